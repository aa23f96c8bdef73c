// Stream adoption: a request that its own stream cannot serve from free memory takes other
// streams' free blocks whose frees have completed, before the allocator stitches or grows.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "glake/stream.hpp"

namespace glake::detail {

/// Moves free blocks between the streams of a block_arena, by the completion marks of a
/// stream_clocks: the best fit for a request when one completed block will do; else (`gather`)
/// the largest completed blocks until their whole handles cover it. It can also wait for just
/// the streams whose pending frees would cover a request, and merge the free neighbours that
/// moves leave on different streams.
///
/// The callbacks keep it apart from the allocator's other bookkeeping: `whole(block)` gives the
/// bytes of whole handles in a free block (what a stitch can use); `moved(block_bytes,
/// was_whole_segment, merged_block)` is told of each move.
/// Complexity: best fit O(streams x (log n + probes)); gathering O(k log k) for k candidates
/// (at most `max_candidates`). No heap allocation once constructed.
/// Thread safety: none (the allocator serialises access).
template <class Arena, class Clocks>
class stream_adoption {
 public:
  using block_type = typename Arena::block_type;

  stream_adoption(std::size_t max_candidates, std::size_t max_probes) : max_probes_(max_probes) {
    adoptable_.reserve(max_candidates);
  }

  /// Whether free blocks have ever moved between streams (a segment may then hold free
  /// neighbours of different streams).
  bool mixed() const noexcept { return mixed_; }

  /// Moves other streams' completed free blocks to `stream`; true when anything moved.
  template <class Whole, class Moved>
  bool adopt(Arena& arena, Clocks& clocks, std::size_t size, stream_ref stream, bool gather, Whole&& whole,
             Moved&& moved) noexcept {
    if (clocks.size() < 2) return false;
    block_type* best = nullptr;
    for (auto& c : clocks) {
      if (c.stream == stream) continue;
      clocks.poll(c);
      block_type* b = arena.best_fit_if(c.stream, size, max_probes_, [&](const block_type& x) {
        return clocks.completed(x.stream, x.free_mark);
      });
      if (b != nullptr && (best == nullptr || b->size < best->size)) best = b;
    }
    if (best != nullptr) {
      move(arena, best, stream, moved);
      return true;
    }
    if (!gather) return false;
    adoptable_.clear();
    for (auto& c : clocks) {
      if (c.stream == stream) continue;
      arena.for_each_free_largest_first(c.stream, [&](block_type& b) {
        if (adoptable_.size() == adoptable_.capacity()) return false;  // never grows: noexcept
        if (clocks.completed(b.stream, b.free_mark) && whole(b) > 0) adoptable_.push_back(&b);
        return adoptable_.size() < adoptable_.capacity();
      });
    }
    std::stable_sort(adoptable_.begin(), adoptable_.end(),
                     [](const block_type* a, const block_type* b) { return a->size > b->size; });
    std::size_t covered = 0;
    for (block_type* b : adoptable_) {
      if (covered >= size) break;
      covered += whole(*b);
      move(arena, b, stream, moved);
    }
    return covered > 0;
  }

  /// Waits when free blocks of other streams whose frees have not completed would serve `size`:
  /// one such block, or with `gather` their whole handles together; it waits for just those
  /// streams' events (stream_clocks::wait_for_wanted). True if it waited.
  template <class Whole>
  bool wait_for_other_streams([[maybe_unused]] Arena& arena, Clocks& clocks, [[maybe_unused]] std::size_t size,
                              [[maybe_unused]] stream_ref stream, [[maybe_unused]] bool gather,
                              [[maybe_unused]] Whole&& whole) noexcept {
    if constexpr (Clocks::has_events) {
      if (clocks.size() < 2) return false;
      bool enough = false;
      std::size_t pending = 0;
      clocks.clear_wanted();
      for (auto& c : clocks) {
        if (c.stream == stream) continue;
        arena.for_each_free_largest_first(c.stream, [&](block_type& b) {
          if (!gather && b.size < size) return false;  // largest first: none further will do
          if (!clocks.completed(b.stream, b.free_mark)) {
            pending += gather ? whole(b) : b.size;
            enough = gather ? pending >= size : true;
            c.wanted = std::max(c.wanted, b.free_mark);
          }
          return !enough;
        });
        if (enough) break;
      }
      if (!enough) return false;
      clocks.wait_for_wanted();
      return true;
    } else {
      (void)clocks;
      return false;
    }
  }

  /// Merges free neighbours of different streams (left by moves) so that fully free segments are
  /// whole blocks again, synchronizing the device first when events exist; `merged(block)` is
  /// told of each merge. True if it synchronized.
  template <class Merged>
  bool merge_across_streams(Arena& arena, Clocks& clocks, Merged&& merged) noexcept {
    bool synchronized = false;
    block_type* b = arena.first();
    while (b != nullptr) {
      block_type* n = arena.next(b);
      if (n != nullptr && b->free && n->free && n->segment == b->segment && n->stream != b->stream) {
        if (Clocks::has_events && !synchronized) {
          clocks.synchronize_all();
          synchronized = true;
        }
        b = arena.restream(n, b->stream);  // merges into b, which stays the block at b's address
        merged(b);
        continue;
      }
      b = n;
    }
    return synchronized;
  }

 private:
  template <class Moved>
  void move(Arena& arena, block_type* b, stream_ref stream, Moved& moved) noexcept {
    const bool was_whole = b->size == b->segment->mapping.size;
    const std::size_t bytes = b->size;
    block_type* merged = arena.restream(b, stream);
    moved(bytes, was_whole, merged);
    mixed_ = true;
  }

  std::vector<block_type*> adoptable_;
  std::size_t max_probes_;
  bool mixed_ = false;
};

}  // namespace glake::detail
