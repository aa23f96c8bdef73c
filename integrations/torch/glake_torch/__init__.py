"""glake's stitching allocator as PyTorch's CUDA allocator.

    import glake_torch                     # PYTHONPATH=<glake>/integrations/torch
    glake_torch.enable()                   # first thing: before anything touches CUDA
    ...                                    # train as usual
    glake_torch.stats()                    # {'peak_active_bytes': ..., 'peak_reserved_bytes': ..., ...}
    torch.cuda.empty_cache()               # releases glake's cached memory (reset hook)

enable() loads libglake_torch.so (the argument `library`, else $GLAKE_TORCH_LIBRARY, else the
build tree: build/torch/ from bench/torch/build_plugin.sh, or build*/**/integrations/torch/ from CMake)
through torch.cuda.memory.CUDAPluggableAllocator and makes it the current allocator. Settings come
from GLAKE_ALLOC_CONF ("frag_limit:2MiB,grow_stitch:true", see the README) and GMLake's variables,
over the plug-in's defaults (glake-replay's "glake" composition); `conf` sets GLAKE_ALLOC_CONF.
GLAKE_TRACE=<path> (or `trace`) records every request for glake-replay (%d: device, %p: pid, %r: rank).

PyTorch's memory statistics (torch.cuda.max_memory_allocated and friends) raise with a pluggable
allocator; stats() gives glake's own, memory_stats() the same under PyTorch's names, and
use_in_torch_cuda() makes torch.cuda's own functions answer from glake. Hooks: PyTorch's reset hook (set_reset_fn, which
torch.cuda.empty_cache() calls) and record_stream hook are set through the allocator object's
Python bindings where this PyTorch has them; without set_reset_fn, torch.cuda.empty_cache is
wrapped instead (hooks() says which). Out of memory raises torch.cuda.OutOfMemoryError where the
plug-in was built against torch's libc10 (bench/torch/build_plugin.sh does so where torch
imports), else a RuntimeError; both say "out of memory" and what glake held (PyTorch does not turn
a null from a pluggable allocator into an error, so the plug-in's alloc function throws; see
integrations/torch/README.md).

Memory snapshots: record_memory_history() starts a bounded history of allocations, frees and
segments, snapshot() returns the state and the history in the dict shape of PyTorch's
torch.cuda.memory._snapshot(), and dump_snapshot(path) pickles it for PyTorch's viewers
(python -m torch.cuda._memory_viz stats|trace_plot|segment_plot FILE, or pytorch.org/memory_viz).
CUDA graphs: enable() installs PyTorch's private-pool hooks (set_begin_allocate_to_pool,
set_end_allocate_to_pool_fn, set_release_pool) where this PyTorch has them, so that
torch.cuda.graph captures into a pool of its own.

Nothing here needs torch except enable(); stats(), empty_cache(), reset_peak_stats() and the
snapshot functions work on the library alone (load()), which needs the NVIDIA driver (libcuda.so.1):
without one, load() and everything that calls it raise DriverNotFoundError (an OSError) saying so.
PYTORCH_CUDA_ALLOC_CONF's keys that have a glake equivalent are applied under GLAKE_ALLOC_CONF
(which wins), and one warning names the others (_conf.py has the table).
"""

import atexit
import ctypes
import glob
import json
import os
import pickle
import sys

from . import _conf
from ._loading import DriverNotFoundError, open_library as _open_library

__version__ = "0.1.0"

__all__ = [
    "DriverNotFoundError",
    "enable",
    "enabled",
    "backend",
    "native_available",
    "load",
    "library_path",
    "settings",
    "stats",
    "empty_cache",
    "reset_peak_stats",
    "hooks",
    "memory_stats",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "use_in_torch_cuda",
    "set_memory_fraction",
    "record_memory_history",
    "snapshot",
    "dump_snapshot",
    "movable_empty",
    "movable_like",
    "offload",
    "prefetch",
    "residence",
    "movable_stats",
    "movable_allocations",
    "copy_",
    "host_time",
    "far_copy_bytes",
    "MovableMemory",
    "SafetensorsEntry",
    "safetensors_layout",
    "load_safetensors",
    "SharedMemory",
    "shared_weights_layout",
    "share_weights",
    "Scheduler",
    "offload_activations",
]

# PyTorch's _record_memory_history keeps every entry by default (max_entries=sys.maxsize); glake's
# history is a ring allocated up front, so an unbounded request keeps this many per device.
DEFAULT_MAX_ENTRIES = 100_000

LIBRARY_NAME = "libglake_torch.so"
ALLOC_FN = "glake_torch_malloc"
FREE_FN = "glake_free"

# integrations/torch/glake_torch/__init__.py -> the repository root
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_lib = None
_lib_path = None
_names = None
_allocator = None  # the torch allocator object, kept alive for the life of the process
_backend = None  # "native" or "pluggable" once enabled
_hooks = {}


def _build_tree_candidates(root):
    """Where a build leaves the library, newest first within each kind."""

    def newest_first(paths):
        return sorted(paths, key=os.path.getmtime, reverse=True)

    yield os.path.join(root, "build", "torch", LIBRARY_NAME)  # bench/torch/build_plugin.sh
    yield from newest_first(glob.glob(os.path.join(root, "build", "*", "integrations", "torch", LIBRARY_NAME)))
    yield from newest_first(glob.glob(os.path.join(root, "build*", "integrations", "torch", LIBRARY_NAME)))


def library_path(library=None, root=None):
    """The plug-in to load: `library`, else $GLAKE_TORCH_LIBRARY, else the one installed beside
    this module (pip install), else the newest one in the build tree under `root` (the
    repository). Raises FileNotFoundError saying where it looked."""
    for given, origin in ((library, "the library argument"), (os.environ.get("GLAKE_TORCH_LIBRARY"), "GLAKE_TORCH_LIBRARY")):
        if given:
            if not os.path.isfile(given):
                raise FileNotFoundError(f"glake_torch: {origin} names {given!r}, which is not a file")
            return os.path.abspath(given)
    packaged = os.path.join(os.path.dirname(os.path.abspath(__file__)), LIBRARY_NAME)
    if os.path.isfile(packaged):
        return packaged
    root = _ROOT if root is None else root
    looked = [packaged]
    for candidate in _build_tree_candidates(root):
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
        looked.append(candidate)
    raise FileNotFoundError(
        f"glake_torch: no {LIBRARY_NAME} found (looked for {', '.join(looked) or 'build trees under ' + root}); "
        "build it (bench/torch/build_plugin.sh, or CMake with the CUDA toolkit), or pass library= "
        "or set GLAKE_TORCH_LIBRARY"
    )


