"""AdamW's optimizer states offloaded to host memory between steps, three ways, on one GPU:

  gpu    the states stay on the GPU (the baseline);
  glake  the states are tensors over glake movable buffers (glake_torch.movable_empty): after
         each step they are offloaded (glake_torch.offload, on a side stream, from a helper
         thread so the next forward runs meanwhile), and prefetched back during the backward pass
         (glake_torch.prefetch from a gradient hook, once backward has freed more activation
         memory than the states need); the tensors and their data_ptr() never change;
  copy   copy-based CPU offload, what frameworks do: after each step the states are copied into
         pinned host tensors (non_blocking, side stream) and the GPU tensors freed
         (record_stream); during the backward pass new GPU tensors are allocated, the states
         copied back and swapped into optimizer.state.

The model is a stack of `--layers` Linear(hidden, hidden) + GELU in fp32, run under bf16 autocast,
one batch of `--tokens` rows per step, so the forward pass is long enough to hide the offload and
the backward pass the prefetch. glake (integrations/torch) is PyTorch's allocator in every variant,
so the variants differ only in where the states are. Only states of parameters with at least
2^20 elements move (the weights; the biases' states stay, as in the copy variant).

Pacing (--pace 1, the default): a forward pre-hook launches layer i only once layer i's states
have left the device. Kernel launches run far ahead of the GPU, and the allocator serves at launch
time, so without pacing every activation is allocated before the offload has freed anything and
the peak barely moves (--pace 0 shows it).

Per step: wall time between the ends of two steps (host time after the step's kernels completed);
device memory in use (cudaMemGetInfo: total - free) sampled at the moments that make the peak: the
end of the forward pass, right after the prefetch is issued, before and after optimizer.step().
Each variant runs in a process of its own; --rounds runs every variant that many times, the order
reversed every other round, one JSON line per run on stdout, then a table.

    python3 bench/torch/offload_states.py [--library build/torch/libglake_torch.so] [--steps 30]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
VARIANTS = ("gpu", "glake", "copy")


def child(args):
    sys.path.insert(0, os.path.join(ROOT, "integrations", "torch"))
    import glake_torch

    glake_torch.enable(library=args.library)
    import torch

    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    blocks = []
    for _ in range(args.layers):
        blocks += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU()]
    model = torch.nn.Sequential(*blocks).to(device)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    moving = [p for p in params if p.numel() >= (1 << 20)]
    state_bytes = sum(2 * p.numel() * p.element_size() for p in moving)
    for p in params:
        st = opt.state[p]
        st["step"] = torch.tensor(0.0)
        for key in ("exp_avg", "exp_avg_sq"):
            if args.variant == "glake" and p.numel() >= (1 << 20):
                st[key] = glake_torch.movable_empty(tuple(p.shape), dtype=p.dtype, device=device).zero_()
            else:
                st[key] = torch.zeros_like(p)
    x = torch.randn(args.tokens, args.hidden, device=device)
    y = torch.randn(args.tokens, args.hidden, device=device)
    side = torch.cuda.Stream(device)
    main = torch.cuda.current_stream(device)
    pinned = {}
    if args.variant == "copy":
        for p in moving:
            pinned[p] = {k: torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for k in ("exp_avg", "exp_avg_sq")}

    def used():
        free, total = torch.cuda.mem_get_info(device)
        return total - free

    samples = []
    offloader = None
    # Pacing: the forward pass of layer i is launched only once the states of layer i have left
    # the device (progress counts moved parameters, in layer order), so the activations it
    # allocates take the place of states already gone instead of adding to them. Launches run
    # ahead of the GPU, so without it every activation would be allocated before any state left.
    progress = {"moved": len(moving), "events": []}
    moved = threading.Condition()
    layer_of = {}
    for index, p in enumerate(moving):
        layer_of[p] = index

    def offload_states():
        side.wait_stream(main)
        with moved:
            progress["moved"] = 0
        if args.variant == "glake":
            def run():
                for p in moving:
                    glake_torch.offload([opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]], stream=side)
                    with moved:
                        progress["moved"] += 1
                        moved.notify_all()
            thread = threading.Thread(target=run)
            thread.start()
            return thread
        if args.variant == "copy":
            progress["events"] = []
            with torch.cuda.stream(side):
                for p in moving:
                    for k in ("exp_avg", "exp_avg_sq"):
                        t = opt.state[p][k]
                        pinned[p][k].copy_(t, non_blocking=True)
                        t.record_stream(side)
                        opt.state[p][k] = None
                    event = torch.cuda.Event()
                    event.record(side)
                    progress["events"].append(event)
        return None

    def wait_for_layer(index):
        if args.variant == "glake":
            with moved:
                moved.wait_for(lambda: progress["moved"] > index)
        elif args.variant == "copy" and index < len(progress["events"]):
            progress["events"][index].synchronize()

    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    if args.variant != "gpu" and args.pace:
        for i, m in enumerate(linears):
            m.register_forward_pre_hook(lambda module, inputs, i=i: wait_for_layer(i))

    def prefetch_states():
        nonlocal offloader
        if offloader is not None:
            offloader.join()
            offloader = None
        if args.variant == "glake":
            # From a helper thread: prefetch waits for the stream's earlier copies before each
            # buffer, which must not hold up the backward pass that called this hook.
            states = [opt.state[p][k] for p in moving for k in ("exp_avg", "exp_avg_sq")]
            offloader = threading.Thread(target=glake_torch.prefetch, args=(states,), kwargs={"stream": side})
            offloader.start()
        elif args.variant == "copy":
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for p in moving:
                    for k in ("exp_avg", "exp_avg_sq"):
                        t = torch.empty(p.shape, dtype=p.dtype, device=device)
                        t.copy_(pinned[p][k], non_blocking=True)
                        opt.state[p][k] = t
        samples.append(("prefetched", used()))

    # The prefetch starts when backward reaches the output of layer `hook_layer` from the top:
    # by then the activations of the layers above it are freed.
    hook_layer = max(1, args.layers - args.prefetch_after)
    losses, times, peaks = [], [], []
    for step in range(args.warmup + args.steps):
        samples.clear()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = x
            for i, layer in enumerate(model):
                h = layer(h)
                if args.variant != "gpu" and i == 2 * hook_layer - 1 and h.requires_grad:
                    h.register_hook(lambda grad: (prefetch_states(), None)[1])
            loss = torch.nn.functional.mse_loss(h.float(), y)
        samples.append(("forward", used()))
        loss.backward()
        if offloader is not None:  # the prefetch thread has queued every copy
            offloader.join()
            offloader = None
        main.wait_stream(side)
        samples.append(("before step", used()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        main.synchronize()
        samples.append(("after step", used()))
        if args.variant != "gpu":
            offloader = offload_states()
        if step > 0:
            times.append(time.perf_counter() - last_end)
        last_end = time.perf_counter()
        losses.append(loss.item())
        peaks.append(max(v for _, v in samples))
    if offloader is not None:
        offloader.join()
    torch.cuda.synchronize()
    kept = times[args.warmup - 1:] if args.warmup > 0 else times
    out = {
        "variant": args.variant,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "layers": args.layers,
        "hidden": args.hidden,
        "tokens": args.tokens,
        "state_bytes": state_bytes,
        "step_s": kept,
        "median_step_s": statistics.median(kept),
        "peak_used_bytes": max(peaks[args.warmup:]),
        "peak_used_at": max(samples, key=lambda s: s[1])[0],
        "glake_peak_reserved_bytes": glake_torch.stats()["peak_reserved_bytes"],
        "losses": losses,
        "movable": glake_torch.movable_stats(),
    }
    print(json.dumps(out))


def summarize(runs):
    by = {}
    for r in runs:
        by.setdefault(r["variant"], []).append(r)
    gpu = by.get("gpu")
    base_step = statistics.median([t for r in gpu for t in r["step_s"]]) if gpu else None
    base_peak = max(r["peak_used_bytes"] for r in gpu) if gpu else None
    base_losses = gpu[0]["losses"] if gpu else None
    print("\n| variant | steps | step time median ms (p10-p90) | vs gpu | peak in use GiB | saved GiB (states %.2f GiB) | max loss difference vs gpu |"
          % (runs[0]["state_bytes"] / 2**30))
    print("|---|---|---|---|---|---|---|")
    for v in VARIANTS:
        if v not in by:
            continue
        ts = sorted(t for r in by[v] for t in r["step_s"])
        med = statistics.median(ts)
        p10, p90 = ts[int(0.1 * (len(ts) - 1))], ts[int(0.9 * (len(ts) - 1))]
        peak = max(r["peak_used_bytes"] for r in by[v])
        diff = max(abs(a - b) for a, b in zip(by[v][0]["losses"], base_losses)) if base_losses else float("nan")
        print(f"| {v} | {len(ts)} | {med * 1e3:.1f} ({p10 * 1e3:.1f}-{p90 * 1e3:.1f}) | "
              f"{med / base_step:.3f} | {peak / 2**30:.2f} | {(base_peak - peak) / 2**30:.2f} | {diff:.3g} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=VARIANTS, help="run one variant in this process (the driver's child)")
    ap.add_argument("--library", default=None, help="libglake_torch.so (default: what glake_torch finds)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="runs per variant, order reversed every other round")
    ap.add_argument("--prefetch-after", type=int, default=4, help="layers of backward before the prefetch starts")
    ap.add_argument("--pace", type=int, default=1, help="1: launch layer i's forward once layer i's states left (see the code)")
    args = ap.parse_args()
    if args.variant:
        child(args)
        return
    runs = []
    for r in range(args.rounds):
        order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
        for v in order:
            cmd = [sys.executable, os.path.abspath(__file__), "--variant", v, "--layers", str(args.layers),
                   "--hidden", str(args.hidden), "--tokens", str(args.tokens), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--prefetch-after", str(args.prefetch_after),
                   "--pace", str(args.pace)]
            if args.library:
                cmd += ["--library", args.library]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                print(json.dumps({"variant": v, "round": r, "error": done.stderr[-3000:]}))
                continue
            line = done.stdout.strip().splitlines()[-1]
            print(line, flush=True)
            runs.append(json.loads(line))
    if runs:
        summarize(runs)


if __name__ == "__main__":
    main()
