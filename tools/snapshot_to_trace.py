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
is read as 'free_completed'. gzip-compressed input is accepted too.

A snapshot is untrusted input. Its pickle opcodes are checked before any runs: persistent ids,
extension codes, INST/OBJ, a BUILD on a class, tuples nested over 100 deep and memo indices out
of sequence are refused. Every class it names becomes an inert stub made for this load, so a
snapshot from any torch version loads, nothing in it is executed and nothing outlives the load.
The (decompressed) pickle may hold at most --max-input-bytes (1 GiB). Entries must be dicts with
a string action and an int, str or None stream; sizes lie in 0..2^48 and addresses in 0..2^64-1.
convert_bytes() converts from memory, for fuzzing.

A one-line summary goes to stderr. Errors, whatever the input, are one line naming the file,
with control characters escaped; exit status 2.
"""

import argparse
import bisect
import collections
import gzip
import io
import os
import pickle
import sys
import zlib
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
#
# A snapshot is untrusted input. torch writes it with pickle.dump of plain dicts, lists, strings
# and numbers, so loading needs no class at all; the pickle's opcodes are checked first (_scan)
# and only then run by pickle's own unpickler, whose find_class hands out inert stubs.


MAX_INPUT_BYTES = 1 << 30  # default bound on the (decompressed) pickle; --max-input-bytes
MAX_SIZE = 1 << 48         # the largest size or segment a trace may carry (glake-replay's bound)
MAX_ADDRESS = (1 << 64) - 1
_MAX_TUPLE_DEPTH = 100     # hashing a deeper tuple recurses in C, unguarded, and can crash
_MAX_CLASSES = 1000        # distinct classes stubbed in one load
_MAX_STACK = 1 << 20       # items on the unpickler's stack at once: a snapshot's pickle holds at
                           # most a batch of 1000 per open container; a flood of NONE opcodes more


def _printable(text, limit=None):
    """`text` safe for a terminal: non-printable characters escaped, cut at `limit` with '...'."""
    text = str(text)
    cut = limit is not None and len(text) > limit
    if cut:
        text = text[:limit]
    if not text.isprintable():
        text = "".join(c if c.isprintable() else
                       (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
                       for c in text)
    return text + "..." if cut else text


def _type_name(value):
    """'a list', 'an int', 'a stub for torch.Foo': what a value is, for messages."""
    name = type(value).__name__ if not isinstance(value, Stub) else _printable(value.stub_of, 60)
    return ("an " if name[:1] in tuple("aeiou") else "a ") + name


class Stub:
    """Inert stand-in for any class a snapshot names.

    It accepts whatever the pickle stream does to an instance (construction, state, items) and
    keeps it for inspection, but runs no code of the class it replaces. Each load makes its own
    stub classes, so nothing a pickle does to one outlives the load.
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


class RestrictedUnpickler(pickle.Unpickler):
    """Every global a pickle names becomes a Stub subclass made for this load; nothing is looked up.

    Run it only on data _scan accepted: _scan refuses persistent ids, extension codes and the
    INST/OBJ opcodes, and a BUILD on a class.
    """

    def __init__(self, file):
        super().__init__(file)
        self._stubs = {}

    def find_class(self, module, name):
        key = (module, name)
        if key not in self._stubs:
            if len(self._stubs) >= _MAX_CLASSES:
                raise SnapshotError(f"not a memory snapshot: names more than {_MAX_CLASSES} classes")
            self._stubs[key] = type("Stub", (Stub,), {
                "stub_of": _printable(f"{module}.{name}", 100)})
        return self._stubs[key]

    def persistent_load(self, pid):
        raise SnapshotError("not a memory snapshot: the pickle holds a persistent id")


