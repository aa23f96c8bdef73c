// Stream adoption (allocators/stitching/stream_adoption.hpp) over a block_arena and stream clocks: other
// streams' completed free blocks move to a request's stream, best fit or gathered largest first;
// pending ones are waited for; free neighbours left on different streams are merged.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

#include "glake/backends/sim.hpp"
#include "glake/detail/block_arena.hpp"
#include "glake/allocators/stitching/stream_adoption.hpp"
#include "glake/allocators/stitching/stream_clocks.hpp"
#include "glake/detail/vmm_backend.hpp"
#include "glake/statistics.hpp"
#include "support/evented_reserver.hpp"

namespace {

using namespace glake;
constexpr std::size_t M = MiB;
const stream_ref A{1}, B{2}, C{3};

struct fake_segment {
  detail::mapped_segment<int> mapping;
};
using arena_type = detail::block_arena<fake_segment>;
using block_type = arena_type::block_type;

// Free blocks of the given sizes on `stream`, separated by live 2 MiB blocks, in one segment.
struct segment_of_blocks {
  fake_segment segment;
  std::vector<block_type*> free;

  segment_of_blocks(arena_type& arena, std::uintptr_t base, std::initializer_list<std::size_t> sizes,
                    stream_ref stream) {
    std::size_t total = 0;
    for (std::size_t s : sizes) total += s + 2 * M;
    segment.mapping.base = base;
    segment.mapping.size = total;
    block_type* rest = arena.add_segment(&segment, base, total, stream);
    for (std::size_t s : sizes) {
      block_type* live = arena.carve(rest, rest->address + s, 2 * M);
      free.push_back(arena.prev(live));
      rest = arena.next(live);
    }
  }
};

struct moves {
  std::size_t count = 0;
  std::size_t bytes = 0;
  std::size_t whole_segments = 0;
  std::vector<block_type*> merged;
  auto callback() {
    return [this](std::size_t n, bool was_whole, block_type* b) {
      ++count;
      bytes += n;
      whole_segments += was_whole ? 1 : 0;
      merged.push_back(b);
    };
  }
};

const auto all_whole = [](block_type& b) { return b.size; };

std::size_t free_bytes_on(arena_type& arena, stream_ref stream) {
  std::size_t bytes = 0;
  arena.for_each_free_largest_first(stream, [&](block_type& b) {
    bytes += b.size;
    return true;
  });
  return bytes;
}

using plain_clocks = detail::stream_clocks<detail::no_events>;

// Event-free clocks on which each of `streams` has called, in order.
plain_clocks clocks_entered(std::initializer_list<stream_ref> streams) {
  plain_clocks clocks(detail::no_events{}, 0);
  for (stream_ref s : streams) clocks.enter(s);
  return clocks;
}
using plain_adoption = detail::stream_adoption<arena_type, plain_clocks>;

}  // namespace

