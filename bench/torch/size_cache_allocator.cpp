// A control for bench/torch/finetune.py (allocator "sizecache"): the thinnest caching allocator
// that fits PyTorch's CUDAPluggableAllocator interface. Blocks come from cudaMalloc, sizes rounded
// up (512 B below 1 MiB, 2 MiB above), and a freed block waits in a list of its exact rounded size
// for the next request of that size; on an out-of-memory every cached block is freed and the
// request tried once more. No splitting, no stream ordering (one stream), no stitching.
//
// What it is for: a run under it costs what PyTorch's pluggable path and a near-free allocator
// cost, so its step time against the default allocator's separates the price of being plugged in
// from glake's own.
//
// Built by bench/torch/build_plugin.sh --size-cache (into build/torch/libsize_cache.so).
#include <cuda_runtime_api.h>

#include <cstddef>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

std::mutex guard;
std::unordered_map<std::size_t, std::vector<void*>>* cached = new std::unordered_map<std::size_t, std::vector<void*>>;
std::size_t reserved = 0, peak_reserved = 0, active = 0, peak_active = 0;

std::size_t rounded(std::size_t n) {
  const std::size_t unit = n < (std::size_t{1} << 20) ? 512 : (std::size_t{2} << 20);
  return (n + unit - 1) / unit * unit;
}

void release_cached() {
  cudaDeviceSynchronize();
  for (auto& [size, blocks] : *cached) {
    for (void* p : blocks) {
      cudaFree(p);
      reserved -= size;
    }
    blocks.clear();
  }
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* sc_malloc(std::size_t size, int, cudaStream_t) {
  const std::size_t n = rounded(size == 0 ? 1 : size);
  std::lock_guard<std::mutex> lock(guard);
  void* p = nullptr;
  auto& blocks = (*cached)[n];
  if (!blocks.empty()) {
    p = blocks.back();
    blocks.pop_back();
  } else {
    if (cudaMalloc(&p, n) != cudaSuccess) {
      cudaGetLastError();
      release_cached();
      if (cudaMalloc(&p, n) != cudaSuccess) {
        cudaGetLastError();
        return nullptr;
      }
    }
    reserved += n;
    if (reserved > peak_reserved) peak_reserved = reserved;
  }
  active += n;
  if (active > peak_active) peak_active = active;
  return p;
}

__attribute__((visibility("default"))) void sc_free(void* p, std::size_t size, int, cudaStream_t) {
  if (p == nullptr) return;
  const std::size_t n = rounded(size == 0 ? 1 : size);
  std::lock_guard<std::mutex> lock(guard);
  (*cached)[n].push_back(p);
  active -= n;
}

/// Peak bytes in blocks handed out (rounded) and peak bytes from cudaMalloc.
__attribute__((visibility("default"))) void sc_peaks(std::size_t* peak_active_bytes, std::size_t* peak_reserved_bytes) {
  std::lock_guard<std::mutex> lock(guard);
  *peak_active_bytes = peak_active;
  *peak_reserved_bytes = peak_reserved;
}

}  // extern "C"
