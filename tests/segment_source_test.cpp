// Segment sources (allocators/segment_source.hpp): what they promise at their limits.
#include <doctest/doctest.h>

#include <cstddef>

#include "glake/allocators/caching_allocator.hpp"
#include "glake/allocators/segment_source.hpp"
#include "glake/backends/sim.hpp"

namespace {

using namespace glake;
using sim_expandable = expandable_segment_source<sim_provider, sim_reserver>;

}  // namespace

TEST_CASE("expandable_segment_source: a huge extension is refused, never wrapped to a small one" *
          doctest::timeout(30)) {
  sim_device device(4 * GiB);
  sim_expandable source(sim_provider{device}, sim_reserver{device}, 2 * MiB, GiB, 512 * MiB);
  CHECK(source.capacity() == 512 * MiB);  // the limit, below the virtual size
  sim_expandable::lease_type lease;
  REQUIRE(source.try_acquire(2 * MiB, default_stream, lease));
  const std::size_t page = 2 * MiB;
  // For the first, lease.size + bytes wraps to 0: a sum, it would pass as a tiny extension.
  for (std::size_t bytes : {~std::size_t{0} - page + 1, ~std::size_t{0} - 2 * page + 1, std::size_t{1} << 63}) {
    CAPTURE(bytes);
    CHECK_FALSE(source.try_extend(lease, bytes));
    CHECK(lease.size == page);
  }
  CHECK(source.calls()[driver_call::create] == 1);
  source.release(lease);
  CHECK(device.physical_bytes() == 0);
}

TEST_CASE("caching_allocator over expandable segments: any size up to SIZE_MAX is null at once" *
          doctest::timeout(30)) {
  sim_device device(4 * GiB);
  caching_allocator<sim_expandable> allocator(sim_expandable{sim_provider{device}, sim_reserver{device}, 2 * MiB, GiB});
  void* held = allocator.allocate(1000);  // the stream now has a segment to extend
  const statistics before = allocator.stats();
  std::uint64_t failed = before.failed_allocations;
  for (std::size_t bytes : {GiB + 1, std::size_t{1} << 50, std::size_t{1} << 62, ~std::size_t{0} - 2 * MiB + 1,
                            ~std::size_t{0} - 1, ~std::size_t{0}}) {
    CAPTURE(bytes);
    CHECK(allocator.try_allocate(bytes) == nullptr);
    CHECK_THROWS_AS((void)allocator.allocate(bytes), out_of_memory);
    failed += 2;
    CHECK(allocator.stats().failed_allocations == failed);
  }
  CHECK(allocator.stats().driver_calls == before.driver_calls);
  allocator.verify();
  allocator.deallocate(held, 1000);
}
