#!/usr/bin/env python3
"""One program, one run: median ns per cached allocate+deallocate pair for glake's stitching
allocator (CUDA backend), cudaMallocAsync on a warm pool, cudaMalloc, and PyTorch's C++ caching
allocator (c10::cuda::CUDACachingAllocator::raw_alloc_with_stream / raw_delete), all timed inside
one small torch C++ extension (glake is header-only, so it compiles in). Each pair keeps a live
neighbour of the same size; median over 51 batches of 2000 pairs (cudaMalloc: 11 batches of 5-50).
Needs a GPU and torch; Boost headers from the system or in .device-deps/include (bench/torch/README.md).

    python3 bench/torch/alloc_pairs.py           # from the repository root; prints a markdown table
"""
import os
import sys

import torch
from torch.utils.cpp_extension import load_inline

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <vector>

#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/cuda.hpp"

namespace {
template <class Pair>
double median_ns(int64_t pairs, int64_t batches, Pair&& pair) {
  for (int64_t i = 0; i < pairs; ++i) pair();
  std::vector<double> per_pair;
  for (int64_t b = 0; b < batches; ++b) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < pairs; ++i) pair();
    const auto t1 = std::chrono::steady_clock::now();
    per_pair.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / pairs);
  }
  std::sort(per_pair.begin(), per_pair.end());
  return per_pair[per_pair.size() / 2];
}
void ok(cudaError_t e) { if (e != cudaSuccess) throw std::runtime_error(cudaGetErrorString(e)); }
using glake_allocator = glake::stitching_allocator<glake::cuda_provider, glake::cuda_reserver>;
std::unique_ptr<glake_allocator> glake_instance;
}  // namespace

// Returns {glake, cudaMallocAsync, cudaMalloc, torch} median ns per pair.
std::vector<double> pair_ns(int64_t bytes) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  if (!glake_instance) glake_instance = std::make_unique<glake_allocator>(glake::cuda_provider(0), glake::cuda_reserver(0));
  const glake::stream_ref on{stream};
  std::vector<double> out;
  {
    void* neighbour = glake_instance->allocate(bytes, on);
    out.push_back(median_ns(2000, 51, [&] { glake_instance->deallocate(glake_instance->allocate(bytes, on), bytes, on); }));
    glake_instance->deallocate(neighbour, bytes, on);
  }
  {
    cudaMemPool_t pool;
    ok(cudaDeviceGetDefaultMemPool(&pool, 0));
    uint64_t keep = ~uint64_t{0};
    ok(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    void* neighbour = nullptr;
    ok(cudaMallocAsync(&neighbour, bytes, stream));
    out.push_back(median_ns(2000, 51, [&] {
      void* p = nullptr;
      ok(cudaMallocAsync(&p, bytes, stream));
      ok(cudaFreeAsync(p, stream));
    }));
    ok(cudaFreeAsync(neighbour, stream));
    ok(cudaStreamSynchronize(stream));
  }
  out.push_back(median_ns(bytes >= (256 << 20) ? 5 : 50, 11, [&] {
    void* p = nullptr;
    ok(cudaMalloc(&p, bytes));
    ok(cudaFree(p));
  }));
  {
    namespace alloc = c10::cuda::CUDACachingAllocator;
    void* neighbour = alloc::raw_alloc_with_stream(bytes, stream);
    out.push_back(median_ns(2000, 51, [&] { alloc::raw_delete(alloc::raw_alloc_with_stream(bytes, stream)); }));
    alloc::raw_delete(neighbour);
  }
  return out;
}
"""


def main():
    torch.cuda.init()
    module = load_inline("glake_alloc_pairs", cpp_sources=SOURCE, functions=["pair_ns"],
                         extra_cflags=["-O2", "-std=c++20", "-DNDEBUG"],
                         extra_include_paths=[os.path.join(ROOT, "include"), os.path.join(ROOT, ".device-deps", "include")],
                         extra_ldflags=["-lcuda"], with_cuda=True, verbose=False)
    sizes = [(512, "512 B"), (4 << 10, "4 KiB"), (64 << 10, "64 KiB"), (1 << 20, "1 MiB"), (2 << 20, "2 MiB"),
             (16 << 20, "16 MiB"), (256 << 20, "256 MiB"), (1 << 30, "1 GiB")]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    print("| size | glake | cudaMallocAsync (warm) | cudaMalloc | PyTorch raw_alloc | async / glake | PyTorch / glake |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for size, name in sizes:
        g, a, m, t = module.pair_ns(size)
        print(f"| {name} | {g:.1f} | {a:.1f} | {m:.1f} | {t:.1f} | {a / g:.1f}x | {t / g:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
