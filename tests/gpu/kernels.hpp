// Host entry points of the GPU tests' kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace glake::gpu_test {
/// Writes word i of [p, p + bytes) as a hash of i and `seed`.
cudaError_t fill(void* p, std::size_t bytes, unsigned int seed, cudaStream_t stream = nullptr);
/// Counts the words of [p, p + bytes) that differ from what fill wrote; synchronizes the stream.
cudaError_t count_mismatches(const void* p, std::size_t bytes, unsigned int seed, unsigned long long* out,
                             cudaStream_t stream = nullptr);
/// Keeps the stream busy for about `cycles` GPU clock cycles.
cudaError_t spin(long long cycles, cudaStream_t stream);
}  // namespace glake::gpu_test
