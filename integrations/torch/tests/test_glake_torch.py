"""Tests for the PyTorch plug-in's Python module and C interface, without torch or a GPU.

The C interface is exercised through libglake_torch_sim.so (the plug-in's source built over the
simulated backend; $GLAKE_TORCH_SIM_LIBRARY, set by CTest); torch is replaced by a fake that does
what torch.cuda.memory.CUDAPluggableAllocator does with the library (loads it, looks the two
functions up) and records what enable() asks of it. With $GLAKE_REPLAY (glake-replay), a trace
recorded by the plug-in is replayed and must give the plug-in's own peaks.

Run: ctest -R torch_plugin.python, or
     GLAKE_TORCH_SIM_LIBRARY=build/debug/integrations/torch/libglake_torch_sim.so \
         python3 -m unittest discover -s integrations/torch/tests -v
"""

import contextlib
import ctypes
import json
import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
import types
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import glake_torch  # noqa: E402

SIM = os.environ.get("GLAKE_TORCH_SIM_LIBRARY")
REPLAY = os.environ.get("GLAKE_REPLAY")
MiB = 1 << 20
needs_sim = unittest.skipUnless(SIM and os.path.isfile(SIM), "GLAKE_TORCH_SIM_LIBRARY is not set (run through ctest)")


@contextlib.contextmanager
def environment(**values):
    """Sets (or, for None, removes) environment variables for the block, then restores them."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def mock_modules(**modules):
    """Puts `modules` into sys.modules for the block (names with dots as keyword arguments through
    **{...}), then restores what was there."""
    saved = {name: sys.modules.get(name) for name in modules}
    try:
        sys.modules.update(modules)
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@contextlib.contextmanager
def captured_stderr():
    """What C code writes to file descriptor 2 during the block, as a list of lines."""
    lines = []
    sys.stderr.flush()
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines.extend(sink.read().decode(errors="replace").splitlines())


def fake_torch(initialized=False, hooks=True):
    """A stand-in for torch with what enable() uses; `seen` records the calls."""
    seen = {"empty_cache_calls": 0}

    class RawAllocator:
        pass

    if hooks:
        RawAllocator.set_reset_fn = lambda self, ptr: seen.__setitem__("reset_fn", ptr)
        RawAllocator.set_record_stream_fn = lambda self, ptr: seen.__setitem__("record_stream_fn", ptr)
        for setter in ("set_begin_allocate_to_pool", "set_end_allocate_to_pool_fn", "set_release_pool"):
            setattr(RawAllocator, setter, lambda self, ptr, setter=setter: seen.__setitem__(setter, ptr))

    class CUDAPluggableAllocator:
        def __init__(self, path, alloc_fn_name, free_fn_name):
            lib = ctypes.CDLL(path)  # what torch does: the two functions must be there
            for name in (alloc_fn_name, free_fn_name):
                if ctypes.cast(getattr(lib, name), ctypes.c_void_p).value is None:
                    raise AssertionError(name)
            seen["pluggable"] = (path, alloc_fn_name, free_fn_name)
            self._raw = RawAllocator()

        def allocator(self):
            return self._raw

    def change_current_allocator(allocator):
        seen["current"] = allocator

    def empty_cache():
        seen["empty_cache_calls"] += 1

    cuda = types.ModuleType("torch.cuda")
    cuda.is_initialized = lambda: initialized
    cuda.current_device = lambda: 0
    cuda.empty_cache = empty_cache
    cuda.memory = types.SimpleNamespace(
        CUDAPluggableAllocator=CUDAPluggableAllocator,
        change_current_allocator=change_current_allocator,
        empty_cache=empty_cache,
    )
    torch = types.ModuleType("torch")
    torch.cuda = cuda
    return torch, seen


@contextlib.contextmanager
def torch_replaced_by(torch):
    saved = sys.modules.get("torch")
    sys.modules["torch"] = torch
    try:
        yield
    finally:
        if saved is None:
            sys.modules.pop("torch", None)
        else:
            sys.modules["torch"] = saved
        glake_torch._allocator = None  # each test enables afresh
        glake_torch._hooks.clear()


class LibraryPath(unittest.TestCase):
    def test_argument_then_environment_then_build_tree(self):
        with tempfile.TemporaryDirectory() as root:
            older = os.path.join(root, "build", "debug", "integrations", "torch", glake_torch.LIBRARY_NAME)
            newer = os.path.join(root, "build", "release", "integrations", "torch", glake_torch.LIBRARY_NAME)
            given = os.path.join(root, "mine.so")
            for i, path in enumerate((older, newer, given)):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                open(path, "w").close()
                os.utime(path, (1000 + i, 1000 + i))
            with environment(GLAKE_TORCH_LIBRARY=None):
                self.assertEqual(glake_torch.library_path(root=root), newer)  # the newest build
                self.assertEqual(glake_torch.library_path(given, root=root), given)
                script_built = os.path.join(root, "build", "torch", glake_torch.LIBRARY_NAME)
                os.makedirs(os.path.dirname(script_built))
                open(script_built, "w").close()
                self.assertEqual(glake_torch.library_path(root=root), script_built)  # build_plugin.sh's
            with environment(GLAKE_TORCH_LIBRARY=older):
                self.assertEqual(glake_torch.library_path(root=root), older)
                self.assertEqual(glake_torch.library_path(given, root=root), given)  # argument wins

    def test_missing_library_says_where_it_looked(self):
        with tempfile.TemporaryDirectory() as root, environment(GLAKE_TORCH_LIBRARY=None):
            with self.assertRaises(FileNotFoundError) as caught:
                glake_torch.library_path(root=root)
            self.assertIn(os.path.join(root, "build", "torch"), str(caught.exception))
            self.assertIn("GLAKE_TORCH_LIBRARY", str(caught.exception))
            with self.assertRaises(FileNotFoundError) as caught:
                glake_torch.library_path(os.path.join(root, "nope.so"), root=root)
            self.assertIn("nope.so", str(caught.exception))
        with environment(GLAKE_TORCH_LIBRARY="/nonexistent/libglake_torch.so"):
            with self.assertRaises(FileNotFoundError) as caught:
                glake_torch.library_path()
            self.assertIn("GLAKE_TORCH_LIBRARY", str(caught.exception))


@needs_sim
class Enable(unittest.TestCase):
    def test_installs_glake_and_both_hooks_and_the_reset_hook_releases_cached_memory(self):
        torch, seen = fake_torch()
        with torch_replaced_by(torch), environment(GLAKE_ALLOC_CONF=None):
            glake_torch.enable(conf="reuse_limit:3", library=SIM)
            self.assertTrue(glake_torch.enabled())
            self.assertEqual(os.environ["GLAKE_ALLOC_CONF"], "reuse_limit:3")
            self.assertIn("reuse_limit:3", glake_torch.settings())
            self.assertEqual(seen["pluggable"], (os.path.abspath(SIM), "glake_torch_malloc", "glake_free"))
            self.assertIs(seen["current"]._raw, seen["current"].allocator())
            self.assertEqual(
                glake_torch.hooks(),
                {"empty_cache": "set_reset_fn", "record_stream": "set_record_stream_fn",
                 "graph_pools": "set_begin_allocate_to_pool, set_end_allocate_to_pool_fn, set_release_pool"})

            lib = glake_torch.load()
            for setter, function in (("set_begin_allocate_to_pool", "glake_begin_allocate_to_pool"),
                                     ("set_end_allocate_to_pool_fn", "glake_end_allocate_to_pool"),
                                     ("set_release_pool", "glake_release_pool")):
                self.assertEqual(seen[setter], ctypes.cast(getattr(lib, function), ctypes.c_void_p).value)
            self.assertEqual(seen["record_stream_fn"], ctypes.cast(lib.glake_record_stream, ctypes.c_void_p).value)
            # What PyTorch does on torch.cuda.empty_cache(): call the reset function, no arguments.
            device = 1
            blocks = [lib.glake_malloc(8 * MiB, device, None) for _ in range(3)]
            for p in blocks:
                lib.glake_free(p, 8 * MiB, device, None)
            self.assertEqual(glake_torch.stats(device)["reserved_bytes"], 24 * MiB)
            ctypes.CFUNCTYPE(None)(seen["reset_fn"])()
            self.assertEqual(glake_torch.stats(device)["reserved_bytes"], 0)

            glake_torch.enable(conf="reuse_limit:4")  # once enabled, nothing changes
            self.assertEqual(os.environ["GLAKE_ALLOC_CONF"], "reuse_limit:3")

    def test_refuses_once_cuda_is_initialised(self):
        torch, seen = fake_torch(initialized=True)
        with torch_replaced_by(torch):
            with self.assertRaises(RuntimeError) as caught:
                glake_torch.enable(library=SIM)
            self.assertIn("before CUDA is initialised", str(caught.exception))
            self.assertNotIn("current", seen)
            self.assertFalse(glake_torch.enabled())

    def test_rejects_invalid_settings_before_switching(self):
        torch, seen = fake_torch()
        with torch_replaced_by(torch), environment(GLAKE_ALLOC_CONF=None):
            with self.assertRaises(ValueError) as caught:
                glake_torch.enable(conf="frag_limit:lots", library=SIM)
            self.assertIn("frag_limit", str(caught.exception))
            self.assertNotIn("pluggable", seen)
            self.assertFalse(glake_torch.enabled())

    def test_without_set_reset_fn_wraps_torch_empty_cache(self):
        torch, seen = fake_torch(hooks=False)
        with torch_replaced_by(torch):
            glake_torch.enable(library=SIM)
            self.assertIn("wrapped", glake_torch.hooks()["empty_cache"])
            self.assertIn("not installed", glake_torch.hooks()["record_stream"])
            self.assertIn("not installed", glake_torch.hooks()["graph_pools"])
            lib = glake_torch.load()
            device = 5
            p = lib.glake_malloc(4 * MiB, device, None)
            lib.glake_free(p, 4 * MiB, device, None)
            self.assertEqual(glake_torch.stats(device)["reserved_bytes"], 4 * MiB)
            torch.cuda.empty_cache()
            self.assertEqual(seen["empty_cache_calls"], 1)  # torch's own still runs
            self.assertEqual(glake_torch.stats(device)["reserved_bytes"], 0)


@needs_sim
class Statistics(unittest.TestCase):
    def setUp(self):
        self.lib = glake_torch.load(SIM)

    def test_names_match_the_values(self):
        names = self.lib.glake_stats_names().decode().split(",")
        values = (ctypes.c_uint64 * 64)()
        self.assertEqual(self.lib.glake_stats(0, values, 64), len(names))
        self.assertEqual(len(set(names)), len(names))
        self.assertEqual(self.lib.glake_backend(), b"simulated")
        self.assertEqual(self.lib.glake_stats(64, values, 64), 0)  # device id out of range
        with self.assertRaises(ValueError):
            glake_torch.stats(64)

    def test_peaks_counts_and_reset(self):
        lib, device = self.lib, 2
        fresh = glake_torch.stats(device)
        self.assertEqual(fresh["allocations"], 0)
        self.assertEqual(fresh["utilization"], 0.0)
        a = lib.glake_malloc(10 * MiB, device, None)
        b = lib.glake_malloc(6 * MiB + 100, device, None)
        lib.glake_free(a, 10 * MiB, device, None)
        s = glake_torch.stats(f"cuda:{device}")
        self.assertEqual((s["allocations"], s["deallocations"]), (2, 1))
        self.assertEqual(s["active_bytes"], 6 * MiB + 100)
        self.assertEqual(s["peak_active_bytes"], 16 * MiB + 100)  # requested bytes, not rounded
        self.assertEqual(s["peak_reserved_bytes"], 18 * MiB)
        self.assertAlmostEqual(s["utilization"], (16 * MiB + 100) / (18 * MiB))
        self.assertGreater(s["driver_create"], 0)
        counts = {k: v for k, v in s.items() if k.startswith("driver_") and k not in ("driver_calls", "driver_ns")}
        self.assertEqual(s["driver_calls"], sum(v for k, v in counts.items() if not k.endswith("_ns")))
        self.assertEqual(s["driver_ns"], sum(v for k, v in counts.items() if k.endswith("_ns")))
        self.assertGreater(s["driver_map_ns"], 0)  # time is kept for the kinds called, apart from their counts
        self.assertEqual(s["driver_unmap_ns"], 0)

        glake_torch.empty_cache(device)  # a's segment was fully free: gone
        s = glake_torch.stats(device)
        self.assertEqual(s["reserved_bytes"], 8 * MiB)
        self.assertEqual(s["peak_reserved_bytes"], 18 * MiB)

        glake_torch.reset_peak_stats(device)
        s = glake_torch.stats(device)
        self.assertEqual((s["peak_active_bytes"], s["peak_reserved_bytes"]), (6 * MiB + 100, 8 * MiB))
        self.assertEqual((s["lifetime_peak_active_bytes"], s["lifetime_peak_reserved_bytes"]), (16 * MiB + 100, 18 * MiB))
        c = lib.glake_malloc(4 * MiB, device, None)
        lib.glake_free(c, 4 * MiB, device, None)
        s = glake_torch.stats(device)
        self.assertEqual((s["peak_active_bytes"], s["peak_reserved_bytes"]), (10 * MiB + 100, 12 * MiB))
        lib.glake_free(b, 6 * MiB + 100, device, None)

    def test_pytorch_names_and_torch_cuda_answering_from_glake(self):
        lib, device = self.lib, 7
        before = glake_torch.stats(device)
        self.assertEqual(before["allocations"], 0)  # a device no other test uses
        a = lib.glake_malloc(10 * MiB, device, None)
        b = lib.glake_malloc(1000, device, None)
        lib.glake_free(a, 10 * MiB, device, None)
        s = glake_torch.stats(device)
        m = glake_torch.memory_stats(device)
        self.assertEqual(list(m), sorted(m))
        self.assertEqual(m["requested_bytes.all.current"], 1000)
        self.assertEqual(m["requested_bytes.all.peak"], 10 * MiB + 1000)
        self.assertEqual(m["allocated_bytes.all.current"], s["allocated_bytes"])
        self.assertGreaterEqual(m["allocated_bytes.all.current"], 1000)  # rounded up
        self.assertGreaterEqual(m["allocated_bytes.all.peak"], 10 * MiB + 1000)
        self.assertEqual(m["active_bytes.all.peak"], m["allocated_bytes.all.peak"])
        self.assertEqual(m["reserved_bytes.all.current"], s["reserved_bytes"])
        self.assertEqual(m["reserved_bytes.all.peak"], s["peak_reserved_bytes"])
        self.assertEqual((m["allocation.all.current"], m["allocation.all.allocated"], m["allocation.all.freed"]), (1, 2, 1))
        self.assertEqual(m["segment.all.current"], s["segments_created"] - s["segments_released"])
        self.assertEqual(m["num_device_alloc"], s["driver_create"])
        self.assertEqual(m["num_ooms"], 0)
        self.assertEqual(m["glake.stitches"], s["stitches"])
        self.assertNotIn("num_alloc_retries", m)  # not kept by glake: absent, not guessed
        self.assertEqual(glake_torch.max_memory_allocated(device), m["allocated_bytes.all.peak"])
        self.assertEqual(glake_torch.memory_reserved(device), s["reserved_bytes"])

        # torch.cuda's own functions, as torch 2.11 writes them: memory_allocated and friends look
        # memory_stats up in torch.cuda.memory at each call, and raise with a pluggable allocator.
        memory = types.ModuleType("torch.cuda.memory")
        exec(textwrap.dedent("""
            def memory_stats(device=None):
                raise RuntimeError("memory_stats is not supported by the pluggable allocator")
            def memory_allocated(device=None):
                return memory_stats(device=device).get("allocated_bytes.all.current", 0)
            def max_memory_allocated(device=None):
                return memory_stats(device=device).get("allocated_bytes.all.peak", 0)
            def max_memory_reserved(device=None):
                return memory_stats(device=device).get("reserved_bytes.all.peak", 0)
            def reset_peak_memory_stats(device=None):
                raise RuntimeError("not supported")
        """), memory.__dict__)
        cuda = types.ModuleType("torch.cuda")
        for name in ("memory_stats", "memory_allocated", "max_memory_allocated", "max_memory_reserved",
                     "reset_peak_memory_stats"):
            setattr(cuda, name, getattr(memory, name))
        cuda.memory = memory
        cuda.is_initialized = lambda: False
        torch = types.ModuleType("torch")
        torch.cuda = cuda
        with mock_modules(torch=torch, **{"torch.cuda": cuda, "torch.cuda.memory": memory}):
            with self.assertRaises(RuntimeError):
                cuda.max_memory_allocated(device)
            replaced = glake_torch.use_in_torch_cuda()
            self.assertIn("torch.cuda.memory.memory_stats", replaced)
            self.assertEqual(cuda.memory_allocated(device), m["allocated_bytes.all.current"])
            self.assertEqual(cuda.max_memory_allocated(device), m["allocated_bytes.all.peak"])
            self.assertEqual(cuda.memory_stats(device)["num_ooms"], 0)
            cuda.reset_peak_memory_stats(device)
            self.assertEqual(cuda.max_memory_allocated(device), glake_torch.stats(device)["peak_allocated_bytes"])
            self.assertLess(cuda.max_memory_allocated(device), m["allocated_bytes.all.peak"])
            self.assertEqual(cuda.max_memory_reserved(device), glake_torch.stats(device)["peak_reserved_bytes"])
        lib.glake_free(b, 1000, device, None)

    def test_memory_fraction_limits_what_a_device_holds(self):
        lib, device = self.lib, 8
        glake_torch.set_memory_fraction(0.01, device)  # 1% of the simulated 80 GiB: 819 MiB
        self.assertIsNone(lib.glake_malloc(900 * MiB, device, None))
        a = lib.glake_malloc(800 * MiB, device, None)
        self.assertIsNotNone(a)
        self.assertIsNone(lib.glake_malloc(64 * MiB, device, None))
        s = glake_torch.stats(device)
        self.assertEqual(s["failed_allocations"], 2)
        self.assertLessEqual(s["reserved_bytes"], 80 * 1024 * MiB // 100)
        with self.assertRaises(ValueError):
            glake_torch.set_memory_fraction(1.5, device)
        glake_torch.set_memory_fraction(1.0, device)  # the whole device again
        b = lib.glake_malloc(2048 * MiB, device, None)
        self.assertIsNotNone(b)
        lib.glake_free(b, 2048 * MiB, device, None)
        glake_torch.set_memory_fraction(0.0, device)  # nothing more may be had
        self.assertEqual(glake_torch.stats(device)["reserved_bytes"], 800 * MiB)  # b's cached 2 GiB went back at once
        self.assertIsNone(lib.glake_malloc(4 * MiB, device, None))
        lib.glake_free(a, 800 * MiB, device, None)
        glake_torch.empty_cache(device)
        self.assertEqual(glake_torch.stats(device)["reserved_bytes"], 0)

HOST_TIME = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[2])
    import glake_torch
    lib = glake_torch.load(sys.argv[1])
    before = glake_torch.host_time()
    p = lib.glake_malloc(3 << 20, 0, None)
    lib.glake_free(p, 3 << 20, 0, None)
    lib.glake_free(None, 0, 0, None)
    print(json.dumps({"before": before, "after": glake_torch.host_time()}))
    """
)


