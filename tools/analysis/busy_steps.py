#!/usr/bin/env python3
"""Where glake's step time goes, per workload, from finetune.py's JSONL (default and glake runs
paired in order), over steps 3..N: the mean extra time of the new-maximum step (index 5, length
996 with the benchmark's seed), the mean extra time of the other steps in which glake made driver
calls, and the mean ratio of the sums of the steps in which it made none (bench/results/finetune.md,
"Step time after cached stitches grow in place"). Run from the repository root:

    python3 tools/analysis/busy_steps.py bench/results/finetune_steptime_grow.jsonl
"""
import statistics
import sys

from steptime_pairs import runs_by_workload  # same folder: the script's own directory is on sys.path

NEW_MAX = 5


def main(paths):
    by = runs_by_workload(paths)
    for (model, strategy), runs in sorted(by.items()):
        new_max, other, quiet = [], [], []
        for d, g in zip(runs["default"], runs["glake"]):
            calls, dt, gt = g["step_driver_calls"], d["step_times_s"], g["step_times_s"]
            steps = range(2, min(len(calls), len(dt), len(gt)))
            new_max.append((gt[NEW_MAX] - dt[NEW_MAX]) * 1000)
            other.append(sum(gt[i] - dt[i] for i in steps if i != NEW_MAX and calls[i] > 0) * 1000)
            q = [i for i in steps if calls[i] == 0]
            if q:
                quiet.append(sum(gt[i] for i in q) / sum(dt[i] for i in q))
        busy = sum(1 for i in range(2, len(calls)) if i != NEW_MAX and calls[i] > 0)
        quiet_text = f"{statistics.mean(quiet):.3f}" if quiet else "-"
        print(f"{model:11s} {strategy:3s} pairs {len(new_max)}  new-maximum step {statistics.mean(new_max):+5.0f} ms  "
              f"other steps with calls ({busy}) {statistics.mean(other):+5.0f} ms  quiet-step sum ratio {quiet_text}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