TEST_CASE("stream adoption: the best completed fit among other streams' free blocks moves to the request's stream") {
  arena_type arena;
  segment_of_blocks on_b(arena, 0x100000000, {8 * M, 16 * M, 24 * M}, B);
  segment_of_blocks on_c(arena, 0x200000000, {14 * M}, C);
  plain_clocks clocks(detail::no_events{}, 0);
  plain_adoption adoption(16, 8);
  moves m;

  clocks.enter(A);
  CHECK_FALSE(adoption.adopt(arena, clocks, 12 * M, A, false, all_whole, m.callback()));  // one stream only
  clocks.enter(B);
  clocks.enter(C);
  CHECK_FALSE(adoption.mixed());

  CHECK(adoption.adopt(arena, clocks, 12 * M, A, false, all_whole, m.callback()));
  CHECK(adoption.mixed());
  REQUIRE(m.count == 1);
  CHECK(m.bytes == 14 * M);  // C's 14 MiB fits better than B's 16 MiB
  CHECK(m.whole_segments == 0);
  CHECK(m.merged[0] == on_c.free[0]);
  CHECK(on_c.free[0]->stream == A);
  CHECK(arena.best_fit(A, 12 * M) == on_c.free[0]);
  CHECK(arena.best_fit(C, 1) == nullptr);

  CHECK(adoption.adopt(arena, clocks, 12 * M, A, false, all_whole, m.callback()));
  CHECK(m.bytes == 14 * M + 16 * M);
  CHECK(on_b.free[1]->stream == A);

  // No single block serves 25 MiB, and without gathering nothing moves.
  CHECK_FALSE(adoption.adopt(arena, clocks, 25 * M, A, false, all_whole, m.callback()));
  CHECK(m.count == 2);
  // The request's own stream is never a source: B's 8 MiB would fit, but A's 14 MiB moves to B.
  CHECK(adoption.adopt(arena, clocks, 8 * M, B, false, all_whole, m.callback()));
  CHECK(m.count == 3);
  CHECK(m.merged.back() == on_c.free[0]);
  CHECK(on_c.free[0]->stream == B);
  CHECK(on_b.free[0]->stream == B);
}

TEST_CASE("stream adoption: gathering takes the largest usable blocks until their whole handles cover the request") {
  arena_type arena;
  segment_of_blocks on_b(arena, 0x100000000, {8 * M, 16 * M, 24 * M}, B);
  segment_of_blocks on_c(arena, 0x200000000, {14 * M, 4 * M}, C);
  plain_clocks clocks = clocks_entered({A, B, C});
  plain_adoption adoption(16, 8);
  moves m;

  CHECK(adoption.adopt(arena, clocks, 30 * M, A, true, all_whole, m.callback()));
  CHECK(m.count == 2);
  CHECK(m.bytes == 40 * M);  // 24 + 16: largest first, until covered
  CHECK(on_b.free[2]->stream == A);
  CHECK(on_b.free[1]->stream == A);
  CHECK(on_c.free[0]->stream == C);
  CHECK(free_bytes_on(arena, A) == 40 * M);

  // Blocks without a whole handle are not taken: here, those under 10 MiB.
  moves n;
  const auto whole_from_10 = [](block_type& b) { return b.size >= 10 * M ? b.size : std::size_t{0}; };
  CHECK(adoption.adopt(arena, clocks, 100 * M, A, true, whole_from_10, n.callback()));
  CHECK(n.count == 1);
  CHECK(n.bytes == 14 * M);  // C's 14; B's 8 and C's 4 have no whole handle
  CHECK(on_b.free[0]->stream == B);
  CHECK(free_bytes_on(arena, C) == 4 * M);
  // Nothing usable left elsewhere: nothing moves.
  CHECK_FALSE(adoption.adopt(arena, clocks, 100 * M, A, true, whole_from_10, n.callback()));
  CHECK(n.count == 1);
}

TEST_CASE("stream adoption: a whole free segment moving is reported as such, and merges with its new stream's neighbours") {
  arena_type arena;
  fake_segment s;
  s.mapping.base = 0x100000000;
  s.mapping.size = 16 * M;
  block_type* whole = arena.add_segment(&s, s.mapping.base, 16 * M, B);
  plain_clocks clocks = clocks_entered({A, B});
  plain_adoption adoption(16, 8);
  moves m;
  CHECK(adoption.adopt(arena, clocks, 16 * M, A, false, all_whole, m.callback()));
  CHECK(m.whole_segments == 1);
  CHECK(m.merged[0] == whole);
  CHECK(whole->stream == A);
  CHECK(whole->free_mark == 0);

  // Two neighbours of B: the second to move joins the first on A.
  arena_type arena2;
  fake_segment s2;
  s2.mapping.base = 0x200000000;
  s2.mapping.size = 16 * M;
  block_type* left = arena2.add_segment(&s2, s2.mapping.base, 16 * M, B);
  block_type* live = arena2.take(left, 8 * M);
  block_type* right = arena2.next(live);
  arena2.restream(right, C);
  arena2.give_back(live);  // free again, on B: left half B, right half C
  REQUIRE(arena2.blocks() == 2);
  plain_clocks clocks2(detail::no_events{}, 0);
  clocks2.enter(A);
  clocks2.enter(B);
  clocks2.enter(C);
  moves n;
  CHECK(adoption.adopt(arena2, clocks2, 12 * M, A, true, all_whole, n.callback()));
  CHECK(n.count == 2);
  CHECK(arena2.blocks() == 1);
  CHECK(arena2.first()->size == 16 * M);
  CHECK(arena2.first()->stream == A);
  CHECK(n.merged.back() == arena2.first());
}

