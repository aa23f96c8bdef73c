"""glake_torch.safetensors_layout on files written here (no torch or GPU needed): a good file's
entries, and every malformed header refused with a ValueError naming what is wrong; and the
simulated library's lack of glake_copy_from_file (loading itself needs CUDA:
bench/torch/load_checkpoint.py runs it on a GPU).

Run: ctest -R torch_plugin.python (with the other tests of this folder)."""

import json
import os
import struct
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import glake_torch  # noqa: E402

SIM = os.environ.get("GLAKE_TORCH_SIM_LIBRARY")


def write(path, header, data=b"", header_size=None, pad=0):
    raw = json.dumps(header).encode() + b" " * pad
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if header_size is None else header_size))
        f.write(raw)
        f.write(data)


class Layout(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.dir.name, "model.safetensors")

    def tearDown(self):
        self.dir.cleanup()

    def refused(self, header, data=b"", text="", **kw):
        write(self.path, header, data, **kw)
        with self.assertRaisesRegex(ValueError, text):
            glake_torch.safetensors_layout(self.path)

    def test_a_good_file(self):
        header = {
            "__metadata__": {"format": "pt"},
            "b": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [16, 28]},
            "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            "s": {"dtype": "I64", "shape": [], "data_offsets": [32, 40]},
            "e": {"dtype": "F16", "shape": [0, 5], "data_offsets": [28, 28]},
        }
        write(self.path, header, bytes(40), pad=3)  # headers may be padded with spaces
        start, size, entries, metadata = glake_torch.safetensors_layout(self.path)
        self.assertEqual(start, 8 + len(json.dumps(header)) + 3)
        self.assertEqual(size, 40)
        self.assertEqual(metadata, {"format": "pt"})
        self.assertEqual([e.name for e in entries], ["a", "b", "e", "s"])  # in file order
        self.assertEqual((entries[1].dtype, entries[1].shape, entries[1].begin, entries[1].end), ("BF16", (2, 3), 16, 28))
        self.assertEqual(entries[3].shape, ())

    def test_malformed_headers_are_refused(self):
        ok = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
        self.refused({"t": ok}, bytes(8), "does not fit", header_size=10_000)
        self.refused({"t": ok}, bytes(8), "at most", header_size=200_000_000)
        self.refused({"t": dict(ok, dtype="F12")}, bytes(8), "dtype 'F12'")
        self.refused({"t": dict(ok, shape=[2, -1])}, bytes(8), "shape")
        self.refused({"t": dict(ok, shape=[True])}, bytes(8), "shape")
        self.refused({"t": dict(ok, data_offsets=[0])}, bytes(8), "data_offsets")
        self.refused({"t": dict(ok, data_offsets=[0, 16])}, bytes(8), "outside the data section")
        self.refused({"t": dict(ok, data_offsets=[8, 4])}, bytes(8), "outside the data section")
        self.refused({"t": dict(ok, shape=[3])}, bytes(12), "needs 12 bytes, data_offsets give 8")
        self.refused({"t": 5}, bytes(8), "not an object")
        self.refused([1, 2], b"", "not a JSON object")
        with open(self.path, "wb") as f:
            f.write(b"\x01\x02")
        with self.assertRaisesRegex(ValueError, "shorter than"):
            glake_torch.safetensors_layout(self.path)
        with open(self.path, "wb") as f:
            f.write(struct.pack("<Q", 4) + b"{\xff}x")
        with self.assertRaisesRegex(ValueError, "not JSON"):
            glake_torch.safetensors_layout(self.path)


@unittest.skipUnless(SIM and os.path.isfile(SIM), "GLAKE_TORCH_SIM_LIBRARY is not set (run through ctest)")
class LoadOverTheSimulatedLibrary(unittest.TestCase):
    def setUp(self):
        glake_torch.load(SIM)

    def test_the_simulated_library_cannot_load(self):
        with self.assertRaisesRegex(RuntimeError, "no glake_copy_from_file"):
            glake_torch.load_safetensors(os.devnull)


if __name__ == "__main__":
    unittest.main()
