"""The array-library hooks (glake_torch/cupy.py, numba.py, rmm.py) without a GPU, CuPy, Numba, RMM
or torch: each library is replaced by a small fake in sys.modules that does with the hook what the
real one does (CuPy calls the allocator and drops UnownedMemory's owner; Numba calls memalloc and
the MemoryPointer's finalizer; RMM calls the two callbacks with its Stream), over the plug-in's
simulated library ($GLAKE_TORCH_SIM_LIBRARY, set by CTest). The plug-in's calls are recorded on
their way to it, so sizes, devices, streams and frees are checked as glake receives them, and
glake's own statistics say the memory came back.

Run: ctest -R torch_plugin.python (with the other Python tests), or
     GLAKE_TORCH_SIM_LIBRARY=build/debug/integrations/torch/libglake_torch_sim.so \
         python3 -m unittest discover -s integrations/torch/tests -p test_arrays.py -v
"""

import collections
import contextlib
import ctypes
import gc
import importlib
import os
import sys
import types
import unittest
import weakref
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import glake_torch  # noqa: E402
from glake_torch import _arrays  # noqa: E402

SIM = os.environ.get("GLAKE_TORCH_SIM_LIBRARY")
MiB = 1 << 20
needs_sim = unittest.skipUnless(SIM and os.path.isfile(SIM), "GLAKE_TORCH_SIM_LIBRARY is not set (run through ctest)")


@contextlib.contextmanager
def modules(**fakes):
    """Puts fake modules into sys.modules for the block ("a__b" names "a.b"), with the hook modules
    imported afresh inside it, then restores both."""
    names = {name.replace("__", "."): module for name, module in fakes.items()}
    hooks = ("glake_torch.cupy", "glake_torch.numba", "glake_torch.rmm")
    saved = {name: sys.modules.get(name) for name in list(names) + list(hooks)}
    try:
        for name in hooks:
            sys.modules.pop(name, None)
        sys.modules.update(names)
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        for name in hooks:
            if hasattr(glake_torch, name.split(".")[1]) and name not in sys.modules:
                delattr(glake_torch, name.split(".")[1])


class Recorder:
    """The plug-in, with its glake_malloc / glake_free calls recorded (stream None read as 0)."""

    def __init__(self, lib):
        self.lib, self.calls = lib, []

    def glake_malloc(self, size, device, stream):
        ptr = self.lib.glake_malloc(size, device, stream)
        self.calls.append(("malloc", size, device, stream or 0, ptr))
        return ptr

    def glake_free(self, ptr, size, device, stream):
        self.calls.append(("free", size, device, stream or 0, ptr))
        self.lib.glake_free(ptr, size, device, stream)

    def __getattr__(self, name):
        return getattr(self.lib, name)


@contextlib.contextmanager
def recorded():
    recorder = Recorder(glake_torch.load(SIM))
    with mock.patch.object(_arrays, "library", lambda path=None: recorder):
        yield recorder


def enter(test, context):
    """test.enterContext (Python 3.11) for older Pythons."""
    stack = contextlib.ExitStack()
    test.addCleanup(stack.close)
    return stack.enter_context(context)


def active_bytes():
    return glake_torch.stats(0)["active_bytes"]


# --- fakes ---------------------------------------------------------------------------------------


