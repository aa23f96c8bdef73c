"""Tests for bench/torch/trace_host_cost.py's trace reading and timing loop, without torch.

Run: python3 -m unittest discover -s bench/torch/tests -v
"""

import gzip
import os
import sys
import tempfile
import unittest
import unittest.mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trace_host_cost  # noqa: E402


def write(directory, name, text):
    path = os.path.join(directory, name)
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "wt") as f:
        f.write(text)
    return path


class ReadOps(unittest.TestCase):
    def test_reads_requests_and_skips_segments_and_comments(self):
        with tempfile.TemporaryDirectory() as d:
            path = write(d, "t.trace.gz", "# glake trace\nS,2097152\na,0,512,0\na,1,4096,0\nf,0\nU,2097152\n\nf,1\n")
            self.assertEqual(trace_host_cost.read_ops(path), [(True, 0, 512), (True, 1, 4096), (False, 0, 0), (False, 1, 0)])

    def test_a_bad_line_names_file_and_line(self):
        with tempfile.TemporaryDirectory() as d:
            path = write(d, "t.trace", "a,0,512,0\nx,1\n")
            with self.assertRaisesRegex(ValueError, r"t\.trace:2: .*'x,1'"):
                trace_host_cost.read_ops(path)
            path = write(d, "u.trace", "a,0,lots,0\n")
            with self.assertRaisesRegex(ValueError, r"u\.trace:1"):
                trace_host_cost.read_ops(path)


class Measure(unittest.TestCase):
    def test_every_allocation_is_freed_once_and_in_trace_order(self):
        ops = [(True, 0, 100), (True, 1, 200), (False, 0, 0), (True, 2, 300)]  # id 2 outlives the trace
        events, pointers = [], iter(range(1000, 2000))

        def alloc(size):
            p = next(pointers)
            events.append(("a", size, p))
            return p

        rows = trace_host_cost.measure(ops, alloc, lambda p: events.append(("f", p)), passes=2)
        self.assertEqual(len(rows), 2)
        first = events[: len(events) // 2]
        self.assertEqual(first, [("a", 100, 1000), ("a", 200, 1001), ("f", 1000), ("a", 300, 1002), ("f", 1001), ("f", 1002)])
        freed = [e[1] for e in events if e[0] == "f"]
        self.assertEqual(sorted(freed), sorted(e[2] for e in events if e[0] == "a"))
        for row in rows:
            self.assertGreater(row["ns_per_call"], 0)
            self.assertGreater(row["steady_ns_per_call"], 0)
            self.assertAlmostEqual(row["net_ns_per_call"], row["ns_per_call"] - row["loop_ns_per_call"])
            self.assertAlmostEqual(row["steady_net_ns_per_call"], row["steady_ns_per_call"] - row["steady_loop_ns_per_call"])

    def test_the_steady_part_is_the_calls_after_the_first_40_percent(self):
        ops = [(True, i, 100) for i in range(10)]
        seen = []
        clock = iter(range(100))
        with unittest.mock.patch.object(trace_host_cost.time, "perf_counter", lambda: next(clock)):
            seconds, steady, live = trace_host_cost.one_pass(ops, lambda size: seen.append(size) or len(seen), lambda p: None)
        self.assertEqual(len(seen), 10)
        self.assertEqual((seconds, steady), (2, 1))  # three clock reads: begin, after op 4, end
        self.assertEqual(sorted(live), list(range(10)))

    def test_a_free_of_an_unknown_id_is_an_error(self):
        with self.assertRaises(KeyError):
            trace_host_cost.measure([(False, 7, 0)], lambda s: s, lambda p: None, passes=2)


if __name__ == "__main__":
    unittest.main()
