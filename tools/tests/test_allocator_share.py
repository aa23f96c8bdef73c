"""Tests for tools/analysis/allocator_share.py on hand-made runs (no torch needed)."""
import io
import json
import os
import sys
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout

TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TOOLS, "analysis"))
import allocator_share  # noqa: E402

LENGTHS = [512, 100, 200, 900, 300, 600]
# Steps 1-2 are left out. Default: steps 3-6 take 0.2, 0.4, 0.3, 0.5 s, 1% of each in the
# allocator. glake: 1% too, except step 5, where it maps new memory: 10%.
DEFAULT = dict(model="opt1.3b", strategy="LR", allocator="default", status="ok", rank=0, seq_lengths=LENGTHS,
               step_times_s=[1.0, 0.5, 0.2, 0.4, 0.3, 0.5], step_allocator_ms=[50.0, 9.0, 2.0, 4.0, 3.0, 5.0],
               step_allocator_calls=[9000, 3000, 1000, 2000, 1000, 2500])
GLAKE = dict(DEFAULT, allocator="glake", step_times_s=[1.0, 0.5, 0.25, 0.4, 0.3, 0.5],
             step_allocator_ms=[90.0, 9.0, 2.5, 4.0, 30.0, 5.0])
# An untimed default run of the same lengths: another host realisation, where step 5 is the
# longest, so glake's slow step 5 does not move its median.
OTHER_HOST = dict(DEFAULT, step_times_s=[1.0, 0.5, 0.3, 0.35, 0.6, 0.5])
del OTHER_HOST["step_allocator_ms"], OTHER_HOST["step_allocator_calls"]


def write_runs(path, runs):
    """Writes `runs` to `path` as finetune.py does: one JSON object per line."""
    with open(path, "w") as f:
        for r in runs:
            f.write(json.dumps(r) + "\n")


