// virtual_buffer on a real GPU: device memory moved to host-NUMA memory and back under the same
// pointers, kernels reading through offloaded pointers, stream ordering, and random rounds of
// moves with every piece's data checked.
#include <doctest/doctest.h>

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <random>
#include <vector>

#include "glake/backends/cuda.hpp"
#include "glake/movers/virtual_buffer.hpp"
#include "gpu_checks.hpp"
#include "kernels.hpp"

namespace {

using namespace glake;
using cuda_buffer = virtual_buffer<cuda_provider, cuda_host_provider, cuda_reserver, cuda_copier>;
static_assert(tiered_memory<cuda_buffer>);
constexpr std::size_t M = MiB;

using gpu_test::device_free_bytes;
using gpu_test::mismatches;

cuda_buffer make_buffer(std::size_t bytes, std::size_t piece) {
  return cuda_buffer(cuda_provider(0), cuda_host_provider(0), cuda_reserver(0), cuda_copier{}, bytes, piece);
}

}  // namespace

// Every member compiles for the CUDA backend.
template class glake::virtual_buffer<glake::cuda_provider, glake::cuda_host_provider, glake::cuda_reserver,
                                     glake::cuda_copier>;

TEST_CASE("gpu: virtual_buffer moves 256 MiB to host memory and back, and kernels read it through the same pointer") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  cuda_buffer buffer = make_buffer(256 * M, 32 * M);
  void* const p = buffer.data();
  buffer.commit(0, buffer.size());
  // fill and count_mismatches hash each word's index from the pointer they are given: the two
  // regions are always written and checked from their own starts.
  char* const rest = static_cast<char*>(p) + 32 * M;
  const std::size_t rest_bytes = buffer.size() - 32 * M;
  REQUIRE(gpu_test::fill(p, 32 * M, 10) == cudaSuccess);
  REQUIRE(gpu_test::fill(rest, rest_bytes, 11) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  const std::size_t free_before = device_free_bytes();

  buffer.offload(0, buffer.size());
  CHECK(buffer.data() == p);
  CHECK(buffer.residence_of(0) == residence::host);
  // The device memory went back to the driver: cudaMemGetInfo sees it free.
  CHECK(device_free_bytes() >= free_before + 250 * M);
  CHECK(mismatches(p, 32 * M, 10) == 0);  // read over the bus, from host memory
  CHECK(mismatches(rest, rest_bytes, 11) == 0);
  // Kernels may write offloaded memory too.
  REQUIRE(gpu_test::fill(p, 32 * M, 12) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);  // the prefetch below is on another stream

  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  buffer.prefetch(0, buffer.size(), stream_ref{stream});
  // Work queued on the prefetch's stream after it sees the data.
  CHECK(mismatches(p, 32 * M, 12, stream) == 0);
  CHECK(mismatches(rest, rest_bytes, 11, stream) == 0);
  CHECK(buffer.residence_of(0) == residence::device);
  CHECK(device_free_bytes() <= free_before + 8 * M);
  const auto s = buffer.stats();
  CHECK(s.offloaded_bytes == 256 * M);
  CHECK(s.prefetched_bytes == 256 * M);
  CHECK(s.host_handles_created == 8);
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
}

TEST_CASE("gpu: virtual_buffer waits for kernels queued before a move, on its stream and on recorded streams") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  cuda_buffer buffer = make_buffer(64 * M, 16 * M);
  void* const p = buffer.data();
  buffer.commit(0, buffer.size());
  cudaStream_t compute = nullptr, side = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking) == cudaSuccess);

  char* const rest = static_cast<char*>(p) + 16 * M;
  // A long kernel, then the fills, all queued on `compute`: the offload's copies come after them.
  REQUIRE(gpu_test::spin(200'000'000, compute) == cudaSuccess);
  REQUIRE(gpu_test::fill(p, 16 * M, 20, compute) == cudaSuccess);
  REQUIRE(gpu_test::fill(rest, 48 * M, 21, compute) == cudaSuccess);
  buffer.offload(0, buffer.size(), stream_ref{compute});
  CHECK(mismatches(p, 16 * M, 20, compute) == 0);
  CHECK(mismatches(rest, 48 * M, 21, compute) == 0);

  // Work on a recorded stream: prefetch waits for it before unmapping the host memory it writes.
  buffer.record_stream(stream_ref{side});
  REQUIRE(gpu_test::spin(200'000'000, side) == cudaSuccess);
  REQUIRE(gpu_test::fill(p, 16 * M, 22, side) == cudaSuccess);
  buffer.prefetch(0, buffer.size(), stream_ref{compute});
  CHECK(mismatches(p, 16 * M, 22, compute) == 0);
  CHECK(mismatches(rest, 48 * M, 21, compute) == 0);
  REQUIRE(cudaStreamSynchronize(side) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(compute) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(side) == cudaSuccess);
}

