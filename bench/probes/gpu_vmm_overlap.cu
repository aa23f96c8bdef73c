// Do the CUDA VMM calls a stitch makes wait for work already running on the GPU?
//
// A stitch maps existing physical handles into a fresh virtual range (cuMemAddressReserve,
// cuMemMap per handle, cuMemSetAccess); dropping one unmaps them. If any of these calls waited
// for the device to go idle, every stitch built during training would also stall the host until
// the GPU's queue drained, a cost no per-call latency table shows. This program times each call
// with the GPU idle and again while a kernel of ~200 ms runs on another stream.
//
//   nvcc -std=c++17 -O2 -arch=sm_90 bench/probes/gpu_vmm_overlap.cu -lcuda -o /tmp/vmm_overlap && /tmp/vmm_overlap
#include <cuda.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "gpu_check.hpp"

namespace {

using glake_probe::check;

__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

struct timings {
  double reserve = 0, map = 0, access = 0, unmap = 0, free = 0;
};

// Maps `handles` side by side into a new range and unmaps it again, timing each kind of call.
timings stitch_once(const std::vector<CUmemGenericAllocationHandle>& handles, std::size_t chunk, int device) {
  timings t;
  const std::size_t size = handles.size() * chunk;
  CUdeviceptr base = 0;
  auto t0 = std::chrono::steady_clock::now();
  check(cuMemAddressReserve(&base, size, chunk, 0, 0), "cuMemAddressReserve");
  t.reserve = ms_since(t0);
  t0 = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < handles.size(); ++i) check(cuMemMap(base + i * chunk, chunk, 0, handles[i], 0), "cuMemMap");
  t.map = ms_since(t0);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  t0 = std::chrono::steady_clock::now();
  check(cuMemSetAccess(base, size, &access, 1), "cuMemSetAccess");
  t.access = ms_since(t0);
  t0 = std::chrono::steady_clock::now();
  check(cuMemUnmap(base, size), "cuMemUnmap");
  t.unmap = ms_since(t0);
  t0 = std::chrono::steady_clock::now();
  check(cuMemAddressFree(base, size), "cuMemAddressFree");
  t.free = ms_since(t0);
  return t;
}

}  // namespace

int main() {
  const int device = 0;
  cudaSetDevice(device);
  cudaFree(nullptr);  // creates the primary context
  const CUmemAllocationProp prop = glake_probe::device_memory(device);
  const std::size_t chunk = glake_probe::granularity(prop);
  const std::size_t count = 64;
  std::vector<CUmemGenericAllocationHandle> handles(count);
  for (auto& h : handles) check(cuMemCreate(&h, chunk, &prop, 0), "cuMemCreate");

  int clock_khz = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device);
  const long long cycles = static_cast<long long>(clock_khz) * 200;  // ~200 ms
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);

  (void)stitch_once(handles, chunk, device);  // warm-up
  std::printf("stitch of %zu handles of %zu MiB; times in ms\n", count, chunk >> 20);
  std::printf("%-28s %9s %9s %9s %9s %9s %12s\n", "GPU", "reserve", "map", "access", "unmap", "addrfree",
              "kernel left");
  for (int round = 0; round < 3; ++round) {
    const timings idle = stitch_once(handles, chunk, device);
    std::printf("%-28s %9.3f %9.3f %9.3f %9.3f %9.3f %12s\n", "idle", idle.reserve, idle.map, idle.access, idle.unmap,
                idle.free, "-");
    spin<<<1, 1, 0, stream>>>(cycles);
    cudaEvent_t done;
    cudaEventCreate(&done);
    cudaEventRecord(done, stream);
    const auto launched = std::chrono::steady_clock::now();
    while (ms_since(launched) < 5) {
    }  // let the kernel start
    const timings busy = stitch_once(handles, chunk, device);
    const bool still_running = cudaEventQuery(done) == cudaErrorNotReady;
    const auto t0 = std::chrono::steady_clock::now();
    cudaEventSynchronize(done);
    const double left = ms_since(t0);
    std::printf("%-28s %9.3f %9.3f %9.3f %9.3f %9.3f %9.1f ms%s\n", "kernel of ~200 ms running", busy.reserve,
                busy.map, busy.access, busy.unmap, busy.free, left, still_running ? "" : " (done)");
    cudaEventDestroy(done);
  }
  for (auto h : handles) check(cuMemRelease(h), "cuMemRelease");
  std::printf("A call that waits for the device shows ~200 ms in its column and ~0 kernel time left.\n");
  return 0;
}
