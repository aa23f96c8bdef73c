#!/usr/bin/env python3
"""A checkpoint from a host file into GPU memory: glake_torch.load_safetensors against
safetensors.torch.load_file(device="cuda") and torch.load + .to("cuda").

The checkpoint: the tensors of an OPT-1.3B-shaped model in bf16 (24 layers of 2048-wide attention
and 8192-wide MLP, 50272 x 2048 embeddings: ~2.6 GB), random values, written once as
model.safetensors (safetensors.torch.save_file) and model.pt (torch.save) in --dir. Every method
reads its file once untimed first, so the page cache holds both: this measures the copies, not the
disk. Then --rounds rounds, each timing every method once, in an order reversed every other round;
a time runs from the call to torch.cuda.synchronize() and includes allocating the GPU tensors.
Every method's tensors are compared with the reference (equal, bit for bit) once.

Output: one JSON object a line (per method: median and p10/p90 seconds and GB/s over rounds),
then a markdown table.

  python3 bench/torch/load_checkpoint.py --dir /tmp/ckpt --rounds 7 [--library build/torch/libglake_torch.so]
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "integrations", "torch"))


def model_tensors(torch, layers=24, hidden=2048, ffn=8192, vocab=50272, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = {"embed_tokens.weight": (vocab, hidden), "embed_positions.weight": (2050, hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[p + name + ".weight"] = (hidden, hidden)
            shapes[p + name + ".bias"] = (hidden,)
        shapes[p + "fc1.weight"] = (ffn, hidden)
        shapes[p + "fc1.bias"] = (ffn,)
        shapes[p + "fc2.weight"] = (hidden, ffn)
        shapes[p + "fc2.bias"] = (hidden,)
        for norm in ("self_attn_layer_norm", "final_layer_norm"):
            shapes[p + norm + ".weight"] = (hidden,)
            shapes[p + norm + ".bias"] = (hidden,)
    return {k: torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16).cpu() for k, s in shapes.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/glake_checkpoint")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--library", help="libglake_torch.so (default: glake_torch's own lookup)")
    args = parser.parse_args()

    import torch
    import safetensors.torch as st
    import glake_torch
    if args.library:
        glake_torch.load(args.library)

    os.makedirs(args.dir, exist_ok=True)
    sf_path = os.path.join(args.dir, "model.safetensors")
    pt_path = os.path.join(args.dir, "model.pt")
    reference = model_tensors(torch)
    nbytes = sum(t.numel() * t.element_size() for t in reference.values())
    st.save_file(reference, sf_path)
    torch.save(reference, pt_path)
    print(f"# load_checkpoint: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"{len(reference)} tensors, {nbytes / 1e9:.2f} GB; files {os.path.getsize(sf_path) / 1e9:.2f} GB "
          f"(safetensors), {os.path.getsize(pt_path) / 1e9:.2f} GB (torch.save)", flush=True)

    def torch_load():
        return {k: v.to("cuda") for k, v in torch.load(pt_path, weights_only=True).items()}

    methods = {
        "safetensors load_file(device=cuda)": lambda: st.load_file(sf_path, device="cuda:0"),
        "torch.load + .to(cuda)": torch_load,
        "glake_torch.load_safetensors": lambda: glake_torch.load_safetensors(sf_path, device=0),
    }
    ok = {}
    for name, load in methods.items():  # warm the page cache; check the bytes
        loaded = load()
        torch.cuda.synchronize()
        ok[name] = all(torch.equal(loaded[k].cpu(), v) for k, v in reference.items()) and len(loaded) == len(reference)
        del loaded
    gc.collect()
    torch.cuda.empty_cache()

    times = {name: [] for name in methods}
    names = list(methods)
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            torch.cuda.synchronize()
            start = time.perf_counter()
            loaded = methods[name]()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
            del loaded
            gc.collect()

    def q(v, f):
        v = sorted(v)
        return v[min(len(v) - 1, int(f * (len(v) - 1) + 0.5))]

    rows = []
    for name in names:
        t = times[name]
        med = statistics.median(t)
        row = dict(bench="load_checkpoint", method=name, bytes=nbytes, rounds=len(t), median_s=round(med, 4),
                   p10_s=round(q(t, 0.1), 4), p90_s=round(q(t, 0.9), 4), median_gbps=round(nbytes / med / 1e9, 2),
                   bytes_ok=ok[name])
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]["median_s"]
    print(f"\n| method | seconds: median (p10-p90) | GB/s | vs safetensors | bytes |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['method']} | {row['median_s']:.3f} ({row['p10_s']:.3f}-{row['p90_s']:.3f}) | "
              f"{row['median_gbps']:.1f} | {base / row['median_s']:.2f}x | {'ok' if row['bytes_ok'] else 'WRONG'} |")
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