// The class comment promises at most `max_candidates` candidates when gathering and no heap
// allocation once constructed (adopt is noexcept), however many streams hold free blocks.
TEST_CASE("stream adoption: gathering looks at no more than max_candidates blocks across streams") {
  arena_type arena;
  segment_of_blocks on_b(arena, 0x100000000, {8 * M, 8 * M}, B);
  segment_of_blocks on_c(arena, 0x200000000, {4 * M, 4 * M}, C);
  plain_clocks clocks = clocks_entered({A, B, C});
  plain_adoption adoption(2, 8);
  moves m;
  CHECK(adoption.adopt(arena, clocks, 1 * GiB, A, true, all_whole, m.callback()));
  CHECK(m.count <= 2);
}

TEST_CASE("stream adoption: blocks whose frees have not completed stay, waiting for them waits on just their stream's event") {
  sim_device device(1 * GiB);
  testing::event_log log;
  testing::evented_reserver reserver(device, log);
  statistics stats;
  using events = detail::counted_events<testing::evented_reserver>;
  using clocks_type = detail::stream_clocks<events>;
  clocks_type clocks(events{reserver, stats}, 0);
  detail::stream_adoption<arena_type, clocks_type> adoption(16, 8);

  arena_type arena;
  fake_segment s;
  s.mapping.base = 0x100000000;
  s.mapping.size = 32 * M;
  clocks.enter(A);
  clocks.enter(B);
  clocks.enter(C);
  block_type* b = arena.add_segment(&s, s.mapping.base, 32 * M, B);
  block_type* live = arena.take(b, 16 * M);
  arena.give_back(live, clocks.mark_free(B));  // freed on B, its work not done yet
  clocks.tick(B);
  REQUIRE(log.events.size() == 1);
  block_type* pending = arena.find(s.mapping.base);
  REQUIRE(pending->free_mark == 1);

  moves m;
  CHECK_FALSE(adoption.adopt(arena, clocks, 24 * M, A, false, all_whole, m.callback()));
  CHECK_FALSE(adoption.adopt(arena, clocks, 24 * M, A, true, all_whole, m.callback()));
  CHECK(m.count == 0);

  // Waiting: not when the pending blocks would not serve the request ...
  CHECK_FALSE(adoption.wait_for_other_streams(arena, clocks, 64 * M, A, false, all_whole));
  CHECK_FALSE(adoption.wait_for_other_streams(arena, clocks, 64 * M, A, true, all_whole));
  CHECK(log.waited == 0);
  // ... nor for the request's own stream ...
  CHECK_FALSE(adoption.wait_for_other_streams(arena, clocks, 24 * M, B, false, all_whole));
  // ... but when they would: on B's event, not the device.
  CHECK(adoption.wait_for_other_streams(arena, clocks, 24 * M, A, false, all_whole));
  CHECK(log.waited == 1);
  CHECK(log.device_synchronized == 0);
  CHECK(stats.device_waits == 1);
  CHECK(clocks.completed(B, 1));

  CHECK(adoption.adopt(arena, clocks, 24 * M, A, false, all_whole, m.callback()));
  CHECK(m.count == 1);
  CHECK(m.bytes == 32 * M);
  CHECK(m.whole_segments == 1);
  CHECK(log.waited == 1);
}

