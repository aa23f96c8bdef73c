"""glake as PyTorch's own CUDA allocator (the native allocator, native_allocator.cpp) on a real GPU:
torch.cuda's statistics, memory_summary, out of memory, CUDA graphs, torch.compile's
reduce-overhead mode (CUDA graph trees), MemPool, snapshots with Python stacks, record_stream and
empty_cache, all through torch's own functions.

The checks run in a child process of their own (enable() must come before CUDA is touched, and the
other test files load the simulated library): under unittest discovery one test starts

    python3 integrations/torch/tests/test_native.py --child [LIBRARY]

and is skipped when the child finds no torch, no GPU, or a plug-in built without the native
allocator (exit 77). GLAKE_TORCH_LIBRARY names the plug-in (else glake_torch finds it).
"""

import os
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_DIR = os.path.dirname(HERE)
SKIP = 77
MiB = 1 << 20

# PyTorch's DeviceStats, as torch.cuda.memory_stats() names them.
STAT_ARRAYS = (
    "allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
    "active_bytes", "inactive_split_bytes", "requested_bytes",
)
STAT_SCALARS = (
    "num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free", "max_split_size",
)


def expected_stat_keys():
    keys = set(STAT_SCALARS)
    for name in STAT_ARRAYS:
        for pool in ("all", "small_pool", "large_pool"):
            for kind in ("current", "peak", "allocated", "freed"):
                keys.add(f"{name}.{pool}.{kind}")
    for name in ("oversize_allocations", "oversize_segments"):
        for kind in ("current", "peak", "allocated", "freed"):
            keys.add(f"{name}.{kind}")
    return keys