class AllocatorShare(unittest.TestCase):
    def test_shares_and_cost_per_call_of_one_run(self):
        shares = allocator_share.step_shares(GLAKE)
        self.assertEqual(sorted(shares), [2, 3, 4, 5])  # steps 3..6
        self.assertAlmostEqual(shares[2][0], 0.01)
        self.assertAlmostEqual(shares[4][0], 0.1)
        self.assertAlmostEqual(shares[2][1], 2500.0)  # 2.5 ms over 1000 calls
        self.assertAlmostEqual(shares[4][1], 30000.0)

    def test_runs_are_pooled_by_step(self):
        second = dict(GLAKE, step_allocator_ms=[90.0, 9.0, 7.5, 4.0, 30.0, 5.0])  # step 3: 3% instead of 1%
        pooled = allocator_share.pooled([GLAKE, second])
        self.assertAlmostEqual(pooled[2][0], 0.02)
        self.assertAlmostEqual(pooled[2][1], (2500.0 + 7500.0) / 2)
        self.assertAlmostEqual(pooled[4][0], 0.1)

    def test_ratios_and_implied_median_ratio_per_host_realisation(self):
        c = allocator_share.compare([DEFAULT], [GLAKE], [DEFAULT, OTHER_HOST])
        self.assertAlmostEqual(c["default_share"], 0.01)
        self.assertAlmostEqual(c["glake_share"], 0.01)
        self.assertEqual((c["steps"], c["steps_over"]), (4, 1))
        self.assertAlmostEqual(c["ratio_median"], 1.0)
        self.assertAlmostEqual(c["ratio_max"], 0.99 / 0.9)
        r = 0.99 / 0.9
        # Timed default run: steps 0.2, 0.4, 0.3, 0.5 -> 0.2, 0.4, 0.3r, 0.5; medians 0.35 and (0.3r + 0.4) / 2.
        self.assertAlmostEqual(c["implied"][0], (0.3 * r + 0.4) / 2 / 0.35)
        # Other host: 0.3, 0.35, 0.6, 0.5 -> 0.3, 0.35, 0.6r, 0.5; both medians (0.35 + 0.5) / 2.
        self.assertAlmostEqual(c["implied"][1], 1.0)
        self.assertAlmostEqual(c["default_ns_per_call"], 2000.0)  # 2000, 2000, 3000, 2000
        self.assertAlmostEqual(c["glake_ns_per_call"], 2250.0)  # 2500, 2000, 30000, 2000

    def test_each_fsdp_rank_is_a_workload_of_its_own(self):
        fsdp = [dict(r, fsdp=True, rank=rank) for r in (DEFAULT, GLAKE) for rank in (0, 1)]
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "fsdp.jsonl")
            write_runs(path, fsdp + [OTHER_HOST])
            workloads, defaults = allocator_share.load([path])
        self.assertEqual(sorted(workloads), ["opt1.3b LR FSDP rank 0", "opt1.3b LR FSDP rank 1"])
        self.assertEqual(len(defaults["opt1.3b LR FSDP rank 1"]), 1)
        self.assertEqual(len(defaults["opt1.3b LR"]), 1)  # a single-GPU run is no FSDP realisation

    def test_fake_world_runs_are_no_fsdp_realisations(self):
        fake = [dict(r, fsdp=True, rank=0, fake_world=2) for r in (DEFAULT, GLAKE)]
        real = [dict(r, fsdp=True, rank=0) for r in (DEFAULT, GLAKE)]
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "fsdp.jsonl")
            write_runs(path, fake + real)
            workloads, defaults = allocator_share.load([path])
        self.assertEqual(sorted(workloads), ["opt1.3b LR FSDP rank 0", "opt1.3b LR FSDP, fake world 2 rank 0"])
        self.assertEqual(len(defaults["opt1.3b LR FSDP rank 0"]), 1)
        self.assertEqual(len(defaults["opt1.3b LR FSDP, fake world 2 rank 0"]), 1)

    def test_table_uses_same_length_default_runs_as_realisations(self):
        with tempfile.TemporaryDirectory() as directory:
            timed, untimed = os.path.join(directory, "timed.jsonl"), os.path.join(directory, "old.jsonl")
            write_runs(timed, (DEFAULT, GLAKE, dict(GLAKE, status="oom"), dict(DEFAULT, fsdp=True, rank=1)))
            write_runs(untimed, (OTHER_HOST, dict(OTHER_HOST, seq_lengths=[1] * 6), dict(OTHER_HOST, fsdp=True),
                                 dict(OTHER_HOST, strategy="N")))
            out = io.StringIO()
            with redirect_stdout(out):
                allocator_share.main([timed, untimed])
        rows = [line for line in out.getvalue().splitlines() if line.startswith("| ") and "workload" not in line]
        self.assertEqual(len(rows), 1)  # rank 1 and the N run have no timed glake partner
        cells = [c.strip() for c in rows[0].strip("|").split("|")]
        first = (0.3 * 0.99 / 0.9 + 0.4) / 2 / 0.35
        self.assertEqual(cells[:2], ["opt1.3b LR", "1, 1"])
        self.assertEqual(cells[8:], ["1 of 4", "2", f"{(first + 1) / 2:.4f}", f"{first:.4f}", "1"])

    def test_defaults_only_files_give_their_default_runs_alone(self):
        with tempfile.TemporaryDirectory() as directory:
            now, before = os.path.join(directory, "now.jsonl"), os.path.join(directory, "before.jsonl")
            write_runs(now, [GLAKE])
            old_glake = dict(GLAKE, step_allocator_ms=[90.0, 9.0, 2.5, 4.0, 3.0, 50.0])
            write_runs(before, (DEFAULT, old_glake, OTHER_HOST))
            workloads, defaults = allocator_share.load([now], defaults_only=[before])
            self.assertEqual(workloads["opt1.3b LR"]["glake"], [GLAKE])  # not the old version's
            self.assertEqual(workloads["opt1.3b LR"]["default"], [DEFAULT])
            self.assertEqual(len(defaults["opt1.3b LR"]), 2)  # both default runs as host conditions
            out = io.StringIO()
            with redirect_stdout(out):
                allocator_share.main([now, "--defaults-only", before])
            self.assertIn("| opt1.3b LR | 1, 1 |", out.getvalue())

    def test_a_file_given_as_results_and_after_defaults_only_is_read_once(self):
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "runs.jsonl")
            write_runs(path, (DEFAULT, GLAKE, OTHER_HOST))
            workloads, defaults = allocator_share.load([path], defaults_only=[path])
            self.assertEqual(len(defaults["opt1.3b LR"]), 2)  # not 4
            self.assertEqual(workloads["opt1.3b LR"]["glake"], [GLAKE])

    def test_neutral_steps_count_with_ratio_one(self):
        c = allocator_share.compare([DEFAULT], [GLAKE], [DEFAULT, OTHER_HOST], neutral=(5,))
        self.assertEqual(c["implied"], [1.0, 1.0])  # step 5 was glake's only costly step
        self.assertAlmostEqual(c["ratio_max"], 0.99 / 0.9)  # the ratios themselves are as measured
        self.assertEqual(sorted(c["per_step"]), [3, 4, 5, 6])
        self.assertAlmostEqual(c["per_step"][5], 0.99 / 0.9)
        self.assertAlmostEqual(c["per_step"][3], 1.0)

    def test_glake_less_ms_takes_time_off_glakes_steps_only(self):
        shares = allocator_share.step_shares(GLAKE, less_ms=2.0)
        self.assertAlmostEqual(shares[2][0], 0.5 / 250)  # step 3: 2.5 - 2 ms in 0.25 s
        self.assertAlmostEqual(shares[4][0], 28.0 / 300)
        self.assertAlmostEqual(shares[2][1], 500.0)  # 0.5 ms over 1000 calls
        self.assertEqual(allocator_share.step_shares(GLAKE, less_ms=100.0)[4][0], 0.0)  # never below 0
        c = allocator_share.compare([DEFAULT], [GLAKE], glake_less_ms=2.0)
        self.assertAlmostEqual(c["default_share"], 0.01)  # the default's steps are untouched
        self.assertAlmostEqual(c["per_step"][3], 0.99 / (1 - 0.5 / 250))
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "runs.jsonl")
            write_runs(path, (DEFAULT, GLAKE))
            out = io.StringIO()
            with redirect_stdout(out):
                allocator_share.main([path, "--glake-less-ms", "2"])
            self.assertIn("Estimate: 2 ms taken off", out.getvalue())
            with self.assertRaises(SystemExit), redirect_stderr(io.StringIO()) as err, redirect_stdout(io.StringIO()):
                allocator_share.main([path, "--glake-less-ms", "-1"])
            self.assertIn("--glake-less-ms", err.getvalue())

    def test_options_print_each_steps_ratio_and_apply_neutral_steps(self):
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "runs.jsonl")
            write_runs(path, (DEFAULT, GLAKE, OTHER_HOST))
            out = io.StringIO()
            with redirect_stdout(out):
                allocator_share.main(["--per-step", path, "--neutral", "5"])
        text = out.getvalue()
        self.assertIn("r = 1 in steps 5", text)
        self.assertIn("| r, step 3 | r, step 4 | r, step 5 | r, step 6 |", text)
        self.assertIn(f"| opt1.3b LR | 1.000 | 1.000 | {0.99 / 0.9:.3f} | 1.000 |", text)
        row = [line for line in text.splitlines() if line.startswith("| opt1.3b LR | 1, 1")][0]
        self.assertEqual([c.strip() for c in row.strip("|").split("|")][10:], ["1.0000", "1.0000", "0"])

    def test_bad_step_numbers_are_refused_with_a_message(self):
        for bad in ("7,x", "0", ""):
            with self.assertRaises(SystemExit), redirect_stderr(io.StringIO()) as err:
                allocator_share.main(["--neutral", bad, "runs.jsonl"])
            self.assertIn("--neutral", err.getvalue())


if __name__ == "__main__":
    unittest.main()
