#!/usr/bin/env python3
"""glake-replay --snapshot: each configuration's file is the dict torch.cuda.memory._snapshot()
gives ("segments", "device_traces"), converts to a pickle as docs/replay.md says, and agrees with
itself: the allocations the history leaves live are the allocated blocks of the segments, the
segments the history leaves are the segments shown, and every segment's blocks tile it (as
torch/cuda/_memory_viz.py's segsum asserts). A configuration that shows no segments has its
allocations' history only. With --quiet nothing goes to stderr.
  replay_snapshot_check.py GLAKE_REPLAY TRACE
"""
import gzip
import json
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path


def check(path, allocations):
    with open(path) as f:
        snapshot = json.load(f)
    # The conversion docs/replay.md gives, for pytorch.org/memory_viz and torch.cuda._memory_viz.
    assert pickle.loads(pickle.dumps(snapshot, protocol=2)) == snapshot
    assert set(snapshot) >= {"segments", "device_traces"}, sorted(snapshot)
    assert len(snapshot["device_traces"]) == 1
    trace = snapshot["device_traces"][0]
    live, segments = {}, {}
    for e in trace:
        assert set(e) >= {"action", "addr", "size", "stream", "time_us", "frames"}, e
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            del live[e["addr"]]
        elif e["action"] == "segment_alloc":
            segments[e["addr"]] = e["size"]
        elif e["action"] == "segment_free":
            del segments[e["addr"]]
        elif e["action"] == "oom":
            assert "device_free" in e
    assert sum(e["action"] == "alloc" for e in trace) == allocations
    if not snapshot["segments"]:
        assert not segments
        return "allocations only"
    for s in snapshot["segments"]:
        assert sum(b["size"] for b in s["blocks"]) == s["total_size"], s["address"]
        for b in s["blocks"]:
            if b["state"] == "active_allocated":
                assert b["requested_size"] <= b["size"]
    blocks = {b["address"]: b["requested_size"] for s in snapshot["segments"] for b in s["blocks"]
              if b["state"] == "active_allocated"}
    assert blocks == live, (len(blocks), len(live))
    shown = {s["address"]: s["total_size"] for s in snapshot["segments"] if s["segment_type"] == "large"}
    assert shown == segments, (len(shown), len(segments))
    return f"{len(shown)} segments, {len(live)} live allocations"


def main(argv):
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    replay, trace = argv[1], Path(argv[2])
    with gzip.open(trace, "rt") as f:
        allocations = sum(1 for line in f if line.startswith("a,") and line.rstrip().split(",")[2] != "0")
    with tempfile.TemporaryDirectory() as out:
        run = subprocess.run([replay, "--quiet", "--snapshot", out, "--snapshot-entries", "10000000", str(trace)],
                             check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert run.stderr == "", run.stderr  # --quiet: no progress, no "wrote" lines
        files = sorted(Path(out).glob("*.json"))
        names = [f.name for f in files]
        assert len(files) == 4, names
        name = trace.name.split(".trace")[0]
        assert f"{name}.glake.json" in names, names
        for f in files:
            print(f"{f.name}: {check(f, allocations)}")
        assert "segments" in check(Path(out) / f"{name}.glake.json", allocations)
    print("replay_snapshot: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
