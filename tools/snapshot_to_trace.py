#!/usr/bin/env python3
"""Convert a PyTorch CUDA memory snapshot into glake's allocation trace format.

Record a snapshot in your own workload with

    torch.cuda.memory._record_memory_history()
    ...  # run the steps you care about
    torch.cuda.memory._dump_snapshot("x.pickle")

then, without torch installed:

    tools/snapshot_to_trace.py x.pickle -o x.trace.gz

Output is one event a line (the format of the bundled traces, traces/README.md):

    a,<id>,<bytes>,<stream>   'alloc'; ids 0,1,2,... in order, never reused; bytes are the
                              request rounded up to 512 as PyTorch's allocator does (the
                              snapshot records the unrounded request)
    f,<id>                    'free_completed' of the allocation at that address
                              ('free_requested' is ignored: the memory is not reusable yet)
    S,<bytes>                 'segment_alloc' or 'segment_map'
    U,<bytes>                 'segment_free' or 'segment_unmap'

<stream> is a small integer, not PyTorch's stream handle: each distinct stream value is
numbered 0,1,2,... in order of first appearance in the output.

The history is a ring buffer and may begin mid-run. A free of an address never allocated in
the history is skipped and counted, and so is an unmap of memory never mapped in it. With
--include-initial the state that existed before the first entry is reconstructed (from the
snapshot's segments and by undoing the history) and emitted first: the segments as S lines,
then the allocations still held as a lines. It is off by default so the output holds only
recorded events; a note on stderr says how much pre-existing state was left out, and the
peaks in the summary depend on it.

'snapshot' and 'oom' entries and unknown actions are skipped and counted; a legacy 'free'
is read as 'free_completed'. The snapshot is read with a restricted unpickler that builds only
plain containers and numbers; any other class becomes an inert stub, so a snapshot from any
torch version loads and nothing in it is executed. gzip-compressed input is accepted too.

A one-line summary goes to stderr. Errors are one line naming the file; exit status 2.
"""

import argparse
import bisect
import builtins
import collections
import gzip
import io
import os
import pickle
import sys
from dataclasses import dataclass, field

PROG = "snapshot_to_trace"
ROUND = 512  # PyTorch's kMinBlockSize: every request is rounded up to a multiple of it

ALLOC_ACTIONS = {"alloc"}
FREE_ACTIONS = {"free_completed", "free"}  # "free": name used by early snapshot versions
MAP_ACTIONS = {"segment_alloc", "segment_map"}
UNMAP_ACTIONS = {"segment_free", "segment_unmap"}
IGNORED_ACTIONS = {"free_requested"}
SKIPPED_ACTIONS = {"snapshot", "oom"}


class SnapshotError(Exception):
    """A snapshot that cannot be converted; the message says what is wrong with it."""


# ---------------------------------------------------------------------------------------------
# Loading


class Stub:
    """Inert stand-in for any class a snapshot names other than plain containers.

    It accepts whatever the pickle stream does to it (construction, state, items) and keeps
    it for inspection, but runs no code of the class it replaces.
    """

    stub_of = "?"

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        self.args, self.kwargs, self.state, self.items = args, kwargs, None, []
        return self

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def __setitem__(self, key, value):
        self.items.append((key, value))

    def append(self, value):
        self.items.append(value)

    def extend(self, values):
        self.items.extend(values)

    def add(self, value):
        self.items.append(value)

    def __repr__(self):
        return f"<stub for {self.stub_of}>"


_SAFE_CLASSES = {
    ("builtins", name): getattr(builtins, name)
    for name in ("dict", "list", "tuple", "set", "frozenset", "str", "bytes", "bytearray",
                 "int", "float", "complex", "bool")
}
_SAFE_CLASSES.update({("collections", name): getattr(collections, name)
                      for name in ("OrderedDict", "defaultdict", "deque", "Counter")})


class RestrictedUnpickler(pickle.Unpickler):
    """Builds builtins containers and numbers only; every other global becomes a Stub class."""

    def __init__(self, file):
        super().__init__(file)
        self._stubs = {}

    def find_class(self, module, name):
        key = ("builtins" if module == "__builtin__" else module, name)
        if key in _SAFE_CLASSES:
            return _SAFE_CLASSES[key]
        if key not in self._stubs:
            self._stubs[key] = type(str(name), (Stub,), {"stub_of": f"{module}.{name}"})
        return self._stubs[key]

    def persistent_load(self, pid):
        return self.find_class("persistent_id", "object")(pid)


