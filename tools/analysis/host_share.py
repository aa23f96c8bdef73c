#!/usr/bin/env python3
"""glake's own host time per training step, from finetune.py runs made with --glake-host-timing
(bench/results/finetune.md, session 9). Run from the repository root:

    python3 tools/analysis/host_share.py bench/results/finetune_s9_hosttime.jsonl

Per glake run (rank 0, finished), over steps 3..N: the median step; the median and largest host
time inside glake's calls per step (driver calls included, GLAKE_HOST_TIMING's own clock reads
too); its median share of the step, over all steps and over steps without driver calls; that
time per allocator call in those quiet steps (a lower bound: the run's calls, model building
included, spread evenly over its steps); and how much the median step falls when each step's
glake time is taken out of it. That last figure bounds what glake can add to a step where all
other work is the same under both allocators, before the default allocator's own time is
subtracted.
"""
import json
import statistics
import sys


def host_share(run):
    """The figures above for one run, or None when it has no per-step glake host time."""
    times, host = run.get("step_times_s") or [], run.get("step_allocator_host_ms") or []
    calls = run.get("step_driver_calls") or []
    n = min(len(times), len(host))
    steps = range(2, n) if n >= 3 else range(n)
    if not steps:
        return None
    t = [times[k] for k in steps]
    h = [host[k] / 1e3 for k in steps]
    quiet = [k for k in steps if k < len(calls) and calls[k] == 0]
    median = statistics.median(t)
    without = statistics.median(a - b for a, b in zip(t, h))
    stats = run.get("glake_stats") or {}
    per_step_calls = (stats.get("allocations", 0) + stats.get("deallocations", 0)) / max(len(times), 1)
    quiet_host = statistics.median(host[k] / 1e3 for k in quiet) if quiet else None
    return dict(
        median_step_s=median,
        host_ms_median=statistics.median(host[k] for k in steps),
        host_ms_max=max(host[k] for k in steps),
        share=statistics.median(b / a for a, b in zip(t, h)),
        quiet_share=statistics.median(host[k] / 1e3 / times[k] for k in quiet) if quiet else None,
        quiet_ns_per_call=quiet_host * 1e9 / per_step_calls if quiet_host is not None and per_step_calls else None,
        bound=median / without - 1,
    )


def main(paths):
    print("| workload | median step s | glake host ms per step, median (max) | share of the step, median "
          "| in steps without driver calls | ns per call there (at least) | median step without glake's time |")
    print("|---|---|---|---|---|---|---|")
    for path in paths:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if r.get("allocator") != "glake" or r.get("status") != "ok" or r.get("rank", 0) != 0:
                    continue
                s = host_share(r)
                if s is None:
                    continue
                pct = lambda v: "(none)" if v is None else f"{v * 100:.2f}%"  # noqa: E731
                ns = "-" if s["quiet_ns_per_call"] is None else f"{s['quiet_ns_per_call']:.0f}"
                print(f"| {r['model']} {r['strategy']} | {s['median_step_s']:.3f} | {s['host_ms_median']:.2f} "
                      f"({s['host_ms_max']:.1f}) | {pct(s['share'])} | {pct(s['quiet_share'])} | {ns} | -{s['bound'] * 100:.1f}% |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
