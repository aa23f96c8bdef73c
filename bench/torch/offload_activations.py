"""Activations of the forward pass offloaded to host memory and brought back for the backward
pass, on one GPU, three ways:

  none   activations stay on the GPU (the baseline);
  glake  the first --offload-layers blocks run inside glake_torch.movable_allocations(), so the
         tensors they save for backward sit on movable buffers; once the next blocks have been
         launched, a helper thread offloads them on a side stream (the tensors and their
         data_ptr() stay); during backward, a gradient hook four blocks above prefetches them
         back on the side stream, and the unpack hook makes the compute stream wait for it;
  cpu    torch.autograd.graph.save_on_cpu(pin_memory=True) around the same blocks (PyTorch's own
         way: each saved tensor copied to pinned host memory when saved, copied back when used).

Blocks are Linear(hidden, hidden) + GELU in fp32 under bf16 autocast (each saves two bf16 tensors
of tokens x hidden), --layers of them, one batch of --tokens rows. glake (integrations/torch) is
PyTorch's allocator in every variant. Pacing (glake): block i is launched only once the offload
of block i-d's tensors has completed (d: --pace-depth, 3), so the memory it allocates takes their place (launches
otherwise run ahead of the GPU and allocate everything first).

Per step: wall time between the ends of two steps; device memory in use (cudaMemGetInfo: total -
free) at the end of the forward pass (the peak). Each variant in a process of its own; --rounds
runs every variant that many times, order reversed every other round; one JSON line per run,
then a table. Losses must equal the baseline's.

    python3 bench/torch/offload_activations.py [--library build/torch/libglake_torch.so] [--steps 20]
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
VARIANTS = ("none", "glake", "cpu")


def child(args):
    sys.path.insert(0, os.path.join(ROOT, "integrations", "torch"))
    import glake_torch

    glake_torch.enable(library=args.library)
    import torch

    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU()) for _ in range(args.layers)]
    model = torch.nn.Sequential(*blocks).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(args.tokens, args.hidden, device=device)
    y = torch.randn(args.tokens, args.hidden, device=device)
    main = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    threshold = args.tokens * args.hidden  # bytes of one bf16 activation / 2: the saved tensors, not small ones

    def used():
        free, total = torch.cuda.mem_get_info(device)
        return total - free

    # glake's bookkeeping for one step: saved tensors per block, offload and prefetch threads.
    saved = [[] for _ in range(args.layers)]
    offloads = [None] * args.layers
    prefetches = [None] * args.layers
    current = {"block": -1}

    def pack(t):
        b = current["block"]
        if 0 <= b < args.offload_layers and glake_torch.residence(t) == "device":
            if all(s.data_ptr() != t.data_ptr() for s in saved[b]):
                saved[b].append(t)
        return t

    def unpack(t):
        for b in range(args.offload_layers):
            if any(s.data_ptr() == t.data_ptr() for s in saved[b]):
                if prefetches[b] is None:  # no hook fired (a block near the top): prefetch now
                    prefetch_block(b)
                prefetches[b].join()
                torch.cuda.current_stream(device).wait_stream(side)
                break
        return t

    def offload_block(b):
        side.wait_stream(main)  # the blocks using them have been launched before this point
        tensors = list(saved[b])
        thread = threading.Thread(target=glake_torch.offload, args=(tensors,), kwargs={"stream": side})
        thread.start()
        offloads[b] = thread

    def prefetch_block(b):
        if prefetches[b] is not None:
            return
        if offloads[b] is not None:
            offloads[b].join()
        tensors = list(saved[b])
        thread = threading.Thread(target=glake_torch.prefetch, args=(tensors,), kwargs={"stream": side})
        thread.start()
        prefetches[b] = thread

    losses, times, peaks = [], [], []
    last_end = None
    for step in range(args.warmup + args.steps):
        for b in range(args.layers):
            saved[b].clear()
            offloads[b] = prefetches[b] = None
        h = x
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if args.variant == "glake":
                with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                    for b, block in enumerate(model):
                        d = args.pace_depth
                        if b >= d and b - d < args.offload_layers and offloads[b - d] is not None:
                            offloads[b - d].join()  # pacing: block b-d's tensors have left
                        current["block"] = b
                        scope = glake_torch.movable_allocations(threshold) if b < args.offload_layers else contextlib.nullcontext()
                        with scope:
                            h = block(h)
                        a = args.prefetch_ahead
                        if 0 <= b - a < args.offload_layers:
                            # The gradient of block b's output is computed by block b+1's
                            # backward: then block b-a's tensors start coming back, some `a`
                            # blocks of backward before they are used.
                            h.register_hook(lambda g, b=b - a: (prefetch_block(b), None)[1])
                        if b >= 1 and b - 1 < args.offload_layers:
                            offload_block(b - 1)
                        current["block"] = -1
                    if args.offload_layers >= args.layers:
                        offload_block(args.layers - 1)
            elif args.variant == "cpu":
                for b, block in enumerate(model):
                    scope = torch.autograd.graph.save_on_cpu(pin_memory=True) if b < args.offload_layers else contextlib.nullcontext()
                    with scope:
                        h = block(h)
            else:
                h = model(h)
            loss = torch.nn.functional.mse_loss(h.float(), y)
        peak = used()
        for t in offloads:
            if t is not None:
                t.join()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        main.synchronize()
        del h
        now = time.perf_counter()
        if last_end is not None and step >= args.warmup:
            times.append(now - last_end)
        last_end = now
        losses.append(loss.item())
        if step >= args.warmup:
            peaks.append(peak)
    offloaded = sum(2 * args.tokens * args.hidden * 2 for _ in range(args.offload_layers))
    print(json.dumps({
        "variant": args.variant,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "layers": args.layers,
        "offload_layers": args.offload_layers,
        "tokens": args.tokens,
        "hidden": args.hidden,
        "offloaded_bytes_per_step": offloaded,
        "step_s": times,
        "peak_used_bytes": max(peaks),
        "losses": losses,
        "movable": glake_torch.movable_stats(),
    }))


def summarize(runs):
    by = {}
    for r in runs:
        by.setdefault(r["variant"], []).append(r)
    base = by.get("none")
    base_step = statistics.median([t for r in base for t in r["step_s"]]) if base else None
    base_peak = max(r["peak_used_bytes"] for r in base) if base else None
    print("\n| variant | steps | step time median ms (p10-p90) | vs none | peak in use GiB | saved GiB (offloaded %.2f GiB) | max loss difference |"
          % (runs[0]["offloaded_bytes_per_step"] / 2**30))
    print("|---|---|---|---|---|---|---|")
    for v in VARIANTS:
        if v not in by:
            continue
        ts = sorted(t for r in by[v] for t in r["step_s"])
        med = statistics.median(ts)
        p10, p90 = ts[int(0.1 * (len(ts) - 1))], ts[int(0.9 * (len(ts) - 1))]
        peak = max(r["peak_used_bytes"] for r in by[v])
        diff = max(abs(a - b) for a, b in zip(by[v][0]["losses"], base[0]["losses"])) if base else float("nan")
        print(f"| {v} | {len(ts)} | {med * 1e3:.1f} ({p10 * 1e3:.1f}-{p90 * 1e3:.1f}) | {med / base_step:.3f} | "
              f"{peak / 2**30:.2f} | {(base_peak - peak) / 2**30:.2f} | {diff:.3g} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=VARIANTS, help="run one variant in this process (the driver's child)")
    ap.add_argument("--library", default=None)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--offload-layers", type=int, default=4, help="blocks (from the first) whose saved tensors move")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pace-depth", type=int, default=3, help="glake: block i waits for block i-d's offload")
    ap.add_argument("--prefetch-ahead", type=int, default=4, help="glake: blocks of backward before a block's prefetch")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="which variants to run, comma-separated")
    args = ap.parse_args()
    if args.variant:
        child(args)
        return
    runs = []
    for r in range(args.rounds):
        chosen = tuple(v for v in VARIANTS if v in args.variants.split(","))
        for v in (chosen if r % 2 == 0 else tuple(reversed(chosen))):
            cmd = [sys.executable, os.path.abspath(__file__), "--variant", v, "--layers", str(args.layers),
                   "--offload-layers", str(args.offload_layers), "--hidden", str(args.hidden), "--tokens",
                   str(args.tokens), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--pace-depth", str(args.pace_depth), "--prefetch-ahead", str(args.prefetch_ahead)]
            if args.library:
                cmd += ["--library", args.library]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                print(json.dumps({"variant": v, "round": r, "error": done.stderr[-3000:]}), flush=True)
                continue
            line = done.stdout.strip().splitlines()[-1]
            print(line, flush=True)
            runs.append(json.loads(line))
    if runs:
        summarize(runs)


if __name__ == "__main__":
    main()