@needs_sim
class HostTime(unittest.TestCase):
    def run_with(self, value):
        env = dict(os.environ)
        env.pop("GLAKE_HOST_TIMING", None)
        if value is not None:
            env["GLAKE_HOST_TIMING"] = value
        run = subprocess.run([sys.executable, "-c", HOST_TIME, SIM, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))],
                             env=env, capture_output=True, text=True, check=True)
        return json.loads(run.stdout)

    def test_counts_calls_and_time_only_when_asked(self):
        r = self.run_with("1")
        self.assertEqual(r["before"], {"ns": 0, "calls": 0})
        self.assertEqual(r["after"]["calls"], 3)  # a free of null is a call too
        self.assertGreater(r["after"]["ns"], 0)
        for off in (None, "", "0"):
            self.assertEqual(self.run_with(off), {"before": None, "after": None}, off)


@needs_sim
class ErrorsStayInside(unittest.TestCase):
    def setUp(self):
        self.lib = glake_torch.load(SIM)

    def test_bad_frees_are_reported_and_counted(self):
        lib, device = self.lib, 3
        p = lib.glake_malloc(3 * MiB, device, None)
        before = glake_torch.stats(device)["errors"]
        with captured_stderr() as lines:
            lib.glake_free(0x1234, 64, device, None)  # never allocated
            lib.glake_free(p, 5 * MiB, device, None)  # wrong size
            lib.glake_free(p, 3 * MiB, 40, None)  # a device that has no allocator
            lib.glake_record_stream(0x1234, 0x77)
            lib.glake_free(None, 0, device, None)  # null: nothing to say
        self.assertEqual(len(lines), 4, lines)
        self.assertTrue(all(line.startswith("glake: ") for line in lines), lines)
        self.assertIn("did not return", lines[0])
        self.assertIn("size", lines[1])
        self.assertIn("no glake allocator", lines[2])
        self.assertIn("record_stream", lines[3])
        s = glake_torch.stats(device)
        self.assertEqual(s["errors"] - before, 4)
        self.assertEqual(s["active_bytes"], 3 * MiB)  # p is still live after the bad frees
        lib.glake_free(p, 3 * MiB, device, None)
        self.assertEqual(glake_torch.stats(device)["active_bytes"], 0)

    def test_failed_allocations_return_null_with_one_line(self):
        lib, device = self.lib, 4
        with environment(GLAKE_ALLOC_CONF="memory_limit:64MiB"):
            with captured_stderr() as lines:
                small = lib.glake_malloc(32 * MiB, device, None)
                self.assertIsNone(lib.glake_malloc(128 * MiB, device, None))
                self.assertIsNone(lib.glake_malloc(MiB, 99, None))  # device id out of range
                self.assertIsNone(lib.glake_malloc(0, device, None))  # zero bytes: null, silently
        self.assertIsNotNone(small)
        self.assertEqual(len(lines), 2, lines)
        self.assertIn("out of memory", lines[0])
        self.assertIn("device 4", lines[0])
        self.assertIn("device 99", lines[1])
        s = glake_torch.stats(device)
        self.assertEqual(s["failed_allocations"], 1)
        self.assertEqual(s["active_bytes"], 32 * MiB)  # the allocator still serves
        lib.glake_free(small, 32 * MiB, device, None)

    def test_bad_settings_fail_allocations_not_the_process(self):
        lib, device = self.lib, 6
        with environment(GLAKE_ALLOC_CONF="reuse_limit:0.5"):
            with self.assertRaises(ValueError) as caught:
                glake_torch.settings()
            self.assertIn("reuse_limit", str(caught.exception))
            with captured_stderr() as lines:
                self.assertIsNone(lib.glake_malloc(MiB, device, None))
            self.assertEqual(len(lines), 1, lines)
            self.assertIn("reuse_limit", lines[0])


