"""Tests for tools/analysis/steptime_pairs.py's interval and verdict (no torch needed).

Run: python3 -m unittest discover -s tools/tests -v
"""

import math
import os
import sys
import unittest

TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TOOLS, "analysis"))
import steptime_pairs as sp  # noqa: E402


class Interval(unittest.TestCase):
    def test_two_ratios_use_t_with_one_degree_of_freedom(self):
        geo, (low, high) = sp.ratio_interval([1.1, 0.9])
        logs = [math.log(1.1), math.log(0.9)]
        half = 12.706 * abs(logs[0] - logs[1]) / math.sqrt(2) / math.sqrt(2)  # stdev of two = |a-b|/sqrt(2)
        self.assertAlmostEqual(geo, math.sqrt(0.99))
        self.assertAlmostEqual(low, math.exp(sum(logs) / 2 - half))
        self.assertAlmostEqual(high, math.exp(sum(logs) / 2 + half))

    def test_one_ratio_has_no_interval(self):
        self.assertEqual(sp.ratio_interval([1.05]), (1.05, None))
        self.assertEqual(sp.verdict(None), "open")

    def test_many_ratios_use_the_normal_quantile(self):
        ratios = [1.0, 1.01] * 20  # 40 pairs: 39 degrees of freedom, past the table
        geo, (low, high) = sp.ratio_interval(ratios)
        logs = [math.log(r) for r in ratios]
        import statistics
        half = 1.960 * statistics.stdev(logs) / math.sqrt(40)
        self.assertAlmostEqual(high / geo, math.exp(half))
        self.assertLess(low, geo)

    def test_verdict_against_the_target(self):
        self.assertEqual(sp.verdict((0.95, 1.02)), "met")
        self.assertEqual(sp.verdict((1.021, 1.1)), "missed")
        self.assertEqual(sp.verdict((0.99, 1.03)), "open")
        self.assertEqual(sp.verdict((0.99, 1.03), target=1.05), "met")


class HostSpeed(unittest.TestCase):
    def test_slow_share_counts_steps_three_on_over_half_a_millisecond(self):
        run = {"step_probe_s": {"python": [0.9e-3, 0.9e-3, 0.38e-3, 0.71e-3, 0.40e-3, 0.69e-3]}}
        self.assertEqual(sp.slow_share(run), 0.5)  # steps 1-2 left out, as in median_step_s
        self.assertIsNone(sp.slow_share({"step_times_s": [0.3] * 6}))  # run without --host-probe

    def test_the_fit_recovers_the_ratio_at_equal_host_speed(self):
        points = [(x, math.log(1.01) + 0.25 * x) for x in (-0.5, -0.2, 0.0, 0.3, 0.6)]
        fit = sp.host_adjusted(points)
        self.assertAlmostEqual(fit["ratio"], 1.01)
        self.assertAlmostEqual(fit["slope"], 0.25)
        self.assertAlmostEqual(fit["corr"], 1.0)
        self.assertAlmostEqual(fit["sd_residual"], 0.0)

    def test_noise_in_host_speed_moves_the_raw_mean_but_not_the_fit(self):
        # glake's runs drew the slower hosts: the raw mean says 1.05, at equal speed 1.00
        points = [(0.2, 0.25 * 0.2 + e) for e in (0.01, -0.01)] + [(0.1, 0.25 * 0.1 + e) for e in (0.01, -0.01)]
        raw = math.exp(sum(y for _, y in points) / len(points))
        self.assertGreater(raw, 1.03)
        self.assertAlmostEqual(sp.host_adjusted(points)["ratio"], 1.0)

    def test_too_few_pairs_or_no_spread_give_no_fit(self):
        self.assertIsNone(sp.host_adjusted([(0.1, 0.0), (0.2, 0.1)]))
        self.assertIsNone(sp.host_adjusted([(0.1, 0.0), (0.1, 0.1), (0.1, 0.2)]))


if __name__ == "__main__":
    unittest.main()
