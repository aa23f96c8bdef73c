"""Tests for tools/analysis/driver_kinds.py on hand-made runs."""
import io
import json
import os
import sys
import tempfile
import unittest
from contextlib import redirect_stdout

TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TOOLS, "analysis"))
import driver_kinds  # noqa: E402

# Three steps; step 2 stitches 40 handles (set access 2 ms over them), step 3 makes no call.
RUN = dict(model="opt1.3b", strategy="N", allocator="glake", status="ok", fsdp=2, rank=0, utilization=0.98,
           peak_reserved_bytes=19_700_000_000, step_driver_calls=[100, 41, 0],
           step_allocator_ms=[20.0, 7.0, 1.0],
           step_driver_kind_calls={"map": [60, 40, 0], "set_access": [40, 1, 0]},
           step_driver_kind_ms={"map": [0.06, 0.04, 0.0], "set_access": [3.0, 2.0, 0.0]})
OTHER_RANK = dict(RUN, rank=1, utilization=0.97, step_driver_kind_ms={"map": [0.06, 0.04, 0.0], "set_access": [3.0, 4.0, 0.0]})


class DriverKinds(unittest.TestCase):
    def test_steps_with_calls_their_kinds_and_set_access_per_mapped_handle(self):
        rows = dict(driver_kinds.step_rows([RUN, OTHER_RANK]))
        self.assertEqual(sorted(rows), [1, 2])  # step 3 made no call
        self.assertEqual(rows[2]["set_access"], (1, 3.0))  # median of 2.0 and 4.0 ms
        self.assertEqual(rows[2]["allocator ms"], 7.0)
        self.assertEqual(rows[2]["driver calls"], 41)
        # 2 ms over 40 handles is 50 us, 4 ms 100 us; step 1 also maps more than 20 (50 us)
        self.assertEqual(rows[2]["set_access us per handle"], (75.0, 50.0, 100.0))
        self.assertEqual(rows[1]["set_access us per handle"], (50.0, 50.0, 50.0))

    def test_cost_per_call_over_all_steps_and_ranks_pooled(self):
        costs = driver_kinds.per_call([RUN, OTHER_RANK])
        self.assertAlmostEqual(costs["map"], 1.0)  # 0.2 ms over 200 calls
        self.assertAlmostEqual(costs["set_access"], 12000 / 82)
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "runs.jsonl")
            with open(path, "w") as f:
                for r in (RUN, OTHER_RANK, dict(RUN, allocator="default")):
                    f.write(json.dumps(r) + "\n")
            out = io.StringIO()
            with redirect_stdout(out):
                self.assertEqual(driver_kinds.main([path]), 0)
        text = out.getvalue()
        self.assertIn("## opt1.3b N FSDP: 2 glake runs", text)  # the default run is not glake's
        self.assertIn("utilization 0.9700-0.9800", text)
        self.assertIn("set_access per handle 75 us (50-100)", text)


if __name__ == "__main__":
    unittest.main()
