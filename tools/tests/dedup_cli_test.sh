#!/usr/bin/env bash
# glake-dedup from the command line: starts, answers --stats, refuses a second broker on the same
# socket (status 0, says so), stops on SIGTERM and removes its socket.
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
"$tool" --socket "$dir/b.sock" 2>"$dir/second.err"
grep -q 'another glake dedup broker' "$dir/second.err"
kill -TERM "$pid"
wait "$pid"
[[ ! -e $dir/b.sock ]] || { echo "socket left behind"; exit 1; }
if "$tool" --socket "$dir/b.sock" --stats 2>/dev/null; then echo "stats without a broker"; exit 1; fi
"$tool" --bogus 2>/dev/null && exit 1
for bad in "0" "12X" "-1G"; do
  if "$tool" --socket "$dir/q.sock" --max-client-bytes "$bad" 2>/dev/null; then echo "accepted --max-client-bytes $bad"; exit 1; fi
done
[[ ! -e $dir/q.sock ]] || { echo "a refused command line made a socket"; exit 1; }
echo "dedup_cli: ok"
