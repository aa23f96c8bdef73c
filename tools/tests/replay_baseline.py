#!/usr/bin/env python3
"""Checks that glake-replay's output on every bundled trace equals the committed baseline.

The baseline (tools/tests/replay_baseline.jsonl) holds one JSON object per trace, configuration
and variant: the named configurations at their settings, glake under settings that take other
paths (2 MiB handles, no growth, no stitching, a small stitch cache, ...), and every
configuration on a device too small for the traces (out-of-memory paths). Each object carries
the replay's statistics and a digest of every placement decision, so a change in any decision
shows. Host timing fields are not compared.

    replay_baseline.py GLAKE_REPLAY TRACES_DIR BASELINE           compare, exit 1 on a difference
    replay_baseline.py GLAKE_REPLAY TRACES_DIR BASELINE --update  rewrite the baseline
"""
import json
import pathlib
import re
import subprocess
import sys

# (variant name, extra glake-replay arguments). Variants with --glake-conf replay only "glake".
VARIANTS = [
    ("defaults", []),
    ("small-device", ["--capacity", "6GiB"]),
    ("max_handle:0", ["-a", "glake", "--glake-conf", "max_handle:0"]),
    ("min_handles:2", ["-a", "glake", "--glake-conf", "min_handles:2"]),
    ("grow_stitch:0", ["-a", "glake", "--glake-conf", "grow_stitch:0"]),
    ("stitch_reserve:1", ["-a", "glake", "--glake-conf", "stitch_reserve:1,max_handle:0"]),
    ("auto_gc", ["-a", "glake", "--glake-conf", "auto_gc:1,max_handle:0"]),
    ("defrag_level:2", ["-a", "glake", "--glake-conf", "defrag_level:2,frag_limit:64MiB"]),
    ("stitching:0", ["-a", "glake", "--glake-conf", "stitching:0"]),
    ("glake-small-device", ["-a", "glake", "--capacity", "10GiB", "--glake-conf", "max_handle:0"]),
]
IGNORED = {"host_ns_per_operation"}
# The generation traces (<model>-G<workload>) are large: replayed under "defaults" only, so that
# the check stays within CI's time under the sanitizers.
ALL_TRACES_VARIANTS = {"defaults"}


def is_generation(trace):
    return re.search(r"-G[A-Z]$", trace.name.removesuffix(".trace.gz")) is not None


def run(replay, traces, variant, args):
    rows = []
    for trace in traces:
        if variant not in ALL_TRACES_VARIANTS and is_generation(trace):
            continue
        out = subprocess.run([replay, "--json", "--quiet", *args, str(trace)], check=True,
                             capture_output=True, text=True).stdout
        for line in out.splitlines():
            row = json.loads(line)
            for key in IGNORED:
                row.pop(key, None)
            row["variant"] = variant
            rows.append(row)
    return rows


def key(row):
    return (row["variant"], row["trace"], row["allocator"])


def main(argv):
    if len(argv) not in (4, 5) or (len(argv) == 5 and argv[4] != "--update"):
        print(__doc__, file=sys.stderr)
        return 2
    replay, traces_dir, baseline = argv[1], pathlib.Path(argv[2]), pathlib.Path(argv[3])
    traces = sorted(traces_dir.glob("*.trace.gz"))
    if not traces:
        print(f"replay_baseline: no traces in {traces_dir}", file=sys.stderr)
        return 2
    rows = [row for name, args in VARIANTS for row in run(replay, traces, name, args)]
    if len(argv) == 5:
        baseline.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
        print(f"replay_baseline: wrote {len(rows)} rows to {baseline}")
        return 0
    expected = {key(r): r for r in map(json.loads, baseline.read_text().splitlines())}
    actual = {key(r): r for r in rows}
    differences = []
    for k in sorted(expected.keys() | actual.keys()):
        if k not in actual:
            differences.append(f"{k}: in the baseline, not replayed")
            continue
        if k not in expected:
            differences.append(f"{k}: replayed, not in the baseline")
            continue
        for field in sorted(expected[k].keys() | actual[k].keys()):
            if expected[k].get(field) != actual[k].get(field):
                differences.append(f"{k} {field}: baseline {expected[k].get(field)!r}, now {actual[k].get(field)!r}")
    for d in differences:
        print("replay_baseline: " + d)
    print(f"replay_baseline: {len(actual)} replays compared, {len(differences)} differences")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