def _opcode_tables():
    """Per opcode byte: how its argument is laid out, and what it does to the stack."""
    arg, effect = [None] * 256, [None] * 256

    def op(code, argument, what):
        arg[code[0]], effect[code[0]] = argument, what

    P = pickle
    for code in (P.NONE, P.NEWTRUE, P.NEWFALSE, P.EMPTY_LIST, P.EMPTY_DICT, P.EMPTY_SET):
        op(code, 0, "push")
    for code, size in ((P.BININT, 4), (P.BININT1, 1), (P.BININT2, 2), (P.BINFLOAT, 8)):
        op(code, size, "push")
    for code in (P.SHORT_BINUNICODE, P.SHORT_BINBYTES, P.SHORT_BINSTRING, P.LONG1):
        op(code, -1, "push")
    for code in (P.BINUNICODE, P.BINBYTES, P.BINSTRING, P.LONG4):
        op(code, -4, "push")
    for code in (P.BINUNICODE8, P.BINBYTES8, P.BYTEARRAY8):
        op(code, -8, "push")
    for code in (P.INT, P.LONG, P.FLOAT, P.STRING, P.UNICODE):
        op(code, "line", "push")
    op(P.MEMOIZE, 0, "memoize")
    op(P.BINPUT, 1, "put")
    op(P.LONG_BINPUT, 4, "put")
    op(P.PUT, "line", "put")
    op(P.BINGET, 1, "get")
    op(P.LONG_BINGET, 4, "get")
    op(P.GET, "line", "get")
    op(P.MARK, 0, "mark")
    for code in (P.APPENDS, P.SETITEMS, P.ADDITEMS):
        op(code, 0, "fill")
    op(P.APPEND, 0, "append")
    op(P.SETITEM, 0, "setitem")
    op(P.LIST, 0, "container")
    op(P.DICT, 0, "container")
    op(P.TUPLE, 0, "tuple")
    op(P.FROZENSET, 0, "tuple")
    op(P.EMPTY_TUPLE, 0, "tuple0")
    op(P.TUPLE1, 0, 1)
    op(P.TUPLE2, 0, 2)
    op(P.TUPLE3, 0, 3)
    op(P.GLOBAL, "lines", "global")
    op(P.STACK_GLOBAL, 0, "stack_global")
    op(P.REDUCE, 0, "call")
    op(P.NEWOBJ, 0, "call")
    op(P.NEWOBJ_EX, 0, "call_ex")
    op(P.BUILD, 0, "build")
    op(P.POP, 0, "pop")
    op(P.POP_MARK, 0, "pop_mark")
    op(P.DUP, 0, "dup")
    op(P.PROTO, 1, "proto")
    op(P.FRAME, 8, "frame")
    op(P.STOP, 0, "stop")
    return arg, effect


_ARG, _EFFECT = _opcode_tables()
_OPCODE_NAMES = {code[0]: name for name, code in vars(pickle).items()
                 if name.isupper() and isinstance(code, bytes) and len(code) == 1}


