#!/usr/bin/env python3
"""How fast this machine's CPUs run a fixed Python loop, CPU by CPU and over time.

On the lent GPU machines (KVM guests) a CPU runs the same loop at full speed or at about half of
it, and which CPUs are slow changes within seconds (bench/results/finetune.md, session 9): the
per-process scatter of host-bound step times. This prints, without a GPU:

  - the machine's CPU facts (cgroup limits, clock, load, busiest processes);
  - per round, the loop's median time on each CPU in turn (pinned);
  - unpinned for --seconds: the share of loops that ran slow, and on which CPU;
  - the loop on the first CPU while a busy process spins on each other CPU in turn (a fixed
    hidden sibling would slow it for one partner only).

  python3 bench/host_speed.py [--rounds N] [--seconds S]
"""
import argparse
import collections
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch"))
# The loop finetune.py --host-probe times after every step, and the CPU a thread ran on.
from finetune import current_cpu, python_loop_seconds as loop  # noqa: E402

SLOW_MS = 0.5  # between the fast (~0.38 ms) and slow (~0.70 ms) modes seen on the H100 machines


def show(command):
    try:
        out = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=20).stdout.rstrip()
    except (OSError, subprocess.SubprocessError) as error:
        out = f"({error})"
    print(f"$ {command}\n{out}")


def spin(cpu):
    os.sched_setaffinity(0, {cpu})
    while True:
        pass


def median_ms(samples=30):
    return statistics.median(loop() for _ in range(samples)) * 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="pinned rounds over all CPUs (default 3)")
    parser.add_argument("--seconds", type=float, default=3.0, help="unpinned sampling time (default 3)")
    parser.add_argument("--no-facts", action="store_true", help="skip the machine facts")
    args = parser.parse_args(argv)
    if not args.no_facts:
        for command in ("cat /sys/fs/cgroup/cpu.max", "grep -m1 'model name' /proc/cpuinfo",
                        "grep MHz /proc/cpuinfo | sort | uniq -c", "cat /proc/loadavg",
                        "ps -eo pid,pcpu,nlwp,psr,comm --sort=-pcpu | head -8"):
            show(command)
    cpus = sorted(os.sched_getaffinity(0))
    try:
        for r in range(args.rounds):
            row = []
            for c in cpus:
                os.sched_setaffinity(0, {c})
                row.append(median_ms())
            print(f"round {r}: " + " ".join(f"{c}:{x:.2f}" for c, x in zip(cpus, row)), flush=True)
        os.sched_setaffinity(0, set(cpus))
        seen = []
        end = time.time() + args.seconds
        while time.time() < end:
            seen.append((loop() * 1e3, current_cpu()))
        slow = sum(1 for ms, _ in seen if ms > SLOW_MS)
        print(f"unpinned: {len(seen)} loops, slow (>{SLOW_MS} ms) share {slow / len(seen):.3f}")
        by = collections.defaultdict(list)
        for ms, c in seen:
            by[c].append(ms)
        print("by cpu: " + " ".join(f"{c}:{len(v)}x{statistics.median(v):.2f}" for c, v in sorted(by.items())))
        partners = []
        for k in cpus[1:]:
            busy = multiprocessing.Process(target=spin, args=(k,), daemon=True)
            busy.start()
            time.sleep(0.05)
            os.sched_setaffinity(0, {cpus[0]})
            partners.append((k, median_ms(40)))
            busy.kill()
            busy.join()
        os.sched_setaffinity(0, {cpus[0]})
        alone = median_ms(40)
        print(f"cpu {cpus[0]} alone {alone:.2f}; with a spinner on: " + " ".join(f"{k}:{ms:.2f}" for k, ms in partners))
    finally:
        os.sched_setaffinity(0, set(cpus))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
