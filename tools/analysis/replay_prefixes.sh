#!/usr/bin/env bash
# When a trace's modeled driver time is spent: replays the first k tenths of its lines
# (k = 1..10) with glake-replay's `glake` configuration and prints driver ms, stitches and peak
# reserved after each (bench/results/replay.md, "When the driver time is spent").
#
#   tools/analysis/replay_prefixes.sh [build/release/tools/glake-replay] traces/opt1.3b-N.trace.gz ...
set -euo pipefail
replay=build/release/tools/glake-replay
if [[ $# -gt 0 && -x $1 && $1 != *.gz ]]; then replay=$1; shift; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for trace in "$@"; do
  name=$(basename "$trace" .trace.gz)
  zcat -f "$trace" > "$tmp/$name.all"
  lines=$(wc -l < "$tmp/$name.all")
  for k in $(seq 1 10); do
    head -n $((lines * k / 10)) "$tmp/$name.all" > "$tmp/$name-$k.trace"
    "$replay" --quiet --json -a glake "$tmp/$name-$k.trace" | python3 -c "
import json, sys
d = json.loads(sys.stdin.readline())
print(f\"$name {$k*10:3d}%  driver {d['modeled_driver_us'] / 1000:7.1f} ms  stitches {d['stitches']:4d}  peak reserved {d['peak_reserved_bytes'] / 1e9:.2f} GB\")"
  done
done
