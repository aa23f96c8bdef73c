"""Tests for tools/analysis/profile_steps.py on hand-made Chrome traces (no torch needed).

Run: python3 -m unittest discover -s tools/tests -v
"""

import gzip
import io
import json
import os
import sys
import tempfile
import unittest

TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TOOLS, "analysis"))
import profile_steps  # noqa: E402


def x(cat, name, ts, dur, tid=1, pid=1):
    return dict(ph="X", cat=cat, name=name, pid=pid, tid=tid, ts=float(ts), dur=float(dur))


# main thread: a forward op holding a matmul; an autograd thread: one backward op. Kernels overlap.
EVENTS = [
    x("cpu_op", "forward", 0, 1000),
    x("cpu_op", "aten::mm", 100, 300),
    x("cuda_runtime", "cudaLaunchKernel", 150, 20),
    x("cpu_op", "aten::add", 500, 100),
    x("cuda_runtime", "cudaLaunchKernel", 520, 10),
    x("cpu_op", "backward", 1100, 400, tid=2),
    x("kernel", "gemm", 200, 400, pid=0, tid=7),
    x("kernel", "add", 500, 200, pid=0, tid=7),  # overlaps gemm by 100
    x("gpu_memcpy", "copy", 1800, 200, pid=0, tid=8),
    dict(ph="i", cat="marker", name="not a span", ts=5.0),
]


class ProfileSteps(unittest.TestCase):
    def write(self, directory, name, events):
        path = os.path.join(directory, name)
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": events}, f)
        return path

    def test_summary(self):
        s = profile_steps.summarize(EVENTS[:-1])
        self.assertAlmostEqual(s["span_ms"], 2.0)  # 0 .. 2000 us, the copy ends last
        self.assertAlmostEqual(s["gpu_busy_ms"], 0.7)  # 200..700 and 1800..2000
        self.assertAlmostEqual(s["gpu_idle_ms"], 1.3)
        self.assertEqual((s["kernels"], s["kernel_ms"]), (2, 0.6))
        self.assertEqual(s["threads"], {"1/1": (1.0, 1), "1/2": (0.4, 1)})
        self.assertEqual(s["api"], {"cudaLaunchKernel": (2, 0.03)})
        self.assertAlmostEqual(s["self_ms"]["forward"], 0.6)  # 1000 - 300 - 100
        self.assertAlmostEqual(s["self_ms"]["aten::mm"], 0.3)
        self.assertAlmostEqual(s["self_ms"]["backward"], 0.4)

    def test_union_of_nested_and_disjoint_intervals(self):
        self.assertEqual(profile_steps.union_length([(0, 10), (2, 5), (20, 30), (25, 40)]), 30)
        self.assertEqual(profile_steps.union_length([]), 0)

    def test_comparison_lists_the_largest_self_time_change_first(self):
        slower = [dict(e) for e in EVENTS]
        slower[3]["dur"] = 400.0  # aten::add: 100 -> 400 us; forward's self time unchanged
        slower[0]["dur"] = 1300.0
        with tempfile.TemporaryDirectory() as directory:
            a = self.write(directory, "a.json.gz", EVENTS)
            b = self.write(directory, "b.json.gz", slower)
            out = io.StringIO()
            summaries = profile_steps.report([a, b], out=out, top=2)
        self.assertEqual(len(summaries), 2)
        lines = out.getvalue().splitlines()
        first = lines.index(f"== self time, {b} minus {a} (ms)") + 1
        self.assertIn("aten::add", lines[first])
        self.assertIn("+0.30", lines[first])


if __name__ == "__main__":
    unittest.main()
