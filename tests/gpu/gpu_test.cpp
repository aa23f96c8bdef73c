// Tests on a real GPU: the CUDA backend, stitched blocks written by kernels, several streams,
// running out of device memory, and rollback when a driver call fails.
// Run by tests/gpu/run_or_skip.sh, which skips (exit 77) where there is no GPU.
#include <doctest/doctest.h>

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/cuda.hpp"
#include "glake/backends/fault_injection.hpp"
#include "gpu_checks.hpp"
#include "kernels.hpp"

namespace {

using namespace glake;
using cuda_stitching = stitching_allocator<cuda_provider, cuda_reserver>;
constexpr std::size_t M = MiB;

using gpu_test::device_free_bytes;
using gpu_test::mismatches;

config stitch_everything() {
  config cfg;
  cfg.frag_limit = 0;
  return cfg;
}

}  // namespace

TEST_CASE("gpu: the CUDA provider and reserver keep CUDA's rules, one handle mapped twice shows the same bytes") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);  // the runtime's context, shared with the driver calls
  cuda_provider provider(0);
  cuda_reserver reserver(0);
  const std::size_t g = provider.granularity();
  CHECK(g >= 2 * M);
  CHECK((g & (g - 1)) == 0);
  CHECK(reserver.granularity() == g);
  CHECK(provider.location() == memory_location::device);
  CHECK_THROWS_AS((void)provider.try_create(g + 1), usage_error);

  auto handle = provider.try_create(4 * g);
  REQUIRE(handle.has_value());
  void* a = reserver.try_reserve(4 * g);
  void* b = reserver.try_reserve(4 * g);
  REQUIRE(a != nullptr);
  REQUIRE(b != nullptr);
  REQUIRE(reserver.try_map(a, 4 * g, *handle));
  REQUIRE(reserver.try_map(b, 4 * g, *handle));
  REQUIRE(reserver.try_set_access(a, 4 * g));
  REQUIRE(reserver.try_set_access(b, 4 * g));
  REQUIRE(gpu_test::fill(a, 4 * g, 7) == cudaSuccess);
  CHECK(mismatches(b, 4 * g, 7) == 0);  // written through one mapping, read through the other
  // A mapping at an offset into a handle is refused by the driver: handles are mapped whole.
  CHECK_THROWS_AS((void)reserver.try_map(static_cast<char*>(a), g, *handle), cuda_error);
  reserver.unmap(a, 4 * g);
  reserver.unmap(b, 4 * g);
  reserver.free(a, 4 * g);
  reserver.free(b, 4 * g);
  provider.release(*handle);
}

TEST_CASE("gpu: a kernel writes a stitched block and the host reads back what it wrote") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  cuda_stitching allocator(cuda_provider(0), cuda_reserver(0), stitch_everything());
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) {
    blocks.push_back(allocator.allocate(64 * M));
    REQUIRE(gpu_test::fill(blocks[i], 64 * M, 100 + i) == cudaSuccess);
  }
  allocator.deallocate(blocks[0], 64 * M);
  allocator.deallocate(blocks[2], 64 * M);
  const std::size_t reserved = allocator.stats().reserved_bytes;
  void* stitched = allocator.allocate(128 * M);
  CHECK(allocator.stats().stitches == 1);
  CHECK(allocator.stats().reserved_bytes == reserved);
  REQUIRE(gpu_test::fill(stitched, 128 * M, 999) == cudaSuccess);
  CHECK(mismatches(stitched, 128 * M, 999) == 0);
  // Host read-back through cudaMemcpy, across the seam between the two stitched blocks.
  std::vector<unsigned int> host(2);
  const std::size_t seam_word = 64 * M / 4 - 1;
  REQUIRE(cudaMemcpy(host.data(), static_cast<unsigned int*>(stitched) + seam_word, 8, cudaMemcpyDeviceToHost) ==
          cudaSuccess);
  CHECK(host[0] == (static_cast<unsigned int>(seam_word * 2654435761u) ^ 999u));
  CHECK(host[1] == (static_cast<unsigned int>((seam_word + 1) * 2654435761u) ^ 999u));
  // The live neighbours kept their contents.
  CHECK(mismatches(blocks[1], 64 * M, 101) == 0);
  CHECK(mismatches(blocks[3], 64 * M, 103) == 0);
  allocator.deallocate(stitched, 128 * M);
  allocator.deallocate(blocks[1], 64 * M);
  allocator.deallocate(blocks[3], 64 * M);
  allocator.verify();
}

