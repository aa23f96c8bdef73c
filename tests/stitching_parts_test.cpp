// The stitching allocator's release and ladder parts (allocators/stitching/segment_release.hpp,
// allocation_ladder.hpp) over the simulated backend, without a stitcher: fully free segments go
// back in Evict order and not while retained; the ladder's rungs come in their order, and a rung
// that releases memory lets a new segment through.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "glake/allocators/stitching/allocation_ladder.hpp"
#include "glake/allocators/stitching/segment_pool.hpp"
#include "glake/allocators/stitching/segment_release.hpp"
#include "glake/allocators/stitching/stream_adoption.hpp"
#include "glake/allocators/stitching/stream_clocks.hpp"
#include "glake/backends/sim.hpp"
#include "glake/detail/accounting.hpp"
#include "glake/policies/admission.hpp"
#include "glake/policies/eviction.hpp"
#include "glake/policies/growth.hpp"

namespace {

using namespace glake;
constexpr std::size_t M = MiB;
const stream_ref A{1};

using pool_type = detail::segment_pool<sim_provider, sim_reserver, power_of_two_growth, lru_eviction>;
using clocks_type = detail::stream_clocks<detail::no_events>;
using adoption_type = detail::stream_adoption<pool_type::arena_type, clocks_type>;
using release_type = detail::segment_release<pool_type, clocks_type, adoption_type, detail::no_stitcher>;
static_assert(detail::segment_releasing<release_type>);

// Records the order in which the ladder asks for the rungs it does not own.
struct recording_host {
  std::string* log;
  bool reclaim_small() noexcept {
    *log += "small ";
    return false;
  }
  bool finish_deferred() noexcept {
    *log += "deferred ";
    return false;
  }
  void finish_moves() noexcept { *log += "moves "; }
  bool moving() const noexcept { return false; }
};
static_assert(detail::ladder_host<recording_host>);
using ladder_type = detail::allocation_ladder<pool_type, clocks_type, detail::no_stitcher, gmlake_admission,
                                              adoption_type, release_type, recording_host>;
static_assert(detail::allocation_laddering<ladder_type>);

config two_mib_handles() {
  config cfg;
  cfg.max_handle = 2 * M;
  return cfg;
}

// A pool with its clocks, adoption, release and ladder, as the allocator wires them.
struct parts {
  sim_device device;
  config cfg = two_mib_handles();
  detail::usage_counters counters;
  pool_type pool;
  clocks_type clocks{detail::no_events{}, 0};
  adoption_type adoption{16, 8};
  detail::no_stitcher stitcher;
  release_type release{pool, clocks, adoption, stitcher};
  gmlake_admission admission{cfg};
  std::string log;
  ladder_type ladder{pool, clocks, counters, admission, stitcher, adoption, release, recording_host{&log}, 512};

  explicit parts(std::size_t capacity)
      : device(capacity), pool(sim_provider{device}, sim_reserver{device}, cfg, counters) {
    clocks.enter(A);
  }
};

}  // namespace

TEST_CASE("segment release: fully free segments go back oldest first until the bytes asked for are released") {
  parts p(1024 * M);
  auto* first = p.pool.add_segment(4 * M, A);
  auto* second = p.pool.add_segment(8 * M, A);
  auto* live = p.pool.add_segment(6 * M, A);
  REQUIRE((first != nullptr && second != nullptr && live != nullptr));
  p.pool.leave_free_queue(live);
  p.pool.arena().take(live, 6 * M);  // not fully free: never released
  CHECK(p.pool.free_segments() == 2);

  CHECK(p.release.release(1 * M) == 4 * M);  // one segment, the oldest
  CHECK(p.pool.free_segments() == 1);
  CHECK(p.counters.s.reserved_bytes == 14 * M);
  CHECK(p.release.release(~std::size_t{0}) == 8 * M);
  CHECK(p.pool.free_segments() == 0);
  CHECK(p.counters.s.reserved_bytes == 6 * M);
  CHECK(p.device.physical_bytes() == 6 * M);
  CHECK(p.release.evict(~std::size_t{0}, true) == 0);  // no stitcher: nothing cached to drop
  CHECK(p.device.violations() == 0);
}

TEST_CASE("segment release: while retained nothing goes back, afterwards it does") {
  parts p(1024 * M);
  REQUIRE(p.pool.add_segment(4 * M, A) != nullptr);
  p.release.retain(true);
  CHECK(p.release.retained());
  CHECK(p.release.release(~std::size_t{0}) == 0);
  CHECK(p.release.release(~std::size_t{0}, false) == 0);
  CHECK(p.pool.free_segments() == 1);
  p.release.retain(false);
  CHECK_FALSE(p.release.retained());
  CHECK(p.release.release(~std::size_t{0}, false) == 4 * M);  // no events: every free has completed
  CHECK(p.device.physical_bytes() == 0);
}

TEST_CASE("allocation ladder: a free block of the stream first, else the rungs in order until one serves") {
  parts p(16 * M);
  auto* parked = p.pool.add_segment(8 * M, A);
  REQUIRE(parked != nullptr);

  // A fit: the first attempt, no rung asked.
  void* small_fit = p.ladder.allocate(6 * M, A);
  CHECK(small_fit != nullptr);
  CHECK(p.log.empty());
  CHECK(p.counters.s.allocated_bytes == 6 * M);

  // 12 MiB: no free block fits and 8 + 12 > 16, so rung 0 fails; rung 1 finishes deferred frees
  // and moves, then releases free segments for the request: nothing is free (6 of 8 MiB live).
  CHECK(p.ladder.allocate(12 * M, A) == nullptr);
  CHECK(p.log == "small deferred moves ");
  CHECK(p.device.physical_bytes() == 8 * M);

  // Freed, the 8 MiB segment is fully free: rung 1's release makes room and a new segment serves.
  auto* b = p.pool.arena().find(reinterpret_cast<std::uintptr_t>(small_fit));
  REQUIRE(b != nullptr);
  p.counters.on_deallocate(b->requested, b->size);
  p.pool.enter_free_queue(p.pool.arena().give_back(b, p.clocks.mark_free(b->stream)));
  p.log.clear();
  void* large = p.ladder.allocate(12 * M, A);
  CHECK(large != nullptr);
  CHECK(p.log == "small deferred moves ");
  CHECK(p.device.physical_bytes() == 12 * M);
  CHECK(p.counters.s.allocated_bytes == 12 * M);
  p.log.clear();
  CHECK(p.ladder.allocate(64 * M, A) == nullptr);  // more than the device: refused before any rung
  CHECK(p.log.empty());
  CHECK(p.device.violations() == 0);
}