def fake_cupy():
    """cupy.cuda as the hook uses it: set_allocator/get_allocator, runtime.getDevice,
    get_current_stream().ptr, UnownedMemory (keeps its owner), MemoryPointer, memory.OutOfMemoryError."""
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    memory = types.ModuleType("cupy.cuda.memory")
    runtime = types.ModuleType("cupy.cuda.runtime")
    state = types.SimpleNamespace(device=0, stream=0, allocator="cupy's pool")

    class UnownedMemory:
        def __init__(self, ptr, size, owner, device_id=-1):
            if device_id < 0 and ptr == 0:
                raise RuntimeError("UnownedMemory requires explicit device ID for a null pointer.")
            self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id

    class MemoryPointer:
        def __init__(self, mem, offset):
            self.mem, self.ptr = mem, mem.ptr + offset

    class OutOfMemoryError(MemoryError):
        def __init__(self, size, total, limit=0):
            super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes).")
            self.size, self.total = size, total

    memory.OutOfMemoryError = OutOfMemoryError
    memory.MemoryPointer = MemoryPointer
    runtime.getDevice = lambda: state.device
    cuda.memory, cuda.runtime = memory, runtime
    cuda.UnownedMemory, cuda.MemoryPointer = UnownedMemory, MemoryPointer
    cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=state.stream)
    cuda.get_allocator = lambda: state.allocator
    cuda.set_allocator = lambda allocator: setattr(state, "allocator", allocator)
    cupy.cuda = cuda
    return cupy, state


def fake_numba():
    """numba.cuda as an EMM plug-in sees it: HostOnlyCUDAMemoryManager (context, allocations,
    reset), MemoryPointer calling its finalizer when freed or collected (weakref.finalize), set_memory_manager, and the driver
    module with the cuda.bindings binding (CUdeviceptr, cuMemGetInfo) and MemoryInfo."""
    numba = types.ModuleType("numba")
    cuda = types.ModuleType("numba.cuda")
    cudadrv = types.ModuleType("numba.cuda.cudadrv")
    driver = types.ModuleType("numba.cuda.cudadrv.driver")
    state = types.SimpleNamespace(manager=None, resets=0, device_free=1000 * MiB, device_total=4000 * MiB)

    class CUdeviceptr:
        def __init__(self, value):
            self.value = value

        def __int__(self):
            return self.value

    driver.USE_NV_BINDING = True
    driver.binding = types.SimpleNamespace(CUdeviceptr=CUdeviceptr)
    driver.driver = types.SimpleNamespace(cuMemGetInfo=lambda: (state.device_free, state.device_total))
    driver.MemoryInfo = collections.namedtuple("MemoryInfo", "free,total")

    class HostOnlyCUDAMemoryManager:
        def __init__(self, *args, **kwargs):
            self.context = kwargs.pop("context")
            self.allocations = {}

        def reset(self):
            state.resets += 1
            self.allocations.clear()

    class MemoryPointer:
        def __init__(self, context, pointer, size, owner=None, finalizer=None):
            self.context, self.device_pointer, self.size = context, pointer, size
            self._finalizer = weakref.finalize(self, finalizer) if finalizer is not None else None

        def free(self):
            if self._finalizer is not None:
                self._finalizer()

    cuda.HostOnlyCUDAMemoryManager, cuda.MemoryPointer = HostOnlyCUDAMemoryManager, MemoryPointer
    cuda.set_memory_manager = lambda manager: setattr(state, "manager", manager)
    cuda.cudadrv, cudadrv.driver = cudadrv, driver
    numba.cuda = cuda
    context = types.SimpleNamespace(device=types.SimpleNamespace(id=0))
    return numba, cuda, cudadrv, driver, state, context


def fake_rmm():
    """rmm.mr with CallbackMemoryResource (keeps the two callbacks; allocate/deallocate call them
    with an rmm-like Stream speaking __cuda_stream__) and the per-device resource map."""
    rmm = types.ModuleType("rmm")
    mr = types.ModuleType("rmm.mr")
    state = types.SimpleNamespace(resources={0: "rmm's cuda resource"}, current=0)

    class Stream:
        def __init__(self, handle):
            self.handle_ = handle

        def __cuda_stream__(self):
            return (0, self.handle_)

    class CallbackMemoryResource:
        def __init__(self, allocate_func, deallocate_func):
            self.allocate_func, self.deallocate_func = allocate_func, deallocate_func

        def allocate(self, size, stream=0):
            return self.allocate_func(size, Stream(stream))

        def deallocate(self, ptr, size, stream=0):
            self.deallocate_func(ptr, size, Stream(stream))

    mr.CallbackMemoryResource = CallbackMemoryResource
    mr.get_current_device_resource = lambda: state.resources.get(state.current)
    mr.set_current_device_resource = lambda r: state.resources.__setitem__(state.current, r)
    mr.get_per_device_resource = lambda device: state.resources.get(device)
    mr.set_per_device_resource = lambda device, r: state.resources.__setitem__(device, r)
    rmm.mr = mr
    return rmm, mr, state


