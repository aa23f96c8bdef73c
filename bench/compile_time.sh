#!/usr/bin/env bash
# Compile time of a user's file that includes glake: the rows of docs/compile-time.md, each compiled
# REPEAT times, printing the least wall-clock and the least CPU (user + system) seconds. Not a
# pass/fail check: CI prints the numbers. On a busy machine compare the CPU column.
#
#   bench/compile_time.sh [--repeat N] [--include DIR] [--cxx CXX] [--suite BUILD_DIR]
#     --include DIR    the include/ to measure (default: this checkout's), e.g. an older release's
#     --suite DIR      also time a clean build of glake_tests in the configured build tree DIR
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
repeat=3
include="$here/include"
cxx="${CXX:-g++}"
suite=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --repeat) repeat="$2"; shift 2 ;;
    --include) include="$(cd "$2" && pwd)"; shift 2 ;;
    --cxx) cxx="$2"; shift 2 ;;
    --suite) suite="$2"; shift 2 ;;
    *) echo "usage: $0 [--repeat N] [--include DIR] [--cxx CXX] [--suite BUILD_DIR]" >&2; exit 2 ;;
  esac
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

cat > "$work/umbrella.cpp" <<'CPP'
#include <glake/glake.hpp>
int main() {}
CPP
cat > "$work/stitching_alone.cpp" <<'CPP'
#include <glake/allocators/stitching_allocator.hpp>
CPP
cat > "$work/config_alone.cpp" <<'CPP'
#include <glake/config.hpp>
CPP
cat > "$work/one_allocator.cpp" <<'CPP'
#include <glake/allocators/stitching_allocator.hpp>
#include <glake/backends/host.hpp>
int main() {
  glake::stitching_allocator<glake::host_provider, glake::host_reserver> a{glake::host_provider(),
                                                                           glake::host_reserver()};
  void* p = a.allocate(1 << 20);
  a.deallocate(p, 1 << 20);
}
CPP
cat > "$work/one_preset.cpp" <<'CPP'
#include <glake/presets.hpp>
int main() {
  glake::host_stitching_allocator<> a{glake::host_provider(), glake::host_reserver()};
  void* p = a.allocate(1 << 20);
  a.deallocate(p, 1 << 20);
}
CPP
cat > "$work/std_only.cpp" <<'CPP'
#include <map>
#include <memory_resource>
#include <string>
#include <vector>
#include <boost/intrusive/set.hpp>
CPP

# The "memory" column is g++'s garbage-collected memory for the file (-ftime-report's TOTAL GGC):
# it does not vary with the machine's load, so it compares two versions even on a busy machine.
ggc=()
if "$cxx" --version | head -n 1 | grep -q 'g++\|GCC'; then ggc=(-ftime-report); fi

# row: NAME FLAGS... -- SOURCE ; prints "seconds wall / cpu / memory"
measure() {
  local name="$1" source="$2"; shift 2
  local best_wall="" best_cpu="" memory="-"
  for ((i = 0; i < repeat; i++)); do
    /usr/bin/time -o "$work/time" -f "%e %U %S" "$cxx" -std=c++20 -I"$include" "${ggc[@]}" "$@" "$work/$source" \
      -o "$work/out.o" >/dev/null 2>"$work/err" || { echo "$name: compile failed:"; cat "$work/err"; return 1; }
    if ((${#ggc[@]})); then memory=$(awk '/^ TOTAL/ { print $NF }' "$work/err"); fi
    read -r wall user sys < <(tail -n 1 "$work/time")
    local cpu
    cpu=$(awk -v u="$user" -v s="$sys" 'BEGIN { printf "%.2f", u + s }')
    if [[ -z "$best_wall" ]] || awk -v a="$wall" -v b="$best_wall" 'BEGIN { exit !(a < b) }'; then best_wall="$wall"; fi
    if [[ -z "$best_cpu" ]] || awk -v a="$cpu" -v b="$best_cpu" 'BEGIN { exit !(a < b) }'; then best_cpu="$cpu"; fi
  done
  printf '%-72s %6s s %6s s %8s\n' "$name" "$best_wall" "$best_cpu" "$memory"
}

printf '%s, least of %s runs, include %s\n' "$("$cxx" --version | head -n 1)" "$repeat" "$include"
printf '%-72s %8s %8s %8s\n' "translation unit" "wall" "cpu" "memory"
measure "glake.hpp + empty main, -fsyntax-only" umbrella.cpp -fsyntax-only
measure "glake.hpp + empty main, -O2 -c" umbrella.cpp -O2 -c
measure "stitching_allocator.hpp alone, -fsyntax-only" stitching_alone.cpp -fsyntax-only
measure "config.hpp alone, -fsyntax-only" config_alone.cpp -fsyntax-only
measure "stitching_allocator<host_provider, host_reserver> alloc+free, -fsyntax-only" one_allocator.cpp -fsyntax-only
measure "stitching_allocator<host_provider, host_reserver> alloc+free, -O2 -c" one_allocator.cpp -O2 -c
if [[ -f "$include/glake/presets.hpp" ]]; then
  measure "host_stitching_allocator<> (preset) alloc+free, -O2 -c" one_preset.cpp -O2 -c
  if grep -q GLAKE_PRESETS_EXTERN "$include/glake/presets.hpp"; then
    measure "the same with -DGLAKE_PRESETS_EXTERN (glake::presets), -O2 -c" one_preset.cpp -O2 -c -DGLAKE_PRESETS_EXTERN
  fi
fi
measure "<vector> <map> <string> <memory_resource> + intrusive set, -fsyntax-only" std_only.cpp -fsyntax-only

if [[ -n "$suite" ]]; then
  cmake --build "$suite" --target clean >/dev/null
  start=$(date +%s.%N)
  cmake --build "$suite" --target glake_tests >/dev/null
  printf '%-72s %6.1f s\n' "clean build of glake_tests in $suite" "$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { print e - s }')"
fi
