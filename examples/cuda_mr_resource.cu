// glake behind CCCL's cuda::mr interface: a stitching allocator on the GPU handed to code that
// takes a memory resource, used stream-ordered, through a type-erased reference, and by copies.
// Needs a GPU; the test that runs it skips without one.
#include <glake/adaptors/cuda_mr_resource.hpp>
#include <glake/cuda_presets.hpp>

#include <cuda_runtime.h>

#include <cstdio>
#include <memory>

__global__ void iota(unsigned* out, std::size_t n) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out[i] = static_cast<unsigned>(i);
  }
}

// Code written against cuda::mr, knowing nothing of glake.
#if GLAKE_CCCL_STREAM_ORDERED_RESOURCE
using device_ref = cuda::mr::resource_ref<cuda::mr::device_accessible>;
unsigned* make_iota(device_ref mr, cuda::stream_ref stream, std::size_t n) {
  auto* p = static_cast<unsigned*>(mr.allocate(stream, n * sizeof(unsigned), alignof(unsigned)));
#else
using device_ref = cuda::mr::async_resource_ref<cuda::mr::device_accessible>;
unsigned* make_iota(device_ref mr, cuda::stream_ref stream, std::size_t n) {
  auto* p = static_cast<unsigned*>(mr.allocate_async(n * sizeof(unsigned), alignof(unsigned), stream));
#endif
  iota<<<256, 256, 0, stream.get()>>>(p, n);
  return p;
}

int main() {
  using namespace glake;
  // Copies of the resource may be used from several threads: give the allocator a lock.
  using gpu_allocator = shared_gpu_stitching_allocator;
  cuda_mr_resource<gpu_allocator> resource =
      make_cuda_mr_resource<gpu_allocator>(cuda_provider(0), cuda_reserver(0));
  static_assert(models_cuda_mr_v<decltype(resource), cuda::mr::device_accessible>);

  cudaStream_t stream = nullptr;
  if (cudaStreamCreate(&stream) != cudaSuccess) return 1;
  const std::size_t n = std::size_t{64} << 20;  // 256 MiB of unsigned
  unsigned* data = make_iota(device_ref{resource}, cuda::stream_ref{stream}, n);

  unsigned last = 0;
  cudaMemcpyAsync(&last, data + n - 1, sizeof last, cudaMemcpyDeviceToHost, stream);
  if (cudaStreamSynchronize(stream) != cudaSuccess) return 1;

  cuda_mr_resource<gpu_allocator> copy = resource;  // shares the allocator
#if GLAKE_CCCL_STREAM_ORDERED_RESOURCE
  copy.deallocate(cuda::stream_ref{stream}, data, n * sizeof(unsigned), alignof(unsigned));
#else
  copy.deallocate_async(data, n * sizeof(unsigned), alignof(unsigned), cuda::stream_ref{stream});
#endif
  const statistics s = resource.allocator().stats();
  std::printf("last element %u (expected %zu); glake reserved %s, peak active %s, now active %s\n", last, n - 1,
              format_bytes(s.reserved_bytes).c_str(), format_bytes(s.peak_active_bytes).c_str(),
              format_bytes(s.active_bytes).c_str());
  cudaStreamDestroy(stream);
  return last == n - 1 && s.active_bytes == 0 && s.peak_active_bytes == n * sizeof(unsigned) ? 0 : 1;
}
