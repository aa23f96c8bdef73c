// Do the driver's mapping calls run in parallel on several threads? (issue 5: with mapping on a
// helper thread, a step that maps much new memory makes the GPU wait for the helper; more
// helpers would help only if the driver does not serialise the calls.)
//
// For T = 1, 2, 4 threads at once, each maps 64 handles of 8 MiB side by side into its own range
// and grants access over it (cuMemMap x 64 + cuMemSetAccess), then unmaps them; and, separately,
// creates 64 handles of 8 MiB each (cuMemCreate) and releases them. Printed: the wall time per
// handle over all threads (what the helpers together would take per handle), median of 5 rounds.
// Scaling shows as a wall time per handle that falls with T.
//
//   nvcc -std=c++17 -O2 -arch=sm_90 bench/gpu_parallel_map.cu -lcuda -o /tmp/parallel_map && /tmp/parallel_map
#include <cuda.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "gpu_check.hpp"

namespace {

using glake_probe::check;
using glake_probe::median;
using clock_type = std::chrono::steady_clock;

constexpr int kHandles = 64;
constexpr std::size_t kHandleBytes = std::size_t{8} << 20;
constexpr int kRounds = 5;

// Runs `work(t)` on `threads` threads at once; returns the wall time in us.
template <class Work>
double wall_us(int threads, Work work) {
  std::vector<std::thread> pool;
  const auto t0 = clock_type::now();
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      check(cudaSetDevice(0), "cudaSetDevice");
      work(t);
    });
  }
  for (auto& th : pool) th.join();
  return std::chrono::duration<double, std::micro>(clock_type::now() - t0).count();
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  check(cudaSetDevice(0), "cudaSetDevice");
  check(cudaFree(nullptr), "cudaFree(0)");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("%s\n", prop.name);
  const CUmemAllocationProp memory = glake_probe::device_memory(0);
  const CUmemAccessDesc access = glake_probe::device_access(0);

  constexpr int kMaxThreads = 4;
  std::vector<std::vector<CUmemGenericAllocationHandle>> handles(kMaxThreads, std::vector<CUmemGenericAllocationHandle>(kHandles));
  for (auto& set : handles) {
    for (auto& h : set) check(cuMemCreate(&h, kHandleBytes, &memory, 0), "cuMemCreate");
  }
  std::vector<CUdeviceptr> bases(kMaxThreads);
  for (auto& b : bases) check(cuMemAddressReserve(&b, kHandles * kHandleBytes, 0, 0, 0), "cuMemAddressReserve");

  std::printf("threads | map+access, us per handle (wall, all threads) | unmap | create | release\n");
  for (int threads : {1, 2, 4}) {
    std::vector<double> map_us, unmap_us, create_us, release_us;
    const double handles_done = static_cast<double>(threads) * kHandles;
    for (int r = 0; r < kRounds; ++r) {
      map_us.push_back(wall_us(threads, [&](int t) {
                         for (int i = 0; i < kHandles; ++i) {
                           check(cuMemMap(bases[t] + i * kHandleBytes, kHandleBytes, 0, handles[t][i], 0), "cuMemMap");
                         }
                         check(cuMemSetAccess(bases[t], kHandles * kHandleBytes, &access, 1), "cuMemSetAccess");
                       }) / handles_done);
      unmap_us.push_back(wall_us(threads, [&](int t) {
                           for (int i = 0; i < kHandles; ++i) check(cuMemUnmap(bases[t] + i * kHandleBytes, kHandleBytes), "cuMemUnmap");
                         }) / handles_done);
      std::vector<std::vector<CUmemGenericAllocationHandle>> fresh(threads, std::vector<CUmemGenericAllocationHandle>(kHandles));
      create_us.push_back(wall_us(threads, [&](int t) {
                            for (auto& h : fresh[t]) check(cuMemCreate(&h, kHandleBytes, &memory, 0), "cuMemCreate");
                          }) / handles_done);
      release_us.push_back(wall_us(threads, [&](int t) {
                             for (auto h : fresh[t]) check(cuMemRelease(h), "cuMemRelease");
                           }) / handles_done);
    }
    std::printf("%d | %.1f | %.1f | %.1f | %.1f\n", threads, median(map_us), median(unmap_us), median(create_us),
                median(release_us));
  }
  for (auto b : bases) check(cuMemAddressFree(b, kHandles * kHandleBytes), "cuMemAddressFree");
  for (auto& set : handles) {
    for (auto h : set) check(cuMemRelease(h), "cuMemRelease");
  }
  return 0;
}
