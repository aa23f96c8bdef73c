// Does remapping a piece of memory between a device handle and a host-NUMA handle wait for
// copies running on the GPU, and what does each call cost by handle size?
//
// An offload copies piece after piece to host memory and remaps each piece once its copy is
// done, hoping to remap piece i while piece i+1 is still being copied. That only pays if the
// remap's driver calls (unmap, map, set access; create and release) neither wait for the copy
// engine nor slow it down. This program times each call idle, then while a 2 GiB
// device-to-pinned-host cudaMemcpyAsync runs on another stream, and reports how long that copy
// took against the same copy alone.
//
//   nvcc -std=c++17 -O2 -arch=sm_90 bench/probes/gpu_remap_during_copy.cu -lcuda -o /tmp/remap_copy && /tmp/remap_copy
#include <cuda.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <vector>

#include "gpu_check.hpp"

namespace {

using glake_probe::check;

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

CUmemAllocationProp properties(bool host) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = host ? CU_MEM_LOCATION_TYPE_HOST_NUMA : CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  return prop;
}

struct timings {
  double create = 0, map = 0, access = 0, unmap = 0, release = 0;
};

// Creates a handle, maps it at `at` with access, unmaps it and releases it, timing each call.
timings cycle(CUdeviceptr at, std::size_t bytes, bool host) {
  timings t;
  const CUmemAllocationProp prop = properties(host);
  CUmemGenericAllocationHandle h{};
  auto t0 = std::chrono::steady_clock::now();
  check(cuMemCreate(&h, bytes, &prop, 0), "cuMemCreate");
  t.create = ms_since(t0);
  t0 = std::chrono::steady_clock::now();
  check(cuMemMap(at, bytes, 0, h, 0), "cuMemMap");
  t.map = ms_since(t0);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = 0;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  t0 = std::chrono::steady_clock::now();
  check(cuMemSetAccess(at, bytes, &access, 1), "cuMemSetAccess");
  t.access = ms_since(t0);
  t0 = std::chrono::steady_clock::now();
  check(cuMemUnmap(at, bytes), "cuMemUnmap");
  t.unmap = ms_since(t0);
  t0 = std::chrono::steady_clock::now();
  check(cuMemRelease(h), "cuMemRelease");
  t.release = ms_since(t0);
  return t;
}

}  // namespace

int main() {
  cudaSetDevice(0);
  cudaFree(nullptr);
  const std::size_t copy_bytes = std::size_t{2} << 30;
  void* dev = nullptr;
  void* pinned = nullptr;
  check(cudaMalloc(&dev, copy_bytes), "cudaMalloc");
  check(cudaMallocHost(&pinned, copy_bytes), "cudaMallocHost");
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  auto copy_ms = [&](bool remap_meanwhile, std::size_t bytes, bool host, CUdeviceptr at, timings* out) {
    cudaEventRecord(start, stream);
    cudaMemcpyAsync(pinned, dev, copy_bytes, cudaMemcpyDeviceToHost, stream);
    cudaEventRecord(stop, stream);
    if (remap_meanwhile) {
      const auto launched = std::chrono::steady_clock::now();
      while (ms_since(launched) < 2) {
      }
      timings sum;
      for (int k = 0; k < 8; ++k) {
        const timings t = cycle(at, bytes, host);
        sum.create += t.create / 8;
        sum.map += t.map / 8;
        sum.access += t.access / 8;
        sum.unmap += t.unmap / 8;
        sum.release += t.release / 8;
      }
      *out = sum;
    }
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    return ms;
  };
  timings unused;
  copy_ms(false, 0, false, 0, &unused);  // warm-up
  const float alone = copy_ms(false, 0, false, 0, &unused);
  std::printf("2 GiB D2H copy alone: %.2f ms (%.1f GB/s)\n", alone, copy_bytes / alone / 1e6);
  std::printf("%-7s %-6s %-9s %9s %9s %9s %9s %9s %14s\n", "handle", "kind", "GPU", "create", "map", "access", "unmap",
              "release", "copy ms");
  for (std::size_t mib : {2, 32, 128}) {
    const std::size_t bytes = mib << 20;
    CUdeviceptr at = 0;
    check(cuMemAddressReserve(&at, bytes, 0, 0, 0), "cuMemAddressReserve");
    for (bool host : {false, true}) {
      (void)cycle(at, bytes, host);  // warm-up
      timings idle;
      for (int k = 0; k < 8; ++k) {
        const timings t = cycle(at, bytes, host);
        idle.create += t.create / 8;
        idle.map += t.map / 8;
        idle.access += t.access / 8;
        idle.unmap += t.unmap / 8;
        idle.release += t.release / 8;
      }
      std::printf("%4zu MiB %-6s %-9s %9.3f %9.3f %9.3f %9.3f %9.3f %14s\n", mib, host ? "host" : "device", "idle",
                  idle.create, idle.map, idle.access, idle.unmap, idle.release, "-");
      timings busy;
      const float with = copy_ms(true, bytes, host, at, &busy);
      std::printf("%4zu MiB %-6s %-9s %9.3f %9.3f %9.3f %9.3f %9.3f %8.2f (+%.2f)\n", mib, host ? "host" : "device",
                  "copying", busy.create, busy.map, busy.access, busy.unmap, busy.release, with, with - alone);
    }
    check(cuMemAddressFree(at, bytes), "cuMemAddressFree");
  }
  std::printf("Times in ms, means of 8. A call that waits for the copy shows ~%.0f ms; one that slows it shows in"
              " the copy's extra time.\n", alone);
  return 0;
}
