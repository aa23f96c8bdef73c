// The internal building blocks: the node pool, the block arena and the VMM backend's remapping.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "glake/backends/sim.hpp"
#include "glake/detail/block_arena.hpp"
#include "glake/detail/driver_meter.hpp"
#include "glake/detail/node_pool.hpp"
#include "glake/detail/vmm_backend.hpp"

namespace {

struct tracked {
  static inline int alive = 0;
  std::uint64_t payload[4] = {1, 2, 3, 4};
  tracked() { ++alive; }
  explicit tracked(bool fail) {
    if (fail) throw std::runtime_error("constructor failed");
    ++alive;
  }
  ~tracked() { --alive; }
};

struct fake_segment {};

}  // namespace

TEST_CASE("node_pool: storage is recycled, so a warm pool stops growing") {
  glake::detail::node_pool<tracked> pool;
  pool.reserve(10);
  const std::size_t warm = pool.free_count();
  CHECK(warm >= 10);
  for (int round = 0; round < 1000; ++round) {
    std::vector<tracked*> made;
    for (int i = 0; i < 10; ++i) made.push_back(pool.create());
    CHECK(pool.free_count() == warm - 10);
    for (tracked* t : made) pool.destroy(t);
    CHECK(pool.free_count() == warm);  // every node came back; nothing new was allocated
  }
  CHECK(tracked::alive == 0);
}

TEST_CASE("node_pool: a throwing constructor gives its node back") {
  glake::detail::node_pool<tracked> pool;
  pool.reserve(1);
  const std::size_t before = pool.free_count();
  CHECK_THROWS_AS(pool.create(true), std::runtime_error);
  CHECK(pool.free_count() == before);
  tracked* t = pool.create(false);
  CHECK(t->payload[3] == 4);
  pool.destroy(t);
  CHECK(tracked::alive == 0);
}

TEST_CASE("block_arena: best fit, split, carve and coalesce") {
  glake::detail::block_arena<fake_segment> arena;
  fake_segment a, b;
  const glake::stream_ref s0{0}, s1{1};
  arena.add_segment(&a, 0x10000, 1000, s0);
  arena.add_segment(&b, 0x20000, 300, s0);
  arena.add_segment(&b, 0x30000, 5000, s1);
  CHECK(arena.free_bytes() == 6300);

  SUBCASE("best fit is the smallest block of the stream that fits") {
    CHECK(arena.best_fit(s0, 200)->address == 0x20000);
    CHECK(arena.best_fit(s0, 301)->address == 0x10000);
    CHECK(arena.best_fit(s0, 1001) == nullptr);  // the 5000 block is on another stream
    CHECK(arena.best_fit(s1, 1001)->address == 0x30000);
  }
  SUBCASE("take splits off the tail, give_back merges it again") {
    auto* blk = arena.take(arena.best_fit(s0, 400), 400);
    CHECK(blk->size == 400);
    CHECK_FALSE(blk->free);
    CHECK(arena.free_bytes() == 5900);
    CHECK(arena.splits() == 1);
    auto* tail = arena.next(blk);
    REQUIRE(tail != nullptr);
    CHECK(tail->address == 0x10000 + 400);
    CHECK(tail->free);
    CHECK(arena.indexed_as_free(*tail));
    auto* merged = arena.give_back(blk);
    CHECK(merged->address == 0x10000);
    CHECK(merged->size == 1000);
    CHECK(arena.blocks() == 3);
    CHECK(arena.merges() == 1);
    CHECK(arena.free_bytes() == 6300);
  }
  SUBCASE("carve takes a middle range and both sides stay free; giving it back merges all three") {
    auto* middle = arena.carve(arena.find(0x30000), 0x30000 + 1000, 2000);
    CHECK(middle->address == 0x30000 + 1000);
    CHECK(middle->size == 2000);
    CHECK(arena.containing(0x30000 + 999)->free);
    CHECK(arena.containing(0x30000 + 3000)->free);
    CHECK(arena.containing(0x30000 + 1500) == middle);
    CHECK(arena.blocks() == 5);
    auto* merged = arena.give_back(middle);
    CHECK(merged->address == 0x30000);
    CHECK(merged->size == 5000);
    CHECK(merged->free);
    CHECK(arena.indexed_as_free(*merged));
    CHECK(arena.blocks() == 3);
  }
  SUBCASE("blocks of different segments never merge") {
    arena.add_segment(&b, 0x10000 + 1000, 24, s0);  // adjacent in address, another segment
    auto* first = arena.take(arena.find(0x10000), 1000);
    auto* back = arena.give_back(first);
    CHECK(back->size == 1000);
    CHECK(arena.next(back)->segment == &b);
  }
  SUBCASE("largest-first iteration visits one stream, descending") {
    arena.add_segment(&a, 0x40000, 700, s0);
    std::vector<std::size_t> seen;
    arena.for_each_free_largest_first(s0, [&](auto& blk) {
      seen.push_back(blk.size);
      return true;
    });
    CHECK(seen == std::vector<std::size_t>{1000, 700, 300});
  }
}