RECORD = textwrap.dedent(
    """
    import ctypes, json, random, sys
    lib = ctypes.CDLL(sys.argv[1])
    lib.glake_malloc.restype = ctypes.c_void_p
    lib.glake_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.glake_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.glake_stats_names.restype = ctypes.c_char_p
    names = lib.glake_stats_names().decode().split(",")
    def stats(device):
        values = (ctypes.c_uint64 * len(names))()
        lib.glake_stats(device, values, len(names))
        return dict(zip(names, values))
    rng = random.Random(7)
    streams = [None, 0x1000, 0x2000]  # first used in this order, so numbered 0, 1, 2
    live = []
    for i in range(3000):
        if live and rng.random() < (0.3 if len(live) < 100 else 0.7):
            p, size, device, stream = live.pop(rng.randrange(len(live)))
            lib.glake_free(p, size, device, stream)
            continue
        device = 0 if rng.random() < 0.8 else 1
        size = rng.randint(1, 1 << 20) if rng.random() < 0.5 else rng.randint(1 << 20, 96 << 20)
        stream = streams[i] if i < 3 else rng.choice(streams)
        p = lib.glake_malloc(size, device, stream)
        assert p, (size, device)
        live.append((p, size, device, stream))
    peaks = {d: stats(d) for d in (0, 1)}
    for p, size, device, stream in live:
        lib.glake_free(p, size, device, stream)
    lib.glake_empty_cache_all()
    print(json.dumps({"peaks": peaks, "after": {d: stats(d) for d in (0, 1)}}))
    """
)


