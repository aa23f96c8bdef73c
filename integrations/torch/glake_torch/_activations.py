"""Saved activations moved to pinned host memory during the forward pass and brought back ahead of
the backward pass, without the compute stream or the launching thread waiting for the copies:
glake_torch.offload_activations.

    with glake_torch.offload_activations(model.model.layers, fraction=0.5):
        loss = model(batch).loss
    loss.backward()

    model = glake_torch.offload_activations.wrap(model, fraction=0.5)   # the same, every forward

Note [Saved activations away] (docs/offload.md, "Activations for the backward pass")

Rationale. Autograd keeps the tensors each operation saves for backward on the device from the
forward pass until backward uses them, the first blocks' longest. Copying them to host memory
while the later blocks compute, and back while the blocks above them run backward, lowers the
peak by what was away; the copies cost nothing where they overlap compute.

Approach. A torch.autograd.graph.saved_tensors_hooks pair. pack sorts each saved tensor into a
unit (a block of `blocks`, the stretch between two blocks, or, without blocks, the tensor itself,
in the order of the forward pass), skips what cannot or need not move (under `min_bytes`,
parameters and views or casts of them, tensors not on the device), and keys the rest by storage
and version, so that a storage saved twice moves once. A policy (Fraction, DeviceBytes, Budget)
picks from the previous forward pass's units which go, earliest first: their copies overlap the
blocks after them, and the last blocks, needed first in backward, stay. The first forward pass,
with no units seen yet, sends the blocks a policy names from their count alone (Fraction: the
first `fraction` of them) or, where it names none, every eligible tensor. Each copy goes on an offload stream that
waits for the compute stream (an event, not the host), into a pinned buffer of a pool reused across
steps; the device storage is marked used by the offload stream (record_stream) and dropped, so
the allocator reuses it only once the copy is done. The launching thread waits only when the
pending copies hold more than the forward pass's end allows (`max_inflight_bytes` plus what the
kept units still to come will add): the caching allocator serves memory at launch time, so a
forward pass launched far ahead of its copies would allocate before any of them freed anything. In backward, a gradient hook on each block's output (it fires before the block's
backward) and every unpack bring the tensors below back on a prefetch stream, `prefetch_bytes`
ahead; unpack makes the compute stream wait for its tensor's event.

Limits. A storage moves whole (a small view of a large storage moves all of it). PyTorch checks
a saved tensor's version only without hooks, so a saved tensor modified in place after it was
saved (an error without hooks) goes unnoticed here, and its copy may see either value. Casts of
frozen parameters under autocast look like activations and may move (autocast's cache keeps them
on the device anyway). A second backward over the same graph (retain_graph) brings the tensors
back again, without lookahead, and needs retain_graph=True here too. Thread safety: one forward pass at a time per object; the pool
is locked (buffers come back from the autograd thread)."""

import collections
import threading
import time
import weakref

__all__ = ["offload_activations"]


# -- Policies -------------------------------------------------------------------------------------
#
# A policy is any object with select(unit_bytes) -> iterable of unit indices to offload, where
# unit_bytes lists the eligible bytes of each unit of the last forward pass, in forward order.
#
# | expression             | returns                 | meaning                                          |
# |------------------------|-------------------------|--------------------------------------------------|
# | p.select(unit_bytes)   | iterable of int indices | the units whose saved tensors go to host memory  |
#
# The three below pick a prefix (earliest first): those copies have the most compute to hide
# behind, and the units needed first in backward stay.
#
# Optional: p.first_pass(block_count) -> iterable of block indices: what goes in the first forward
# pass, before any unit was seen (without it, every eligible tensor goes then).


def _prefix(unit_bytes, keep_going):
    chosen, total = [], 0
    for i, n in enumerate(unit_bytes):
        if not keep_going(total, n):
            break
        chosen.append(i)
        total += n
    return chosen