TEST_CASE("gpu: 10^4 random rounds of commit, offload, prefetch and decommit keep every piece's data") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  constexpr std::size_t pieces = 32, piece = 2 * M;
  cuda_buffer buffer = make_buffer(pieces * piece, piece);
  char* const base = static_cast<char*>(buffer.data());
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  const stream_ref s{stream};
  std::vector<unsigned int> seeds(pieces, 0);  // 0: no memory
  std::mt19937_64 random(20261125);
  unsigned int next_seed = 1;
  std::uint64_t moved = 0, bad = 0;
  for (int round = 0; round < 10'000; ++round) {
    const std::size_t first = random() % pieces;
    const std::size_t count = 1 + random() % std::min<std::size_t>(6, pieces - first);
    auto all = [&](residence r) {
      for (std::size_t i = first; i < first + count; ++i) {
        if (buffer.residence_of(i * piece) != r) return false;
      }
      return true;
    };
    const std::size_t offset = first * piece, bytes = count * piece;
    switch (random() % 5) {
      case 0:
        buffer.commit(offset, bytes);
        for (std::size_t i = first; i < first + count; ++i) {
          if (seeds[i] != 0) continue;
          seeds[i] = next_seed++;
          REQUIRE(gpu_test::fill(base + i * piece, piece, seeds[i], stream) == cudaSuccess);
        }
        break;
      case 1:
      case 2:
        if (all(residence::device)) {
          buffer.offload(offset, bytes, s);
          ++moved;
        } else if (all(residence::host)) {
          buffer.prefetch(offset, bytes, s);
          ++moved;
        }
        break;
      case 3:
        // Rewrite a piece wherever it lives (a kernel writing through an offloaded pointer).
        if (seeds[first] != 0) {
          seeds[first] = next_seed++;
          REQUIRE(gpu_test::fill(base + first * piece, piece, seeds[first], stream) == cudaSuccess);
        }
        break;
      default:
        if (random() % 4 == 0) {
          buffer.decommit(offset, bytes, s);
          for (std::size_t i = first; i < first + count; ++i) seeds[i] = 0;
        }
    }
    if (round % 50 == 49) {
      for (std::size_t i = 0; i < pieces; ++i) {
        if (seeds[i] != 0) bad += mismatches(base + i * piece, piece, seeds[i], stream);
      }
    }
  }
  CHECK(bad == 0);
  CHECK(moved > 1000);
  MESSAGE("moves: " << moved << ", offloaded " << buffer.stats().offloaded_bytes / M << " MiB, host handles made "
                    << buffer.stats().host_handles_created);
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
}

TEST_CASE("gpu: virtual_buffer refuses an offload it cannot back and leaves the data in place") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  cuda_buffer buffer = make_buffer(8 * M, 2 * M);
  buffer.commit(0, 4 * M);
  REQUIRE(gpu_test::fill(buffer.data(), 4 * M, 5) == cudaSuccess);
  CHECK_THROWS_AS(buffer.offload(0, 8 * M), usage_error);  // half of it holds nothing
  CHECK_THROWS_AS(buffer.prefetch(0, 2 * M), usage_error);  // on the device already
  CHECK(buffer.residence_of(0) == residence::device);
  CHECK(mismatches(buffer.data(), 4 * M, 5) == 0);
}

TEST_CASE("gpu: virtual_buffer refuses to move memory on a stream capturing a graph") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  cuda_buffer buffer = make_buffer(64 * M, 32 * M);
  buffer.commit(0, buffer.size());
  buffer.offload(32 * M, 32 * M);  // the second piece on the host
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  CHECK_THROWS_AS(buffer.offload(0, 32 * M, stream_ref{stream}), usage_error);
  CHECK_THROWS_AS(buffer.prefetch(32 * M, 32 * M, stream_ref{stream}), usage_error);
  cudaGraph_t graph = nullptr;
  // The refusals queued nothing: the capture ends valid, and empty.
  REQUIRE(cudaStreamEndCapture(stream, &graph) == cudaSuccess);
  std::size_t nodes = 1;
  CHECK(cudaGraphGetNodes(graph, nullptr, &nodes) == cudaSuccess);
  CHECK(nodes == 0);
  (void)cudaGraphDestroy(graph);
  CHECK(buffer.residence_of(0) == residence::device);
  CHECK(buffer.residence_of(32 * M) == residence::host);
  buffer.offload(0, 32 * M, stream_ref{stream});  // after the capture, the same move runs
  CHECK(buffer.residence_of(0) == residence::host);
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
}
