#!/usr/bin/env bash
# glake-budget from the command line: starts with a budget in bytes or as a fraction of the
# device, answers --stats, refuses a second coordinator on the same socket (status 0, says so),
# stops on SIGTERM and removes its socket; bad arguments are refused; sizes such as 1.5T are read,
# the descriptor limit is raised, and a path that is not a socket is refused and kept; --stats --json
# is one JSON object, --version and --help answer, errors name the option.
set -euo pipefail
tool=$1
dir=$(mktemp -d)
pid=
trap 'if [[ -n $pid ]]; then kill "$pid" 2>/dev/null || true; fi; rm -rf "$dir"' EXIT
wait_socket() {
  for _ in $(seq 200); do [[ -S $1 ]] && return 0; sleep 0.05; done
  echo "no socket $1"
  exit 1
}
"$tool" --socket "$dir/b.sock" --budget 40G --quiet &
pid=$!
wait_socket "$dir/b.sock"
[[ $(stat -c %a "$dir/b.sock") == 600 ]] || { echo "socket mode $(stat -c %a "$dir/b.sock")"; exit 1; }
stats=$("$tool" --socket "$dir/b.sock" --stats)
grep -qx 'budget 42949672960' <<<"$stats" || { echo "stats: $stats"; exit 1; }
grep -qx 'workloads 0' <<<"$stats" || { echo "stats: $stats"; exit 1; }
json=$("$tool" --socket "$dir/b.sock" --stats --json)
[[ $json == '{"budget":42949672960,"used":0,"workloads":0,"lines":[]}' ]] || { echo "stats --json: $json"; exit 1; }
"$tool" --socket "$dir/b.sock" --budget 1G 2>"$dir/second.err"
grep -q 'another glake budget coordinator' "$dir/second.err"
kill -TERM "$pid"
wait "$pid"
[[ ! -e $dir/b.sock ]] || { echo "socket left behind"; exit 1; }
if "$tool" --socket "$dir/b.sock" --stats 2>/dev/null; then echo "stats without a coordinator"; exit 1; fi

"$tool" --socket "$dir/f.sock" --budget 0.5 --device-bytes 80G --quiet &
pid=$!
wait_socket "$dir/f.sock"
"$tool" --socket "$dir/f.sock" --stats | grep -qx 'budget 42949672960'
kill -TERM "$pid"
wait "$pid"
pid=

# Sizes with a fraction, and the whole of the largest device.
"$tool" --socket "$dir/t.sock" --budget 1.5T --quiet &
pid=$!
wait_socket "$dir/t.sock"
"$tool" --socket "$dir/t.sock" --stats | grep -qx 'budget 1649267441664' || { echo "--budget 1.5T"; exit 1; }
# The soft descriptor limit is raised to the hard one.
limits() { awk '/^Max open files/ {print $4, $5}' "/proc/$1/limits"; }
read -r soft hard < <(limits "$pid")
[[ $soft == "$hard" ]] || { echo "descriptor limit $soft of $hard"; exit 1; }
kill -TERM "$pid"
wait "$pid"
(ulimit -Sn 64 && exec "$tool" --socket "$dir/m.sock" --budget 1.0 --device-bytes 18446744073709551615 --quiet) &
pid=$!
wait_socket "$dir/m.sock"
"$tool" --socket "$dir/m.sock" --stats | grep -qx 'budget 18446744073709551615' || { echo "fraction 1.0 of 2^64-1"; exit 1; }
read -r soft hard < <(limits "$pid")
[[ $soft == "$hard" ]] || { echo "descriptor limit $soft of $hard after ulimit -Sn 64"; exit 1; }
kill -TERM "$pid"
wait "$pid"
pid=

# Nothing the coordinator did not make is replaced or removed; errors name the path.
echo notes >"$dir/notes.txt"
if "$tool" --socket "$dir/notes.txt" --budget 1G 2>"$dir/notes.err"; then echo "served on a regular file"; exit 1; fi
grep -q "$dir/notes.txt" "$dir/notes.err" || { echo "error: $(cat "$dir/notes.err")"; exit 1; }
[[ $(cat "$dir/notes.txt") == notes ]] || { echo "notes.txt changed"; exit 1; }
if "$tool" --socket "$dir/missing/b.sock" --budget 1G 2>"$dir/missing.err"; then echo "served in a missing directory"; exit 1; fi
grep -q "$dir/missing/" "$dir/missing.err" || { echo "error: $(cat "$dir/missing.err")"; exit 1; }

for bad in "--budget 0.5" "--budget 1.5 --device-bytes 1G" "--budget 0" "--budget 12X" "--bogus" "--json"; do
  # shellcheck disable=SC2086
  if "$tool" --socket "$dir/x.sock" $bad 2>/dev/null; then echo "accepted: $bad"; exit 1; fi
done
# --version and --help answer on stdout with status 0; an error names the option.
[[ $("$tool" --version) == "glake-budget "[0-9]*.[0-9]*.[0-9]* ]] || { echo "version: $("$tool" --version)"; exit 1; }
"$tool" --help | grep -q -- '--device-bytes N' || { echo "help"; exit 1; }
if "$tool" --socket "$dir/x.sock" --device-bytes 0 --budget 1G 2>"$dir/bad.err"; then echo "accepted --device-bytes 0"; exit 1; fi
grep -q -- "--device-bytes: takes a positive size, not '0'" "$dir/bad.err" || { echo "error: $(cat "$dir/bad.err")"; exit 1; }
echo "budget_cli: ok"