def load(library=None):
    """Loads the plug-in (once per process) and returns the ctypes library."""
    global _lib, _lib_path, _names
    _conf.fold_pytorch_conf()  # before any allocator reads GLAKE_ALLOC_CONF
    if _lib is not None:
        if library and os.path.realpath(library) != os.path.realpath(_lib_path):
            raise RuntimeError(f"glake_torch: already loaded from {_lib_path}, cannot switch to {library}")
        return _lib
    path = library_path(library)
    try:  # a library with the native allocator links torch's libraries: torch loads them first
        import torch  # noqa: F401
    except Exception:  # no torch (the simulated library needs none), or a broken one
        pass
    lib = _open_library(path)
    if hasattr(lib, "glake_native_install"):  # built against torch's headers
        lib.glake_native_install.restype = ctypes.c_int
        lib.glake_native_install.argtypes = [ctypes.c_char_p, ctypes.c_ulong]
    lib.glake_malloc.restype = ctypes.c_void_p
    lib.glake_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.glake_free.restype = None
    lib.glake_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.glake_record_stream.restype = None
    lib.glake_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.glake_empty_cache.restype = None
    lib.glake_empty_cache.argtypes = [ctypes.c_int]
    lib.glake_empty_cache_all.restype = None
    lib.glake_empty_cache_all.argtypes = []
    lib.glake_set_memory_fraction.restype = None
    lib.glake_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
    lib.glake_reset_peak.restype = None
    lib.glake_reset_peak.argtypes = [ctypes.c_int]
    lib.glake_stats.restype = ctypes.c_size_t
    lib.glake_stats.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    lib.glake_stats_names.restype = ctypes.c_char_p
    lib.glake_stats_names.argtypes = []
    lib.glake_settings.restype = ctypes.c_int
    lib.glake_settings.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.glake_backend.restype = ctypes.c_char_p
    lib.glake_backend.argtypes = []
    lib.glake_host_time.restype = ctypes.c_int
    lib.glake_host_time.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]
    lib.glake_flush_traces.restype = None
    lib.glake_flush_traces.argtypes = []
    lib.glake_record_history.restype = ctypes.c_int
    lib.glake_record_history.argtypes = [ctypes.c_int, ctypes.c_size_t]
    lib.glake_snapshot.restype = ctypes.c_size_t
    lib.glake_snapshot.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.glake_movable_create.restype = ctypes.c_void_p
    lib.glake_movable_create.argtypes = [ctypes.c_size_t, ctypes.c_int]
    lib.glake_movable_destroy.restype = ctypes.c_int
    lib.glake_movable_destroy.argtypes = [ctypes.c_void_p]
    for name in ("glake_offload", "glake_prefetch"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    for name in ("glake_offload_many", "glake_prefetch_many"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_void_p]
    lib.glake_residence.restype = ctypes.c_int
    lib.glake_residence.argtypes = [ctypes.c_void_p]
    if hasattr(lib, "glake_keep_far_copy"):  # libraries built before read-only marks lack them
        lib.glake_keep_far_copy.restype = ctypes.c_int
        lib.glake_keep_far_copy.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.glake_far_copy_bytes.restype = ctypes.c_size_t
        lib.glake_far_copy_bytes.argtypes = []
    lib.glake_movable_stats.restype = ctypes.c_size_t
    lib.glake_movable_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    lib.glake_set_movable_scope.restype = ctypes.c_size_t
    lib.glake_set_movable_scope.argtypes = [ctypes.c_size_t]
    lib.glake_last_error.restype = ctypes.c_size_t
    lib.glake_last_error.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    if hasattr(lib, "glake_scheduler_create"):  # libraries built before the schedulers lack them
        lib.glake_scheduler_create.restype = ctypes.c_void_p
        lib.glake_scheduler_create.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_char_p,
                                               ctypes.c_void_p]
        for name in ("glake_scheduler_destroy", "glake_scheduler_iteration_begin", "glake_scheduler_idle"):
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = [ctypes.c_void_p]
        lib.glake_scheduler_manage.restype = ctypes.c_int
        lib.glake_scheduler_manage.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.glake_scheduler_unmanage.restype = ctypes.c_int
        lib.glake_scheduler_unmanage.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.glake_scheduler_will_use.restype = ctypes.c_int
        lib.glake_scheduler_will_use.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.glake_scheduler_stats.restype = ctypes.c_size_t
        lib.glake_scheduler_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        lib.glake_scheduler_stats_names.restype = ctypes.c_char_p
        lib.glake_scheduler_stats_names.argtypes = []
    if hasattr(lib, "glake_scheduler_create_with"):  # with the choice of deferred moves
        lib.glake_scheduler_create_with.restype = ctypes.c_void_p
        lib.glake_scheduler_create_with.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_char_p,
                                                    ctypes.c_void_p, ctypes.c_int]
        lib.glake_scheduler_settle.restype = ctypes.c_int
        lib.glake_scheduler_settle.argtypes = [ctypes.c_void_p]
    if hasattr(lib, "glake_shared_create"):  # libraries built before shared weights lack them
        lib.glake_shared_create.restype = ctypes.c_void_p
        lib.glake_shared_create.argtypes = [ctypes.c_size_t, ctypes.c_int]
        lib.glake_share.restype = ctypes.c_int
        lib.glake_share.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p,
                                    ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        lib.glake_shared_destroy.restype = ctypes.c_int
        lib.glake_shared_destroy.argtypes = [ctypes.c_void_p]
    _names = lib.glake_stats_names().decode().split(",")
    _lib, _lib_path = lib, path
    atexit.register(lib.glake_flush_traces)
    return lib


def settings():
    """The settings a device's allocator is made with if made now ("key:value,..."). Raises
    ValueError naming the setting and the variable when the environment's are invalid."""
    return _settings_of(load())


def _settings_of(lib):
    buffer = ctypes.create_string_buffer(1024)
    status = lib.glake_settings(buffer, len(buffer))
    text = buffer.value.decode(errors="replace")
    if status != 0:
        raise ValueError(f"glake_torch: {text}")
    return text


def enabled():
    """True once enable() made glake PyTorch's CUDA allocator in this process."""
    return _allocator is not None


def backend():
    """How enable() made glake PyTorch's CUDA allocator: "native" (glake is torch's own
    CUDAAllocator and answers every hook: memory_stats, memory_summary, snapshots with stacks,
    CUDA graph trees, MemPool), "pluggable" (through CUDAPluggableAllocator, which forwards only
    allocation, frees and a few hooks), or None before enable()."""
    return _backend


def native_available(library=None):
    """True when the plug-in was built with the native allocator (torch's headers were found at
    build time)."""
    return hasattr(load(library), "glake_native_install")


def hooks():
    """How PyTorch's hooks were installed: {'empty_cache': ..., 'record_stream': ...}."""
    return dict(_hooks)


