// Do the CUDA calls a training step makes get slower as the process holds more VMM handles?
//
// glake builds device memory from 2 MiB physical handles (cuMemCreate), each mapped into a segment
// and, for stitched ranges, once more elsewhere: a fine-tuning run holds ~12,000 handles and ~20,000
// mappings where PyTorch's default allocator holds a few hundred cudaMalloc segments. If a call a
// training step makes anyway (a kernel launch, an event, cudaMemGetInfo, the per-handle cost of
// mapping a stitch) scaled with that count, glake would pay it in every step, outside its own
// calls. This probe times those calls with K handles created and mapped twice (a segment range
// and alias ranges, as a stitch maps them), for K from 0 up to 16,384 (32 GiB). By default the
// aliases are one range; with an argument R they are K/R ranges of R handles each, so the number
// of reserved ranges grows too (glake reserves one per segment and one per stitch). Memsets of
// 4 KiB into cudaMalloc'd and into VMM-mapped memory are timed as well (PyTorch issues them for
// zero-filled tensors).
//
//   nvcc -std=c++17 -O2 -arch=sm_90 bench/gpu_handle_count.cu -lcuda -o /tmp/handle_count && /tmp/handle_count [R]
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
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
  CUdeviceptr segment = 0;
  std::vector<CUdeviceptr> aliases;  // each maps `per_alias` handles (the last one maybe fewer)
  std::size_t bytes = 0, per_alias = 0;
};

// Maps handles[first, first + count) side by side at `base` and opens them to the device.
void map_range(const held& h, std::size_t first, std::size_t count, CUdeviceptr base, std::size_t chunk, int device) {
  for (std::size_t i = 0; i < count; ++i) check(cuMemMap(base + i * chunk, chunk, 0, h.handles[first + i], 0), "cuMemMap");
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  check(cuMemSetAccess(base, count * chunk, &access, 1), "cuMemSetAccess");
}

void unmap_range(CUdeviceptr base, std::size_t bytes) {
  check(cuMemUnmap(base, bytes), "cuMemUnmap");
  check(cuMemAddressFree(base, bytes), "cuMemAddressFree");
}

// Grows `h` to `count` handles, each mapped in one segment range and in an alias range of
// `per_alias` handles (all of them in one when per_alias is 0).
void hold(held& h, std::size_t count, std::size_t per_alias, std::size_t chunk, const CUmemAllocationProp& prop,
          int device) {
  if (h.bytes != 0) {
    unmap_range(h.segment, h.bytes);
    for (std::size_t i = 0; i < h.aliases.size(); ++i) {
      unmap_range(h.aliases[i], std::min(h.per_alias, h.handles.size() - i * h.per_alias) * chunk);
    }
    h.aliases.clear();
  }
  while (h.handles.size() < count) {
    CUmemGenericAllocationHandle handle{};
    check(cuMemCreate(&handle, chunk, &prop, 0), "cuMemCreate");
    h.handles.push_back(handle);
  }
  h.bytes = count * chunk;
  h.per_alias = per_alias == 0 ? std::max<std::size_t>(count, 1) : per_alias;
  if (count == 0) return;
  check(cuMemAddressReserve(&h.segment, h.bytes, chunk, 0, 0), "cuMemAddressReserve");
  map_range(h, 0, count, h.segment, chunk, device);
  for (std::size_t first = 0; first < count; first += h.per_alias) {
    const std::size_t n = std::min(h.per_alias, count - first);
    CUdeviceptr alias = 0;
    check(cuMemAddressReserve(&alias, n * chunk, chunk, 0, 0), "cuMemAddressReserve");
    map_range(h, first, n, alias, chunk, device);
    h.aliases.push_back(alias);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t per_alias = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 0;
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

  std::printf("median us over 200 calls each; K handles of %zu MiB, each mapped twice (aliases: %s)\n", chunk >> 20,
              per_alias == 0 ? "one range" : (std::to_string(per_alias) + " handles a range").c_str());
  std::printf("%7s %10s %10s %12s %12s %12s %14s %14s %12s %12s\n", "K", "memGetInfo", "launch", "launch+sync",
              "event rec+q", "memcpy 4KiB", "malloc+free 2M", "stitch 4 (us)", "memset dev", "memset vmm");
  held h;
  for (const std::size_t k : {std::size_t{0}, std::size_t{1024}, std::size_t{4096}, std::size_t{12288}, std::size_t{16384}}) {
    hold(h, k, per_alias, chunk, prop, device);
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
      map_range(s, 0, spare.size(), s.segment, chunk, device);
      unmap_range(s.segment, s.bytes);
    });
    // A memset into the middle of the mapped memory (the spare handles' when none are held).
    held target;
    target.handles = spare;
    target.bytes = spare.size() * chunk;
    CUdeviceptr vmm = h.aliases.empty() ? 0 : h.aliases[h.aliases.size() / 2];
    if (vmm == 0) {
      check(cuMemAddressReserve(&target.segment, target.bytes, chunk, 0, 0), "cuMemAddressReserve");
      map_range(target, 0, spare.size(), target.segment, chunk, device);
      vmm = target.segment;
    }
    const double memset_dev = median_us(n, [&] { check(cudaMemsetAsync(small, 0, 4096, stream), "cudaMemsetAsync"); });
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    const double memset_vmm = median_us(n, [&] {
      check(cudaMemsetAsync(reinterpret_cast<void*>(vmm), 0, 4096, stream), "cudaMemsetAsync");
    });
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    if (target.segment != 0) unmap_range(target.segment, target.bytes);
    std::printf("%7zu %10.2f %10.2f %12.2f %12.2f %12.2f %14.2f %14.2f %12.2f %12.2f\n", k, info, launch, launch_sync,
                event_us, copy, malloc_free, stitch, memset_dev, memset_vmm);
  }
  hold(h, 0, per_alias, chunk, prop, device);
  for (auto handle : h.handles) check(cuMemRelease(handle), "cuMemRelease");
  for (auto s : spare) check(cuMemRelease(s), "cuMemRelease");
  std::printf("A call whose cost grows with K is paid in every training step under glake, not under PyTorch's allocator.\n");
  return 0;
}
