"""Tests for tools/analysis/replay_ns_pairs.py, against a stand-in for glake-replay.

Run: python3 -m unittest discover -s tools/tests -v
"""

import os
import stat
import subprocess
import sys
import tempfile
import unittest

TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(TOOLS, "analysis", "replay_ns_pairs.py")

# Prints one record per trace argument and configuration, as glake-replay --json does, with
# ns/op from FAKE_NS ("glake=300,pytorch-default=200"); logs each call's -a list to FAKE_LOG.
FAKE = r'''#!/usr/bin/env python3
import json, os, sys
args = sys.argv[1:]
order = args[args.index("-a") + 1].split(",")
traces = [a for a in args if a.endswith(".trace")]
ns = dict(kv.split("=") for kv in os.environ["FAKE_NS"].split(","))
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(",".join(order) + "\n")
for t in traces:
    for a in order:
        print(json.dumps({"trace": t, "allocator": a, "host_ns_per_operation": float(ns[a])}))
'''


class ReplayNsPairs(unittest.TestCase):
    def run_script(self, ns, *extra):
        with tempfile.TemporaryDirectory() as d:
            fake = os.path.join(d, "glake-replay")
            with open(fake, "w") as f:
                f.write(FAKE)
            os.chmod(fake, os.stat(fake).st_mode | stat.S_IEXEC)
            log = os.path.join(d, "calls.log")
            env = dict(os.environ, FAKE_NS=ns, FAKE_LOG=log)
            done = subprocess.run([sys.executable, SCRIPT, *extra, fake, os.path.join(d, "x.trace")],
                                  capture_output=True, text=True, env=env)
            calls = []
            if os.path.exists(log):
                with open(log) as f:
                    calls = f.read().split()
        return done, calls

    def test_a_ratio_within_the_target_is_met(self):
        done, calls = self.run_script("glake=290,pytorch-default=200", "--runs", "4", "--copies", "2")
        self.assertEqual(done.returncode, 0, done.stderr)
        line = done.stdout.splitlines()[1]
        self.assertIn("1.450", line)
        self.assertIn(" 8  met", line)  # 4 runs x 2 copies
        # The configurations' order alternates from run to run.
        self.assertEqual(calls, ["glake,pytorch-default", "pytorch-default,glake"] * 2)

    def test_a_ratio_over_the_target_is_missed(self):
        done, _ = self.run_script("glake=310,pytorch-default=200", "--runs", "1", "--copies", "1")
        self.assertEqual(done.returncode, 1)
        self.assertIn("missed", done.stdout)

    def test_a_glake_run_over_a_microsecond_is_missed_whatever_the_ratio(self):
        done, _ = self.run_script("glake=1100,pytorch-default=1000", "--runs", "1", "--copies", "1")
        self.assertEqual(done.returncode, 1)
        self.assertIn("missed", done.stdout)

    def test_bad_counts_are_refused(self):
        done, _ = self.run_script("glake=1,pytorch-default=1", "--runs", "0")
        self.assertEqual(done.returncode, 2)
        self.assertIn("--runs", done.stderr)


if __name__ == "__main__":
    unittest.main()
