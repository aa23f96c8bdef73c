#!/usr/bin/env bash
# Builds and runs all tests twice: a Debug build (build/debug; with the RMM tests where RMM's pip
# wheels can be installed, see rmm_setup), then a RelWithDebInfo build
# under AddressSanitizer + UBSan (build/asan, package tests excluded); then the multi-threaded
# tests alone under ThreadSanitizer (build/tsan, only glake_thread_tests built, `ctest -L threads`);
# then each fuzz target for FUZZ_SECONDS (default 60) from its committed corpus (fuzz/run.sh,
# build/fuzz, Clang). Runs every stage even if an earlier one fails; exits non-zero if any does,
# after a summary line. Warnings are errors here (-DGLAKE_WERROR=ON), though the option is off
# by default.
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

# RMM for the Debug stage (GLAKE_WITH_RMM: tests/rmm_resource_test.cpp without a GPU, the RMM GPU
# tests and bench_rmm compiled): RMM's pip wheels in a venv under build/ (installed once, then
# reused), where the platform allows; otherwise one line says why the RMM tests are skipped.
rmm_args=(-DGLAKE_WITH_RMM=OFF)
rmm_venv=build/rmm-venv
rmm_setup() {
  local platform
  platform="$(uname -s)/$(uname -m)"
  if [[ $platform != Linux/x86_64 && $platform != Linux/aarch64 ]]; then
    echo "test.sh: RMM tests skipped: RMM's wheels are for Linux x86_64 and aarch64, not $platform"
    return 1
  fi
  # Where CMake's FindCUDAToolkit looks first: nvcc on PATH, else /usr/local/cuda.
  local cuda=/usr/local/cuda
  if command -v nvcc >/dev/null 2>&1; then
    cuda=$(dirname "$(dirname "$(command -v nvcc)")")
  fi
  local cuda_version
  cuda_version=$(sed -n 's/^#define CUDA_VERSION \([0-9]*\).*/\1/p' "$cuda/include/cuda.h" 2>/dev/null || true)
  if [[ -z $cuda_version ]]; then
    echo "test.sh: RMM tests skipped: no CUDA toolkit (no $cuda/include/cuda.h)"
    return 1
  fi
  if ((cuda_version < 13000)); then
    echo "test.sh: RMM tests skipped: the CUDA toolkit at $cuda is $cuda_version, RMM's cu13 wheels need 13.x"
    return 1
  fi
  if [[ ! -x $rmm_venv/bin/python ]] && ! python3 -m venv "$rmm_venv" >/dev/null 2>&1; then
    rm -rf "$rmm_venv"
    echo "test.sh: RMM tests skipped: python3 -m venv failed"
    return 1
  fi
  local site
  if ! site=$("$rmm_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') ||
     [[ -z $site ]]; then
    echo "test.sh: RMM tests skipped: the venv's python in $rmm_venv does not run"
    return 1
  fi
  if ! grep -qs '#define RMM_VERSION "26\.10\.' "$site/librmm/include/rmm/version_config.hpp" ||
     [[ ! -d $site/rapids_logger ]]; then
    echo "test.sh: installing librmm-cu13 26.10 and rapids-logger into $rmm_venv"
    if ! timeout 600 "$rmm_venv/bin/python" -m pip install --quiet --disable-pip-version-check \
         'librmm-cu13==26.10.*' 'rapids-logger'; then
      echo "test.sh: RMM tests skipped: pip could not install librmm-cu13==26.10.* (no network or no index?)"
      return 1
    fi
  fi
  rmm_args=(-DGLAKE_WITH_RMM=ON "-DGLAKE_RMM_ROOT=$site")
}
rmm_setup || true

debug=FAIL
echo "=== test.sh: Debug build (build/debug) ==="
if configure_and_build build/debug -DCMAKE_BUILD_TYPE=Debug -DGLAKE_SANITIZE= "${rmm_args[@]}" &&
   (cd build/debug && ctest --output-on-failure -j2 --timeout 600); then
  debug=PASS
fi

echo "=== test.sh: compile time of a user's file (bench/compile_time.sh; printed, never fails) ==="
./bench/compile_time.sh --repeat 1 || true

asan=FAIL
echo "=== test.sh: AddressSanitizer + UBSan build (build/asan) ==="
export ASAN_OPTIONS=detect_leaks=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
if configure_and_build build/asan -DCMAKE_BUILD_TYPE=RelWithDebInfo \
     -DGLAKE_SANITIZE=address,undefined &&
   (cd build/asan && ctest --output-on-failure -j2 --timeout 600 -LE package); then
  asan=PASS
fi

tsan=FAIL
echo "=== test.sh: ThreadSanitizer, multi-threaded tests only (build/tsan) ==="
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
tsan_gen=()
[[ -f build/tsan/CMakeCache.txt ]] || tsan_gen=("${generator[@]}")
if cmake -S . -B build/tsan "${tsan_gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
     -DGLAKE_SANITIZE=thread -DGLAKE_WERROR=ON -DGLAKE_BUILD_TESTS=ON -DGLAKE_BUILD_EXAMPLES=OFF \
     -DGLAKE_BUILD_BENCHMARKS=OFF -DGLAKE_BUILD_TOOLS=OFF -DGLAKE_BUILD_INTEGRATIONS=OFF \
     -DGLAKE_INSTALL=OFF &&
   cmake --build build/tsan -j2 --target glake_thread_tests &&
   (cd build/tsan && ctest --output-on-failure -j2 --timeout 600 -L threads); then
  tsan=PASS
fi

fuzz=FAIL
echo "=== test.sh: fuzzing, ${FUZZ_SECONDS:-60} s a target (build/fuzz; docs/fuzzing.md) ==="
# Absurd request sizes (2^40 .. SIZE_MAX) included: every allocator refuses them at once.
if GLAKE_FUZZ_ABSURD=${GLAKE_FUZZ_ABSURD:-1} ./fuzz/run.sh "${FUZZ_SECONDS:-60}"; then
  fuzz=PASS
fi

stages="debug: $debug, asan+ubsan: $asan, tsan: $tsan, fuzz: $fuzz"
if [[ $debug == PASS && $asan == PASS && $tsan == PASS && $fuzz == PASS ]]; then
  echo "test.sh: ALL PASSED ($stages)"
else
  echo "test.sh: FAILED ($stages)"
  exit 1
fi
