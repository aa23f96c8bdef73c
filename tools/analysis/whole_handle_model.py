#!/usr/bin/env python3
"""A rejected design, kept so its numbers can be rerun: every allocation is a cached mapping of
whole power-of-two handles that are never split. Run from the repository root:

    python3 tools/analysis/whole_handle_model.py

It prints utilization (requests over 1 MiB only), modeled driver time and handle/mapping counts per
trace; bench/results/replay.md quotes them.
"""
# Model: physical memory = whole handles of 2 MiB x 2^k (<= MAXH); a handle belongs wholly to one
# allocation (never split). A request R (rounded to 2 MiB) takes free handles largest-first that fit
# under the need, then, if short, the smallest free handle covering the rest when its waste is small,
# else new handles (binary decomposition of the shortfall). Every allocation is a mapping of its
# handles; mappings are cached by handle tuple (a hit costs nothing). Small requests (<= 1 MiB) are
# ignored (they live in a small pool). Cost model: H100 medians.
import bisect
import collections
import gzip
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
G = 2 << 20
CREATE, MAP, SA1, SAN = 11.81, 1.11, 30.74, 21.78
def run(path, maxh, waste_frac, train_s):
    free = collections.defaultdict(list)   # size -> list of handle ids
    size_of = {}; nid = 0
    reserved = peak_res = active = peak_act = 0
    live = {}; cache = set(); cost = 0.0
    nmap = 0
    def new_handles(need):
        nonlocal nid, reserved, peak_res, cost
        out = []
        k = maxh
        while need > 0:
            while k > need: k //= 2
            if k < G: k = G
            out.append(nid); size_of[nid] = k; nid += 1; reserved += k; need -= k
            cost += CREATE
        peak_res = max(peak_res, reserved)
        return out
    for line in gzip.open(path, 'rt'):
        p = line.rstrip().split(',')
        if p[0] == 'a':
            n = int(p[2])
            if n <= 1 << 20: continue
            R = -(-n // G) * G
            need = R; got = []
            sizes = sorted(s for s in free if free[s])
            # largest free handles not exceeding the need
            while need > 0:
                sizes = [s for s in sizes if free[s]]
                i = bisect.bisect_right(sizes, need) - 1
                if i < 0: break
                s = sizes[i]; got.append(free[s].pop()); need -= s
            if need > 0:
                sizes = [s for s in sorted(free) if free[s]]
                i = bisect.bisect_left(sizes, need)
                if i < len(sizes) and sizes[i] - need <= waste_frac * R:
                    got.append(free[sizes[i]].pop()); need = 0
            if need > 0:
                got += new_handles(need)
            key = tuple(sorted(got))
            if key not in cache:
                cache.add(key); nmap += len(key)
                cost += len(key) * MAP + SA1 + (len(key) - 1) * SAN
            live[p[1]] = (got, n); active += n; peak_act = max(peak_act, active)
        elif p[0] == 'f':
            if p[1] in live:
                got, n = live.pop(p[1]); active -= n
                for h in got: free[size_of[h]].append(h)
    return peak_act, peak_res, cost, nid, nmap
traces = [('opt1.3b-N', 2.73), ('opt1.3b-R', 4.102), ('opt1.3b-LR', 3.99), ('llama1b-LR', 3.556)]
for maxh_mib, wf in [(1024, 0.0), (1024, 0.05), (256, 0.05), (64, 0.05), (1024, 0.125)]:
    print(f"max handle {maxh_mib} MiB, waste <= {wf:.0%}")
    for t, sec in traces:
        a, r, c, h, m = run(os.path.join(ROOT, 'traces', f'{t}.trace.gz'), maxh_mib << 20, wf, sec)
        print(f"  {t:11s} util {a/r:.4f} (large only)  drv {c/1000:7.1f} ms = {100*c/1e6/sec:6.2f}%  handles {h} mapped {m}")
