// thrust on a real GPU through glake (include/glake/adaptors/thrust_allocator.hpp): device_vector
// memory and the temporary storage of sort, reduce and scan come from a stitching allocator over
// the CUDA backend, on a stream of the test's own. tests/thrust_allocator_test.cpp tests the same
// adaptor without a GPU.
#include <doctest/doctest.h>

#include <cuda_runtime.h>
#include <thrust/copy.h>
#include <thrust/device_vector.h>
#include <thrust/functional.h>
#include <thrust/reduce.h>
#include <thrust/scan.h>
#include <thrust/sequence.h>
#include <thrust/sort.h>
#include <thrust/tabulate.h>
#include <thrust/transform_reduce.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "glake/adaptors/thrust_allocator.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/cuda.hpp"
#include "../support/thrust_growth.hpp"

namespace {

using namespace glake;
using cuda_stitching = stitching_allocator<cuda_provider, cuda_reserver>;
template <class T>
using glake_vector = thrust::device_vector<T, thrust_allocator<T, cuda_stitching>>;

// What thrust reads off the types, checked where thrust is compiled for the GPU.
using int_allocator = thrust_allocator<int, cuda_stitching>;
static_assert(std::is_same_v<int_allocator::rebind<char>::other, thrust_allocator<char, cuda_stitching>>);
static_assert(std::is_same_v<std::allocator_traits<int_allocator>::rebind_alloc<double>,
                             thrust_allocator<double, cuda_stitching>>);
static_assert(std::is_same_v<int_allocator::pointer, thrust::device_ptr<int>>);
static_assert(std::is_same_v<glake_vector<int>::allocator_type, int_allocator>);
static_assert(std::is_convertible_v<int_allocator, thrust_allocator<char, cuda_stitching>>);
static_assert(!std::is_default_constructible_v<int_allocator>);
// The policies hold a thrust_allocator<char> by value (a reference would dangle once the
// expression that made the policy ends), on par's and par_nosync's stream bases. thrust's own
// names, as RMM's exec_policy spells them.
static_assert(std::is_same_v<decltype(thrust_policy(std::declval<cuda_stitching&>(), cudaStream_t{})),
                             thrust::detail::execute_with_allocator<thrust_allocator<char, cuda_stitching>,
                                                                    thrust::cuda_cub::execute_on_stream_base>>);
static_assert(std::is_same_v<decltype(thrust_policy_nosync(std::declval<cuda_stitching&>(), cudaStream_t{})),
                             thrust::detail::execute_with_allocator<thrust_allocator<char, cuda_stitching>,
                                                                    thrust::cuda_cub::execute_on_stream_nosync_base>>);

// Keys in no particular order: a multiplicative hash of the index.
struct scrambled {
  __host__ __device__ std::uint32_t operator()(std::size_t i) const {
    std::uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull;
    x ^= x >> 29;
    x *= 0xbf58476d1ce4e5b9ull;
    return static_cast<std::uint32_t>(x >> 32);
  }
};

struct widen {
  __host__ __device__ std::uint64_t operator()(std::uint32_t x) const { return x; }
};

// A non-blocking stream, so nothing on it is ordered with the default stream by accident.
struct test_stream {
  test_stream() { REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess); }
  ~test_stream() { cudaStreamDestroy(s); }
  test_stream(const test_stream&) = delete;
  test_stream& operator=(const test_stream&) = delete;
  cudaStream_t s = nullptr;
};

}  // namespace

TEST_CASE("gpu: thrust device_vector grows to 64 Mi elements taking every byte from glake") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  test_stream stream;
  cuda_stitching allocator(cuda_provider(0), cuda_reserver(0));
  constexpr std::size_t target = std::size_t{64} << 20;
  {
    glake_vector<std::uint32_t> v{thrust_allocator<std::uint32_t, cuda_stitching>(allocator, stream_ref{stream.s})};
    CHECK(allocator.stats().active_bytes == 0);
    const int reallocations = testing::grow_checked(v, allocator, target);
    CHECK(reallocations >= 8);
    std::vector<std::uint32_t> host(v.size());
    thrust::copy(v.begin(), v.end(), host.begin());  // every element survived the copies on growth
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < host.size(); ++i) wrong += host[i] != static_cast<std::uint32_t>(i);
    CHECK(wrong == 0);
    v.shrink_to_fit();
    CHECK(v.capacity() == target);
    CHECK(allocator.stats().active_bytes == target * sizeof(std::uint32_t));
    allocator.verify();
  }
  CHECK(allocator.stats().active_bytes == 0);
  CHECK(allocator.stats().allocations == allocator.stats().deallocations);
  CHECK(allocator.stats().reserved_bytes >= target * sizeof(std::uint32_t));  // cached, not returned
}

