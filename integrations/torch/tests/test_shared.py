"""Shared weights through the plug-in's C interface and glake_torch's SharedMemory, without torch
or a GPU: libglake_torch_sim.so ($GLAKE_TORCH_SIM_LIBRARY), whose shared regions are host memory,
published to a real broker (glake-dedup, $GLAKE_DEDUP) by this process and by another one.

Run: ctest -R torch_plugin.python (with the other Python tests)."""

import ctypes
import os
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import glake_torch  # noqa: E402

SIM = os.environ.get("GLAKE_TORCH_SIM_LIBRARY")
DEDUP = os.environ.get("GLAKE_DEDUP")
MiB = 1 << 20

# A second process publishing the same bytes: prints its totals and whether its bytes survived.
PEER = r"""
import ctypes, json, sys
sys.path.insert(0, sys.argv[1])
import glake_torch
glake_torch.load(sys.argv[2])
memory = glake_torch.SharedMemory(int(sys.argv[4]), device=0)
piece = 2 << 20
pattern = b"".join(bytes([k]) * 256 + bytes(range(256)) * (piece // 256 - 1) for k in range(memory.nbytes // piece))
ctypes.memmove(memory.ptr, pattern, memory.nbytes)
totals = memory.share(sys.argv[3])
totals["intact"] = ctypes.string_at(memory.ptr, memory.nbytes) == pattern
print(json.dumps(totals))
"""


def pattern(n):
    """n bytes in 2 MiB pieces that all differ (their first 256 bytes say which piece)."""
    piece = 2 * MiB
    return b"".join(bytes([k]) * 256 + bytes(range(256)) * (piece // 256 - 1) for k in range(n // piece))


@unittest.skipUnless(SIM and os.path.isfile(SIM) and DEDUP and os.path.isfile(DEDUP),
                     "GLAKE_TORCH_SIM_LIBRARY or GLAKE_DEDUP is not set (run through ctest)")
class SharedWeightsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.lib = glake_torch.load(SIM)
        cls.dir = tempfile.TemporaryDirectory(prefix="glake-shared-")
        cls.socket = os.path.join(cls.dir.name, "broker.sock")
        cls.broker = subprocess.Popen([DEDUP, "--socket", cls.socket, "--quiet"])
        deadline = time.monotonic() + 30
        while not os.path.exists(cls.socket):
            if time.monotonic() > deadline or cls.broker.poll() is not None:
                raise RuntimeError("glake-dedup did not start")
            time.sleep(0.01)

    @classmethod
    def tearDownClass(cls):
        cls.broker.terminate()
        cls.broker.wait(30)
        cls.dir.cleanup()

    def peer(self, nbytes):
        out = subprocess.run([sys.executable, "-c", PEER, os.path.dirname(HERE), SIM, self.socket, str(nbytes)],
                             capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        import json
        return json.loads(out.stdout)

    def test_a_second_process_maps_the_first_ones_copy(self):
        memory = glake_torch.SharedMemory(5 * MiB, device=0)
        self.assertEqual(memory.nbytes, 6 * MiB)  # 2 MiB pieces
        self.assertEqual(memory.__cuda_array_interface__["data"], (memory.ptr, False))
        data = pattern(memory.nbytes)
        ctypes.memmove(memory.ptr, data, memory.nbytes)
        first = memory.share(self.socket)
        self.assertEqual(first, {"pieces": 3, "shared": 0, "stored": 3, "kept_private": 0, "shared_bytes": 0})
        self.assertEqual(ctypes.string_at(memory.ptr, memory.nbytes), data)  # same address, same bytes

        second = self.peer(5 * MiB)
        self.assertEqual(second, {"pieces": 3, "shared": 3, "stored": 0, "kept_private": 0,
                                  "shared_bytes": 6 * MiB, "intact": True})
        with self.assertRaisesRegex(ValueError, "published already"):
            memory.share(self.socket)
        del memory  # destroyed: its references go back to the broker

    def test_different_bytes_are_not_shared(self):
        memory = glake_torch.SharedMemory(2 * MiB, device=0)
        ctypes.memset(memory.ptr, 0x5A, memory.nbytes)
        totals = memory.share(self.socket)
        self.assertEqual(totals["shared"], 0)
        self.assertEqual(totals["stored"], 1)
        self.assertEqual(ctypes.string_at(memory.ptr, 16), b"\x5a" * 16)

    def test_without_a_broker_the_region_stays_private(self):
        memory = glake_torch.SharedMemory(4 * MiB, device=0)
        ctypes.memset(memory.ptr, 7, memory.nbytes)
        totals = memory.share(os.path.join(self.dir.name, "nobody.sock"))
        self.assertEqual(totals["kept_private"], 2)
        self.assertEqual(totals["shared"] + totals["stored"], 0)
        ctypes.memset(memory.ptr, 8, 16)  # still private and writable
        self.assertEqual(ctypes.string_at(memory.ptr, 16), b"\x08" * 16)

    def test_misuse_is_refused_and_changes_nothing(self):
        memory = glake_torch.SharedMemory(2 * MiB, device=0)
        values = (ctypes.c_uint64 * 5)()
        self.assertEqual(self.lib.glake_share(memory.ptr + 4096, self.socket.encode(), None, values, 5), -1)
        self.assertIn("starts no shared region", glake_torch._last_error(self.lib))
        self.assertEqual(self.lib.glake_share(memory.ptr, b"", None, values, 5), -1)
        self.assertEqual(self.lib.glake_shared_destroy(memory.ptr + 4096), -1)
        self.assertEqual(self.lib.glake_shared_create(0, 0), None)
        with self.assertRaises(ValueError):
            glake_torch.SharedMemory(0)
        ctypes.memset(memory.ptr, 1, 16)  # the region is untouched and still writable
        self.assertEqual(ctypes.string_at(memory.ptr, 16), b"\x01" * 16)

    def test_layout_is_aligned_and_deterministic(self):
        class T:
            def __init__(self, numel, size):
                self._n, self._s = numel, size

            def numel(self):
                return self._n

            def element_size(self):
                return self._s

        layout, total = glake_torch.shared_weights_layout([T(3, 4), T(100, 2), T(0, 4), T(1, 1)])
        self.assertEqual(layout, [(0, 12), (256, 200), (512, 0), (512, 1)])
        self.assertEqual(total, 768)


if __name__ == "__main__":
    unittest.main()