def _scan(data):
    """Checks a pickle's opcodes before pickle runs them; raises SnapshotError if it holds one that
    a snapshot never needs (persistent ids, extension codes, INST/OBJ, out-of-band buffers), sets
    the state of a class rather than of an instance (BUILD on a global), calls anything but a
    class, nests tuples deeper than _MAX_TUPLE_DEPTH, or names a memo slot beyond the next free one
    (the unpickler's memo is an array as long as the largest index)."""
    arg, effect = _ARG, _EFFECT
    stack, marks, memo = [], [], {}  # per stack item: tuple nesting depth, or a global's name
    n, pos = len(data), 0

    def fail(message):
        raise SnapshotError(f"not a pickle ({message} at byte {start})")

    try:
        while pos < n:
            start = pos
            code = data[pos]
            a, e = arg[code], effect[code]
            pos += 1
            if a == 0:
                pass
            elif a == -1:
                pos += 1 + data[pos]
            elif a.__class__ is int:
                if a > 0:
                    argument = data[pos:pos + a]
                    pos += a
                else:
                    pos += -a + int.from_bytes(data[pos:pos - a], "little")
            elif a == "line" or a == "lines":
                end = data.find(b"\n", pos)
                if a == "lines" and end >= 0:
                    end = data.find(b"\n", end + 1)
                if end < 0:
                    fail("unterminated text argument")
                argument = data[pos:end]
                pos = end + 1
            else:
                name = _OPCODE_NAMES.get(code)
                if name is None:
                    fail(f"unknown opcode 0x{code:02x}")
                raise SnapshotError(f"not a memory snapshot: the pickle uses {name} (byte {start}), "
                                    "which a snapshot never needs")
            if pos > n:
                fail("truncated argument")

            if e == "push":
                stack.append(0)
                if len(stack) > _MAX_STACK:
                    fail(f"more than {_MAX_STACK} items on the stack")
            elif e == "memoize":
                memo[len(memo)] = stack[-1]
            elif e == "get":
                stack.append(memo[int(argument) if a == "line" else
                                  int.from_bytes(argument, "little")])
            elif e == "mark":
                marks.append(len(stack))
            elif e == "fill":
                m = marks.pop()
                if m == 0:
                    fail("nothing to fill")
                del stack[m:]
            elif e == "put":
                index = int(argument) if a == "line" else int.from_bytes(argument, "little")
                if index > len(memo):
                    fail(f"memo index {index} out of sequence")
                memo[index] = stack[-1]
            elif e == "append":
                stack.pop()
                stack[-1]
            elif e == "setitem":
                del stack[-2:]
                stack[-1]
            elif e == "container":
                del stack[marks.pop():]
                stack.append(0)
            elif e == "tuple" or e.__class__ is int:
                m = marks.pop() if e == "tuple" else len(stack) - e
                if m < 0:
                    fail("stack underflow")
                depth = 1 + max((d for d in stack[m:] if d.__class__ is int), default=0)
                if depth > _MAX_TUPLE_DEPTH:
                    fail(f"tuples nested more than {_MAX_TUPLE_DEPTH} deep")
                del stack[m:]
                stack.append(depth)
            elif e == "tuple0":
                stack.append(1)
            elif e == "global":
                stack.append(_printable(argument.decode("utf-8", "replace").replace("\n", "."), 100))
            elif e == "stack_global":
                del stack[-2:]
                stack.append("a class")
            elif e == "call" or e == "call_ex":
                del stack[-(2 if e == "call_ex" else 1):]
                if stack[-1].__class__ is not str:
                    fail("a call of something other than a class")
                stack[-1] = 0
            elif e == "build":
                stack.pop()
                if stack[-1].__class__ is str:
                    raise SnapshotError(f"not a memory snapshot: the pickle sets the state of the "
                                        f"class {stack[-1]} itself (BUILD at byte {start})")
            elif e == "pop":
                if marks and marks[-1] == len(stack):
                    marks.pop()
                else:
                    stack.pop()
            elif e == "pop_mark":
                del stack[marks.pop():]
            elif e == "dup":
                stack.append(stack[-1])
            elif e == "proto":
                if argument[0] > pickle.HIGHEST_PROTOCOL:
                    fail(f"unsupported protocol {argument[0]}")
            elif e == "stop":
                stack.pop()
                return
    except (IndexError, KeyError, ValueError) as error:
        fail({IndexError: "stack underflow", KeyError: "memo key missing",
              ValueError: "bad memo index"}[type(error)])
    raise SnapshotError("not a pickle (no STOP opcode: truncated?)")


def _decompress(data, max_bytes):
    """The contents of gzip `data`, read in pieces up to max_bytes so that a small file cannot
    inflate without bound."""
    out = io.BytesIO()
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as f:
            while True:
                piece = f.read(min(1 << 20, max_bytes + 1 - out.tell()))
                if not piece:
                    break
                out.write(piece)
                if out.tell() > max_bytes:
                    raise SnapshotError(f"gzip data decompresses to more than {max_bytes} bytes "
                                        "(--max-input-bytes raises the limit)")
    except (OSError, EOFError, zlib.error) as e:
        raise SnapshotError(f"corrupt gzip data: {_printable(e, 200)}") from None
    return out.getvalue()


def load_snapshot_bytes(data, max_bytes=MAX_INPUT_BYTES):
    """The snapshot dict in `data` (a pickle, or a gzip-compressed one); raises SnapshotError if
    there is none."""
    if len(data) > max_bytes:
        raise SnapshotError(f"more than {max_bytes} bytes (--max-input-bytes raises the limit)")
    if data[:2] == b"\x1f\x8b":
        data = _decompress(data, max_bytes)
    _scan(data)
    try:
        obj = RestrictedUnpickler(io.BytesIO(data)).load()
    except SnapshotError:
        raise
    except Exception as e:  # a malformed stream can raise almost anything, MemoryError included
        raise SnapshotError(f"not a pickle ({type(e).__name__}: {_printable(e, 200)})") from None
    if not isinstance(obj, dict):
        raise SnapshotError(f"not a memory snapshot: the pickle holds {_type_name(obj)}, "
                            "not a dict")
    return obj


