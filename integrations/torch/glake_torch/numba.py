"""glake as Numba's device memory manager (an External Memory Management plug-in).

    import glake_torch
    glake_torch.use_with_numba()          # before Numba's first device allocation, or:
    NUMBA_CUDA_MEMORY_MANAGER=glake_torch.numba python3 app.py

GlakeNumbaManager allocates device memory (cuda.device_array, to_device, ...) through glake
(glake_malloc on the context's device, on the default stream, as Numba's own allocations are
unordered) and frees it through glake when Numba finalizes the MemoryPointer. Host memory
(memhostalloc, mempin) stays Numba's. get_memory_info() is the device's free memory plus what
glake holds cached (free to Numba's allocations), and its total; reset() (numba.cuda's context
reset) releases glake's cached memory. IPC handles are refused: glake's memory is mapped with
cuMemMap, which cuIpcGetMemHandle does not cover. Out of memory raises
glake_torch.OutOfMemoryError (a MemoryError) after glake's line on stderr.
"""

import ctypes

from . import _arrays

_numba = _arrays.require("numba.cuda", "numba-cuda", "glake_torch.numba")
_driver = _arrays.require("numba.cuda.cudadrv.driver", "numba-cuda", "glake_torch.numba")
_library = None  # the plug-in's path, as use() was given it (None: glake_torch.load's search)


def _device_pointer(value):
    """The pointer as the binding Numba's driver uses: cuda.bindings' CUdeviceptr, or a ctypes
    c_uint64 where Numba runs over its ctypes binding (older Numba, NUMBA_CUDA_USE_NVIDIA_BINDING=0)."""
    if not getattr(_driver, "USE_NV_BINDING", True):
        return ctypes.c_uint64(value)
    binding = getattr(_driver, "binding", None)
    if binding is None:
        from cuda.bindings import driver as binding
    return binding.CUdeviceptr(value)


def _driver_memory_info():
    """(free, total) bytes of the current context's device, from cuMemGetInfo."""
    get = _driver.driver.cuMemGetInfo
    if getattr(_driver, "USE_NV_BINDING", True):  # Numba's wrapper returns the values
        free, total = get()
    else:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        get(ctypes.byref(free), ctypes.byref(total))
        free, total = free.value, total.value
    return int(free), int(total)


def _finalizer(free, ptr, size, device):
    def finalize():
        free(ptr, size, device, None)

    return finalize


class GlakeNumbaManager(_numba.HostOnlyCUDAMemoryManager):
    """Numba's EMM interface (version 1) over glake; one per Numba context (device)."""

    def initialize(self):  # at every push of the context: once is enough
        if getattr(self, "_lib", None) is None:
            self._lib = _arrays.library(_library)
            self._device = self.context.device.id

    _ready = initialize

    def memalloc(self, size):
        self._ready()
        ptr = _arrays.allocate(self._lib, size, self._device, None)
        finalizer = _finalizer(self._lib.glake_free, ptr, size, self._device) if ptr else None
        return _numba.MemoryPointer(self.context, _device_pointer(ptr), size, finalizer=finalizer)

    def get_memory_info(self):
        self._ready()
        free, total = _driver_memory_info()
        held = _arrays.stats_of(self._device)
        free += held["reserved_bytes"] - held["allocated_bytes"]
        info = getattr(_driver, "MemoryInfo", None)
        return info(free=free, total=total) if info is not None else (free, total)

    def get_ipc_handle(self, memory):
        raise NotImplementedError(
            "glake_torch.numba: glake's device memory is mapped with cuMemMap, which CUDA IPC "
            "(cuIpcGetMemHandle) does not cover; share such arrays another way, or use Numba's own "
            "memory manager for them"
        )

    def reset(self):
        super().reset()
        self._ready()
        self._lib.glake_empty_cache(self._device)

    @property
    def interface_version(self):
        return 1


def use(library=None):
    """numba.cuda.set_memory_manager(GlakeNumbaManager): before Numba's first device allocation
    (a context made earlier keeps its manager). `library` is the plug-in's path."""
    global _library
    _library = library
    _arrays.library(library)  # a missing or unloadable plug-in fails here, not at the first array
    _numba.set_memory_manager(GlakeNumbaManager)
    return GlakeNumbaManager


# NUMBA_CUDA_MEMORY_MANAGER=glake_torch.numba makes Numba look this name up.
_numba_memory_manager = GlakeNumbaManager
