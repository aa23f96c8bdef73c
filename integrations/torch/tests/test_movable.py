"""Movable buffers through the plug-in's C interface and glake_torch's functions, without torch or
a GPU: libglake_torch_sim.so ($GLAKE_TORCH_SIM_LIBRARY, set by CTest), whose movable buffers are
virtual_buffers over the simulated device and its host tier.

Run: ctest -R torch_plugin.python (with the other Python tests)."""

import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import glake_torch  # noqa: E402

SIM = os.environ.get("GLAKE_TORCH_SIM_LIBRARY")
MiB = 1 << 20


@unittest.skipUnless(SIM and os.path.isfile(SIM), "GLAKE_TORCH_SIM_LIBRARY is not set (run through ctest)")
class MovableTest(unittest.TestCase):
    def setUp(self):
        self.lib = glake_torch.load(SIM)
        self.before = glake_torch.movable_stats()

    def test_offload_and_prefetch_keep_the_address(self):
        memory = glake_torch.MovableMemory(3 * MiB, device=0)
        ptr = memory.ptr
        self.assertTrue(ptr)
        interface = memory.__cuda_array_interface__
        self.assertEqual(interface["data"], (ptr, False))
        self.assertEqual(interface["shape"], (3 * MiB,))
        self.assertEqual(glake_torch.residence(ptr), "device")
        self.assertEqual(glake_torch.residence(ptr + 3 * MiB - 1), "device")  # any address inside
        stats = glake_torch.movable_stats()
        self.assertEqual(stats["buffers"], self.before["buffers"] + 1)
        self.assertEqual(stats["device_bytes"], self.before["device_bytes"] + 4 * MiB)  # 2 MiB granules

        glake_torch.offload(ptr + 100)
        self.assertEqual(memory.ptr, ptr)
        self.assertEqual(glake_torch.residence(ptr), "host")
        stats = glake_torch.movable_stats()
        self.assertEqual(stats["device_bytes"], self.before["device_bytes"])
        self.assertEqual(stats["host_bytes"], self.before["host_bytes"] + 4 * MiB)
        with self.assertRaises(ValueError) as caught:
            glake_torch.offload(ptr)  # already on the host
        self.assertIn("not on device", str(caught.exception))

        glake_torch.prefetch(ptr)
        self.assertEqual(glake_torch.residence(ptr), "device")
        self.assertEqual(glake_torch.movable_stats()["prefetched_bytes"], self.before["prefetched_bytes"] + 4 * MiB)
        del memory
        self.assertEqual(glake_torch.movable_stats()["buffers"], self.before["buffers"])
        self.assertIsNone(glake_torch.residence(ptr))

    def test_lists_move_together(self):
        memories = [glake_torch.MovableMemory(2 * MiB, device=0) for _ in range(3)]
        pointers = [m.ptr for m in memories]
        glake_torch.offload(pointers)
        self.assertEqual([glake_torch.residence(p) for p in pointers], ["host"] * 3)
        glake_torch.prefetch(pointers)
        self.assertEqual([glake_torch.residence(p) for p in pointers], ["device"] * 3)
        # A failure stops the list there: the first moved, the second refused.
        glake_torch.offload(pointers[1])
        with self.assertRaises(ValueError):
            glake_torch.offload(pointers)
        self.assertEqual([glake_torch.residence(p) for p in pointers], ["host", "host", "device"])

    def test_a_movable_scope_serves_allocations_with_movable_buffers_and_caches_them(self):
        lib = self.lib
        with glake_torch.movable_allocations(min_bytes=4 * MiB):
            small = lib.glake_malloc(MiB, 0, None)  # under the threshold: an ordinary block
            big = lib.glake_malloc(6 * MiB, 0, None)
            with glake_torch.movable_allocations(min_bytes=64 * MiB):  # nests
                ordinary = lib.glake_malloc(6 * MiB, 0, None)
            again = lib.glake_malloc(6 * MiB, 0, None)
        outside = lib.glake_malloc(6 * MiB, 0, None)
        self.assertEqual(glake_torch.residence(big), "device")
        self.assertEqual(glake_torch.residence(again), "device")
        for p in (small, ordinary, outside):  # the allocator's own blocks: on the device
            self.assertEqual(glake_torch.residence(p), "device")
        glake_torch.offload(big)
        self.assertEqual(glake_torch.residence(big), "host")
        stats = glake_torch.movable_stats()
        self.assertEqual(stats["buffers"], self.before["buffers"] + 2)
        # Freed on the device: cached and served again for the same size and stream; freed
        # offloaded: destroyed.
        lib.glake_free(again, 6 * MiB, 0, None)
        self.assertEqual(glake_torch.movable_stats()["cached_buffer_bytes"], 6 * MiB)
        self.assertIsNone(glake_torch.residence(again))  # a cached buffer is no live allocation
        lib.glake_free(big, 6 * MiB, 0, None)
        self.assertEqual(glake_torch.movable_stats()["buffers"], self.before["buffers"] + 1)
        with glake_torch.movable_allocations(min_bytes=4 * MiB):
            reused = lib.glake_malloc(5 * MiB, 0, None)  # rounds to the same 6 MiB
        self.assertEqual(reused, again)
        self.assertEqual(glake_torch.movable_stats()["cache_reuses"], self.before["cache_reuses"] + 1)
        lib.glake_free(reused, 5 * MiB, 0, None)
        lib.glake_empty_cache(0)
        stats = glake_torch.movable_stats()
        self.assertEqual(stats["buffers"], self.before["buffers"])
        self.assertEqual(stats["cached_buffer_bytes"], 0)
        for p, n in ((small, MiB), (ordinary, 6 * MiB), (outside, 6 * MiB)):
            lib.glake_free(p, n, 0, None)
        with self.assertRaises(ValueError):
            glake_torch.movable_allocations(0)

    def test_the_allocators_own_blocks_move_too(self):
        lib = self.lib
        big = lib.glake_malloc(64 * MiB, 0, None)
        small = lib.glake_malloc(4096, 0, None)
        self.assertEqual(glake_torch.residence(big), "device")
        glake_torch.offload(big)
        self.assertEqual(glake_torch.residence(big), "host")
        with self.assertRaises(ValueError) as caught:
            glake_torch.offload(big)
        self.assertIn("offloaded already", str(caught.exception))
        with self.assertRaises(ValueError) as caught:
            glake_torch.offload(small)
        self.assertIn("small allocation", str(caught.exception))
        with self.assertRaises(ValueError):
            glake_torch.offload(big + 4096)  # inside, not the allocation's first address
        glake_torch.prefetch([big])
        self.assertEqual(glake_torch.residence(big), "device")
        glake_torch.offload(big)
        lib.glake_free(big, 64 * MiB, 0, None)  # freed while offloaded: an ordinary free
        self.assertIsNone(glake_torch.residence(big))
        lib.glake_free(small, 4096, 0, None)
        self.assertEqual(glake_torch.movable_stats()["buffers"], self.before["buffers"])

    def test_misuse_and_exhaustion_are_clear_errors(self):
        with self.assertRaises(ValueError) as caught:
            glake_torch.offload(0x1234000)
        self.assertIn("not a live allocation", str(caught.exception))
        self.assertIsNone(glake_torch.residence(0x1234000))
        self.assertEqual(self.lib.glake_movable_destroy(0x1234000), -1)
        with self.assertRaises(MemoryError):  # the simulated device has 80 GiB
            glake_torch.MovableMemory(100 << 30, device=0)
        with self.assertRaises(ValueError):
            glake_torch.MovableMemory(0)
        self.assertEqual(glake_torch.movable_stats()["buffers"], self.before["buffers"])


if __name__ == "__main__":
    unittest.main()
