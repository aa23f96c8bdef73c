"""Host time per allocator call over a recorded training trace, on the GPU, one allocator a process:

    python3 bench/torch/trace_host_cost.py default    [--passes 5] TRACE...
    python3 bench/torch/trace_host_cost.py expandable [--passes 5] TRACE...
    python3 bench/torch/trace_host_cost.py glake      [--passes 5] TRACE...

Replays a trace's a/f lines (traces/README.md's format; one stream) through the process's current
CUDA allocator with torch.cuda.caching_allocator_alloc / caching_allocator_delete, the same entry
points for PyTorch's own allocator and for glake's plug-in. Pass 1 starts from an empty allocator
(it pays for the driver calls that build the cache); passes 2..N repeat the trace on the warm
cache. Every pass also runs the same loop with do-nothing callables; subtracting that leaves the
allocator's share (the binding into C++ included). Prints one JSON object per trace: ns per call
per pass, raw and net of the loop; pass 1's steady part (the calls after the first 40% of the
trace, where a training run has built its cache and repeats steps); and the best warm pass.
The steady part is the one that compares with a training run's later steps: a warm pass replays
the trace's first steps over a cache built for its last ones, which no training run does.
No kernel runs: this is the allocator's host time alone, the part of a host-bound training step
that the allocator adds.
"""
import argparse
import gzip
import json
import os
import sys
import time

ALLOCATORS = ("default", "expandable", "glake")


def read_ops(path):
    """The trace's requests as (is_alloc, id, bytes) tuples; S/U lines and comments skipped.
    Raises ValueError on a line it cannot read, naming the file and line."""
    opener = gzip.open if path.endswith(".gz") else open
    ops = []
    with opener(path, "rt") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line or line[0] in "#SU":
                continue
            fields = line.split(",")
            try:
                if fields[0] == "a" and len(fields) >= 3:
                    ops.append((True, int(fields[1]), int(fields[2])))
                elif fields[0] == "f" and len(fields) == 2:
                    ops.append((False, int(fields[1]), 0))
                else:
                    raise ValueError("not an a/f/S/U line")
            except ValueError as error:
                raise ValueError(f"{path}:{number}: {error}: {line[:80]!r}") from None
    return ops


STEADY_FROM = 0.4  # the share of a trace after which a run is in its steady state


def one_pass(ops, alloc, delete):
    """Runs `ops` through alloc(bytes) -> pointer and delete(pointer); returns (seconds, steady
    seconds, live): the time of all calls, the time of the calls from STEADY_FROM of the trace on,
    and the pointers still live at the end, which the caller frees outside the timed part. A free
    of an id never allocated raises KeyError."""
    live = {}
    split = int(len(ops) * STEADY_FROM)
    begin = time.perf_counter()
    for is_alloc, ident, size in ops[:split]:
        if is_alloc:
            live[ident] = alloc(size)
        else:
            delete(live.pop(ident))
    middle = time.perf_counter()
    for is_alloc, ident, size in ops[split:]:
        if is_alloc:
            live[ident] = alloc(size)
        else:
            delete(live.pop(ident))
    end = time.perf_counter()
    return end - begin, end - middle, live


def measure(ops, alloc, delete, passes):
    """Per pass: ns per call through alloc/delete and through do-nothing callables, over the
    whole trace and over its steady part (from STEADY_FROM on)."""
    calls = len(ops)
    steady_calls = max(1, calls - int(calls * STEADY_FROM))
    rows = []
    for _ in range(passes):
        seconds, steady, live = one_pass(ops, alloc, delete)
        for pointer in live.values():
            delete(pointer)
        null_seconds, null_steady, _ = one_pass(ops, lambda size: size, lambda pointer: None)
        rows.append({"ns_per_call": seconds / calls * 1e9, "loop_ns_per_call": null_seconds / calls * 1e9,
                     "steady_ns_per_call": steady / steady_calls * 1e9,
                     "steady_loop_ns_per_call": null_steady / steady_calls * 1e9})
    for row in rows:
        row["net_ns_per_call"] = row["ns_per_call"] - row["loop_ns_per_call"]
        row["steady_net_ns_per_call"] = row["steady_ns_per_call"] - row["steady_loop_ns_per_call"]
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("allocator", choices=ALLOCATORS)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--passes", type=int, default=5, help="passes over each trace (default 5, at least 2)")
    args = parser.parse_args(argv)
    if args.passes < 2:
        parser.error("--passes must be at least 2 (pass 1 is the cold one)")
    if args.allocator == "expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if args.allocator == "glake":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "integrations", "torch"))
        import glake_torch

        glake_torch.enable()
    import torch

    torch.cuda.init()
    device = torch.cuda.current_device()
    stream = torch.cuda.current_stream(device)
    raw_alloc, raw_delete = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete

    def alloc(size):
        return raw_alloc(size, device, stream)

    for path in args.traces:
        ops = read_ops(path)
        rows = measure(ops, alloc, raw_delete, args.passes)
        torch.cuda.empty_cache()
        warm = min(rows[1:], key=lambda r: r["net_ns_per_call"])
        print(json.dumps({
            "trace": os.path.basename(path), "allocator": args.allocator, "calls": len(ops),
            "cold_net_ns_per_call": round(rows[0]["net_ns_per_call"], 1),
            "steady_net_ns_per_call": round(rows[0]["steady_net_ns_per_call"], 1),
            "warm_net_ns_per_call": round(warm["net_ns_per_call"], 1),
            "warm_ns_per_call": round(warm["ns_per_call"], 1),
            "passes": [{k: round(v, 1) for k, v in r.items()} for r in rows],
            "gpu": torch.cuda.get_device_name(device), "torch_version": torch.__version__,
            "alloc_conf": os.environ.get("GLAKE_ALLOC_CONF" if args.allocator == "glake" else "PYTORCH_CUDA_ALLOC_CONF", ""),
        }), flush=True)


if __name__ == "__main__":
    main()
