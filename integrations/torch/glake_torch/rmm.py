"""glake as an RMM device memory resource, for RMM's Python API and what allocates through it
(cuDF and the rest of RAPIDS, rmm.DeviceBuffer, rmm.allocators.cupy/numba/torch).

    import rmm, glake_torch
    rmm.mr.set_current_device_resource(glake_torch.rmm_resource())   # or glake_torch.use_with_rmm()

resource() is an rmm.mr.CallbackMemoryResource whose allocate and deallocate call glake_malloc and
glake_free on one device (the current one when it is made, as RMM's per-device resources) and on
the stream RMM passes, so RMM's stream ordering holds: a block deallocated on a stream is reused
at once by work on that stream. Each call crosses into Python (RMM says as much of every
CallbackMemoryResource): for cuDF's many small allocations, put rmm.mr.PoolMemoryResource or
BinningMemoryResource over it only if profiles show that cost. Out of memory raises
glake_torch.OutOfMemoryError (a MemoryError, which RMM turns into std::bad_alloc / rmm's
out_of_memory) after glake's line on stderr.
"""

from . import _arrays


def _rmm():
    return _arrays.require("rmm", "rmm-cu13, or the RMM wheel of your CUDA version", "glake_torch.rmm")


def stream_handle(stream):
    """The cudaStream_t of the stream object RMM hands a callback, as an int (0: the default
    stream): rmm.pylibrmm.stream.Stream speaks the CUDA stream protocol (__cuda_stream__)."""
    if stream is None:
        return 0
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        _, handle = protocol() if callable(protocol) else protocol
        return int(handle)
    for name in ("handle", "ptr", "value"):
        handle = getattr(stream, name, None)
        if handle is not None:
            return int(handle)
    raise TypeError(f"glake_torch.rmm: cannot tell the CUDA stream of {stream!r}")


def _current_device():
    """The CUDA runtime's current device (what RMM's per-device resource map is keyed by)."""
    try:
        from cuda.bindings import runtime  # RMM's own dependency (cuda-bindings)
    except ImportError:
        try:
            from cuda import cudart as runtime  # cuda-python before 12.6
        except ImportError:
            return 0
    status, device = runtime.cudaGetDevice()
    if int(status) != 0:
        raise RuntimeError(f"glake_torch.rmm: cudaGetDevice failed ({status})")
    return int(device)


def callbacks(device=None, library=None):
    """The (allocate, deallocate) pair of RMM's CallbackMemoryResource over glake on `device`
    (None: the current one now): allocate(size, stream) -> int, deallocate(ptr, size, stream)."""
    lib = _arrays.library(library)
    index = _current_device() if device is None else int(device)
    free = lib.glake_free

    def allocate(size, stream):
        return _arrays.allocate(lib, size, index, stream_handle(stream))

    def deallocate(ptr, size, stream):
        if ptr:
            free(ptr, size, index, stream_handle(stream) or None)

    return allocate, deallocate


def resource(device=None, library=None):
    """rmm.mr.CallbackMemoryResource over glake on `device` (None: the current device now);
    `library` is the plug-in's path. Raises ModuleNotFoundError without RMM's Python package."""
    rmm = _rmm()
    allocate, deallocate = callbacks(device, library)
    return rmm.mr.CallbackMemoryResource(allocate, deallocate)


def use(device=None, library=None):
    """Makes resource(device) RMM's resource of that device (None: the current device:
    rmm.mr.set_current_device_resource; else rmm.mr.set_per_device_resource); returns the
    resource RMM had there."""
    rmm = _rmm()
    mr = resource(device, library)
    if device is None:
        previous = rmm.mr.get_current_device_resource()
        rmm.mr.set_current_device_resource(mr)
    else:
        previous = rmm.mr.get_per_device_resource(int(device))
        rmm.mr.set_per_device_resource(int(device), mr)
    return previous
