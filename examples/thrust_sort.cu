// thrust through glake: a device_vector whose memory, and a sort whose temporary storage, come
// from a stitching allocator on the GPU, on one stream; then what glake held. Needs a GPU (CTest
// runs it through tests/gpu/run_or_skip.sh, which skips it without one).
#include <cuda_runtime.h>
#include <thrust/device_vector.h>
#include <thrust/sort.h>
#include <thrust/tabulate.h>

#include <glake/adaptors/thrust_allocator.hpp>
#include <glake/cuda_presets.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>

namespace {

// Keys in no particular order: a multiplicative hash of the index.
struct scrambled {
  __host__ __device__ std::uint32_t operator()(std::size_t i) const {
    std::uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull;
    x ^= x >> 29;
    return static_cast<std::uint32_t>((x * 0xbf58476d1ce4e5b9ull) >> 32);
  }
};

bool ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess;
}

}  // namespace

int main() {
  using namespace glake;
  using allocator_type = gpu_stitching_allocator<>;
  using keys_allocator = thrust_allocator<std::uint32_t, allocator_type>;

  if (!ok(cudaFree(nullptr), "cudaFree(nullptr)")) return 1;  // the runtime's context, shared with glake's driver calls
  cudaStream_t stream = nullptr;
  if (!ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags")) return 1;

  bool sorted = false;
  {
    // The allocator is the caller's: it must outlive every vector and policy that uses it.
    allocator_type allocator(cuda_provider(0), cuda_reserver(0));
    constexpr std::size_t n = std::size_t{1} << 26;  // 64 Mi keys, 256 MiB

    thrust::device_vector<std::uint32_t, keys_allocator> keys(n, keys_allocator(allocator, stream_ref{stream}));
    auto policy = thrust_policy(allocator, stream);  // thrust::cuda::par.on(stream), temporaries from glake
    thrust::tabulate(policy, keys.begin(), keys.end(), scrambled{});
    const statistics before = allocator.reset_peaks();
    thrust::sort(policy, keys.begin(), keys.end());
    const statistics after = allocator.stats();
    sorted = thrust::is_sorted(policy, keys.begin(), keys.end());

    std::printf("sorted %zu keys (%s): %s\n", n, format_bytes(n * sizeof(std::uint32_t)).c_str(),
                sorted ? "in order" : "NOT IN ORDER");
    std::printf("glake held: %s active before the sort, %s at its peak (the sort's temporary storage on top),\n"
                "            %s reserved from the driver (%llu cuMemCreate calls); the sort made %llu allocations\n",
                format_bytes(before.active_bytes).c_str(), format_bytes(after.peak_active_bytes).c_str(),
                format_bytes(after.reserved_bytes).c_str(),
                static_cast<unsigned long long>(after.driver_calls[driver_call::create]),
                static_cast<unsigned long long>(after.allocations - before.allocations));
  }
  cudaStreamDestroy(stream);
  return sorted ? 0 : 1;
}