TEST_CASE("gpu: copies and memsets queued right after allocate run, on new memory and on a stitch") {
  // The driver checks a copy's or memset's memory when the call is queued, not when it runs
  // (bench/gpu_async_hazards.cu): memory must be mapped and accessible when allocate returns.
  // Kernels alone would not notice memory that becomes ready only before they run.
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  cudaStream_t s = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  constexpr std::size_t piece = 4 * M;
  unsigned char* host = nullptr;  // [in | out | out]
  REQUIRE(cudaMallocHost(reinterpret_cast<void**>(&host), 3 * piece) == cudaSuccess);
  for (std::size_t i = 0; i < piece; ++i) host[i] = static_cast<unsigned char>(i * 7 + 1);
  {
    config cfg = stitch_everything();
    cfg.max_handle = 8 * M;
    cuda_stitching allocator(cuda_provider(0), cuda_reserver(0), cfg);
    // Each call is queued at once after allocate; the stream then runs them in order.
    auto copies_run = [&](void* p, std::size_t bytes) {
      auto* d = static_cast<unsigned char*>(p);
      REQUIRE(cudaMemsetAsync(d, 0xab, bytes, s) == cudaSuccess);
      REQUIRE(cudaMemcpyAsync(d, host, piece, cudaMemcpyDefault, s) == cudaSuccess);
      REQUIRE(cudaMemcpyAsync(host + piece, d, piece, cudaMemcpyDefault, s) == cudaSuccess);
      REQUIRE(cudaMemcpyAsync(host + 2 * piece, d + bytes - piece, piece, cudaMemcpyDeviceToHost, s) == cudaSuccess);
      REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
      CHECK(std::memcmp(host, host + piece, piece) == 0);
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < piece; ++i) wrong += host[2 * piece + i] != 0xab;
      CHECK(wrong == 0);
    };
    std::vector<void*> blocks;
    for (int i = 0; i < 6; ++i) {
      blocks.push_back(allocator.allocate(64 * M, stream_ref{s}));
      copies_run(blocks.back(), 64 * M);
    }
    for (int i = 0; i < 6; i += 2) allocator.deallocate(blocks[i], 64 * M, stream_ref{s});
    void* stitched = allocator.allocate(192 * M, stream_ref{s});
    CHECK(allocator.stats().stitches == 1);
    copies_run(stitched, 192 * M);
    allocator.deallocate(stitched, 192 * M, stream_ref{s});
    for (int i = 1; i < 6; i += 2) allocator.deallocate(blocks[i], 64 * M, stream_ref{s});
    allocator.verify();
  }
  cudaFreeHost(host);
  cudaStreamDestroy(s);
}

