// The PyTorch plug-in on a real GPU, through its C interface (glake_torch.h) as PyTorch calls it:
// blocks on two streams written and read back, statistics, empty_cache, peak resets,
// record_stream, out of memory (null from glake_malloc, an exception from glake_torch_malloc),
// bad frees survived, and a free from a thread whose current device is another one.
// Run by tests/gpu/run_or_skip.sh, which skips (exit 77) where there is no GPU.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <new>
#include <sstream>
#include <string>
#include <vector>

#include "glake_torch.h"

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

std::map<std::string, std::uint64_t> stats(int device) {
  std::vector<std::string> names;
  std::istringstream list(glake_stats_names());
  for (std::string name; std::getline(list, name, ',');) names.push_back(name);
  std::vector<std::uint64_t> values(names.size());
  REQUIRE(glake_stats(device, values.data(), values.size()) == names.size());
  std::map<std::string, std::uint64_t> out;
  for (std::size_t i = 0; i < names.size(); ++i) out[names[i]] = values[i];
  return out;
}

CUstream_st* as_plugin(cudaStream_t s) { return reinterpret_cast<CUstream_st*>(s); }

struct two_streams {
  cudaStream_t a = nullptr, b = nullptr;
  two_streams() {
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    REQUIRE(cudaFree(nullptr) == cudaSuccess);  // the primary context, as PyTorch has it
    REQUIRE(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking) == cudaSuccess);
    REQUIRE(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking) == cudaSuccess);
  }
  ~two_streams() {
    cudaStreamDestroy(a);
    cudaStreamDestroy(b);
  }
};

unsigned char byte_at(const void* p, std::size_t offset) {
  unsigned char value = 0;
  REQUIRE(cudaMemcpy(&value, static_cast<const unsigned char*>(p) + offset, 1, cudaMemcpyDeviceToHost) == cudaSuccess);
  return value;
}

}  // namespace

TEST_CASE("gpu: torch plug-in: blocks on two streams, statistics, empty_cache and peaks") {
  two_streams streams;
  glake_empty_cache(0);
  auto before = stats(0);

  struct block {
    void* p;
    std::size_t size;
    cudaStream_t stream;
    unsigned char value;
  };
  std::vector<block> blocks;
  std::size_t live = 0;
  unsigned char value = 1;
  for (std::size_t size : {std::size_t{512}, std::size_t{4096}, MiB, 3 * MiB + 100, 64 * MiB, 200 * MiB}) {
    for (cudaStream_t s : {streams.a, streams.b}) {
      void* p = glake_malloc(size, 0, as_plugin(s));
      REQUIRE(p != nullptr);
      REQUIRE(cudaMemsetAsync(p, value, size, s) == cudaSuccess);
      blocks.push_back({p, size, s, value++});
      live += size;
    }
  }
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  for (const block& b : blocks) {
    CHECK(byte_at(b.p, 0) == b.value);
    CHECK(byte_at(b.p, b.size - 1) == b.value);  // no block overlaps another
  }
  auto now = stats(0);
  CHECK(now["allocations"] - before["allocations"] == blocks.size());
  CHECK(now["active_bytes"] == live);
  CHECK(now["peak_active_bytes"] >= live);
  CHECK(now["reserved_bytes"] >= live);

  for (const block& b : blocks) glake_free(b.p, b.size, 0, as_plugin(b.stream));
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  now = stats(0);
  CHECK(now["active_bytes"] == 0);
  CHECK(now["reserved_bytes"] > 0);
  CHECK(now["errors"] == before["errors"]);

  // Memory freed on stream a serves a new 128 MiB request there without new memory.
  const std::size_t reserved = now["reserved_bytes"];
  void* big = glake_malloc(128 * MiB, 0, as_plugin(streams.a));
  REQUIRE(big != nullptr);
  REQUIRE(cudaMemsetAsync(big, 0x5a, 128 * MiB, streams.a) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(streams.a) == cudaSuccess);
  CHECK(byte_at(big, 128 * MiB - 1) == 0x5a);
  CHECK(stats(0)["reserved_bytes"] == reserved);
  glake_free(big, 128 * MiB, 0, as_plugin(streams.a));

  glake_empty_cache(0);
  CHECK(stats(0)["reserved_bytes"] == 0);

  void* p = glake_malloc(16 * MiB, 0, as_plugin(streams.a));
  REQUIRE(p != nullptr);
  glake_reset_peak(0);
  now = stats(0);
  CHECK(now["peak_active_bytes"] == 16 * MiB);
  CHECK(now["peak_reserved_bytes"] == 16 * MiB);
  CHECK(now["lifetime_peak_active_bytes"] >= live);
  glake_free(p, 16 * MiB, 0, as_plugin(streams.a));
  glake_empty_cache_all();
  CHECK(stats(0)["reserved_bytes"] == 0);
}

namespace {
std::atomic<bool> release_stream_b{false};
void CUDART_CB block_until_released(void*) {
  while (!release_stream_b.load()) {
  }
}
}  // namespace