TEST_CASE("gpu: thrust sort of 10^8 keys on a stream takes its temporary storage from glake") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  test_stream stream;
  cuda_stitching allocator(cuda_provider(0), cuda_reserver(0));
  constexpr std::size_t n = 100'000'000;
  const std::size_t vector_bytes = n * sizeof(std::uint32_t);
  {
    glake_vector<std::uint32_t> keys(n, thrust_allocator<std::uint32_t, cuda_stitching>(allocator, stream_ref{stream.s}));
    REQUIRE(allocator.stats().active_bytes == vector_bytes);
    auto policy = thrust_policy(allocator, stream.s);
    thrust::tabulate(policy, keys.begin(), keys.end(), scrambled{});
    const std::uint64_t sum = thrust::transform_reduce(policy, keys.begin(), keys.end(), widen{}, std::uint64_t{0},
                                                       thrust::plus<std::uint64_t>());
    REQUIRE_FALSE(thrust::is_sorted(policy, keys.begin(), keys.end()));

    allocator.reset_peaks();
    const std::uint64_t allocations = allocator.stats().allocations;
    thrust::sort(policy, keys.begin(), keys.end());
    const statistics after = allocator.stats();
    MESSAGE("sort of 10^8 keys: peak active " << format_bytes(after.peak_active_bytes) << ", reserved "
                                              << format_bytes(after.reserved_bytes) << ", "
                                              << after.allocations - allocations << " allocations");
    CHECK(after.allocations > allocations);              // the temporary storage came from glake
    CHECK(after.peak_active_bytes > vector_bytes);       // on top of the keys
    CHECK(after.active_bytes == vector_bytes);           // and went back
    CHECK(thrust::is_sorted(policy, keys.begin(), keys.end()));
    CHECK(thrust::transform_reduce(policy, keys.begin(), keys.end(), widen{}, std::uint64_t{0},
                                   thrust::plus<std::uint64_t>()) == sum);  // a permutation of the keys
    std::uint32_t ends[2] = {1, 0};
    thrust::copy(keys.begin(), keys.begin() + 1, ends);
    thrust::copy(keys.end() - 1, keys.end(), ends + 1);
    CHECK(ends[0] < ends[1]);
    allocator.verify();
  }
  CHECK(allocator.stats().active_bytes == 0);
}

TEST_CASE("gpu: thrust reduce and inclusive_scan through glake's policies give the right answers") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  test_stream stream;
  cuda_stitching allocator(cuda_provider(0), cuda_reserver(0));
  using alloc = thrust_allocator<std::uint64_t, cuda_stitching>;
  constexpr std::size_t n = 10'000'000;
  {
    glake_vector<std::uint64_t> values(n, alloc(allocator, stream_ref{stream.s}));
    glake_vector<std::uint64_t> prefix(n, alloc(allocator, stream_ref{stream.s}));
    const std::size_t live = 2 * n * sizeof(std::uint64_t);
    thrust::sequence(thrust_policy(allocator, stream.s), values.begin(), values.end());  // 0, 1, ..., n - 1

    std::uint64_t allocations = allocator.stats().allocations;
    const std::uint64_t sum = thrust::reduce(thrust_policy(allocator, stream.s), values.begin(), values.end(),
                                             std::uint64_t{0});
    CHECK(sum == std::uint64_t{n} * (n - 1) / 2);
    CHECK(allocator.stats().allocations > allocations);  // reduce's temporary storage came from glake
    CHECK(allocator.stats().active_bytes == live);

    // par_nosync: the scan may still run when inclusive_scan returns; its temporary storage is
    // already freed on the stream, where nothing can reuse it before the scan is done.
    allocations = allocator.stats().allocations;
    thrust::inclusive_scan(thrust_policy_nosync(allocator, stream.s), values.begin(), values.end(), prefix.begin());
    CHECK(allocator.stats().allocations > allocations);
    CHECK(allocator.stats().active_bytes == live);
    REQUIRE(cudaStreamSynchronize(stream.s) == cudaSuccess);
    std::vector<std::uint64_t> host(n);
    thrust::copy(prefix.begin(), prefix.end(), host.begin());
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i) wrong += host[i] != std::uint64_t{i} * (i + 1) / 2;
    CHECK(wrong == 0);
    allocator.verify();
  }
  CHECK(allocator.stats().active_bytes == 0);
}

TEST_CASE("gpu: thrust allocators are equal on the same allocator and stream, vectors move memory with them") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  test_stream one, two;
  cuda_stitching first(cuda_provider(0), cuda_reserver(0));
  cuda_stitching second(cuda_provider(0), cuda_reserver(0));
  const int_allocator a(first, stream_ref{one.s});
  CHECK(a == int_allocator(first, stream_ref{one.s}));
  CHECK(a != int_allocator(first, stream_ref{two.s}));
  CHECK(a != int_allocator(second, stream_ref{one.s}));
  const thrust_allocator<char, cuda_stitching> rebound(a);
  CHECK(rebound == a);
  CHECK(rebound.stream() == stream_ref{one.s});
  CHECK(thrust_policy(first, one.s).get_allocator() == rebound);
  CHECK(thrust_policy_nosync(first, two.s).get_allocator() != rebound);

  {
    glake_vector<int> v(1 << 20, 5, int_allocator(first, stream_ref{one.s}));
    glake_vector<int> w(3 << 20, 7, int_allocator(second, stream_ref{two.s}));
    v = std::move(w);  // v's memory goes back to first; w's memory, with its allocator, to v
    CHECK(first.stats().active_bytes == 0);
    CHECK(second.stats().active_bytes == v.capacity() * sizeof(int));
    CHECK(v.get_allocator() == int_allocator(second, stream_ref{two.s}));
    CHECK(v.size() == std::size_t{3} << 20);
    CHECK(v.back() == 7);
  }
  CHECK(first.stats().active_bytes == 0);
  CHECK(second.stats().active_bytes == 0);
  first.verify();
  second.verify();
}
