#!/usr/bin/env bash
# Builds and runs all tests, printing each stage's time:
#   0. compile time: bench/compile_time.sh once (printed, never fails);
#   1. checked: one -O1 -g1 build under AddressSanitizer + UBSan (build/checked) and every
#      test: the doctest suites, tools, examples, the plug-in's Python tests, the package tests.
#      glake has no assert() of its own, so a plain Debug build would check nothing this one does
#      not; its misuse checks (GLAKE_CHECKED) are on in every build type;
#   rmm: RMM's tests, GPU tests, benchmark and example in a Debug build of their own (build/rmm,
#      unsanitized, as RMM's library is), where RMM's pip wheels can be installed (rmm_setup);
#   2. tsan: the multi-threaded tests alone under ThreadSanitizer (build/tsan, `ctest -L threads`);
#   3. fuzz: each fuzz target for FUZZ_SECONDS (default 30) from its committed corpus, after its
#      committed reproducers (fuzz/run.sh, build/fuzz, Clang).
# Runs every stage even if an earlier one fails; exits non-zero if any does, after a summary line.
# Warnings are errors here (-DGLAKE_WERROR=ON), though the option is off by default. The test
# files are compiled as a few combined translation units (GLAKE_TEST_GROUPS; one per file is the
# default of a build configured by hand, which rebuilds less after a change).
#
#   scripts/test.sh --quick   one plain Debug build (build/debug) and its tests: no sanitizers,
#                             no RMM, no fuzzing. The loop while changing code.
set -euo pipefail
cd "$(dirname "$0")/.."

quick=false
case ${1:-} in
  --quick) quick=true ;;
  "") ;;
  -h | --help)
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
  *)
    echo "test.sh: unknown argument '$1' (see scripts/test.sh --help)" >&2
    exit 2
    ;;
esac

started=$SECONDS
./scripts/setup.sh

generator=()
if command -v ninja >/dev/null 2>&1; then
  generator=(-G Ninja)
fi

# stage_time <name> <start>: one line with a stage's wall time.
stage_time() {
  local s=$((SECONDS - $2))
  printf 'test.sh: %s took %dm%02ds\n' "$1" $((s / 60)) $((s % 60))
}

# configure_and_build <dir> <cmake args...>
configure_and_build() {
  local dir=$1
  shift
  local gen=()
  [[ -f $dir/CMakeCache.txt ]] || gen=("${generator[@]}")
  cmake -S . -B "$dir" "${gen[@]}" -DGLAKE_BUILD_TESTS=ON -DGLAKE_BUILD_EXAMPLES=ON \
    -DGLAKE_BUILD_BENCHMARKS=ON -DGLAKE_BUILD_TOOLS=ON -DGLAKE_WERROR=ON -DGLAKE_TEST_GROUPS=6 "$@" &&
    cmake --build "$dir" -j2
}

# run_ctest <dir> <ctest args...>: the tests, then the ten slowest (where the time goes).
run_ctest() {
  local dir=$1
  shift
  local status=0
  (cd "$dir" && ctest --output-on-failure -j2 --timeout 900 "$@") || status=$?
  if [[ -f $dir/Testing/Temporary/LastTest.log ]]; then
    echo "test.sh: the slowest tests in $dir:"
    sed -n 's/^"\(.*\)" end time: .*//; s/^\([0-9]*\/[0-9]* Test: \)\(.*\)/\2/p; s/^Test time = *\([0-9.]*\) sec/\1/p' \
      "$dir/Testing/Temporary/LastTest.log" | paste - - | sort -t$'\t' -k2 -rn | head -10 |
      awk -F'\t' '{printf "  %7.1f s  %s\n", $2, $1}'
  fi
  return $status
}

if $quick; then
  quick_result=FAIL
  t=$SECONDS
  echo "=== test.sh --quick: Debug build and tests (build/debug) ==="
  if configure_and_build build/debug -DCMAKE_BUILD_TYPE=Debug -DGLAKE_SANITIZE= -DGLAKE_WITH_RMM=OFF &&
     run_ctest build/debug; then
    quick_result=PASS
  fi
  stage_time "the quick stage" "$t"
  stage_time "everything" "$started"
  echo "test.sh --quick: $quick_result"
  [[ $quick_result == PASS ]]
  exit
fi

# RMM for the checked stage (GLAKE_WITH_RMM: tests/rmm_resource_test.cpp without a GPU, the RMM
# GPU tests and bench_rmm compiled): RMM's pip wheels in a venv under build/ (installed once,
# then reused), where the platform allows; otherwise one line says why the RMM tests are skipped.
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

echo "=== test.sh: compile time of a user's file (bench/compile_time.sh; printed, never fails) ==="
./bench/compile_time.sh --repeat 1 || true