def enable(conf=None, library=None, trace=None, pluggable=None):
    """Makes glake PyTorch's CUDA allocator. Call it before anything touches CUDA (before the first
    tensor on the GPU, torch.cuda.set_device, init_process_group with NCCL, ...).

    conf:      GLAKE_ALLOC_CONF to use ("key:value,..."); None keeps the environment's.
    library:   path of libglake_torch.so; None searches (see library_path).
    trace:     GLAKE_TRACE pattern; None keeps the environment's.
    pluggable: True installs through CUDAPluggableAllocator even where the native allocator was
               built; None follows GLAKE_TORCH_BACKEND ("pluggable" or "native", the default).

    The native allocator is installed where the library was built with it (torch's headers found
    at build time), else the pluggable one, with a warning once (backend() says which).
    Raises ValueError for invalid settings and RuntimeError when CUDA is already initialised, both
    before anything is switched. Calling it again once enabled does nothing."""
    global _allocator, _backend
    if _allocator is not None:
        return
    if conf is not None:
        os.environ["GLAKE_ALLOC_CONF"] = conf
    if trace is not None:
        os.environ["GLAKE_TRACE"] = trace
    lib = load(library)
    settings()  # invalid settings fail here, not at the first allocation

    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError(
            "glake_torch.enable() must run before CUDA is initialised, and it already is (a tensor "
            "was put on the GPU, or torch.cuda.set_device/init/current_device or NCCL ran): PyTorch "
            "can only switch allocators before its own was used. Call enable() first thing in the "
            "process."
        )
    if pluggable is None:
        choice = os.environ.get("GLAKE_TORCH_BACKEND", "native").strip().lower()
        if choice not in ("native", "pluggable"):
            raise ValueError(f"GLAKE_TORCH_BACKEND={choice!r}: expected 'native' or 'pluggable'")
        pluggable = choice == "pluggable"
    if not pluggable and hasattr(lib, "glake_native_install"):
        message = ctypes.create_string_buffer(1024)
        if lib.glake_native_install(message, len(message)) != 0:
            raise RuntimeError(
                f"glake_torch.enable(): PyTorch refused to switch to glake ({message.value.decode()}); its own "
                "CUDA allocator was already used. Call enable() first thing in the process."
            )
        _allocator = "native"
        _backend = "native"
        _hooks.clear()
        _hooks["all"] = "native allocator (torch's CUDAAllocator)"
        return
    if not pluggable:
        import warnings

        warnings.warn(
            f"glake_torch: {_lib_path} was built without torch's headers, so glake is installed through "
            "CUDAPluggableAllocator: torch.cuda.memory_stats/memory_summary, snapshots with stacks and "
            "torch.compile(mode='reduce-overhead') need the native allocator. Rebuild the plug-in where torch "
            "is installed (pip install <glake>/integrations/torch, or bench/torch/build_plugin.sh).",
            RuntimeWarning,
            stacklevel=2,
        )
    allocator = torch.cuda.memory.CUDAPluggableAllocator(_lib_path, ALLOC_FN, FREE_FN)
    installed = _install_hooks(torch, allocator, lib)
    try:
        torch.cuda.memory.change_current_allocator(allocator)
    except RuntimeError as error:
        raise RuntimeError(
            f"glake_torch.enable(): PyTorch refused to switch to glake ({error}); its own CUDA "
            "allocator was already used. Call enable() first thing in the process."
        ) from error
    _allocator = allocator
    _backend = "pluggable"
    _hooks.clear()
    _hooks.update(installed)


def _function_pointer(lib, name):
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def _install_hooks(torch, allocator, lib):
    raw = allocator.allocator()
    installed = {}
    if hasattr(raw, "set_reset_fn"):
        raw.set_reset_fn(_function_pointer(lib, "glake_empty_cache_all"))
        installed["empty_cache"] = "set_reset_fn"
    else:
        original = torch.cuda.empty_cache

        def empty_cache():
            original()
            lib.glake_empty_cache(-1)

        empty_cache.__doc__ = original.__doc__
        torch.cuda.empty_cache = empty_cache
        torch.cuda.memory.empty_cache = empty_cache
        installed["empty_cache"] = "wrapped torch.cuda.empty_cache (no set_reset_fn in this PyTorch)"
    if hasattr(raw, "set_memory_fraction_fn"):
        raw.set_memory_fraction_fn(_function_pointer(lib, "glake_set_memory_fraction"))
        installed["memory_fraction"] = "set_memory_fraction_fn"
    if hasattr(raw, "set_record_stream_fn"):
        raw.set_record_stream_fn(_function_pointer(lib, "glake_record_stream"))
        installed["record_stream"] = "set_record_stream_fn"
    else:
        installed["record_stream"] = "not installed (no set_record_stream_fn in this PyTorch)"
    # CUDA graphs' private pools: the three hooks or none (a pool begun but never ended or
    # released would keep its memory for ever).
    pool_hooks = (
        ("set_begin_allocate_to_pool", "glake_begin_allocate_to_pool"),
        ("set_end_allocate_to_pool_fn", "glake_end_allocate_to_pool"),
        ("set_release_pool", "glake_release_pool"),
    )
    if all(hasattr(raw, setter) for setter, _ in pool_hooks):
        for setter, function in pool_hooks:
            getattr(raw, setter)(_function_pointer(lib, function))
        installed["graph_pools"] = ", ".join(setter for setter, _ in pool_hooks)
    else:
        installed["graph_pools"] = "not installed (this PyTorch lacks set_begin_allocate_to_pool and friends)"
    return installed


def _device_index(device):
    if device is None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return torch.cuda.current_device()
        return 0
    if isinstance(device, int):
        return device
    if not isinstance(device, str):  # torch.device
        if getattr(device, "type", "cuda") != "cuda":
            raise ValueError(f"glake_torch: {device!r} is not a CUDA device")
        index = getattr(device, "index", None)
        return _device_index(None) if index is None else index
    text = device
    if text.startswith("cuda:"):
        return int(text[len("cuda:"):])
    if text == "cuda":
        return _device_index(None)
    raise ValueError(f"glake_torch: {device!r} is not a CUDA device")


def stats(device=None):
    """glake's statistics of `device` (default: the current one) as a dict: the allocator's
    counters (active_bytes, peak_active_bytes = requested bytes; reserved_bytes, peak_reserved_bytes
    = physical bytes held; stitches, segments, driver calls by kind (driver_map, ...) and the host
    nanoseconds spent in them (driver_map_ns, ...), failed_allocations = out of memory), what
    offloads and prefetches cost (offload_moves, offload_driver_calls, offload_handles_made,
    offload_handles_reused, offload_handed_over, offload_host_ns; prefetch_* the same), lifetime
    peaks, "errors" (swallowed failures), plus "driver_calls" and "driver_ns" (all kinds) and
    "utilization" (peak active / peak reserved)."""
    lib = load()
    index = _device_index(device)
    values = (ctypes.c_uint64 * len(_names))()
    count = lib.glake_stats(index, values, len(_names))
    if count == 0:
        raise ValueError(f"glake_torch: device {device!r} is out of range")
    result = dict(zip(_names, values[: min(count, len(_names))]))
    result["driver_calls"] = sum(v for k, v in result.items() if k.startswith("driver_") and not k.endswith("_ns"))
    result["driver_ns"] = sum(v for k, v in result.items() if k.startswith("driver_") and k.endswith("_ns"))
    reserved = result["peak_reserved_bytes"]
    result["utilization"] = result["peak_active_bytes"] / reserved if reserved else 0.0
    result["device"] = index
    return result


def host_time():
    """Host time spent in glake's allocation calls so far, all devices: {"ns": ..., "calls": ...};
    None unless GLAKE_HOST_TIMING was set (not "" or "0") when the plug-in was first called."""
    lib = load()
    ns, calls = ctypes.c_uint64(0), ctypes.c_uint64(0)
    if not lib.glake_host_time(ctypes.byref(ns), ctypes.byref(calls)):
        return None
    return {"ns": ns.value, "calls": calls.value}


def empty_cache(device=None):
    """Releases glake's cached memory on `device`, or on every device when None."""
    load().glake_empty_cache(-1 if device is None else _device_index(device))


def set_memory_fraction(fraction, device=None):
    """As torch.cuda.set_per_process_memory_fraction, which calls it once enable() has installed
    it (hooks()["memory_fraction"]): glake holds at most `fraction` (0..1) of `device`'s memory
    from now on, releasing cached memory above it at once (1: the whole device)."""
    if not 0.0 <= float(fraction) <= 1.0:
        raise ValueError(f"glake_torch: memory fraction {fraction!r} is not within [0, 1]")
    load().glake_set_memory_fraction(ctypes.c_double(float(fraction)), _device_index(device))


def reset_peak_stats(device=None):
    """Peaks are measured from now on, on `device` or every device when None."""
    load().glake_reset_peak(-1 if device is None else _device_index(device))


