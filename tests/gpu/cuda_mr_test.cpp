// The cuda::mr adaptor on a real GPU: a CUDA-backend glake allocator as a device_accessible
// resource, kernels writing what it returns (stitched blocks included), stream-ordered and
// synchronous members, CCCL's type-erased reference.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "glake/adaptors/cuda_mr_resource.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/cuda.hpp"
#include "kernels.hpp"

namespace {

using namespace glake;
using cuda_stitching = stitching_allocator<cuda_provider, cuda_reserver>;
using device_resource = cuda_mr_resource<cuda_stitching>;

static_assert(allocator_location_v<cuda_stitching> == memory_location::device);
static_assert(models_cuda_mr_v<device_resource, cuda::mr::device_accessible>);
static_assert(!cuda::has_property<device_resource, cuda::mr::host_accessible>);

unsigned long long mismatches(const void* p, std::size_t bytes, unsigned int seed, cudaStream_t stream = nullptr) {
  unsigned long long count = ~0ull;
  REQUIRE(gpu_test::count_mismatches(p, bytes, seed, &count, stream) == cudaSuccess);
  return count;
}

device_resource make_resource() {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  config cfg;
  cfg.frag_limit = 0;  // stitch whenever free chunks allow
  return device_resource(std::make_shared<cuda_stitching>(cuda_provider(0), cuda_reserver(0), cfg));
}

}  // namespace

TEST_CASE("gpu: cuda_mr_resource serves kernels on a stream, stitched blocks included") {
  device_resource resource = make_resource();
  cudaStream_t raw = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking) == cudaSuccess);
  const cuda::stream_ref stream{raw};
  constexpr std::size_t M = MiB;

  std::vector<void*> blocks;
  for (unsigned i = 0; i < 4; ++i) {
    blocks.push_back(resource.allocate(stream, 64 * M));
    REQUIRE(gpu_test::fill(blocks[i], 64 * M, 10 + i, raw) == cudaSuccess);
  }
  resource.deallocate(stream, blocks[0], 64 * M);
  resource.deallocate(stream, blocks[2], 64 * M);
  void* stitched = resource.allocate(stream, 128 * M, 256);
  CHECK(resource.allocator().stats().stitches == 1);
  REQUIRE(gpu_test::fill(stitched, 128 * M, 77, raw) == cudaSuccess);
  CHECK(mismatches(stitched, 128 * M, 77, raw) == 0);
  CHECK(mismatches(blocks[1], 64 * M, 11, raw) == 0);
  CHECK(mismatches(blocks[3], 64 * M, 13, raw) == 0);

  // Small and odd sizes, every alignment up to the guarantee.
  for (std::size_t bytes : {std::size_t{4}, std::size_t{1000}, 300 * KiB, 1 * M + 4, 5 * M + 12}) {
    for (std::size_t alignment = 4; alignment <= 256; alignment *= 4) {
      void* p = resource.allocate(stream, bytes, alignment);
      CHECK(reinterpret_cast<std::uintptr_t>(p) % alignment == 0);
      REQUIRE(gpu_test::fill(p, bytes, 5, raw) == cudaSuccess);
      CHECK(mismatches(p, bytes, 5, raw) == 0);
      resource.deallocate(stream, p, bytes, alignment);
    }
  }
  resource.deallocate(stream, stitched, 128 * M, 256);
  resource.deallocate(stream, blocks[1], 64 * M);
  resource.deallocate(stream, blocks[3], 64 * M);
  REQUIRE(cudaStreamSynchronize(raw) == cudaSuccess);
  CHECK(resource.allocator().stats().active_bytes == 0);
  resource.allocator().verify();
  REQUIRE(cudaStreamDestroy(raw) == cudaSuccess);
}

TEST_CASE("gpu: cuda_mr_resource's synchronous members and CCCL's type-erased reference") {
  device_resource resource = make_resource();
  void* p = resource.allocate_sync(8 * MiB);
  REQUIRE(gpu_test::fill(p, 8 * MiB, 3) == cudaSuccess);
  CHECK(mismatches(p, 8 * MiB, 3) == 0);
  resource.deallocate_sync(p, 8 * MiB);

#if GLAKE_CCCL_STREAM_ORDERED_RESOURCE
  cuda::mr::resource_ref<cuda::mr::device_accessible> ref{resource};
  void* q = ref.allocate(cuda::stream_ref{cudaStream_t{}}, 3 * MiB, 256);
#else
  cuda::mr::async_resource_ref<cuda::mr::device_accessible> ref{resource};
  void* q = ref.allocate_async(3 * MiB, 256, cuda::stream_ref{});
#endif
  REQUIRE(gpu_test::fill(q, 3 * MiB, 4) == cudaSuccess);
  CHECK(mismatches(q, 3 * MiB, 4) == 0);
#if GLAKE_CCCL_STREAM_ORDERED_RESOURCE
  ref.deallocate(cuda::stream_ref{cudaStream_t{}}, q, 3 * MiB, 256);
#else
  ref.deallocate_async(q, 3 * MiB, 256, cuda::stream_ref{});
#endif
  CHECK(resource.allocator().stats().active_bytes == 0);

  // Out of device memory: glake's out_of_memory, and the resource stays usable.
  std::size_t free = 0, total = 0;
  REQUIRE(cudaMemGetInfo(&free, &total) == cudaSuccess);
  CHECK_THROWS_AS((void)resource.allocate_sync(total + 64 * MiB), out_of_memory);
  void* again = resource.allocate_sync(64 * MiB);
  CHECK(again != nullptr);
  resource.deallocate_sync(again, 64 * MiB);
  resource.allocator().verify();
}
