// What the GPU tests ask of the device: free memory (cudaMemGetInfo) and the words of a range
// that differ from what gpu_test::fill wrote. Needs doctest (the calls REQUIRE success).
#pragma once

#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstddef>

#include "kernels.hpp"

namespace glake::gpu_test {

inline std::size_t device_free_bytes() {
  std::size_t free = 0, total = 0;
  REQUIRE(cudaMemGetInfo(&free, &total) == cudaSuccess);
  return free;
}

inline unsigned long long mismatches(const void* p, std::size_t bytes, unsigned int seed,
                                     cudaStream_t stream = nullptr) {
  unsigned long long count = ~0ull;
  REQUIRE(count_mismatches(p, bytes, seed, &count, stream) == cudaSuccess);
  return count;
}

}  // namespace glake::gpu_test
