// The std::pmr adaptor: standard containers on glake allocators.
#include <doctest/doctest.h>

#include <cstdint>
#include <memory_resource>
#include <string>
#include <string_view>
#include <vector>

#include "glake/adaptors/pmr_resource.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/host.hpp"
#include "glake/backends/sim.hpp"
#include "support/usage_kind.hpp"

using namespace glake;

TEST_CASE("pmr_resource: standard containers run on the stitching allocator over real memory") {
  stitching_allocator<host_provider, host_reserver> allocator(host_provider(2 * MiB, 256 * MiB),
                                                              host_reserver(2 * MiB));
  pmr_resource resource(allocator);
  {
    std::pmr::vector<std::uint64_t> numbers(&resource);
    for (std::uint64_t i = 0; i < 1'000'000; ++i) numbers.push_back(i * i);  // grows past 1 MiB
    std::pmr::vector<std::pmr::string> words(&resource);
    for (int i = 0; i < 1000; ++i) words.emplace_back(std::string(100, static_cast<char>('a' + i % 26)));
    CHECK(numbers[999'999] == 999'999ull * 999'999ull);
    CHECK(std::string_view(words[27]) == std::string(100, 'b'));
    CHECK(allocator.stats().active_bytes >= 8'000'000);
    allocator.verify();
  }
  CHECK(allocator.stats().active_bytes == 0);
  CHECK(allocator.stats().allocations == allocator.stats().deallocations);
}

TEST_CASE("pmr_resource: zero bytes, alignment, identity and errors") {
  sim_device device(1 * GiB);
  stitching_allocator<sim_provider, sim_reserver> allocator(sim_provider{device}, sim_reserver{device});
  pmr_resource resource(allocator, stream_ref{3});
  std::pmr::memory_resource& r = resource;

  void* zero = r.allocate(0);
  CHECK(zero != nullptr);  // pmr wants a usable pointer
  void* other_zero = r.allocate(0);
  CHECK(other_zero != zero);
  r.deallocate(zero, 0);
  r.deallocate(other_zero, 0);

  void* aligned = r.allocate(100, 512);
  CHECK(reinterpret_cast<std::uintptr_t>(aligned) % 512 == 0);
  r.deallocate(aligned, 100, 512);
  // Above the guarantee: refused, not misaligned; the allocator cannot serve it at all.
  CHECK(testing::usage_kind([&] { (void)r.allocate(100, 4096); }) == usage_error::kind::unsupported);
  CHECK_THROWS_AS((void)r.allocate(std::size_t{4} << 30), std::bad_alloc);

  pmr_resource same_allocator(allocator, stream_ref{3});
  CHECK(r.is_equal(r));
  CHECK_FALSE(r.is_equal(same_allocator));
  CHECK(resource.stream() == stream_ref{3});
  CHECK(allocator.stats().active_bytes == 0);
}

TEST_CASE("pmr_resource: any size up to SIZE_MAX is a bad_alloc at once, counted" * doctest::timeout(30)) {
  sim_device device(1 * GiB);
  stitching_allocator<sim_provider, sim_reserver> allocator(sim_provider{device}, sim_reserver{device});
  pmr_resource resource(allocator);
  std::pmr::memory_resource& r = resource;
  const std::size_t sizes[] = {GiB + 1, std::size_t{1} << 50, std::size_t{1} << 62, ~std::size_t{0} - 1,
                               ~std::size_t{0}};
  for (std::size_t bytes : sizes) {
    CAPTURE(bytes);
    CHECK_THROWS_AS((void)r.allocate(bytes), out_of_memory);
  }
  CHECK(allocator.stats().failed_allocations == std::size(sizes));
  CHECK(allocator.stats().driver_calls.total() == 0);
}