TEST_CASE("gpu: a repaired cached stitch serves kernels and no longer maps the block that took part of it") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  cuda_stitching allocator(cuda_provider(0), cuda_reserver(0), stitch_everything());
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) {
    blocks.push_back(allocator.allocate(64 * M));
    REQUIRE(gpu_test::fill(blocks[i], 64 * M, 100 + i) == cudaSuccess);
  }
  allocator.deallocate(blocks[0], 64 * M);
  allocator.deallocate(blocks[2], 64 * M);
  void* stitched = allocator.allocate(128 * M);
  REQUIRE(allocator.stats().stitches == 1);
  REQUIRE(gpu_test::fill(stitched, 128 * M, 5) == cudaSuccess);
  allocator.deallocate(stitched, 128 * M);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);  // the range's work is done: it may be remapped
  void* hole = allocator.allocate(16 * M);           // in place, over 8 of the range's chunks
  REQUIRE(gpu_test::fill(hole, 16 * M, 77) == cudaSuccess);
  allocator.deallocate(blocks[1], 64 * M);           // spare chunks outside the range
  const std::size_t reserved = allocator.stats().reserved_bytes;
  void* again = allocator.allocate(128 * M);
  CHECK(again == stitched);
  CHECK(allocator.stats().stitch_repairs == 1);
  CHECK(allocator.stats().reserved_bytes == reserved);
  REQUIRE(gpu_test::fill(again, 128 * M, 999) == cudaSuccess);
  CHECK(mismatches(again, 128 * M, 999) == 0);
  CHECK(mismatches(hole, 16 * M, 77) == 0);  // written through the range before; not any more
  CHECK(mismatches(blocks[3], 64 * M, 103) == 0);
  allocator.deallocate(again, 128 * M);
  allocator.deallocate(hole, 16 * M);
  allocator.deallocate(blocks[3], 64 * M);
  allocator.verify();
  allocator.release_cached();
  CHECK(allocator.stats().reserved_bytes == 0);
}

TEST_CASE("gpu: a cached stitch grows in place into its reserved addresses and serves kernels") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  cuda_stitching allocator(cuda_provider(0), cuda_reserver(0), stitch_everything());
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) {
    blocks.push_back(allocator.allocate(64 * M));
    REQUIRE(gpu_test::fill(blocks[i], 64 * M, 100 + i) == cudaSuccess);
  }
  allocator.deallocate(blocks[0], 64 * M);
  allocator.deallocate(blocks[2], 64 * M);
  void* stitched = allocator.allocate(128 * M);
  REQUIRE(allocator.stats().stitches == 1);
  REQUIRE(gpu_test::fill(stitched, 128 * M, 5) == cudaSuccess);
  allocator.deallocate(stitched, 128 * M);
  allocator.deallocate(blocks[1], 64 * M);  // free chunks outside the range to grow it by
  const std::size_t reserved = allocator.stats().reserved_bytes;
  void* grown = allocator.allocate(160 * M);
  CHECK(grown == stitched);
  CHECK(allocator.stats().stitch_grows == 1);
  CHECK(allocator.stats().stitches == 1);
  CHECK(allocator.stats().reserved_bytes == reserved);
  REQUIRE(gpu_test::fill(grown, 160 * M, 999) == cudaSuccess);
  CHECK(mismatches(grown, 160 * M, 999) == 0);
  CHECK(mismatches(blocks[3], 64 * M, 103) == 0);
  allocator.deallocate(grown, 160 * M);
  allocator.deallocate(blocks[3], 64 * M);
  allocator.verify();
  allocator.release_cached();
  CHECK(allocator.stats().reserved_bytes == 0);
}

TEST_CASE("gpu: several streams at once each reuse their own blocks, kernels see their own data") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  stitching_allocator<cuda_provider, cuda_reserver, best_fit_tail_stitching, lru_eviction, mutex_lock> allocator(
      cuda_provider(0), cuda_reserver(0), stitch_everything());
  std::vector<std::thread> threads;
  std::vector<unsigned long long> errors(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      cudaStream_t stream = nullptr;
      if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
        errors[t] = 1;
        return;
      }
      for (int i = 0; i < 50; ++i) {
        const std::size_t bytes = (1 + (i * 7 + t) % 16) * 3 * M + 4096 * t;
        void* p = allocator.allocate(bytes, stream_ref{stream});
        const unsigned int seed = static_cast<unsigned int>(t * 1000 + i);
        unsigned long long bad = 0;
        if (gpu_test::fill(p, bytes & ~std::size_t{3}, seed, stream) != cudaSuccess ||
            gpu_test::count_mismatches(p, bytes & ~std::size_t{3}, seed, &bad, stream) != cudaSuccess) {
          bad = 1;
        }
        errors[t] += bad;
        allocator.deallocate(p, bytes, stream_ref{stream});  // after the synchronizing check
      }
      cudaStreamDestroy(stream);
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) CHECK(errors[t] == 0);
  allocator.verify();
  CHECK(allocator.stats().active_bytes == 0);
}