def load_snapshot(path, max_bytes=MAX_INPUT_BYTES):
    """Returns the snapshot dict stored at `path`; raises SnapshotError if there is none."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size  # 0 for a pipe: then read up to the limit
            if size > max_bytes:
                raise SnapshotError(f"more than {max_bytes} bytes (--max-input-bytes raises "
                                    "the limit)")
            data = f.read() if size else f.read(max_bytes + 1)
    except OSError as e:
        raise SnapshotError(f"cannot read: {_printable(e.strerror or e, 200)}") from None
    return load_snapshot_bytes(data, max_bytes)


# ---------------------------------------------------------------------------------------------
# Conversion


def round_size(nbytes):
    """PyTorch's default round_size: at least 512, a multiple of 512."""
    return ROUND if nbytes < ROUND else (nbytes + ROUND - 1) // ROUND * ROUND


def _as_int(value):
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class _Coverage:
    """The addresses covered by half-open ranges, merged where they overlap or touch, kept sorted in
    blocks of at most 2 * _LOAD (start, end) pairs (a list of short lists, as sortedcontainers
    keeps its lists). add and remove cost O(log n + _LOAD) plus the ranges they absorb, and each
    range is absorbed once, so n events cost O(n log n) whatever their addresses (a flat list
    costs O(n) a move, quadratic in a history of segment events)."""

    _LOAD = 256

    def __init__(self):
        self._blocks = []  # lists of disjoint (start, end), in order across blocks
        self._firsts = []  # each block's first start, for bisect

    def add(self, lo, hi, edges=None):
        """Covers [lo, hi); returns the bytes not covered before. `edges` (a set), when given,
        gets the ends of each stretch that was not covered."""
        taken = self._take(lo, hi, True)
        covered, at = 0, lo
        for s, e in taken:
            covered += max(min(e, hi) - max(s, lo), 0)
            if edges is not None and s > at:
                edges.update((at, min(s, hi)))
            at = max(at, e)
        if edges is not None and at < hi:
            edges.update((at, hi))
        self._put(min(lo, taken[0][0]) if taken else lo, max(hi, taken[-1][1]) if taken else hi)
        return (hi - lo) - covered

    def remove(self, lo, hi, edges=None):
        """Uncovers [lo, hi); returns the bytes that were covered. `edges` (a set), when given,
        gets the points where a covered stretch was cut."""
        taken = self._take(lo, hi, False)
        removed = sum(min(e, hi) - max(s, lo) for s, e in taken)
        if taken and taken[0][0] < lo:
            self._put(taken[0][0], lo)
            if edges is not None:
                edges.add(lo)
        if taken and taken[-1][1] > hi:
            self._put(hi, taken[-1][1])
            if edges is not None:
                edges.add(hi)
        return removed

    def items(self):
        return [r for block in self._blocks for r in block]

    def _take(self, lo, hi, touching):
        """Removes and returns, in order, the ranges that meet [lo, hi) (or touch it)."""
        blocks, firsts = self._blocks, self._firsts
        if not blocks:
            return []
        b = max(bisect.bisect_right(firsts, lo) - 1, 0)
        block = blocks[b]
        i = max(bisect.bisect_right(block, (lo, MAX_ADDRESS + 1)) - 1, 0)
        if i < len(block) and not (block[i][1] > lo or (touching and block[i][1] == lo)):
            i += 1
        taken = []
        while b < len(blocks):
            block = blocks[b]
            j = i
            while j < len(block) and (block[j][0] < hi or (touching and block[j][0] == hi)):
                j += 1
            ended = j < len(block)
            if i < j:
                taken.extend(block[i:j])
                del block[i:j]
            if block:
                firsts[b] = block[0][0]
                b += 1
            else:
                del blocks[b], firsts[b]
            if ended:
                break
            i = 0
        return taken

    def _put(self, start, end):
        blocks, firsts = self._blocks, self._firsts
        if not blocks:
            blocks.append([(start, end)])
            firsts.append(start)
            return
        b = max(bisect.bisect_right(firsts, start) - 1, 0)
        block = blocks[b]
        bisect.insort(block, (start, end))
        firsts[b] = block[0][0]
        if len(block) > 2 * self._LOAD:
            half = len(block) // 2
            blocks.insert(b + 1, block[half:])
            firsts.insert(b + 1, block[half][0])
            del block[half:]


