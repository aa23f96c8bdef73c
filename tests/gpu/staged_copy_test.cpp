// staged_copier on a real GPU: pageable memory to the device and back from 1 byte to 1 GiB, the
// direct path for pinned and registered memory, ordering after kernels, file loads, and what
// the classifier says about each kind of memory; multipath_copier where there are several GPUs.
#include <doctest/doctest.h>

#include <cuda.h>
#include <cuda_runtime.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "glake/backends/cuda_copy.hpp"
#include "glake/movers/multipath_copy.hpp"
#include "glake/movers/staged_copy.hpp"
#include "kernels.hpp"

namespace {

using namespace glake;
using cuda_staged_copier = staged_copier<cuda_copy_backend, cuda_pointer_classifier>;
static_assert(byte_copier<cuda_staged_copier>);

// The words gpu_test::fill writes (word i: i * 2654435761 ^ seed); a tail of fewer than 4 bytes
// gets the low bytes of the next word.
void host_fill(unsigned char* p, std::size_t bytes, unsigned int seed) {
  for (std::size_t i = 0; i * 4 < bytes; ++i) {
    const unsigned int word = static_cast<unsigned int>(i * 2654435761u) ^ seed;
    std::memcpy(p + i * 4, &word, std::min<std::size_t>(4, bytes - i * 4));
  }
}
std::size_t host_mismatches(const unsigned char* p, std::size_t bytes, unsigned int seed) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i * 4 + 4 <= bytes; ++i) {
    unsigned int word = 0;
    std::memcpy(&word, p + i * 4, 4);
    if (word != (static_cast<unsigned int>(i * 2654435761u) ^ seed)) ++bad;
  }
  return bad;
}
unsigned long long device_mismatches(const void* p, std::size_t bytes, unsigned int seed, cudaStream_t stream) {
  unsigned long long count = ~0ull;
  REQUIRE(gpu_test::count_mismatches(p, bytes, seed, &count, stream) == cudaSuccess);
  return count;
}

struct stream_holder {
  stream_holder() { REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess); }
  ~stream_holder() { (void)cudaStreamDestroy(stream); }
  cudaStream_t stream = nullptr;
};

struct device_buffer {
  explicit device_buffer(std::size_t bytes) { REQUIRE(cudaMalloc(&p, bytes) == cudaSuccess); }
  ~device_buffer() { (void)cudaFree(p); }
  unsigned char* data() const { return static_cast<unsigned char*>(p); }
  void* p = nullptr;
};

}  // namespace

TEST_CASE("gpu: staged_copier copies pageable memory to the device and back, 1 byte to 1 GiB") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  cuda_staged_copier copier{cuda_copy_backend(0)};
  stream_holder s;
  const stream_ref stream{s.stream};
  std::uint64_t staged = 0;
  for (const std::size_t n : {std::size_t{1}, std::size_t{4097}, 8 * MiB, 8 * MiB + 12, 100 * MiB + 4, 1 * GiB}) {
    CAPTURE(n);
    device_buffer dev(n);
    std::vector<unsigned char> host(n);
    host_fill(host.data(), n, 1);
    copier.copy(dev.data(), host.data(), n, stream);
    std::memset(host.data(), 0, n);  // the source was read whole when copy returned
    CHECK(device_mismatches(dev.data(), n, 1, s.stream) == 0);

    // Back: a kernel queued before the copy writes what it must read.
    REQUIRE(gpu_test::fill(dev.data(), n, 2, s.stream) == cudaSuccess);
    copier.copy(host.data(), dev.data(), n, stream);
    CHECK(host_mismatches(host.data(), n, 2) == 0);  // no synchronization: there when copy returns
    staged += 2;
  }
  // One element copies the tail bytes beyond the kernels' words too.
  std::vector<unsigned char> odd(4097), back(4097);
  host_fill(odd.data(), odd.size(), 3);
  device_buffer dev(odd.size());
  copier.copy(dev.data(), odd.data(), odd.size(), stream);
  copier.copy(back.data(), dev.data(), back.size(), stream);
  CHECK(back == odd);
  const staged_copy_statistics stats = copier.stats();
  CHECK(stats.staged_copies == staged + 2);
  CHECK(stats.direct_copies == 0);
  CHECK(stats.staging_bytes == copier.options().chunks * copier.options().chunk_bytes);
  copier.release_staging();
  CHECK(copier.stats().staging_bytes == 0);
}

