// Kernels for the GPU tests: fill a range with a position-dependent pattern, count mismatches.
#include "kernels.hpp"

namespace {

__global__ void fill_kernel(unsigned int* data, std::size_t words, unsigned int seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    data[i] = static_cast<unsigned int>(i * 2654435761u) ^ seed;
  }
}

__global__ void check_kernel(const unsigned int* data, std::size_t words, unsigned int seed,
                             unsigned long long* mismatches) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    if (data[i] != (static_cast<unsigned int>(i * 2654435761u) ^ seed)) atomicAdd(mismatches, 1ull);
  }
}

__global__ void spin_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

}  // namespace

namespace glake::gpu_test {

cudaError_t spin(long long cycles, cudaStream_t stream) {
  spin_kernel<<<1, 1, 0, stream>>>(cycles);
  return cudaGetLastError();
}

cudaError_t fill(void* p, std::size_t bytes, unsigned int seed, cudaStream_t stream) {
  fill_kernel<<<1024, 256, 0, stream>>>(static_cast<unsigned int*>(p), bytes / 4, seed);
  return cudaGetLastError();
}

cudaError_t count_mismatches(const void* p, std::size_t bytes, unsigned int seed, unsigned long long* out,
                             cudaStream_t stream) {
  unsigned long long* counter = nullptr;
  cudaError_t e = cudaMallocAsync(&counter, sizeof *counter, stream);
  if (e != cudaSuccess) return e;
  cudaMemsetAsync(counter, 0, sizeof *counter, stream);
  check_kernel<<<1024, 256, 0, stream>>>(static_cast<const unsigned int*>(p), bytes / 4, seed, counter);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  cudaMemcpyAsync(out, counter, sizeof *counter, cudaMemcpyDeviceToHost, stream);
  cudaFreeAsync(counter, stream);
  return cudaStreamSynchronize(stream);
}

}  // namespace glake::gpu_test
