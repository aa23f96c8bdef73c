#!/usr/bin/env bash
# Builds and runs all tests twice: a Debug build (build/debug), then a RelWithDebInfo build
# under AddressSanitizer + UBSan (build/asan, package tests excluded). Runs both stages even if
# the first fails; exits non-zero if either does, after a summary line. Warnings are errors here
# (-DGLAKE_WERROR=ON), though the option is off by default.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh

generator=()
if command -v ninja >/dev/null 2>&1; then
  generator=(-G Ninja)
fi

# configure_and_build <dir> <cmake args...>
configure_and_build() {
  local dir=$1
  shift
  local gen=()
  [[ -f $dir/CMakeCache.txt ]] || gen=("${generator[@]}")
  cmake -S . -B "$dir" "${gen[@]}" -DGLAKE_BUILD_TESTS=ON -DGLAKE_BUILD_EXAMPLES=ON \
    -DGLAKE_BUILD_BENCHMARKS=ON -DGLAKE_BUILD_TOOLS=ON -DGLAKE_WERROR=ON "$@" &&
    cmake --build "$dir" -j2
}

debug=FAIL
echo "=== test.sh: Debug build (build/debug) ==="
if configure_and_build build/debug -DCMAKE_BUILD_TYPE=Debug -DGLAKE_SANITIZE= &&
   (cd build/debug && ctest --output-on-failure -j2 --timeout 600); then
  debug=PASS
fi

asan=FAIL
echo "=== test.sh: AddressSanitizer + UBSan build (build/asan) ==="
export ASAN_OPTIONS=detect_leaks=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
if configure_and_build build/asan -DCMAKE_BUILD_TYPE=RelWithDebInfo \
     -DGLAKE_SANITIZE=address,undefined &&
   (cd build/asan && ctest --output-on-failure -j2 --timeout 600 -LE package); then
  asan=PASS
fi

if [[ $debug == PASS && $asan == PASS ]]; then
  echo "test.sh: ALL PASSED (debug: $debug, asan+ubsan: $asan)"
else
  echo "test.sh: FAILED (debug: $debug, asan+ubsan: $asan)"
  exit 1
fi
