#!/usr/bin/env python3
"""N processes serving the same model on one GPU: device memory with and without
glake_torch.share_weights, the time to deduplicate, inference throughput before and after, and
what is left on the device after processes are killed while publishing.

The model: a Llama-shaped decoder (transformers' LlamaForCausalLM, 16 layers, 2048 wide, 5632 MLP,
32000 vocabulary: ~1.1 B parameters, ~2.2 GB in bf16), initialised on the GPU from one seed, so
that every process holds the same bytes. Each worker process builds it, times --iters forward
passes (batch x tokens, no_grad), then (mode glake) calls share_weights and
torch.cuda.empty_cache(), times the forward passes again, and reports; it then waits, so that all
N are alive when the parent reads the device's memory in use (cudaMemGetInfo, from the parent,
whose own context is counted in the baseline taken before the workers start). Each worker empties
PyTorch's cache after building the model and before reporting, so what it holds then is its
context and its weights; forward passes are timed one worker at a time (a lock file).

Modes, one after another in one call, for each N in --processes:
  private  N workers started together, no sharing: N copies of the weights
  glake    a glake-dedup-cuda broker, a first worker that stores the weights, then N-1 started
           together that share them: one copy, plus per-process overhead
  pair     (once, whatever N) a broker, a worker that stores the weights, and a second process
           with two copies of the model, one shared: forward passes of the two timed in --pairs
           interleaved pairs (order alternating) with a GPU-bound batch (--pair-batch x
           --pair-tokens), on the device's clock: throughput after sharing against before
  kill     a broker and N workers started together, each killed (SIGKILL) at a random moment
           of --kill-after (while it builds, publishes or serves);
           after all are gone and the broker is stopped, the memory in use must be back at the
           baseline (no leak)

Output: one JSON object a line per worker and per run, then a markdown table.

  python3 bench/torch/share_weights.py --library build/torch/libglake_torch.so \\
      --dedup build/release/tools/glake-dedup-cuda --processes 2,4,8
"""

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "integrations", "torch"))
GiB = 1 << 30