class NativeChecks:
    """Run in the child, after glake_torch.enable() installed the native allocator (a
    unittest.TestCase there only, so that discovery in the parent does not collect it)."""

    def setUp(self):
        import torch

        self.torch = torch
        torch.cuda.synchronize()

    def test_backend_is_native(self):
        import glake_torch

        self.assertEqual(glake_torch.backend(), "native")
        self.assertEqual(self.torch.cuda.get_allocator_backend(), "glake")
        with self.assertWarns(UserWarning):
            self.assertEqual(glake_torch.use_in_torch_cuda(), [])

    def test_memory_stats_keys_complete(self):
        x = self.torch.empty(3 * MiB, dtype=self.torch.uint8, device="cuda")
        stats = self.torch.cuda.memory_stats()
        missing = expected_stat_keys() - set(stats)
        self.assertFalse(missing, f"memory_stats lacks {sorted(missing)}")
        self.assertGreaterEqual(stats["allocated_bytes.all.current"], 3 * MiB)
        self.assertEqual(
            stats["allocated_bytes.all.current"],
            stats["allocated_bytes.small_pool.current"] + stats["allocated_bytes.large_pool.current"],
        )
        del x

    def test_memory_summary_prints_glakes_numbers(self):
        import glake_torch

        torch = self.torch
        x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        glake = glake_torch.stats()
        self.assertEqual(torch.cuda.memory_reserved(), glake["reserved_bytes"])
        self.assertGreaterEqual(torch.cuda.memory_allocated(), 64 * MiB)
        self.assertLessEqual(torch.cuda.memory_allocated(), glake["allocated_bytes"])
        summary = torch.cuda.memory_summary()
        self.assertIn("Allocated memory", summary)
        self.assertIn("GPU reserved memory", summary)
        del x

    def test_reset_peak_memory_stats(self):
        torch = self.torch
        x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
        del x
        self.assertGreaterEqual(torch.cuda.max_memory_allocated(), 256 * MiB)
        torch.cuda.reset_peak_memory_stats()
        self.assertEqual(torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated())
        self.assertLessEqual(torch.cuda.max_memory_reserved(), max(torch.cuda.memory_reserved(), 1))
        y = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        self.assertGreaterEqual(torch.cuda.max_memory_allocated(), 8 * MiB)
        del y

    def test_out_of_memory_is_torch_error_and_leaves_things_usable(self):
        torch = self.torch
        before = torch.cuda.memory_stats()["num_ooms"]
        with self.assertRaises(torch.cuda.OutOfMemoryError) as caught:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        self.assertIn("out of memory", str(caught.exception))
        self.assertEqual(torch.cuda.memory_stats()["num_ooms"], before + 1)
        y = torch.ones(1024, device="cuda")
        self.assertEqual(float(y.sum()), 1024.0)

    def test_cuda_graph_capture_and_replay(self):
        torch = self.torch
        x = torch.zeros(1 << 20, device="cuda")
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x * 2 + 1  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(g):
            y = (x * 2 + 1).relu()
        for value in (1.0, 3.0):
            x.fill_(value)
            g.replay()
            torch.cuda.synchronize()
            self.assertTrue(torch.equal(y, torch.full_like(x, 2 * value + 1)))
        del g, y

    def test_compile_reduce_overhead_training_and_inference(self):
        torch = self.torch
        torch.manual_seed(0)

        def mlp():
            return torch.nn.Sequential(
                torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256), torch.nn.GELU(),
                torch.nn.Linear(256, 10),
            ).cuda()

        eager = mlp()
        compiled_model = mlp()
        compiled_model.load_state_dict(eager.state_dict())
        opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
        opt_c = torch.optim.SGD(compiled_model.parameters(), lr=0.05)

        def step(forward, opt, x, target):
            loss = torch.nn.functional.cross_entropy(forward(x), target)
            loss.backward()  # the backward graph is a CUDA graph of the tree as well
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach().clone()

        # CUDA graph trees: forward and backward recorded once warm, then replayed.
        forward = torch.compile(compiled_model, mode="reduce-overhead")
        for i in range(8):
            x = torch.randn(64, 256, device="cuda")
            target = torch.randint(0, 10, (64,), device="cuda")
            loss_e = step(eager, opt_e, x, target)
            loss_c = step(forward, opt_c, x, target)
            torch.testing.assert_close(loss_c, loss_e, rtol=1e-4, atol=1e-4, msg=f"training loss of step {i}")
        for pe, pc in zip(eager.parameters(), compiled_model.parameters()):
            torch.testing.assert_close(pc, pe, rtol=1e-4, atol=1e-4)

        @torch.compile(mode="reduce-overhead")
        def infer(x):
            return compiled_model(x)

        with torch.no_grad():
            for _ in range(4):
                x = torch.randn(32, 256, device="cuda")
                torch.testing.assert_close(infer(x).clone(), eager(x), rtol=1e-4, atol=1e-4)
            # A second shape records another graph into the same tree after replays.
            for _ in range(3):
                x = torch.randn(16, 256, device="cuda")
                torch.testing.assert_close(infer(x).clone(), eager(x), rtol=1e-4, atol=1e-4)

    def test_mem_pool(self):
        torch = self.torch
        pool = torch.cuda.MemPool()
        self.assertEqual(pool.use_count(), 1)
        with torch.cuda.use_mem_pool(pool):
            self.assertEqual(pool.use_count(), 2)
            x = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        self.assertEqual(pool.use_count(), 1)
        outside = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        segments = pool.snapshot()
        self.assertTrue(segments, "the pool's snapshot shows no segment")
        self.assertTrue(all(tuple(s["segment_pool_id"]) == tuple(pool.id) for s in segments))
        addresses = [(s["address"], s["address"] + s["total_size"]) for s in segments]
        self.assertTrue(any(lo <= x.data_ptr() < hi for lo, hi in addresses))
        self.assertFalse(any(lo <= outside.data_ptr() < hi for lo, hi in addresses))
        del x, outside, pool

    def test_memory_history_snapshot_has_python_frames(self):
        torch = self.torch
        torch.cuda.memory._record_memory_history(max_entries=1000)
        try:
            x = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
            snap = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        here = os.path.basename(__file__)
        blocks = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
        self.assertTrue(
            any(any(f["filename"].endswith(here) for f in b["frames"]) for b in blocks),
            "no live block has a frame of this file",
        )
        allocs = [e for e in snap["device_traces"][torch.cuda.current_device()] if e["action"] == "alloc"]
        self.assertTrue(any(e["addr"] == x.data_ptr() and e["frames"] for e in allocs))
        # Each byte once: the segments add up to what torch.cuda reports reserved.
        self.assertEqual(sum(s["total_size"] for s in snap["segments"]), torch.cuda.memory_reserved())
        del x

    def test_record_stream(self):
        torch = self.torch
        side = torch.cuda.Stream()
        x = torch.ones(16 * MiB // 4, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(10_000_000)
            y = x * 3
        before = torch.cuda.memory_allocated()
        x.record_stream(side)
        del x
        self.assertEqual(torch.cuda.memory_allocated(), before - 16 * MiB)
        z = torch.zeros(16 * MiB // 4, device="cuda")  # must not reuse x's memory before side is done
        torch.cuda.synchronize()
        self.assertEqual(float(y[0]), 3.0)
        self.assertEqual(float(y.sum()), 3.0 * y.numel())
        del y, z

    def test_empty_cache_returns_memory(self):
        torch = self.torch
        torch.cuda.empty_cache()  # so that x needs memory of its own
        x = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
        del x
        torch.cuda.synchronize()
        held = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        self.assertLessEqual(torch.cuda.memory_reserved(), held - 512 * MiB)

    def test_memory_fraction(self):
        torch = self.torch
        torch.cuda.set_per_process_memory_fraction(0.25)
        try:
            total = torch.cuda.get_device_properties(0).total_memory
            with self.assertRaises(torch.cuda.OutOfMemoryError):
                torch.empty(total // 2, dtype=torch.uint8, device="cuda")
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)

    def test_ipc_refused_clearly(self):
        torch = self.torch
        x = torch.ones(1024, device="cuda")
        with self.assertRaisesRegex(RuntimeError, "glake"):
            x.untyped_storage()._share_cuda_()


def child(library):
    """Runs NativeChecks after enable(); exit 77 where they cannot run."""
    try:
        import torch
    except ImportError:
        print("test_native: no torch; skipped")
        return SKIP
    if not torch.cuda.is_available():
        print("test_native: no GPU; skipped")
        return SKIP
    sys.path.insert(0, PACKAGE_DIR)
    import glake_torch

    if not glake_torch.native_available(library):
        print(f"test_native: {glake_torch.library_path(library)} was built without the native allocator; skipped")
        return SKIP
    glake_torch.enable(library=library)
    checks = type("NativeChecks", (NativeChecks, unittest.TestCase), {})
    suite = unittest.defaultTestLoader.loadTestsFromTestCase(checks)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    return 0 if result.wasSuccessful() else 1


class NativeAllocator(unittest.TestCase):
    def test_native_checks_in_a_process_of_their_own(self):
        library = os.environ.get("GLAKE_TORCH_LIBRARY")
        command = [sys.executable, os.path.abspath(__file__), "--child"] + ([library] if library else [])
        env = dict(os.environ)
        env.pop("GLAKE_TORCH_SIM_LIBRARY", None)
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
        output = done.stdout + done.stderr
        if done.returncode == SKIP:
            self.skipTest(output.strip().splitlines()[-1] if output.strip() else "skipped")
        self.assertEqual(done.returncode, 0, output)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2] if len(sys.argv) > 2 else None))
    unittest.main()