def memory_viz():
    """PyTorch's torch/cuda/_memory_viz.py: torch's own where torch imports, else the file
    $GLAKE_MEMORY_VIZ names (its plotting and summary functions need nothing of torch); None."""
    try:
        from torch.cuda import _memory_viz  # noqa: PLC0415

        return _memory_viz
    except ImportError:
        pass
    path = os.environ.get("GLAKE_MEMORY_VIZ")
    if not path:
        return None
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location("_memory_viz", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def replay_like_memory_viz(test, snapshot, device):
    """What MemoryViz.js's segment view does at each event (simulate_memory, then draw): starting
    from the snapshot's segments and live blocks, undo the device's events newest first; at every
    step each live block must lie inside a segment, an undone free_requested must find its block,
    and an undone segment_map / segment_alloc must find its segment. Returns the steps checked."""
    segments = [[s["address"], s["total_size"]] for s in snapshot["segments"] if s["device"] == device]
    blocks = {}
    for s in snapshot["segments"]:
        if s["device"] != device:
            continue
        at = s["address"]
        for b in s["blocks"]:
            test.assertEqual(b["address"], at)  # blocks tile their segment
            if b["state"] in ("active_allocated", "active_pending_free"):
                blocks[at] = b["size"]
            at += b["size"]
        test.assertEqual(at, s["address"] + s["total_size"])

    def inside(addr):
        return any(a <= addr < a + n for a, n in segments)

    steps = 0
    for e in reversed(snapshot["device_traces"][device]):
        action, addr, size = e["action"], e["addr"], e["size"]
        if action == "alloc":
            blocks.pop(addr, None)
        elif action == "free_completed":
            blocks[addr] = size
        elif action == "free_requested":
            test.assertIn(addr, blocks, f"free_requested of {addr:#x} undone with no block there")
        elif action in ("segment_free", "segment_unmap"):
            segments.append([addr, size])
        elif action in ("segment_alloc", "segment_map"):
            found = [s for s in segments if s[0] <= addr and addr + size <= s[0] + s[1]]
            test.assertTrue(found, f"{action} of {addr:#x} undone with no segment there")
            segments.remove(found[0])
        for live in blocks:
            test.assertTrue(inside(live), f"block {live:#x} in no segment after undoing {e}")
        steps += 1
    return steps


@needs_sim
class Snapshots(unittest.TestCase):
    def setUp(self):
        self.lib = glake_torch.load(SIM)

    def tearDown(self):
        glake_torch.record_memory_history(enabled=None)

    def segments_of(self, snap, device):
        return [s for s in snap["segments"] if s["device"] == device]

    def one_segment_per_request(self):
        # These checks read one segment per large request, as glake made them before segments
        # grew in place (segment_reserve, the plug-in's default): a grown segment is reported as
        # segment_free of the old and segment_alloc of the new, which the undo below cannot step
        # through block by block (docs/pytorch.md).
        cm = environment(GLAKE_ALLOC_CONF="segment_reserve:0")
        cm.__enter__()
        self.addCleanup(cm.__exit__, None, None, None)

    def test_segments_blocks_and_history_match_the_allocator(self):
        self.one_segment_per_request()
        lib, device = self.lib, 11
        glake_torch.record_memory_history(max_entries=1000)
        sizes = [30 * MiB, 1000, 5 * MiB + 7, 100, 64 * MiB]
        live = {lib.glake_malloc(n, device, None): n for n in sizes}
        first, second = list(live)[:2]
        lib.glake_free(first, live.pop(first), device, None)
        lib.glake_free(second, live.pop(second), device, None)
        snap = glake_torch.snapshot()
        self.assertEqual(set(snap), {"segments", "device_traces", "stitched_ranges"})
        segments = self.segments_of(snap, device)
        self.assertTrue(segments)
        stats = glake_torch.stats(device)
        self.assertEqual(sum(s["total_size"] for s in segments if s["segment_type"] == "large"), stats["reserved_bytes"])
        keys = {"device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream",
                "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"}
        allocated = {}
        for s in segments:
            self.assertLessEqual(keys, set(s))
            self.assertEqual(sum(b["size"] for b in s["blocks"]), s["total_size"])
            self.assertEqual(s["allocated_size"], sum(b["size"] for b in s["blocks"] if b["state"] == "active_allocated"))
            self.assertEqual(s["segment_pool_id"], [0, 0])
            for b in s["blocks"]:
                self.assertLessEqual({"address", "size", "requested_size", "state", "frames"}, set(b))
                self.assertIn(b["state"], ("active_allocated", "active_pending_free", "inactive"))
                if b["state"] == "active_allocated":
                    allocated[b["address"]] = b["requested_size"]
        self.assertEqual(allocated, live)
        self.assertEqual(sum(s["requested_size"] for s in segments), stats["active_bytes"])
        small = [b for s in segments for b in s["blocks"] if b.get("pool") == "small"]
        self.assertTrue(any(live.get(b["address"]) == 100 for b in small))

        trace = snap["device_traces"][device]
        self.assertGreater(len(snap["device_traces"]), device)  # one list per device up to the last one made
        self.assertEqual([e["size"] for e in trace if e["action"] == "alloc"], sizes)
        actions = [e["action"] for e in trace if e["action"] != "segment_alloc"]
        self.assertEqual(actions, ["alloc"] * 5 + ["free_requested", "free_completed"] * 2)
        self.assertEqual([e["addr"] for e in trace if e["action"] == "free_requested"], [first, second])
        times = [e["time_us"] for e in trace]
        self.assertEqual(times, sorted(times))
        for e in trace:
            self.assertLessEqual({"action", "addr", "size", "stream", "time_us", "frames"}, set(e))
        # A segment_alloc comes before the first allocation inside it.
        alloc_at = {e["addr"]: i for i, e in enumerate(trace) if e["action"] == "alloc"}
        for i, e in enumerate(trace):
            if e["action"] == "segment_alloc":
                inside = [j for a, j in alloc_at.items() if e["addr"] <= a < e["addr"] + e["size"]]
                self.assertTrue(inside and min(inside) > i)
        self.assertGreater(replay_like_memory_viz(self, snap, device), 0)
        for p, n in live.items():
            lib.glake_free(p, n, device, None)

    def test_history_is_a_bounded_ring_and_stops(self):
        lib, device = self.lib, 12
        glake_torch.record_memory_history(max_entries=5)
        for i in range(10):
            p = lib.glake_malloc(MiB + i, device, None)
            lib.glake_free(p, MiB + i, device, None)
        trace = glake_torch.snapshot()["device_traces"][device]
        self.assertEqual([e["action"] for e in trace],
                         ["free_requested", "free_completed", "alloc", "free_requested", "free_completed"])
        self.assertEqual(trace[2]["size"], MiB + 9)
        glake_torch.record_memory_history(enabled=None)
        lib.glake_free(lib.glake_malloc(MiB, device, None), MiB, device, None)
        self.assertEqual(len(glake_torch.snapshot()["device_traces"][device]), 5)
        with self.assertRaises(ValueError):
            glake_torch.record_memory_history(max_entries=0)

    def test_a_stitched_allocation_is_a_segment_of_its_own(self):
        self.one_segment_per_request()
        lib, device = self.lib, 13
        glake_torch.record_memory_history()
        blocks = [lib.glake_malloc(100 * MiB, device, None) for _ in range(4)]
        for p in blocks[0::2]:
            lib.glake_free(p, 100 * MiB, device, None)
        stitched = lib.glake_malloc(200 * MiB, device, None)
        stats = glake_torch.stats(device)
        self.assertEqual(stats["stitches"], 1)
        snap = glake_torch.snapshot()
        segments = self.segments_of(snap, device)
        mine = [s for s in segments if s["segment_type"] == "stitched"]
        self.assertEqual(len(mine), 1)
        seg = mine[0]
        self.assertEqual(seg["address"], stitched)
        self.assertEqual(seg["total_size"], 200 * MiB)
        self.assertEqual(seg["blocks"][0]["state"], "active_allocated")
        self.assertEqual(seg["blocks"][0]["requested_size"], 200 * MiB)
        self.assertEqual(sum(p["size"] for p in seg["pieces"]), 200 * MiB)
        homes = [b for s in segments if s["segment_type"] == "large" for b in s["blocks"] if "stitched_into" in b]
        self.assertEqual({b["stitched_into"] for b in homes}, {stitched})
        self.assertEqual(sum(b["size"] for b in homes), 200 * MiB)
        self.assertTrue(all(b["state"] == "inactive" for b in homes))
        # Each allocated byte once: the live blocks' requests are the allocator's active bytes.
        self.assertEqual(sum(s["requested_size"] for s in segments), stats["active_bytes"])
        self.assertEqual(sum(s["total_size"] for s in segments if s["segment_type"] == "large"), stats["reserved_bytes"])
        ranges = [r for r in snap["stitched_ranges"] if r["device"] == device]
        self.assertEqual([(r["address"], r["live"]) for r in ranges], [(stitched, True)])
        trace = snap["device_traces"][device]
        self.assertEqual([e["action"] for e in trace if e["addr"] == stitched], ["segment_map", "alloc"])
        self.assertGreater(replay_like_memory_viz(self, snap, device), 0)

        lib.glake_free(stitched, 200 * MiB, device, None)
        snap = glake_torch.snapshot()
        self.assertFalse([s for s in self.segments_of(snap, device) if s["segment_type"] == "stitched"])
        self.assertEqual([e["action"] for e in snap["device_traces"][device] if e["addr"] == stitched],
                         ["segment_map", "alloc", "free_requested", "free_completed", "segment_unmap"])
        self.assertEqual([r["live"] for r in snap["stitched_ranges"] if r["device"] == device], [False])  # cached
        self.assertGreater(replay_like_memory_viz(self, snap, device), 0)
        for p in blocks[1::2]:
            lib.glake_free(p, 100 * MiB, device, None)

    def test_dump_snapshot_pickles_what_pytorchs_viewers_read(self):
        lib, device = self.lib, 14
        glake_torch.record_memory_history()
        live = [(lib.glake_malloc(n, device, None), n) for n in (3 * MiB, 700, 40 * MiB, 200 * MiB)]
        lib.glake_free(live[0][0], live[0][1], device, None)
        with captured_stderr():
            self.assertIsNone(lib.glake_malloc(1 << 50, device, None))  # an oom entry
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "snapshot.pickle")
            written = glake_torch.dump_snapshot(path)
            with open(path, "rb") as f:
                data = pickle.load(f)
            self.assertEqual(data, written)
            self.assertEqual(data["device_traces"][device][-1]["action"], "oom")
            self.assertEqual(data["device_traces"][device][-1]["size"], 1 << 50)
            viz = memory_viz()
            if viz is None:
                self.skipTest("torch does not import and GLAKE_MEMORY_VIZ is not set: PyTorch's _memory_viz not run")
            summary = viz.segsum(data)  # asserts its own accounting
            self.assertIn("total_reserved", summary)
            self.assertIn("Device %d" % device, viz.trace(data))
            for html in (viz.trace_plot(data), viz.trace_plot(data, plot_segments=True), viz.segment_plot(data)):
                self.assertIn("snapshot.pickle", html)
                self.assertGreater(len(html), 1000)
            for cmd in ("stats", "trace_plot", "segment_plot"):
                out = os.path.join(directory, cmd + ".out")
                run = subprocess.run([sys.executable, viz.__file__, cmd, path] + ([] if cmd == "stats" else ["-o", out]),
                                     capture_output=True, text=True)
                self.assertEqual(run.returncode, 0, run.stderr)
                self.assertTrue(cmd == "stats" or os.path.getsize(out) > 0)
        for p, n in live[1:]:
            lib.glake_free(p, n, device, None)


