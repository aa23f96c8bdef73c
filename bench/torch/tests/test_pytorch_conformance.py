"""Tests for bench/torch/pytorch_conformance.py's selection rule, junit parsing and report,
without torch, pytest or a GPU.

Run: python3 -m unittest discover -s bench/torch/tests -v
"""

import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pytorch_conformance as pc  # noqa: E402

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="test.test_cuda.TestCuda" name="test_memory_stats" time="0.1"/>
<testcase classname="test.test_cuda.TestCuda" name="test_caching_pinned_memory" time="0.1">
  <failure message="AssertionError: 3 != 4&#10;second line">trace</failure></testcase>
<testcase classname="test.test_cuda.TestCuda" name="test_graph_pool" time="0.1">
  <skipped type="pytest.skip" message="requires two GPUs"/></testcase>
<testcase classname="test.test_cuda.TestCudaMallocAsync" name="test_snapshot" time="0.1">
  <error message="RuntimeError: pluggable | not supported">trace</error></testcase>
</testsuite></testsuites>
"""


class SelectionTest(unittest.TestCase):
    def test_rule(self):
        collected = pc.parse_collect(
            "test/test_cuda.py::TestCuda::test_memory_stats\n"
            "test/test_cuda.py::TestCuda::test_matmul_device_mismatch\n"
            "test/test_cuda.py::TestCudaMallocAsync::test_record_stream\n"
            "test/test_cuda.py::TestMemPool::test_mempool_context\n"
            "test/inductor/test_cudagraph_trees.py::CudaGraphTreeTests::test_run_simple\n"
            "\n3 tests collected in 1.0s\n")
        self.assertEqual(len(collected), 5)
        kept = pc.select(collected)
        self.assertNotIn("test/test_cuda.py::TestCuda::test_matmul_device_mismatch", kept)
        self.assertIn("test/inductor/test_cudagraph_trees.py::CudaGraphTreeTests::test_run_simple", kept)
        self.assertIn("test/test_cuda.py::TestMemPool::test_mempool_context", kept)
        self.assertEqual(len(kept), 4)

    def test_file_name_alone_does_not_select(self):
        # "cuda" or the path must not make every test match: only the class and name count.
        self.assertEqual(pc.select(["test/test_cuda.py::TestCuda::test_cublas_workspace"]), [])


class ExtractTest(unittest.TestCase):
    def test_follows_test_tree_imports_only(self):
        import subprocess
        git = tempfile.mkdtemp()
        def put(path, text):
            os.makedirs(os.path.dirname(os.path.join(git, path)), exist_ok=True)
            with open(os.path.join(git, path), "w") as f:
                f.write(text)
        put("test/test_cuda.py", "import torch\nfrom common_helpers import x\n")
        put("test/common_helpers.py", "from inductor.util import y\n")
        put("test/inductor/util.py", "import os\n")
        put("test/inductor/__init__.py", "")
        put("test/inductor/test_cudagraph_trees.py", "import torch\n")
        put("test/unrelated.py", "")
        run = lambda *a: subprocess.run(["git", "-C", git] + list(a), check=True, capture_output=True)
        run("init", "-q")
        run("add", ".")
        run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "t")
        run("tag", "v0")
        dest = tempfile.mkdtemp()
        got = pc.extract(os.path.join(git, ".git"), "v0", dest)
        self.assertEqual(got, ["test/common_helpers.py", "test/inductor/__init__.py",
                               "test/inductor/test_cudagraph_trees.py", "test/inductor/util.py",
                               "test/test_cuda.py"])
        self.assertTrue(open(os.path.join(dest, "SOURCE")).read().startswith("pytorch v0 ("))


class ReportTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.xml = os.path.join(self.dir, "r.xml")
        with open(self.xml, "w") as f:
            f.write(JUNIT)

    def test_parse_junit(self):
        r = pc.parse_junit(self.xml)
        self.assertEqual(r["test.test_cuda.TestCuda::test_memory_stats"], ("passed", ""))
        self.assertEqual(r["test.test_cuda.TestCuda::test_caching_pinned_memory"],
                         ("failed", "AssertionError: 3 != 4"))
        self.assertEqual(r["test.test_cuda.TestCuda::test_graph_pool"][0], "skipped")
        self.assertEqual(r["test.test_cuda.TestCudaMallocAsync::test_snapshot"][0], "error")
        self.assertEqual(pc.counts(r), {"passed": 1, "failed": 1, "error": 1, "skipped": 1})

    def test_regressions_exclude_native_failures(self):
        glake = pc.parse_junit(self.xml)
        native = dict(glake)
        native["test.test_cuda.TestCuda::test_caching_pinned_memory"] = ("passed", "")
        reg = pc.regressions(native, glake)
        self.assertEqual([t for t, _ in reg], ["test.test_cuda.TestCuda::test_caching_pinned_memory"])
        md = os.path.join(self.dir, "r.md")
        pc.write_markdown(md, {"selected": 5, "torch": "2.11.0"}, native, glake)
        text = open(md).read()
        self.assertIn("| glake | 1 | 1 | 1 | 1 | 1 |", text)
        self.assertIn("| native | 2 | 0 | 1 | 1 | 1 |", text)
        self.assertIn("Failing under glake, not natively (1)", text)
        self.assertIn("AssertionError: 3 != 4", text)


if __name__ == "__main__":
    unittest.main()