# --- tests ---------------------------------------------------------------------------------------


class MissingLibraryTest(unittest.TestCase):
    """Without the array library, each entry point says which package to install."""

    def test_each_hook_names_the_package_to_install(self):
        blocked = {"cupy": None, "numba": None, "numba.cuda": None, "rmm": None}
        with modules(**blocked):
            for call, package in ((glake_torch.cupy_allocator, "cupy-cuda13x"), (glake_torch.use_with_cupy, "cupy"),
                                  (glake_torch.numba_memory_manager, "numba-cuda"),
                                  (glake_torch.use_with_numba, "numba-cuda"),
                                  (glake_torch.rmm_resource, "rmm-cu13"), (glake_torch.use_with_rmm, "rmm-cu13")):
                with self.subTest(call=call.__name__):
                    with self.assertRaises(ModuleNotFoundError) as raised:
                        call()
                    self.assertIn("not installed", str(raised.exception))
                    self.assertIn(f"pip install {package}", str(raised.exception))

    def test_a_failure_inside_an_installed_library_keeps_its_own_message(self):
        def broken(name):
            raise ModuleNotFoundError("No module named 'fastrlock'", name="fastrlock")

        with mock.patch.object(importlib, "import_module", broken):
            with self.assertRaises(ModuleNotFoundError) as raised:
                _arrays.require("cupy", "cupy-cuda13x", "glake_torch.cupy")
        self.assertEqual(raised.exception.name, "fastrlock")

    def test_the_package_imports_without_torch_or_an_array_library(self):
        for name in ("OutOfMemoryError", "cupy_allocator", "use_with_cupy", "numba_memory_manager", "use_with_numba",
                     "rmm_resource", "use_with_rmm"):
            self.assertIn(name, glake_torch.__all__)
        self.assertTrue(issubclass(glake_torch.OutOfMemoryError, MemoryError))


