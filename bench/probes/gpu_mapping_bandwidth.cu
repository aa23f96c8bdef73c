// Do kernels run slower over memory mapped as many 2 MiB handles than over one cudaMalloc?
//
// glake builds its segments and stitched ranges from 2 MiB physical handles (cuMemCreate), each
// mapped separately; PyTorch's default allocator gets large segments from cudaMalloc. If the GPU's
// address translation covered fewer bytes per TLB entry over separately mapped handles, kernels
// touching a large working set would run slower under glake even in steps where glake makes no
// call at all. This program times two kernels over 4 GiB laid out four ways:
//   cudaMalloc        one cudaMalloc of the whole buffer
//   one handle        one cuMemCreate handle of the whole buffer, mapped once
//   2 MiB in order    2048 handles of 2 MiB mapped side by side in creation order (a segment)
//   2 MiB shuffled    the same handles mapped in a shuffled order (a stitch over scattered chunks)
// The kernels: a streaming read of the whole buffer (bandwidth), and random 4-byte reads spread
// over all of it (translation-bound). Median of 15 runs each, timed with events.
//
//   nvcc -std=c++17 -O2 -arch=sm_90 bench/probes/gpu_mapping_bandwidth.cu -lcuda -o /tmp/mapbw && /tmp/mapbw
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "gpu_check.hpp"

namespace {

using glake_probe::check;

__global__ void stream_read(const uint4* p, std::size_t n, unsigned long long* out) {
  unsigned int acc = 0;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) atomicAdd(out, 1ull);  // keeps the loads
}

__global__ void random_read(const unsigned int* p, std::size_t words, int reads, unsigned long long* out) {
  unsigned long long x = (blockIdx.x * 1024ull + threadIdx.x) * 0x9E3779B97F4A7C15ull + 1;
  unsigned int acc = 0;
  for (int k = 0; k < reads; ++k) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    acc += p[x % words];
  }
  if (acc == 0x12345678u) atomicAdd(out, 1ull);
}

__global__ void fill(unsigned int* p, std::size_t words) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < words; i += std::size_t(gridDim.x) * blockDim.x) {
    p[i] = static_cast<unsigned int>(i * 2654435761u);
  }
}

struct result {
  float stream_ms, random_ms;
};

template <class Launch>
float median_ms(Launch&& launch) {
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "cudaEventCreate");
  check(cudaEventCreate(&b), "cudaEventCreate");
  launch();  // warm-up
  std::vector<float> t;
  for (int rep = 0; rep < 15; ++rep) {
    check(cudaEventRecord(a), "cudaEventRecord");
    launch();
    check(cudaEventRecord(b), "cudaEventRecord");
    check(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

result measure(void* p, std::size_t bytes, unsigned long long* sink) {
  fill<<<1024, 256>>>(static_cast<unsigned int*>(p), bytes / 4);
  check(cudaDeviceSynchronize(), "fill");
  result r{};
  r.stream_ms = median_ms([&] { stream_read<<<132 * 8, 256>>>(static_cast<const uint4*>(p), bytes / 16, sink); });
  r.random_ms = median_ms([&] { random_read<<<132 * 8, 256>>>(static_cast<const unsigned int*>(p), bytes / 4, 256, sink); });
  check(cudaDeviceSynchronize(), "kernels");
  return r;
}

void report(const char* name, result r, std::size_t bytes) {
  const double random_reads = 132.0 * 8 * 256 * 256;
  std::printf("%-16s stream %7.3f ms (%6.0f GB/s)   random 4-byte reads %7.3f ms (%6.2f G reads/s)\n", name,
              r.stream_ms, bytes / (r.stream_ms * 1e6), r.random_ms, random_reads / (r.random_ms * 1e6));
}

}  // namespace

int main() {
  check(cudaFree(nullptr), "cudaFree");
  CUdevice dev;
  check(cuCtxGetDevice(&dev), "cuCtxGetDevice");
  const std::size_t chunk = 2ull << 20, bytes = 4ull << 30, count = bytes / chunk;
  unsigned long long* sink = nullptr;
  check(cudaMalloc(&sink, sizeof *sink), "cudaMalloc");

  {
    void* p = nullptr;
    check(cudaMalloc(&p, bytes), "cudaMalloc");
    report("cudaMalloc", measure(p, bytes, sink), bytes);
    check(cudaFree(p), "cudaFree");
  }
  const CUmemAllocationProp prop = glake_probe::device_memory(dev);
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  {
    CUmemGenericAllocationHandle h;
    check(cuMemCreate(&h, bytes, &prop, 0), "cuMemCreate");
    CUdeviceptr va;
    check(cuMemAddressReserve(&va, bytes, 0, 0, 0), "cuMemAddressReserve");
    check(cuMemMap(va, bytes, 0, h, 0), "cuMemMap");
    check(cuMemSetAccess(va, bytes, &access, 1), "cuMemSetAccess");
    report("one handle", measure(reinterpret_cast<void*>(va), bytes, sink), bytes);
    check(cuMemUnmap(va, bytes), "cuMemUnmap");
    check(cuMemAddressFree(va, bytes), "cuMemAddressFree");
    check(cuMemRelease(h), "cuMemRelease");
  }
  std::vector<CUmemGenericAllocationHandle> handles(count);
  for (auto& h : handles) check(cuMemCreate(&h, chunk, &prop, 0), "cuMemCreate");
  for (const bool shuffled : {false, true}) {
    std::vector<std::size_t> order(count);
    for (std::size_t i = 0; i < count; ++i) order[i] = i;
    if (shuffled) std::shuffle(order.begin(), order.end(), std::mt19937(42));
    CUdeviceptr va;
    check(cuMemAddressReserve(&va, bytes, 0, 0, 0), "cuMemAddressReserve");
    for (std::size_t i = 0; i < count; ++i) check(cuMemMap(va + i * chunk, chunk, 0, handles[order[i]], 0), "cuMemMap");
    check(cuMemSetAccess(va, bytes, &access, 1), "cuMemSetAccess");
    report(shuffled ? "2 MiB shuffled" : "2 MiB in order", measure(reinterpret_cast<void*>(va), bytes, sink), bytes);
    check(cuMemUnmap(va, bytes), "cuMemUnmap");
    check(cuMemAddressFree(va, bytes), "cuMemAddressFree");
  }
  for (auto& h : handles) check(cuMemRelease(h), "cuMemRelease");
  cudaFree(sink);
  return 0;
}
