// What does room to grow cost? glake reserves `stitch_reserve` (default 2) times a stitched
// range's size of virtual address space, so a cached range can later grow in place by mapping
// handles after its end. This program times, per reservation size, on the device it runs on:
//   reserve+free      cuMemAddressReserve then cuMemAddressFree of the size, nothing mapped
//   stitch 1x / 2x    a stitch of 64 handles of 2 MiB (128 MiB): reserve 128 MiB or 256 MiB, map
//                     the 64 handles, one cuMemSetAccess over them; then unmap all and free
// Median and 90th percentile of 40 runs each, in microseconds.
//
//   nvcc -std=c++17 -O2 -arch=sm_90 bench/gpu_address_reserve.cu -lcuda -o /tmp/reserve && /tmp/reserve
#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "gpu_check.hpp"

namespace {

using glake_probe::check;

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void report(const char* what, std::vector<double> us) {
  std::sort(us.begin(), us.end());
  std::printf("%-34s n=%3zu median=%9.2f us  p90=%9.2f\n", what, us.size(), us[us.size() / 2], us[us.size() * 9 / 10]);
}

}  // namespace

int main() {
  check(cuInit(0), "cuInit");
  CUdevice device;
  check(cuDeviceGet(&device, 0), "cuDeviceGet");
  CUcontext context;
  check(cuDevicePrimaryCtxRetain(&context, device), "cuDevicePrimaryCtxRetain");
  check(cuCtxSetCurrent(context), "cuCtxSetCurrent");
  constexpr std::size_t MiB = std::size_t{1} << 20;
  constexpr int runs = 40;

  for (std::size_t size : {2 * MiB, 32 * MiB, 256 * MiB, 1024 * MiB, 4096 * MiB, 16384 * MiB, 65536 * MiB}) {
    std::vector<double> us;
    for (int r = 0; r < runs; ++r) {
      CUdeviceptr base = 0;
      const double t0 = now_us();
      check(cuMemAddressReserve(&base, size, 0, 0, 0), "cuMemAddressReserve");
      check(cuMemAddressFree(base, size), "cuMemAddressFree");
      us.push_back(now_us() - t0);
    }
    char label[64];
    std::snprintf(label, sizeof label, "reserve+free %zu MiB", size / MiB);
    report(label, us);
  }

  const CUmemAllocationProp prop = glake_probe::device_memory(0);
  constexpr std::size_t chunk = 2 * MiB, handles = 64, bytes = chunk * handles;
  std::vector<CUmemGenericAllocationHandle> h(handles);
  for (auto& one : h) check(cuMemCreate(&one, chunk, &prop, 0), "cuMemCreate");
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  for (std::size_t factor : {1, 2}) {
    std::vector<double> us;
    for (int r = 0; r < runs; ++r) {
      const std::size_t reserved = bytes * factor;
      CUdeviceptr base = 0;
      const double t0 = now_us();
      check(cuMemAddressReserve(&base, reserved, 0, 0, 0), "cuMemAddressReserve");
      for (std::size_t i = 0; i < handles; ++i) check(cuMemMap(base + i * chunk, chunk, 0, h[i], 0), "cuMemMap");
      check(cuMemSetAccess(base, bytes, &access, 1), "cuMemSetAccess");
      for (std::size_t i = 0; i < handles; ++i) check(cuMemUnmap(base + i * chunk, chunk), "cuMemUnmap");
      check(cuMemAddressFree(base, reserved), "cuMemAddressFree");
      us.push_back(now_us() - t0);
    }
    char label[64];
    std::snprintf(label, sizeof label, "stitch %zu x 2 MiB, reserve %zux", handles, factor);
    report(label, us);
  }
  for (auto& one : h) check(cuMemRelease(one), "cuMemRelease");
  check(cuDevicePrimaryCtxRelease(device), "cuDevicePrimaryCtxRelease");
  std::puts("done");
  return 0;
}
