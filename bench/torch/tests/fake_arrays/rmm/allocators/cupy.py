"""rmm.allocators.cupy for the stand-in RMM: CuPy memory from RMM's current resource."""

import cupy

from .. import mr


class _Buffer:
    def __init__(self, size):
        self.resource, self.size = mr.get_current_device_resource(), size
        self.ptr = self.resource.allocate(size) if size else 0

    def __del__(self):
        if self.ptr:
            self.resource.deallocate(self.ptr, self.size)


def rmm_cupy_allocator(nbytes):
    buf = _Buffer(nbytes)
    return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(buf.ptr, nbytes, buf, 0), 0)