def build_model(torch, args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 128, num_key_value_heads=args.hidden // 128,
                         vocab_size=32000, max_position_embeddings=4096)
    torch.manual_seed(args.seed)
    torch.cuda.manual_seed(args.seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.eval()
    return model


def forward_ms(torch, model, args):
    ids = torch.randint(0, 32000, (args.batch, args.tokens), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(7))
    times = []
    with torch.no_grad():
        model(ids)  # warm-up
        for _ in range(args.iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            logits = model(ids).logits
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times), float(logits.float().sum())


def timed_alone(torch, model, args):
    """forward_ms with no other worker timing at the same time (a lock file beside the broker's
    socket), so that workers started together are timed on an otherwise idle GPU."""
    import fcntl

    with open(args.lock, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return forward_ms(torch, model, args)


def pair_worker(args):
    """Two identical models in one process, the second shared (mapped onto the copy another
    process stored), timed in interleaved pairs: the order alternates, --pairs of them, each
    forward pass timed on the device (events) with a batch large enough to keep the GPU busy."""
    import torch
    import glake_torch

    glake_torch.load(args.library)
    private = build_model(torch, args)
    shared = build_model(torch, args)
    torch.cuda.empty_cache()
    totals = glake_torch.share_weights(shared, args.socket)
    torch.cuda.empty_cache()
    ids = torch.randint(0, 32000, (args.pair_batch, args.pair_tokens), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(7))
    ms = {"private": [], "shared": []}
    sums = {}
    with torch.no_grad():
        for model in (private, shared):  # warm-up
            model(ids)
        for k in range(args.pairs):
            order = (("private", private), ("shared", shared)) if k % 2 == 0 else (("shared", shared), ("private", private))
            for name, model in order:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                logits = model(ids).logits
                end.record()
                torch.cuda.synchronize()
                ms[name].append(start.elapsed_time(end))
                sums[name] = float(logits.float().sum())
                del logits
    ratios = sorted(b / a for a, b in zip(ms["private"], ms["shared"]))
    print(json.dumps({"pairs": args.pairs, "batch": args.pair_batch, "tokens": args.pair_tokens,
                      "shared_pieces": totals.get("shared"), "private_ms": statistics.median(ms["private"]),
                      "shared_ms": statistics.median(ms["shared"]), "ratio_median": statistics.median(ratios),
                      "ratio_p10": ratios[len(ratios) // 10], "ratio_p90": ratios[len(ratios) * 9 // 10],
                      "same_output": sums["private"] == sums["shared"],
                      "private_all": ms["private"], "shared_all": ms["shared"]}), flush=True)


def run_pair(args):
    """A broker, a first worker that stores the weights, then pair_worker in a second process."""
    with tempfile.TemporaryDirectory(prefix="glake-share-") as directory:
        broker, socket = start_broker(args, directory)
        storer = spawn(args, 0, socket, directory)
        try:
            if not storer.stdout.readline():
                raise SystemExit("the storing worker failed")
            command = [sys.executable, os.path.abspath(__file__), "--pair-worker", "--library", args.library,
                       "--socket", socket, "--pairs", str(args.pairs), "--pair-batch", str(args.pair_batch),
                       "--pair-tokens", str(args.pair_tokens), "--layers", str(args.layers),
                       "--hidden", str(args.hidden), "--ffn", str(args.ffn)]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit("the pair worker failed: " + done.stderr[-2000:])
            result = json.loads(done.stdout.strip().splitlines()[-1])
        finally:
            storer.stdin.close()
            storer.wait(60)
            broker.terminate()
            broker.wait(30)
    print(json.dumps({"mode": "pair", **result}), flush=True)
    print(f"\ninterleaved pairs ({result['pairs']}, batch {result['batch']} x {result['tokens']} tokens, "
          f"{result['shared_pieces']} pieces shared): private {result['private_ms']:.2f} ms, shared "
          f"{result['shared_ms']:.2f} ms; shared / private per pair: median {result['ratio_median']:.4f} "
          f"(p10 {result['ratio_p10']:.4f}, p90 {result['ratio_p90']:.4f}); outputs equal: {result['same_output']}")
    return result


def worker(args):
    import torch
    import glake_torch

    glake_torch.load(args.library)
    model = build_model(torch, args)
    torch.cuda.empty_cache()  # the fp32 weights of initialisation, cached after .to(bfloat16)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    before_ms, before_sum = timed_alone(torch, model, args)
    report = {"rank": args.rank, "weight_bytes": weight_bytes, "forward_ms_before": before_ms}
    if args.socket:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        totals = glake_torch.share_weights(model, args.socket)
        torch.cuda.empty_cache()
        report["share_s"] = time.perf_counter() - t0
        report.update(totals)
        after_ms, after_sum = timed_alone(torch, model, args)
        report["forward_ms_after"] = after_ms
        report["same_output"] = after_sum == before_sum
    torch.cuda.empty_cache()  # what stays: the context and the weights
    report["reserved_bytes"] = torch.cuda.memory_reserved()
    print(json.dumps(report), flush=True)
    # Alive until the parent has measured; it may ask for forward passes timed meanwhile.
    for line in sys.stdin:
        if line.strip() != "time":
            break
        print(json.dumps({"forward_ms": forward_ms(torch, model, args)[0]}), flush=True)


def used_bytes(torch):
    free, total = torch.cuda.mem_get_info()
    return total - free


def process_memory_mib():
    """{pid: device memory in MiB} as nvidia-smi sees each process (empty when it cannot say)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found = {}
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            found[int(parts[0])] = int(parts[1])
    return found


def start_broker(args, directory):
    socket = os.path.join(directory, "broker.sock")
    broker = subprocess.Popen([args.dedup, "--socket", socket, "--device", "0", "--quiet"])
    deadline = time.monotonic() + 30
    while not os.path.exists(socket):
        if time.monotonic() > deadline or broker.poll() is not None:
            raise SystemExit("glake-dedup did not start")
        time.sleep(0.01)
    return broker, socket


def spawn(args, rank, socket, directory):
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(rank), "--library", args.library,
               "--lock", os.path.join(directory, "timing.lock"),
               "--iters", str(args.iters), "--batch", str(args.batch), "--tokens", str(args.tokens),
               "--layers", str(args.layers), "--hidden", str(args.hidden), "--ffn", str(args.ffn)]
    if socket:
        command += ["--socket", socket]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def run(torch, args, mode, n):
    baseline = used_bytes(torch)
    with tempfile.TemporaryDirectory(prefix="glake-share-") as directory:
        broker, socket = start_broker(args, directory) if mode != "private" else (None, None)
        time.sleep(1)
        broker_bytes = used_bytes(torch) - baseline  # the broker's own CUDA context
        workers, reports = [], []
        try:
            if mode == "kill":  # all started together, each killed at a random moment
                rng = random.Random(n)
                start = time.monotonic()
                workers = [spawn(args, rank, socket, directory) for rank in range(n)]
                for at, w in sorted(((rng.uniform(*args.kill_after), w) for w in workers), key=lambda x: x[0]):
                    time.sleep(max(0.0, start + at - time.monotonic()))
                    w.send_signal(signal.SIGKILL)
                for w in workers:
                    w.wait()
                peak = None
            else:
                # private: all at once; glake: the first alone (it stores), then the others at
                # once (they share what it stored).
                first = 1 if mode == "glake" else 0
                for group in (range(first), range(first, n)):
                    started = [(rank, spawn(args, rank, socket, directory)) for rank in group]
                    workers += [w for _, w in started]
                    for rank, w in started:
                        line = w.stdout.readline()
                        if not line:
                            raise SystemExit(f"worker {rank} ({mode}) failed")
                        reports.append(json.loads(line))
                        print(json.dumps({"mode": mode, "n": n, **reports[-1]}), flush=True)
                peak = used_bytes(torch)
                per_process = process_memory_mib()
                # Throughput with all N alive, one worker at a time on an otherwise idle GPU.
                served = []
                for w in workers:
                    w.stdin.write("time\n")
                    w.stdin.flush()
                    served.append(json.loads(w.stdout.readline())["forward_ms"])
                for w in workers:
                    w.stdin.close()
                for w in workers:
                    w.wait()
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
                    w.wait()
            if broker is not None:
                broker.terminate()
                broker.wait(30)
    time.sleep(1)
    after = used_bytes(torch)
    result = {"mode": mode, "n": n, "baseline_gib": baseline / GiB, "after_gib": after / GiB,
              "leak_gib": (after - baseline) / GiB, "broker_gib": broker_bytes / GiB}
    if peak is not None:
        weights = reports[0]["weight_bytes"]
        result.update({
            "weights_gib": weights / GiB,
            "in_use_gib": (peak - baseline) / GiB,
            "copies": (peak - baseline) / weights,
            "share_s": [r.get("share_s") for r in reports],
            "forward_ms_before": statistics.median(r["forward_ms_before"] for r in reports),
            "forward_ms_after": statistics.median(r.get("forward_ms_after", r["forward_ms_before"]) for r in reports),
            "same_output": all(r.get("same_output", True) for r in reports),
            "served_ms": statistics.median(served),
            "worker_mib": [per_process.get(w.pid) for w in workers],
            "broker_mib": per_process.get(broker.pid) if broker is not None else None,
            "served_ms_all": served,
            "shared_pieces": [r.get("shared") for r in reports],
        })
    print(json.dumps(result), flush=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--library", required=True)
    parser.add_argument("--dedup", help="glake-dedup-cuda")
    parser.add_argument("--processes", default="2,4,8")
    parser.add_argument("--modes", default="private,glake,kill")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-after", type=float, nargs=2, default=(3.0, 20.0),
                        help="seconds after its start at which each worker of mode kill is killed")
    parser.add_argument("--pairs", type=int, default=50, help="mode pair: interleaved pairs of forward passes")
    parser.add_argument("--pair-batch", type=int, default=8)
    parser.add_argument("--pair-tokens", type=int, default=2048)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pair-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--lock", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.pair_worker:
        return pair_worker(args)
    modes = args.modes.split(",")
    if any(m != "private" for m in modes) and not args.dedup:
        raise SystemExit("--dedup PATH (glake-dedup-cuda) is needed for modes glake, kill and pair")
    if "pair" in modes:
        run_pair(args)
        modes = [m for m in modes if m != "pair"]
        if not modes:
            return
    import torch

    torch.cuda.init()
    results = [run(torch, args, mode, int(n)) for n in args.processes.split(",") for mode in modes]
    # A process's memory besides its weights (its context, what PyTorch keeps), from the private
    # run of the same N: there in_use = N x (weights + other). The weights' copies in glake mode
    # are then (in_use - broker - N x other) / weights; whatever sharing adds per process counts
    # as copies in that figure. The fit over N of glake's in_use separates the two: its slope is
    # what each process adds, its intercept the weights and the broker.
    private = {r["n"]: r for r in results if r["mode"] == "private" and "in_use_gib" in r}
    other = {n: r["in_use_gib"] / n - r["weights_gib"] for n, r in private.items()}
    print("\n| N | mode | weights GiB | in use GiB | broker GiB | other per process GiB | weight copies | "
          "share s (first, others) | forward ms, served (vs private) | same output | left after exit GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "in_use_gib" in r:
            share = [s for s in r["share_s"] if s is not None]
            share_text = f"{share[0]:.2f}, {statistics.median(share[1:]):.2f}" if len(share) > 1 else "-"
            o = other.get(r["n"])
            copies = "-" if o is None else f"{(r['in_use_gib'] - r['broker_gib'] - r['n'] * o) / r['weights_gib']:.2f}"
            base = private.get(r["n"])
            served = f"{r['served_ms']:.1f}" + (f" ({r['served_ms'] / base['served_ms']:.3f})" if base else "")
            print(f"| {r['n']} | {r['mode']} | {r['weights_gib']:.2f} | {r['in_use_gib']:.2f} | {r['broker_gib']:.2f} | "
                  f"{'-' if o is None else f'{o:.2f}'} | {copies} | {share_text} | {served} | {r['same_output']} | "
                  f"{r['leak_gib']:.2f} |")
        else:
            print(f"| {r['n']} | {r['mode']} | | | {r['broker_gib']:.2f} | | | | | | {r['leak_gib']:.2f} |")
    shared = sorted((r["n"], r["in_use_gib"]) for r in results if r["mode"] == "glake" and "in_use_gib" in r)
    if len(shared) >= 2:
        ns, ys = [n for n, _ in shared], [y for _, y in shared]
        mean_n, mean_y = statistics.fmean(ns), statistics.fmean(ys)
        slope = sum((n - mean_n) * (y - mean_y) for n, y in shared) / sum((n - mean_n) ** 2 for n in ns)
        intercept = mean_y - slope * mean_n
        broker = statistics.fmean(r["broker_gib"] for r in results if r["mode"] == "glake")
        weights = results[0]["weights_gib"]
        besides = (f"; the private processes hold {statistics.fmean(other.values()):.3f} GiB each besides their weights"
                   if other else "")
        print(f"\nglake in use = {intercept:.2f} + {slope:.3f} x N GiB (least squares over N = {ns}); "
              f"less the broker's {broker:.2f} GiB, the intercept is {(intercept - broker) / weights:.2f} copies "
              f"of the weights{besides}")


if __name__ == "__main__":
    main()