TEST_CASE("stream adoption: merge_across_streams merges free neighbours of different streams within a segment") {
  arena_type arena;
  fake_segment s1, s2;
  s1.mapping.base = 0x100000000;
  s1.mapping.size = 24 * M;
  s2.mapping.base = s1.mapping.base + 24 * M;  // right after s1: never merged with it
  s2.mapping.size = 8 * M;
  block_type* first = arena.add_segment(&s1, s1.mapping.base, 24 * M, A);
  block_type* middle = arena.carve(first, s1.mapping.base + 8 * M, 8 * M);
  arena.restream(arena.next(middle), B);  // [16, 24) free on B
  arena.give_back(middle);                // [0, 16) free on A
  block_type* other = arena.add_segment(&s2, s2.mapping.base, 8 * M, C);
  REQUIRE(arena.blocks() == 3);

  plain_clocks clocks(detail::no_events{}, 0);
  plain_adoption adoption(16, 8);
  std::vector<block_type*> merged;
  CHECK_FALSE(adoption.merge_across_streams(arena, clocks, [&](block_type* b) { merged.push_back(b); }));
  REQUIRE(merged.size() == 1);
  CHECK(merged[0] == first);
  CHECK(arena.blocks() == 2);
  CHECK(first->size == 24 * M);
  CHECK(first->stream == A);
  CHECK(arena.next(first) == other);
  CHECK(other->stream == C);

  // With events, the device is synchronized once before the first merge.
  sim_device device(1 * GiB);
  testing::event_log log;
  testing::evented_reserver reserver(device, log);
  statistics stats;
  using events = detail::counted_events<testing::evented_reserver>;
  using clocks_type = detail::stream_clocks<events>;
  clocks_type evented(events{reserver, stats}, 0);
  detail::stream_adoption<arena_type, clocks_type> evented_adoption(16, 8);
  block_type* live = arena.take(first, 8 * M);
  arena.restream(arena.next(live), B);
  arena.give_back(live);
  block_type* live2 = arena.take(other, 4 * M);
  arena.restream(arena.next(live2), A);
  arena.give_back(live2);
  REQUIRE(arena.blocks() == 4);
  merged.clear();
  CHECK(evented_adoption.merge_across_streams(arena, evented, [&](block_type* b) { merged.push_back(b); }));
  CHECK(merged.size() == 2);
  CHECK(log.device_synchronized == 1);
  CHECK(arena.blocks() == 2);

  // Nothing to merge: no synchronize.
  CHECK_FALSE(evented_adoption.merge_across_streams(arena, evented, [&](block_type* b) { merged.push_back(b); }));
  CHECK(log.device_synchronized == 1);
}

namespace {
// Clocks over a joining reserver, streams A, B, C entered, and one 32 MiB segment of B freed on
// B (mark 1, its event pending).
struct joinable_pending {
  sim_device device{1 * GiB};
  testing::event_log log;
  testing::joining_reserver reserver{device, log};
  statistics stats;
  using events = detail::counted_events<testing::joining_reserver>;
  using clocks_type = detail::stream_clocks<events>;
  clocks_type clocks{events{reserver, stats}, 0};
  arena_type arena;
  fake_segment s;
  block_type* pending = nullptr;

  joinable_pending() {
    s.mapping.base = 0x100000000;
    s.mapping.size = 32 * M;
    clocks.enter(A);
    clocks.enter(B);
    clocks.enter(C);
    block_type* b = arena.add_segment(&s, s.mapping.base, 32 * M, B);
    block_type* live = arena.take(b, 16 * M);
    arena.give_back(live, clocks.mark_free(B));
    clocks.tick(B);
    pending = arena.find(s.mapping.base);
  }
};
static_assert(joinable_pending::clocks_type::can_join);
static_assert(!plain_clocks::can_join);
}  // namespace

