// The segment pool (allocators/stitching/segment_pool.hpp) over the simulated backend: segments made of the
// growth policy's handles, counted as reserved, their whole handles, and the queue of fully free
// segments.
#include <doctest/doctest.h>

#include <cstddef>
#include <string>
#include <utility>

#include "glake/backends/sim.hpp"
#include "glake/detail/accounting.hpp"
#include "glake/allocators/stitching/segment_pool.hpp"
#include "glake/policies/eviction.hpp"
#include "glake/policies/growth.hpp"

namespace {

using namespace glake;
constexpr std::size_t M = MiB;
const stream_ref A{1}, B{2};

using pool_type = detail::segment_pool<sim_provider, sim_reserver, power_of_two_growth, lru_eviction>;

config handles_up_to(std::size_t max_handle, int min_handles) {
  config cfg;
  cfg.max_handle = max_handle;
  cfg.min_handles = min_handles;
  return cfg;
}

}  // namespace

TEST_CASE("segment pool: a new segment is one free block of the growth policy's handles, counted as reserved") {
  sim_device device(1 * GiB);
  detail::usage_counters counters;
  pool_type pool(sim_provider{device}, sim_reserver{device}, handles_up_to(8 * M, 2), counters);
  CHECK(pool.chunk() == 2 * M);
  CHECK(pool.growth().max_handle() == 8 * M);

  auto* b = pool.add_segment(22 * M, A);
  REQUIRE(b != nullptr);
  CHECK(b->free);
  CHECK(b->size == 22 * M);
  CHECK(b->stream == A);
  const auto& m = b->segment->mapping;
  CHECK(b->address == m.base);
  CHECK(m.size == 22 * M);
  REQUIRE(m.count == 4);  // 8 + 8 + 4 + 2
  CHECK(m.slots[0].size == 8 * M);
  CHECK(m.slots[2].size == 4 * M);
  CHECK(m.slots[3].offset == 20 * M);
  CHECK(counters.s.reserved_bytes == 22 * M);
  CHECK(counters.s.peak_reserved_bytes == 22 * M);
  CHECK(counters.s.segments_created == 1);
  CHECK(device.physical_bytes() == 22 * M);
  CHECK(device.live_handles() == 4);
  CHECK(device.live_mappings() == 4);
  CHECK(pool.backend().physical_bytes() == 22 * M);
  CHECK(pool.arena().free_bytes() == 22 * M);
  CHECK(pool.largest_free_block() == 22 * M);
  CHECK(pool.free_segments() == 1);
  CHECK(pool.free_victim() == b->segment);
  CHECK(b->segment->stitch_refs == 0);
  CHECK(device.violations() == 0);
}

TEST_CASE("segment pool: whole_handles_of gives the handles lying wholly inside a block") {
  sim_device device(1 * GiB);
  detail::usage_counters counters;
  pool_type pool(sim_provider{device}, sim_reserver{device}, handles_up_to(8 * M, 2), counters);
  auto* b = pool.add_segment(16 * M, A);  // handles of 8 MiB at 0 and 8 MiB
  REQUIRE(b != nullptr);
  REQUIRE(b->segment->mapping.count == 2);

  auto whole = pool.whole_handles_of(*b);
  CHECK(whole.block == b);
  CHECK(whole.offset == 0);
  CHECK(whole.size == 16 * M);

  auto* live = pool.arena().take(b, 6 * M);  // [0, 6) live, [6, 16) free
  auto* rest = pool.arena().next(live);
  whole = pool.whole_handles_of(*rest);
  CHECK(whole.block == rest);
  CHECK(whole.offset == 8 * M);  // the first handle starting in it
  CHECK(whole.size == 8 * M);
  whole = pool.whole_handles_of(*live);
  CHECK(whole.size == 0);  // 6 MiB of an 8 MiB handle

  auto* middle = pool.arena().take(rest, 4 * M);  // [6, 10) live, [10, 16) free
  whole = pool.whole_handles_of(*pool.arena().next(middle));
  CHECK(whole.size == 0);  // [10, 16) holds no whole handle
  pool.arena().give_back(middle);
  pool.arena().give_back(live);
}

