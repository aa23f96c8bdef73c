"""A stand-in for RMM's Python package in tests of bench/torch/array_libraries.py: rmm.mr's
resources as Python objects (a pool that keeps what it got, a statistics adaptor with exact byte
counts, CallbackMemoryResource calling its two functions with a Stream) and
rmm.allocators.cupy.rmm_cupy_allocator over the current resource."""

from . import mr  # noqa: F401

__version__ = "0.0+fake"