@needs_sim
class Trace(unittest.TestCase):
    def test_a_recorded_trace_reads_back_and_replays_to_the_plugins_peaks(self):
        with tempfile.TemporaryDirectory() as directory:
            pattern = os.path.join(directory, "run-%p.trace")
            env = dict(os.environ, GLAKE_TRACE=pattern)
            env.pop("GLAKE_ALLOC_CONF", None)
            run = subprocess.run([sys.executable, "-c", RECORD, SIM], env=env, capture_output=True, text=True, check=True)
            result = json.loads(run.stdout)
            files = sorted(os.listdir(directory))
            self.assertEqual(len(files), 2, files)  # one per device: run-<pid>.trace, run-<pid>.dev1.trace
            device0 = os.path.join(directory, min(files, key=len))
            self.assertTrue(max(files, key=len).endswith(".dev1.trace"))

            for device, name in ((0, device0), (1, os.path.join(directory, max(files, key=len)))):
                peaks = result["peaks"][str(device)]
                with open(name) as f:
                    lines = f.read().splitlines()
                self.assertTrue(lines[0].startswith("# glake trace of device %d" % device))
                self.assertTrue(all(len(line) < 255 for line in lines))
                events = [line.split(",") for line in lines if not line.startswith("#")]
                self.assertEqual(sum(1 for e in events if e[0] == "a"), peaks["allocations"])
                self.assertEqual({e[3] for e in events if e[0] == "a"}, {"0", "1", "2"})
                # S and U lines follow the plug-in's reserved bytes: their peak is its peak, and
                # after everything was freed and the cache emptied they sum to what it still holds.
                reserved = peak = 0
                for e in events:
                    if e[0] in "SU":
                        reserved += int(e[1]) if e[0] == "S" else -int(e[1])
                        peak = max(peak, reserved)
                self.assertEqual(peak, peaks["peak_reserved_bytes"])
                self.assertEqual(reserved, result["after"][str(device)]["reserved_bytes"])
                self.assertEqual(reserved, 0)

                if REPLAY:
                    replay = subprocess.run([REPLAY, "--json", "--quiet", "-a", "glake", name], capture_output=True, text=True, check=True)
                    replayed = json.loads(replay.stdout.splitlines()[0])
                    self.assertEqual(replayed["peak_active_bytes"], peaks["peak_active_bytes"])
                    self.assertEqual(replayed["peak_reserved_bytes"], peaks["peak_reserved_bytes"])
                    self.assertEqual(replayed["recorded_peak_reserved_bytes"], peaks["peak_reserved_bytes"])


if __name__ == "__main__":
    unittest.main()