TEST_CASE("gpu: staged_copier copies pinned and registered memory with one cuMemcpyAsync") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  cuda_staged_copier copier{cuda_copy_backend(0)};
  stream_holder s;
  const stream_ref stream{s.stream};
  const std::size_t n = 64 * MiB;
  device_buffer dev(n);
  void* pinned = nullptr;
  REQUIRE(cudaMallocHost(&pinned, n) == cudaSuccess);
  std::vector<unsigned char> registered(n);
  REQUIRE(cudaHostRegister(registered.data(), n, cudaHostRegisterDefault) == cudaSuccess);

  auto* const p = static_cast<unsigned char*>(pinned);
  host_fill(p, n, 4);
  copier.copy(dev.data(), p, n, stream);
  CHECK(device_mismatches(dev.data(), n, 4, s.stream) == 0);
  REQUIRE(gpu_test::fill(dev.data(), n, 5, s.stream) == cudaSuccess);
  copier.copy(registered.data(), dev.data(), n, stream);
  REQUIRE(cudaStreamSynchronize(s.stream) == cudaSuccess);  // direct copies are asynchronous
  CHECK(host_mismatches(registered.data(), n, 5) == 0);

  const staged_copy_statistics stats = copier.stats();
  CHECK(stats.direct_copies == 2);
  CHECK(stats.direct_bytes == 2 * n);
  CHECK(stats.staged_copies == 0);
  CHECK(stats.staging_bytes == 0);  // no pinned memory was needed

  cuda_pointer_classifier classify;
  std::vector<unsigned char> pageable(16);
  void* managed = nullptr;
  REQUIRE(cudaMallocManaged(&managed, 4096) == cudaSuccess);
  CHECK(classify.locate(pageable.data()) == pointer_info{memory_kind::pageable, -1});
  CHECK(classify.locate(p + n - 1) == pointer_info{memory_kind::pinned, -1});
  CHECK(classify.locate(registered.data() + 100) == pointer_info{memory_kind::pinned, -1});
  CHECK(classify.locate(dev.data() + n - 1) == pointer_info{memory_kind::device, 0});
  CHECK(classify.locate(managed).kind == memory_kind::managed);
  REQUIRE(cudaFree(managed) == cudaSuccess);
  REQUIRE(cudaHostUnregister(registered.data()) == cudaSuccess);
  REQUIRE(cudaFreeHost(pinned) == cudaSuccess);
}

TEST_CASE("gpu: staged_copier orders its copies after a kernel queued before them") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  cuda_staged_copier copier{cuda_copy_backend(0)};
  stream_holder s;
  const stream_ref stream{s.stream};
  const std::size_t n = 96 * MiB + 8;
  device_buffer dev(n);
  std::vector<unsigned char> host(n);

  // A spin of ~100 ms then a fill of the target: a copy that ran before them would be overwritten.
  REQUIRE(gpu_test::spin(200'000'000, s.stream) == cudaSuccess);
  REQUIRE(gpu_test::fill(dev.data(), n, 6, s.stream) == cudaSuccess);
  host_fill(host.data(), n, 7);
  copier.copy(dev.data(), host.data(), n, stream);
  CHECK(device_mismatches(dev.data(), n, 7, s.stream) == 0);

  // A spin then a fill of the source: a copy that ran before them would read old bytes.
  REQUIRE(gpu_test::spin(200'000'000, s.stream) == cudaSuccess);
  REQUIRE(gpu_test::fill(dev.data(), n, 8, s.stream) == cudaSuccess);
  copier.copy(host.data(), dev.data(), n, stream);
  CHECK(host_mismatches(host.data(), n, 8) == 0);
}

TEST_CASE("gpu: staged_copier loads a file into device memory") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  char path[] = "/tmp/glake_gpu_staged_copy_XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  ::unlink(path);
  const std::size_t n = 200 * MiB + 4;
  std::vector<unsigned char> contents(n + 4096);
  host_fill(contents.data() + 4096, n, 9);
  REQUIRE(::write(fd, contents.data(), contents.size()) == static_cast<ssize_t>(contents.size()));
  cuda_staged_copier copier{cuda_copy_backend(0)};
  stream_holder s;
  device_buffer dev(n);
  copier.copy_from_file(dev.data(), fd, 4096, n, stream_ref{s.stream});
  CHECK(device_mismatches(dev.data(), n, 9, s.stream) == 0);
  CHECK(copier.stats().file_reads == 1);
  ::close(fd);
}

