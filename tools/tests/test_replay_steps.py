"""Tests for tools/analysis/replay_steps.py on hand-made traces and a stand-in replay binary."""
import io
import json
import os
import stat
import sys
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout

TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TOOLS, "analysis"))
import replay_steps  # noqa: E402

# Two steps of 3 and 5 tokens: token ids of 64 x 3 = 192 and 64 x 5 = 320 bytes. Step 1 starts at
# line 2, step 2 at the first 320-byte request after that, line 3; lines 0-1 are set-up.
TRACE = [
    "# set-up\n",
    "a,0,4096,0\n",
    "a,1,192,0\n",
    "a,2,320,0\n",
    "f,1\n",
    "f,2\n",
    "a,3,320,0\n",
    "f,3\n",
]

# A stand-in for glake-replay (called as BINARY --quiet --json -a NAME PATH [--glake-conf TEXT]):
# driver calls = lines of the prefix, 2 us each; a stitch per allocation; "grows" = the settings' length.
FAKE_REPLAY = """#!{python}
import json, sys
lines = open(sys.argv[5]).readlines()
conf = sys.argv[7] if len(sys.argv) > 7 else ""
allocs = sum(1 for l in lines if l.startswith("a,"))
print(json.dumps(dict(driver_calls=dict(map=len(lines), unmap=0), modeled_driver_us=2.0 * len(lines),
                      stitches=allocs, stitch_repairs=0, stitch_grows=len(conf), utilization=0.99,
                      peak_reserved_bytes=2**30)))
"""


class StepStarts(unittest.TestCase):
    def test_exact_sizes_in_order(self):
        self.assertEqual(replay_steps.step_starts(TRACE, [3, 5]), [2, 3])

    def test_sizes_rounded_to_512_when_exact_ones_are_missing(self):
        rounded = ["a,0,512,0\n", "a,1,100,0\n", "a,2,512,0\n"]  # 192 and 320 both round to 512
        self.assertEqual(replay_steps.step_starts(rounded, [3, 5]), [0, 2])

    def test_none_when_a_step_has_no_token_ids(self):
        self.assertIsNone(replay_steps.step_starts(TRACE, [3, 7]))
        self.assertIsNone(replay_steps.step_starts(["f,1\n"], [3]))


class NewMemorySteps(unittest.TestCase):
    def test_steps_longer_than_the_first(self):
        self.assertEqual(replay_steps.new_memory_steps(replay_steps.sequence_lengths(14)), [6, 7])
        self.assertEqual(replay_steps.new_memory_steps([5, 3, 9, 4, 6]), [3, 5])
        self.assertEqual(replay_steps.new_memory_steps([5, 3]), [])


class PerStep(unittest.TestCase):
    def test_differences_of_consecutive_prefixes(self):
        def result(calls, us, stitches):
            return dict(driver_calls=dict(map=calls, set_access=1), modeled_driver_us=us, stitches=stitches,
                        stitch_repairs=0, stitch_grows=0)
        steps = replay_steps.per_step([result(10, 100.0, 1), result(15, 600.0, 3), result(15, 600.0, 3)])
        self.assertEqual([s["calls"] for s in steps], [5, 0])
        self.assertEqual([s["ms"] for s in steps], [0.5, 0.0])
        self.assertEqual([s["stitches"] for s in steps], [2, 0])


class WithReplay(unittest.TestCase):
    def setUp(self):
        self.directory = tempfile.TemporaryDirectory()
        self.binary = os.path.join(self.directory.name, "fake-replay")
        with open(self.binary, "w") as f:
            f.write(FAKE_REPLAY.format(python=sys.executable))
        os.chmod(self.binary, os.stat(self.binary).st_mode | stat.S_IEXEC)
        self.trace = os.path.join(self.directory.name, "t.trace")
        with open(self.trace, "w") as f:
            f.writelines(TRACE)

    def tearDown(self):
        self.directory.cleanup()

    def test_a_step_is_the_lines_from_its_start_to_the_next(self):
        steps, whole = replay_steps.trace_steps(self.binary, self.trace, [3, 5])
        # Set-up is lines 0-1; step 1 is line 2; step 2 is lines 3-7.
        self.assertEqual([s["calls"] for s in steps], [1, 5])
        self.assertEqual([s["ms"] for s in steps], [0.002, 0.010])
        self.assertEqual([s["stitches"] for s in steps], [1, 2])
        self.assertEqual(whole["driver_calls"]["map"], len(TRACE))

    def test_settings_reach_every_prefix(self):
        steps, whole = replay_steps.trace_steps(self.binary, self.trace, [3, 5], conf="max_handle:16MiB")
        self.assertEqual(whole["stitch_grows"], len("max_handle:16MiB"))
        self.assertEqual([s["grows"] for s in steps], [0, 0])  # the same in every prefix: no difference

    def test_main_cuts_at_the_seeds_lengths(self):
        first, second = replay_steps.sequence_lengths(2)
        with open(self.trace, "w") as f:
            f.writelines(["a,0,4096,0\n", f"a,1,{64 * first},0\n", "f,1\n", f"a,2,{64 * second},0\n", "f,2\n"])
        out = io.StringIO()
        with redirect_stdout(out):
            status = replay_steps.main([self.binary, self.trace, "--steps", "2"])
        self.assertEqual(status, 0)
        self.assertIn("calls/ms per step: 2/0.0 2/0.0", out.getvalue())

    def test_main_reports_traces_it_cannot_cut(self):
        out = io.StringIO()
        with redirect_stdout(out):
            status = replay_steps.main([self.binary, self.trace, "--steps", "2"])  # the seed's lengths are not 3, 5
        self.assertEqual(status, 1)
        self.assertIn("no token-id request for every step", out.getvalue())
    def test_a_failing_replay_is_reported_not_raised(self):
        with open(self.binary, "w") as f:
            f.write(f"#!{sys.executable}\nimport sys\nprint('glake-replay: bad setting', file=sys.stderr)\nsys.exit(2)\n")
        with self.assertRaises(replay_steps.ReplayError) as caught:
            replay_steps.trace_steps(self.binary, self.trace, [3, 5], conf="nonsense")
        self.assertIn("bad setting", str(caught.exception))
        first, second = replay_steps.sequence_lengths(2)
        with open(self.trace, "w") as f:
            f.writelines([f"a,1,{64 * first},0\n", f"a,2,{64 * second},0\n"])
        err = io.StringIO()
        with redirect_stderr(err), redirect_stdout(io.StringIO()):
            status = replay_steps.main([self.binary, self.trace, "--steps", "2", "--glake-conf", "nonsense"])
        self.assertEqual(status, 2)
        self.assertIn("exited with 2: glake-replay: bad setting", err.getvalue())

if __name__ == "__main__":
    unittest.main()
