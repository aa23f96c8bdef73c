#!/usr/bin/env python3
"""The allocator's own share of each training step under PyTorch's default allocator and under
glake, from finetune.py runs made with --allocator-timing, and the step-time ratio it implies.
Run from the repository root:

    python3 tools/analysis/allocator_share.py bench/results/finetune_single.jsonl
    python3 tools/analysis/allocator_share.py --per-step bench/results/finetune_fsdp.jsonl

--allocator-timing wraps whichever allocator runs (PyTorch's native one, or glake behind the
pluggable interface, PyTorch's wrapper included) and times its allocations and frees on the host.
A share is a ratio within one process, so the host's speed, which swings by 2x in phases of
seconds on the GPU machines measured (bench/results/finetune.md), cancels out of it; a step-time ratio between two processes does not.

Per workload (finished runs; under FSDP each rank is a workload of its own), over steps 3..N (the steps of the median step time), and
per allocator with all its runs pooled by step index: the median share of a step spent in the
allocator, and its host time per call (median over steps). Then, step by step (the runs see the
same sequence lengths in the same order):

    implied ratio r_k = (1 - s_default,k) / (1 - s_glake,k)

which is what glake's step k would take against the default's if everything outside the
allocator's calls cost the same under both. The table gives the median r_k and the largest, and
how many steps have r_k above 1.02 (the steps where glake maps new memory).

The target is on the median step, and on these machines which step is the median is decided by
the host's speed during the run more than by the step's length. So each finished default run of
the workload in the files given (timed or not, same sequence lengths) serves as one observed
realisation of the host: its steps D_k become glake's implied steps D_k * r_k, and

    implied ratio = median_k(D_k * r_k) / median_k(D_k)

is the target's quantity for that realisation with the host's speed taken out. The table gives
the median of the implied ratio over the realisations, the largest, and how many exceed 1.02.
What this leaves out is stated in bench/results/finetune.md: effects outside the calls (caches
the calls evict, GPU work waiting on a driver call).

Options (before or after the files):
    --per-step       also print each workload's r_k, step by step
    --neutral K,...  take r_k = 1 for these steps (numbered from 1) in the implied ratios: what
                     the target's quantity would be if glake cost no more than the default there
    --glake-less-ms X  take X ms off glake's allocator time in every step (never below 0): what
                     the target's quantity would be if each glake call cost that much less in all
                     (an estimate for a change measured elsewhere, e.g. a cheaper event interval
                     measured on one GPU, applied to two-GPU runs)
    --defaults-only FILE...  more results of which only the default runs are used: earlier runs as
                     host realisations, without another allocator version's glake runs
"""
import argparse
import json
import os
import statistics
import sys

from steptime_pairs import TARGET  # same folder: the script's own directory is on sys.path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "bench", "torch"))
from finetune import fsdp_label, step_list  # noqa: E402  (standard library only at import)


def step_shares(run, less_ms=0.0):
    """{step index: (share of the step in the allocator, ns per call)} for steps 3..N of one run,
    with `less_ms` taken off each step's allocator time (never below 0)."""
    times, calls = run.get("step_times_s") or [], run.get("step_allocator_calls") or []
    ms = [max(0.0, x - less_ms) for x in run.get("step_allocator_ms") or []]
    n = min(len(times), len(ms), len(calls))
    return {k: (ms[k] / 1e3 / times[k], ms[k] * 1e6 / calls[k] if calls[k] else None)
            for k in range(2, n) if times[k] > 0}


def mean_step_times(runs):
    """{step index: mean step seconds} over the runs' steps 3..N."""
    by_step = {}
    for run in runs:
        for k, t in enumerate(run.get("step_times_s") or []):
            if k >= 2:
                by_step.setdefault(k, []).append(t)
    return {k: statistics.fmean(v) for k, v in by_step.items()}


def pooled(runs, less_ms=0.0):
    """{step index: (mean share, mean ns per call)} over the runs' steps 3..N."""
    by_step = {}
    for run in runs:
        for k, value in step_shares(run, less_ms).items():
            by_step.setdefault(k, []).append(value)
    out = {}
    for k, values in by_step.items():
        per_call = [v for _, v in values if v is not None]
        out[k] = (statistics.fmean(s for s, _ in values), statistics.fmean(per_call) if per_call else None)
    return out


def compare(default_runs, glake_runs, realisations=None, neutral=(), glake_less_ms=0.0):
    """The figures of one workload, or None when either allocator has no timed steps. Steps in
    `neutral` (numbered from 1) count with r = 1 in the implied ratios; `glake_less_ms` is taken
    off each of glake's steps (step_shares' less_ms)."""
    d, g = pooled(default_runs), pooled(glake_runs, glake_less_ms)
    steps = sorted(set(d) & set(g))
    if not steps:
        return None
    ratios = [(1 - d[k][0]) / (1 - g[k][0]) for k in steps]
    used = [1.0 if k + 1 in neutral else r for k, r in zip(steps, ratios)]
    implied = []
    for run in realisations or default_runs:
        times = run.get("step_times_s") or []
        pairs = [(times[k], r) for k, r in zip(steps, used) if k < len(times)]
        if pairs:
            implied.append(statistics.median(t * r for t, r in pairs) / statistics.median(t for t, _ in pairs))

    def per_call(p):
        values = [p[k][1] for k in steps if p[k][1] is not None]
        return statistics.median(values) if values else None

    return dict(
        default_share=statistics.median(d[k][0] for k in steps), glake_share=statistics.median(g[k][0] for k in steps),
        default_ns_per_call=per_call(d), glake_ns_per_call=per_call(g),
        ratio_median=statistics.median(ratios), ratio_max=max(ratios), steps=len(steps),
        steps_over=sum(r > TARGET for r in ratios), implied=implied,
        runs=(len(default_runs), len(glake_runs)), per_step={k + 1: r for k, r in zip(steps, ratios)},
    )