def load_snapshot(path):
    """Returns the snapshot dict stored at `path`; raises SnapshotError if there is none."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise SnapshotError(f"cannot read: {e.strerror or e}") from None
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise SnapshotError(f"corrupt gzip data: {e}") from None
    try:
        obj = RestrictedUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # a malformed stream can raise almost anything
        raise SnapshotError(f"not a pickle ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise SnapshotError(f"not a memory snapshot: the pickle holds a {type(obj).__name__}, "
                            "not a dict")
    return obj


# ---------------------------------------------------------------------------------------------
# Conversion


def round_size(nbytes):
    """PyTorch's default round_size: at least 512, a multiple of 512."""
    return ROUND if nbytes < ROUND else (nbytes + ROUND - 1) // ROUND * ROUND


def _as_int(value):
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class _Ranges:
    """Disjoint half-open address ranges. Adjacent ranges stay separate so that segments
    keep their identity; O(n) per update, and a snapshot has few segment events."""

    def __init__(self):
        self._starts, self._ends = [], []

    def add(self, lo, hi):
        """Covers [lo, hi); returns the bytes not covered before."""
        gaps, at = [], lo
        for s, e in self._overlapping(lo, hi):
            if s > at:
                gaps.append((at, s))
            at = max(at, e)
        if at < hi:
            gaps.append((at, hi))
        for s, e in gaps:
            i = bisect.bisect_left(self._starts, s)
            self._starts.insert(i, s)
            self._ends.insert(i, e)
        return sum(e - s for s, e in gaps)

    def remove(self, lo, hi):
        """Uncovers [lo, hi); returns the bytes that were covered."""
        removed = 0
        for s, e in self._overlapping(lo, hi):
            i = bisect.bisect_left(self._starts, s)
            del self._starts[i], self._ends[i]
            removed += min(e, hi) - max(s, lo)
            for ps, pe in ((s, lo), (hi, e)):
                if ps < pe:
                    j = bisect.bisect_left(self._starts, ps)
                    self._starts.insert(j, ps)
                    self._ends.insert(j, pe)
        return removed

    def items(self):
        return list(zip(self._starts, self._ends))

    def _overlapping(self, lo, hi):
        i = max(bisect.bisect_right(self._starts, lo) - 1, 0)
        out = []
        while i < len(self._starts) and self._starts[i] < hi:
            if self._ends[i] > lo:
                out.append((self._starts[i], self._ends[i]))
            i += 1
        return out


@dataclass
class Conversion:
    """The trace lines of one device and what was counted on the way."""

    device: int
    lines: list = field(default_factory=list)
    allocations: int = 0
    frees: int = 0
    maps: int = 0
    unmaps: int = 0
    initial_allocations: int = 0   # emitted (only with include_initial)
    initial_segments: int = 0      # emitted (only with include_initial)
    free_requested: int = 0
    skipped: collections.Counter = field(default_factory=collections.Counter)
    warnings: collections.Counter = field(default_factory=collections.Counter)
    pre_existing: tuple = (0, 0, 0, 0)  # allocations, bytes, segments, bytes before the history
    peak_active: int = 0
    peak_reserved: int = 0
    streams: dict = field(default_factory=dict)  # PyTorch stream value -> small integer


def _device_trace(snapshot, device):
    traces = snapshot.get("device_traces")
    if traces is None:
        raise SnapshotError("no device_traces: was _record_memory_history() enabled before "
                            "_dump_snapshot()?")
    if not isinstance(traces, (list, tuple)):
        raise SnapshotError(f"device_traces is a {type(traces).__name__}, not a list")
    if device is None:
        busy = [i for i, t in enumerate(traces) if t]
        if len(busy) > 1:
            raise SnapshotError("events on devices " + ", ".join(map(str, busy)) +
                                ": choose one with --device")
        if not busy and not traces:
            raise SnapshotError("device_traces is empty")
        device = busy[0] if busy else 0
    if not 0 <= device < len(traces):
        raise SnapshotError(f"device {device} out of range: the snapshot has "
                            f"{len(traces)} device trace(s)")
    trace = traces[device]
    if not isinstance(trace, (list, tuple)):
        raise SnapshotError(f"device_traces[{device}] is a {type(trace).__name__}, not a list")
    return device, trace


