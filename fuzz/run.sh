#!/usr/bin/env bash
# Builds the fuzz targets (build/fuzz, Clang, -fsanitize=fuzzer,address,undefined) and runs each
# for a bounded time from its committed corpus. Usage:
#   fuzz/run.sh [SECONDS] [TARGET...]    TARGET: trace config alloc_ops tiered_ops dedup_protocol budget_protocol snapshot (default: all)
# First reruns every committed reproducer in fuzz/crashes/<target>/ (each must now pass), then
# fuzzes with fuzz/corpus/<target> as seeds; new inputs go to build/fuzz/corpus/<target>, never
# to the committed corpus. Two targets run at a time. A crash prints the reproducer's path and
# the command that reruns it; the exit status is non-zero if any target failed.
# Environment: GLAKE_FUZZ_ABSURD (default 1) turns the alloc_ops fuzzer's absurd request sizes
# on or off; CLANGXX picks the compiler (default clang++-14, else clang++).
set -uo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-60}
shift || true
targets=("$@")
((${#targets[@]})) || targets=(trace config alloc_ops tiered_ops dedup_protocol budget_protocol snapshot)
build=build/fuzz

cxx=${CLANGXX:-}
if [[ -z $cxx ]]; then
  for c in clang++-14 clang++; do
    if command -v "$c" >/dev/null 2>&1; then cxx=$c; break; fi
  done
fi
if [[ -z $cxx ]]; then
  echo "fuzz/run.sh: no clang++ (scripts/setup.sh installs clang-14)" >&2
  exit 1
fi

need_native=false
for t in "${targets[@]}"; do [[ $t != snapshot ]] && need_native=true; done
if $need_native; then
  gen=()
  command -v ninja >/dev/null 2>&1 && [[ ! -f $build/CMakeCache.txt ]] && gen=(-G Ninja)
  cmake -S . -B "$build" "${gen[@]}" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DGLAKE_BUILD_FUZZERS=ON -DGLAKE_BUILD_TESTS=OFF -DGLAKE_BUILD_EXAMPLES=OFF \
    -DGLAKE_BUILD_BENCHMARKS=OFF -DGLAKE_BUILD_TOOLS=OFF -DGLAKE_BUILD_INTEGRATIONS=OFF \
    -DGLAKE_INSTALL=OFF -DGLAKE_WERROR=ON -DGLAKE_SANITIZE= >/dev/null &&
    cmake --build "$build" -j2 || { echo "fuzz/run.sh: FAILED to build the fuzz targets"; exit 1; }
fi

# The snapshot importer's harness runs under Atheris from a venv in build/ (Debian's system pip
# is closed, PEP 668); without Atheris it falls back to its pure-Python mutator.
python_cmd=()
for t in "${targets[@]}"; do
  [[ $t == snapshot ]] || continue
  venv=$build-venv
  if [[ ! -x $venv/bin/python ]]; then
    python3 -m venv "$venv" || echo "fuzz/run.sh: cannot create $venv (python3-venv missing?)" >&2
  fi
  if [[ -x $venv/bin/python ]]; then
    "$venv/bin/python" -c "import atheris" 2>/dev/null ||
      "$venv/bin/pip" install -q --only-binary :all: atheris==2.3.0 ||
      echo "fuzz/run.sh: no Atheris wheel; the snapshot fuzzer uses its pure-Python mutator" >&2
    python_cmd=("$venv/bin/python" fuzz/snapshot_fuzz.py)
  else
    python_cmd=(python3 fuzz/snapshot_fuzz.py)
  fi
done

command_for() {
  case $1 in
    snapshot) echo "${python_cmd[*]}" ;;
    *) echo "$build/fuzz/glake_fuzz_$1" ;;
  esac
}

# run_target <target>: reproducers, then fuzzing; output in $build/logs/<target>.log.
run_target() {
  local t=$1 cmd
  cmd=$(command_for "$t")
  local log=$build/logs/$t.log crashes=$build/crashes/$t work=$build/corpus/$t
  mkdir -p "$build/logs" "$crashes" "$work"
  local dict=()
  [[ -f fuzz/dict/$t.dict ]] && dict=(-dict="fuzz/dict/$t.dict")
  : >"$log"
  local reproducer
  for reproducer in fuzz/crashes/"$t"/*; do
    [[ -f $reproducer ]] || continue
    if ! $cmd -runs=1 "$reproducer" >>"$log" 2>&1; then
      echo "REPRODUCER $reproducer still fails: $cmd $reproducer" >>"$log"
      return 1
    fi
  done
  # -rss_limit_mb: the harnesses hold little; more means a leak or a blow-up in the code tested.
  $cmd -max_total_time="$seconds" -timeout=25 -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1 \
    -artifact_prefix="$crashes/" "${dict[@]}" "$work" "fuzz/corpus/$t" >>"$log" 2>&1
}

declare -A status
pids=()
names=()
report() {
  local i=$1 t=${names[$1]}
  if wait "${pids[$i]}"; then
    status[$t]=PASS
  else
    status[$t]=FAIL
  fi
  local log=$build/logs/$t.log
  echo "=== fuzz $t: ${status[$t]} (log: $log) ==="
  grep -E "^(alloc_ops_fuzzer|tiered_ops_fuzzer|snapshot_fuzz|stat::number_of_executed_units|stat::peak_rss_mb|#[0-9]+ +DONE)" "$log" | tail -5
  if [[ ${status[$t]} == FAIL ]]; then
    grep -E "ERROR:|check failed|REPRODUCER|Uncaught|^[A-Za-z]*Error|SUMMARY" "$log" | head -8
    local artifact
    artifact=$(sed -n "s/.*Test unit written to \(.*\)/\1/p; s/.*reproducer written to \(.*\)/\1/p" "$log" | tail -1)
    if [[ -n $artifact ]]; then
      echo "fuzz $t: reproducer: $artifact"
      echo "fuzz $t: rerun with: $(command_for "$t") $artifact"
    fi
  fi
}

for t in "${targets[@]}"; do
  case $t in trace | config | alloc_ops | tiered_ops | dedup_protocol | budget_protocol | snapshot) ;; *)
    echo "fuzz/run.sh: unknown target '$t'" >&2
    exit 2
    ;;
  esac
  run_target "$t" &
  pids+=($!)
  names+=("$t")
  if ((${#pids[@]} % 2 == 0)); then
    report $((${#pids[@]} - 2))
    report $((${#pids[@]} - 1))
  fi
done
((${#pids[@]} % 2 == 1)) && report $((${#pids[@]} - 1))

failed=0
summary=""
for t in "${targets[@]}"; do
  summary+=" $t: ${status[$t]},"
  [[ ${status[$t]} == PASS ]] || failed=1
done
echo "fuzz/run.sh: ${seconds}s each;${summary%,}"
exit $failed