@needs_sim
class CupyTest(unittest.TestCase):
    def setUp(self):
        self.cupy, self.state = fake_cupy()
        enter(self, modules(cupy=self.cupy, cupy__cuda=self.cupy.cuda))
        self.lib = enter(self, recorded())
        self.before = active_bytes()

    def test_allocations_come_from_glake_on_the_current_stream_and_are_freed_on_it(self):
        allocate = glake_torch.cupy_allocator()
        self.state.stream = 0x1000
        a = allocate(3 * MiB)
        self.state.stream = 0x2000  # the current stream at the free does not matter: the block's does
        b = allocate(5 * MiB + 1)
        self.assertEqual([c[:4] for c in self.lib.calls], [("malloc", 3 * MiB, 0, 0x1000), ("malloc", 5 * MiB + 1, 0, 0x2000)])
        self.assertEqual((a.ptr, a.mem.size, a.mem.device_id), (self.lib.calls[0][4], 3 * MiB, 0))
        self.assertEqual(active_bytes() - self.before, 8 * MiB + 1)
        del a
        gc.collect()
        self.assertEqual(self.lib.calls[2], ("free", 3 * MiB, 0, 0x1000, self.lib.calls[0][4]))
        del b
        gc.collect()
        self.assertEqual(self.lib.calls[3], ("free", 5 * MiB + 1, 0, 0x2000, self.lib.calls[1][4]))
        self.assertEqual(active_bytes(), self.before)

    def test_a_view_keeps_the_block_until_the_last_pointer_goes(self):
        allocate = glake_torch.cupy_allocator()
        a = allocate(2 * MiB)
        view = self.cupy.cuda.MemoryPointer(a.mem, MiB)
        del a
        gc.collect()
        self.assertEqual([c[0] for c in self.lib.calls], ["malloc"])
        del view
        gc.collect()
        self.assertEqual([c[0] for c in self.lib.calls], ["malloc", "free"])

    def test_zero_bytes_ask_glake_nothing(self):
        p = glake_torch.cupy_allocator()(0)
        self.assertEqual((p.ptr, p.mem.size, p.mem.device_id), (0, 0, 0))
        self.assertEqual(self.lib.calls, [])

    def test_out_of_memory_is_cupys_error_and_holds_nothing(self):
        allocate = glake_torch.cupy_allocator()
        with self.assertRaises(self.cupy.cuda.memory.OutOfMemoryError) as raised:
            allocate(1 << 50)
        self.assertEqual(raised.exception.size, 1 << 50)
        self.assertEqual(active_bytes(), self.before)

    def test_a_pinned_device_is_used_whatever_is_current(self):
        allocate = glake_torch.cupy_allocator(device=0)
        self.state.device = 3
        p = allocate(MiB)
        self.assertEqual(self.lib.calls[0][2], 0)
        self.assertEqual(p.mem.device_id, 0)

    def test_use_installs_it_and_returns_the_previous_allocator(self):
        previous = glake_torch.use_with_cupy()
        self.assertEqual(previous, "cupy's pool")
        self.assertTrue(callable(self.state.allocator))
        self.state.allocator(MiB)
        gc.collect()
        self.assertEqual([c[0] for c in self.lib.calls], ["malloc", "free"])


@needs_sim
class NumbaTest(unittest.TestCase):
    def setUp(self):
        numba, cuda, cudadrv, driver, self.state, self.context = fake_numba()
        enter(self, modules(numba=numba, numba__cuda=cuda, numba__cuda__cudadrv=cudadrv,
                                  numba__cuda__cudadrv__driver=driver))
        self.lib = enter(self, recorded())
        self.before = active_bytes()
        self.manager = glake_torch.numba_memory_manager()(context=self.context)
        self.manager.initialize()

    def test_memalloc_comes_from_glake_and_the_finalizer_frees_it(self):
        m = self.manager.memalloc(7 * MiB)
        ptr = self.lib.calls[0][4]
        self.assertEqual(self.lib.calls, [("malloc", 7 * MiB, 0, 0, ptr)])
        self.assertEqual((int(m.device_pointer), m.size, m.context), (ptr, 7 * MiB, self.context))
        self.assertEqual(active_bytes() - self.before, 7 * MiB)
        m.free()
        self.assertEqual(self.lib.calls[1], ("free", 7 * MiB, 0, 0, ptr))
        self.assertEqual(active_bytes(), self.before)

    def test_memory_info_counts_glakes_cache_as_free(self):
        m = self.manager.memalloc(3 * MiB)
        m.free()
        held = glake_torch.stats(0)
        cached = held["reserved_bytes"] - held["allocated_bytes"]
        self.assertGreater(cached, 0)
        info = self.manager.get_memory_info()
        self.assertEqual((info.free, info.total), (self.state.device_free + cached, self.state.device_total))

    def test_reset_releases_glakes_cache(self):
        self.manager.memalloc(3 * MiB).free()
        held = glake_torch.stats(0)
        self.assertGreater(held["reserved_bytes"], held["allocated_bytes"])
        self.manager.reset()
        held = glake_torch.stats(0)
        self.assertEqual(self.state.resets, 1)
        self.assertEqual(held["reserved_bytes"], held["allocated_bytes"])

    def test_out_of_memory_is_a_memory_error(self):
        with self.assertRaises(glake_torch.OutOfMemoryError):
            self.manager.memalloc(1 << 50)
        self.assertEqual(active_bytes(), self.before)

    def test_a_collected_pointer_is_freed(self):
        self.manager.memalloc(MiB)
        gc.collect()
        self.assertEqual([c[0] for c in self.lib.calls], ["malloc", "free"])
        self.assertEqual(active_bytes(), self.before)

    def test_ipc_is_refused_with_the_reason(self):
        with self.assertRaisesRegex(NotImplementedError, "cuMemMap"):
            self.manager.get_ipc_handle(self.manager.memalloc(MiB))

    def test_numba_over_its_ctypes_binding_gets_ctypes_pointers(self):
        driver = sys.modules["numba.cuda.cudadrv.driver"]
        driver.USE_NV_BINDING = False

        def mem_get_info(free, total):
            free._obj.value, total._obj.value = self.state.device_free, self.state.device_total

        driver.driver = types.SimpleNamespace(cuMemGetInfo=mem_get_info)
        m = self.manager.memalloc(MiB)
        self.assertIsInstance(m.device_pointer, ctypes.c_uint64)
        self.assertEqual(m.device_pointer.value, self.lib.calls[0][4])
        self.assertEqual(self.manager.get_memory_info().total, self.state.device_total)
        m.free()

    def test_the_environment_variable_and_use_find_the_manager(self):
        module = importlib.import_module("glake_torch.numba")
        self.assertIs(module._numba_memory_manager, glake_torch.numba_memory_manager())
        self.assertEqual(module.GlakeNumbaManager(context=self.context).interface_version, 1)
        glake_torch.use_with_numba()
        self.assertIs(self.state.manager, module.GlakeNumbaManager)


