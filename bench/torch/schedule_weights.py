#!/usr/bin/env python3
"""A model whose weights exceed a device budget, run with glake_torch.Scheduler: the weights move
to host memory and back under the same pointers, planned from the first iteration, so that at most
--fraction of them are on the device at once.

The model: `--layers` Linear(hidden, hidden, bias=False) + GELU in bf16, `--tokens` rows per step;
a step is a forward pass (`--mode infer`) or a forward and backward pass without an optimizer
(`--mode train`: the weights' gradients are produced and dropped). Variants, each in a process of
its own with glake as PyTorch's allocator:

  gpu    every weight stays on the device (the baseline);
  glake  Scheduler(budget = fraction x weights).attach(model): each layer's pre-hooks bring its
         weight in, the plan prefetches ahead and offloads the furthest next use; every move
         returns once the memory moved (moves="wait");
  glake-deferred  the same with moves="deferred": a move queues its copies and returns, the
         memory is remapped once they are done, and a layer's pre-hook waits only for the moves
         of its own weight.
  glake-overlapped  moves="overlapped": deferred, the copies on the scheduler's two copy streams
         (after the work queued before the move), so that they run beside the layers' compute.
  glake-read-only  glake-overlapped with every weight managed read-only (attach(read_only="all"):
         nothing writes them here): once a weight has been away and back, its host copy is kept
         and its offloads copy nothing.

Training only, the other ways of lowering a step's peak, all weights on the device:

  save_on_cpu  the forward pass under torch.autograd.graph.save_on_cpu(pin_memory=True): the
         activations saved for the backward pass go to pinned host memory and come back;
  recompute    every layer (Linear + GELU) checkpointed (torch.utils.checkpoint, non-reentrant):
         only the layers' inputs are kept, each layer runs again in the backward pass;
  glake-recompute  recompute with glake-overlapped's scheduler (the recomputation's forward
         pre-hooks bring each layer's weight in before its backward; iterations begun by hand).

Every variant checks its result: the sum of one forward pass's output (and, training, of the
first layer's weight gradient) after the timed steps, which must equal the baseline's (to 1e-4).

Per variant: step time (median and p10-p90 of --steps steps after --warmup), the allocator's host
time in driver calls per step by kind (glake_torch.stats; far memory's own calls are not in it),
the weights' bytes on the device at most (the scheduler's peak_device_bytes; the baseline: all of them), device memory in
use at the end of each step (cudaMemGetInfo), the allocator's peak over the timed steps (bytes
requested and bytes of device memory held: glake_torch.stats after reset_peak_stats), the scheduler's counters, and the compute/transfer
ratio of one layer (its forward time on the device against copying its weight at the bus speed
measured here). Output: one JSON line per run, rounds alternating the variants' order, then a
table.

    python3 bench/torch/schedule_weights.py --library build/torch/libglake_torch.so \\
        --fraction 0.6 --rounds 3

GLAKE_ALLOC_CONF applies to every variant (glake is PyTorch's allocator in all of them); e.g.
max_handle:64MiB,min_handles:1 gives each 128 MiB weight two handles instead of sixteen.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "integrations", "torch"))
GiB = 1 << 30


def child(args):
    import glake_torch

    glake_torch.enable(library=args.library)
    import torch

    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.hidden, args.hidden, bias=False) for _ in range(args.layers)]
    blocks = []
    for layer in layers:
        blocks += [layer, torch.nn.GELU()]
    model = torch.nn.Sequential(*blocks).to("cuda", torch.bfloat16)
    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16,
                    requires_grad=args.mode == "train")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    # One layer's compute against moving its weight, on this machine.
    w = layers[0].weight
    host = torch.empty(w.shape, dtype=w.dtype, pin_memory=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(5):
        host.copy_(w, non_blocking=True)
    end.record()
    torch.cuda.synchronize()
    copy_ms = start.elapsed_time(end) / 5
    with torch.no_grad():
        layers[0](x)
        start.record()
        for _ in range(5):
            layers[0](x)
        end.record()
    torch.cuda.synchronize()
    layer_ms = start.elapsed_time(end) / 5
    del host

    scheduler = None
    recompute = args.variant in ("recompute", "glake-recompute")
    if args.variant.startswith("glake"):
        moves = {"glake": "wait", "glake-deferred": "deferred", "glake-overlapped": "overlapped",
                 "glake-recompute": "overlapped", "glake-read-only": "overlapped"}[args.variant]
        scheduler = glake_torch.Scheduler(int(args.fraction * weight_bytes), name="schedule_weights", moves=moves)
        scheduler.attach(model, backward="outputs" if recompute else True,
                         read_only="all" if args.variant == "glake-read-only" else None)

    def forward():
        if recompute:
            from torch.utils.checkpoint import checkpoint_sequential

            if scheduler is not None:  # checkpoint_sequential calls the layers, not the model's pre-hook
                scheduler.iteration_begin()
            return checkpoint_sequential(model, args.layers, x, use_reentrant=False)
        if args.variant == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                return model(x)
        return model(x)

    def step():
        if args.mode == "train":
            out = forward()
            out.float().sum().backward()
            for p in model.parameters():
                p.grad = None
            x.grad = None
        else:
            with torch.no_grad():
                model(x)

    times, in_use = [], []
    kinds = ("create", "release", "reserve", "address_free", "map", "unmap", "set_access")
    driver_before = None
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            driver_before = glake_torch.stats()
            glake_torch.reset_peak_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
            free, total = torch.cuda.mem_get_info()
            in_use.append(total - free)
    driver_after = glake_torch.stats()
    peaks = {"peak_requested_gib": driver_after["peak_active_bytes"] / GiB,
             "peak_held_gib": driver_after["peak_reserved_bytes"] / GiB}
    # The allocator's host time in driver calls per timed step, by kind (ms): what the moves cost
    # the launching thread besides their copies.
    driver_ms = {k: (driver_after[f"driver_{k}_ns"] - driver_before[f"driver_{k}_ns"]) / 1e6 / args.steps
                 for k in kinds}
    times.sort()
    # The result, to compare with the baseline's: a wrong weight anywhere changes it.
    if args.mode == "train":
        out = forward()
        out.float().sum().backward()
        check = [out.float().sum().item(), layers[0].weight.grad.float().sum().item()]
        for p in model.parameters():
            p.grad = None
        x.grad = None
    else:
        with torch.no_grad():
            check = [model(x).float().sum().item()]
    torch.cuda.synchronize()
    report = {
        "check": check,
        "variant": args.variant, "mode": args.mode, "fraction": args.fraction, "layers": args.layers,
        "hidden": args.hidden, "tokens": args.tokens, "weight_gib": weight_bytes / GiB,
        "step_ms": statistics.median(times), "p10_ms": times[len(times) // 10], "p90_ms": times[len(times) * 9 // 10],
        "in_use_gib": max(in_use) / GiB, "layer_ms": layer_ms, "weight_copy_ms": copy_ms,
        "compute_per_transfer": layer_ms / copy_ms,
        "driver_ms_per_step": driver_ms, "driver_ms_per_step_total": sum(driver_ms.values()),
        "alloc_conf": os.environ.get("GLAKE_ALLOC_CONF"), **peaks,
    }
    if scheduler is not None:
        s = scheduler.stats()
        report["weights_on_device_gib"] = s["peak_device_bytes"] / GiB
        report["scheduler"] = s
        report["far_copy_gib"] = glake_torch.far_copy_bytes() / GiB
        scheduler.close()
    else:
        report["weights_on_device_gib"] = weight_bytes / GiB
    print(json.dumps(report), flush=True)


def close(a, b):
    """Equal results to 1e-4 (relative): a kernel may reduce in another order; a wrong weight
    moves the sums by far more."""
    return len(a) == len(b) and all(abs(x - y) <= 1e-4 * max(abs(x), abs(y), 1.0) for x, y in zip(a, b))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--library", required=True)
    ap.add_argument("--variants", default="gpu,glake,glake-deferred,glake-overlapped")
    ap.add_argument("--mode", choices=("infer", "train"), default="train")
    ap.add_argument("--fraction", type=float, default=0.6)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        return child(args)
    variants = args.variants.split(",")
    runs = []
    for r in range(args.rounds):
        for v in (variants if r % 2 == 0 else list(reversed(variants))):
            passed = []  # this script's arguments but --variants and its value
            skip = False
            for a in sys.argv[1:]:
                if skip:
                    skip = False
                elif a == "--variants":
                    skip = True
                elif not a.startswith("--variants="):
                    passed.append(a)
            cmd = [sys.executable, os.path.abspath(__file__), "--variant", v] + passed
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                print(json.dumps({"variant": v, "round": r, "error": done.stderr[-2000:]}), flush=True)
                continue
            run = json.loads(done.stdout.strip().splitlines()[-1])
            run["round"] = r
            runs.append(run)
            print(json.dumps(run), flush=True)
    print("\n| variant | step ms, median of rounds' medians | vs gpu | weights on device GiB | in use GiB | "
          "peak requested GiB | peak held GiB | compute/transfer | result as gpu's | driver ms a step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = [r["step_ms"] for r in runs if r["variant"] == "gpu"]
    base_check = next((r["check"] for r in runs if r["variant"] == "gpu"), None)
    for v in variants:
        mine = [r for r in runs if r["variant"] == v]
        if not mine:
            continue
        ms = statistics.median(r["step_ms"] for r in mine)
        ratio = ms / statistics.median(base) if base else float("nan")
        same = "-" if base_check is None else ("yes" if all(close(r["check"], base_check) for r in mine) else "NO")
        print(f"| {v} | {ms:.1f} | {ratio:.3f} | {max(r['weights_on_device_gib'] for r in mine):.2f} | "
              f"{max(r['in_use_gib'] for r in mine):.2f} | {max(r['peak_requested_gib'] for r in mine):.2f} | "
              f"{max(r['peak_held_gib'] for r in mine):.2f} | {mine[0]['compute_per_transfer']:.2f} | {same} | "
              f"{statistics.median(r['driver_ms_per_step_total'] for r in mine):.1f} |")


if __name__ == "__main__":
    main()
