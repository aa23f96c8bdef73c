#!/usr/bin/env python3
"""Driver work per training step of a fine-tuning trace, replayed through glake-replay.

bench/torch/finetune.py draws every step's sequence length from one seed, and each step begins by
allocating its token ids: BATCH x length int64 values, 64 x length bytes (rounded up to 512 in
traces PyTorch's allocator recorded). The trace is cut at the first such request of each step, in
order; every prefix is replayed with one configuration (`glake` unless --allocator says otherwise),
and a step's figures are the differences between the prefix that ends before it and the one that
ends after it. Steps 1-2 are warm-up; finetune.py's step time is the median of steps 3..N.

    python3 tools/analysis/replay_steps.py build/release/tools/glake-replay traces/opt1.3b-N-fsdp2-rank0.trace.gz
    python3 tools/analysis/replay_steps.py REPLAY TRACE... [--glake-conf max_handle:16MiB] [--allocator NAME]

Prints one row per trace: driver calls and modeled driver milliseconds (H100 latencies,
tools/replay/latency.hpp) per step, then the sums over the steps longer than the first (6-7 with
the seed's lengths: where memory grows) and over the steps after them (8-N), and stitches, repairs and grows in the late steps. Exits 1 when a trace cannot be cut (it
holds no token-id request for some step: another seed or step count), 2 when a replay fails.
"""
import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "bench", "torch"))
from finetune import BATCH, sequence_lengths  # noqa: E402  (standard library only at import)

ID_BYTES = 8  # int64 token ids


def new_memory_steps(lengths):
    """The steps after the first that are longer than it (numbered from 1): where a run needs
    memory its first step did not. With the seed's lengths, 6 and 7 (996 and 890 tokens, after
    860)."""
    return [k for k, n in enumerate(lengths[1:], 2) if n > lengths[0]]


def read_lines(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return f.readlines()


def step_starts(lines, lengths, granule=512):
    """Line index of each step's first token-id request, or None when the trace lacks one.
    Exact sizes are tried first (glake's own traces), then sizes rounded up to `granule` (PyTorch's)."""
    for rounding in (1, granule):
        wanted = [-(-BATCH * ID_BYTES * n // rounding) * rounding for n in lengths]
        starts, k = [], 0
        for i, line in enumerate(lines):
            if k == len(wanted):
                break
            if line.startswith("a,") and line.split(",")[2] == str(wanted[k]):
                starts.append(i)
                k += 1
        if k == len(wanted):
            return starts
    return None


class ReplayError(RuntimeError):
    pass


def replay(binary, path, allocator, conf):
    command = [binary, "--quiet", "--json", "-a", allocator, path]
    if conf:
        command += ["--glake-conf", conf]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise ReplayError(f"{' '.join(command)} exited with {done.returncode}: {done.stderr.strip()}")
    return json.loads(done.stdout)


def per_step(results):
    """Differences between consecutive prefix results: one dict per step."""
    steps = []
    for before, after in zip(results, results[1:]):
        steps.append(dict(
            calls=sum(after["driver_calls"].values()) - sum(before["driver_calls"].values()),
            ms=(after["modeled_driver_us"] - before["modeled_driver_us"]) / 1000,
            stitches=after.get("stitches", 0) - before.get("stitches", 0),
            repairs=after.get("stitch_repairs", 0) - before.get("stitch_repairs", 0),
            grows=after.get("stitch_grows", 0) - before.get("stitch_grows", 0),
        ))
    return steps


def trace_steps(binary, trace, lengths, allocator="glake", conf=None):
    """(per-step figures, the whole trace's replay result), or None when the trace cannot be cut."""
    lines = read_lines(trace)
    starts = step_starts(lines, lengths)
    if starts is None:
        return None
    results = []
    with tempfile.TemporaryDirectory() as directory:
        # The first prefix, the model's set-up, is no step's.
        for n, end in enumerate(starts + [len(lines)]):
            path = os.path.join(directory, f"prefix{n}.trace")
            with open(path, "w") as f:
                f.writelines(lines[:end])
            results.append(replay(binary, path, allocator, conf))
    return per_step(results), results[-1]


def summary(name, steps, whole, lengths):
    per = " ".join(f"{s['calls']}/{s['ms']:.1f}" for s in steps)
    head = (f"{name}: util {whole['utilization']:.4f}, peak reserved {whole['peak_reserved_bytes'] / 2**30:.3f} GiB\n"
            f"  calls/ms per step: {per}\n")
    grown = new_memory_steps(lengths)
    if not grown:
        return head + "  no step is longer than the first"
    late = steps[grown[-1]:]
    new_max = [steps[k - 1] for k in grown]
    return (head + f"  steps {grown[0]}-{grown[-1]}: {sum(s['ms'] for s in new_max):.1f} ms; "
            f"steps {grown[-1] + 1}-{len(steps)}: {sum(s['ms'] for s in late):.1f} ms, "
            f"{sum(s['calls'] for s in late)} calls, {sum(s['stitches'] for s in late)} stitches, "
            f"{sum(s['repairs'] for s in late)} repairs, {sum(s['grows'] for s in late)} grows")


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("replay", help="the glake-replay binary")
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--allocator", default="glake", help="glake-replay configuration (default glake)")
    parser.add_argument("--glake-conf", help="settings over glake's, as glake-replay --glake-conf")
    parser.add_argument("--steps", type=int, default=14, help="steps the run made (default 14)")
    args = parser.parse_args(argv)
    lengths = sequence_lengths(args.steps)
    status = 0
    for trace in args.traces:
        name = os.path.basename(trace).split(".trace")[0]
        try:
            got = trace_steps(args.replay, trace, lengths, args.allocator, args.glake_conf)
        except (OSError, ReplayError) as e:
            print(f"{name}: {e}", file=sys.stderr)
            return 2
        if got is None:
            print(f"{name}: no token-id request for every step (not a finetune.py trace with this seed)")
            status = 1
            continue
        print(summary(name, *got, lengths))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
