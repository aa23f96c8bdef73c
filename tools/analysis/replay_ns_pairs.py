#!/usr/bin/env python3
"""Host time per operation of glake against the pytorch-default emulation, as paired replays.
Run from the repository root:

    python3 tools/analysis/replay_ns_pairs.py build/rel/tools/glake-replay traces/*.trace.gz
    python3 tools/analysis/replay_ns_pairs.py --runs 7 --copies 3 --cpu 1 REPLAY TRACE...

Single replays vary by +-30% on a shared host, whose speed changes in phases. So each run is one
glake-replay process given the trace `--copies` times and both configurations, the order of the
configurations alternating from run to run; each copy gives one pair (glake's ns/op over the
default's, replayed one after the other on the same parsed trace). With `--cpu K` the process is
pinned to CPU K (taskset). Per trace: both configurations' median ns/op, the pairs' median ratio
and quartiles, glake's largest ns/op, and whether the targets hold (ratio at most 1.5, no glake
run over 1000 ns/op). Exits 1 when any trace misses them.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

TARGET_RATIO = 1.5
TARGET_NS = 1000.0


def pairs(replay, trace, runs, copies, cpu, capacity):
    """(glake ns/op, default ns/op) per copy of every run."""
    found = []
    for run in range(runs):
        order = "glake,pytorch-default" if run % 2 == 0 else "pytorch-default,glake"
        command = [replay, "--quiet", "--json", "-a", order, "--capacity", capacity] + [trace] * copies
        if cpu is not None:
            command = ["taskset", "-c", str(cpu)] + command
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        records = [json.loads(line) for line in out.splitlines() if line.strip()]
        if len(records) != 2 * copies:
            raise SystemExit(f"{trace}: expected {2 * copies} records, got {len(records)}")
        for k in range(0, len(records), 2):
            by = {r["allocator"]: r["host_ns_per_operation"] for r in records[k:k + 2]}
            found.append((by["glake"], by["pytorch-default"]))
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("replay", help="the glake-replay executable")
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--runs", type=int, default=7, help="processes per trace (default 7)")
    parser.add_argument("--copies", type=int, default=3, help="copies of the trace per process (default 3)")
    parser.add_argument("--cpu", type=int, default=None, help="pin each process to this CPU")
    parser.add_argument("--capacity", default="140GiB")
    args = parser.parse_args()
    if args.runs < 1 or args.copies < 1:
        parser.error("--runs and --copies must be at least 1")
    missed = 0
    print(f"{'trace':<24} {'glake ns/op':>11} {'default':>8} {'ratio':>6} {'quartiles':>11} {'glake max':>9}  n  targets")
    for trace in args.traces:
        found = pairs(args.replay, trace, args.runs, args.copies, args.cpu, args.capacity)
        ratios = sorted(g / d for g, d in found)
        glake = [g for g, _ in found]
        ratio = statistics.median(ratios)
        ok = ratio <= TARGET_RATIO and max(glake) <= TARGET_NS
        missed += not ok
        name = os.path.basename(trace).split(".trace")[0]
        print(f"{name:<24} {statistics.median(glake):>11.1f} {statistics.median(d for _, d in found):>8.1f} "
              f"{ratio:>6.3f} {ratios[len(ratios) // 4]:>5.2f}-{ratios[3 * len(ratios) // 4]:<5.2f} "
              f"{max(glake):>9.0f} {len(ratios):>2}  {'met' if ok else 'missed'}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
