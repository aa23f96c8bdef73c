#!/usr/bin/env python3
"""Writes the seed corpora under fuzz/corpus/ (committed; rerun only to change them).

trace:     short snippets of traces/*.trace.gz (plain, one gzip-compressed) and a few damaged
           variants; config: GLAKE_ALLOC_CONF strings and GMLake variable sets; alloc_ops: one
           operation mix per allocator composition; snapshot: small PyTorch-style snapshots.
Deterministic: the same files every run.
"""
import gzip
import os
import pickle
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "fuzz", "corpus")


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def trace_lines(name, start, count):
    with gzip.open(os.path.join(ROOT, "traces", name), "rt") as f:
        lines = f.read().splitlines()
    return lines[start:start + count]


def traces():
    head = "\n".join(trace_lines("opt1.3b-N.trace.gz", 0, 40)) + "\n"
    write("trace", "opt-head.trace", head.encode())
    # A window from the middle: frees of ids allocated before it are what the reader rejects,
    # so keep only the lines whose ids the window itself allocates.
    mid = trace_lines("opt1.3b-N-fsdp2-rank0.trace.gz", 0, 400)
    write("trace", "fsdp-head.trace", ("\n".join(mid[:60]) + "\n").encode())
    live, kept = set(), []
    for line in trace_lines("llama1b-LR-glake.trace.gz", 0, 200):
        f = line.split(",")
        if f[0] == "a":
            live.add(f[1])
        if f[0] == "f" and f[1] not in live:
            continue
        kept.append(line)
    write("trace", "llama-glake-head.trace", ("\n".join(kept[:80]) + "\n").encode())
    write("trace", "opt-head.trace.gz", gzip.compress(head.encode(), mtime=0))
    write("trace", "multi-stream.trace",
          b"a,0,512,0\na,1,1048576,1\na,2,4096,2\nS,2097152\nf,1\nf,0\nU,2097152\nf,2\n")
    write("trace", "crlf-comment.trace", b"# comment\r\na,0,512,0\r\n\r\nf,0\r\n")
    write("trace", "no-final-newline.trace", b"a,7,1024,3\nf,7")
    write("trace", "bad-free.trace", b"a,0,512,0\nf,1\n")
    write("trace", "truncated.trace.gz", gzip.compress(head.encode(), mtime=0)[:60])


def configs():
    apply_texts = [
        "frag_limit:2MiB,reuse_limit:2,defrag_level:0,auto_gc:8GiB,grow_stitch:true",
        "stitching:true,frag_limit:2MiB,reuse_limit:2,defrag_level:0,auto_gc:1000GiB,grow_stitch:true,"
        "small_limit:1MiB,small_segment:2MiB,round_to:512,chunk_size:0,max_handle:0,memory_limit:0,"
        "stitch_reserve:2",
        " small_limit : 0.5 MB , round_to:4096,, max_handle:64M,min_handles:4,event_interval_us:0,",
        "memory_limit:1.25TiB,chunk_size:2097152,stitch_reserve:1.5,reuse_limit:1e1",
        "frag_limit:18446744073709551615,auto_gc:16777215T",
        "stitching:off,grow_stitch:YES,defrag_level:2",
    ]
    for i, text in enumerate(apply_texts):
        write("config", f"apply-{i}", b"\x00" + text.encode())
    env_sets = [
        ["1", "1073741824", "10", "0", "1000", "0", ""],
        ["0", "", "2.5", "2", "8", "1", "frag_limit:64MiB"],
        ["", "", "", "", "", "", "reuse_limit:1,defrag_level:1"],
        ["1", "0", "1", "1", "18446744073", "1", "auto_gc:1GiB"],
    ]
    for i, values in enumerate(env_sets):
        write("config", f"env-{i}", b"\x01" + "\n".join(values).encode())


def alloc_ops():
    rng = random.Random(20261201)
    for which in range(8):
        for variant in range(2):
            data = bytearray([which, rng.randrange(256), rng.randrange(256)])
            for _ in range(120 if variant == 0 else 40):
                op = rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15])
                data.append((rng.randrange(16) << 4) | op)
                if op <= 5:
                    # small mostly; mid, large and (variant 1) absurd now and then
                    cls = rng.choice([0] * 8 + [11, 12, 14] + ([15] if variant else []))
                    data += bytes([cls, rng.randrange(256), rng.randrange(256)])
                elif op in (6, 7, 8, 9, 10, 12):
                    data.append(rng.randrange(256))
            write("alloc_ops", f"mix-{which}-{variant}", bytes(data))


def snapshots():
    def alloc(addr, size, stream=0, action="alloc"):
        return {"action": action, "addr": addr, "size": size, "stream": stream, "frames": []}

    base = 0x7F0000000000
    small = {
        "segments": [{"device": 0, "address": base, "total_size": 2 << 20, "stream": 0,
                      "blocks": [{"address": base, "size": 512, "state": "active_allocated",
                                  "requested_size": 500}]}],
        "device_traces": [[
            alloc(base, 2 << 20, action="segment_alloc"),
            alloc(base + 512, 1000), alloc(base + 2048, 4096, 7),
            alloc(base + 512, 1000, action="free_requested"),
            alloc(base + 512, 1000, action="free_completed"),
            {"action": "snapshot"}, alloc(base + 8192, 100, action="oom"),
            alloc(base + 4 << 20, 20 << 20, action="segment_map"),
            alloc(base + 4 << 20, 20 << 20, action="segment_unmap"),
            alloc(base + 2048, 4096, 7, action="free"),
        ]],
    }
    write("snapshot", "small.pickle", pickle.dumps(small, protocol=2))
    write("snapshot", "small.pickle.gz", gzip.compress(pickle.dumps(small, protocol=4), mtime=0))
    two = {"segments": [], "device_traces": [[alloc(base, 512)], [alloc(base, 1024, 3)]]}
    write("snapshot", "two-devices.pickle", pickle.dumps(two, protocol=3))
    write("snapshot", "not-a-dict.pickle", pickle.dumps([1, 2, 3]))
    write("snapshot", "empty.pickle", pickle.dumps({"device_traces": []}))


def main():
    traces()
    configs()
    alloc_ops()
    snapshots()
    return 0


if __name__ == "__main__":
    sys.exit(main())