def workload(run):
    """The row a run belongs to: "opt1.3b N", or "opt1.3b N FSDP rank 1" for a rank of an FSDP run
    ("opt1.3b N FSDP, fake world 2 rank 0" for finetune.py --fake-world)."""
    name = f"{run['model']} {run['strategy']}"
    label = fsdp_label(run)
    return f"{name} {label} rank {run.get('rank', 0)}" if label else name


def load(paths, defaults_only=()):
    """{workload: {allocator: [runs]}} of the finished runs with allocator timing, and
    {workload: [runs]} of all finished default runs (the host realisations).
    Files in `defaults_only` give their default runs alone: earlier runs as host conditions and as
    the default side, without another allocator version's glake runs."""
    workloads, defaults = {}, {}
    sources = [(path, False) for path in paths] + [(path, True) for path in defaults_only if path not in paths]
    for path, only_defaults in sources:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if r.get("status") != "ok":
                    continue
                if only_defaults and r.get("allocator") != "default":
                    continue
                key = workload(r)
                if r.get("allocator") == "default":
                    defaults.setdefault(key, []).append(r)
                if "step_allocator_ms" in r:
                    workloads.setdefault(key, {}).setdefault(r["allocator"], []).append(r)
    return workloads, defaults


def main(argv):
    parser = argparse.ArgumentParser(description="The allocator's share of each step and the step-time ratio it "
                                     "implies (see the module's docstring).")
    parser.add_argument("files", nargs="+", help="finetune.py JSONL results")
    parser.add_argument("--per-step", action="store_true", help="also print each workload's r_k, step by step")
    parser.add_argument("--neutral", type=step_list, default=(), metavar="K,...",
                        help="take r_k = 1 for these steps (numbered from 1) in the implied ratios")
    parser.add_argument("--glake-less-ms", type=float, default=0.0, metavar="X",
                        help="take X ms off glake's allocator time in every step (an estimate, never below 0)")
    parser.add_argument("--defaults-only", nargs="+", default=[], metavar="FILE",
                        help="more JSONL results of which only the default runs are used (earlier "
                        "allocator versions' files, for their host realisations)")
    args = parser.parse_args(argv)
    if args.glake_less_ms < 0:
        parser.error("--glake-less-ms must be >= 0")
    if args.glake_less_ms:
        print(f"Estimate: {args.glake_less_ms:g} ms taken off glake's allocator time in every step.\n")
    if args.neutral:
        print(f"Implied ratios with r = 1 in steps {', '.join(map(str, args.neutral))}.\n")
    print("| workload | runs (default, glake) | share of a step in the allocator: default | glake "
          "| ns per call: default | glake | per-step ratio r: median | largest | steps over 1.02 "
          "| host realisations | implied ratio of median steps: median | largest | over 1.02 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    workloads, defaults = load(args.files, args.defaults_only)
    steps_of = {}
    for name, by_allocator in workloads.items():
        timed = by_allocator.get("default", []) + by_allocator.get("glake", [])
        lengths = timed[0].get("seq_lengths") if timed else None
        same = [r for r in defaults.get(name, []) if r.get("seq_lengths") == lengths]
        c = compare(by_allocator.get("default", []), by_allocator.get("glake", []), same, args.neutral,
                    args.glake_less_ms)
        if c is None:
            continue
        steps_of[name] = c["per_step"]

        def ns(v):
            return f"{v:.0f}" if v is not None else "-"

        print(f"| {name} | {c['runs'][0]}, {c['runs'][1]} | {100 * c['default_share']:.2f}% | "
              f"{100 * c['glake_share']:.2f}% | {ns(c['default_ns_per_call'])} | {ns(c['glake_ns_per_call'])} | "
              f"{c['ratio_median']:.4f} | {c['ratio_max']:.4f} | {c['steps_over']} of {c['steps']} | "
              f"{len(c['implied'])} | {statistics.median(c['implied']):.4f} | {max(c['implied']):.4f} | "
              f"{sum(x > TARGET for x in c['implied'])} |")
    if args.per_step and steps_of:
        numbers = sorted({k for r in steps_of.values() for k in r})
        print("\n| workload | " + " | ".join(f"r, step {k}" for k in numbers) + " |")
        print("|---|" + "---|" * len(numbers))
        for name, r in steps_of.items():
            print(f"| {name} | " + " | ".join(f"{r[k]:.3f}" if k in r else "-" for k in numbers) + " |")
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1:]))
