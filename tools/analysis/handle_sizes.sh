#!/usr/bin/env bash
# The handle-size trade-off: for each trace, glake's utilization, peak reserved (against
# expandable segments'), modeled driver ms over the whole trace and over its steady part (after
# the first 40% of its lines), for max_handle 0 (2 MiB handles only) to 32 MiB
# (bench/results/replay.md, "Handles of up to 8 MiB").
#
#   tools/analysis/handle_sizes.sh [build/release/tools/glake-replay] traces/*.trace.gz
set -euo pipefail
replay=build/release/tools/glake-replay
if [[ $# -gt 0 && -x $1 && $1 != *.gz ]]; then replay=$1; shift; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
json() { "$replay" --quiet --json "$@"; }
field() { python3 -c "import json, sys; d = json.loads(sys.stdin.readline()); print($1)"; }
printf '%-24s %-10s %11s %11s %9s %9s %9s\n' trace max_handle utilization "reserved GB" "exp. GB" "drv ms" "steady"
for trace in "$@"; do
  name=$(basename "$trace" .trace.gz)
  zcat -f "$trace" > "$tmp/all"
  head -n $(( $(wc -l < "$tmp/all") * 4 / 10 )) "$tmp/all" > "$tmp/head"
  expandable=$(json -a pytorch-expandable "$tmp/all" | field "round(d['peak_reserved_bytes'] / 1e9, 3)")
  for handle in 0 4MiB 8MiB 16MiB 32MiB; do
    all=$(json -a glake --glake-conf max_handle:$handle "$tmp/all")
    head_ms=$(json -a glake --glake-conf max_handle:$handle "$tmp/head" | field "d['modeled_driver_us'] / 1000")
    echo "$all" | field "'%-24s %-10s %11.4f %11.3f %9.3f %9.0f %9.0f' % ('$name', '$handle', d['utilization'], d['peak_reserved_bytes'] / 1e9, $expandable, d['modeled_driver_us'] / 1000, d['modeled_driver_us'] / 1000 - $head_ms)"
  done
done