def _entry(e):
    """(action, addr, size, stream) of a trace entry; addr/size None when unusable."""
    if not isinstance(e, dict):
        return None, None, None, None
    return e.get("action"), _as_int(e.get("addr")), _as_int(e.get("size")), e.get("stream")


def _device_segments(snapshot, device):
    segments = snapshot.get("segments") or []
    if not isinstance(segments, (list, tuple)):
        return []
    return [s for s in segments if isinstance(s, dict) and s.get("device", device) == device
            and _as_int(s.get("address")) is not None and _as_int(s.get("total_size"))]


def _initial_state(snapshot, device, trace):
    """What was held before the first entry: (segment ranges, [(addr, bytes, stream)]).

    Segments: the snapshot's segments (state at the end) with the history undone backwards.
    Allocations: frees of addresses never allocated in the history, in history order, then
    blocks still active at the end that no recorded alloc accounts for.
    """
    segments = _device_segments(snapshot, device)
    ranges = _Ranges()
    for seg in segments:
        ranges.add(seg["address"], seg["address"] + seg["total_size"])
    for e in reversed(trace):
        action, addr, size, _ = _entry(e)
        if addr is None or size is None:
            continue
        if action in MAP_ACTIONS:
            ranges.remove(addr, addr + size)
        elif action in UNMAP_ACTIONS:
            ranges.add(addr, addr + size)

    live, allocs, seen = set(), [], set()
    for e in trace:
        action, addr, size, stream = _entry(e)
        if addr is None:
            continue
        if action in ALLOC_ACTIONS:
            live.add(addr)
        elif action in FREE_ACTIONS:
            if addr in live:
                live.discard(addr)
            elif addr not in seen and size is not None:
                seen.add(addr)
                allocs.append((addr, round_size(size), stream))
    for seg in segments:
        offset = seg["address"]
        for b in seg.get("blocks") or []:
            if not isinstance(b, dict):
                continue
            bsize = _as_int(b.get("size")) or 0
            addr = _as_int(b.get("address"))
            addr = offset if addr is None else addr  # old snapshots: blocks lie back to back
            offset = addr + bsize
            state = b.get("state")
            if (isinstance(state, str) and state.startswith("active")
                    and addr not in live and addr not in seen):
                requested = _as_int(b.get("requested_size"))
                seen.add(addr)
                allocs.append((addr, round_size(requested) if requested else bsize,
                               seg.get("stream")))
    return ranges, allocs


def convert(snapshot, device=None, include_initial=False):
    """Converts a loaded snapshot dict; raises SnapshotError if it has no usable trace."""
    device, trace = _device_trace(snapshot, device)
    out = Conversion(device=device)
    lines = out.lines
    initial_ranges, initial_allocs = _initial_state(snapshot, device, trace)
    segs = initial_ranges.items()
    out.pre_existing = (len(initial_allocs), sum(b for _, b, _ in initial_allocs),
                        len(segs), sum(e - s for s, e in segs))

    addr_to_id, id_size = {}, []
    active = reserved = 0

    def stream_no(stream):
        key = stream if isinstance(stream, (int, str, type(None))) else repr(stream)
        return out.streams.setdefault(key, len(out.streams))

    def alloc(addr, nbytes, stream):
        nonlocal active
        old = addr_to_id.pop(addr, None)
        if old is not None:  # its free is missing from the history; the memory was reused
            out.warnings["alloc at an address still live (free emitted first)"] += 1
            free(old)
        addr_to_id[addr] = len(id_size)
        lines.append(f"a,{len(id_size)},{nbytes},{stream_no(stream)}")
        id_size.append(nbytes)
        out.allocations += 1
        active += nbytes
        out.peak_active = max(out.peak_active, active)

    def free(ident):
        nonlocal active
        lines.append(f"f,{ident}")
        out.frees += 1
        active -= id_size[ident]

    ranges = _Ranges()
    if include_initial:
        for lo, hi in segs:
            ranges.add(lo, hi)
            lines.append(f"S,{hi - lo}")
            reserved += hi - lo
        out.initial_segments = len(segs)
        out.maps += len(segs)
        out.peak_reserved = reserved
        for addr, nbytes, stream in initial_allocs:
            alloc(addr, nbytes, stream)
        out.initial_allocations = len(initial_allocs)

    for e in trace:
        action, addr, size, stream = _entry(e)
        if action in ALLOC_ACTIONS | FREE_ACTIONS | MAP_ACTIONS | UNMAP_ACTIONS and (
                addr is None or (size is None and action not in FREE_ACTIONS)):
            out.skipped[f"malformed {action}"] += 1
        elif action in ALLOC_ACTIONS:
            alloc(addr, round_size(size), stream)
        elif action in FREE_ACTIONS:
            ident = addr_to_id.pop(addr, None)
            if ident is None:
                out.skipped["free of an address not allocated in the history"] += 1
            else:
                free(ident)
        elif action in IGNORED_ACTIONS:
            out.free_requested += 1
        elif action in MAP_ACTIONS:
            if ranges.add(addr, addr + size) != size:
                out.warnings["map over memory already mapped"] += 1
            lines.append(f"S,{size}")
            out.maps += 1
            reserved += size
            out.peak_reserved = max(out.peak_reserved, reserved)
        elif action in UNMAP_ACTIONS:
            removed = ranges.remove(addr, addr + size)
            if removed == 0:
                out.skipped["unmap of memory not mapped in the history"] += 1
                continue
            if removed != size:
                out.warnings["unmap partly of memory not mapped in the history"] += 1
            lines.append(f"U,{removed}")
            out.unmaps += 1
            reserved -= removed
        elif action in SKIPPED_ACTIONS:
            out.skipped[action] += 1
        else:
            out.skipped[f"unknown action {action!r}"] += 1
    return out


