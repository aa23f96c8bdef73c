// Can an allocator hand out an address and map it later, on a helper thread? Two questions:
//   A. Which stream operations does the driver refuse when they are queued on an address range
//      that is only reserved, or mapped but without access yet? (The work is held by a host
//      function until the range is mapped and accessible, as a gate on the stream would.)
//   B. Does a helper thread's cuMemMap / cuMemSetAccess still complete while the owning thread
//      waits in a synchronizing call (context, stream or event) for a stream that a host function
//      holds until the helper is done? If not, that is a deadlock.
// Part B runs first: its waits run in a thread the program abandons when they do not finish in
// 5 s. Part A prints each call's answer as soon as it returns.
//
// On an H100 (driver 580.159.04, 2026-11-23):
//   B. cudaDeviceSynchronize, cudaStreamSynchronize and cudaEventSynchronize all returned once the
//      helper had mapped and granted access: no deadlock.
//   A. Mapped and accessible: every call queued and ran. Mapped without access: cudaMemcpyAsync
//      (H2D with Default or HostToDevice, D2D, D2H) and cudaMemsetAsync were refused with
//      cudaErrorInvalidValue when queued; cudaPointerGetAttributes answered. Reserved only: the
//      first cudaMemcpyAsync never returned (in two runs, stopped by `timeout`), so the rest of
//      that state was not reached.
// So memory must be mapped and accessible before anything queues a copy on it: an allocator cannot
// hand out an address and map it later, whatever holds the stream.
//
//   nvcc -std=c++17 -O2 -arch=sm_90 bench/probes/gpu_async_hazards.cu -lcuda -o /tmp/hazards && timeout 120 /tmp/hazards
#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "gpu_check.hpp"

