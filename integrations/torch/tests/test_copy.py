"""glake_torch.copy_ without torch or a GPU: its checks on fake tensors, and the simulated
library's lack of glake_copy (the copy itself needs CUDA; the plug-in's GPU tests run it).

Run: ctest -R torch_plugin.python (with the other tests of this folder)."""

import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import glake_torch  # noqa: E402

SIM = os.environ.get("GLAKE_TORCH_SIM_LIBRARY")


class FakeTensor:
    def __init__(self, cuda, dtype="float32", numel=16, contiguous=True):
        self.is_cuda = cuda
        self.dtype = dtype
        self._numel = numel
        self._contiguous = contiguous

    def numel(self):
        return self._numel

    def is_contiguous(self):
        return self._contiguous

    def element_size(self):
        return 4

    def data_ptr(self):
        return 4096


@unittest.skipUnless(SIM and os.path.isfile(SIM), "GLAKE_TORCH_SIM_LIBRARY is not set (run through ctest)")
class CopyOverTheSimulatedLibrary(unittest.TestCase):
    def setUp(self):
        glake_torch.load(SIM)

    def test_the_simulated_library_has_no_copy(self):
        with self.assertRaisesRegex(RuntimeError, "simulated library has no glake_copy"):
            glake_torch.copy_(FakeTensor(cuda=True), FakeTensor(cuda=False))


class CopyChecks(unittest.TestCase):
    """The tensor checks come after the library lookup: a library with a glake_copy that must
    never be called stands in."""

    def setUp(self):
        self.calls = []
        calls = self.calls

        class Function:
            argtypes = None
            restype = None

            def __call__(self, *args):
                calls.append(args)
                return 0

        class Library:
            glake_copy = Function()

        self.saved = glake_torch._lib
        glake_torch._lib = Library()

    def tearDown(self):
        glake_torch._lib = self.saved

    def test_refuses_tensors_it_cannot_copy(self):
        with self.assertRaisesRegex(ValueError, "dtype and number of elements"):
            glake_torch.copy_(FakeTensor(cuda=True, numel=8), FakeTensor(cuda=False, numel=16))
        with self.assertRaisesRegex(ValueError, "dtype and number of elements"):
            glake_torch.copy_(FakeTensor(cuda=True, dtype="float16"), FakeTensor(cuda=False))
        with self.assertRaisesRegex(ValueError, "contiguous"):
            glake_torch.copy_(FakeTensor(cuda=True), FakeTensor(cuda=False, contiguous=False))
        with self.assertRaisesRegex(ValueError, "between a CUDA tensor and a CPU tensor"):
            glake_torch.copy_(FakeTensor(cuda=False), FakeTensor(cuda=False))
        self.assertEqual(self.calls, [])


if __name__ == "__main__":
    unittest.main()