# ---------------------------------------------------------------------------------------------
# Command line


def _gib(n):
    return f"{n / 2**30:.3f} GiB"


def _report(path, conv, include_initial, err):
    for what, n in sorted(conv.skipped.items()):
        print(f"{PROG}: {path}: skipped {n} x {what}", file=err)
    for what, n in sorted(conv.warnings.items()):
        print(f"{PROG}: {path}: warning: {n} x {what}", file=err)
    n_alloc, alloc_bytes, n_seg, seg_bytes = conv.pre_existing
    if not include_initial and (n_alloc or n_seg):
        print(f"{PROG}: {path}: note: {n_alloc} allocation(s) of {alloc_bytes} bytes and "
              f"{n_seg} segment(s) of {seg_bytes} bytes existed before the history began; "
              "--include-initial adds them", file=err)
    initial = (f" ({conv.initial_allocations} initial, {conv.initial_segments} initial "
               "segments)" if include_initial else "")
    print(f"{PROG}: {path}: device {conv.device}: {conv.allocations} allocations{initial}, "
          f"{conv.frees} frees, {conv.maps} segments mapped, {conv.unmaps} unmapped, "
          f"{sum(conv.skipped.values())} entries skipped, {conv.free_requested} free_requested "
          f"ignored, {len(conv.streams)} stream(s); peak active {conv.peak_active} bytes "
          f"({_gib(conv.peak_active)}), peak reserved {conv.peak_reserved} bytes "
          f"({_gib(conv.peak_reserved)})", file=err)


def _write(lines, output):
    text = "".join(line + "\n" for line in lines)
    if output in (None, "-"):
        sys.stdout.write(text)
        sys.stdout.flush()
    elif output.endswith(".gz"):
        with gzip.open(output, "wt", encoding="ascii") as f:
            f.write(text)
    else:
        with open(output, "w", encoding="ascii") as f:
            f.write(text)


def _parser():
    p = argparse.ArgumentParser(prog=os.path.basename(sys.argv[0]) or PROG,
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="snapshot written by torch.cuda.memory._dump_snapshot "
                                 "(pickle, optionally gzip-compressed)")
    p.add_argument("-o", "--output", default="-",
                   help="trace file to write; a .gz suffix compresses it; '-' (default) "
                        "writes to stdout")
    p.add_argument("--device", type=int, default=None, metavar="N",
                   help="device whose trace to convert (default: the only device with "
                        "events; an error if several have events)")
    p.add_argument("--include-initial", action="store_true",
                   help="first emit the segments and allocations that existed before the "
                        "history began (off by default)")
    return p


def main(argv=None):
    """Runs the command line; returns the exit status (0, or 2 for a bad snapshot)."""
    args = _parser().parse_args(argv)
    try:
        conv = convert(load_snapshot(args.input), args.device, args.include_initial)
    except SnapshotError as e:
        print(f"{PROG}: error: {args.input}: {e}", file=sys.stderr)
        return 2
    try:
        _write(conv.lines, args.output)
    except OSError as e:
        print(f"{PROG}: error: {args.output}: cannot write: {e.strerror or e}", file=sys.stderr)
        return 2
    _report(args.input, conv, args.include_initial, sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