namespace {

using glake_probe::check;

std::atomic<int> gate_open{0};

void CUDART_CB hold_stream(void*) {
  while (gate_open.load() == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
}

struct range {
  CUdeviceptr base = 0;
  std::size_t bytes = 0;
  CUmemGenericAllocationHandle handle{};
};

const char* name_of(cudaError_t e) { return e == cudaSuccess ? "ok" : cudaGetErrorName(e); }

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  check(cudaSetDevice(0), "cudaSetDevice");
  check(cudaFree(nullptr), "cudaFree(0)");
  const CUmemAllocationProp prop = glake_probe::device_memory(0);
  const std::size_t g = glake_probe::granularity(prop);
  const CUmemAccessDesc a = glake_probe::device_access(0);
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  void* pinned = nullptr;
  check(cudaMallocHost(&pinned, g), "cudaMallocHost");
  void* device_buffer = nullptr;
  check(cudaMalloc(&device_buffer, g), "cudaMalloc");

  // B. The owning thread waits for the held stream; a helper maps and opens the gate.
  std::printf("B. a helper maps while the owner waits in a synchronizing call\n");
  const char* waits[] = {"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize"};
  for (int w = 0; w < 3; ++w) {
    range r{0, 8 * g, {}};
    check(cuMemCreate(&r.handle, r.bytes, &prop, 0), "cuMemCreate");
    check(cuMemAddressReserve(&r.base, r.bytes, 0, 0, 0), "cuMemAddressReserve");
    gate_open = 0;
    check(cudaLaunchHostFunc(s, hold_stream, nullptr), "cudaLaunchHostFunc");
    check(cudaMemsetAsync(device_buffer, 1, g, s), "cudaMemsetAsync");
    cudaEvent_t event = nullptr;
    check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
    check(cudaEventRecord(event, s), "cudaEventRecord");
    std::atomic<int> waited{0}, mapped{0};
    std::thread owner([&] {
      check(cudaSetDevice(0), "cudaSetDevice (owner)");
      cudaError_t e = w == 0 ? cudaDeviceSynchronize() : w == 1 ? cudaStreamSynchronize(s) : cudaEventSynchronize(event);
      waited = e == cudaSuccess ? 1 : 2;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the owner is now waiting
    std::thread helper([&] {
      check(cudaSetDevice(0), "cudaSetDevice (helper)");
      check(cuMemMap(r.base, r.bytes, 0, r.handle, 0), "cuMemMap");
      mapped = 1;
      check(cuMemSetAccess(r.base, r.bytes, &a, 1), "cuMemSetAccess");
      mapped = 2;
      gate_open = 1;
    });
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (waited.load() == 0 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    const char* helper_state = mapped.load() == 0 ? "stuck in cuMemMap" : mapped.load() == 1 ? "stuck in cuMemSetAccess" : "done";
    std::printf("  owner in %-22s: %s; helper %s\n", waits[w],
                waited.load() == 1 ? "returned" : waited.load() == 2 ? "returned an error" : "still waiting after 5 s",
                helper_state);
    if (waited.load() == 0) {
      std::printf("  deadlock: stopping here\n");
      std::fflush(stdout);
      std::_Exit(3);
    }
    owner.join();
    helper.join();
    check(cudaEventDestroy(event), "cudaEventDestroy");
    check(cuMemUnmap(r.base, r.bytes), "cuMemUnmap");
    check(cuMemAddressFree(r.base, r.bytes), "cuMemAddressFree");
    check(cuMemRelease(r.handle), "cuMemRelease");
  }
  // A. Each operation queued behind a held stream on a range in state `state`; then the range is
  // mapped and made accessible, the stream released, and synchronized.
  std::printf("A. operations queued on a range before it is ready (stream held meanwhile)\n");
  const char* states[] = {"reserved only", "mapped, no access", "mapped and accessible"};
  const char* ops[] = {"cudaMemcpyAsync H2D (pinned, Default)", "cudaMemcpyAsync H2D (pinned, HostToDevice)",
                       "cudaMemcpyAsync D2D (Default)", "cudaMemsetAsync", "cudaMemcpyAsync D2H (pinned, Default)",
                       "cudaPointerGetAttributes"};
  for (int state : {2, 1, 0}) {  // the riskiest last: a call that blocks ends the program
    for (int op = 0; op < 6; ++op) {
      range r{0, g, {}};
      check(cuMemCreate(&r.handle, g, &prop, 0), "cuMemCreate");
      check(cuMemAddressReserve(&r.base, g, 0, 0, 0), "cuMemAddressReserve");
      if (state >= 1) check(cuMemMap(r.base, g, 0, r.handle, 0), "cuMemMap");
      if (state >= 2) check(cuMemSetAccess(r.base, g, &a, 1), "cuMemSetAccess");
      gate_open = 0;
      check(cudaLaunchHostFunc(s, hold_stream, nullptr), "cudaLaunchHostFunc");
      void* p = reinterpret_cast<void*>(r.base);
      cudaError_t e = cudaSuccess;
      switch (op) {
        case 0: e = cudaMemcpyAsync(p, pinned, g, cudaMemcpyDefault, s); break;
        case 1: e = cudaMemcpyAsync(p, pinned, g, cudaMemcpyHostToDevice, s); break;
        case 2: e = cudaMemcpyAsync(p, device_buffer, g, cudaMemcpyDefault, s); break;
        case 3: e = cudaMemsetAsync(p, 0, g, s); break;
        case 4: e = cudaMemcpyAsync(pinned, p, g, cudaMemcpyDefault, s); break;
        case 5: {
          cudaPointerAttributes attributes{};
          e = cudaPointerGetAttributes(&attributes, p);
          if (e == cudaSuccess && attributes.type != cudaMemoryTypeDevice) e = cudaErrorUnknown;
          break;
        }
      }
      (void)cudaGetLastError();  // a refused call leaves a non-sticky error behind
      std::printf("  %-22s %-45s queued: %s\n", states[state], ops[op], name_of(e));
      if (state < 1) check(cuMemMap(r.base, g, 0, r.handle, 0), "cuMemMap");
      if (state < 2) check(cuMemSetAccess(r.base, g, &a, 1), "cuMemSetAccess");
      gate_open = 1;
      const cudaError_t after = cudaStreamSynchronize(s);
      std::printf("  %-22s %-45s ran: %s\n", "", "", name_of(after));
      if (after != cudaSuccess) {
        std::printf("  the stream failed; stopping (the error is sticky)\n");
        return 1;
      }
      check(cuMemUnmap(r.base, g), "cuMemUnmap");
      check(cuMemAddressFree(r.base, g), "cuMemAddressFree");
      check(cuMemRelease(r.handle), "cuMemRelease");
    }
  }

  std::printf("done\n");
  return 0;
}