# PyTorch's statistics that glake keeps, as (PyTorch name, glake current, glake peak). PyTorch's
# "requested" is what was asked; its "allocated" what blocks hold after rounding; its "active" the
# allocated blocks plus those freed but still in use by a stream (glake counts a record_stream'd
# block as allocated until its streams' work completes, so "active" is glake's allocated).
_TORCH_BYTES = (
    ("allocated_bytes", "allocated_bytes", "peak_allocated_bytes"),
    ("active_bytes", "allocated_bytes", "peak_allocated_bytes"),
    ("requested_bytes", "active_bytes", "peak_active_bytes"),
    ("reserved_bytes", "reserved_bytes", "peak_reserved_bytes"),
)


def memory_stats(device=None):
    """glake's statistics of `device` under the names of torch.cuda.memory_stats(), for code and
    dashboards that read those: "allocated_bytes.all.current" / ".peak" (bytes of live blocks,
    after rounding), "active_bytes.all.*" (the same: glake counts a record_stream'd block until
    its streams are done), "requested_bytes.all.*" (bytes asked for), "reserved_bytes.all.*"
    (physical memory held), "allocation.all.current/allocated/freed" (live allocations and
    allocate / free calls so far), "segment.all.current/allocated/freed" (glake's growths),
    "num_ooms", "num_device_alloc" / "num_device_free" (physical handles created and released);
    "small_pool" / "large_pool" keys are not given (glake's pools are not PyTorch's). Keys PyTorch
    has and glake does not keep (num_alloc_retries, inactive_split*, oversize_*, cumulative
    byte counts) are absent rather than guessed. glake's own statistics follow as "glake.<name>"
    (stitches, driver calls, ...). Sorted by key, like PyTorch's."""
    s = stats(device)
    out = {}
    for name, current, peak in _TORCH_BYTES:
        out[name + ".all.current"] = s[current]
        out[name + ".all.peak"] = s[peak]
    out["allocation.all.current"] = s["allocations"] - s["deallocations"]
    out["allocation.all.allocated"] = s["allocations"]
    out["allocation.all.freed"] = s["deallocations"]
    out["segment.all.current"] = s["segments_created"] - s["segments_released"]
    out["segment.all.allocated"] = s["segments_created"]
    out["segment.all.freed"] = s["segments_released"]
    out["num_ooms"] = s["failed_allocations"]
    out["num_device_alloc"] = s["driver_create"]
    out["num_device_free"] = s["driver_release"]
    for key, value in s.items():
        out["glake." + key] = value
    return dict(sorted(out.items()))


def memory_allocated(device=None):
    """As torch.cuda.memory_allocated: bytes of live blocks on `device`."""
    return stats(device)["allocated_bytes"]


def max_memory_allocated(device=None):
    """As torch.cuda.max_memory_allocated: their peak since the last reset_peak_stats."""
    return stats(device)["peak_allocated_bytes"]


def memory_reserved(device=None):
    """As torch.cuda.memory_reserved: physical memory glake holds on `device`."""
    return stats(device)["reserved_bytes"]


def max_memory_reserved(device=None):
    """As torch.cuda.max_memory_reserved: its peak since the last reset_peak_stats."""
    return stats(device)["peak_reserved_bytes"]


def record_memory_history(enabled=True, max_entries=DEFAULT_MAX_ENTRIES):
    """Starts (enabled true: every device's history emptied, at most `max_entries` kept per
    device, the newest) or stops (enabled None or False; the entries stay for snapshot()) glake's
    memory history, as torch.cuda.memory._record_memory_history. Stacks are not recorded (the
    entries' "frames" are empty). Raises RuntimeError when the history cannot be allocated."""
    on = bool(enabled) and enabled != "none"
    if on:
        max_entries = int(max_entries)
        if max_entries <= 0:
            raise ValueError(f"glake_torch: max_entries must be positive, got {max_entries}")
        if max_entries >= sys.maxsize:
            max_entries = DEFAULT_MAX_ENTRIES
    if load().glake_record_history(1 if on else 0, max_entries if on else 0) != 0:
        raise RuntimeError("glake_torch: the memory history could not be started (see stderr)")


def snapshot():
    """glake's state and memory history in the shape of torch.cuda.memory._snapshot(): a dict
    with "segments" (per segment: device, address, total_size, allocated_size, active_size,
    requested_size, stream, segment_type, segment_pool_id, is_expandable, frames, blocks; per
    block: address, size, requested_size, state, frames) and "device_traces" (per device, the
    history: action, addr, size, stream, time_us, frames), plus glake's "stitched_ranges".
    Physical segments are segment_type "large" (the small pool's blocks sit in them, marked
    "pool": "small"); a live stitched allocation is a segment of segment_type "stitched" whose
    memory is that of its pieces, shown "inactive" with "stitched_into" in their own segments
    (see integrations/torch/README.md)."""
    lib = load()
    size = lib.glake_snapshot(None, 0)
    while True:
        buffer = ctypes.create_string_buffer(size + 4096)
        written = lib.glake_snapshot(buffer, len(buffer))
        if written == 0:
            raise RuntimeError("glake_torch: taking a snapshot failed (see stderr)")
        if written < len(buffer):
            return json.loads(buffer.raw[:written])
        size = written  # it grew in between: ask again with room for it


def dump_snapshot(path):
    """Pickles snapshot() to `path`, as torch.cuda.memory._dump_snapshot does, for
    python -m torch.cuda._memory_viz and pytorch.org/memory_viz."""
    data = snapshot()
    with open(path, "wb") as f:
        pickle.dump(data, f)
    return data


def use_in_torch_cuda():
    """Makes torch.cuda's statistics answer from glake: torch.cuda.memory_stats (and with it
    memory_allocated, max_memory_allocated, memory_reserved, max_memory_reserved and
    memory_stats_as_nested_dict's flat form, which PyTorch computes from memory_stats) and
    reset_peak_memory_stats / reset_max_memory_allocated / reset_max_memory_cached, and the memory
    snapshots: torch.cuda.memory._record_memory_history, _snapshot, _dump_snapshot and
    torch.cuda.memory_snapshot. One call, after enable(); code calling those functions then works
    unchanged. PyTorch's functions are replaced in torch.cuda and torch.cuda.memory (they look
    memory_stats up there at each call); returns the names replaced.

    Unnecessary with the native allocator (backend() == "native"), where torch.cuda's own
    functions answer from glake: it then warns, replaces nothing and returns []."""
    if _backend == "native":
        import warnings

        warnings.warn(
            "glake_torch.use_in_torch_cuda() is unnecessary with the native allocator: torch.cuda's own "
            "statistics and snapshots answer from glake; nothing was replaced",
            stacklevel=2,
        )
        return []
    import torch

    def torch_memory_stats(device=None):
        return memory_stats(device)

    def torch_reset_peak_memory_stats(device=None):
        reset_peak_stats(device)

    def torch_record_memory_history(enabled="all", context="all", stacks="all", max_entries=sys.maxsize,
                                    device=None, *args, **kwargs):
        # context and stacks: glake records no stacks; the rest of PyTorch's arguments as well.
        record_memory_history(enabled, max_entries)

    def torch_snapshot(device=None, *args, **kwargs):
        return snapshot()

    def torch_dump_snapshot(filename="dump_snapshot.pickle"):
        dump_snapshot(filename)

    def torch_memory_snapshot(*args, **kwargs):
        return snapshot()["segments"]

    replaced = []
    targets = [torch.cuda, getattr(torch.cuda, "memory", None)]
    for module in [m for m in targets if m is not None]:
        for name, fn in (
            ("memory_stats", torch_memory_stats),
            ("reset_peak_memory_stats", torch_reset_peak_memory_stats),
            ("reset_max_memory_allocated", torch_reset_peak_memory_stats),
            ("reset_max_memory_cached", torch_reset_peak_memory_stats),
            ("_record_memory_history", torch_record_memory_history),
            ("_snapshot", torch_snapshot),
            ("_dump_snapshot", torch_dump_snapshot),
            ("memory_snapshot", torch_memory_snapshot),
        ):
            if hasattr(module, name):
                setattr(module, name, fn)
                replaced.append(f"{module.__name__}.{name}")
    return replaced