TEST_CASE("gpu: running out of the real device memory leaves the allocator usable") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  const std::size_t free_before = device_free_bytes();
  {
    config cfg;
    cfg.max_handle = 1 * GiB;  // fill the device with few driver calls
    cuda_stitching allocator(cuda_provider(0), cuda_reserver(0), cfg);
    std::vector<void*> held;
    for (;;) {
      void* p = allocator.try_allocate(4 * GiB);
      if (p == nullptr) break;
      held.push_back(p);
      REQUIRE(held.size() < 64);  // a device with more than 256 GiB would be news
    }
    CHECK(held.size() >= 1);
    CHECK_THROWS_AS((void)allocator.allocate(4 * GiB), out_of_memory);
    allocator.verify();
    // Usable afterwards: small requests still fit, and freed memory is reused at once.
    void* small = allocator.try_allocate(1000);
    allocator.deallocate(held.back(), 4 * GiB);
    held.pop_back();
    void* again = allocator.allocate(4 * GiB);
    REQUIRE(gpu_test::fill(again, 4 * GiB, 5) == cudaSuccess);
    CHECK(mismatches(again, 4 * GiB, 5) == 0);
    allocator.deallocate(again, 4 * GiB);
    if (small != nullptr) allocator.deallocate(small, 1000);
    for (void* p : held) allocator.deallocate(p, 4 * GiB);
    allocator.release_cached();
    allocator.verify();
    CHECK(allocator.stats().reserved_bytes == 0);
  }
  // Everything went back to the driver (within a little driver bookkeeping).
  CHECK(device_free_bytes() + 64 * M >= free_before);
}

TEST_CASE("gpu: a failure at any driver call of a stitch leaves allocator and device as they were") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  using faulty = stitching_allocator<fault_injecting_provider<cuda_provider>, fault_injecting_reserver<cuda_reserver>>;
  const std::size_t free_before = device_free_bytes();
  int sites = 0;
  for (std::uint64_t n = 1;; ++n) {
    CAPTURE(n);
    fault_plan plan;
    config cfg = stitch_everything();
    cfg.grow_stitch = true;
    faulty allocator(fault_injecting_provider<cuda_provider>(cuda_provider(0), plan),
                     fault_injecting_reserver<cuda_reserver>(cuda_reserver(0), plan), cfg);
    void* blocks[4];
    for (auto& b : blocks) b = allocator.allocate(8 * M);
    allocator.deallocate(blocks[0], 8 * M);
    allocator.deallocate(blocks[2], 8 * M);
    const statistics before = allocator.stats();
    plan.fail_nth_call(n);
    void* p = allocator.try_allocate(24 * M);  // 16 MiB stitched from the free blocks + 8 MiB new
    const bool injected = plan.faults_injected() > 0;
    plan.never_fail();
    allocator.verify();
    if (p == nullptr) {
      CHECK(allocator.stats().reserved_bytes == before.reserved_bytes);
      CHECK(allocator.stats().active_bytes == before.active_bytes);
      p = allocator.allocate(24 * M);
    }
    REQUIRE(gpu_test::fill(p, 24 * M, 3) == cudaSuccess);
    CHECK(mismatches(p, 24 * M, 3) == 0);
    allocator.deallocate(p, 24 * M);
    allocator.deallocate(blocks[1], 8 * M);
    allocator.deallocate(blocks[3], 8 * M);
    if (!injected) break;
    ++sites;
  }
  CHECK(sites >= 8);
  CHECK(device_free_bytes() + 64 * M >= free_before);  // nothing leaked on the device
}