checked=FAIL
t=$SECONDS
echo "=== test.sh: checked build, -O1 -g1 under AddressSanitizer + UBSan (build/checked) ==="
export ASAN_OPTIONS=detect_leaks=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# -O1 -g1 (line tables, enough for the sanitizers' stacks) rather than RelWithDebInfo's -O2 -g: the
# largest test file compiles in 92 s instead of 187 s (g++ 12, 2-core machine, 2026-11-28), and the
# build is most of this stage.
if configure_and_build build/checked -DCMAKE_BUILD_TYPE=RelWithDebInfo \
     "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" \
     -DGLAKE_SANITIZE=address,undefined -DGLAKE_WITH_RMM=OFF &&
   run_ctest build/checked; then
  checked=PASS
fi
stage_time "the checked stage" "$t"

# RMM's targets (glake_rmm_tests, the RMM GPU tests, bench_rmm, examples/rmm) in a Debug build of
# their own: nvcc rejects bench_rmm.cu at -O2 (a __host__ __device__ copy of a shared_ptr inside
# cuda::mr, a warning made an error), and RMM's library is not sanitized anyway.
rmm=SKIPPED
if [[ ${rmm_args[0]} == -DGLAKE_WITH_RMM=ON ]]; then
  rmm=FAIL
  t=$SECONDS
  echo "=== test.sh: RMM's tests and benchmark, Debug (build/rmm) ==="
  rmm_gen=()
  [[ -f build/rmm/CMakeCache.txt ]] || rmm_gen=("${generator[@]}")
  if cmake -S . -B build/rmm "${rmm_gen[@]}" -DCMAKE_BUILD_TYPE=Debug -DGLAKE_SANITIZE= -DGLAKE_WERROR=ON \
       -DGLAKE_BUILD_TESTS=ON -DGLAKE_BUILD_EXAMPLES=ON -DGLAKE_BUILD_BENCHMARKS=ON -DGLAKE_BUILD_TOOLS=OFF \
       -DGLAKE_BUILD_INTEGRATIONS=OFF -DGLAKE_INSTALL=OFF "${rmm_args[@]}" >/dev/null &&
     cmake --build build/rmm -j2 --target glake_rmm_tests glake_gpu_rmm_tests bench_rmm example_rmm_current_resource &&
     build/rmm/tests/glake_rmm_tests &&
     { tests/gpu/run_or_skip.sh build/rmm/tests/glake_gpu_rmm_tests; code=$?; ((code == 0 || code == 77)); } &&
     { tests/gpu/run_or_skip.sh build/rmm/examples/example_rmm_current_resource; code=$?; ((code == 0 || code == 77)); }; then
    rmm=PASS
  fi
  stage_time "the rmm stage" "$t"
fi

tsan=FAIL
t=$SECONDS
echo "=== test.sh: ThreadSanitizer, multi-threaded tests only (build/tsan) ==="
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
tsan_gen=()
[[ -f build/tsan/CMakeCache.txt ]] || tsan_gen=("${generator[@]}")
if cmake -S . -B build/tsan "${tsan_gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
     -DGLAKE_SANITIZE=thread -DGLAKE_WERROR=ON -DGLAKE_BUILD_TESTS=ON -DGLAKE_TEST_GROUPS=3 -DGLAKE_BUILD_EXAMPLES=OFF \
     -DGLAKE_BUILD_BENCHMARKS=OFF -DGLAKE_BUILD_TOOLS=OFF -DGLAKE_BUILD_INTEGRATIONS=OFF \
     -DGLAKE_INSTALL=OFF &&
   cmake --build build/tsan -j2 --target glake_thread_tests &&
   (cd build/tsan && ctest --output-on-failure -j2 --timeout 600 -L threads); then
  tsan=PASS
fi
stage_time "the tsan stage" "$t"

fuzz=FAIL
t=$SECONDS
echo "=== test.sh: fuzzing, ${FUZZ_SECONDS:-30} s a target (build/fuzz; docs/fuzzing.md) ==="
# Absurd request sizes (2^40 .. SIZE_MAX) included: every allocator refuses them at once.
if GLAKE_FUZZ_ABSURD=${GLAKE_FUZZ_ABSURD:-1} ./fuzz/run.sh "${FUZZ_SECONDS:-30}"; then
  fuzz=PASS
fi
stage_time "the fuzz stage" "$t"

stage_time "everything" "$started"
stages="checked (ASan+UBSan): $checked, rmm: $rmm, tsan: $tsan, fuzz: $fuzz"
if [[ $checked == PASS && $rmm != FAIL && $tsan == PASS && $fuzz == PASS ]]; then
  echo "test.sh: ALL PASSED ($stages)"
else
  echo "test.sh: FAILED ($stages)"
  exit 1
fi
