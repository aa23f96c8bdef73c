"""Tests for tools/snapshot_to_trace.py on synthetic snapshots (no torch needed).

Run: python3 -m unittest discover -s tools/tests -v
"""

import collections
import contextlib
import gzip
import io
import os
import pickle
import random
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
import unittest

TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(TOOLS, "snapshot_to_trace.py")
sys.path.insert(0, TOOLS)
import snapshot_to_trace as s2t  # noqa: E402

MiB = 1 << 20
S0, S1 = 0x7F00AA, 0x7F00BB  # two raw PyTorch stream handles


def ev(action, addr=0, size=0, stream=S0, **extra):
    """One trace entry as _dump_snapshot writes it (frames left empty)."""
    return dict(action=action, addr=addr, size=size, stream=stream, frames=[], **extra)


def snapshot(*traces, segments=()):
    return {"segments": list(segments), "device_traces": [list(t) for t in traces]}


class Frame:
    """A class the converter cannot know: it must come back as a stub."""

    def __init__(self, name):
        self.name = name


class Exploit:
    """Unpickling this with a plain pickle.load would create a file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class ConverterTest(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory()
        self.dir = self._tmp.name

    def tearDown(self):
        self._tmp.cleanup()

    def dump(self, obj, name="snap.pickle"):
        path = os.path.join(self.dir, name)
        with open(path, "wb") as f:
            pickle.dump(obj, f)
        return path

    def run_main(self, *argv):
        """main() in-process: (exit status, stdout lines, stderr text)."""
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = s2t.main(list(argv))
        return rc, out.getvalue().splitlines(), err.getvalue()

    def convert(self, snap, *argv):
        rc, lines, err = self.run_main(self.dump(snap), *argv)
        self.assertEqual(rc, 0, err)
        return lines, err

    # -- events --------------------------------------------------------------------------------

    def test_alloc_free_pairing_by_address_with_512_rounding(self):
        lines, err = self.convert(snapshot([
            ev("alloc", 0x1000, 1000), ev("alloc", 0x2000, 100), ev("alloc", 0x3000, 2048),
            ev("free_completed", 0x2000, 100), ev("free_completed", 0x1000, 1000),
        ]))
        self.assertEqual(lines, ["a,0,1024,0", "a,1,512,0", "a,2,2048,0", "f,1", "f,0"])
        self.assertIn("3 allocations", err)
        self.assertIn("2 frees", err)
        self.assertIn(f"peak active {1024 + 512 + 2048} bytes", err)

    def test_address_reuse_after_free_gets_a_new_id(self):
        lines, _ = self.convert(snapshot([
            ev("alloc", 0x1000, 512), ev("free_completed", 0x1000, 512),
            ev("alloc", 0x1000, 4096), ev("free_completed", 0x1000, 4096),
        ]))
        self.assertEqual(lines, ["a,0,512,0", "f,0", "a,1,4096,0", "f,1"])

    def test_second_free_of_an_address_is_skipped(self):
        lines, err = self.convert(snapshot([
            ev("alloc", 0x1000, 512), ev("free_completed", 0x1000),
            ev("free_completed", 0x1000),
        ]))
        self.assertEqual(lines, ["a,0,512,0", "f,0"])
        self.assertIn("skipped 1 x free of an address not allocated in the history", err)

    def test_alloc_at_a_live_address_frees_the_old_id_first_and_warns(self):
        lines, err = self.convert(snapshot([
            ev("alloc", 0x1000, 512), ev("alloc", 0x1000, 1024), ev("free_completed", 0x1000),
        ]))
        self.assertEqual(lines, ["a,0,512,0", "f,0", "a,1,1024,0", "f,1"])
        self.assertIn("warning: 1 x alloc at an address still live", err)
        self.assertIn("peak active 1024 bytes", err)

    def test_free_requested_is_ignored_until_free_completed(self):
        lines, err = self.convert(snapshot([
            ev("alloc", 0x1000, 512), ev("free_requested", 0x1000, 512),
            ev("alloc", 0x2000, 512), ev("free_completed", 0x1000, 512),
        ]))
        self.assertEqual(lines, ["a,0,512,0", "a,1,512,0", "f,0"])
        self.assertIn("1 free_requested ignored", err)
        self.assertIn("peak active 1024 bytes", err)

    def test_free_of_unknown_address_is_skipped_and_counted(self):
        lines, err = self.convert(snapshot([
            ev("free_completed", 0x9000, 512), ev("alloc", 0x1000, 512),
        ]))
        self.assertEqual(lines, ["a,0,512,0"])
        self.assertIn("skipped 1 x free of an address not allocated in the history", err)
        self.assertIn("1 entries skipped", err)

    def test_snapshot_oom_and_unknown_actions_are_skipped_and_counted(self):
        lines, err = self.convert(snapshot([
            ev("snapshot"), ev("alloc", 0x1000, 512), ev("oom", size=MiB, device_free=0),
            ev("teleport", 0x1000, 512),
        ]))
        self.assertEqual(lines, ["a,0,512,0"])
        self.assertIn("skipped 1 x snapshot", err)
        self.assertIn("skipped 1 x oom", err)
        self.assertIn("skipped 1 x unknown action 'teleport'", err)
        self.assertIn("3 entries skipped", err)

    def test_segment_alloc_free_and_map_unmap(self):
        lines, err = self.convert(snapshot([
            ev("segment_alloc", 0x100000, 20 * MiB), ev("alloc", 0x100000, MiB),
            ev("segment_map", 0x4000000, 2 * MiB), ev("segment_map", 0x4200000, 2 * MiB),
            ev("segment_unmap", 0x4200000, 2 * MiB), ev("free_completed", 0x100000, MiB),
            ev("segment_free", 0x100000, 20 * MiB),
        ]))
        self.assertEqual(lines, [f"S,{20 * MiB}", f"a,0,{MiB},0", f"S,{2 * MiB}",
                                 f"S,{2 * MiB}", f"U,{2 * MiB}", "f,0", f"U,{20 * MiB}"])
        self.assertIn(f"peak reserved {24 * MiB} bytes", err)

    def test_unmap_of_memory_mapped_before_the_history_is_skipped(self):
        lines, err = self.convert(snapshot([
            ev("segment_unmap", 0x4000000, 2 * MiB), ev("segment_map", 0x8000000, 2 * MiB),
        ]))
        self.assertEqual(lines, [f"S,{2 * MiB}"])
        self.assertIn("skipped 1 x unmap of memory not mapped in the history", err)

    def test_streams_are_numbered_in_order_of_first_appearance(self):
        lines, err = self.convert(snapshot([
            ev("alloc", 0x1000, 512, stream=S1), ev("alloc", 0x2000, 512, stream=S0),
            ev("alloc", 0x3000, 512, stream=S1),
        ]))
        self.assertEqual(lines, ["a,0,512,0", "a,1,512,1", "a,2,512,0"])
        self.assertIn("2 stream(s)", err)

    def test_legacy_free_action_counts_as_free_completed(self):
        lines, _ = self.convert(snapshot([ev("alloc", 0x1000, 512), ev("free", 0x1000, 512)]))
        self.assertEqual(lines, ["a,0,512,0", "f,0"])

    # -- output --------------------------------------------------------------------------------

    def test_gz_output_is_readable_with_gzip_and_matches_stdout(self):
        snap = snapshot([ev("segment_alloc", 0, 2 * MiB), ev("alloc", 0, 700),
                         ev("free_completed", 0, 700)])
        path = self.dump(snap)
        out = os.path.join(self.dir, "t.trace.gz")
        rc, stdout_lines, _ = self.run_main(path, "-o", out)
        self.assertEqual(rc, 0)
        self.assertEqual(stdout_lines, [])
        with gzip.open(out, "rt") as f:
            self.assertEqual(f.read().splitlines(), [f"S,{2 * MiB}", "a,0,1024,0", "f,0"])

    def test_plain_file_output(self):
        out = os.path.join(self.dir, "t.trace")
        rc, _, _ = self.run_main(self.dump(snapshot([ev("alloc", 0, 512)])), "--output", out)
        self.assertEqual(rc, 0)
        with open(out) as f:
            self.assertEqual(f.read(), "a,0,512,0\n")

    # -- state before the history --------------------------------------------------------------

    def initial_snapshot(self):
        """At the end: one 20 MiB segment (existed before) holding a weight allocated before the
        history (0x100000) and one allocated in it (0x300000); the history frees an activation
        allocated before it (0x200000), which is inactive at the end, and maps a new segment."""
        seg = {"device": 0, "address": 0x100000, "total_size": 20 * MiB, "stream": S1,
               "segment_type": "large", "blocks": [
                   {"address": 0x100000, "size": MiB, "requested_size": MiB - 100,
                    "state": "active_allocated", "frames": []},
                   {"address": 0x200000, "size": MiB, "requested_size": MiB,
                    "state": "inactive", "frames": []},
                   {"address": 0x300000, "size": MiB, "requested_size": MiB,
                    "state": "active_allocated", "frames": []},
                   {"address": 0x400000, "size": 17 * MiB, "requested_size": 0,
                    "state": "inactive", "frames": []}]}
        other_device = dict(seg, device=1, address=0x900000000)
        seg2 = {"device": 0, "address": 0x8000000, "total_size": 2 * MiB, "stream": S0,
                "segment_type": "large", "blocks": [
                    {"address": 0x8000000, "size": 2 * MiB, "requested_size": 2 * MiB,
                     "state": "inactive", "frames": []}]}
        return snapshot([
            ev("free_requested", 0x200000, MiB, stream=S1),
            ev("free_completed", 0x200000, MiB, stream=S1),
            ev("alloc", 0x300000, MiB, stream=S0),
            ev("segment_alloc", 0x8000000, 2 * MiB),
        ], [], segments=[seg, other_device, seg2])

    def test_initial_state_is_left_out_by_default_with_a_note(self):
        lines, err = self.convert(self.initial_snapshot())
        self.assertEqual(lines, [f"a,0,{MiB},0", f"S,{2 * MiB}"])
        self.assertIn(f"note: 2 allocation(s) of {2 * MiB} bytes and 1 segment(s) of "
                      f"{20 * MiB} bytes existed before the history began", err)
        self.assertIn(f"peak active {MiB} bytes", err)

    def test_include_initial_emits_segments_then_live_allocations_first(self):
        lines, err = self.convert(self.initial_snapshot(), "--include-initial")
        self.assertEqual(lines, [
            f"S,{20 * MiB}",                # the segment that existed before the history
            f"a,0,{MiB},0",                 # freed in the history: allocated before it (S1)
            f"a,1,{MiB},0",                 # active at the end, not allocated in it (S1)
            "f,0", f"a,2,{MiB},1", f"S,{2 * MiB}",  # S0 is the second stream seen
        ])
        self.assertNotIn("note:", err)
        self.assertIn("(2 initial, 1 initial segments)", err)
        self.assertIn(f"peak active {2 * MiB} bytes", err)
        self.assertIn(f"peak reserved {22 * MiB} bytes", err)

    def test_include_initial_undoes_unmaps_of_expandable_segments(self):
        # Expandable segment: 4 MiB mapped before the history, 2 MiB unmapped in it.
        seg = {"device": 0, "address": 0x4000000, "total_size": 2 * MiB, "stream": S0,
               "segment_type": "large", "is_expandable": True, "blocks": [
                   {"address": 0x4000000, "size": 2 * MiB, "requested_size": 0,
                    "state": "inactive", "frames": []}]}
        snap = snapshot([ev("segment_unmap", 0x4200000, 2 * MiB)], segments=[seg])
        lines, _ = self.convert(snap, "--include-initial")
        self.assertEqual(lines, [f"S,{2 * MiB}", f"S,{2 * MiB}", f"U,{2 * MiB}"])

    # -- devices -------------------------------------------------------------------------------

    def test_device_defaults_to_the_only_one_with_events(self):
        lines, err = self.convert(snapshot([], [ev("alloc", 0, 512)]))
        self.assertEqual(lines, ["a,0,512,0"])
        self.assertIn("device 1:", err)

    def test_device_can_be_chosen_when_several_have_events(self):
        snap = snapshot([ev("alloc", 0, 512)], [ev("alloc", 0, 1024), ev("alloc", 9, 2048)])
        lines, _ = self.convert(snap, "--device", "1")
        self.assertEqual(lines, ["a,0,1024,0", "a,1,2048,0"])

    # -- loading -------------------------------------------------------------------------------

    def test_restricted_unpickler_stubs_unknown_classes_and_runs_nothing(self):
        marker = os.path.join(self.dir, "pwned")
        snap = snapshot([ev("alloc", 0x1000, 512), ev("free_completed", 0x1000)])
        snap["device_traces"][0][0]["frames"] = [Frame("forward")]
        snap["exploit"] = Exploit(marker)
        path = self.dump(snap)
        loaded = s2t.load_snapshot(path)
        frame = loaded["device_traces"][0][0]["frames"][0]
        self.assertIsInstance(frame, s2t.Stub)
        self.assertNotIsInstance(frame, Frame)
        self.assertEqual(frame.state, {"name": "forward"})
        self.assertIsInstance(loaded["exploit"], s2t.Stub)
        self.assertFalse(os.path.exists(marker), "the unpickler ran os.system")
        rc, lines, _ = self.run_main(path)
        self.assertEqual((rc, lines), (0, ["a,0,512,0", "f,0"]))
        self.assertFalse(os.path.exists(marker))

    def test_gzip_compressed_snapshot_is_read(self):
        path = os.path.join(self.dir, "snap.pickle.gz")
        with gzip.open(path, "wb") as f:
            pickle.dump(snapshot([ev("alloc", 0, 512)]), f)
        rc, lines, _ = self.run_main(path)
        self.assertEqual((rc, lines), (0, ["a,0,512,0"]))

    # -- errors --------------------------------------------------------------------------------

    def assert_error(self, path, message, *argv):
        rc, lines, err = self.run_main(path, *argv)
        self.assertEqual(rc, 2)
        self.assertEqual(lines, [])
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn(f"error: {path}: ", err)
        self.assertIn(message, err)

    def test_error_not_a_pickle(self):
        path = os.path.join(self.dir, "notes.txt")
        with open(path, "w") as f:
            f.write("this is not a pickle\n")
        self.assert_error(path, "not a pickle")

    def test_error_pickle_that_is_not_a_dict(self):
        self.assert_error(self.dump([1, 2, 3]), "not a memory snapshot")

    def test_error_no_device_traces(self):
        self.assert_error(self.dump({"segments": []}), "no device_traces")

    def test_error_device_out_of_range(self):
        self.assert_error(self.dump(snapshot([ev("alloc")])), "device 3 out of range",
                          "--device", "3")

    def test_error_several_devices_with_events_and_none_chosen(self):
        self.assert_error(self.dump(snapshot([ev("alloc")], [ev("alloc")])),
                          "events on devices 0, 1: choose one with --device")

    def test_error_missing_file(self):
        self.assert_error(os.path.join(self.dir, "absent.pickle"), "cannot read")

    def test_error_keeps_output_file_unwritten(self):
        out = os.path.join(self.dir, "t.trace")
        self.assert_error(self.dump({"x": 1}), "no device_traces", "-o", out)
        self.assertFalse(os.path.exists(out))

    # -- hostile input -------------------------------------------------------------------------

    def write(self, data, name="hostile.pickle"):
        path = os.path.join(self.dir, name)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def test_build_on_a_class_is_refused_and_the_class_is_unchanged(self):
        # collections.Counter, then BUILD with state (None, {"most_common": 1}): setattr on the
        # class itself, for the whole process, under a plain restricted unpickler.
        data = (b"\x80\x04ccollections\nCounter\nN}\x8c\x0bmost_common\x94K\x01s\x86b.")
        original = collections.Counter.most_common
        try:
            self.assert_error(self.write(data), "sets the state of the class collections.Counter "
                                                "itself")
        finally:
            changed = collections.Counter.most_common is not original
            collections.Counter.most_common = original
        self.assertFalse(changed, "the pickle changed collections.Counter")

    def test_a_small_pickle_cannot_call_constructors_with_huge_arguments(self):
        # list(bytes(2**24)): a 50-byte file that allocated a 16 MiB bytes and a 128 MiB list.
        data = (b"\x80\x04cbuiltins\nlist\ncbuiltins\nbytes\nJ\x00\x00\x00\x01\x85R\x85R.")
        tracemalloc.start()
        try:
            self.assert_error(self.write(data), "not a memory snapshot")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        self.assertLess(peak, 4 * MiB)

    def test_gzip_that_inflates_past_the_limit_is_refused_without_inflating_it(self):
        bomb = gzip.compress(bytes(64 * MiB), compresslevel=9)
        self.assertLess(len(bomb), MiB)
        tracemalloc.start()
        try:
            with self.assertRaisesRegex(s2t.SnapshotError, f"decompresses to more than {MiB} bytes"):
                s2t.load_snapshot_bytes(bomb, max_bytes=MiB)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        self.assertLess(peak, 8 * MiB)
        self.assert_error(self.write(bomb, "bomb.pickle.gz"), "decompresses to more than",
                          "--max-input-bytes", str(MiB))
        self.assert_error(self.write(bomb[:len(bomb) // 2], "cut.pickle.gz"), "corrupt gzip data")

    def test_a_flood_of_none_opcodes_is_refused_at_the_stack_limit(self):
        data = b"\x80\x02" + b"N" * (4 * MiB) + b"."
        start = time.process_time()
        with self.assertRaisesRegex(s2t.SnapshotError, f"more than {s2t._MAX_STACK} items on the stack"):
            s2t.load_snapshot_bytes(data)
        self.assertLess(time.process_time() - start, 5)

    def test_coverage_counts_bytes_as_a_set_of_addresses_does(self):
        rng = random.Random(7)
        cover, model = s2t._Coverage(), set()
        for _ in range(6000):
            lo = rng.randrange(4000)
            hi = lo + rng.randrange(1, 6 if rng.random() < 0.95 else 400)
            span = set(range(lo, hi))
            if rng.random() < 0.6:
                self.assertEqual(cover.add(lo, hi), len(span - model))
                model |= span
            else:
                self.assertEqual(cover.remove(lo, hi), len(span & model))
                model -= span
        covered = [a for s, e in cover.items() for a in range(s, e)]
        self.assertEqual(covered, sorted(model))
        self.assertTrue(all(e < s2 for (_, e), (s2, _) in zip(cover.items(), cover.items()[1:])))

    def test_segment_events_convert_in_n_log_n_whatever_their_addresses(self):
        n = 50000
        # Maps from the top down (each in front of the others), then maps over all of them again
        # and again, then one unmap: quadratic with ranges kept apart in one flat list.
        events = [ev("segment_map", (2 * (n - i)) << 21, 1 << 21) for i in range(n)]
        whole = (2 * n + 2) << 21
        events += [ev("segment_map", 1 << 21, whole)] * (n // 10)
        events += [ev("segment_unmap", 1 << 21, whole)]
        start = time.process_time()
        conv = s2t.convert(snapshot(events), include_initial=True)
        self.assertLess(time.process_time() - start, 15)
        self.assertEqual(conv.maps, n + n // 10)
        self.assertEqual(conv.unmaps, 1)
        self.assertEqual(conv.lines[n], f"S,{whole}")
        self.assertEqual(conv.lines[-1], f"U,{whole}")
        self.assertEqual(conv.warnings["map over memory already mapped"], n // 10)

    def test_malformed_structures_end_in_one_line_naming_the_entry(self):
        cases = [
            (snapshot([ev("alloc", 0, 512), ev([1], 0, 512)]),
             "device_traces[0][1]: action is a list, not a string"),
            (snapshot([ev("alloc", 0, 512), 7]), "device_traces[0][1] is an int, not a dict"),
            (snapshot([ev("alloc", 0, 512)], segments=[{"address": 0, "total_size": MiB,
                                                        "blocks": 5}]),
             "segments[0].blocks is an int, not a list"),
            (snapshot([ev("alloc", 0, 512)], segments=[{"address": 0, "total_size": MiB,
                                                        "blocks": [None]}]),
             "segments[0].blocks[0] is a NoneType, not a dict"),
            (dict(snapshot([ev("alloc", 0, 512)]), segments=5), "segments is an int, not a list"),
            (snapshot([ev("alloc", 0, -100)]),
             "device_traces[0][0]: size -100 is out of range (0 to 2^48)"),
            (snapshot([ev("alloc", 0, 2**80)]),
             "device_traces[0][0]: size of 81 bits is out of range (0 to 2^48)"),
            (snapshot([ev("segment_map", 0, 2**48 + 1)]), "size 281474976710657 is out of range"),
            (snapshot([ev("alloc", -1, 512)]), "device_traces[0][0]: addr -1 is out of range"),
            (snapshot([ev("alloc", 0, 512)], segments=[{"address": 0, "total_size": -5}]),
             "segments[0]: total_size -5 is out of range"),
            (snapshot([ev("alloc", 0, 512, stream=[1, [2]])]),
             "device_traces[0][0]: stream is a list, not an integer"),
        ]
        for snap, message in cases:
            with self.subTest(message=message):
                self.assert_error(self.dump(snap), message)

    def test_a_stream_that_would_repr_exponentially_is_refused_at_once(self):
        # Ten references to the one list under it, 30 deep: 10^30 elements when printed.
        nested = [0]
        for _ in range(30):
            nested = [nested] * 10
        start = time.monotonic()
        self.assert_error(self.dump(snapshot([ev("alloc", 0, 512, stream=nested)])),
                          "stream is a list, not an integer")
        self.assertLess(time.monotonic() - start, 5)

    def run_script(self, path, limit_memory=False):
        def limit():
            resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        return subprocess.run([sys.executable, SCRIPT, path], capture_output=True, text=True,
                              timeout=120, preexec_fn=limit if limit_memory else None)

    def test_deeply_nested_tuples_are_refused_before_python_hashes_them(self):
        # A dict keyed by a tuple 10^6 deep: hashing it recursed in C and crashed the interpreter.
        data = b"\x80\x04}K\x01" + b"\x85" * 1_000_000 + b"K\x02s."
        r = self.run_script(self.write(data))
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("tuples nested more than 100 deep", r.stderr)
        self.assertEqual(len(r.stderr.splitlines()), 1)

    def test_a_memo_index_far_ahead_is_refused_before_the_memo_grows_to_it(self):
        # LONG_BINPUT 2^28: the unpickler's memo array grew to 2^29 slots (4 GiB).
        data = b"\x80\x04}r\x00\x00\x00\x10."
        r = self.run_script(self.write(data), limit_memory=True)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("memo index 268435456 out of sequence", r.stderr)

    def test_opcodes_a_snapshot_never_needs_are_refused(self):
        for data, name in ((b"\x80\x04\x8c\x011\x94Q.", "BINPERSID"),
                           (b"\x80\x02\x82\x01.", "EXT1"),
                           (b"(i__main__\nX\n.", "INST")):
            with self.subTest(name=name):
                self.assert_error(self.write(data), f"the pickle uses {name}")

    def test_control_characters_are_escaped_in_messages(self):
        rc, _, err = self.run_main(self.write(b"\x1b[31m\x07"))
        self.assertEqual(rc, 2)
        self.assertNotIn("\x1b", err)
        self.assertIn("unknown opcode 0x1b at byte 0", err)
        path = self.write(b"\x80\x04].", "odd\x1b[2Jname.pickle")
        rc, _, err = self.run_main(path)
        self.assertEqual(rc, 2)
        self.assertNotIn("\x1b", err)
        self.assertIn("odd\\x1b[2Jname.pickle", err)
        lines, err = self.convert(snapshot([ev("alloc", 0, 512), ev("\x1b[2J" + "x" * 500)]))
        self.assertNotIn("\x1b", err)
        self.assertLess(max(len(line) for line in err.splitlines()), 300)

    def test_an_unexpected_exception_still_ends_in_one_line_and_status_2(self):
        original = s2t.convert
        s2t.convert = lambda *args: (_ for _ in ()).throw(RecursionError("too deep"))
        try:
            self.assert_error(self.dump(snapshot([ev("alloc", 0, 512)])),
                              "cannot convert (RecursionError: too deep)")
        finally:
            s2t.convert = original

    def test_convert_bytes_returns_text_or_raises_snapshot_error_only(self):
        valid = pickle.dumps(snapshot([ev("alloc", 0x1000, 1000), ev("free_completed", 0x1000),
                                       ev("segment_map", 0, 2 * MiB)]), protocol=4)
        self.assertEqual(s2t.convert_bytes(valid), f"a,0,1024,0\nf,0\nS,{2 * MiB}\n")
        self.assertEqual(s2t.convert_bytes(gzip.compress(valid)), s2t.convert_bytes(valid))
        rng = random.Random(1)
        for protocol in (0, 2, 4, 5):
            data = pickle.dumps(snapshot([ev("alloc", 0x1000, 1000), ev("free", 0x1000)]),
                                protocol=protocol)
            for _ in range(300):
                mutated = bytearray(data)
                for _ in range(rng.randint(1, 4)):
                    at = rng.randrange(len(mutated))
                    mutated[at] = rng.randrange(256)
                if rng.random() < 0.3:
                    mutated = mutated[:rng.randrange(len(mutated))]
                try:
                    self.assertIsInstance(s2t.convert_bytes(bytes(mutated)), str)
                except s2t.SnapshotError as e:
                    self.assertEqual(len(str(e).splitlines()), 1)
                    self.assertTrue(str(e).isprintable(), str(e))

    # -- as a program --------------------------------------------------------------------------

    def test_subprocess_converts_and_fails_with_status_2(self):
        good = self.dump(snapshot([ev("alloc", 0x10, 600, stream=S1), ev("free_completed", 0x10)]))
        r = subprocess.run([sys.executable, SCRIPT, good], capture_output=True, text=True,
                           timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.splitlines(), ["a,0,1024,0", "f,0"])
        self.assertEqual(len(r.stderr.splitlines()), 1)
        self.assertIn("1 allocations", r.stderr)

        bad = self.dump({"segments": []}, "bad.pickle")
        r = subprocess.run([sys.executable, SCRIPT, bad], capture_output=True, text=True,
                           timeout=60)
        self.assertEqual(r.returncode, 2)
        self.assertEqual(r.stdout, "")
        self.assertIn(f"{bad}: no device_traces", r.stderr)

    def test_script_is_executable_with_a_shebang(self):
        self.assertTrue(os.access(SCRIPT, os.X_OK))
        with open(SCRIPT) as f:
            self.assertEqual(f.readline(), "#!/usr/bin/env python3\n")


if __name__ == "__main__":
    unittest.main()
