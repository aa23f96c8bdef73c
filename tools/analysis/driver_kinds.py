#!/usr/bin/env python3
"""glake's driver calls by kind, per training step, from finetune.py runs that recorded them
(step_driver_kind_calls / step_driver_kind_ms: the plug-in's driver_<kind> and driver_<kind>_ns).
Run from the repository root:

    python3 tools/analysis/driver_kinds.py bench/results/finetune_fsdp.jsonl

Per workload (FSDP ranks pooled), over its finished glake runs:
- memory: utilization and peak reserved (smallest-largest), and the driver calls of steps 3..N
  (median over the runs);
- each step with driver calls: the median driver calls and allocator milliseconds (when the runs
  were timed with --allocator-timing), the median calls / milliseconds of each kind, and cuMemSetAccess's cost
  per handle mapped in that step (its milliseconds over the step's cuMemMap calls, for steps
  that map more than 20 handles): median and range over the runs;
- each kind's cost per call over all steps (total milliseconds over total calls).
Runs without per-kind figures (before a837dda) count in the memory line and the steps' calls and
allocator milliseconds.
"""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "bench", "torch"))
from finetune import fsdp_label  # noqa: E402  (standard library only at import)

MIN_MAPS = 20  # fewer maps in a step make set-access per handle mostly the call's fixed cost


def workload(run):
    label = fsdp_label(run)
    return f"{run['model']} {run['strategy']}" + (f" {label}" if label else "")


def load(paths):
    """{workload: [finished glake runs]} in the order met."""
    out = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                run = json.loads(line)
                if run.get("allocator") == "glake" and run.get("status") == "ok":
                    out.setdefault(workload(run), []).append(run)
    return out


def step_rows(runs):
    """[(step number, {figure: value})] for the steps where any run called the driver: the median
    driver calls and allocator milliseconds over all runs, the kinds over those that have them."""
    runs = [r for r in runs if r.get("step_driver_calls")]
    if not runs:
        return []
    kinds = [r for r in runs if r.get("step_driver_kind_calls")]
    names = sorted({k for r in kinds for k in r["step_driver_kind_calls"]})
    steps = min(len(r["step_driver_calls"]) for r in runs)
    rows = []
    for k in range(steps):
        if not any(r["step_driver_calls"][k] for r in runs):
            continue
        row = {"driver calls": statistics.median(r["step_driver_calls"][k] for r in runs)}
        timed = [r["step_allocator_ms"][k] for r in runs if len(r.get("step_allocator_ms") or []) > k]
        if timed:
            row["allocator ms"] = statistics.median(timed)
        for name in names:
            calls = [r["step_driver_kind_calls"].get(name, [0] * steps)[k] for r in kinds]
            ms = [r["step_driver_kind_ms"].get(name, [0.0] * steps)[k] for r in kinds]
            row[name] = (statistics.median(calls), statistics.median(ms))
        per_handle = [r["step_driver_kind_ms"]["set_access"][k] * 1000 / r["step_driver_kind_calls"]["map"][k]
                      for r in kinds if "set_access" in r["step_driver_kind_ms"] and "map" in r["step_driver_kind_calls"]
                      and r["step_driver_kind_calls"]["map"][k] > MIN_MAPS]
        if per_handle:
            row["set_access us per handle"] = (statistics.median(per_handle), min(per_handle), max(per_handle))
        rows.append((k + 1, row))
    return rows


def per_call(runs):
    """{kind: microseconds per call over every step of the runs}."""
    calls, ms = {}, {}
    for r in runs:
        for name, values in (r.get("step_driver_kind_calls") or {}).items():
            calls[name] = calls.get(name, 0) + sum(values)
            ms[name] = ms.get(name, 0.0) + sum(r["step_driver_kind_ms"][name])
    return {name: ms[name] * 1000 / calls[name] for name in calls if calls[name]}


def report(name, runs):
    lines = [f"## {name}: {len(runs)} glake runs"]
    util = [r["utilization"] for r in runs]
    reserved = [r["peak_reserved_bytes"] / 1e9 for r in runs]
    later = [sum(r.get("step_driver_calls", [])[2:]) for r in runs]
    lines.append(f"utilization {min(util):.4f}-{max(util):.4f}, reserved {min(reserved):.2f}-{max(reserved):.2f} GB, "
                 f"driver calls in steps 3..N {statistics.median(later):.0f}")
    for step, row in step_rows(runs):
        head = f"step {step}, {row['driver calls']:.0f} driver calls"
        head += f", allocator {row['allocator ms']:.0f} ms" if "allocator ms" in row else ""
        # A kind's entry is (calls, ms); the per-handle figure is a triple and follows below.
        parts = [f"{k} {v[0]:.0f}/{v[1]:.1f} ms" for k, v in row.items()
                 if isinstance(v, tuple) and len(v) == 2 and round(v[0])]
        if "set_access us per handle" in row:
            mid, low, high = row["set_access us per handle"]
            parts.append(f"set_access per handle {mid:.0f} us ({low:.0f}-{high:.0f})")
        lines.append(f"  {head}" + (": " + " | ".join(parts) if parts else ""))
    costs = per_call(runs)
    if costs:
        lines.append("per call: " + ", ".join(f"{k} {v:.1f} us" for k, v in sorted(costs.items())))
    return "\n".join(lines)


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    for name, runs in load(argv).items():
        print(report(name, runs))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
