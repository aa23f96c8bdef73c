// Can a stitch's driver calls leave the training thread? (issue 5: FSDP N's remaining step time)
//
// glake's extra step time under FSDP is its driver calls: each mapped handle costs ~20-50 us of
// cuMemMap + cuMemSetAccess on the thread that asked for memory. A stitch's address could be
// handed out at once and its handles mapped by a helper thread, the request's stream told to wait
// for a flag the helper sets when done (cuStreamWaitValue32): the GPU runs behind the host, so it
// would seldom wait. This probe measures what that needs:
//   1. the training thread's cost of a kernel launch, alone and while a helper thread maps and
//      unmaps handles (does the driver's lock make the launches wait?);
//   2. the helper's cost per handle, alone and while the launches run;
//   3. a gated use: a range reserved, a gate and kernels writing and checking the range queued at
//      once, the handles mapped by the helper afterwards, which then opens the gate; the kernels'
//      writes are checked. Gate "hostfn" (the default): a host function (cudaLaunchHostFunc)
//      that holds the stream until the helper sets an atomic. Gate "value": cuStreamWaitValue32
//      on a device flag the helper sets with cuStreamWriteValue32 from its own stream. On the
//      H200 (driver 580.159.04) "value" hung after the helper had mapped and granted access, so
//      run it under `timeout`.
//
//   nvcc -std=c++17 -O2 -arch=sm_90 bench/gpu_async_map.cu -lcuda -o /tmp/async_map && /tmp/async_map [hostfn|value|skip]
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "gpu_check.hpp"

namespace {

using glake_probe::check;
using glake_probe::median;
using clock_type = std::chrono::steady_clock;

constexpr int kHandles = 64;
constexpr int kLaunches = 20000;
constexpr int kRounds = 5;

__global__ void empty_kernel() {}

__global__ void fill(unsigned* p, std::size_t n, unsigned salt) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    p[i] = static_cast<unsigned>(i) ^ salt;
  }
}

__global__ void count_wrong(const unsigned* p, std::size_t n, unsigned salt, unsigned long long* wrong) {
  unsigned long long local = 0;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    local += p[i] != (static_cast<unsigned>(i) ^ salt);
  }
  if (local != 0) atomicAdd(wrong, local);
}

double us_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::micro>(clock_type::now() - t0).count();
}

struct mapper {
  int device;
  std::size_t handle_bytes;
  std::vector<CUmemGenericAllocationHandle> handles;

  CUmemAccessDesc access() const { return glake_probe::device_access(device); }
  std::size_t bytes() const { return handles.size() * handle_bytes; }

  CUdeviceptr reserve() const {
    CUdeviceptr base = 0;
    check(cuMemAddressReserve(&base, bytes(), 0, 0, 0), "cuMemAddressReserve");
    return base;
  }
  // Maps every handle side by side at `base` and grants access: us per handle.
  double map(CUdeviceptr base) const {
    const auto t0 = clock_type::now();
    for (std::size_t i = 0; i < handles.size(); ++i) {
      check(cuMemMap(base + i * handle_bytes, handle_bytes, 0, handles[i], 0), "cuMemMap");
    }
    const CUmemAccessDesc a = access();
    check(cuMemSetAccess(base, bytes(), &a, 1), "cuMemSetAccess");
    return us_since(t0) / handles.size();
  }
  // Unmaps them: us per handle.
  double unmap(CUdeviceptr base) const {
    const auto t0 = clock_type::now();
    for (std::size_t i = 0; i < handles.size(); ++i) check(cuMemUnmap(base + i * handle_bytes, handle_bytes), "cuMemUnmap");
    return us_since(t0) / handles.size();
  }
  void release_range(CUdeviceptr base) const { check(cuMemAddressFree(base, bytes()), "cuMemAddressFree"); }
};

// ns per launch of `kLaunches` empty kernels on `stream`, host time only.
double launch_ns(cudaStream_t stream) {
  const auto t0 = clock_type::now();
  for (int i = 0; i < kLaunches; ++i) empty_kernel<<<1, 32, 0, stream>>>();
  const double ns = us_since(t0) * 1000.0 / kLaunches;
  check(cudaGetLastError(), "launch");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return ns;
}

}  // namespace

std::atomic<int> host_gate{0};