class Fraction:
    """The earliest units whose bytes come nearest `fraction` of all eligible bytes (a unit goes
    when at least half of it fits under the target)."""

    def __init__(self, fraction):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"glake_torch.offload_activations: fraction must be within [0, 1], not {fraction}")
        self.fraction = float(fraction)

    def select(self, unit_bytes):
        target = self.fraction * sum(unit_bytes)
        return _prefix(unit_bytes, lambda total, n: n > 0 and total + n / 2 <= target or n == 0 and total < target)

    def first_pass(self, block_count):
        return range(round(self.fraction * block_count))

    def __repr__(self):
        return f"Fraction({self.fraction})"


class DeviceBytes:
    """The fewest earliest units such that at most `max_device_bytes` of eligible bytes stay."""

    def __init__(self, max_device_bytes):
        if max_device_bytes < 0:
            raise ValueError(f"glake_torch.offload_activations: max_device_bytes of {max_device_bytes}")
        self.max_device_bytes = int(max_device_bytes)

    def select(self, unit_bytes):
        total = sum(unit_bytes)
        return _prefix(unit_bytes, lambda gone, n: total - gone > self.max_device_bytes)

    def __repr__(self):
        return f"DeviceBytes({self.max_device_bytes})"


class Budget:
    """Keeps the step within `budget` bytes of device memory: what else is in use when the forward
    pass begins (`in_use()`, bytes) is taken from it and the rest is what activations may keep
    (DeviceBytes). With a glake_torch.Scheduler, its managed tensors count at its budget (it fills
    up to it during the step) instead of at what they hold when the forward pass begins."""

    def __init__(self, budget, in_use, scheduler=None):
        self.budget = int(budget)
        self.in_use = in_use
        self.scheduler = scheduler
        self.last_allowance = None

    def allowance(self):
        other = self.in_use()
        if self.scheduler is not None:
            other += self.scheduler.budget - self.scheduler.stats().get("device_bytes", 0)
        return max(0, self.budget - other)

    def select(self, unit_bytes):
        self.last_allowance = self.allowance()
        return DeviceBytes(self.last_allowance).select(unit_bytes)

    def __repr__(self):
        return f"Budget({self.budget})"


# -- Transports: where copies run -------------------------------------------------------------------


class _PinnedPool:
    """Pinned host buffers by exact size, reused across steps (the sizes of one step recur in the
    next). A buffer comes back with the event after which nothing reads or writes it; whoever
    takes it next orders its copy after that event. Buffers unused for a whole step are freed.
    Locked: buffers come back from the autograd thread."""

    def __init__(self, make):
        self.make = make
        self.free = collections.defaultdict(list)  # nbytes -> [(buffer, event, step)]
        self.lock = threading.Lock()
        self.step = 0
        self.created_bytes = 0
        self.pooled_bytes = 0

    def take(self, nbytes):
        with self.lock:
            free = self.free.get(nbytes)
            if free:
                buffer, event, _ = free.pop()
                self.pooled_bytes -= nbytes
                return buffer, event
        self.created_bytes += nbytes
        return self.make(nbytes), None

    def give(self, buffer, nbytes, event):
        with self.lock:
            self.free[nbytes].append((buffer, event, self.step))
            self.pooled_bytes += nbytes

    def next_step(self):
        with self.lock:
            self.step += 1
            for nbytes, free in list(self.free.items()):
                kept = [entry for entry in free if entry[2] >= self.step - 1]
                self.pooled_bytes -= nbytes * (len(free) - len(kept))
                if kept:
                    self.free[nbytes] = kept
                else:
                    del self.free[nbytes]


