// Do the CUDA calls a training step makes get slower as the process holds more VMM handles?
//
// glake builds device memory from 2 MiB physical handles (cuMemCreate), each mapped into a segment
// and, for stitched ranges, once more elsewhere: a fine-tuning run holds ~12,000 handles and ~20,000
// mappings where PyTorch's default allocator holds a few hundred cudaMalloc segments. If a call a
// training step makes anyway (a kernel launch, an event, cudaMemGetInfo, the per-handle cost of
// mapping a stitch) scaled with that count, glake would pay it in every step, outside its own
// calls. This probe times those calls with K handles created and mapped twice (a segment range
// and an alias range, as a stitch maps them), for K from 0 up to 16,384 (32 GiB).
//
//   nvcc -std=c++17 -O2 -arch=sm_90 bench/gpu_handle_count.cu -lcuda -o /tmp/handle_count && /tmp/handle_count
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <vector>

#include "gpu_check.hpp"

namespace {

using glake_probe::check;

__global__ void empty_kernel() {}

double median_us(int repeats, const std::function<void()>& call) {
  std::vector<double> us;
  us.reserve(static_cast<std::size_t>(repeats));
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(us.begin(), us.begin() + repeats / 2, us.end());
  return us[static_cast<std::size_t>(repeats / 2)];
}

struct held {
  std::vector<CUmemGenericAllocationHandle> handles;
  CUdeviceptr segment = 0, alias = 0;
  std::size_t bytes = 0;
};

void map_all(const held& h, CUdeviceptr base, std::size_t chunk, int device) {
  for (std::size_t i = 0; i < h.handles.size(); ++i) check(cuMemMap(base + i * chunk, chunk, 0, h.handles[i], 0), "cuMemMap");
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  check(cuMemSetAccess(base, h.bytes, &access, 1), "cuMemSetAccess");
}

// Grows `h` to `count` handles, each mapped in a segment range and in an alias range.
void hold(held& h, std::size_t count, std::size_t chunk, const CUmemAllocationProp& prop, int device) {
  if (h.bytes != 0) {
    check(cuMemUnmap(h.segment, h.bytes), "cuMemUnmap");
    check(cuMemUnmap(h.alias, h.bytes), "cuMemUnmap");
    check(cuMemAddressFree(h.segment, h.bytes), "cuMemAddressFree");
    check(cuMemAddressFree(h.alias, h.bytes), "cuMemAddressFree");
  }
  while (h.handles.size() < count) {
    CUmemGenericAllocationHandle handle{};
    check(cuMemCreate(&handle, chunk, &prop, 0), "cuMemCreate");
    h.handles.push_back(handle);
  }
  h.bytes = count * chunk;
  if (count == 0) return;
  check(cuMemAddressReserve(&h.segment, h.bytes, chunk, 0, 0), "cuMemAddressReserve");
  check(cuMemAddressReserve(&h.alias, h.bytes, chunk, 0, 0), "cuMemAddressReserve");
  map_all(h, h.segment, chunk, device);
  map_all(h, h.alias, chunk, device);
}

}  // namespace

int main() {
  const int device = 0;
  check(cudaSetDevice(device), "cudaSetDevice");
  check(cudaFree(nullptr), "cudaFree");  // creates the primary context
  const CUmemAllocationProp prop = glake_probe::device_memory(device);
  const std::size_t chunk = glake_probe::granularity(prop);

  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaEvent_t event;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
  void* pinned = nullptr;
  check(cudaMallocHost(&pinned, 4096), "cudaMallocHost");
  void* small = nullptr;
  check(cudaMalloc(&small, 4096), "cudaMalloc");
  // Four spare handles for the stitch column: mapped into a fresh range and unmapped, as a stitch
  // of four handles does.
  std::vector<CUmemGenericAllocationHandle> spare(4);
  for (auto& s : spare) check(cuMemCreate(&s, chunk, &prop, 0), "cuMemCreate");

  std::printf("median us over 200 calls each; K handles of %zu MiB, each mapped twice\n", chunk >> 20);
  std::printf("%7s %10s %10s %12s %12s %12s %14s %14s\n", "K", "memGetInfo", "launch", "launch+sync",
              "event rec+q", "memcpy 4KiB", "malloc+free 2M", "stitch 4 (us)");
  held h;
  for (const std::size_t k : {std::size_t{0}, std::size_t{1024}, std::size_t{4096}, std::size_t{12288}, std::size_t{16384}}) {
    hold(h, k, chunk, prop, device);
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const int n = 200;
    const double info = median_us(n, [] {
      std::size_t free_bytes = 0, total = 0;
      check(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo");
    });
    const double launch = median_us(n, [&] { empty_kernel<<<1, 1, 0, stream>>>(); });
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    const double launch_sync = median_us(n, [&] {
      empty_kernel<<<1, 1, 0, stream>>>();
      check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    });
    const double event_us = median_us(n, [&] {
      check(cudaEventRecord(event, stream), "cudaEventRecord");
      (void)cudaEventQuery(event);
    });
    const double copy = median_us(n, [&] {
      check(cudaMemcpyAsync(small, pinned, 4096, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
      check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    });
    const double malloc_free = median_us(n, [] {
      void* p = nullptr;
      check(cudaMalloc(&p, 2 << 20), "cudaMalloc");
      check(cudaFree(p), "cudaFree");
    });
    const double stitch = median_us(n, [&] {
      held s;
      s.handles = spare;
      s.bytes = spare.size() * chunk;
      check(cuMemAddressReserve(&s.segment, s.bytes, chunk, 0, 0), "cuMemAddressReserve");
      map_all(s, s.segment, chunk, device);
      check(cuMemUnmap(s.segment, s.bytes), "cuMemUnmap");
      check(cuMemAddressFree(s.segment, s.bytes), "cuMemAddressFree");
    });
    std::printf("%7zu %10.2f %10.2f %12.2f %12.2f %12.2f %14.2f %14.2f\n", k, info, launch, launch_sync, event_us, copy,
                malloc_free, stitch);
  }
  hold(h, 0, chunk, prop, device);
  for (auto handle : h.handles) check(cuMemRelease(handle), "cuMemRelease");
  for (auto s : spare) check(cuMemRelease(s), "cuMemRelease");
  std::printf("A call whose cost grows with K is paid in every training step under glake, not under PyTorch's allocator.\n");
  return 0;
}
