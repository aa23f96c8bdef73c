"""torch.empty + del pairs through PyTorch's allocator or through glake's plug-in, one process each:

    python3 bench/torch/empty_pairs.py default
    python3 bench/torch/empty_pairs.py glake [GLAKE_ALLOC_CONF]

Prints the mean time of a cached pair at 4 KiB, 1 MiB, 16 MiB and 256 MiB (20,000 pairs after 100
warm-up pairs each), then three bursts of 2,000 live tensors of mixed sizes freed together. It
measures what one allocation costs as PyTorch sees it (Python, dispatcher, allocator), so the two
allocators can be compared on the path a training step takes; bench/results/finetune.md quotes it.
Needs torch and a GPU; for glake, libglake_torch.so built by bench/torch/build_plugin.sh.
"""
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "integrations", "torch"))


def main(argv):
    mode = argv[1] if len(argv) > 1 else "default"
    if mode not in ("default", "glake"):
        sys.exit("usage: empty_pairs.py default|glake [GLAKE_ALLOC_CONF]")
    if mode == "glake":
        import glake_torch

        glake_torch.enable(conf=argv[2] if len(argv) > 2 else None)
    import torch

    torch.cuda.init()
    keep = [torch.empty(1 << 20, device="cuda") for _ in range(4)]  # noqa: F841 (something live)
    for size in [4096, 1 << 20, 16 << 20, 256 << 20]:
        n = 20000
        for _ in range(100):
            x = torch.empty(size, dtype=torch.uint8, device="cuda")
            del x
        begin = time.perf_counter()
        for _ in range(n):
            x = torch.empty(size, dtype=torch.uint8, device="cuda")
            del x
        per_pair = (time.perf_counter() - begin) / n
        print(f"{mode:8s} torch.empty+del {size:>10d} B: {per_pair * 1e6:.2f} us", flush=True)
    random.seed(1)
    sizes = [random.choice([512, 4096, 65536, 1 << 20, 3 << 20, 9 << 20]) for _ in range(2000)]
    for _ in range(3):
        begin = time.perf_counter()
        xs = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in sizes]
        del xs
        elapsed = time.perf_counter() - begin
        print(f"{mode:8s} burst of 2000 mixed: {elapsed * 1e3:.2f} ms ({elapsed / 2000 * 1e6:.2f} us per pair)",
              flush=True)


if __name__ == "__main__":
    main(sys.argv)