// A host function that holds its stream until the helper thread opens the gate.
void CUDART_CB wait_for_gate(void*) {
  while (host_gate.load() == 0) std::this_thread::yield();
}

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IONBF, 0);  // a hang shows how far it got
  // Which part 3 runs: "hostfn", "value" or "skip" (see the top of the file).
  const std::string gate = argc > 1 ? argv[1] : "hostfn";
  if (gate != "hostfn" && gate != "value" && gate != "skip") {
    std::fprintf(stderr, "usage: %s [hostfn|value|skip]\n", argv[0]);
    return 2;
  }
  const int device = 0;
  check(cudaSetDevice(device), "cudaSetDevice");
  check(cudaFree(nullptr), "cudaFree(0)");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  std::printf("%s\n", prop.name);

  mapper m{device, 8u << 20, {}};
  const CUmemAllocationProp memory = glake_probe::device_memory(device);
  m.handles.resize(kHandles);
  for (auto& h : m.handles) check(cuMemCreate(&h, m.handle_bytes, &memory, 0), "cuMemCreate");

  cudaStream_t stream = nullptr, helper_stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaStreamCreateWithFlags(&helper_stream, cudaStreamNonBlocking), "cudaStreamCreate");
  launch_ns(stream);  // warm-up

  std::printf("1. launches and mapping, each alone\n");
  // 1-2. Launches and mapping, each alone and together.
  std::vector<double> alone_launch, alone_map, alone_unmap, both_launch, both_map, both_unmap;
  for (int r = 0; r < kRounds; ++r) {
    alone_launch.push_back(launch_ns(stream));
    const CUdeviceptr base = m.reserve();
    alone_map.push_back(m.map(base));
    alone_unmap.push_back(m.unmap(base));
    m.release_range(base);
  }
  std::printf("2. launches while a helper thread maps\n");
  for (int r = 0; r < kRounds; ++r) {
    std::atomic<bool> stop{false};
    std::vector<double> maps, unmaps;
    std::thread helper([&] {
      check(cudaSetDevice(device), "cudaSetDevice (helper)");
      const CUdeviceptr base = m.reserve();
      while (!stop.load()) {
        maps.push_back(m.map(base));
        unmaps.push_back(m.unmap(base));
      }
      m.release_range(base);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    both_launch.push_back(launch_ns(stream));
    stop.store(true);
    helper.join();
    both_map.push_back(median(maps));
    both_unmap.push_back(median(unmaps));
  }
  std::printf("launch, ns (median of %d x %d): alone %.0f, with a helper mapping %.0f\n", kRounds, kLaunches,
              median(alone_launch), median(both_launch));
  std::printf("helper, us per 8 MiB handle: map+access alone %.1f, during launches %.1f; unmap alone %.1f, during %.1f\n",
              median(alone_map), median(both_map), median(alone_unmap), median(both_unmap));

  // 3. Gated use: queue the wait and the work first, map afterwards.
  if (gate == "skip") return 0;
  std::printf("3. gated use, gate %s\n", gate.c_str());
  CUdeviceptr flag = 0;
  unsigned long long* wrong = nullptr;
  check(cuMemAlloc(&flag, sizeof(unsigned)), "cuMemAlloc(flag)");
  check(cudaMalloc(&wrong, sizeof(*wrong)), "cudaMalloc");
  const std::size_t n = m.bytes() / sizeof(unsigned);
  for (int r = 0; r < kRounds; ++r) {
    check(cuMemsetD32(flag, 0, 1), "cuMemsetD32");
    check(cudaMemset(wrong, 0, sizeof(*wrong)), "cudaMemset");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const CUdeviceptr base = m.reserve();
    auto* p = reinterpret_cast<unsigned*>(base);
    const auto t0 = clock_type::now();
    host_gate.store(0);
    if (gate == "hostfn") {
      check(cudaLaunchHostFunc(stream, wait_for_gate, nullptr), "cudaLaunchHostFunc");
    } else {
      check(cuStreamWaitValue32(reinterpret_cast<CUstream>(stream), flag, 1, CU_STREAM_WAIT_VALUE_GEQ),
            "cuStreamWaitValue32");
    }
    fill<<<264, 256, 0, stream>>>(p, n, 0x5a5a0000u + r);
    count_wrong<<<264, 256, 0, stream>>>(p, n, 0x5a5a0000u + r, wrong);
    check(cudaGetLastError(), "launch");
    const double enqueue_us = us_since(t0);
    std::printf("   queued in %.1f us; mapping\n", enqueue_us);
    double map_us = 0;
    std::thread helper([&] {
      check(cudaSetDevice(device), "cudaSetDevice (helper)");
      const auto t1 = clock_type::now();
      for (std::size_t i = 0; i < m.handles.size(); ++i) {
        check(cuMemMap(base + i * m.handle_bytes, m.handle_bytes, 0, m.handles[i], 0), "cuMemMap");
      }
      std::printf("   mapped; granting access\n");
      const CUmemAccessDesc a = m.access();
      check(cuMemSetAccess(base, m.bytes(), &a, 1), "cuMemSetAccess");
      map_us = us_since(t1);
      std::printf("   access granted; opening the gate\n");
      if (gate == "hostfn") {
        host_gate.store(1);
      } else {
        check(cuStreamWriteValue32(reinterpret_cast<CUstream>(helper_stream), flag, 1, 0), "cuStreamWriteValue32");
      }
    });
    helper.join();
    const double queued_us = us_since(t0);
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    const double done_us = us_since(t0);
    unsigned long long bad = ~0ull;
    check(cudaMemcpy(&bad, wrong, sizeof(bad), cudaMemcpyDeviceToHost), "cudaMemcpy");
    std::printf("gated round %d: wait + 2 kernels queued in %.1f us; helper mapped %d handles in %.0f us; "
                "flag set at %.0f us, work done at %.0f us; wrong words: %llu of %zu\n",
                r, enqueue_us, kHandles, map_us, queued_us, done_us, bad, n);
    m.unmap(base);
    m.release_range(base);
  }
  check(cudaFree(wrong), "cudaFree");
  check(cuMemFree(flag), "cuMemFree");
  for (auto& h : m.handles) check(cuMemRelease(h), "cuMemRelease");
  std::printf("done\n");
  return 0;
}