TEST_CASE("gpu: threads copy through one staged_copier, each on its own stream") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  cuda_staged_copier copier{cuda_copy_backend(0)};
  constexpr int threads = 3;
  const std::size_t n = 128 * MiB + 4;
  std::vector<std::size_t> bad(threads, ~std::size_t{0});
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      // Each thread's own current context: the primary one, as the runtime makes it.
      if (cudaSetDevice(0) != cudaSuccess) return;
      cudaStream_t stream = nullptr;
      if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return;
      void* dev = nullptr;
      if (cudaMalloc(&dev, n) == cudaSuccess) {
        std::vector<unsigned char> host(n), back(n);
        host_fill(host.data(), n, 20 + static_cast<unsigned>(t));
        std::size_t wrong = 0;
        for (int round = 0; round < 3; ++round) {
          copier.copy(dev, host.data(), n, stream_ref{stream});
          copier.copy(back.data(), dev, n, stream_ref{stream});
          wrong += back == host ? 0 : 1;
        }
        bad[t] = wrong;
        (void)cudaFree(dev);
      }
      (void)cudaStreamDestroy(stream);
    });
  }
  for (std::thread& w : workers) w.join();
  for (int t = 0; t < threads; ++t) CHECK(bad[t] == 0);
  CHECK(copier.stats().staged_copies == 2 * 3 * threads);
}

TEST_CASE("gpu: staged_copier refuses device memory of another device") {
  int devices = 0;
  REQUIRE(cudaGetDeviceCount(&devices) == cudaSuccess);
  if (devices < 2) {
    MESSAGE("one device only: nothing to refuse");
    return;
  }
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  device_buffer other(4096);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  cuda_staged_copier copier{cuda_copy_backend(0)};
  std::vector<unsigned char> host(4096);
  CHECK_THROWS_AS(copier.copy(other.data(), host.data(), host.size()), usage_error);
  CHECK(copier.stats().staged_copies + copier.stats().direct_copies == 0);
}

TEST_CASE("gpu: multipath_copier splits copies into device 0 over every peer") {
  int devices = 0;
  REQUIRE(cudaGetDeviceCount(&devices) == cudaSuccess);
  if (devices < 2) {
    MESSAGE("one device only: no peer to split with");
    return;
  }
  using cuda_multipath = multipath_copier<cuda_copy_backend, cuda_pointer_classifier>;
  static_assert(byte_copier<cuda_multipath>);
  std::vector<cuda_copy_backend> backends;
  std::vector<cudaStream_t> streams(static_cast<std::size_t>(devices));
  for (int d = 0; d < devices; ++d) {
    REQUIRE(cudaSetDevice(d) == cudaSuccess);
    REQUIRE(cudaStreamCreateWithFlags(&streams[static_cast<std::size_t>(d)], cudaStreamNonBlocking) == cudaSuccess);
    backends.emplace_back(d);
  }
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  for (int a = 0; a < devices; ++a) {
    for (int b = a + 1; b < devices; ++b) {
      cuda_enable_peer_access(backends[static_cast<std::size_t>(a)], backends[static_cast<std::size_t>(b)]);
    }
  }
  const std::size_t n = 96 * MiB + 12;  // not a multiple of the alignment: an uneven last share
  device_buffer dev(n);
  std::vector<unsigned char> host(n), back(n);
  host_fill(host.data(), n, 11);
  {
    std::vector<peer_route<cuda_copy_backend>> peers;
    for (int d = 1; d < devices; ++d) {
      peers.push_back({backends[static_cast<std::size_t>(d)], stream_ref{streams[static_cast<std::size_t>(d)]}, 1.0,
                       4 * MiB});
    }
    multipath_options o;
    o.scratch_bytes = 16 * MiB;  // a peer's share in several pieces
    cuda_multipath copier(backends[0], peers, cuda_pointer_classifier{}, o);
    stream_holder s;
    // A kernel queued before the copy writes what the copy overwrites: the copy comes after it.
    REQUIRE(gpu_test::fill(dev.data(), n, 5, s.stream) == cudaSuccess);
    copier.copy(dev.data(), host.data(), n, stream_ref{s.stream});
    CHECK(device_mismatches(dev.data(), n, 11, s.stream) == 0);
    REQUIRE(gpu_test::fill(dev.data(), n, 12, s.stream) == cudaSuccess);
    std::memset(back.data(), 0, n);
    copier.copy(back.data(), dev.data(), n, stream_ref{s.stream});
    CHECK(host_mismatches(back.data(), n, 12) == 0);
    const multipath_statistics st = copier.stats();
    CHECK(st.split_copies == 2);
    for (int d = 0; d < devices; ++d) CHECK(st.path_bytes[static_cast<std::size_t>(d)] > 0);
    copier.release_scratch();
  }
  for (cudaStream_t st : streams) (void)cudaStreamDestroy(st);
}
