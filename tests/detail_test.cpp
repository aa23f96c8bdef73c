// The internal building blocks: the node pool and the block arena.
#include <doctest/doctest.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "glake/detail/block_arena.hpp"
#include "glake/detail/node_pool.hpp"

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
