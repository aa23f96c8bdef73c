#!/usr/bin/env bash
# Builds and runs the fragmentation demo (examples/fragmentation_demo.cpp) in a Release build
# under build/release. No GPU needed.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh

build=build/release
generator=()
if [[ ! -f $build/CMakeCache.txt ]] && command -v ninja >/dev/null 2>&1; then
  generator=(-G Ninja)
fi
cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DGLAKE_BUILD_TESTS=OFF -DGLAKE_BUILD_EXAMPLES=ON >/dev/null
cmake --build "$build" --target example_fragmentation_demo -j2
echo
exec "$build/examples/example_fragmentation_demo" "$@"