# ------------------------------------------------------------------ movable memory (offload)

_RESIDENCE = {1: "device", 2: "host"}


def _last_error(lib):
    buffer = ctypes.create_string_buffer(1024)
    lib.glake_last_error(buffer, len(buffer))
    return buffer.value.decode(errors="replace")


def _raise_for(code, lib, what):
    if code == 0:
        return
    message = f"glake_torch: {what} failed: {_last_error(lib)}"
    if code == -1:
        raise ValueError(message)
    if code == -2:
        torch = sys.modules.get("torch")
        oom = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None) if torch is not None else None
        raise (oom or MemoryError)(message)
    raise RuntimeError(message)


def _creation_error(lib, what):
    """The exception for a failed creation of `what`: torch's OutOfMemoryError (or MemoryError)
    when memory ran out, else RuntimeError, with glake's reason."""
    message = f"glake_torch: {what}: {_last_error(lib)}"
    if any(words in message for words in ("out of memory", "out of device memory", "out of address space", "ran out")):
        torch = sys.modules.get("torch")
        return (getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None) or MemoryError)(message)
    return RuntimeError(message)


class _DeviceRegion:
    """What MovableMemory and SharedMemory share: `ptr` and `nbytes` seen as a CUDA byte array
    (a tensor made over it keeps it alive), and destruction with the last reference, after the
    device has finished with it (the caller's streams are synchronized first)."""

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 2}

    def __del__(self):
        ptr, self.ptr = getattr(self, "ptr", None), None
        if ptr:
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_initialized():
                torch.cuda.synchronize(self.device)
            self._destroy(ptr)


class MovableMemory(_DeviceRegion):
    """One movable buffer (glake_movable_create): `nbytes` of device memory whose address never
    changes while offload() and prefetch() move it to host memory and back. A tensor made over it
    (movable_empty) keeps it alive through __cuda_array_interface__; it is destroyed with the last
    reference, after the device has finished with it (the caller's streams are synchronized first)."""

    def __init__(self, nbytes, device=None, library=None):
        if nbytes <= 0:
            raise ValueError(f"glake_torch: a movable buffer of {nbytes} bytes")
        self._lib = load(library)
        self.device = _device_index(device)
        self.nbytes = int(nbytes)
        self.ptr = self._lib.glake_movable_create(self.nbytes, self.device)
        if not self.ptr:
            raise _creation_error(self._lib, f"a movable buffer of {self.nbytes} bytes on device {self.device}")

    def _destroy(self, ptr):
        self._lib.glake_movable_destroy(ptr)


def _stream_handle(stream, device):
    if stream is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        stream = torch.cuda.current_stream(device)
    return getattr(stream, "cuda_stream", stream)


def movable_empty(*size, dtype=None, device=None):
    """An uninitialised CUDA tensor of `size` over its own movable buffer (rounded up to 2 MiB):
    offload(tensor) and prefetch(tensor) move its memory and keep the tensor and its data_ptr()."""
    import torch

    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    dtype = torch.get_default_dtype() if dtype is None else dtype
    numel = 1
    for n in size:
        numel *= int(n)
    itemsize = torch.empty((), dtype=dtype).element_size()
    memory = MovableMemory(max(1, numel * itemsize), device)
    raw = torch.as_tensor(memory, device=f"cuda:{memory.device}")
    return raw[: numel * itemsize].view(dtype).view(size)


def movable_like(tensor):
    """movable_empty with `tensor`'s shape, dtype and device, holding a copy of its values."""
    out = movable_empty(tuple(tensor.shape), dtype=tensor.dtype, device=tensor.device)
    out.copy_(tensor)
    return out


def _pointer(tensor):
    return tensor.untyped_storage().data_ptr() if hasattr(tensor, "untyped_storage") else int(tensor)


def _movable_call(name, tensors, stream):
    lib = load()
    many = isinstance(tensors, (list, tuple))
    items = list(tensors) if many else [tensors]
    if not items:
        return
    device = getattr(getattr(items[0], "device", None), "index", None)
    pointers = (ctypes.c_void_p * len(items))(*[_pointer(t) for t in items])
    code = getattr(lib, f"glake_{name}_many")(pointers, len(items), _stream_handle(stream, device))
    _raise_for(code, lib, name)


def offload(tensors, stream=None):
    """Moves the memory under a tensor, or under each of a list of them, to host memory, ordered
    on `stream` (default: the current stream): the device memory is free when this returns; the
    tensors and their data_ptr() stay, and kernels may still read them, over the bus. A tensor
    over a movable buffer (movable_empty) moves whole; any other tensor that glake's allocator
    holds (its storage of at least 2 MiB, outside a CUDA graph's pool) moves its whole 2 MiB
    handles, the bytes it shares with neighbouring blocks staying on the device. ValueError for a
    tensor neither is, one already offloaded, or a small one (glake's small pool does not move);
    torch.cuda.OutOfMemoryError when host memory runs out (nothing of that buffer moved). The
    call holds no Python lock while it waits: run it on a helper thread to overlap it with work."""
    _movable_call("offload", tensors, stream)


def prefetch(tensors, stream=None):
    """Moves them back to device memory, ordered on `stream`: work queued there afterwards sees
    the data (other streams wait for it, e.g. with wait_stream). Where glake is PyTorch's
    allocator, the memory they need is first released from its cache (once for a list)."""
    _movable_call("prefetch", tensors, stream)


def residence(tensor):
    """"device" or "host" for a tensor over a movable buffer or glake's allocator, None for any
    other."""
    return _RESIDENCE.get(load().glake_residence(_pointer(tensor)))


def far_copy_bytes():
    """Host memory held by the kept copies of tensors managed read-only (Scheduler.manage) while
    they are on the device, over every device."""
    lib = load()
    return int(lib.glake_far_copy_bytes()) if hasattr(lib, "glake_far_copy_bytes") else 0


def movable_stats():
    """All movable buffers: buffers, device_bytes, host_bytes, cached_host_bytes (host memory kept
    for the next offload), offloaded_bytes and prefetched_bytes (totals moved), cached_buffer_bytes
    (freed movable allocations kept for reuse) and cache_reuses."""
    lib = load()
    names = ("buffers", "device_bytes", "host_bytes", "cached_host_bytes", "offloaded_bytes", "prefetched_bytes",
             "cached_buffer_bytes", "cache_reuses")
    values = (ctypes.c_uint64 * len(names))()
    n = lib.glake_movable_stats(values, len(names))
    return dict(zip(names, list(values)[:n]))


