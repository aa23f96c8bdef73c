// The thrust adaptor without a GPU: built with THRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP
// (tests/CMakeLists.txt), so thrust's "device" memory is host memory and its algorithms run on the
// host, over a stitching allocator on real host memory. tests/gpu/thrust_test.cu runs the same
// adaptor on a GPU.
#include <doctest/doctest.h>

#include <thrust/copy.h>
#include <thrust/device_vector.h>
#include <thrust/equal.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/reduce.h>
#include <thrust/scan.h>
#include <thrust/sequence.h>
#include <thrust/sort.h>
#include <thrust/system/cpp/execution_policy.h>
#include <thrust/tabulate.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "glake/adaptors/thrust_allocator.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/host.hpp"
#include "glake/backends/sim.hpp"
#include "support/thrust_growth.hpp"

static_assert(THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CPP, "this test runs thrust on the host");

namespace {

using namespace glake;
using host_stitching = stitching_allocator<host_provider, host_reserver>;
using sim_stitching = stitching_allocator<sim_provider, sim_reserver>;
template <class T>
using vector_of = thrust::device_vector<T, thrust_allocator<T, host_stitching>>;

host_stitching make_allocator() { return host_stitching(host_provider(2 * MiB, 1 * GiB), host_reserver(2 * MiB)); }

// A vector's elements on the host, all of them in one copy.
template <class T>
std::vector<T> to_host(const vector_of<T>& v) {
  std::vector<T> out(v.size());
  thrust::copy(v.begin(), v.end(), out.begin());
  return out;
}

// Rebinds and conversions keep the allocator; equality is "same allocator and same stream".
static_assert(std::is_same_v<thrust_allocator<int, host_stitching>::rebind<double>::other,
                             thrust_allocator<double, host_stitching>>);
static_assert(std::is_same_v<std::allocator_traits<thrust_allocator<int, host_stitching>>::rebind_alloc<char>,
                             thrust_allocator<char, host_stitching>>);
static_assert(std::is_convertible_v<thrust_allocator<int, host_stitching>, thrust_allocator<char, host_stitching>>);
static_assert(!std::is_convertible_v<thrust_allocator<int, host_stitching>, thrust_allocator<int, sim_stitching>>);
static_assert(std::is_same_v<vector_of<int>::allocator_type, thrust_allocator<int, host_stitching>>);

}  // namespace

TEST_CASE("thrust_allocator: a device_vector growing to 4 Mi elements takes every byte from glake") {
  host_stitching allocator = make_allocator();
  constexpr std::size_t target = std::size_t{4} << 20;
  {
    vector_of<std::uint32_t> v{thrust_allocator<std::uint32_t, host_stitching>(allocator, stream_ref{7})};
    CHECK(allocator.stats().active_bytes == 0);
    const int reallocations = testing::grow_checked(v, allocator, target);
    CHECK(reallocations >= 8);
    CHECK(thrust::equal(v.begin(), v.end(), thrust::counting_iterator<std::uint32_t>(0)));  // copies kept the data
    v.shrink_to_fit();
    CHECK(v.capacity() == target);
    CHECK(allocator.stats().active_bytes == target * sizeof(std::uint32_t));
    allocator.verify();
  }
  CHECK(allocator.stats().active_bytes == 0);
  CHECK(allocator.stats().allocations == allocator.stats().deallocations);
}

TEST_CASE("thrust_allocator: thrust's algorithms take their temporary storage from glake through the policy") {
  host_stitching allocator = make_allocator();
  using alloc = thrust_allocator<std::uint64_t, host_stitching>;
  constexpr std::size_t n = 1 << 20;
  vector_of<std::uint64_t> keys(n, alloc(allocator));
  thrust::tabulate(keys.begin(), keys.end(), [](std::size_t i) -> std::uint64_t { return (i * 2654435761u) % 1000003; });
  const std::size_t vector_bytes = n * sizeof(std::uint64_t);
  REQUIRE(allocator.stats().active_bytes == vector_bytes);
  const std::uint64_t sum = thrust::reduce(keys.begin(), keys.end(), std::uint64_t{0});

  // The CPP system's counterpart of glake::thrust_policy (which exists only for CUDA).
  auto policy = thrust::cpp::par(thrust_allocator<char, host_stitching>(allocator));
  allocator.reset_peaks();
  const std::uint64_t allocations = allocator.stats().allocations;
  thrust::stable_sort(policy, keys.begin(), keys.end());  // a merge sort: a temporary buffer of n keys
  CHECK(allocator.stats().allocations > allocations);
  CHECK(allocator.stats().peak_active_bytes >= 2 * vector_bytes);
  CHECK(allocator.stats().active_bytes == vector_bytes);
  CHECK(thrust::is_sorted(keys.begin(), keys.end()));
  CHECK(thrust::reduce(keys.begin(), keys.end(), std::uint64_t{0}) == sum);  // a permutation

  vector_of<std::uint64_t> prefix(n, alloc(allocator));
  thrust::inclusive_scan(policy, thrust::counting_iterator<std::uint64_t>(1),
                         thrust::counting_iterator<std::uint64_t>(n + 1), prefix.begin());
  const std::vector<std::uint64_t> sums = to_host(prefix);
  CHECK(sums[0] == 1u);
  CHECK(sums[n - 1] == std::uint64_t{n} * (n + 1) / 2);
  allocator.verify();
}