def _split_at(ranges, points):
    """`ranges` (sorted, disjoint) cut at each of the sorted `points` inside one: the segments a
    merged coverage was made of, as far as the history's boundaries tell."""
    pieces = []
    for start, end in ranges:
        i = bisect.bisect_right(points, start)
        while i < len(points) and points[i] < end:
            pieces.append((start, points[i]))
            start = points[i]
            i += 1
        pieces.append((start, end))
    return pieces


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
        raise SnapshotError(f"device_traces is {_type_name(traces)}, not a list")
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
        raise SnapshotError(f"device_traces[{device}] is {_type_name(trace)}, not a list")
    return device, trace


def _checked(where, what, value, maximum):
    """`value` if it is an int from 0 to `maximum` (2^48 or 2^64 - 1), None if it is missing or
    not an int."""
    value = _as_int(value)
    if value is not None and not 0 <= value <= maximum:
        shown = value if abs(value) < 1 << 64 else f"of {value.bit_length()} bits"
        bound = "2^48" if maximum == MAX_SIZE else "2^64 - 1"
        raise SnapshotError(f"{where}: {what} {shown} is out of range (0 to {bound})")
    return value


def _stream(where, value):
    if value is not None and not isinstance(value, (int, str)):
        raise SnapshotError(f"{where}: stream is {_type_name(value)}, not an integer")
    return value