TEST_CASE("gpu: torch plug-in: record_stream keeps a block until the other stream's work is done") {
  two_streams streams;
  glake_empty_cache(0);
  release_stream_b = false;
  REQUIRE(cudaLaunchHostFunc(streams.b, block_until_released, nullptr) == cudaSuccess);  // b is busy

  void* p = glake_malloc(32 * MiB, 0, as_plugin(streams.a));
  REQUIRE(p != nullptr);
  REQUIRE(cudaMemsetAsync(p, 1, 32 * MiB, streams.b) == cudaSuccess);  // queued behind the host function
  glake_record_stream(p, as_plugin(streams.b));
  glake_free(p, 32 * MiB, 0, as_plugin(streams.a));
  void* q = glake_malloc(32 * MiB, 0, as_plugin(streams.a));
  REQUIRE(q != nullptr);
  CHECK(q != p);  // p is still in use on b

  release_stream_b = true;
  REQUIRE(cudaStreamSynchronize(streams.b) == cudaSuccess);
  glake_free(q, 32 * MiB, 0, as_plugin(streams.a));
  const std::uint64_t reserved = stats(0)["reserved_bytes"];
  void* r = glake_malloc(32 * MiB, 0, as_plugin(streams.a));  // p's or q's memory, nothing new
  REQUIRE(r != nullptr);
  CHECK(stats(0)["reserved_bytes"] == reserved);
  glake_free(r, 32 * MiB, 0, as_plugin(streams.a));
  glake_empty_cache(0);
}

TEST_CASE("gpu: torch plug-in: out of memory and bad frees stay inside") {
  two_streams streams;
  std::size_t free_bytes = 0, total = 0;
  REQUIRE(cudaMemGetInfo(&free_bytes, &total) == cudaSuccess);
  const std::size_t too_much = total + 2048 * MiB;

  auto before = stats(0);
  CHECK(glake_malloc(too_much, 0, as_plugin(streams.a)) == nullptr);
  CHECK(stats(0)["failed_allocations"] == before["failed_allocations"] + 1);

  // glake's out_of_memory (a std::bad_alloc), or, in a plug-in built against torch's c10,
  // c10::OutOfMemoryError (a std::exception, which PyTorch raises as torch.OutOfMemoryError).
  bool threw = false;
  try {
    (void)glake_torch_malloc(too_much, 0, as_plugin(streams.a));
  } catch (const std::exception& e) {
    threw = true;
    CHECK(std::strstr(e.what(), "out of memory") != nullptr);
  }
  CHECK(threw);

  void* p = glake_malloc(8 * MiB, 0, as_plugin(streams.a));  // still serves
  REQUIRE(p != nullptr);
  before = stats(0);
  int foreign = 0;
  glake_free(&foreign, 64, 0, as_plugin(streams.a));  // a host pointer it never returned
  glake_free(p, 3 * MiB, 0, as_plugin(streams.a));    // the wrong size
  glake_free(p, 8 * MiB, 63, as_plugin(streams.a));   // a device without an allocator
  CHECK(stats(0)["errors"] == before["errors"] + 3);
  CHECK(stats(0)["active_bytes"] == 8 * MiB);
  glake_free(p, 8 * MiB, 0, as_plugin(streams.a));
  CHECK(stats(0)["active_bytes"] == 0);
  glake_empty_cache(0);
}

TEST_CASE("gpu: torch plug-in: a block of device 0 freed while device 1 is current") {
  int count = 0;
  REQUIRE(cudaGetDeviceCount(&count) == cudaSuccess);
  if (count < 2) {
    MESSAGE("one GPU only: nothing to test");
    return;
  }
  two_streams streams;
  void* p = glake_malloc(64 * MiB, 0, as_plugin(streams.a));
  REQUIRE(p != nullptr);
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  const std::uint64_t errors = stats(0)["errors"];
  glake_free(p, 64 * MiB, 0, as_plugin(streams.a));
  glake_empty_cache_all();  // releases on device 0 from device 1's context
  CHECK(stats(0)["errors"] == errors);
  CHECK(stats(0)["reserved_bytes"] == 0);
  int current = -1;
  REQUIRE(cudaGetDevice(&current) == cudaSuccess);
  CHECK(current == 1);  // the caller's device is left as it was
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
}

TEST_CASE("gpu: torch plug-in: glake_copy moves pageable memory to the device and back") {
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  const std::size_t n = 64 * MiB + 3;
  void* dev = nullptr;
  REQUIRE(cudaMalloc(&dev, n) == cudaSuccess);
  std::vector<unsigned char> host(n), back(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<unsigned char>(i * 7 + i / 4096);
  CHECK(glake_copy(dev, host.data(), n, as_plugin(stream)) == 0);
  CHECK(glake_copy(back.data(), dev, n, as_plugin(stream)) == 0);  // the data is there on return
  CHECK(back == host);
  // Misuse: -1 and a reason, nothing copied.
  CHECK(glake_copy(nullptr, host.data(), n, as_plugin(stream)) == -1);
  char reason[256] = {};
  glake_last_error(reason, sizeof reason);
  CHECK(std::string(reason).find("null pointer") != std::string::npos);
  CHECK(glake_copy(dev, dev, 0, as_plugin(stream)) == 0);  // zero bytes: nothing
  REQUIRE(cudaFree(dev) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
}