TEST_CASE("block_arena: check_tiling catches gaps, overruns and unmerged neighbours") {
  struct seg {
    std::uintptr_t base;
    std::size_t size;
  };
  glake::detail::block_arena<seg> arena;
  seg s{0x10000, 4096};
  arena.add_segment(&s, s.base, s.size, glake::stream_ref{});
  const auto extent = [](const seg& x) { return std::pair{x.base, x.size}; };
  const auto fail = [](const std::string& what) { throw std::logic_error(what); };
  int visited = 0;
  const auto count = [&](const auto&) { ++visited; };

  auto* first = arena.take(arena.find(0x10000), 1024);
  CHECK_NOTHROW(arena.check_tiling(extent, fail, count));
  CHECK(visited == 2);

  s.size = 8192;  // the segment claims more than its blocks cover
  CHECK_THROWS_WITH_AS(arena.check_tiling(extent, fail, count), "the last segment's blocks do not reach its end",
                       std::logic_error);
  s.size = 4096;
  first->size = 512;  // a gap between the first block and the next
  CHECK_THROWS_WITH_AS(arena.check_tiling(extent, fail, count), "a segment's blocks are not contiguous",
                       std::logic_error);
  first->size = 1024;
  arena.give_back(first);
  CHECK_NOTHROW(arena.check_tiling(extent, fail, count));
}

TEST_CASE("vmm_backend: try_restitch replaces and appends handles within the reservation, and refuses bad changes") {
  using namespace glake;
  constexpr std::size_t chunk = 2 * MiB;
  sim_device device(64 * MiB);
  detail::vmm_backend<sim_provider, sim_reserver> backend(sim_provider{device}, sim_reserver{device});
  detail::mapped_segment<sim_provider::handle_type> segment;
  const std::vector<std::size_t> sizes(6, chunk);
  REQUIRE(backend.try_create_segment(sizes, segment));
  const auto slot = [&](std::size_t i) { return segment.slots[i]; };
  const std::vector layout = {slot(0), slot(1)};
  void* base = backend.try_map_stitched(layout, 4 * chunk);  // room for two more
  REQUIRE(base != nullptr);
  CHECK(device.reserved_bytes() == 6 * chunk + 4 * chunk);
  const auto handle_at = [&](std::size_t i) {
    const auto where = device.resolve(static_cast<char*>(base) + i * chunk);
    return where.has_value() && where->accessible ? where->handle : ~std::uint64_t{0};
  };
  using change = decltype(backend)::replacement;
  const std::size_t mappings = device.live_mappings();

  // Refused, with nothing changed: appends past the reservation, a gap before an append, out of
  // order, and a replacement of another size.
  for (const std::vector<change>& bad :
       {std::vector<change>{{2, slot(2)}, {3, slot(3)}, {4, slot(4)}}, std::vector<change>{{3, slot(3)}},
        std::vector<change>{{1, slot(2)}, {0, slot(3)}},
        std::vector<change>{{0, detail::handle_slot<sim_provider::handle_type>{slot(2).handle, 0, 2 * chunk}}}}) {
    CHECK_THROWS_AS(backend.try_restitch(base, 4 * chunk, layout, bad), std::invalid_argument);
    CHECK(device.live_mappings() == mappings);
    CHECK(handle_at(0) == slot(0).handle.id);
    CHECK(handle_at(1) == slot(1).handle.id);
  }

  // Replace the second handle and append two: 3 maps, one unmap, one access call over the run.
  const auto calls = backend.calls();
  const std::vector<change> changes = {{1, slot(3)}, {2, slot(4)}, {3, slot(5)}};
  REQUIRE(backend.try_restitch(base, 4 * chunk, layout, changes));
  CHECK(backend.calls()[glake::driver_call::map] - calls[glake::driver_call::map] == 3);
  CHECK(backend.calls()[glake::driver_call::unmap] - calls[glake::driver_call::unmap] == 1);
  CHECK(backend.calls()[glake::driver_call::set_access] - calls[glake::driver_call::set_access] == 1);
  CHECK(handle_at(0) == slot(0).handle.id);
  CHECK(handle_at(1) == slot(3).handle.id);
  CHECK(handle_at(2) == slot(4).handle.id);
  CHECK(handle_at(3) == slot(5).handle.id);

  for (std::size_t i = 0; i < 4; ++i) backend.unmap_stitched(static_cast<char*>(base) + i * chunk, chunk);
  backend.free_stitched(base, 4 * chunk);
  backend.destroy_segment(segment);
  CHECK(device.live_mappings() == 0);
  CHECK(device.reserved_bytes() == 0);
  CHECK(device.violations() == 0);
}

