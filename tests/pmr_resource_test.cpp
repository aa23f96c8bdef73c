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
  CHECK_THROWS_AS((void)r.allocate(100, 4096), usage_error);  // above the guarantee: refused, not misaligned
  CHECK_THROWS_AS((void)r.allocate(std::size_t{4} << 30), std::bad_alloc);

  pmr_resource same_allocator(allocator, stream_ref{3});
  CHECK(r.is_equal(r));
  CHECK_FALSE(r.is_equal(same_allocator));
  CHECK(resource.stream() == stream_ref{3});
  CHECK(allocator.stats().active_bytes == 0);
}