TEST_CASE("stream adoption: with joins, the request's stream waits on the other stream's event and takes its pending block") {
  joinable_pending f;
  detail::stream_adoption<arena_type, joinable_pending::clocks_type> adoption(16, 8, true);
  moves m;
  CHECK(adoption.wait_for_other_streams(f.arena, f.clocks, 24 * M, A, false, all_whole));
  REQUIRE(f.log.joins.size() == 1);
  CHECK(f.log.joins[0] == std::pair{A, B});
  CHECK(f.log.waited == 0);
  CHECK(f.stats.stream_joins == 1);
  CHECK(f.stats.device_waits == 0);
  CHECK_FALSE(f.clocks.completed(B, 1));  // B's work is not known done ...
  CHECK(f.clocks.usable(B, 1, A));        // ... but A is ordered after it
  CHECK_FALSE(f.clocks.usable(B, 1, C));  // C is not

  CHECK(adoption.adopt(f.arena, f.clocks, 24 * M, A, false, all_whole, m.callback()));
  REQUIRE(m.count == 1);
  CHECK(m.bytes == 32 * M);
  CHECK(f.pending->stream == A);
  // A's now, marked with A's next free: a third stream waits for A's next event.
  CHECK(f.pending->free_mark == 1);
  CHECK_FALSE(f.clocks.completed(A, f.pending->free_mark));
  CHECK_FALSE(f.clocks.usable(B, 1, A));  // the join ended with the request
  CHECK_FALSE(adoption.adopt(f.arena, f.clocks, 8 * M, C, false, all_whole, m.callback()));
  CHECK(m.count == 1);
}

TEST_CASE("stream adoption: a join that fails leaves the block where it was, for the host to wait for") {
  joinable_pending f;
  detail::stream_adoption<arena_type, joinable_pending::clocks_type> adoption(16, 8, true);
  f.log.fail_joins = true;
  f.clocks.clear_wanted();
  for (auto& c : f.clocks) {
    if (c.stream == B) c.wanted = 1;
  }
  CHECK(f.clocks.join_wanted(A));  // a mark is left for the host
  CHECK(f.stats.stream_joins == 0);
  CHECK_FALSE(f.clocks.usable(B, 1, A));
  moves m;
  CHECK_FALSE(adoption.adopt(f.arena, f.clocks, 8 * M, A, false, all_whole, m.callback()));
  CHECK(f.pending->stream == B);
  CHECK(f.pending->free_mark == 1);

  // Through the adoption: the host waits instead, then the block moves.
  CHECK(adoption.wait_for_other_streams(f.arena, f.clocks, 8 * M, A, false, all_whole));
  CHECK(f.log.joins.empty());
  CHECK(f.log.waited == 1);
  CHECK(f.stats.device_waits == 1);
  CHECK(adoption.adopt(f.arena, f.clocks, 8 * M, A, false, all_whole, m.callback()));
  CHECK(f.pending->stream == A);
  CHECK(f.pending->free_mark == 0);  // its work done: A's like any completed block
}

TEST_CASE("stream adoption: without the option, or while the stream captures, the host waits") {
  joinable_pending f;
  detail::stream_adoption<arena_type, joinable_pending::clocks_type> off(16, 8, false);
  CHECK(off.wait_for_other_streams(f.arena, f.clocks, 8 * M, A, false, all_whole));
  CHECK(f.log.joins.empty());
  CHECK(f.log.waited == 1);

  joinable_pending g;
  detail::stream_adoption<arena_type, joinable_pending::clocks_type> on(16, 8, true);
  g.device.begin_capture(A);
  CHECK(on.wait_for_other_streams(g.arena, g.clocks, 8 * M, A, false, all_whole));
  CHECK(g.log.joins.empty());
  CHECK(g.log.waited == 1);
}