TEST_CASE("mapped_segment::index_of: a hint naming the handle is taken, any other is replaced") {
  constexpr std::size_t m = glake::MiB;
  glake::detail::mapped_segment<glake::sim_handle> segment;
  segment.count = 3;
  segment.slots = std::make_unique<glake::detail::handle_slot<glake::sim_handle>[]>(3);
  const std::size_t sizes[] = {2 * m, 4 * m, 2 * m};
  for (std::size_t i = 0, offset = 0; i < 3; offset += sizes[i], ++i) {
    segment.slots[i].offset = offset;
    segment.slots[i].size = sizes[i];
  }
  std::size_t hint = 0;
  CHECK(segment.index_of(2 * m, hint) == 1);  // searched
  CHECK(hint == 1);
  CHECK(segment.index_of(2 * m, hint) == 1);  // taken
  hint = 2;                                   // names another handle
  CHECK(segment.index_of(2 * m, hint) == 1);
  hint = 7;                                   // past the end
  CHECK(segment.index_of(6 * m, hint) == 2);
  CHECK(hint == 2);
  CHECK(segment.index_of(0, hint) == 0);
}

TEST_CASE("mapped_segment::first_at_or_after: std::lower_bound's answer for every count and offset") {
  constexpr std::size_t m = glake::MiB;
  for (std::size_t count = 0; count <= 9; ++count) {
    glake::detail::mapped_segment<glake::sim_handle> segment;
    segment.count = count;
    segment.slots = std::make_unique<glake::detail::handle_slot<glake::sim_handle>[]>(count + 1);
    std::vector<std::size_t> offsets;
    std::size_t offset = 0;
    for (std::size_t i = 0; i < count; ++i) {
      segment.slots[i].offset = offset;
      segment.slots[i].size = (i % 3 + 1) * 2 * m;  // handles of differing sizes
      offsets.push_back(offset);
      offset += segment.slots[i].size;
    }
    for (std::size_t probe = 0; probe <= offset + 2 * m; probe += m / 2) {
      const auto expected = static_cast<std::size_t>(std::lower_bound(offsets.begin(), offsets.end(), probe) - offsets.begin());
      CAPTURE(count);
      CAPTURE(probe);
      CHECK(segment.first_at_or_after(probe) == expected);
    }
  }
}

TEST_CASE("driver_meter: each call is counted and timed under its kind, a throwing one too") {
  using namespace std::chrono_literals;
  glake::detail::driver_meter meter;
  const int result = meter(glake::driver_call::map, [] {
    std::this_thread::sleep_for(3ms);
    return 42;
  });
  CHECK(result == 42);  // the call's result comes back
  CHECK(meter.counts()[glake::driver_call::map] == 1);
  CHECK(meter.times()[glake::driver_call::map] >= 3'000'000);
  CHECK(meter.counts().total() == 1);
  CHECK(meter.times().total() == meter.times()[glake::driver_call::map]);

  const std::uint64_t map_time = meter.times()[glake::driver_call::map];
  CHECK_THROWS_AS(meter(glake::driver_call::unmap,
                        []() -> int {
                          std::this_thread::sleep_for(2ms);
                          throw std::runtime_error("driver error");
                        }),
                  std::runtime_error);
  CHECK(meter.counts()[glake::driver_call::unmap] == 1);
  CHECK(meter.times()[glake::driver_call::unmap] >= 2'000'000);
  CHECK(meter.times()[glake::driver_call::map] == map_time);  // other kinds untouched
  CHECK(meter.counts()[glake::driver_call::create] == 0);
  CHECK(meter.times()[glake::driver_call::create] == 0);
}

TEST_CASE("driver_meter: in a sequence each call is timed from the end of the one before") {
  using namespace std::chrono_literals;
  glake::detail::driver_meter meter;
  const auto start = std::chrono::steady_clock::now();
  {
    const glake::detail::driver_meter::sequence calls(meter);
    {
      const glake::detail::driver_meter::sequence inner(meter);  // nested: changes nothing
      meter(glake::driver_call::create, [] { std::this_thread::sleep_for(2ms); });
    }
    meter(glake::driver_call::map, [] { std::this_thread::sleep_for(3ms); });
    // Between calls of a sequence, time counts toward the next call: without a sequence this
    // 4 ms gap would be counted nowhere.
    std::this_thread::sleep_for(4ms);
    CHECK_THROWS_AS(meter(glake::driver_call::set_access,
                          []() -> int {
                            std::this_thread::sleep_for(1ms);
                            throw std::runtime_error("driver error");
                          }),
                    std::runtime_error);
  }
  const auto wall = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start);
  CHECK(meter.counts().total() == 3);
  CHECK(meter.times()[glake::driver_call::create] >= 2'000'000);
  CHECK(meter.times()[glake::driver_call::map] >= 3'000'000);
  CHECK(meter.times()[glake::driver_call::set_access] >= 1'000'000);
  CHECK(meter.times()[glake::driver_call::set_access] >= 5'000'000);  // with the 4 ms gap before it
  // Each call's time ends where the next one's starts: no time is counted twice.
  CHECK(meter.times().total() <= static_cast<std::uint64_t>(wall.count()));

  // After the sequence, a call is timed on its own again: sleeping before it does not count.
  const std::uint64_t unmap_before = meter.times()[glake::driver_call::unmap];
  std::this_thread::sleep_for(5ms);
  meter(glake::driver_call::unmap, [] {});
  CHECK(meter.times()[glake::driver_call::unmap] - unmap_before < 5'000'000);
}