class movable_allocations:
    """Within this block, on this thread, CUDA requests of at least `min_bytes` through glake get
    movable buffers of their own: the tensors made then (e.g. a forward pass's activations) can
    be offloaded and prefetched under the same data_ptr(). Frees keep them for reuse by the same
    size on the same stream; torch.cuda.empty_cache() releases them. Nests."""

    def __init__(self, min_bytes=1 << 20):
        if min_bytes <= 0:
            raise ValueError("glake_torch: movable_allocations needs min_bytes > 0")
        self.min_bytes = int(min_bytes)
        self._previous = 0

    def __enter__(self):
        self._previous = load().glake_set_movable_scope(self.min_bytes)
        return self

    def __exit__(self, *exc):
        load().glake_set_movable_scope(self._previous)
        return False


# ------------------------------------------------------------------ copies from pageable memory


def copy_(dst, src, stream=None):
    """Copies the contiguous tensor `src` into the contiguous tensor `dst` (same dtype and number
    of elements), one on the GPU and one on the CPU, through glake's staged copier: a CPU tensor
    in pageable memory (a numpy array's, a loaded checkpoint's) goes through pinned buffers that
    several threads fill or drain while the GPU copies the previous one; a pinned one goes straight
    to one cudaMemcpyAsync. Ordered on `stream` (default: the CUDA tensor's current stream). To
    the GPU it returns once `src` has been read (src may be reused at once); to the CPU once `dst`
    holds the data. Returns dst. ValueError for tensors it cannot copy; RuntimeError when the
    loaded library has no glake_copy (the simulated one)."""
    lib = load()
    fn = getattr(lib, "glake_copy", None)
    if fn is None:
        raise RuntimeError("glake_torch: copy_ needs libglake_torch.so built with CUDA "
                           "(the simulated library has no glake_copy)")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    if dst.dtype != src.dtype or dst.numel() != src.numel():
        raise ValueError(f"glake_torch: copy_ from {src.dtype} x {src.numel()} to {dst.dtype} x {dst.numel()}: "
                         "dtype and number of elements must match")
    if not dst.is_contiguous() or not src.is_contiguous():
        raise ValueError("glake_torch: copy_ needs contiguous tensors")
    if dst.is_cuda == src.is_cuda:
        raise ValueError("glake_torch: copy_ copies between a CUDA tensor and a CPU tensor")
    device = (dst if dst.is_cuda else src).device.index
    nbytes = dst.numel() * dst.element_size()
    code = fn(dst.data_ptr(), src.data_ptr(), nbytes, _stream_handle(stream, device))
    _raise_for(code, lib, "copy_")
    return dst


# ------------------------------------------------------------------ checkpoints from files

# safetensors' dtype names, their torch dtype names and sizes in bytes.
_SAFETENSORS_DTYPES = {
    "BOOL": ("bool", 1), "U8": ("uint8", 1), "I8": ("int8", 1), "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1), "I16": ("int16", 2), "U16": ("uint16", 2), "F16": ("float16", 2),
    "BF16": ("bfloat16", 2), "I32": ("int32", 4), "U32": ("uint32", 4), "F32": ("float32", 4),
    "I64": ("int64", 8), "U64": ("uint64", 8), "F64": ("float64", 8),
}
_SAFETENSORS_MAX_HEADER = 100_000_000  # as the safetensors library


class SafetensorsEntry:
    """One tensor of a safetensors file: name, dtype (safetensors' name), shape, and its bytes
    [begin, end) in the data section."""

    __slots__ = ("name", "dtype", "shape", "begin", "end")

    def __init__(self, name, dtype, shape, begin, end):
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end

    def __repr__(self):
        return f"SafetensorsEntry({self.name!r}, {self.dtype}, {self.shape}, [{self.begin}, {self.end}))"