TEST_CASE("gpu: a block still used by a kernel on another stream is not reused until that kernel is done") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  cudaStream_t a = nullptr, b = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking) == cudaSuccess);
  {
    cuda_stitching allocator(cuda_provider(0), cuda_reserver(0));
    void* p = allocator.allocate(8 * M, stream_ref{a});
    REQUIRE(gpu_test::spin(2'000'000'000LL, b) == cudaSuccess);  // about a second of work on b
    REQUIRE(gpu_test::fill(p, 8 * M, 1, b) == cudaSuccess);      // b writes p after it
    allocator.record_stream(p, stream_ref{b});
    allocator.deallocate(p, 8 * M, stream_ref{a});
    void* q = allocator.allocate(8 * M, stream_ref{a});
    CHECK(q != p);  // b's kernel may still write p
    REQUIRE(cudaStreamSynchronize(b) == cudaSuccess);
    void* r = allocator.allocate(8 * M, stream_ref{a});
    CHECK(r == p);  // b is done: the deferred free ran
    CHECK(mismatches(r, 8 * M, 1, a) == 0);  // and what b wrote was never overwritten meanwhile
    allocator.deallocate(q, 8 * M, stream_ref{a});
    allocator.deallocate(r, 8 * M, stream_ref{a});
    allocator.verify();
    const statistics st = allocator.stats();
    CHECK(st.events_recorded >= 1);  // the event on b that held p's free back
    CHECK(st.event_queries >= 1);    // asked until b was done
    CHECK(st.event_ns > 0);          // real driver calls, timed
  }
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
}

TEST_CASE("gpu: a peer named to the reserver reads and writes a stitched block of another device") {
  int devices = 0;
  REQUIRE(cudaGetDeviceCount(&devices) == cudaSuccess);
  if (devices < 2) {
    MESSAGE("needs two GPUs (this machine has " << devices << "): nothing checked");
    return;
  }
  int can_access = 0;
  REQUIRE(cudaDeviceCanAccessPeer(&can_access, 1, 0) == cudaSuccess);
  if (can_access == 0) {
    MESSAGE("device 1 cannot access device 0's memory: nothing checked");
    return;
  }
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  cuda_stitching allocator(cuda_provider(0), cuda_reserver(0, {1}), stitch_everything());
  void* a = allocator.allocate(32 * M);
  void* b = allocator.allocate(32 * M);
  void* c = allocator.allocate(32 * M);
  allocator.deallocate(a, 32 * M);
  allocator.deallocate(c, 32 * M);
  void* stitched = allocator.allocate(64 * M);
  REQUIRE(allocator.stats().stitches == 1);

  // Written by a kernel on device 1 through the stitched range, read back on device 0.
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  REQUIRE(gpu_test::fill(stitched, 64 * M, 4242) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  CHECK(mismatches(stitched, 64 * M, 4242) == 0);
  // And the other way: written on device 0, counted by a kernel on device 1.
  REQUIRE(gpu_test::fill(b, 32 * M, 77) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  CHECK(mismatches(b, 32 * M, 77) == 0);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  allocator.deallocate(stitched, 64 * M);
  allocator.deallocate(b, 32 * M);
  allocator.verify();
}

TEST_CASE("gpu: the stitching allocator offloads a block and a stitched block to host memory and back") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  config cfg;
  cfg.frag_limit = 0;  // stitch whatever no free block serves
  cuda_stitching allocator(cuda_provider(0), cuda_reserver(0), cfg);
  allocator.attach_far_memory(cuda_host_provider(0), cuda_copier{});
  const std::size_t M = MiB;
  void* plain = allocator.allocate(256 * M);
  REQUIRE(gpu_test::fill(plain, 256 * M, 71) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  const std::size_t free_before = gpu_test::device_free_bytes();
  allocator.offload(plain);
  CHECK(allocator.residence_of(plain) == residence::host);
  CHECK(gpu_test::device_free_bytes() >= free_before + 250 * M);  // the device memory went back
  CHECK(gpu_test::mismatches(plain, 256 * M, 71) == 0);           // read over the bus
  REQUIRE(gpu_test::fill(plain, 256 * M, 72) == cudaSuccess);     // and written
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  allocator.prefetch(plain);
  CHECK(gpu_test::mismatches(plain, 256 * M, 72) == 0);
  allocator.verify();

  // A stitched block: four freed 64 MiB blocks, the device's cache full of them.
  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(allocator.allocate(64 * M));
  for (int i = 0; i < 8; i += 2) allocator.deallocate(blocks[i], 64 * M);
  allocator.set_memory_limit(allocator.reserved_bytes());  // no growth: only a stitch serves it
  void* stitched = allocator.allocate(256 * M);
  REQUIRE(allocator.stats().stitches >= 1);
  REQUIRE(gpu_test::fill(stitched, 256 * M, 73) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  allocator.offload(stitched);
  CHECK(gpu_test::mismatches(stitched, 256 * M, 73) == 0);
  allocator.set_memory_limit(0);
  allocator.prefetch(stitched);
  CHECK(gpu_test::mismatches(stitched, 256 * M, 73) == 0);
  allocator.verify();
  allocator.deallocate(stitched, 256 * M);
  for (int i = 1; i < 8; i += 2) allocator.deallocate(blocks[i], 64 * M);
  allocator.deallocate(plain, 256 * M);
  allocator.verify();
}

TEST_CASE("gpu: far_residence::unmapped moves a block and a stitched block out and back, with their bytes") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  config cfg;
  cfg.frag_limit = 0;
  cuda_stitching allocator(cuda_provider(0), cuda_reserver(0), cfg);
  allocator.attach_far_memory(cuda_host_provider(0), cuda_copier{}, far_residence::unmapped);
  cudaStream_t work = nullptr, copies = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&work, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamCreateWithFlags(&copies, cudaStreamNonBlocking) == cudaSuccess);
  const stream_ref w{work}, c{copies};
  void* p = allocator.allocate(256 * M, w);
  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(allocator.allocate(64 * M, w));
  for (int i = 0; i < 8; i += 2) allocator.deallocate(blocks[i], 64 * M, w);
  allocator.set_memory_limit(allocator.reserved_bytes());  // only a stitch serves the next one
  void* stitched = allocator.allocate(256 * M, w);
  REQUIRE(allocator.stats().stitches >= 1);
  allocator.set_memory_limit(0);
  REQUIRE(cudaStreamSynchronize(work) == cudaSuccess);
  for (int round = 0; round < 3; ++round) {
    const unsigned char v = static_cast<unsigned char>(90 + 2 * round);
    // Written by kernels queued behind a long one: the deferred copies wait for them.
    REQUIRE(gpu_test::spin(100'000'000, work) == cudaSuccess);
    REQUIRE(gpu_test::fill(p, 256 * M, v, work) == cudaSuccess);
    REQUIRE(gpu_test::fill(stitched, 256 * M, v + 1, work) == cudaSuccess);
    const std::size_t free_before = device_free_bytes();
    allocator.offload(p, w, move_completion::deferred, c);
    allocator.offload(stitched, w, move_completion::deferred, c);
    allocator.complete_moves(true);
    CHECK(allocator.residence_of(p) == residence::host);
    CHECK(device_free_bytes() >= free_before + 500 * M);
    // Away, the addresses map nothing: the driver reports no backing there.
    int mapped = 1;
    const CUresult r = cuPointerGetAttribute(&mapped, CU_POINTER_ATTRIBUTE_MAPPED, reinterpret_cast<CUdeviceptr>(p));
    CHECK((r != CUDA_SUCCESS || mapped == 0));
    // Back with the copies on their own stream; the work stream waits for them by an event
    // (ready_on), the host does not: a kernel queued at once reads the bytes.
    REQUIRE(gpu_test::spin(100'000'000, copies) == cudaSuccess);  // the copies start late
    allocator.prefetch(p, w, move_completion::deferred, c);
    allocator.ready_on(p, w);
    CHECK(cudaStreamQuery(copies) == cudaErrorNotReady);  // the call did not wait for them
    CHECK(mismatches(p, 256 * M, v, work) == 0);
    allocator.prefetch(stitched, w);
    allocator.complete_moves(true);
    CHECK(allocator.stats().offloaded_bytes == 0);
    CHECK(mismatches(stitched, 256 * M, v + 1) == 0);
    REQUIRE(cuPointerGetAttribute(&mapped, CU_POINTER_ATTRIBUTE_MAPPED, reinterpret_cast<CUdeviceptr>(p)) == CUDA_SUCCESS);
    CHECK(mapped == 1);
    allocator.verify();
  }
  allocator.offload(p, w);
  allocator.deallocate(p, 256 * M, w);  // freed while away
  allocator.deallocate(stitched, 256 * M, w);
  for (int i = 1; i < 8; i += 2) allocator.deallocate(blocks[i], 64 * M, w);
  allocator.verify();
  REQUIRE(cudaStreamSynchronize(work) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(work) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(copies) == cudaSuccess);
}

TEST_CASE("gpu: a block marked keep_far_copy goes out without a copy and comes back with its bytes") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  cuda_stitching allocator(cuda_provider(0), cuda_reserver(0));
  allocator.attach_far_memory(cuda_host_provider(0), cuda_copier{}, far_residence::unmapped);
  cudaStream_t work = nullptr, copies = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&work, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamCreateWithFlags(&copies, cudaStreamNonBlocking) == cudaSuccess);
  const stream_ref w{work}, c{copies};
  void* p = allocator.allocate(256 * M, w);
  REQUIRE(gpu_test::fill(p, 256 * M, 55, work) == cudaSuccess);
  allocator.keep_far_copy(p);
  allocator.offload(p, w, move_completion::deferred, c);
  allocator.complete_moves(true);
  allocator.prefetch(p, w, move_completion::deferred, c);
  allocator.ready_on(p, w);
  REQUIRE(cudaStreamSynchronize(work) == cudaSuccess);
  allocator.complete_moves(true);
  CHECK(allocator.far_copy_bytes() == 256 * M);
  for (int round = 0; round < 3; ++round) {
    // The copy stream is busy: an offload to the clean copy does not wait for it, only for the
    // work that uses the block (a kernel still running when the offload is asked for).
    REQUIRE(gpu_test::spin(600'000'000, copies) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(work) == cudaSuccess);
    const std::size_t free_before = device_free_bytes();
    REQUIRE(gpu_test::spin(50'000'000, work) == cudaSuccess);
    allocator.offload(p, w, move_completion::deferred, c);
    CHECK(allocator.complete_moves(false) == 0);
    REQUIRE(cudaStreamSynchronize(work) == cudaSuccess);
    CHECK(allocator.complete_moves(false) == 1);
    CHECK(cudaStreamQuery(copies) == cudaErrorNotReady);
    CHECK(device_free_bytes() >= free_before + 250 * M);
    CHECK(allocator.far_copy_bytes() == 0);
    allocator.prefetch(p, w, move_completion::deferred, c);
    allocator.ready_on(p, w);
    CHECK(mismatches(p, 256 * M, 55, work) == 0);
    allocator.complete_moves(true);
    CHECK(allocator.far_copy_bytes() == 256 * M);
    allocator.verify();
  }
  allocator.keep_far_copy(p, false);
  CHECK(allocator.far_copy_bytes() == 0);
  allocator.deallocate(p, 256 * M, w);
  REQUIRE(cudaStreamSynchronize(work) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(work) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(copies) == cudaSuccess);
}

