#!/usr/bin/env python3
"""Where a training step's time goes, from the Chrome traces that finetune.py --profile-steps writes
(torch.profiler, CPU and CUDA activities). Run from the repository root:

    python3 tools/analysis/profile_steps.py TRACE.json.gz [TRACE.json.gz ...]

Per trace, all times in ms:
  span        first host event to the end of the last GPU activity
  gpu busy    union of kernels, copies and memsets; gpu idle = span - busy
  kernels     count and summed duration
  host ops    per host thread: time inside top-level operators (cpu_op), and their count
  runtime     CUDA runtime and driver calls by name: count and summed duration
With two or more traces, the operators whose self time (own time less their children's, per
thread) differs most between the first trace and each other one are listed too.
"""
import collections
import gzip
import json
import sys

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
API_CATEGORIES = ("cuda_runtime", "cuda_driver")


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]


def union_length(intervals):
    total, end = 0.0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def self_times(ops):
    """Self time of each operator (its duration less that of the operators directly inside it,
    on the same thread), summed by name; and each thread's top-level total and count."""
    by_name = collections.Counter()
    top = collections.defaultdict(lambda: [0.0, 0])
    by_thread = collections.defaultdict(list)
    for e in ops:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for thread, events in by_thread.items():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # [event, time of its direct children]
        for e in events:
            while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
                done, inner = stack.pop()
                by_name[done["name"]] += done["dur"] - inner
            if stack:
                stack[-1][1] += e["dur"]
            else:
                top[thread][0] += e["dur"]
                top[thread][1] += 1
            stack.append([e, 0.0])
        for done, inner in stack:
            by_name[done["name"]] += done["dur"] - inner
    return by_name, dict(top)


def summarize(events):
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    host = [e for e in events if e.get("cat") not in GPU_CATEGORIES]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    start = min(e["ts"] for e in host) if host else min((e["ts"] for e in gpu), default=0.0)
    end = max((e["ts"] + e["dur"] for e in events), default=start)
    busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    api = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") in API_CATEGORIES:
            api[e["name"]][0] += 1
            api[e["name"]][1] += e["dur"]
    own, top = self_times(ops)
    kernels = [e for e in gpu if e.get("cat") == "kernel"]
    return dict(
        span_ms=(end - start) / 1e3, gpu_busy_ms=busy / 1e3, gpu_idle_ms=(end - start - busy) / 1e3,
        kernels=len(kernels), kernel_ms=sum(e["dur"] for e in kernels) / 1e3,
        threads={f"{t[0]}/{t[1]}": (round(v[0] / 1e3, 3), v[1]) for t, v in sorted(top.items(), key=lambda kv: -kv[1][0])},
        api={name: (v[0], round(v[1] / 1e3, 3)) for name, v in sorted(api.items(), key=lambda kv: -kv[1][1])},
        self_ms={name: us / 1e3 for name, us in own.items()},
    )


def report(paths, out=sys.stdout, top=15):
    summaries = [(path, summarize(load(path))) for path in paths]
    for path, s in summaries:
        print(f"== {path}", file=out)
        print(f"span {s['span_ms']:.1f}  gpu busy {s['gpu_busy_ms']:.1f}  idle {s['gpu_idle_ms']:.1f}  "
              f"kernels {s['kernels']} ({s['kernel_ms']:.1f})", file=out)
        for thread, (ms, count) in list(s["threads"].items())[:3]:
            print(f"  host thread {thread}: {ms:.1f} in {count} top-level ops", file=out)
        for name, (count, ms) in list(s["api"].items())[:8]:
            print(f"  {name:32s} {count:7d} {ms:9.2f}", file=out)
    if len(summaries) > 1:
        base_path, base = summaries[0]
        for path, s in summaries[1:]:
            names = set(base["self_ms"]) | set(s["self_ms"])
            diff = sorted(names, key=lambda n: -abs(s["self_ms"].get(n, 0) - base["self_ms"].get(n, 0)))
            print(f"== self time, {path} minus {base_path} (ms)", file=out)
            for n in diff[:top]:
                a, b = base["self_ms"].get(n, 0.0), s["self_ms"].get(n, 0.0)
                print(f"  {b - a:+9.2f}  {a:9.2f} -> {b:9.2f}  {n}", file=out)
    return summaries


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    report(sys.argv[1:])