def safetensors_layout(path):
    """Reads and checks a safetensors file's header: returns (data_start, data_bytes, entries,
    metadata), entries in file order. ValueError, naming the file and the entry, for a header
    that is not what the format says (size, JSON, dtype, shape, offsets outside the data or not
    matching the shape); no tensor bytes are read."""
    import struct
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: {size} bytes, shorter than a safetensors header's 8-byte size")
        (n,) = struct.unpack("<Q", head)
        if n > _SAFETENSORS_MAX_HEADER or 8 + n > size:
            raise ValueError(f"{path}: a header of {n} bytes does not fit a file of {size} bytes "
                             f"(at most {_SAFETENSORS_MAX_HEADER})")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: the header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    data_start = 8 + n
    data_bytes = size - data_start
    metadata = header.pop("__metadata__", None) or {}
    entries = []
    for name, e in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(e, dict):
            raise ValueError(f"{where}: not an object")
        dtype, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{where}: dtype {dtype!r} is not one of {', '.join(_SAFETENSORS_DTYPES)}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise ValueError(f"{where}: shape {shape!r} is not a list of sizes")
        if (not isinstance(offsets, list) or len(offsets) != 2 or
                not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise ValueError(f"{where}: data_offsets {offsets!r} is not [begin, end]")
        begin, end = offsets
        if not 0 <= begin <= end <= data_bytes:
            raise ValueError(f"{where}: bytes [{begin}, {end}) lie outside the data section's {data_bytes} bytes")
        numel = 1
        for d in shape:
            numel *= d
        if numel * _SAFETENSORS_DTYPES[dtype][1] != end - begin:
            raise ValueError(f"{where}: {dtype} x {shape} needs {numel * _SAFETENSORS_DTYPES[dtype][1]} bytes, "
                             f"data_offsets give {end - begin}")
        entries.append(SafetensorsEntry(name, dtype, tuple(shape), begin, end))
    entries.sort(key=lambda x: x.begin)
    return data_start, data_bytes, entries, metadata


def load_safetensors(path, device=None, stream=None):
    """Loads a safetensors file straight into GPU memory: one device buffer for the data section,
    read from the file by glake's staged copier (several threads pread into pinned buffers while
    the GPU copies the previous one: no pageable copy of the file in between), and one tensor a
    header entry viewing its bytes (a tensor whose offset does not suit its dtype's alignment is
    copied into a tensor of its own, on the device). Returns {name: tensor}, in file order.
    The tensors share the buffer: its memory goes back once all of them are gone. Ordered on
    `stream` (default: the device's current stream); returns once the file has been read.
    ValueError for a malformed header (safetensors_layout), RuntimeError for a read or copy
    failure (the reason from glake) or a library without glake_copy_from_file."""
    lib = load()
    fn = getattr(lib, "glake_copy_from_file", None)
    if fn is None:
        raise RuntimeError("glake_torch: load_safetensors needs libglake_torch.so built with CUDA "
                           "(the simulated library has no glake_copy_from_file)")
    import torch
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    data_start, data_bytes, entries, _ = safetensors_layout(path)
    index = _device_index(device)
    dev = torch.device("cuda", index)
    used = max((e.end for e in entries), default=0)
    buffer = torch.empty(used, dtype=torch.uint8, device=dev)
    if used > 0:
        with open(path, "rb") as f:
            code = fn(buffer.data_ptr(), f.fileno(), data_start, used, _stream_handle(stream, index))
        _raise_for(code, lib, "load_safetensors")
    tensors = {}
    for e in entries:
        name, size = _SAFETENSORS_DTYPES[e.dtype]
        dtype = getattr(torch, name, None)
        if dtype is None:
            raise ValueError(f"{path}: tensor {e.name!r}: this torch has no {name}")
        piece = buffer[e.begin:e.end]
        if e.begin % size == 0:
            tensors[e.name] = piece.view(dtype).view(e.shape)
        else:
            t = torch.empty(e.shape, dtype=dtype, device=dev)
            t.view(-1).view(torch.uint8).copy_(piece)
            tensors[e.name] = t
    return tensors


SHARE_FIELDS = ("pieces", "shared", "stored", "kept_private", "shared_bytes")


class SharedMemory(_DeviceRegion):
    """A region of device memory for weights that several processes may share read-only
    (glake_shared_create): `nbytes` rounded up to 2 MiB on `device`, held by its own mappings, not
    by glake's allocator, so that sharing a piece gives this process's copy back to the driver.
    share() publishes it to a dedup broker (glake-dedup); it is read-only from then on. A tensor
    made over it keeps it alive through __cuda_array_interface__; it is destroyed with the last
    reference, after the device has finished with it."""

    def __init__(self, nbytes, device=None, library=None):
        if nbytes <= 0:
            raise ValueError(f"glake_torch: a shared region of {nbytes} bytes")
        self._lib = load(library)
        if not hasattr(self._lib, "glake_shared_create"):
            raise RuntimeError("glake_torch: this libglake_torch.so has no shared weights (rebuild it)")
        self.device = _device_index(device)
        self.ptr = self._lib.glake_shared_create(int(nbytes), self.device)
        if not self.ptr:
            raise _creation_error(self._lib, f"a shared region of {nbytes} bytes on device {self.device}")
        granule = 2 << 20
        self.nbytes = (int(nbytes) + granule - 1) // granule * granule
        self.published = None

    def share(self, socket, start_broker=None):
        """Publishes the whole region to the broker at `socket` (starting the glake-dedup executable
        `start_broker` there if none listens). Returns {pieces, shared, stored, kept_private,
        shared_bytes}: pieces now on another process's copy, on this one's (kept for others), or
        kept private (broker unreachable or refusing: said once on stderr), and the bytes given
        back. ValueError when published already."""
        values = (ctypes.c_uint64 * len(SHARE_FIELDS))()
        code = self._lib.glake_share(self.ptr, os.fsencode(socket),
                                     os.fsencode(start_broker) if start_broker else None, values, len(values))
        _raise_for(code, self._lib, "share")
        self.published = dict(zip(SHARE_FIELDS, (int(v) for v in values)))
        return dict(self.published)

    def _destroy(self, ptr):
        self._lib.glake_shared_destroy(ptr)


def shared_weights_layout(tensors, alignment=256):
    """Where share_weights puts each tensor: [(offset, nbytes)], in order, each offset a multiple
    of `alignment`, and the total. The same tensors (shapes and dtypes) give the same layout in
    every process, which is what lets equal weights land in equal pieces."""
    layout, offset = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        layout.append((offset, n))
        offset = (offset + n + alignment - 1) // alignment * alignment
    return layout, offset


def share_weights(model, socket, start_broker=None):
    """Moves `model`'s parameters and buffers (all on one CUDA device) into one SharedMemory region
    and publishes it to the dedup broker at `socket`: processes that load the same weights keep
    one copy of them on the device. The parameters stay the same objects (their .data is replaced
    by views of the region); tensors shared by several modules stay shared. The weights are
    read-only afterwards: for inference (a write faults on the device). Returns the totals of
    SharedMemory.share plus "bytes", the region's size."""
    import torch

    seen, order, owners = {}, [], []
    for module_name, module in model.named_modules():
        for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
            for name, t in table.items():
                if t is None:
                    continue
                key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
                if key not in seen:
                    seen[key] = len(order)
                    order.append(t)
                owners.append((module, kind, name, seen[key]))
    if not order:
        raise ValueError("glake_torch.share_weights: the model has no parameters or buffers")
    devices = {t.device for t in order}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"glake_torch.share_weights: the weights must be on one CUDA device, not {sorted(map(str, devices))}")
    device = next(iter(devices))
    layout, total = shared_weights_layout(order)
    memory = SharedMemory(max(total, 1), device.index)
    raw = torch.as_tensor(memory, device=device)
    raw.zero_()  # the padding too: equal weights must give equal pieces
    views = []
    with torch.no_grad():
        for t, (offset, n) in zip(order, layout):
            view = raw[offset:offset + n].view(t.dtype).view(t.shape)
            view.copy_(t)
            views.append(view)
    torch.cuda.synchronize(device)
    totals = memory.share(socket, start_broker)
    for module, kind, name, index in owners:
        if kind == "param":
            module._parameters[name].data = views[index]
        else:
            module._buffers[name] = views[index]
    totals["bytes"] = memory.nbytes
    return totals


