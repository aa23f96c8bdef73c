// GPU allocation latency: median cached allocate+deallocate pair for glake's stitching allocator
// on the CUDA backend, cudaMallocAsync on a warm pool and cudaMalloc, sizes 512 B to 1 GiB; and
// the latency of building a stitched range against the number of blocks stitched.
// Needs a GPU. Build: see bench/results/gpu_alloc_latency.md.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/cuda.hpp"

namespace {

using namespace glake;
using clock_type = std::chrono::steady_clock;

#define CHECK_CUDA(call)                                                                   \
  do {                                                                                     \
    const cudaError_t e_ = (call);                                                         \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(e_));              \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median over `batches` of the mean ns per pair in a batch of `pairs`.
template <class Pair>
double time_pairs(int batches, int pairs, Pair&& pair) {
  for (int i = 0; i < pairs; ++i) pair();  // warm
  std::vector<double> per_pair;
  for (int b = 0; b < batches; ++b) {
    const auto t0 = clock_type::now();
    for (int i = 0; i < pairs; ++i) pair();
    const auto t1 = clock_type::now();
    per_pair.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / pairs);
  }
  return median(per_pair);
}

std::string size_text(std::size_t bytes) {
  char buffer[32];
  if (bytes >= GiB) {
    std::snprintf(buffer, sizeof buffer, "%zu GiB", bytes / GiB);
  } else if (bytes >= MiB) {
    std::snprintf(buffer, sizeof buffer, "%zu MiB", bytes / MiB);
  } else if (bytes >= KiB) {
    std::snprintf(buffer, sizeof buffer, "%zu KiB", bytes / KiB);
  } else {
    std::snprintf(buffer, sizeof buffer, "%zu B", bytes);
  }
  return buffer;
}

}  // namespace

int main() {
  CHECK_CUDA(cudaFree(nullptr));
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaMemPool_t pool = nullptr;
  CHECK_CUDA(cudaDeviceGetDefaultMemPool(&pool, 0));
  std::uint64_t keep_all = ~std::uint64_t{0};
  CHECK_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all));  // stays warm

  stitching_allocator<cuda_provider, cuda_reserver> glake_allocator(cuda_provider(0), cuda_reserver(0));
  const stream_ref on{stream};

  std::printf("## Cached allocate+deallocate pair (median ns per pair)\n\n");
  std::printf("| size | glake stitching_allocator | cudaMallocAsync (warm pool) | cudaMalloc | async / glake |\n");
  std::printf("|---:|---:|---:|---:|---:|\n");
  for (std::size_t bytes : {std::size_t{512}, 4 * KiB, 64 * KiB, 1 * MiB, 2 * MiB, 16 * MiB, 256 * MiB, 1 * GiB}) {
    // A live neighbour keeps the pool from being trivially empty, as in bench/cached_pair_bench.
    void* neighbour = glake_allocator.allocate(bytes, on);
    const double glake_ns = time_pairs(51, 2000, [&] {
      void* p = glake_allocator.allocate(bytes, on);
      glake_allocator.deallocate(p, bytes, on);
    });
    void* async_neighbour = nullptr;
    CHECK_CUDA(cudaMallocAsync(&async_neighbour, bytes, stream));
    const double async_ns = time_pairs(51, 2000, [&] {
      void* p = nullptr;
      CHECK_CUDA(cudaMallocAsync(&p, bytes, stream));
      CHECK_CUDA(cudaFreeAsync(p, stream));
    });
    const int malloc_pairs = bytes >= 256 * MiB ? 5 : 50;
    const double malloc_ns = time_pairs(11, malloc_pairs, [&] {
      void* p = nullptr;
      CHECK_CUDA(cudaMalloc(&p, bytes));
      CHECK_CUDA(cudaFree(p));
    });
    std::printf("| %s | %.1f | %.1f | %.1f | %.1fx |\n", size_text(bytes).c_str(), glake_ns, async_ns, malloc_ns,
                async_ns / glake_ns);
    std::fflush(stdout);
    CHECK_CUDA(cudaFreeAsync(async_neighbour, stream));
    glake_allocator.deallocate(neighbour, bytes, on);
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));

  std::printf("\n## Building a stitched range from k free blocks (2 MiB handles, median of 9)\n\n");
  std::printf("| blocks k (4 MiB = 2 handles each) | new stitch (us) | cached stitch reused (us) | release_cached: unmap stitch + release k segments (us) |\n");
  std::printf("|---:|---:|---:|---:|\n");
  for (std::size_t k : {std::size_t{2}, std::size_t{4}, std::size_t{16}, std::size_t{64}, std::size_t{256}}) {
    std::vector<double> fresh, reused, evicted;
    for (int rep = 0; rep < 9; ++rep) {
      config cfg;
      cfg.frag_limit = 0;
      stitching_allocator<cuda_provider, cuda_reserver> a(cuda_provider(0), cuda_reserver(0), cfg);
      std::vector<void*> blocks;
      for (std::size_t i = 0; i < 2 * k; ++i) blocks.push_back(a.allocate(2 * MiB + MiB));  // 4 MiB blocks
      for (std::size_t i = 0; i < 2 * k; i += 2) a.deallocate(blocks[i], 2 * MiB + MiB);
      const std::size_t bytes = k * 4 * MiB;  // needs every free block, side by side
      auto t0 = clock_type::now();
      void* p = a.allocate(bytes);
      auto t1 = clock_type::now();
      a.deallocate(p, bytes);
      auto t2 = clock_type::now();
      p = a.allocate(bytes);
      auto t3 = clock_type::now();
      a.deallocate(p, bytes);
      auto t4 = clock_type::now();
      a.release_cached();  // unmaps the cached stitched range (and releases free memory)
      auto t5 = clock_type::now();
      if (a.stats().stitches != 1 || a.stats().stitch_cache_hits != 1) {
        std::fprintf(stderr, "expected one stitch and one reuse for k=%zu\n", k);
        return 1;
      }
      (void)t4;
      fresh.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      reused.push_back(std::chrono::duration<double, std::micro>(t3 - t2).count());
      evicted.push_back(std::chrono::duration<double, std::micro>(t5 - t4).count());
      for (std::size_t i = 1; i < 2 * k; i += 2) a.deallocate(blocks[i], 2 * MiB + MiB);
    }
    std::printf("| %zu | %.1f | %.2f | %.1f |\n", k, median(fresh), median(reused), median(evicted));
    std::fflush(stdout);
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}
