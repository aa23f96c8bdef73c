#!/usr/bin/env bash
# glake-dedup from the command line: starts, answers --stats, refuses a second broker on the same
# socket (status 0, says so), stops on SIGTERM and removes its socket; --stats says why it got no
# answer, the descriptor limit is raised, and a path that is not a socket is refused and kept;
# --stats --json is one JSON object, --version and --help answer, errors name the option.
set -euo pipefail
tool=$1
dir=$(mktemp -d)
trap 'kill "$pid" 2>/dev/null || true; rm -rf "$dir"' EXIT
"$tool" --socket "$dir/b.sock" --quiet &
pid=$!
for _ in $(seq 200); do [[ -S $dir/b.sock ]] && break; sleep 0.05; done
[[ -S $dir/b.sock ]] || { echo "no socket"; exit 1; }
[[ $(stat -c %a "$dir/b.sock") == 600 ]] || { echo "socket mode $(stat -c %a "$dir/b.sock")"; exit 1; }
stats=$("$tool" --socket "$dir/b.sock" --stats)
grep -qx 'objects 0' <<<"$stats" || { echo "stats: $stats"; exit 1; }
json=$("$tool" --socket "$dir/b.sock" --stats --json)
[[ $json == '{"clients":0,"objects":0,"object_bytes":0,"references":0,"publishes":0,"shared":0,"refused":0}' ]] ||
  { echo "stats --json: $json"; exit 1; }
"$tool" --socket "$dir/b.sock" 2>"$dir/second.err"
grep -q 'another glake dedup broker' "$dir/second.err"
kill -TERM "$pid"
wait "$pid"
[[ ! -e $dir/b.sock ]] || { echo "socket left behind"; exit 1; }
if "$tool" --socket "$dir/b.sock" --stats 2>"$dir/stats.err"; then echo "stats without a broker"; exit 1; fi
grep -q "no broker answers at $dir/b.sock (connect: " "$dir/stats.err" || { echo "stats error: $(cat "$dir/stats.err")"; exit 1; }
# The soft descriptor limit is raised to the hard one.
(ulimit -Sn 64 && exec "$tool" --socket "$dir/l.sock" --quiet) &
pid=$!
for _ in $(seq 200); do [[ -S $dir/l.sock ]] && break; sleep 0.05; done
read -r soft hard < <(awk '/^Max open files/ {print $4, $5}' "/proc/$pid/limits")
[[ $soft == "$hard" ]] || { echo "descriptor limit $soft of $hard after ulimit -Sn 64"; exit 1; }
kill -TERM "$pid"
wait "$pid"
# Nothing the broker did not make is replaced or removed; errors name the path.
echo notes >"$dir/notes.txt"
if "$tool" --socket "$dir/notes.txt" 2>"$dir/notes.err"; then echo "served on a regular file"; exit 1; fi
grep -qx "glake-dedup: $dir/notes.txt exists and is not a socket; not replacing it (give another --socket path)" \
  "$dir/notes.err" || { echo "error: $(cat "$dir/notes.err")"; exit 1; }  # the tool's name once, no "glake: " after it
[[ $(cat "$dir/notes.txt") == notes ]] || { echo "notes.txt changed"; exit 1; }
if "$tool" --socket "$dir/missing/b.sock" 2>"$dir/missing.err"; then echo "served in a missing directory"; exit 1; fi
grep -q "$dir/missing/" "$dir/missing.err" || { echo "error: $(cat "$dir/missing.err")"; exit 1; }
"$tool" --bogus 2>/dev/null && exit 1
# --version and --help answer on stdout with status 0; an error names the option.
[[ $("$tool" --version) == "glake-dedup "[0-9]*.[0-9]*.[0-9]* ]] || { echo "version: $("$tool" --version)"; exit 1; }
"$tool" --help | grep -q -- '--max-client-bytes SIZE' || { echo "help"; exit 1; }
if "$tool" --socket "$dir/q.sock" --max-objects x 2>"$dir/bad.err"; then echo "accepted --max-objects x"; exit 1; fi
grep -q -- "--max-objects: takes a positive number, not 'x'" "$dir/bad.err" || { echo "error: $(cat "$dir/bad.err")"; exit 1; }
if "$tool" --socket "$dir/q.sock" --json 2>/dev/null; then echo "accepted --json without --stats"; exit 1; fi
for bad in "0" "12X" "-1G"; do
  if "$tool" --socket "$dir/q.sock" --max-client-bytes "$bad" 2>/dev/null; then echo "accepted --max-client-bytes $bad"; exit 1; fi
done
[[ ! -e $dir/q.sock ]] || { echo "a refused command line made a socket"; exit 1; }
echo "dedup_cli: ok"