TEST_CASE("segment pool: whole_handles_of agrees with a walk over handles of several sizes") {
  sim_device device(1 * GiB);
  detail::usage_counters counters;
  pool_type pool(sim_provider{device}, sim_reserver{device}, handles_up_to(8 * M, 1), counters);
  auto* b = pool.add_segment(30 * M, A);  // handles of 8, 8, 8, 4 and 2 MiB
  REQUIRE(b != nullptr);
  const auto& m = b->segment->mapping;
  REQUIRE(m.count == 5);
  REQUIRE(m.slots[4].size == 2 * M);
  // The first handle starting in the block (or its end), and the handles lying wholly inside it.
  const auto walk = [&](const pool_type::block_type& x) {
    const std::size_t begin = x.address - m.base, end = begin + x.size;
    std::size_t first = end, size = 0;
    for (std::size_t i = m.count; i-- > 0;) {
      if (m.slots[i].offset >= begin) first = m.slots[i].offset;
      if (m.slots[i].offset >= begin && m.slots[i].offset + m.slots[i].size <= end) size += m.slots[i].size;
    }
    return std::pair{first, size};
  };
  std::size_t compared = 0;
  for (std::size_t cut = 0; cut < 30 * M; cut += M) {
    for (std::size_t length = M; cut + length <= 30 * M; length += M) {
      auto* whole = pool.arena().find(m.base);
      REQUIRE(whole != nullptr);
      auto* live = pool.arena().carve(whole, m.base + cut, length);
      for (auto* x = pool.arena().find(m.base); x != nullptr; x = pool.arena().next(x)) {
        const auto run = pool.whole_handles_of(*x);
        CHECK(run.block == x);
        CHECK(std::pair{run.offset, run.size} == walk(*x));
        ++compared;
      }
      pool.arena().give_back(live);
    }
  }
  CHECK(compared > 1000);
  CHECK(pool.arena().blocks() == 1);
}

TEST_CASE("segment pool: the free queue holds exactly the fully free segments, in eviction order") {
  sim_device device(1 * GiB);
  detail::usage_counters counters;
  pool_type pool(sim_provider{device}, sim_reserver{device}, config{}, counters);
  auto* b1 = pool.add_segment(8 * M, A);
  auto* b2 = pool.add_segment(4 * M, B);
  REQUIRE(b1 != nullptr);
  REQUIRE(b2 != nullptr);
  auto* s1 = b1->segment;
  auto* s2 = b2->segment;
  CHECK(pool.free_segments() == 2);
  CHECK(pool.free_victim() == s1);  // lru: the oldest first

  // Taking part of a segment takes it out of the queue; freeing it whole again puts it back last.
  pool.leave_free_queue(b1);
  auto* live = pool.arena().take(b1, 2 * M);
  CHECK(pool.free_segments() == 1);
  CHECK(pool.free_victim() == s2);
  auto* merged = pool.arena().give_back(live);
  pool.enter_free_queue(merged);
  CHECK(pool.free_segments() == 2);
  CHECK(pool.free_victim() == s2);

  // Blocks that are not a whole segment never enter.
  pool.leave_free_queue(b2);
  auto* part = pool.arena().take(b2, 2 * M);
  pool.enter_free_queue(pool.arena().next(part));
  CHECK(pool.free_segments() == 1);
  pool.enter_free_queue(pool.arena().give_back(part));
  CHECK(pool.free_segments() == 2);

  pool.unqueue(s1);
  CHECK(pool.free_victim() == s2);
  pool.requeue(s1);
  CHECK(pool.free_victim() == s2);
  pool.unqueue(s2);
  CHECK(pool.free_victim() == s1);
  pool.requeue(s2);

  // Dropping a segment gives everything back to the device and the counters.
  pool.drop_segment(s1);
  CHECK(pool.free_segments() == 1);
  CHECK(counters.s.reserved_bytes == 4 * M);
  CHECK(counters.s.peak_reserved_bytes == 12 * M);
  CHECK(counters.s.segments_released == 1);
  CHECK(device.physical_bytes() == 4 * M);
  CHECK(pool.arena().blocks() == 1);
  pool.drop_segment(pool.free_victim());
  CHECK(pool.free_segments() == 0);
  CHECK(counters.s.reserved_bytes == 0);
  CHECK(counters.s.segments_released == 2);
  CHECK(device.physical_bytes() == 0);
  CHECK(device.reserved_bytes() == 0);
  CHECK(device.live_mappings() == 0);
  CHECK(pool.arena().blocks() == 0);
  CHECK(pool.free_victim() == nullptr);
  CHECK(device.violations() == 0);
}

