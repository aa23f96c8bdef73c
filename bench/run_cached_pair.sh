#!/usr/bin/env bash
# Builds bench/cached_pair_bench.cpp, measures ns per cached allocate+deallocate pair and counts
# instructions per pair under callgrind, and writes bench/results/cached_pair.md.
#
#   bench/run_cached_pair.sh            # from anywhere; about a minute on 2 cores
#
# Environment: CXX (default g++), VALGRIND (default valgrind), PAIRS (default 10000: the
# instruction count is (Ir(2*PAIRS) - Ir(PAIRS)) / PAIRS, which cancels set-up and teardown).
# Targets: median <= 100 ns and <= 400 instructions per pair.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
CXX="${CXX:-g++}"
VALGRIND="${VALGRIND:-valgrind}"
PAIRS="${PAIRS:-10000}"
ns_target=100
instr_target=400

bin="build/bench/cached_pair_bench"
mkdir -p build/bench bench/results
flags=(-std=c++20 -O2 -DNDEBUG -Wall -Wextra -Wpedantic -Werror -Iinclude)
echo "building $bin" >&2
"$CXX" "${flags[@]}" bench/cached_pair_bench.cpp -o "$bin"

echo "timing" >&2
timing="$("$bin")"

# Instructions of one --instructions run, from callgrind's "Collected : N" line.
count() {
  "$VALGRIND" --tool=callgrind --callgrind-out-file=/dev/null "$bin" --instructions "$@" 2>&1 |
    awk '/Collected :/ { print $NF }'
}

echo "counting instructions" >&2
instr_rows=""
for size in 512 4K 64K 1M 2M 16M 256M 1G; do
  for alloc in stitching stitching_mutex caching; do
    for scenario in exact split; do
      one="$(count "$size" "$alloc" "$PAIRS" "$scenario")"
      two="$(count "$size" "$alloc" "$((2 * PAIRS))" "$scenario")"
      per_pair="$(awk -v a="$one" -v b="$two" -v n="$PAIRS" 'BEGIN { printf "%.1f", (b - a) / n }')"
      ok="$(awk -v x="$per_pair" -v t="$instr_target" 'BEGIN { print (x <= t) ? "yes" : "**no**" }')"
      instr_rows+="| $size | $alloc | $scenario | $per_pair | $ok |"$'\n'
    done
  done
done

# The timing table with a target column added to every data row.
timing_checked="$(printf '%s\n' "$timing" | awk -v t="$ns_target" -F'|' '
  /^\| size/ { print $0 " meets <= " t " ns |"; next }
  /^\|---/   { print $0 "---|"; next }
  /^\|/      { print $0 " " (($5 + 0 <= t) ? "yes" : "**no**") " |"; next }
  { print }')"

commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
dirty=""
if [ -n "$(git status --porcelain 2>/dev/null)" ]; then dirty=" (working tree has uncommitted changes)"; fi

# The headers measured, even when uncommitted: a digest of every file under include/.
headers="$(find include -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)"

out="bench/results/cached_pair.md"
{
  echo "# Cached allocate+deallocate pair"
  echo
  echo "Written by \`bench/run_cached_pair.sh\`; what a cached pair is, and the two scenarios,"
  echo "are defined in the header comment of \`bench/cached_pair_bench.cpp\`."
  echo
  echo "- Command: \`bench/run_cached_pair.sh\` (PAIRS=$PAIRS), which runs"
  echo "  \`$CXX ${flags[*]} bench/cached_pair_bench.cpp -o $bin\`,"
  echo "  then \`$bin\` for the timings and"
  echo "  \`$VALGRIND --tool=callgrind --callgrind-out-file=/dev/null $bin --instructions SIZE ALLOCATOR N SCENARIO\`"
  echo "  with N = $PAIRS and $((2 * PAIRS)); instructions/pair = (Ir(N=$((2 * PAIRS))) - Ir(N=$PAIRS)) / $PAIRS."
  echo "- Date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "- Source: commit $commit$dirty; sha256 of the include/ files: $headers"
  echo "- Machine: $(nproc) cores, $(awk -F': ' '/model name/ { print $2; exit }' /proc/cpuinfo)"
  echo "- Compiler: $("$CXX" --version | head -n 1); $("$VALGRIND" --version)"
  echo "- Targets: median <= $ns_target ns and <= $instr_target instructions per pair."
  echo
  echo "## Time per pair"
  echo
  echo "$timing_checked"
  echo
  echo "## Instructions per pair (callgrind)"
  echo
  echo "| size | allocator | scenario | instructions/pair | meets <= $instr_target |"
  echo "|---:|---|---|---:|---|"
  printf '%s' "$instr_rows"
} >"$out"
echo "wrote $out" >&2