TEST_CASE("gpu: spare handles an offload gave back serve the next prefetch, and the bytes come back") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  config cfg;
  cfg.move_spares = 128 * M;
  cuda_stitching allocator(cuda_provider(0), cuda_reserver(0), cfg);
  allocator.attach_far_memory(cuda_host_provider(0), cuda_copier{}, far_residence::unmapped);
  cudaStream_t work = nullptr, copies = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&work, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamCreateWithFlags(&copies, cudaStreamNonBlocking) == cudaSuccess);
  const stream_ref w{work}, c{copies};
  void* p = allocator.allocate(64 * M, w);
  void* q = allocator.allocate(64 * M, w);
  for (int round = 0; round < 3; ++round) {
    const unsigned char v = static_cast<unsigned char>(20 + 2 * round);
    REQUIRE(gpu_test::fill(p, 64 * M, v, work) == cudaSuccess);
    REQUIRE(gpu_test::fill(q, 64 * M, v + 1, work) == cudaSuccess);
    const std::size_t free_before = device_free_bytes();
    allocator.offload(p, w, move_completion::deferred, c);
    allocator.offload(q, w, move_completion::deferred, c);
    allocator.complete_moves(true);
    CHECK(allocator.stats().spare_bytes == 128 * M);
    CHECK(device_free_bytes() + 16 * M < free_before + 128 * M);  // the spares are still held
    const statistics before = allocator.stats();
    // Back in the other order: q on handles p had.
    allocator.prefetch(q, w, move_completion::deferred, c);
    allocator.prefetch(p, w, move_completion::deferred, c);
    allocator.ready_on(q, w);
    allocator.ready_on(p, w);
    CHECK(mismatches(q, 64 * M, v + 1, work) == 0);
    CHECK(mismatches(p, 64 * M, v, work) == 0);
    allocator.complete_moves(true);
    const statistics after = allocator.stats();
    CHECK(after.driver_calls[driver_call::create] == before.driver_calls[driver_call::create]);
    CHECK(after.recycled_handles > before.recycled_handles);
    CHECK(after.spare_bytes == 0);
    allocator.verify();
  }
  allocator.offload(p, w);
  const std::size_t free_before = device_free_bytes();
  allocator.release_cached();
  CHECK(allocator.stats().spare_bytes == 0);
  CHECK(device_free_bytes() >= free_before + 60 * M);
  allocator.prefetch(p, w);
  CHECK(mismatches(p, 64 * M, 24, work) == 0);
  allocator.deallocate(p, 64 * M, w);
  allocator.deallocate(q, 64 * M, w);
  allocator.verify();
  REQUIRE(cudaStreamSynchronize(work) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(work) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(copies) == cudaSuccess);
}

