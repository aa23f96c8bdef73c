"""glake as CuPy's device memory allocator.

    import cupy, glake_torch
    glake_torch.use_with_cupy()                          # or:
    cupy.cuda.set_allocator(glake_torch.cupy_allocator())

allocator() returns a function of a size in bytes giving a cupy.cuda.MemoryPointer, what
cupy.cuda.set_allocator takes. The memory is glake's (glake_malloc on the current device and the
current CuPy stream), wrapped in cupy.cuda.UnownedMemory whose owner frees it through glake
(glake_free with the same size, device and stream) once CuPy drops the last array viewing it. Like
CuPy's own pool, a block freed on a stream is reused at once by work on that stream; CuPy's pool
is bypassed, so cupy.get_default_memory_pool() reads zero and glake_torch.stats() says what is held.
Out of memory raises cupy.cuda.memory.OutOfMemoryError (CuPy's FFT plan cache and others catch it),
after glake's line on stderr saying what it held. Pinned host memory stays CuPy's.
"""

from . import _arrays


class _Block:
    """Owns one glake allocation; frees it when CuPy's UnownedMemory drops it (any thread)."""

    __slots__ = ("ptr", "size", "device", "stream", "_free")

    def __init__(self, free, ptr, size, device, stream):
        self._free, self.ptr, self.size, self.device, self.stream = free, ptr, size, device, stream

    def __del__(self):
        self._free(self.ptr, self.size, self.device, self.stream or None)


def _cupy():
    return _arrays.require("cupy", "cupy-cuda13x, or the CuPy wheel of your CUDA version", "glake_torch.cupy")


def allocator(device=None, library=None):
    """A CuPy allocator over glake: size -> cupy.cuda.MemoryPointer. `device` pins every allocation
    to one device (None: CuPy's current device at each call); `library` is the plug-in's path
    (None: glake_torch.load's search). Raises ModuleNotFoundError without CuPy."""
    cupy = _cupy()
    lib = _arrays.library(library)
    free = lib.glake_free
    cuda = cupy.cuda

    def glake_cupy_malloc(size):
        index = cuda.runtime.getDevice() if device is None else device
        stream = cuda.get_current_stream().ptr
        if size == 0:
            return cuda.MemoryPointer(cuda.UnownedMemory(0, 0, None, index), 0)
        try:
            ptr = _arrays.allocate(lib, size, index, stream)
        except _arrays.OutOfMemoryError:
            held = _arrays.stats_of(index)["active_bytes"]
            raise cuda.memory.OutOfMemoryError(size, held) from None
        memory = cuda.UnownedMemory(ptr, size, _Block(free, ptr, size, index, stream), index)
        return cuda.MemoryPointer(memory, 0)

    glake_cupy_malloc.glake_library = lib
    return glake_cupy_malloc


def use(library=None):
    """cupy.cuda.set_allocator(allocator()); returns the allocator CuPy had."""
    cupy = _cupy()
    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(allocator(library=library))
    return previous
