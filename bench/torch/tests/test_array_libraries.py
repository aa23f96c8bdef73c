"""bench/torch/array_libraries.py without a GPU: the driver, its children and the report over the
stand-in CuPy and RMM in tests/fake_arrays (arrays that take their bytes from the installed
allocator, with no data) and, for glake's runs, the simulated plug-in ($GLAKE_TORCH_SIM_LIBRARY).

Run: ctest -R bench.torch_finetune (with the other bench tests), or
     GLAKE_TORCH_SIM_LIBRARY=build/debug/integrations/torch/libglake_torch_sim.so \\
         python3 -m unittest discover -s bench/torch/tests -p test_array_libraries.py
"""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(os.path.dirname(HERE), "array_libraries.py")
FAKES = os.path.join(HERE, "fake_arrays")
SIM = os.environ.get("GLAKE_TORCH_SIM_LIBRARY")


def run(*args, **env):
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([sys.executable, SCRIPT, "--out", out, *args], capture_output=True, text=True,
                              env=dict(os.environ, **env))
        report = None
        if os.path.isfile(os.path.join(out, "array_libraries.json")):
            with open(os.path.join(out, "array_libraries.json")) as f:
                report = json.load(f)
            with open(os.path.join(out, "array_libraries.md")) as f:
                report["markdown"] = f.read()
        return done, report


@unittest.skipUnless(SIM and os.path.isfile(SIM), "GLAKE_TORCH_SIM_LIBRARY is not set (run through ctest)")
class ArrayLibrariesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.done, cls.report = run("--libraries", "cupy,rmm", "--steps", "8", PYTHONPATH=FAKES,
                                   GLAKE_TORCH_LIBRARY=SIM)
        cls.runs = {(r["library"], r["allocator"]): r for r in (cls.report or {}).get("runs", [])}

    def test_every_run_succeeds_and_the_report_is_written(self):
        self.assertEqual(self.done.returncode, 0, self.done.stderr[-3000:])
        self.assertEqual(set(self.runs), {("cupy", "own"), ("cupy", "glake"), ("rmm", "own"), ("rmm", "glake")})
        self.assertTrue(all(r["ok"] for r in self.runs.values()), self.runs)
        self.assertEqual(self.report["problems"], [])
        # Two rounds (the default), the order alternating: own first, then glake first.
        self.assertEqual([(r["library"], r["allocator"], r["round"]) for r in self.report["runs"]],
                         [(lib, alloc, r) for lib in ("cupy", "rmm")
                          for r, order in ((0, ("own", "glake")), (1, ("glake", "own"))) for alloc in order])
        self.assertIn("| cupy | matmul + FFT loop | 0 | glake |", self.report["markdown"])
        self.assertIn("| cupy | matmul + FFT loop | 1 | glake |", self.report["markdown"])

    def test_glake_served_every_request_and_got_every_block_back(self):
        for library in ("cupy", "rmm"):
            glake = self.runs[(library, "glake")]["glake"]
            self.assertGreater(glake["allocations"], 8)
            self.assertEqual((glake["active_bytes"], glake["failed_allocations"], glake["errors"]), (0, 0, 0))
            self.assertGreaterEqual(glake["peak_reserved_bytes"], glake["peak_active_bytes"])

    def test_both_runs_of_a_library_make_the_same_requests(self):
        for library in ("cupy", "rmm"):
            own, glake = self.runs[(library, "own")], self.runs[(library, "glake")]
            self.assertEqual(own["checksum"], glake["checksum"])
            self.assertEqual(own["in_use_peak_bytes"], glake["in_use_peak_bytes"])
        # RMM's statistics adaptor counts every request exactly: its peak is glake's own.
        self.assertEqual(self.runs[("rmm", "glake")]["in_use_peak_bytes"],
                         self.runs[("rmm", "glake")]["glake"]["peak_active_bytes"])


class DriverTest(unittest.TestCase):
    def test_checksums_that_differ_are_a_problem(self):
        sys.path.insert(0, os.path.dirname(HERE))
        import array_libraries

        runs = [{"library": "cupy", "allocator": "own", "ok": True, "checksum": 1.0},
                {"library": "cupy", "allocator": "glake", "ok": True, "checksum": 2.0},
                {"library": "rmm", "allocator": "own", "ok": False, "skipped": "not importable"},
                {"library": "numba", "allocator": "glake", "ok": False, "error": "exit 1: boom"}]
        problems = array_libraries.compare(runs)
        self.assertEqual(len(problems), 2)
        self.assertIn("checksums differ", " ".join(problems))
        self.assertIn("boom", " ".join(problems))

    @unittest.skipUnless(importlib.util.find_spec("numba") is None, "numba is installed here")
    def test_a_library_that_does_not_import_is_skipped_not_failed(self):
        done, report = run("--libraries", "numba", "--steps", "1")
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertTrue(all(r.get("skipped") for r in report["runs"]))
        self.assertIn("not importable", report["markdown"])

    def test_an_unknown_library_is_refused(self):
        done, _ = run("--libraries", "cupy,jax")
        self.assertEqual(done.returncode, 2)
        self.assertIn("unknown libraries ['jax']", done.stderr)


if __name__ == "__main__":
    unittest.main()