TEST_CASE("thrust_allocator: equality, and the memory travels with its allocator on move and swap") {
  host_stitching first = make_allocator();
  host_stitching second = make_allocator();
  using alloc = thrust_allocator<int, host_stitching>;
  const alloc a(first, stream_ref{1});
  CHECK(a == alloc(first, stream_ref{1}));
  CHECK(a != alloc(first, stream_ref{2}));   // same allocator, another stream
  CHECK(a != alloc(second, stream_ref{1}));  // another allocator
  const thrust_allocator<char, host_stitching> rebound(a);
  CHECK(rebound == a);
  CHECK(&rebound.allocator() == &first);
  CHECK(rebound.stream() == stream_ref{1});

  {
    vector_of<int> v(1000, 5, alloc(first));
    vector_of<int> w(3000, 7, alloc(second));
    v = std::move(w);  // v's memory goes back to first, w's memory and allocator move to v
    CHECK(first.stats().active_bytes == 0);
    CHECK(second.stats().active_bytes == v.capacity() * sizeof(int));
    CHECK(v.get_allocator() == alloc(second));
    CHECK(to_host(v) == std::vector<int>(3000, 7));

    vector_of<int> x(500, 9, alloc(first));
    v.swap(x);  // allocators swap with the memory
    CHECK(x.get_allocator() == alloc(second));
    CHECK(v.get_allocator() == alloc(first));
    CHECK(first.stats().active_bytes == v.capacity() * sizeof(int));

    vector_of<int> copy(alloc(second, stream_ref{3}));
    copy = v;  // copy assignment keeps the target's allocator
    CHECK(copy.get_allocator() == alloc(second, stream_ref{3}));
    CHECK(to_host(copy) == std::vector<int>(500, 9));
    CHECK(second.stats().active_bytes == (x.capacity() + copy.capacity()) * sizeof(int));
  }
  CHECK(first.stats().active_bytes == 0);
  CHECK(second.stats().active_bytes == 0);
  first.verify();
  second.verify();
}

TEST_CASE("thrust_allocator: zero elements, overflow, alignment and out of memory") {
  sim_device device(1 * GiB);
  sim_stitching allocator(sim_provider{device}, sim_reserver{device});
  thrust_allocator<double, sim_stitching> doubles(allocator, stream_ref{4});

  // Zero elements: a distinct usable pointer (cub reads a null buffer as a size query).
  const auto zero = doubles.allocate(0);
  const auto other_zero = doubles.allocate(0);
  CHECK(zero.get() != nullptr);
  CHECK(zero != other_zero);
  doubles.deallocate(zero, 0);
  doubles.deallocate(other_zero, 0);
  doubles.deallocate(thrust::device_ptr<double>(), 10);  // null is ignored

  // n * sizeof(T) would wrap around: refused by name before the allocator sees it.
  CHECK(doubles.max_size() == ~std::size_t{0} / sizeof(double));
  CHECK_THROWS_AS((void)doubles.allocate(doubles.max_size() + 1), usage_error);
  CHECK_THROWS_WITH_AS((void)doubles.allocate(~std::size_t{0} / 4), doctest::Contains("overflow"), usage_error);

  // Above the allocator's alignment: refused rather than served misaligned.
  struct alignas(1024) page_aligned {
    char bytes[1024];
  };
  REQUIRE(allocator.alignment() < alignof(page_aligned));
  thrust_allocator<page_aligned, sim_stitching> pages(allocator);
  CHECK_THROWS_AS((void)pages.allocate(1), usage_error);

  // Out of memory is glake's out_of_memory, a std::bad_alloc, and leaves nothing behind.
  CHECK_THROWS_AS((void)doubles.allocate(2 * GiB / sizeof(double)), out_of_memory);
  CHECK_THROWS_AS((void)doubles.allocate(2 * GiB / sizeof(double)), std::bad_alloc);
  const auto fits = doubles.allocate(1000);
  CHECK(allocator.stats().active_bytes == 1000 * sizeof(double));
  doubles.deallocate(fits, 1000);
  CHECK(allocator.stats().active_bytes == 0);
  CHECK(allocator.stats().failed_allocations == 2);
  allocator.verify();
}