TEST_CASE("segment pool: out of memory is null with nothing counted or left behind") {
  sim_device device(16 * M);
  detail::usage_counters counters;
  pool_type pool(sim_provider{device}, sim_reserver{device}, handles_up_to(4 * M, 1), counters);
  CHECK(pool.add_segment(32 * M, A) == nullptr);
  CHECK(pool.add_segment(~std::size_t{0} - 1, A) == nullptr);  // rounding would overflow
  CHECK(counters.s.reserved_bytes == 0);
  CHECK(counters.s.segments_created == 0);
  CHECK(pool.free_segments() == 0);
  CHECK(pool.arena().blocks() == 0);
  CHECK(device.physical_bytes() == 0);
  CHECK(device.reserved_bytes() == 0);
  CHECK(device.live_handles() == 0);

  config limited = handles_up_to(4 * M, 1);
  limited.memory_limit = 8 * M;
  sim_device roomy(1 * GiB);
  {
    pool_type capped(sim_provider{roomy}, sim_reserver{roomy}, limited, counters);
    REQUIRE(capped.add_segment(8 * M, A) != nullptr);
    CHECK(capped.add_segment(2 * M, A) == nullptr);  // over the memory limit
    CHECK(counters.s.segments_created == 1);
    CHECK(roomy.physical_bytes() == 8 * M);
    CHECK(roomy.calls()[driver_call::create] == 2);  // the refused segment made no call
  }  // the pool gives its segment back
  CHECK(roomy.physical_bytes() == 0);
  CHECK(roomy.reserved_bytes() == 0);
  CHECK(roomy.violations() == 0);
}

TEST_CASE("segment pool: its destruction gives every segment back, whatever its blocks") {
  sim_device device(1 * GiB);
  detail::usage_counters counters;
  {
    pool_type pool(sim_provider{device}, sim_reserver{device}, handles_up_to(8 * M, 2), counters);
    auto* b1 = pool.add_segment(16 * M, A);
    auto* b2 = pool.add_segment(6 * M, B);
    REQUIRE(b1 != nullptr);
    REQUIRE(b2 != nullptr);
    pool.leave_free_queue(b1);
    pool.arena().take(b1, 10 * M);
    REQUIRE(device.live_handles() == 2 + 3);  // 8 + 8, and 2 + 2 + 2 (none above half of 6)
  }
  CHECK(device.physical_bytes() == 0);
  CHECK(device.live_handles() == 0);
  CHECK(device.reserved_bytes() == 0);
  CHECK(device.violations() == 0);
}

TEST_CASE("segment pool: the chunk must be a multiple of the granularity, and small_segment of the chunk") {
  sim_device device(1 * GiB);
  detail::usage_counters counters;
  config cfg;
  cfg.chunk_size = 3 * M;
  try {
    pool_type pool(sim_provider{device}, sim_reserver{device}, cfg, counters);
    FAIL("expected a config_error");
  } catch (const config_error& e) {
    CHECK(std::string(e.what()).find("chunk_size") != std::string::npos);
  }
  cfg.chunk_size = 4 * M;  // the default small_segment, 2 MiB, is no multiple of it
  try {
    pool_type pool(sim_provider{device}, sim_reserver{device}, cfg, counters);
    FAIL("expected a config_error");
  } catch (const config_error& e) {
    // The setting changed is named first: chunk_size, not the small_segment it was set against.
    CHECK(std::string(e.what()).find("chunk_size (") != std::string::npos);
    CHECK(std::string(e.what()).find("must divide small_segment") != std::string::npos);
  }
  cfg.chunk_size = 0;
  cfg.small_segment = 1 * M;  // below the 2 MiB granularity that chunk_size 0 stands for
  try {
    pool_type pool(sim_provider{device}, sim_reserver{device}, cfg, counters);
    FAIL("expected a config_error");
  } catch (const config_error& e) {
    CHECK(std::string(e.what()).find("small_segment (") != std::string::npos);
    CHECK(std::string(e.what()).find("granularity") != std::string::npos);
  }
  cfg.chunk_size = 4 * M;
  cfg.small_segment = 8 * M;
  pool_type pool(sim_provider{device}, sim_reserver{device}, cfg, counters);
  CHECK(pool.chunk() == 4 * M);
  cfg.max_handle = 6 * M;  // the growth policy's own check
  CHECK_THROWS_AS(pool_type(sim_provider{device}, sim_reserver{device}, cfg, counters), config_error);
}

