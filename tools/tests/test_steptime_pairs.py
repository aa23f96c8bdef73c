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


if __name__ == "__main__":
    unittest.main()