class Scheduler:
    """Keeps the tensors it manages (glake's allocations: parameters, optimizer states, persistent
    buffers) within `budget` bytes of device memory, moving them to host memory and back under the
    same pointers, so the tensors and their data_ptr() never change (docs/scheduling.md). The
    policy is planned: the first iteration is recorded, then prefetches are placed ahead of each
    use and the furthest next use goes out first. With `socket` the budget is shared with the
    other processes whose schedulers joined the glake-budget coordinator there.

    Drive it by hand (manage, iteration_begin, will_use before each operation) or let attach(model)
    do it with module hooks. Tensors smaller than one 2 MiB handle are left alone (not movable);
    managed tensors are kept alive by the scheduler until unmanage() or close().

    `moves`: "wait" (each move returns once the memory moved: the thread waits for the device),
    "deferred" (a move queues its copies on `stream` and returns; the memory is remapped once
    they are done, and will_use settles what it names before returning: the thread waits only for
    the moves of what the next operation uses) or "overlapped" (deferred, the copies on two streams
    of the scheduler's own, after the work queued on `stream`: transfers run beside the work
    queued after them). With "deferred" or "overlapped", a managed tensor must not be used by work
    that will_use did not announce while its move is pending (a remap under a running kernel
    faults): call settle() first, e.g. before optimizer.step(); attach's hooks announce the
    forward and backward uses."""

    MOVES = ("wait", "deferred", "overlapped")

    def __init__(self, budget, device=None, socket=None, name=None, stream=None, library=None, moves="wait"):
        self._lib = load(library)
        if not hasattr(self._lib, "glake_scheduler_create"):
            raise RuntimeError("glake_torch: this libglake_torch.so has no schedulers (rebuild it)")
        if budget <= 0:
            raise ValueError(f"glake_torch: a budget of {budget} bytes")
        if moves not in self.MOVES:
            raise ValueError(f"glake_torch: moves must be one of {self.MOVES}, not {moves!r}")
        if moves != "wait" and not hasattr(self._lib, "glake_scheduler_create_with"):
            raise RuntimeError("glake_torch: this libglake_torch.so has no deferred moves (rebuild it)")
        self.device = _device_index(device)
        self.budget = int(budget)
        self.moves = moves
        arguments = (self.device, self.budget, os.fsencode(socket) if socket else None,
                     name.encode() if name else None, _stream_handle(stream, self.device))
        if hasattr(self._lib, "glake_scheduler_create_with"):
            handle = self._lib.glake_scheduler_create_with(*arguments, self.MOVES.index(moves))
        else:
            handle = self._lib.glake_scheduler_create(*arguments)
        if not handle:
            raise RuntimeError(f"glake_torch: creating a scheduler failed: {_last_error(self._lib)}")
        self._handle = handle
        self._managed = {}  # first address -> the tensor, kept alive while managed
        self._read_only = set()  # first addresses of those managed with read_only
        self._hooks = []

    MIN_BYTES = 2 << 20

    @staticmethod
    def _span(tensor):
        """(first address, bytes) of a tensor's storage, or of a (pointer, bytes) pair."""
        if hasattr(tensor, "untyped_storage"):
            storage = tensor.untyped_storage()
            return storage.data_ptr(), storage.nbytes()
        return int(tensor[0]), int(tensor[1])  # (pointer, bytes), without torch

    def manage(self, tensor, read_only=False):
        """Manages the storage of `tensor` (a CUDA tensor glake allocated). False, and nothing
        done, for one below 2 MiB or managed already.

        `read_only` promises that nothing writes the tensor while it is managed (a frozen
        weight): its host copy is kept once it has been offloaded and brought back, so its later
        offloads copy nothing and only give the device memory back. The copy holds host memory
        while the tensor is on the device (far_copy_bytes()). A write to it while managed is lost
        at its next offload; unmanage() ends the promise."""
        ptr, nbytes = self._span(tensor)
        if nbytes < self.MIN_BYTES or ptr in self._managed:
            return False
        if read_only and not hasattr(self._lib, "glake_keep_far_copy"):
            raise RuntimeError("glake_torch: this libglake_torch.so has no read-only marks (rebuild it)")
        _raise_for(self._lib.glake_scheduler_manage(self._handle, ptr, nbytes), self._lib, "manage")
        if read_only:
            code = self._lib.glake_keep_far_copy(ptr, 1)
            if code != 0:
                self._lib.glake_scheduler_unmanage(self._handle, ptr)
                _raise_for(code, self._lib, "manage")
            self._read_only.add(ptr)
        self._managed[ptr] = tensor
        return True

    def unmanage(self, tensor):
        ptr, _ = self._span(tensor)
        if ptr not in self._managed:
            raise ValueError("glake_torch: the tensor is not managed by this scheduler")
        _raise_for(self._lib.glake_scheduler_unmanage(self._handle, ptr), self._lib, "unmanage")
        self._unmark(ptr)
        del self._managed[ptr]

    def _unmark(self, ptr):
        if ptr in self._read_only:
            self._read_only.discard(ptr)
            self._lib.glake_keep_far_copy(ptr, 0)

    def managed(self, tensor):
        return self._span(tensor)[0] in self._managed

    def will_use(self, tensors):
        """The next operation uses these (managed ones count; others are ignored): they are on the
        device when this returns."""
        ptrs = [p for p in (self._span(t)[0] for t in tensors) if p in self._managed]
        if not ptrs:
            return
        array = (ctypes.c_void_p * len(ptrs))(*ptrs)
        _raise_for(self._lib.glake_scheduler_will_use(self._handle, array, len(ptrs)), self._lib, "will_use")

    def iteration_begin(self):
        _raise_for(self._lib.glake_scheduler_iteration_begin(self._handle), self._lib, "iteration_begin")

    def idle(self):
        _raise_for(self._lib.glake_scheduler_idle(self._handle), self._lib, "idle")

    def settle(self):
        """Completes every pending move of the managed tensors (moves="deferred"), waiting for their
        copies: call it before work that uses managed tensors without will_use, such as
        optimizer.step() over all parameters. Nothing to do with moves="wait"."""
        if self.moves != "wait":
            _raise_for(self._lib.glake_scheduler_settle(self._handle), self._lib, "settle")

    def stats(self):
        names = self._lib.glake_scheduler_stats_names().decode().split(",")
        values = (ctypes.c_uint64 * len(names))()
        self._lib.glake_scheduler_stats(self._handle, values, len(names))
        return dict(zip(names, (int(v) for v in values)))

    def attach(self, model, backward=True, read_only=None):
        """Manages `model`'s parameters (those of at least 2 MiB) and hooks it: a forward pre-hook
        on the model begins an iteration, and each module's forward pre-hook (and, with
        `backward`, its full backward pre-hook) brings its own parameters in before it runs.
        PyTorch refuses full backward hooks on a module whose output is modified in place
        afterwards; backward="outputs" hooks the gradient of each module's first output that
        requires one instead (a forward hook registers it; it fires before the module's backward
        runs, also when the output was modified in place or the module is recomputed by
        activation checkpointing). backward=False leaves the backward pass out: it then reads
        what is on the host over the bus, which memory offloaded with far_unmapped does not
        allow (attach refuses it then with a ValueError). read_only="frozen" manages the
        parameters that do not require grad as read-only (see manage), read_only="all" every
        parameter (inference, or gradients that no optimizer applies): their offloads copy
        nothing; the caller promises not to write them while attached (load weights before
        attach). Returns how many tensors it manages.

        Parameters still in host memory come to this scheduler's device one at a time, each
        managed as it arrives, so a model larger than the budget loads within it (build the model
        on the CPU, attach, then move the rest, e.g. model.to("cuda"), and make the optimizer)."""
        if read_only not in (None, "frozen", "all"):
            raise ValueError(f"glake_torch: read_only must be None, 'frozen' or 'all', not {read_only!r}")
        if not backward and "far_unmapped:true" in _settings_of(self._lib).split(","):
            raise ValueError("glake_torch: attach(backward=False) with GLAKE_ALLOC_CONF far_unmapped: memory away "
                             "is not mapped, so a backward pass that finds a parameter away faults; use "
                             "backward=True or backward=\"outputs\"")
        count = 0
        for p in model.parameters():
            if getattr(p, "is_cuda", True) is False:
                p.data = p.data.to(f"cuda:{self.device}")
            frozen = read_only == "all" or (read_only == "frozen" and not getattr(p, "requires_grad", True))
            count += bool(self.manage(p, read_only=frozen))
        self._hooks.append(model.register_forward_pre_hook(lambda module, args: self.iteration_begin()))
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if self.managed(p)]
            if not own:
                continue
            self._hooks.append(module.register_forward_pre_hook(lambda m, args, own=own: self.will_use(own)))
            if backward == "outputs":
                self._hooks.append(module.register_forward_hook(
                    lambda m, args, output, own=own: self._hook_gradient(output, own)))
            elif backward and hasattr(module, "register_full_backward_pre_hook"):
                self._hooks.append(module.register_full_backward_pre_hook(
                    lambda m, grad_output, own=own: self.will_use(own)))
        return count

    def _hook_gradient(self, output, own):
        # The first tensor of the output that takes part in autograd: its gradient's hook brings
        # the module's parameters in before the module's backward runs.
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if getattr(t, "requires_grad", False) and hasattr(t, "register_hook"):
                t.register_hook(lambda grad, own=own: self.will_use(own))
                return

    def close(self):
        """Removes the hooks, brings every managed tensor back to the device and stops managing it,
        and destroys the scheduler."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        handle, self._handle = getattr(self, "_handle", None), None
        if not handle:
            return
        self._lib.glake_scheduler_destroy(handle)
        for ptr in self._managed:  # back on the device where there is room; else it stays usable on the host
            if self._lib.glake_residence(ptr) == 2:
                self._lib.glake_prefetch(ptr, None)
            self._unmark(ptr)
        self._managed = {}

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

# Saved activations to host memory and back (glake_torch/_activations.py; torch is imported on first use).
from ._activations import offload_activations  # noqa: E402

# CuPy, Numba and RMM allocating through glake (glake_torch/cupy.py, numba.py, rmm.py; none needs torch).
from ._arrays import *  # noqa: E402,F401,F403
__all__ += _arrays.__all__  # noqa: F405