@needs_sim
class RmmTest(unittest.TestCase):
    def setUp(self):
        rmm, mr, self.state = fake_rmm()
        enter(self, modules(rmm=rmm, rmm__mr=mr))
        self.lib = enter(self, recorded())
        self.before = active_bytes()

    def test_callbacks_allocate_and_free_through_glake_on_rmms_stream(self):
        resource = glake_torch.rmm_resource(device=0)
        p = resource.allocate(9 * MiB, 0x3000)
        self.assertEqual(self.lib.calls, [("malloc", 9 * MiB, 0, 0x3000, p)])
        self.assertEqual(active_bytes() - self.before, 9 * MiB)
        resource.deallocate(p, 9 * MiB, 0x3000)
        self.assertEqual(self.lib.calls[1], ("free", 9 * MiB, 0, 0x3000, p))
        self.assertEqual(active_bytes(), self.before)

    def test_zero_bytes_and_null_frees_reach_nothing(self):
        resource = glake_torch.rmm_resource(device=0)
        self.assertEqual(resource.allocate(0), 0)
        resource.deallocate(0, 0)
        self.assertEqual(self.lib.calls, [])

    def test_out_of_memory_is_a_memory_error(self):
        with self.assertRaises(MemoryError):
            glake_torch.rmm_resource(device=0).allocate(1 << 50)

    def test_use_sets_the_current_or_the_named_devices_resource(self):
        with mock.patch("glake_torch.rmm._current_device", lambda: 0):
            previous = glake_torch.use_with_rmm()
        self.assertEqual(previous, "rmm's cuda resource")
        self.assertTrue(hasattr(self.state.resources[0], "allocate_func"))
        glake_torch.use_with_rmm(device=1)
        self.assertTrue(hasattr(self.state.resources[1], "allocate_func"))

    def test_stream_objects_are_read_by_the_cuda_stream_protocol(self):
        from glake_torch import rmm as hook

        self.assertEqual(hook.stream_handle(None), 0)
        self.assertEqual(hook.stream_handle(types.SimpleNamespace(__cuda_stream__=lambda: (0, 0x77))), 0x77)
        self.assertEqual(hook.stream_handle(types.SimpleNamespace(ptr=0x55)), 0x55)
        with self.assertRaises(TypeError):
            hook.stream_handle(object())


if __name__ == "__main__":
    unittest.main()
