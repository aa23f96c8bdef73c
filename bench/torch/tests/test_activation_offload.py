"""bench/torch/activation_offload.py without a GPU: the variants' parsing, the layers recomputed,
and the report over synthetic runs (no torch needed); the dry run (--device cpu, a tiny model)
where torch and transformers import.

Run: ctest -R bench.torch_finetune (with the other bench tests), or
     python3 -m unittest discover -s bench/torch/tests -p test_activation_offload.py
"""

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(os.path.dirname(HERE), "activation_offload.py")
spec = importlib.util.spec_from_file_location("activation_offload", SCRIPT)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
GiB = 2 ** 30


def run_of(variant, step_ms, reserved_gib, losses=(1.0, 0.5), offloaded=None, round_=0):
    r = {"variant": variant, "model": "1b", "layers": 22, "lora": False, "parameters": 1.1e9, "trainable": 1.1e9,
         "batch": 4, "seq": 2048, "device": "NVIDIA H200", "torch": "2.11.0", "allocator": "pytorch",
         "step_s": [step_ms / 1e3] * 20, "losses": list(losses), "round": round_,
         "peak_allocated_bytes": int((reserved_gib - 1) * GiB), "peak_reserved_bytes": int(reserved_gib * GiB),
         "peak_used_bytes": int((reserved_gib + 0.5) * GiB)}
    if offloaded is not None:
        r["glake"] = {"offloaded_bytes_per_step": int(offloaded * GiB)}
    return r


class ActivationOffloadReportTest(unittest.TestCase):
    def test_variants_and_layers(self):
        self.assertEqual(bench.parse_variant("none"), ("none", None))
        self.assertEqual(bench.parse_variant("glake:0.25"), ("glake", 0.25))
        self.assertEqual(bench.parse_variant("save_on_cpu"), ("save_on_cpu", 1.0))
        with self.assertRaises(ValueError):
            bench.parse_variant("offload:0.5")
        self.assertEqual(bench.spaced(4, 8), [0, 2, 4, 6])  # every second layer
        self.assertEqual(bench.spaced(11, 22), list(range(0, 22, 2)))
        self.assertEqual(bench.spaced(22, 22), list(range(22)))
        self.assertEqual(bench.spaced(0, 22), [])
        for v in (bench.DEFAULT_VARIANTS + "," + bench.QUICK_VARIANTS).split(","):
            bench.parse_variant(v)

    def test_report_at_equal_peak_and_targets(self):
        runs = [run_of("none", 100, 50), run_of("none", 100, 50, round_=1),
                run_of("glake:0.5", 101, 39, offloaded=11), run_of("glake:0.75", 108, 29, offloaded=16),
                run_of("recompute:0.5", 115, 40), run_of("recompute:0.75", 122, 30),
                run_of("save_on_cpu:0.5", 140, 39), run_of("glake:0.25", 100, 45, losses=(1.0, 0.75))]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            bench.summarize(runs + [{"variant": "glake:0.9", "round": 0, "error": "exit 1"}])
        text = out.getvalue()
        self.assertIn("| glake:0.5 | 20 | 101.0 (101.0-101.0) | 1.010 | 38.00 | -22.4% | 39.00 | -22.0% | 39.50 | 11.00 | 0 |", text)
        self.assertIn("| none | 40 |", text)
        self.assertIn("| glake:0.25 | 20 | 100.0 (100.0-100.0) | 1.000 | 44.00 | -10.2% | 45.00 | -10.0% | 45.50 | - | 0.25 |", text)
        # recompute at 39 GiB: between 40 (1.15) and 30 (1.22): 1.157; save_on_cpu at 39: 1.400.
        self.assertIn("| glake:0.5 | -22.0% | 1.010 | 1.400 | 1.157 |", text)
        self.assertIn("| glake:0.75 | -42.0% | 1.080 | out of range | out of range |", text)
        self.assertIn("-20% at <= 1.02x: met by glake:0.5", text)
        self.assertIn("-40% at <= 1.10x: met by glake:0.75", text)


def _imports(name):
    return subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True).returncode == 0


@unittest.skipUnless(_imports("torch") and _imports("transformers"), "torch or transformers does not import")
class ActivationOffloadDryRunTest(unittest.TestCase):
    def test_cpu_dry_run_gives_equal_losses(self):
        done = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--variants", "none,glake:0.5,recompute:0.5",
                               "--steps", "1", "--warmup", "2", "--seq", "32", "--layers", "3"],
                              capture_output=True, text=True, timeout=900)
        self.assertEqual(done.returncode, 0, done.stderr[-2000:])
        runs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        self.assertEqual([r["variant"] for r in runs], ["none", "glake:0.5", "recompute:0.5"])
        for r in runs:
            self.assertNotIn("error", r)
            self.assertEqual(r["losses"], runs[0]["losses"])
        glake = runs[1]["glake"]
        self.assertGreater(glake["offloaded_bytes_per_step"], 0)
        self.assertLess(glake["offloaded_bytes_per_step"], glake["activation_bytes"])


if __name__ == "__main__":
    unittest.main()
