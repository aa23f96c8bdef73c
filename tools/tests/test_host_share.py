"""Tests for tools/analysis/host_share.py on hand-made runs (no torch needed)."""
import io
import json
import os
import sys
import tempfile
import unittest
from contextlib import redirect_stdout

TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TOOLS, "analysis"))
import host_share  # noqa: E402

# Steps 1-2 are left out; steps 3-6 take 0.2, 0.4, 0.3, 0.5 s with 2, 8, 3, 5 ms inside glake,
# and driver calls in step 4 only.
RUN = dict(model="opt1.3b", strategy="N", allocator="glake", status="ok", rank=0,
           step_times_s=[1.0, 0.5, 0.2, 0.4, 0.3, 0.5], step_allocator_host_ms=[90.0, 9.0, 2.0, 8.0, 3.0, 5.0],
           step_driver_calls=[900, 10, 0, 40, 0, 0], glake_stats=dict(allocations=3000, deallocations=3000))


class HostShare(unittest.TestCase):
    def test_figures_of_one_run(self):
        s = host_share.host_share(RUN)
        self.assertAlmostEqual(s["median_step_s"], 0.35)
        self.assertAlmostEqual(s["host_ms_median"], 4.0)
        self.assertEqual(s["host_ms_max"], 8.0)
        self.assertAlmostEqual(s["share"], (0.01 + 0.01) / 2)  # shares 0.010, 0.020, 0.010, 0.010
        self.assertAlmostEqual(s["quiet_share"], 0.01)  # steps 3, 5, 6
        self.assertAlmostEqual(s["quiet_ns_per_call"], 3e-3 * 1e9 / 1000)  # 3 ms over 6000 / 6 calls: 3000 ns
        without = (0.297 + 0.392) / 2  # steps less glake's time: 0.198, 0.392, 0.297, 0.495
        self.assertAlmostEqual(s["bound"], 0.35 / without - 1)

    def test_runs_without_host_time_are_skipped(self):
        self.assertIsNone(host_share.host_share(dict(RUN, step_allocator_host_ms=[])))
        no_quiet = host_share.host_share(dict(RUN, step_driver_calls=[1] * 6))
        self.assertIsNone(no_quiet["quiet_share"])
        self.assertIsNone(no_quiet["quiet_ns_per_call"])

    def test_table_has_a_row_per_finished_glake_run(self):
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "runs.jsonl")
            with open(path, "w") as f:
                for r in (RUN, dict(RUN, allocator="default"), dict(RUN, status="oom"), dict(RUN, model="llama1b")):
                    f.write(json.dumps(r) + "\n")
            out = io.StringIO()
            with redirect_stdout(out):
                host_share.main([path])
        rows = [line for line in out.getvalue().splitlines() if line.startswith("| ") and "workload" not in line]
        self.assertEqual([row.split(" | ")[0] for row in rows], ["| opt1.3b N", "| llama1b N"])
        self.assertTrue(rows[0].endswith(f"| 1.00% | 3000 | -{(0.35 / ((0.297 + 0.392) / 2) - 1) * 100:.1f}% |"))


if __name__ == "__main__":
    unittest.main()