TEST_CASE("gpu: deferred moves with copies on a stream of their own start after the work queued before them") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  cuda_stitching allocator(cuda_provider(0), cuda_reserver(0));
  allocator.attach_far_memory(cuda_host_provider(0), cuda_copier{});
  cudaStream_t work = nullptr, copies = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&work, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamCreateWithFlags(&copies, cudaStreamNonBlocking) == cudaSuccess);
  const stream_ref w{work}, c{copies};
  void* p = allocator.allocate(256 * M, w);
  REQUIRE(cudaStreamSynchronize(work) == cudaSuccess);
  const std::size_t free_before = device_free_bytes();

  // The bytes are written by a kernel queued behind a long one; the copies must wait for both.
  REQUIRE(gpu_test::spin(200'000'000, work) == cudaSuccess);
  REQUIRE(gpu_test::fill(p, 256 * M, 81, work) == cudaSuccess);
  allocator.offload(p, w, move_completion::deferred, c);
  CHECK(cudaStreamQuery(work) == cudaErrorNotReady);  // the call did not wait for the stream
  allocator.complete_move(p);
  CHECK(allocator.residence_of(p) == residence::host);
  CHECK(device_free_bytes() >= free_before + 250 * M);
  CHECK(mismatches(p, 256 * M, 81) == 0);  // what the kernel wrote, now in host memory

  REQUIRE(gpu_test::spin(200'000'000, work) == cudaSuccess);
  REQUIRE(gpu_test::fill(p, 256 * M, 82, work) == cudaSuccess);  // written over the bus
  allocator.prefetch(p, w, move_completion::deferred, c);
  CHECK(cudaStreamQuery(work) == cudaErrorNotReady);
  allocator.complete_move(p);
  CHECK(allocator.residence_of(p) == residence::device);
  CHECK(allocator.stats().offloaded_bytes == 0);
  CHECK(mismatches(p, 256 * M, 82) == 0);
  allocator.verify();
  allocator.deallocate(p, 256 * M, w);
  REQUIRE(cudaStreamSynchronize(work) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(work) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(copies) == cudaSuccess);
}