def _sequence(where, value):
    """`value` if it is a list or tuple, () if it is missing."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise SnapshotError(f"{where} is {_type_name(value)}, not a list")
    return value


def _entries(trace, device):
    """(action, addr, size, stream) of each entry, checked; addr/size None when missing."""
    out = []
    for i, e in enumerate(trace):
        where = f"device_traces[{device}][{i}]"
        if not isinstance(e, dict):
            raise SnapshotError(f"{where} is {_type_name(e)}, not a dict")
        action = e.get("action")
        if not isinstance(action, str):
            raise SnapshotError(f"{where}: action is {_type_name(action)}, not a string")
        out.append((action, _checked(where, "addr", e.get("addr"), MAX_ADDRESS),
                    _checked(where, "size", e.get("size"), MAX_SIZE),
                    _stream(where, e.get("stream"))))
    return out


def _device_segments(snapshot, device):
    """The snapshot's segments on `device`, checked, as (address, total_size, stream, blocks),
    blocks as (address or None, size, requested_size or None, state)."""
    out = []
    for i, seg in enumerate(_sequence("segments", snapshot.get("segments"))):
        where = f"segments[{i}]"
        if not isinstance(seg, dict):
            raise SnapshotError(f"{where} is {_type_name(seg)}, not a dict")
        if seg.get("device", device) != device:
            continue
        address = _checked(where, "address", seg.get("address"), MAX_ADDRESS)
        total = _checked(where, "total_size", seg.get("total_size"), MAX_SIZE)
        stream = _stream(where, seg.get("stream"))
        blocks = []
        for j, b in enumerate(_sequence(f"{where}.blocks", seg.get("blocks"))):
            bwhere = f"{where}.blocks[{j}]"
            if not isinstance(b, dict):
                raise SnapshotError(f"{bwhere} is {_type_name(b)}, not a dict")
            blocks.append((_checked(bwhere, "address", b.get("address"), MAX_ADDRESS),
                           _checked(bwhere, "size", b.get("size"), MAX_SIZE) or 0,
                           _checked(bwhere, "requested_size", b.get("requested_size"),
                                    MAX_SIZE),
                           b.get("state")))
        if address is not None and total:
            out.append((address, total, stream, blocks))
    return out


def _initial_state(snapshot, device, trace):
    """What was held before the first entry: ([(start, end)] of segments, [(addr, bytes, stream)]).

    Segments: the snapshot's segments (state at the end) with the history undone backwards.
    Allocations: frees of addresses never allocated in the history, in history order, then
    blocks still active at the end that no recorded alloc accounts for.
    """
    segments = _device_segments(snapshot, device)
    # Merged, with the points where segments met (a segment's ends, the ends of what an undone
    # unmap added, where an undone map cut a segment) to cut them apart again at the end.
    ranges, points = _Coverage(), set()
    for address, total, _, _ in segments:
        ranges.add(address, address + total, points)
    for action, addr, size, _ in reversed(trace):
        if addr is None or size is None:
            continue
        if action in MAP_ACTIONS:
            ranges.remove(addr, addr + size, points)
        elif action in UNMAP_ACTIONS:
            ranges.add(addr, addr + size, points)

    live, allocs, seen = set(), [], set()
    for action, addr, size, stream in trace:
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
    for offset, _, seg_stream, blocks in segments:
        for addr, bsize, requested, state in blocks:
            addr = offset if addr is None else addr  # old snapshots: blocks lie back to back
            offset = addr + bsize
            if (isinstance(state, str) and state.startswith("active")
                    and addr not in live and addr not in seen):
                seen.add(addr)
                allocs.append((addr, round_size(requested) if requested else bsize, seg_stream))
    return _split_at(ranges.items(), sorted(points)), allocs


def convert(snapshot, device=None, include_initial=False):
    """Converts a loaded snapshot dict; raises SnapshotError if it has no usable trace."""
    device, trace = _device_trace(snapshot, device)
    trace = _entries(trace, device)
    out = Conversion(device=device)
    lines = out.lines
    initial_ranges, initial_allocs = _initial_state(snapshot, device, trace)
    segs = initial_ranges
    out.pre_existing = (len(initial_allocs), sum(b for _, b, _ in initial_allocs),
                        len(segs), sum(e - s for s, e in segs))

    addr_to_id, id_size = {}, []
    active = reserved = 0

    def stream_no(stream):
        return out.streams.setdefault(stream, len(out.streams))

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

    ranges = _Coverage()
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

    for action, addr, size, stream in trace:
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
        elif len(out.skipped) < 20:
            out.skipped[f"unknown action {_printable(repr(action), 40)}"] += 1
        else:
            out.skipped["unknown action (others)"] += 1
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
    p.add_argument("--max-input-bytes", type=int, default=MAX_INPUT_BYTES, metavar="N",
                   help="refuse a snapshot larger than N bytes, after decompression "
                        f"(default {MAX_INPUT_BYTES}, 1 GiB)")
    return p


def convert_bytes(data, device=None, include_initial=False, max_bytes=MAX_INPUT_BYTES):
    """The trace text (one event a line, each ending in a newline) of the snapshot held in `data`,
    a pickle or a gzip-compressed one, as the command line would write it; touches no file.

    Contract (what a fuzz harness may rely on): for any bytes, it returns a str or raises
    SnapshotError, whose message is one printable line of at most a few hundred characters. Any
    other exception is a bug. Memory is bounded by `max_bytes` (the decompressed pickle) times the
    unpickler's constant factor; nothing in `data` is executed.
    """
    conv = convert(load_snapshot_bytes(data, max_bytes), device, include_initial)
    return "".join(line + "\n" for line in conv.lines)


def main(argv=None):
    """Runs the command line; returns the exit status (0, or 2 for a bad snapshot)."""
    args = _parser().parse_args(argv)
    path = _printable(args.input)
    try:
        conv = convert(load_snapshot(args.input, args.max_input_bytes), args.device,
                       args.include_initial)
    except SnapshotError as e:
        print(f"{PROG}: error: {path}: {_printable(e, 500)}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a bug, MemoryError or RecursionError: still one line
        print(f"{PROG}: error: {path}: cannot convert ({type(e).__name__}: {_printable(e, 200)})",
              file=sys.stderr)
        return 2
    try:
        _write(conv.lines, args.output)
    except OSError as e:
        print(f"{PROG}: error: {_printable(args.output)}: cannot write: "
              f"{_printable(e.strerror or e, 200)}", file=sys.stderr)
        return 2
    _report(path, conv, args.include_initial, sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
