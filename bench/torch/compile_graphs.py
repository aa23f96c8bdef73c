#!/usr/bin/env python3
"""torch.compile(mode="reduce-overhead") (CUDA graph trees) under three CUDA allocators.

Three workloads, each compiled with mode="reduce-overhead", fixed shapes, bf16 where it applies:
  gpt2-train   a GPT-2-shaped decoder (6 layers, 768 wide, 12 heads, vocabulary 50257), a full
               training step: the model compiled (forward and backward graphs), AdamW eager; batch 8 x 512
  decode       greedy generation with a static KV cache: a 12-layer Llama-like decoder written
               here (RMSNorm, rotary-free attention, SwiGLU; 1024 wide, 16 heads), one compiled
               decode step per token over a preallocated cache; batch 8, prompt 128, 128 new tokens
  resnet-infer a ResNet-50-shaped vision model (torchvision, random weights), inference, batch 64
Allocators: default, expandable (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), glake
(glake_torch.enable() before CUDA starts; its native allocator where the plug-in has it).

Each (workload, allocator) runs in a process of its own; with --rounds R the allocators' order
alternates between rounds (interleaved runs of the same workload). A process warms up (compiles,
records its graphs), then times --steps steps, each closed by torch.cuda.synchronize(). Reported:
median and spread (p10-p90) of the step time, peak reserved (torch.cuda.max_memory_reserved) and
allocated, the device memory in use at the end over the start (cudaMemGetInfo), and a checksum of
the outputs (losses, generated tokens, logits) that every allocator must reproduce.

  python3 bench/torch/compile_graphs.py --out $OUT/graphs.jsonl --markdown $OUT/graphs.md
  python3 bench/torch/compile_graphs.py --workloads decode --allocators default,glake --rounds 3
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
GLAKE_TORCH = os.path.join(ROOT, "integrations", "torch")
WORKLOADS = ("gpt2-train", "decode", "resnet-infer")
ALLOCATORS = ("default", "expandable", "glake")
SEED = 1234


def gpt2_train(torch, steps):
    import transformers

    config = transformers.GPT2Config(n_layer=6, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    torch.manual_seed(SEED)
    model = transformers.GPT2LMHeadModel(config).cuda().to(torch.bfloat16)
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator(device="cuda").manual_seed(SEED)
    batches = [torch.randint(0, config.vocab_size, (8, 512), device="cuda", generator=generator) for _ in range(4)]

    compiled = torch.compile(model, mode="reduce-overhead")  # forward and backward graphs
    losses = []

    def step(i):
        torch.compiler.cudagraph_mark_step_begin()
        ids = batches[i % len(batches)]
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())

    return step, lambda: [round(float(v), 4) for v in losses[:8]]


def decode(torch, steps):
    nn = torch.nn
    width, heads, layers, vocab, batch, prompt, new = 1024, 16, 12, 32000, 8, 128, 128
    head_dim = width // heads
    total = prompt + new

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.RMSNorm(width), nn.RMSNorm(width)
            self.qkv = nn.Linear(width, 3 * width, bias=False)
            self.out = nn.Linear(width, width, bias=False)
            self.up = nn.Linear(width, 2 * 2816, bias=False)
            self.down = nn.Linear(2816, width, bias=False)
            # The static KV cache: buffers, so CUDA graph trees treat them as static inputs.
            self.register_buffer("k_cache", torch.zeros(batch, heads, total, head_dim), persistent=False)
            self.register_buffer("v_cache", torch.zeros(batch, heads, total, head_dim), persistent=False)

        def forward(self, x, position):
            k_cache, v_cache = self.k_cache, self.v_cache
            b, t, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, heads, head_dim).unbind(2)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            k_cache.index_copy_(2, position, k)
            v_cache.index_copy_(2, position, v)
            mask = torch.arange(total, device=x.device)[None, :] <= position[:, None]
            a = nn.functional.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)
            x = x + self.out(a.transpose(1, 2).reshape(b, t, width))
            gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
            return x + self.down(nn.functional.silu(gate) * up)

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.RMSNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)

        def forward(self, ids, position):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x, position)
            return self.head(self.norm(x[:, -1]))

    torch.manual_seed(SEED)
    model = Decoder().cuda().to(torch.bfloat16).eval()
    generator = torch.Generator(device="cuda").manual_seed(SEED)
    prompt_ids = torch.randint(0, vocab, (batch, prompt), device="cuda", generator=generator)
    step_fn = torch.compile(model, mode="reduce-overhead")
    tokens = []

    @torch.no_grad()
    def generate(_i):
        # The prompt in one eager pass (its own shapes), then one compiled step per new token.
        logits = model(prompt_ids, torch.arange(prompt, device="cuda"))
        token = logits.argmax(-1, keepdim=True)
        out = [token]
        for p in range(prompt, total - 1):
            torch.compiler.cudagraph_mark_step_begin()
            logits = step_fn(token, torch.tensor([p], device="cuda"))
            token = logits.argmax(-1, keepdim=True).clone()
            out.append(token)
        tokens.append(torch.cat(out, dim=1))

    return generate, lambda: int(torch.stack(tokens[:2]).sum()) if tokens else None


def resnet_infer(torch, steps):
    import torchvision

    torch.manual_seed(SEED)
    model = torchvision.models.resnet50(weights=None).cuda().to(torch.bfloat16).eval()
    compiled = torch.compile(model, mode="reduce-overhead")
    generator = torch.Generator(device="cuda").manual_seed(SEED)
    images = [torch.randn(64, 3, 224, 224, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(4)]
    sums = []

    @torch.no_grad()
    def step(i):
        torch.compiler.cudagraph_mark_step_begin()
        logits = compiled(images[i % len(images)])
        sums.append(logits.float().sum().clone())

    return step, lambda: [round(float(v), 2) for v in sums[:4]]


def glake_counters(allocator):
    """glake's cumulative driver calls and their host ns, plus its allocation calls' host time when
    GLAKE_HOST_TIMING was set: {} for the other allocators."""
    if allocator != "glake":
        return {}
    import glake_torch

    s = glake_torch.stats()
    out = {"glake_" + key: value for key, value in s.items()
           if key.startswith(("driver_", "events_", "event_", "device_waits", "stitch")) and isinstance(value, int)}
    host = glake_torch.host_time()
    if host is not None:
        out.update(glake_host_ns=host["ns"], glake_host_calls=host["calls"])
    return out


def pool_memory(torch):
    """What each memory pool holds at the end (torch.cuda.memory_snapshot's segments by
    segment_pool_id; (0, 0) is the general pool, the others CUDA graphs' private pools):
    {pool: [segments, reserved bytes, allocated bytes]}."""
    pools = {}
    for segment in torch.cuda.memory_snapshot():
        key = str(tuple(segment.get("segment_pool_id", (0, 0))))
        entry = pools.setdefault(key, [0, 0, 0])
        entry[0] += 1
        entry[1] += segment["total_size"]
        entry[2] += segment.get("allocated_size", 0)
    return pools


def child(args):
    result = dict(workload=args.workload, allocator=args.allocator, steps=args.steps, round=args.round)
    if args.allocator == "glake":
        sys.path.insert(0, GLAKE_TORCH)
        import glake_torch

        glake_torch.enable()
        result["glake_backend"] = glake_torch.backend() if hasattr(glake_torch, "backend") else "pluggable"
    import torch

    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    base = total - free
    result.update(torch=torch.__version__, gpu=torch.cuda.get_device_name())
    make = {"gpt2-train": gpt2_train, "decode": decode, "resnet-infer": resnet_infer}[args.workload]
    try:
        step, outputs = make(torch, args.steps)
        t0 = time.perf_counter()
        for i in range(args.warmup):
            step(i)
        torch.cuda.synchronize()
        result["warmup_s"] = round(time.perf_counter() - t0, 2)
        result["peak_reserved_after_warmup_bytes"] = torch.cuda.max_memory_reserved()
        result["pools_after_warmup"] = pool_memory(torch)
        counts_before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
        glake_before = glake_counters(args.allocator)
        times = []
        for i in range(args.steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            step(args.warmup + i)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        times.sort()
        free_end, _ = torch.cuda.mem_get_info()
        # Per timed step: allocations (every allocator), and under glake its driver calls and,
        # with GLAKE_HOST_TIMING=1, the host time of its allocation calls.
        result["allocations_per_step"] = round(
            (torch.cuda.memory_stats().get("allocation.all.allocated", 0) - counts_before) / args.steps, 1)
        result["pools"] = pool_memory(torch)
        glake_after = glake_counters(args.allocator)
        for key in glake_after:
            result[key + "_per_step"] = round((glake_after[key] - glake_before[key]) / args.steps, 1)
        result.update(
            status="ok", median_ms=round(1000 * statistics.median(times), 3),
            p10_ms=round(1000 * times[len(times) // 10], 3), p90_ms=round(1000 * times[(9 * len(times)) // 10], 3),
            peak_reserved_bytes=torch.cuda.max_memory_reserved(), peak_allocated_bytes=torch.cuda.max_memory_allocated(),
            device_used_over_base_bytes=(total - free_end) - base, outputs=outputs())
    except Exception as error:  # noqa: BLE001
        result.update(status="error", error=f"{type(error).__name__}: {error}"[:1500])
    print("RESULT " + json.dumps(result), flush=True)


def drive(args):
    results = []
    for r in range(args.rounds):
        for workload in args.workloads:
            order = list(args.allocators) if r % 2 == 0 else list(reversed(args.allocators))
            for allocator in order:
                env = dict(os.environ)
                for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
                    env.pop(name, None)
                if allocator == "expandable":
                    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
                command = [sys.executable, os.path.abspath(__file__), "--child", "--workload", workload,
                           "--allocator", allocator, "--steps", str(args.steps), "--warmup", str(args.warmup),
                           "--round", str(r)]
                started = time.time()
                try:
                    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
                    output = run.stdout + run.stderr
                except subprocess.TimeoutExpired as error:
                    output = (error.stdout or "") + "\nTIMEOUT"
                    output = output if isinstance(output, str) else output.decode()
                line = next((l for l in output.splitlines() if l.startswith("RESULT ")), None)
                result = json.loads(line[7:]) if line else dict(workload=workload, allocator=allocator, round=r,
                                                               status="error", error=output[-1500:])
                result["wall_s"] = round(time.time() - started, 1)
                results.append(result)
                print(f"[round {r}] {workload} {allocator}: {result.get('status')} median {result.get('median_ms')} ms, "
                      f"peak reserved {result.get('peak_reserved_bytes', 0) / 1e9:.3f} GB ({result['wall_s']} s)"
                      + (f" {result.get('error', '')[:300]}" if result.get("status") != "ok" else ""), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(result) + "\n")
    return results


def markdown(results):
    lines = ["| workload | allocator | runs | median ms (each run) | p10-p90 ms | peak reserved GB | peak allocated GB | "
             "device used over base GB | outputs equal to default |", "|---" * 9 + "|"]
    for workload in dict.fromkeys(r["workload"] for r in results):
        ref = next((r.get("outputs") for r in results if r["workload"] == workload and r["allocator"] == "default"
                    and r.get("status") == "ok"), None)
        for allocator in ALLOCATORS:
            runs = [r for r in results if r["workload"] == workload and r["allocator"] == allocator]
            ok = [r for r in runs if r.get("status") == "ok"]
            if not runs:
                continue
            if not ok:
                lines.append(f"| {workload} | {allocator} | {len(runs)} | {runs[0].get('error', '')[:120]} | | | | | |")
                continue
            medians = ", ".join(f"{r['median_ms']:.2f}" for r in ok)
            spread = ", ".join(f"{r['p10_ms']:.2f}-{r['p90_ms']:.2f}" for r in ok)
            gb = lambda key: max(r[key] for r in ok) / 1e9  # noqa: E731
            equal = all(r.get("outputs") == ref for r in ok) if ref is not None else "-"
            lines.append(f"| {workload} | {allocator} | {len(ok)} | {medians} | {spread} | {gb('peak_reserved_bytes'):.3f} | "
                         f"{gb('peak_allocated_bytes'):.3f} | {gb('device_used_over_base_bytes'):.3f} | {equal} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--allocators", default=",".join(ALLOCATORS))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out")
    parser.add_argument("--markdown")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--allocator", help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.allocators = [a for a in args.allocators.split(",") if a]
    for w in args.workloads:
        if w not in WORKLOADS:
            parser.error(f"unknown workload {w!r} (choose from {', '.join(WORKLOADS)})")
    for a in args.allocators:
        if a not in ALLOCATORS:
            parser.error(f"unknown allocator {a!r} (choose from {', '.join(ALLOCATORS)})")
    results = drive(args)
    table = markdown(results)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
