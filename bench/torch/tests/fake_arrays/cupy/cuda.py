"""cupy.cuda for the stand-in CuPy: a pool with CuPy's counters (used_bytes, total_bytes; it
keeps what it got), set_allocator/get_allocator, UnownedMemory, MemoryPointer, runtime."""

import itertools
import types

_addresses = itertools.count(1 << 40, 1 << 30)


class OutOfMemoryError(MemoryError):
    def __init__(self, size, total, limit=0):
        super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes).")


memory = types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError)


class UnownedMemory:
    def __init__(self, ptr, size, owner, device_id=-1):
        self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id


class MemoryPointer:
    def __init__(self, mem, offset):
        self.mem, self.ptr = mem, mem.ptr + offset


class _PoolBlock:
    def __init__(self, pool, size):
        self.pool, self.size = pool, size
        pool.used += size
        if pool.used > pool.total:
            pool.total = pool.used

    def __del__(self):
        self.pool.used -= self.size


class MemoryPool:
    def __init__(self):
        self.used = self.total = 0

    def malloc(self, size):
        return MemoryPointer(UnownedMemory(next(_addresses), size, _PoolBlock(self, size), 0), 0)

    def used_bytes(self):
        return self.used

    def total_bytes(self):
        return self.total


default_pool = MemoryPool()
_allocator = default_pool.malloc


def set_allocator(allocator=None):
    global _allocator
    _allocator = allocator or default_pool.malloc


def get_allocator():
    return _allocator


def alloc(size):
    return _allocator(size)


def get_current_stream():
    return types.SimpleNamespace(ptr=0)


class Device:
    def __init__(self, index=0):
        self.id = index

    def use(self):
        pass

    def synchronize(self):
        pass


runtime = types.SimpleNamespace(
    getDevice=lambda: 0,
    memGetInfo=lambda: (70 << 30, 80 << 30),
    getDeviceProperties=lambda index: {"name": b"stand-in GPU"},
)
