"""What the array-library hooks share (glake_torch/cupy.py, numba.py, rmm.py): the plug-in's
allocation through ctypes, the error for a missing library, and the entry points glake_torch
re-exports. None of it imports torch: the hooks load libglake_torch.so with glake_torch.load(),
which imports torch only where it is installed (a library built against torch's libc10 needs it
loaded first); the library itself needs only the NVIDIA driver.

Every hook follows glake's stream rule (integrations/torch/glake_torch.h): a block is freed with
the size, device and stream it was allocated with, and it may be reused at once by work queued on
that stream, and by other streams once that work has completed.
"""

import importlib

__all__ = [
    "OutOfMemoryError",
    "cupy_allocator",
    "use_with_cupy",
    "numba_memory_manager",
    "use_with_numba",
    "rmm_resource",
    "use_with_rmm",
]


class OutOfMemoryError(MemoryError):
    """glake could not allocate what an array library asked for (the reason, with what glake held,
    is the line the plug-in wrote on stderr just before)."""


def require(module, package, what):
    """Imports `module`, or raises ModuleNotFoundError naming the pip package to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is not None and module != error.name and not module.startswith(error.name + "."):
            raise  # the library is there but something it imports is not: its own message says what
        raise ModuleNotFoundError(
            f"glake_torch: {what} needs {module}, which is not installed: pip install {package}", name=module
        ) from None


def library(path=None):
    """The plug-in (glake_torch.load): `path`, else $GLAKE_TORCH_LIBRARY, else the packaged or
    built one."""
    from . import load

    return load(path)


def allocate(lib, size, device, stream):
    """glake_malloc(size, device, stream) as an int; raises OutOfMemoryError on failure. Zero bytes
    are not asked for: they give 0."""
    if size < 0:
        raise ValueError(f"glake_torch: cannot allocate {size} bytes")
    if size == 0:
        return 0
    ptr = lib.glake_malloc(size, device, stream or None)
    if not ptr:
        raise OutOfMemoryError(
            f"glake_torch: out of memory allocating {size} bytes on device {device} (glake's message, "
            "with what it held, is on stderr)"
        )
    return ptr


def stats_of(device):
    """glake_torch.stats(device)."""
    from . import stats

    return stats(device)


# The public entry points, re-exported by glake_torch; each imports its hook module (and so the
# array library) only when called.


def cupy_allocator(device=None, library=None):
    """A CuPy allocator over glake (glake_torch.cupy.allocator): cupy.cuda.set_allocator(it)."""
    from . import cupy

    return cupy.allocator(device=device, library=library)


def use_with_cupy(library=None):
    """Makes glake CuPy's device allocator (glake_torch.cupy.use)."""
    from . import cupy

    return cupy.use(library=library)


def numba_memory_manager():
    """The Numba EMM plug-in class over glake (glake_torch.numba.GlakeNumbaManager)."""
    from . import numba

    return numba.GlakeNumbaManager


def use_with_numba(library=None):
    """Makes glake Numba's device memory manager (glake_torch.numba.use)."""
    from . import numba

    return numba.use(library=library)


def rmm_resource(device=None, library=None):
    """An rmm.mr.CallbackMemoryResource over glake (glake_torch.rmm.resource)."""
    from . import rmm

    return rmm.resource(device=device, library=library)


def use_with_rmm(device=None, library=None):
    """Makes glake RMM's current device resource (glake_torch.rmm.use)."""
    from . import rmm

    return rmm.use(device=device, library=library)
