"""Saved activations away from the device during a training step of a Llama-shaped transformer
(transformers, random weights, bf16), four ways, at several settings:

  none            activations stay on the device (the baseline);
  glake:F         glake_torch.offload_activations(model.model.layers, fraction=F) around the
                  forward pass: the first blocks' saved tensors (F of their bytes) go to pinned
                  host memory on an offload stream, come back on a prefetch stream ahead of
                  backward;
  save_on_cpu[:F] torch.autograd.graph.save_on_cpu(pin_memory=True) around the whole forward
                  pass, or around the first F of the layers;
  recompute:F     torch.utils.checkpoint (non-reentrant) on F of the layers, every k-th (the
                  peak falls with the number of layers, not with which).

Each variant runs in a process of its own; --rounds runs every variant that many times, the order
reversed every other round. Per variant: --steps timed steps after --warmup (glake learns its plan
in the first step), step time with the device synchronized at each step's end (median, p10-p90),
the peak of torch.cuda.max_memory_allocated / max_memory_reserved (glake's own statistics with
--library) over the timed steps, and cudaMemGetInfo's memory in use sampled after the forward
pass, the backward pass and the optimizer step; every step's loss, compared with none's (the same
seed, data and weights: equal where the kernels are deterministic; "none" against itself across
rounds is the noise floor). One JSON line per run (also appended to --out), then tables.

    python3 bench/torch/activation_offload.py --quick                       # < 4 minutes on an H200
    python3 bench/torch/activation_offload.py [--model 1b|3b|8b] [--lora] [--library build/torch/libglake_torch.so]
    python3 bench/torch/activation_offload.py --device cpu                  # dry run, a tiny model
    python3 bench/torch/activation_offload.py --summarize FILE.jsonl        # the tables again
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# Llama-shaped presets: hidden, intermediate, layers, heads, kv heads, vocabulary.
MODELS = {
    "tiny": (256, 512, 6, 4, 2, 1000),       # the dry run
    "1b": (2048, 5632, 22, 32, 4, 32000),    # 1.1 B parameters (TinyLlama's shape)
    "3b": (3072, 8192, 28, 24, 8, 32000),    # 3.0 B (Llama 3.2 3B's, a 32k vocabulary)
    "8b": (4096, 14336, 32, 32, 8, 32000),   # 7.5 B (Llama 3 8B's, a 32k vocabulary)
}
DEFAULT_VARIANTS = "none,glake:0.25,glake:0.5,glake:0.75,save_on_cpu,save_on_cpu:0.5,recompute:0.25,recompute:0.5,recompute:0.75"
QUICK_VARIANTS = "none,glake:0.25,glake:0.5,save_on_cpu:0.5,recompute:0.25,recompute:0.5"


def parse_variant(text):
    kind, _, value = text.partition(":")
    if kind not in ("none", "glake", "save_on_cpu", "recompute"):
        raise ValueError(f"unknown variant {text!r}")
    fraction = float(value) if value else (None if kind == "none" else 1.0)
    return kind, fraction


def spaced(count, total):
    """`count` of `total` layer indices, evenly spaced (every k-th)."""
    if count <= 0:
        return []
    return sorted({min(total - 1, int(i * total / count)) for i in range(count)})


def child(args):
    sys.path.insert(0, os.path.join(ROOT, "integrations", "torch"))
    import glake_torch

    if args.library:
        glake_torch.enable(library=args.library)
    import contextlib
    import functools

    import torch
    import torch.utils.checkpoint
    from transformers import AutoModelForCausalLM, LlamaConfig

    kind, fraction = parse_variant(args.variant)
    cuda = args.device != "cpu"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    hidden, intermediate, layers, heads, kv_heads, vocab = MODELS[args.model]
    if args.layers:
        layers = args.layers
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         max_position_embeddings=args.seq, use_cache=False)
    torch.manual_seed(0)
    built = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.train()
    if args.lora:  # rank-r adapters on every attention and MLP projection; the base frozen
        model.requires_grad_(False)
        add_lora(torch, model, args.lora_rank)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, foreach=True)
    blocks = model.model.layers
    count = round((fraction or 0) * len(blocks))

    def wrap_layers(indices, around):
        for i in indices:
            forward = blocks[i].forward
            blocks[i].forward = functools.partial(around, forward)

    def checkpointed(forward, *a, **k):
        return torch.utils.checkpoint.checkpoint(forward, *a, use_reentrant=False, **k)

    def on_cpu(forward, *a, **k):
        with torch.autograd.graph.save_on_cpu(pin_memory=cuda):
            return forward(*a, **k)

    context = None
    whole = contextlib.nullcontext
    if kind == "glake":
        extra = {}
        if not cuda:  # the dry run: the module's synchronous test transport, small tensors move too
            from glake_torch import _activations
            extra = {"_transport": _activations._HostCopies(torch), "min_bytes": 1 << 12}
        context = glake_torch.offload_activations(blocks, fraction=fraction, **extra)
        whole = lambda: context  # noqa: E731
    elif kind == "save_on_cpu" and fraction >= 1.0:
        whole = lambda: torch.autograd.graph.save_on_cpu(pin_memory=cuda)  # noqa: E731
    elif kind == "save_on_cpu":
        wrap_layers(range(count), on_cpu)
    elif kind == "recompute":
        wrap_layers(spaced(count, len(blocks)), checkpointed)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=generator).to(device)
    if cuda:
        torch.cuda.synchronize()
    built = time.perf_counter() - built

    def synchronize():
        if cuda:
            torch.cuda.synchronize()

    def in_use():
        if not cuda:
            return 0
        free, total = torch.cuda.mem_get_info(device)
        return total - free

    def peaks():
        if not cuda:
            return 0, 0
        if glake_torch.enabled() and glake_torch.backend() != "native":
            return glake_torch.max_memory_allocated(0), glake_torch.max_memory_reserved(0)
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)

    def reset_peaks():
        if not cuda:
            return
        if glake_torch.enabled() and glake_torch.backend() != "native":
            glake_torch.reset_peak_stats(0)
        else:
            torch.cuda.reset_peak_memory_stats(device)

    losses, times, used = [], [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            synchronize()
            reset_peaks()
        start = time.perf_counter()
        with whole():
            loss = model(input_ids=ids, labels=ids).loss
        samples = [in_use()]
        loss.backward()
        samples.append(in_use())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        samples.append(in_use())
        losses.append(loss.item())
        del loss
        synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            used.append(max(samples))
    allocated, reserved = peaks()
    out = {
        "variant": args.variant, "model": args.model, "layers": len(blocks), "lora": args.lora,
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in trainable), "batch": args.batch, "seq": args.seq,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
        "allocator": ("glake " + glake_torch.backend()) if glake_torch.enabled() else "pytorch",
        "build_s": built, "step_s": times, "losses": losses, "round": args.round,
        "peak_allocated_bytes": allocated, "peak_reserved_bytes": reserved,
        "peak_used_bytes": max(used) if used else 0,
        "layers_changed": count if kind in ("save_on_cpu", "recompute") else None,
    }
    if context is not None:
        stats = context.stats()
        plan = stats.pop("plan") or []
        units = stats.pop("units")
        stats["activation_bytes"] = sum(units)
        stats["offloaded_bytes_per_step"] = sum(units[i] for i in plan if i < len(units))
        out["glake"] = stats
    print(json.dumps(out), flush=True)


def add_lora(torch, model, rank):
    class LoRA(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base
            self.a = torch.nn.Parameter(torch.randn(rank, base.in_features, dtype=base.weight.dtype,
                                                    device=base.weight.device) / math.sqrt(base.in_features))
            self.b = torch.nn.Parameter(torch.zeros(base.out_features, rank, dtype=base.weight.dtype,
                                                    device=base.weight.device))

        def forward(self, x):
            return self.base(x) + (x @ self.a.t()) @ self.b.t()

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child_module in list(parent.named_children()):
                if isinstance(child_module, torch.nn.Linear):
                    setattr(parent, name, LoRA(child_module))


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def summarize(runs):
    runs = [r for r in runs if "error" not in r]
    if not runs:
        print("no run finished")
        return
    by = {}
    for r in runs:
        by.setdefault(r["variant"], []).append(r)
    base = by.get("none")
    first = runs[0]
    print(f"\n{first['device']}, torch {first['torch']}, allocator {first['allocator']}; model {first['model']} "
          f"({first['parameters'] / 1e9:.2f} B parameters, {first['trainable'] / 1e9:.3f} B trainable"
          f"{', LoRA' if first['lora'] else ''}), {first['layers']} layers, batch {first['batch']} x {first['seq']} tokens")
    base_step = statistics.median([t for r in base for t in r["step_s"]]) if base else None
    base_alloc = max(r["peak_allocated_bytes"] for r in base) if base else None
    base_res = max(r["peak_reserved_bytes"] for r in base) if base else None
    GiB = 2 ** 30
    print("\n| variant | steps | step ms, median (p10-p90) | vs none | max allocated GiB | vs none | "
          "max reserved GiB | vs none | in use GiB (cudaMemGetInfo) | offloaded GiB/step | max loss difference vs none |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = {}
    for variant, rs in by.items():
        ts = [t for r in rs for t in r["step_s"]]
        med = statistics.median(ts)
        alloc = max(r["peak_allocated_bytes"] for r in rs)
        res = max(r["peak_reserved_bytes"] for r in rs)
        used = max(r["peak_used_bytes"] for r in rs)
        if base:
            pairs = [(a, b) for r in rs for b0 in base[:1] for a, b in zip(r["losses"], b0["losses"])]
            if variant == "none":  # against itself across rounds: the noise floor
                pairs = [(a, b) for r in rs[1:] for a, b in zip(r["losses"], rs[0]["losses"])]
            diff = max((abs(a - b) for a, b in pairs), default=float("nan"))
        else:
            diff = float("nan")
        off = rs[0].get("glake", {}).get("offloaded_bytes_per_step")
        rows[variant] = (med, alloc, res)
        ratio = lambda x, b: f"{x / b:.3f}" if b else "-"  # noqa: E731
        change = lambda x, b: f"{(x - b) / b * 100:+.1f}%" if b else "-"  # noqa: E731
        print(f"| {variant} | {len(ts)} | {med * 1e3:.1f} ({percentile(ts, 0.1) * 1e3:.1f}-{percentile(ts, 0.9) * 1e3:.1f}) | "
              f"{ratio(med, base_step)} | {alloc / GiB:.2f} | {change(alloc, base_alloc)} | {res / GiB:.2f} | "
              f"{change(res, base_res)} | {used / GiB:.2f} | {'-' if off is None else f'{off / GiB:.2f}'} | {diff:.3g} |")
    if not base or not base_res:
        return
    # At equal peak: each glake setting against the other ways, the step time of each interpolated
    # (linearly in reserved memory between its two nearest settings) at glake's reserved peak.
    others = {}
    for variant, (med, alloc, res) in rows.items():
        kind, _ = parse_variant(variant)
        if kind in ("save_on_cpu", "recompute"):
            others.setdefault(kind, []).append((res, med))
    others.setdefault("recompute", []).append((base_res, base_step))
    others.setdefault("save_on_cpu", []).append((base_res, base_step))
    print("\nAt glake's peak (max reserved), the others' step time interpolated between their settings:\n")
    print("| glake | reserved vs none | step vs none | save_on_cpu at that peak | recompute at that peak |")
    print("|---|---|---|---|---|")
    for variant, (med, alloc, res) in sorted(rows.items()):
        if parse_variant(variant)[0] != "glake":
            continue
        cells = []
        for kind in ("save_on_cpu", "recompute"):
            points = sorted(others.get(kind, []))
            below = [p for p in points if p[0] <= res]
            above = [p for p in points if p[0] >= res]
            if not below or not above:
                cells.append("out of range")
                continue
            (r0, t0), (r1, t1) = below[-1], above[0]
            t = t0 if r1 == r0 else t0 + (t1 - t0) * (res - r0) / (r1 - r0)
            cells.append(f"{t / base_step:.3f}")
        print(f"| {variant} | {(res - base_res) / base_res * 100:+.1f}% | {med / base_step:.3f} | {cells[0]} | {cells[1]} |")
    print("\nTargets: peak -20% at <= 1.02x step time, -40% at <= 1.10x (max reserved, against none):")
    for goal, limit in ((0.20, 1.02), (0.40, 1.10)):
        met = [v for v, (med, alloc, res) in rows.items() if parse_variant(v)[0] == "glake"
               and res <= (1 - goal) * base_res and med <= limit * base_step]
        print(f"  -{goal * 100:.0f}% at <= {limit:.2f}x: {'met by ' + ', '.join(sorted(met)) if met else 'not met'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", help="run one variant in this process (the driver's child)")
    ap.add_argument("--variants", default=None, help=f"comma-separated (default {DEFAULT_VARIANTS}; --quick: {QUICK_VARIANTS})")
    ap.add_argument("--model", choices=sorted(MODELS), default=None, help="Llama-shaped preset (1b; tiny on the cpu)")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    ap.add_argument("--lora", action="store_true", help="frozen base, rank-r adapters on every projection")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (4; 2 on the cpu)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (2048; 64 on the cpu)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per run (20; 3 on the cpu)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=None, help="runs of every variant (2; --quick and cpu: 1)")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_VARIANTS}, one round of 20 steps")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--library", default=None, help="libglake_torch.so: glake as PyTorch's allocator in every variant")
    ap.add_argument("--out", default=None, help="append each run's JSON line to this file")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--summarize", default=None, help="print the tables of a JSON-lines file and exit")
    args = ap.parse_args()
    cpu = args.device == "cpu"
    args.model = args.model or ("tiny" if cpu else "1b")
    args.batch = args.batch or (2 if cpu else 4)
    args.seq = args.seq or (64 if cpu else 2048)
    args.steps = args.steps or (3 if cpu else 20)
    args.rounds = args.rounds or (1 if cpu or args.quick else 2)
    if args.summarize:
        with open(args.summarize) as f:
            summarize([json.loads(line) for line in f if line.strip()])
        return
    if args.variant:
        child(args)
        return
    variants = (args.variants or (QUICK_VARIANTS if args.quick else DEFAULT_VARIANTS)).split(",")
    for v in variants:
        parse_variant(v)
    runs = []
    for r in range(args.rounds):
        for v in (variants if r % 2 == 0 else list(reversed(variants))):
            cmd = [sys.executable, os.path.abspath(__file__), "--variant", v, "--model", args.model, "--batch",
                   str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--device", args.device, "--lora-rank", str(args.lora_rank), "--round", str(r)]
            for flag, value in (("--layers", args.layers), ("--library", args.library)):
                if value:
                    cmd += [flag, str(value)]
            if args.lora:
                cmd.append("--lora")
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
                if done.returncode != 0 or not lines:
                    raise RuntimeError(f"exit {done.returncode}: {done.stderr[-3000:]}")
                result = json.loads(lines[-1])
            except Exception as e:  # a failed or hung variant is reported, the others still run
                result = {"variant": v, "round": r, "error": str(e)[-3000:]}
            line = json.dumps(result)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
            runs.append(result)
    summarize(runs)


if __name__ == "__main__":
    main()
