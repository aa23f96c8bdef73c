// presets: the named compositions are the allocators they say (policies, lock), with_lock_t swaps
// only the lock, and each preset allocates, stitches or caches as its allocator does.
#include <doctest/doctest.h>

#include <cstddef>
#include <type_traits>

#include "glake/presets.hpp"

namespace {

using namespace glake;

// Naming a lock restates nothing else.
static_assert(std::is_same_v<host_stitching_allocator<>,
                             stitching_allocator<host_provider, host_reserver, best_fit_tail_stitching, lru_eviction,
                                                 no_lock, gmlake_admission, power_of_two_growth>>);
static_assert(std::is_same_v<shared_sim_stitching_allocator,
                             stitching_allocator<sim_provider, sim_reserver, best_fit_tail_stitching, lru_eviction,
                                                 mutex_lock>>);
static_assert(std::is_same_v<host_caching_allocator<mutex_lock>,
                             caching_allocator<vmm_segment_source<host_provider, host_reserver>, mutex_lock>>);
// Each preset is the allocator its name says (concepts of allocators/concepts.hpp).
static_assert(allocator<host_stitching_allocator<>> && owning_allocator<host_stitching_allocator<>>);
static_assert(stream_recording_allocator<shared_host_stitching_allocator>);
static_assert(owning_allocator<host_caching_allocator<>> && cache_releasing_allocator<host_caching_allocator<mutex_lock>>);
static_assert(allocator<sim_stitching_allocator<>> && memory_limiting_allocator<shared_sim_stitching_allocator>);
static_assert(owning_allocator<sim_caching_allocator<>> && peak_resetting_allocator<sim_caching_allocator<mutex_lock>>);
// with_lock_t keeps the other policies of a composition that is no preset.
using largest_first = stitching_allocator<sim_provider, sim_reserver, largest_first_stitching, lru_eviction>;
static_assert(std::is_same_v<with_lock_t<largest_first, mutex_lock>,
                             stitching_allocator<sim_provider, sim_reserver, largest_first_stitching, lru_eviction,
                                                 mutex_lock>>);
static_assert(std::is_same_v<lock_of_t<with_lock_t<largest_first, mutex_lock>>, mutex_lock>);
static_assert(std::is_same_v<with_lock_t<with_lock_t<largest_first, mutex_lock>, no_lock>, largest_first>);
static_assert(std::is_same_v<with_lock_t<sim_caching_allocator<>, mutex_lock>, sim_caching_allocator<mutex_lock>>);

constexpr std::size_t MB = std::size_t{1} << 20;

}  // namespace

TEST_CASE("presets: the host stitching preset stitches two free blocks, with either lock") {
  config cfg;
  cfg.frag_limit = 2 * MB;
  const auto stitch_two = [&](auto& allocator) {
    void* blocks[4];
    for (void*& b : blocks) b = allocator.allocate(8 * MB);
    allocator.deallocate(blocks[0], 8 * MB);
    allocator.deallocate(blocks[2], 8 * MB);
    void* big = allocator.allocate(16 * MB);
    const statistics s = allocator.stats();
    CHECK(s.stitches == 1);
    CHECK(s.reserved_bytes == 32 * MB);
    allocator.deallocate(big, 16 * MB);
    allocator.deallocate(blocks[1], 8 * MB);
    allocator.deallocate(blocks[3], 8 * MB);
    allocator.verify();
  };
  host_stitching_allocator<> one_thread(host_provider(), host_reserver(), cfg);
  stitch_two(one_thread);
  shared_host_stitching_allocator shared(host_provider(), host_reserver(), cfg);
  stitch_two(shared);
}

TEST_CASE("presets: the simulated presets stitch and cache on one sim_device") {
  sim_device gpu(256 * MB);
  config cfg;
  cfg.frag_limit = 2 * MB;
  shared_sim_stitching_allocator stitching(sim_provider{gpu}, sim_reserver{gpu}, cfg);
  void* a = stitching.allocate(6 * MB);
  CHECK(stitching.owns(a));
  CHECK(stitching.stats().active_bytes >= 6 * MB);
  stitching.deallocate(a, 6 * MB);

  sim_caching_allocator<> caching(vmm_segment_source<sim_provider, sim_reserver>(sim_provider{gpu}, sim_reserver{gpu}));
  void* b = caching.allocate(4096);
  void* c = caching.allocate(4096);
  CHECK(b != c);
  caching.deallocate(b, 4096);
  CHECK(caching.allocate(4096) == b);  // best fit reuses the cached block
  caching.deallocate(b, 4096);
  caching.deallocate(c, 4096);
  CHECK(caching.stats().active_bytes == 0);
  CHECK(gpu.violations() == 0);
}
