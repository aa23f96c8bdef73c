#!/usr/bin/env python3
"""Step-time pairs of default and glake from finetune.py's JSONL output, for runs made with
`finetune.py --allocators default,glake --repeat N` (allocator order reversed every other round).
Run from the repository root:

    python3 tools/analysis/steptime_pairs.py results.jsonl

Per workload: each run's median step, the pair ratios (glake / default, runs paired in order),
glake's mean over default's mean, how many of steps 3..N made driver calls and how many calls,
and the median per-step ratio over steps where glake made none; the pairs' geometric mean with
its 95% interval (Student's t over the log ratios) and what that says of the 1.02 target: "met"
when the whole interval lies at or below it, "missed" when above, else "open". Then the median,
geometric mean, interval and verdict of all pair ratios pooled; and, over the pairs whose runs
ran with --host-probe, the ratio at equal host speed: the intercept of a least-squares line
through (glake's share of slow probes minus default's, log ratio), a probe being slow when its
Python loop took over 0.5 ms (the GPU machines measured ran it in ~0.38 or ~0.70 ms;
bench/results/finetune.md, "How measured", says why pairs decide little there).

finetune.py's tables use ratio_interval and verdict for repeated runs; allocator_share.py uses
TARGET.
"""
import collections
import json
import math
import statistics
import sys


def runs_by_workload(paths):
    """The rank-0 runs that finished, as {(model, strategy): {allocator: [run, ...]}}, each list in
    file order (so default and glake runs pair by position)."""
    by = collections.defaultdict(lambda: collections.defaultdict(list))
    for path in paths:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if r.get("status") == "ok" and r.get("rank", 0) == 0:
                    by[(r["model"], r["strategy"])][r["allocator"]].append(r)
    return by


# Two-sided 95% quantiles of Student's t by degrees of freedom (1..30); the normal's beyond.
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
       2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
       2.045, 2.042)
TARGET = 1.02


def ratio_interval(ratios):
    """Geometric mean of the ratios and its 95% interval; the interval is None for one ratio."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.mean(logs)
    if len(logs) < 2:
        return math.exp(mean), None
    half = (T95[len(logs) - 2] if len(logs) - 1 <= len(T95) else 1.960) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), (math.exp(mean - half), math.exp(mean + half))


SLOW_PROBE_S = 0.5e-3


def slow_share(run, threshold=SLOW_PROBE_S):
    """The share of steps 3..N whose host probe's Python loop ran slow, or None without probes."""
    loops = ((run.get("step_probe_s") or {}).get("python") or [])[2:]
    return sum(1 for t in loops if t > threshold) / len(loops) if loops else None


def host_adjusted(points):
    """Least squares through (slow-share difference, log ratio) points: the ratio at equal host
    speed (exp of the intercept), the slope, the correlation, and the residuals' and the log
    ratios' standard deviations. None for fewer than 3 points or no spread in host speed."""
    if len(points) < 3:
        return None
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    intercept = my - slope * mx
    residuals = [y - intercept - slope * x for x, y in points]
    syy = sum((y - my) ** 2 for y in ys)
    corr = slope * math.sqrt(sxx / syy) if syy > 0 else float("nan")
    return dict(ratio=math.exp(intercept), slope=slope, corr=corr, sd_residual=statistics.stdev(residuals),
                sd_raw=statistics.stdev(ys))


def verdict(interval, target=TARGET):
    if interval is None:
        return "open"
    low, high = interval
    return "met" if high <= target else "missed" if low > target else "open"


def main(paths):
    by = runs_by_workload(paths)
    ratios, probed = [], []
    for (model, strategy), runs in sorted(by.items()):
        d, g = runs["default"], runs["glake"]
        if not d or not g:
            continue
        pairs = [x["median_step_s"] / y["median_step_s"] for x, y in zip(g, d)]
        ratios += pairs
        for x, y, ratio in zip(g, d, pairs):
            if slow_share(x) is not None and slow_share(y) is not None:
                probed.append((slow_share(x) - slow_share(y), math.log(ratio)))
        quiet_g, quiet_d = [], []
        for x, y in zip(g, d):
            calls = x.get("step_driver_calls") or []
            for i in range(2, min(len(calls), len(y["step_times_s"]))):
                if calls[i] == 0:
                    quiet_g.append(x["step_times_s"][i])
                    quiet_d.append(y["step_times_s"][i])
        means = statistics.mean(r["median_step_s"] for r in g) / statistics.mean(r["median_step_s"] for r in d)
        busy = [sum(1 for c in (x.get("step_driver_calls") or [])[2:] if c) for x in g]
        calls = [sum((x.get("step_driver_calls") or [])[2:]) for x in g]
        quiet = statistics.median(quiet_g) / statistics.median(quiet_d) if quiet_g else float("nan")
        steps = lambda rs: " ".join(f"{r['median_step_s']:.3f}" for r in rs)  # noqa: E731
        pair_text = " ".join(f"{p:.3f}" for p in pairs)
        print(f"{model:11s} {strategy:3s} default {steps(d):14s} glake {steps(g):14s} pairs {pair_text:12s} "
              f"means {means:.3f}  steps with calls {busy}  calls {calls}  quiet-step ratio {quiet:.3f} (n={len(quiet_g)})")
        geo, interval = ratio_interval(pairs)
        span = f"[{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "[one pair]"
        print(f"{'':15s} {len(pairs)} pairs: geometric mean {geo:.3f}, 95% {span}, target {TARGET}: {verdict(interval)}")
    if ratios:
        geo, interval = ratio_interval(ratios)
        span = f"[{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "[one pair]"
        print(f"{len(ratios)} pairs: median {statistics.median(ratios):.3f}, geometric mean {geo:.3f}, "
              f"95% {span}, target {TARGET}: {verdict(interval)}")
    fit = host_adjusted(probed)
    if fit:
        print(f"{len(probed)} pairs with --host-probe: ratio at equal host speed {fit['ratio']:.3f} "
              f"(raw geometric mean {math.exp(statistics.mean(y for _, y in probed)):.3f}; slope {fit['slope']:.3f} "
              f"per unit of slow-share difference, correlation {fit['corr']:.2f}, sd of log ratios "
              f"{fit['sd_raw']:.3f} -> {fit['sd_residual']:.3f})")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
