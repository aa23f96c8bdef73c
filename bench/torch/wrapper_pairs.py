#!/usr/bin/env python3
"""What one cached allocation costs through PyTorch under each allocator, hot, in C++ and from
Python: the price of PyTorch's pluggable path next to its own allocator (bench/results/
gpu_alloc_latency.md, session 9).

Each allocator runs in a process of its own (PyTorch fixes its allocator at the first CUDA
allocation), in rounds whose order reverses every other round:
  default    PyTorch's caching allocator
  glake      the plug-in (integrations/torch), through CUDAPluggableAllocator
  sizecache  bench/torch/size_cache_allocator.cpp through the same path: a near-free allocator, so
             its figures are PyTorch's pluggable wrapper alone
Per size, with a live neighbour of the same size: the median ns of a
c10::cuda::CUDACachingAllocator::raw_alloc_with_stream + raw_delete pair over 51 batches of 2000
(the entry a tensor's storage uses), and of torch.empty + del from Python over 31 batches of 500.

    bench/torch/build_plugin.sh && bench/torch/build_plugin.sh --size-cache
    python3 bench/torch/wrapper_pairs.py [--rounds 2]      # repository root, on the GPU machine
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
ALLOCATORS = ("default", "glake", "sizecache")
SIZES = ((512, "512 B"), (64 << 10, "64 KiB"), (2 << 20, "2 MiB"), (64 << 20, "64 MiB"))

SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <algorithm>
#include <chrono>
#include <vector>

double raw_pair_ns(int64_t bytes) {
  namespace alloc = c10::cuda::CUDACachingAllocator;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  void* neighbour = alloc::raw_alloc_with_stream(bytes, stream);
  for (int i = 0; i < 2000; ++i) alloc::raw_delete(alloc::raw_alloc_with_stream(bytes, stream));
  std::vector<double> batches;
  for (int b = 0; b < 51; ++b) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 2000; ++i) alloc::raw_delete(alloc::raw_alloc_with_stream(bytes, stream));
    batches.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / 2000);
  }
  alloc::raw_delete(neighbour);
  std::sort(batches.begin(), batches.end());
  return batches[batches.size() / 2];
}
"""


def child(allocator):
    import torch

    if allocator == "glake":
        sys.path.insert(0, os.path.join(ROOT, "integrations", "torch"))
        import glake_torch

        glake_torch.enable()
    elif allocator == "sizecache":
        path = os.environ.get("GLAKE_SIZE_CACHE_LIBRARY", os.path.join(ROOT, "build", "torch", "libsize_cache.so"))
        torch.cuda.memory.change_current_allocator(torch.cuda.memory.CUDAPluggableAllocator(path, "sc_malloc", "sc_free"))
    from torch.utils.cpp_extension import load_inline

    torch.cuda.init()
    module = load_inline("glake_wrapper_pairs", cpp_sources=SOURCE, functions=["raw_pair_ns"],
                         extra_cflags=["-O2"], with_cuda=True, verbose=False)
    out = {"allocator": allocator, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "sizes": {}}
    for bytes_, _ in SIZES:
        raw = module.raw_pair_ns(bytes_)
        neighbour = torch.empty(bytes_, dtype=torch.uint8, device="cuda")
        batches = []
        for _ in range(31):
            t0 = time.perf_counter()
            for _ in range(500):
                x = torch.empty(bytes_, dtype=torch.uint8, device="cuda")
                del x
            batches.append((time.perf_counter() - t0) / 500 * 1e9)
        del neighbour
        out["sizes"][str(bytes_)] = dict(raw_pair_ns=round(raw, 1), python_pair_ns=round(statistics.median(batches), 1))
    print("RESULT " + json.dumps(out), flush=True)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the three processes (default 2)")
    parser.add_argument("--child", choices=ALLOCATORS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child)
    results = {a: [] for a in ALLOCATORS}
    for r in range(args.rounds):
        for allocator in ALLOCATORS if r % 2 == 0 else ALLOCATORS[::-1]:
            run = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", allocator],
                                 capture_output=True, text=True, timeout=600)
            line = next((l for l in run.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                print(f"{allocator}: no result (exit {run.returncode})\n{run.stderr[-2000:]}", file=sys.stderr)
                return 1
            results[allocator].append(json.loads(line[7:]))
    first = results["default"][0]
    print(f"torch {first['torch']}, {first['gpu']}; {args.rounds} rounds, each allocator in its own process; "
          "median ns per pair, one value per round")
    print("| size | entry | " + " | ".join(ALLOCATORS) + " |")
    print("|---|---|" + "---:|" * len(ALLOCATORS))
    for bytes_, name in SIZES:
        for key, entry in (("raw_pair_ns", "raw_alloc + raw_delete (C++)"), ("python_pair_ns", "torch.empty + del (Python)")):
            cells = [" / ".join(f"{run['sizes'][str(bytes_)][key]:.0f}" for run in results[a]) for a in ALLOCATORS]
            print(f"| {name} | {entry} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
