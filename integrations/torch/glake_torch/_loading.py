"""Opens libglake_torch.so with ctypes, turning the loader's failures into errors that say what is
missing and what to do (the loader's own message names a file, not the cause)."""

import ctypes


class DriverNotFoundError(OSError):
    """The NVIDIA driver's libcuda.so.1, which libglake_torch.so links, is not on this machine."""


def open_library(path):
    """ctypes.CDLL(path); raises DriverNotFoundError without the NVIDIA driver, and OSError naming
    torch's libc10 when the library was built against a torch that is not found."""
    try:
        return ctypes.CDLL(path)
    except OSError as error:
        text = str(error)
        if "libcuda.so" in text:
            raise DriverNotFoundError(
                f"glake_torch: {path} needs the NVIDIA driver (libcuda.so.1), which is not installed or not "
                "on the loader's path (LD_LIBRARY_PATH): glake_torch runs where a CUDA GPU and its driver are"
            ) from None
        if "libc10" in text:
            raise OSError(
                f"glake_torch: {path} was built against torch, whose libc10 is not found ({text}): install "
                "the torch it was built with (pip show glake-torch names it), or import torch before glake_torch"
            ) from None
        raise OSError(f"glake_torch: cannot load {path}: {text}") from None