TEST_CASE("segment pool: a segment with room grows in place, its free last block joining the new memory") {
  sim_device device(1 * GiB);
  detail::usage_counters counters;
  pool_type pool(sim_provider{device}, sim_reserver{device}, handles_up_to(0, 8), counters);
  auto* b = pool.add_segment(4 * M, A, 64 * M);
  REQUIRE(b != nullptr);
  auto* s = b->segment;
  CHECK(s->mapping.room() == 60 * M);
  CHECK(pool.growing(A) == s);
  CHECK(pool.growing(B) == nullptr);
  CHECK(pool_type::grows(*s));
  CHECK(pool.add_segment(2 * M, B) != nullptr);  // no room: not a growing segment
  CHECK(pool.growing(B) == nullptr);

  // A live head, a free 1 MiB tail: new memory joins the tail.
  pool.leave_free_queue(b);
  pool.arena().take(b, 3 * M);
  auto* tail = pool.extend(s, 4 * M, A);
  REQUIRE(tail != nullptr);
  CHECK(tail->address == s->mapping.base + 3 * M);
  CHECK(tail->size == 5 * M);
  CHECK(s->mapping.size == 8 * M);
  CHECK(s->mapping.count == 4);
  CHECK(s->mapping.slots[3].offset == 6 * M);
  CHECK(s->mapping.room() == 56 * M);
  CHECK(counters.s.reserved_bytes == 10 * M);
  CHECK(counters.s.segments_created == 2);  // growing is not a new segment
  CHECK(device.physical_bytes() == 10 * M);
  CHECK(pool.extend(s, 58 * M, A) == nullptr);  // beyond its room: nothing changes
  CHECK(s->mapping.size == 8 * M);
  CHECK(device.physical_bytes() == 10 * M);
  CHECK(device.violations() == 0);
}

TEST_CASE("segment pool: split cuts a segment at a handle, and the pieces share its range until the last goes") {
  sim_device device(1 * GiB);
  detail::usage_counters counters;
  pool_type pool(sim_provider{device}, sim_reserver{device}, handles_up_to(0, 8), counters);
  auto* b = pool.add_segment(8 * M, A, 64 * M);
  REQUIRE(b != nullptr);
  auto* s = b->segment;
  pool.leave_free_queue(b);
  auto* first = pool.arena().take(b, 2 * M);  // live [0, 2), free [2, 8)
  auto* rest = pool.arena().find(s->mapping.base + 2 * M);
  auto* middle = pool.arena().carve(rest, s->mapping.base + 2 * M, 4 * M);  // live [2, 6), free [6, 8)
  auto* t = pool.split(s, 6 * M);
  CHECK(s->mapping.size == 6 * M);
  CHECK(s->mapping.count == 3);
  CHECK(s->mapping.room() == 0);
  CHECK(t->mapping.base == s->mapping.base + 6 * M);
  CHECK(t->mapping.size == 2 * M);
  CHECK(t->mapping.count == 1);
  CHECK(t->mapping.slots[0].offset == 0);
  CHECK(t->mapping.room() == 56 * M);  // the room to grow goes with the end
  CHECK(pool.growing(A) == t);
  CHECK(pool.arena().find(t->mapping.base)->segment == t);
  CHECK(pool.free_segments() == 1);  // t is one free block
  auto* u = pool.split(s, 2 * M);
  CHECK(u->mapping.size == 4 * M);
  CHECK(pool.arena().find(u->mapping.base) == middle);
  CHECK(middle->segment == u);
  pool.enter_free_queue(pool.arena().give_back(middle));
  CHECK(pool.free_segments() == 2);
  pool.drop_segment(u);
  pool.drop_segment(t);
  CHECK(device.physical_bytes() == 2 * M);
  CHECK(counters.s.reserved_bytes == 2 * M);
  CHECK(device.reserved_bytes() == 64 * M);  // s still lies in the shared range
  pool.enter_free_queue(pool.arena().give_back(first));
  pool.drop_segment(s);
  CHECK(device.reserved_bytes() == 0);
  CHECK(device.physical_bytes() == 0);
  CHECK(device.live_mappings() == 0);
  CHECK(device.violations() == 0);
}
