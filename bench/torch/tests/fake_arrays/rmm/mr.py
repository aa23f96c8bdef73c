"""rmm.mr for the stand-in RMM."""

import itertools

_addresses = itertools.count(1 << 44, 1 << 30)


class Stream:
    def __init__(self, handle=0):
        self.handle_ = handle

    def __cuda_stream__(self):
        return (0, self.handle_)


class CudaMemoryResource:
    def allocate(self, size, stream=None):
        return next(_addresses)

    def deallocate(self, ptr, size, stream=None):
        pass


class PoolMemoryResource:
    def __init__(self, upstream, initial_pool_size=None, maximum_pool_size=None):
        self.upstream, self.used, self.size = upstream, 0, initial_pool_size or 0

    def allocate(self, size, stream=None):
        self.used += size
        self.size = max(self.size, self.used)
        return self.upstream.allocate(size, stream)

    def deallocate(self, ptr, size, stream=None):
        self.used -= size

    def pool_size(self):
        return self.size


class StatisticsResourceAdaptor:
    def __init__(self, upstream):
        self.upstream, self.current, self.peak = upstream, 0, 0

    def allocate(self, size, stream=None):
        ptr = self.upstream.allocate(size, stream)
        self.current += size
        self.peak = max(self.peak, self.current)
        return ptr

    def deallocate(self, ptr, size, stream=None):
        self.current -= size
        self.upstream.deallocate(ptr, size, stream)

    @property
    def allocation_counts(self):
        return {"current_bytes": self.current, "peak_bytes": self.peak}


class CallbackMemoryResource:
    def __init__(self, allocate_func, deallocate_func):
        self.allocate_func, self.deallocate_func = allocate_func, deallocate_func

    def allocate(self, size, stream=None):
        return self.allocate_func(size, stream or Stream())

    def deallocate(self, ptr, size, stream=None):
        self.deallocate_func(ptr, size, stream or Stream())


_resources = {0: CudaMemoryResource()}


def get_current_device_resource():
    return _resources[0]


def set_current_device_resource(resource):
    _resources[0] = resource


def get_per_device_resource(device):
    return _resources.get(device)


def set_per_device_resource(device, resource):
    _resources[device] = resource