class _CudaTransport:
    """Copies on two streams of its own: device to host on the offload stream, after the work
    queued so far on the current stream; host to device on the prefetch stream, into memory
    allocated on the current stream (so the compute stream's pool serves it) after the work queued
    there so far (that memory's last users). Nothing here waits on the host but synchronize()."""

    def __init__(self, torch, device):
        from . import backend, enabled, hooks

        if enabled() and backend() == "pluggable" and hooks().get("record_stream") != "set_record_stream_fn":
            # The device storage is dropped while its copy runs: without record_stream the
            # allocator could hand it out under the copy.
            raise RuntimeError("glake_torch.offload_activations: glake's pluggable allocator has no record_stream "
                               f"hook in this PyTorch ({hooks().get('record_stream')}); use the native backend")
        self.torch = torch
        self.device = device
        self.offload_stream = torch.cuda.Stream(device)
        self.prefetch_stream = torch.cuda.Stream(device)
        self.pool = _PinnedPool(lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))

    def on_device(self, t):
        return t.device == self.device

    def offload(self, flat):
        torch, stream = self.torch, self.offload_stream
        host, after = self.pool.take(flat.numel())
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:
            stream.wait_event(after)  # the buffer's last prefetch has read it
        with torch.cuda.stream(stream):
            host.copy_(flat, non_blocking=True)
        flat.record_stream(stream)  # the allocator reuses the storage only after this copy
        done = torch.cuda.Event()
        done.record(stream)
        return host, done

    def prefetch(self, host, offloaded):
        torch, stream = self.torch, self.prefetch_stream
        flat = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        stream.wait_event(offloaded)
        with torch.cuda.stream(stream):
            flat.copy_(host, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(stream)
        return flat, ready

    def wait(self, ready):
        self.torch.cuda.current_stream(self.device).wait_event(ready)

    def discard(self, flat):
        """A prefetched storage dropped without an unpack (whose wait would have ordered its
        free after the copy): the allocator must not reuse it under the copy."""
        flat.record_stream(self.prefetch_stream)

    @staticmethod
    def done(event):
        return event.query()

    @staticmethod
    def synchronize(event):
        event.synchronize()


class _HostCopies:
    """A transport without a GPU, for tests and dry runs: the 'device' is the CPU, copies are
    synchronous clones into pooled buffers, events are counters, and `log` lists what happened
    (("offload", nbytes), ("prefetch", nbytes), ("wait", nbytes), ("synchronize", nbytes))."""

    class Event:
        def __init__(self, nbytes):
            self.nbytes, self.complete = nbytes, False

    def __init__(self, torch, complete=True):
        self.torch = torch
        self.complete = complete  # False: copies stay pending until synchronize() (the throttle's test)
        self.device = torch.device("cpu")
        self.pool = _PinnedPool(lambda n: torch.empty(n, dtype=torch.uint8))
        self.log = []

    def on_device(self, t):
        return t.device.type == "cpu"

    def offload(self, flat):
        host, _ = self.pool.take(flat.numel())
        host.copy_(flat)
        self.log.append(("offload", flat.numel()))
        event = self.Event(flat.numel())
        event.complete = self.complete
        return host, event

    def prefetch(self, host, offloaded):
        self.log.append(("prefetch", host.numel()))
        return host.clone(), self.Event(host.numel())

    def wait(self, ready):
        self.log.append(("wait", ready.nbytes))

    def discard(self, flat):
        self.log.append(("discard", flat.numel()))

    @staticmethod
    def done(event):
        return event.complete

    def synchronize(self, event):
        self.log.append(("synchronize", event.nbytes))
        event.complete = True


# -- Records ----------------------------------------------------------------------------------------


class _Stored:
    """One storage saved for backward: kept on the device (`kept`, nothing moves) or away in `host`
    and, between its prefetch and the last unpack of this backward pass, back in `device`."""

    __slots__ = ("position", "nbytes", "kept", "host", "offloaded", "device", "ready", "handles",
                 "unpacked", "transport", "__weakref__")

    def __init__(self, position, nbytes, kept, transport):
        self.position, self.nbytes, self.kept = position, nbytes, kept
        self.host = self.offloaded = self.device = self.ready = None
        self.handles = self.unpacked = 0
        self.transport = transport

    def give_back(self):
        """The host buffer goes back to the pool, free once the last copy that touched it is done."""
        host, self.host = self.host, None
        if host is not None:
            self.transport.pool.give(host, self.nbytes, self.ready if self.ready is not None else self.offloaded)

    def __del__(self):  # the graph that saved it is gone (no backward, or retain_graph)
        try:
            device, self.device = self.device, None
            if device is not None:
                self.transport.discard(device)
            self.give_back()
        except Exception:  # interpreter shutdown
            pass


class _Saved:
    """What pack returns (autograd keeps it): the tensor itself where it stays, else its record
    and the view of the storage it was."""

    __slots__ = ("stored", "tensor", "dtype", "size", "stride", "offset", "forward")

    def __init__(self, stored, tensor, forward):
        self.stored, self.forward = stored, forward
        if stored.kept:
            self.tensor = tensor
        else:
            self.tensor = None
            self.dtype, self.size, self.stride, self.offset = (tensor.dtype, tuple(tensor.shape), tensor.stride(),
                                                               tensor.storage_offset())


class _Forward:
    """The records of one forward pass, in pack order, and its backward's prefetch frontier: every
    record at or above `frontier` is needed now; up to `prefetch_bytes` below it come ahead."""

    def __init__(self, owner):
        self.owner = owner
        self.away = []  # offloaded records, in pack order
        self.cursor = None  # the highest record of `away` not yet prefetched by the walk down
        self.frontier = None
        self.ahead = collections.deque()  # prefetched records below the frontier
        self.ahead_bytes = 0
        self.block_start = {}  # block index -> the first position packed in it
        self.lock = threading.Lock()

    def advance(self, position):
        """Backward reached `position`: what is at or above it comes back now, and what is below
        it until `prefetch_bytes` are ahead."""
        with self.lock:
            if self.cursor is None:
                self.cursor = len(self.away) - 1
            if self.frontier is None or position < self.frontier:
                self.frontier = position
                while self.ahead and self.ahead[0].position >= position:
                    self.ahead_bytes -= self.ahead.popleft().nbytes
            limit = self.owner._prefetch_limit()
            while self.cursor >= 0:
                stored = self.away[self.cursor]
                needed = stored.position >= position
                if not needed and self.ahead_bytes >= limit:
                    break
                self.cursor -= 1
                if stored.device is None and stored.host is not None:
                    self.owner._prefetch(stored)
                if not needed:
                    self.ahead.append(stored)
                    self.ahead_bytes += stored.nbytes


# -- The context manager ------------------------------------------------------------------------


class offload_activations:
    """Saved activations of the forward passes run inside it go to pinned host memory and come
    back before backward needs them (see the note at the top of this file for how).

    blocks:        the model's repeated blocks (e.g. model.model.layers), in forward order; their
                   saved tensors are grouped per block, and each block's backward brings back
                   those of the blocks below. None: every saved tensor is a unit of its own, in
                   pack order, and unpacks drive the prefetches.
    fraction, max_device_bytes, budget, policy: which units go (one of them; fraction=0.5 when
                   none): Fraction, DeviceBytes, Budget (with `scheduler`), or any object with
                   select(unit_bytes).
    min_bytes:     smaller saved tensors stay (1 MiB).
    prefetch_bytes: bytes brought back ahead of backward's position (None: twice the largest
                   offloaded unit of the last forward pass, at least 64 MiB).
    max_inflight_bytes: pending copies (device memory not yet freed) allowed at the forward
                   pass's end; before it, also what the kept units still to come will add. The
                   launching thread waits for the oldest copy beyond that (None: the largest
                   offloaded unit, at least 64 MiB; 1 GiB in the first pass).
    parameters:    tensors never to move (besides nn.Parameter and views of them): e.g. a model's
                   buffers. With `blocks`, their parameters are added.
    device:        the CUDA device (None: the current one).
    retain_graph:  keep the host copies until the graph is freed, for more than one backward over
                   it (else each buffer goes back to the pool at its tensor's last unpack).

    stats() says what moved. Use one object for one model: it learns the units from each forward
    pass for the next. close() removes the block hooks."""

    def __init__(self, blocks=None, *, fraction=None, max_device_bytes=None, budget=None, scheduler=None,
                 policy=None, min_bytes=1 << 20, prefetch_bytes=None, max_inflight_bytes=None, parameters=(),
                 device=None, retain_graph=False, _transport=None):
        given = [x is not None for x in (fraction, max_device_bytes, budget, policy)]
        if sum(given) > 1:
            raise ValueError("glake_torch.offload_activations: give at most one of fraction, max_device_bytes, "
                             "budget and policy")
        if scheduler is not None and budget is None:
            raise ValueError("glake_torch.offload_activations: a scheduler counts within a budget: give budget=")
        self.blocks = list(blocks) if blocks is not None else None
        self.budget = budget
        self.scheduler = scheduler
        if policy is None:
            if max_device_bytes is not None:
                policy = DeviceBytes(max_device_bytes)
            elif budget is None:
                policy = Fraction(0.5 if fraction is None else fraction)
        self.policy = policy  # Budget's is made once the device is known
        self.min_bytes = int(min_bytes)
        self.prefetch_bytes = prefetch_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.device = device
        self.retain_graph = retain_graph
        self._transport = _transport
        self._skip = set()
        self._skip_sources = list(parameters)
        if self.blocks is not None:
            for block in self.blocks:
                self._skip_sources.extend(block.parameters())
        self._hooks = []
        self._installed = False
        self._active = None  # the _Forward under way
        self._context = None
        self._plan = None  # set of unit indices to offload, None before the first pass
        self._first = None  # the first pass's block indices to offload (None: every eligible tensor)
        self._block = None  # the block whose forward is running
        self._units = []  # eligible bytes per unit of the forward pass under way
        self._unit = 0
        self._last_units = []
        self._largest = 0  # largest offloaded unit of the last pass
        self._kept_after = []  # per unit: the kept bytes of the units after it (last pass)
        self._inflight = collections.deque()
        self._inflight_bytes = 0
        self._position = 0
        self._keys = {}
        self._stats = collections.Counter()

    # -- set-up ------------------------------------------------------------------------------------

    @classmethod
    def wrap(cls, model, blocks="auto", **kwargs):
        """Runs every forward pass of `model` inside a new offload_activations(blocks, **kwargs), which
        becomes model.glake_activations; returns the model. blocks="auto": the largest
        nn.ModuleList in the model (a transformer's layers), or None when there is none."""
        if blocks == "auto":
            blocks = cls.find_blocks(model)
        context = cls(blocks, parameters=kwargs.pop("parameters", list(model.parameters()) + list(model.buffers())),
                      **kwargs)
        forward = model.forward

        def offloaded_forward(*args, **kw):
            with context:
                return forward(*args, **kw)

        model.forward = offloaded_forward
        model.glake_activations = context
        return model

    @staticmethod
    def find_blocks(model):
        import torch

        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
        if not lists:
            return None
        return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters()) + len(m)))

    def _setup(self):
        import torch

        self._torch = torch
        if self._transport is None:
            device = self.device
            if device is None:
                device = torch.device("cuda", torch.cuda.current_device())
            device = torch.device(device)
            if device.type != "cuda":
                raise ValueError(f"glake_torch.offload_activations: a CUDA device, not {device}")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            self.device = device
            self._transport = _CudaTransport(torch, device)
        if self.policy is None:
            self.policy = Budget(self.budget, self._in_use, self.scheduler)
        if self.blocks is not None and hasattr(self.policy, "first_pass"):
            self._first = set(self.policy.first_pass(len(self.blocks)))
        for t in self._skip_sources:
            try:
                self._skip.add(t.untyped_storage().data_ptr())
            except Exception:
                pass
        if self.blocks is not None:
            for index, block in enumerate(self.blocks):
                self._hooks.append(block.register_forward_pre_hook(
                    lambda module, args, index=index: self._block_begins(index)))
                self._hooks.append(block.register_forward_hook(
                    lambda module, args, output, index=index: self._block_ends(index, output)))
        self._installed = True

    def _in_use(self):
        from . import enabled, memory_allocated

        if enabled():
            return memory_allocated(self.device.index)
        return self._torch.cuda.memory_allocated(self.device)

    def close(self):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._installed = False  # the next `with` installs the block hooks again

    # -- forward -----------------------------------------------------------------------------------

    def __enter__(self):
        if self._active is not None:
            raise RuntimeError("glake_torch.offload_activations: already inside this one (one forward pass at a time)")
        if not self._installed:
            self._setup()
        if self._last_units:
            self._plan = set(self.policy.select(self._last_units))
            self._largest = max((self._last_units[i] for i in self._plan if i < len(self._last_units)), default=0)
            kept_after, total = [0] * len(self._last_units), 0
            for i in range(len(self._last_units) - 1, -1, -1):
                kept_after[i] = total
                if i not in self._plan:
                    total += self._last_units[i]
            self._kept_after = kept_after
        self._transport.pool.next_step()
        self._active = _Forward(self)
        self._units, self._unit = [0], 0
        self._block = None
        self._position = 0
        self._keys = {}
        self._context = self._torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._context.__enter__()
        self._stats["forward_passes"] += 1
        return self

    def __exit__(self, *exc):
        self._context.__exit__(*exc)
        self._context = None
        if any(self._units):  # a pass without saves (no_grad, evaluation) teaches nothing
            self._last_units = self._units
        self._active = None
        self._keys = {}
        return False

    def _next_unit(self):
        self._units.append(0)
        self._unit += 1

    def _block_begins(self, index):
        if self._active is None:
            return
        self._block = index
        self._next_unit()
        self._active.block_start.setdefault(index, self._position)

    def _block_ends(self, index, output):
        forward = self._active
        if forward is None:
            return
        self._block = None
        self._next_unit()
        start = forward.block_start.get(index, self._position)
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if getattr(t, "requires_grad", False) and hasattr(t, "register_hook"):
                # Fires once the gradient of the block's output is known: the block's backward
                # is next, and the tensors below it should start coming back.
                t.register_hook(lambda grad, forward=forward, start=start: forward.advance(start))
                break

    def _eligible(self, t):
        torch = self._torch
        if type(t) is not torch.Tensor or t.layout != torch.strided or not self._transport.on_device(t):
            return False
        if t.numel() * t.element_size() < self.min_bytes:
            return False
        if t.is_leaf and t.requires_grad:  # a parameter, or an input that wants a gradient
            return False
        base = t._base
        if base is not None and (isinstance(base, torch.nn.Parameter) or base.is_leaf and base.requires_grad):
            return False
        grad_fn = t.grad_fn
        if grad_fn is not None and grad_fn.name().startswith("ToCopyBackward"):  # a cast of a parameter
            if any(fn is not None and fn.name() == "torch::autograd::AccumulateGrad" for fn, _ in grad_fn.next_functions):
                return False
        return True

    def _pack(self, t):
        if not self._eligible(t):
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._skip:
            return t
        key = (ptr, t._version)
        entry = self._keys.get(key)
        stored = entry[0] if entry is not None and entry[1]() is not None else None
        forward = self._active
        if stored is None:
            stored = self._store(t, storage, forward)
            self._keys[key] = (stored, weakref.ref(t))
        else:
            self._stats["deduplicated"] += 1
        stored.handles += 1
        return _Saved(stored, t, forward)

    def _store(self, t, storage, forward):
        nbytes = storage.nbytes()
        unit = self._unit if self.blocks is not None else len(self._units) - 1
        position = self._position
        self._position += 1
        if self._plan is not None:
            kept = unit not in self._plan
        else:  # the first pass: the blocks the policy names from their count, else everything
            kept = self._first is not None and self._block not in self._first
        stored = _Stored(position, nbytes, kept, self._transport)
        self._units[unit] += nbytes
        if self.blocks is None:
            self._units.append(0)  # without blocks, each record is a unit of its own
        if kept:
            self._stats["kept_bytes"] += nbytes
            self._throttle(unit, 0)  # the copies still pending must have room beside it
            return stored
        torch = self._torch
        flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        self._throttle(unit, nbytes)
        stored.host, stored.offloaded = self._transport.offload(flat)
        self._inflight.append((stored.offloaded, nbytes))
        self._inflight_bytes += nbytes
        forward.away.append(stored)
        self._stats["offloaded_bytes"] += nbytes
        self._stats["offloaded_tensors"] += 1
        return stored

    def _throttle(self, unit, nbytes):
        """Waits for the oldest pending copies until this one of `nbytes` fits: pending copies hold
        device memory, and the forward pass's peak is at its end, so they may hold as much as the
        kept units still to come will add (kept_after) plus max_inflight_bytes, which is all
        they may hold by then."""
        transport = self._transport
        while self._inflight and transport.done(self._inflight[0][0]):
            self._inflight_bytes -= self._inflight.popleft()[1]
        if self._plan is None:
            limit = self.max_inflight_bytes if self.max_inflight_bytes is not None else 1 << 30
        else:
            limit = self.max_inflight_bytes if self.max_inflight_bytes is not None else max(self._largest, 64 << 20)
            limit += self._kept_after[unit] if unit < len(self._kept_after) else 0
        if not self._inflight or self._inflight_bytes + nbytes <= limit:
            return
        began = time.perf_counter()
        while self._inflight and self._inflight_bytes + nbytes > limit:
            event, pending = self._inflight.popleft()
            transport.synchronize(event)
            self._inflight_bytes -= pending
            self._stats["throttle_waits"] += 1
        self._stats["throttle_s"] += time.perf_counter() - began

    # -- backward ----------------------------------------------------------------------------------

    def _prefetch_limit(self):
        if self.prefetch_bytes is not None:
            return self.prefetch_bytes
        return max(2 * self._largest, 64 << 20)

    def _prefetch(self, stored):
        stored.device, stored.ready = self._transport.prefetch(stored.host, stored.offloaded)
        self._stats["prefetched_bytes"] += stored.nbytes

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        stored = saved.stored
        saved.forward.advance(stored.position)
        if stored.kept:
            return saved.tensor
        with saved.forward.lock:
            if stored.device is None:  # a second backward (retain_graph): back again, without lookahead
                if stored.host is None:
                    raise RuntimeError("glake_torch.offload_activations: a saved tensor was unpacked again after "
                                       "its backward; pass retain_graph=True to offload_activations to allow it")
                self._prefetch(stored)
            flat, ready = stored.device, stored.ready
            stored.unpacked += 1
            if stored.unpacked >= stored.handles:  # the last of this backward: autograd holds it now
                stored.device, stored.unpacked = None, 0
                if not self.retain_graph:  # the host copy is read once: its buffer goes back now
                    stored.give_back()
        self._transport.wait(ready)
        torch = self._torch
        return torch.empty(0, dtype=saved.dtype, device=flat.device).set_(
            flat.untyped_storage(), saved.offset, saved.size, saved.stride)

    def stats(self):
        """Counts since this object was made: forward_passes, offloaded_bytes and offloaded_tensors
        (to host memory), kept_bytes (eligible but kept by the policy), deduplicated (saves of a
        storage already saved), prefetched_bytes, throttle_waits (the launching thread waited for a
        copy), pinned_bytes (host buffers made) and pooled_bytes (those idle now); plan: the units
        that went in the last pass, units: the bytes of each unit."""
        out = dict(self._stats)
        if self._transport is not None:
            out["pinned_bytes"] = self._transport.pool.created_bytes
            out["pooled_bytes"] = self._transport.pool.pooled_bytes
        out["plan"] = sorted(self._plan) if self._plan is not None else None
        out["units"] = list(self._last_units)
        return out


offload_activations.Fraction = Fraction
offload_activations.DeviceBytes = DeviceBytes
offload_activations.Budget = Budget
