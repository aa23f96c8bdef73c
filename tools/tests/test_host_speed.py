"""bench/host_speed.py prints a timing per CPU per round, the unpinned slow share and the
spinner-partner row (run for real, briefly, on this machine's CPUs)."""
import os
import re
import subprocess
import sys
import unittest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "host_speed.py")


class HostSpeed(unittest.TestCase):
    def test_prints_each_cpu_each_round_and_the_slow_share(self):
        run = subprocess.run([sys.executable, SCRIPT, "--rounds", "2", "--seconds", "0.2", "--no-facts"],
                             capture_output=True, text=True, timeout=120)
        self.assertEqual(run.returncode, 0, run.stderr)
        cpus = sorted(os.sched_getaffinity(0))
        rows = re.findall(r"^round (\d+): (.*)$", run.stdout, re.M)
        self.assertEqual([int(r) for r, _ in rows], [0, 1])
        for _, row in rows:
            cells = [cell.split(":") for cell in row.split()]
            self.assertEqual([int(c) for c, _ in cells], cpus)
            self.assertTrue(all(float(ms) > 0 for _, ms in cells))
        share = re.search(r"slow \(>0.5 ms\) share ([0-9.]+)", run.stdout)
        self.assertIsNotNone(share, run.stdout)
        self.assertTrue(0 <= float(share.group(1)) <= 1)
        partners = re.search(r"^cpu (\d+) alone ([0-9.]+); with a spinner on: ?(.*)$", run.stdout, re.M)
        self.assertIsNotNone(partners, run.stdout)
        self.assertEqual(int(partners.group(1)), cpus[0])
        self.assertEqual(len(partners.group(3).split()), len(cpus) - 1)


if __name__ == "__main__":
    unittest.main()
