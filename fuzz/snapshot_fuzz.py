#!/usr/bin/env python3
"""Fuzzes tools/snapshot_to_trace.py: load_snapshot + convert on arbitrary bytes.

Each input is a snapshot file as the converter reads it (a pickle, maybe gzip-compressed). It is
converted with and without --include-initial. A bad snapshot must be refused with SnapshotError;
any other exception is a crash. A snapshot that converts must give a trace that glake-replay's
reader accepts (tools/replay/trace.hpp: ids live when freed and never reused, non-negative
numbers that fit, U lines never releasing more than S lines reserved); GLAKE_FUZZ_TRACE_CHECK=0
turns that cross-check off.

Runs under Atheris (libFuzzer for Python) when it can be imported; otherwise under a small
pure-Python mutator (random byte flips, inserts, deletes and splices of corpus files) with the
same command line for what fuzz/run.sh uses: corpus directories, -max_total_time=S,
-artifact_prefix=DIR/, -runs=N, and files to rerun one by one.

The converter reads the input from a file today (`load_snapshot(path)`); `run_one` is the
only place to change once it can take bytes.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

try:
    import atheris  # noqa: E402
    ENGINE = "atheris"
except ImportError:
    atheris = None
    ENGINE = "pure-python"

if atheris is not None:
    with atheris.instrument_imports():
        import snapshot_to_trace as s2t
else:
    import snapshot_to_trace as s2t

TRACE_CHECK = os.environ.get("GLAKE_FUZZ_TRACE_CHECK", "1") != "0"
_NUMBER = re.compile(r"[0-9]+\Z")
_U64 = 2**64
# The input goes to a memfd, read back through /proc: no disk, nothing to clean up.
_FD = os.memfd_create("snapshot_fuzz")
_PATH = f"/proc/self/fd/{_FD}"


class TraceRejected(AssertionError):
    """The converter's output would be refused by glake-replay's trace reader."""


def check_trace(lines):
    """The rules of read_trace in tools/replay/trace.hpp, on the converter's lines."""
    live, reserved = {}, 0

    def number(text, what, limit=_U64):
        if not _NUMBER.match(text) or int(text) >= limit:
            raise TraceRejected(f"{what} {text!r} is not a non-negative integer below {limit}")
        return int(text)

    for n, line in enumerate(lines, 1):
        fields = line.split(",")
        where = f"line {n} {line!r}"
        if fields[0] == "a" and len(fields) == 4:
            ident = number(fields[1], f"{where}: id")
            live_bytes = number(fields[2], f"{where}: size")
            number(fields[3], f"{where}: stream", 2**32)
            if ident in live:
                raise TraceRejected(f"{where}: id already live")
            live[ident] = live_bytes
        elif fields[0] == "f" and len(fields) == 2:
            if live.pop(number(fields[1], f"{where}: id"), None) is None:
                raise TraceRejected(f"{where}: free of an id that is not live")
        elif fields[0] in ("S", "U") and len(fields) == 2:
            size = number(fields[1], f"{where}: segment size")
            if fields[0] == "S":
                reserved += size
            elif size > reserved:
                raise TraceRejected(f"{where}: releases more than was reserved")
            else:
                reserved -= size
        else:
            raise TraceRejected(f"{where}: not a trace line")


def run_one(data):
    os.ftruncate(_FD, 0)
    os.pwrite(_FD, data, 0)
    try:
        snapshot = s2t.load_snapshot(_PATH)
    except s2t.SnapshotError:
        return
    for include_initial in (False, True):
        try:
            conv = s2t.convert(snapshot, None, include_initial)
        except s2t.SnapshotError:
            return
        if TRACE_CHECK:
            check_trace(conv.lines)


# --------------------------------------------------------------------------------------------
# The pure-Python engine, used only without Atheris.


def _mutate(data, corpus, rng):
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.randrange(5)
        if choice == 0 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif choice == 1:
            at = rng.randint(0, len(data))
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif choice == 2 and data:
            at = rng.randrange(len(data))
            del data[at:at + rng.randint(1, 8)]
        elif choice == 3 and corpus:
            other = rng.choice(corpus)
            a, b = sorted(rng.randrange(len(other) + 1) for _ in range(2))
            at = rng.randint(0, len(data))
            data[at:at] = other[a:b]
        elif data:
            at = rng.randrange(len(data))
            data[at] ^= 1 << rng.randrange(8)
    return bytes(data[:4096])


def _pure_python_main(argv):
    import random
    import time
    import traceback

    options, paths = {}, []
    for arg in argv[1:]:
        m = re.match(r"-(\w+)=(.*)\Z", arg)
        if m:
            options[m.group(1)] = m.group(2)
        else:
            paths.append(arg)
    prefix = options.get("artifact_prefix", "./")
    files = [p for p in paths if os.path.isfile(p)]
    dirs = [p for p in paths if os.path.isdir(p)]

    def crash(data, error):
        digest = __import__("hashlib").sha1(data).hexdigest()
        path = f"{prefix}crash-{digest}"
        with open(path, "wb") as f:
            f.write(data)
        traceback.print_exception(type(error), error, error.__traceback__)
        print(f"snapshot_fuzz ({ENGINE}): crash; reproducer written to {path}", file=sys.stderr)
        return 1

    if files:  # rerun reproducers
        for path in files:
            with open(path, "rb") as f:
                data = f.read()
            try:
                run_one(data)
            except Exception as e:  # noqa: BLE001 - any exception is the finding
                traceback.print_exception(type(e), e, e.__traceback__)
                print(f"snapshot_fuzz ({ENGINE}): {path}: crash", file=sys.stderr)
                return 1
            print(f"snapshot_fuzz ({ENGINE}): {path}: ok", file=sys.stderr)
        return 0

    corpus = []
    for d in dirs:
        for name in sorted(os.listdir(d)):
            with open(os.path.join(d, name), "rb") as f:
                corpus.append(f.read())
    rng = random.Random(int(options.get("seed", "0")) or None)
    deadline = time.monotonic() + float(options.get("max_total_time", "0") or "inf")
    runs_left = int(options.get("runs", "-1"))
    executed = 0
    queue = corpus or [b""]
    for data in corpus:
        try:
            run_one(data)
        except Exception as e:  # noqa: BLE001
            return crash(data, e)
        executed += 1
    while runs_left != 0 and time.monotonic() < deadline:
        data = _mutate(rng.choice(queue), queue, rng)
        try:
            run_one(data)
        except Exception as e:  # noqa: BLE001
            return crash(data, e)
        executed += 1
        runs_left -= 1
    print(f"snapshot_fuzz ({ENGINE}): {executed} inputs, no crash", file=sys.stderr)
    return 0


def main():
    print(f"snapshot_fuzz: engine {ENGINE}", file=sys.stderr)
    if atheris is not None:
        atheris.Setup(sys.argv, run_one)
        atheris.Fuzz()  # does not return
    return _pure_python_main(sys.argv)


if __name__ == "__main__":
    sys.exit(main())
