#!/usr/bin/env bash
# The main job: builds glake-replay and replays the bundled fine-tuning traces (traces/) through
# PyTorch's default allocator, its expandable segments, GMLake and glake on a simulated 80 GB GPU,
# printing one table. No GPU needed. Extra arguments go to glake-replay (e.g. --json, --plot DIR).
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh

build=build/release
generator=()
if [[ ! -f $build/CMakeCache.txt ]] && command -v ninja >/dev/null 2>&1; then
  generator=(-G Ninja)
fi
cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DGLAKE_BUILD_TESTS=OFF -DGLAKE_BUILD_EXAMPLES=OFF -DGLAKE_BUILD_TOOLS=ON >/dev/null
cmake --build "$build" --target glake-replay -j2
echo

status=0
first=1
while IFS=$'\t' read -r trace seconds _; do
  [[ $trace == trace ]] && continue
  out=$("$build/tools/glake-replay" --capacity 80GiB --training-seconds "$seconds" "$@" \
        "traces/$trace.trace.gz") || status=$?
  if ((first)); then echo "$out"; first=0; else echo "$out" | tail -n +2; fi
done < traces/index.tsv
echo
echo "util = peak active / peak reserved; drv ms = driver calls priced at the H100's measured latencies;"
echo "drv/train = that time as a share of the run's training time (traces/index.tsv)."
exit $status
