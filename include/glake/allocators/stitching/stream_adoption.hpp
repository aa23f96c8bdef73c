// Stream adoption: a request that its own stream cannot serve from free memory takes other
// streams' free blocks whose frees have completed, before the allocator stitches or grows.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "glake/stream.hpp"

namespace glake::detail {

/// Moves free blocks between the streams of a block_arena, by the completion marks of a
/// stream_clocks: the best fit for a request when one completed block will do; else (`gather`)
/// the largest completed blocks until their whole handles cover it. With `join`, a block whose
/// free an event in flight covers counts as completed: the request's stream waits for that event
/// on the device when it takes the block (one join per stream when gathering, on the event
/// covering the newest free taken), unless it may be capturing a graph. It can also wait for just
/// the streams whose pending frees would cover a request, or with `join` (config::stream_join,
/// on backends whose streams wait for events) make the request's stream wait for them on the
/// device instead (stream_clocks::join_wanted), and merge the free neighbours that moves leave on
/// different streams. A block taken through a join is its new stream's, marked with that stream's
/// next free mark: its next event, recorded after the join, covers the work it waited for, so no
/// third stream takes it before that work is done.
///
/// The callbacks keep it apart from the allocator's other bookkeeping: `whole(block)` gives the
/// bytes of whole handles in a free block (what a stitch can use); `moved(block_bytes,
/// was_whole_segment, merged_block)` is told of each move.
/// Complexity: best fit O(streams x (log n + probes)); gathering O(k log k) for k candidates
/// (at most `max_candidates`), plus O(k^2) to find each stream's newest free when joining. No
/// heap allocation once constructed.
/// Thread safety: none (the allocator serialises access).
template <class Arena, class Clocks>
class stream_adoption {
 public:
  using block_type = typename Arena::block_type;

  stream_adoption(std::size_t max_candidates, std::size_t max_probes, bool join = false)
      : max_probes_(max_probes), join_(join) {
    adoptable_.reserve(max_candidates);
  }

  /// Whether free blocks have ever moved between streams (a segment may then hold free
  /// neighbours of different streams).
  bool mixed() const noexcept { return mixed_; }

  /// Moves other streams' completed free blocks (and those `stream` joined for this request,
  /// wait_for_other_streams) to `stream`; true when anything moved. Ends the request's joins.
  template <class Whole, class Moved>
  bool adopt(Arena& arena, Clocks& clocks, std::size_t size, stream_ref stream, bool gather, Whole&& whole,
             Moved&& moved) noexcept {
    const bool any = adopt_usable(arena, clocks, size, stream, gather, whole, moved);
    if constexpr (Clocks::can_join) {
      if (join_) clocks.clear_joined();
    }
    return any;
  }

  /// Waits when free blocks of other streams whose frees have not completed would serve `size`:
  /// one such block, or with `gather` their whole handles together; it waits for just those
  /// streams' events (stream_clocks::wait_for_wanted). With `join`, unless `stream` may be
  /// capturing a graph (then the device could not order it, and the host waits as before), it
  /// joins those events instead, and waits only for marks it cannot join. True if it waited or
  /// joined: the next adopt on `stream` may take those blocks.
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
      if constexpr (Clocks::can_join) {
        // A reserver that cannot tell capture (no capture_aware_reserver) is taken at its word:
        // its streams are never capturing.
        if (join_ && !clocks.events().may_be_capturing(stream) && !clocks.join_wanted(stream)) return true;
      }
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
  template <class Whole, class Moved>
  bool adopt_usable(Arena& arena, Clocks& clocks, std::size_t size, stream_ref stream, bool gather, Whole& whole,
                    Moved& moved) noexcept {
    if (clocks.size() < 2) return false;
    // With joins, a block whose free an event in flight covers is usable too: `stream` is made
    // to wait for that event on the device when the block is taken (take). Asked once a call,
    // and only when such a block is a candidate, whether `stream` may be capturing a graph.
    int joins_allowed = join_ ? -1 : 0;  // -1: not asked yet
    const auto candidate = [&](const block_type& x) {
      if (clocks.usable(x.stream, x.free_mark, stream)) return true;
      if (joins_allowed == 0 || !clocks.joinable(x.stream, x.free_mark)) return false;
      if (joins_allowed < 0) joins_allowed = may_join(clocks, stream) ? 1 : 0;
      return joins_allowed == 1;
    };
    block_type* best = nullptr;
    for (auto& c : clocks) {
      if (c.stream == stream) continue;
      clocks.poll(c);
      block_type* b = arena.best_fit_if(c.stream, size, max_probes_, candidate);
      if (b != nullptr && (best == nullptr || b->size < best->size)) best = b;
    }
    if (best != nullptr && take(clocks, *best, stream)) {
      move(arena, clocks, best, stream, moved);
      return true;
    }
    if (!gather) return false;
    adoptable_.clear();
    for (auto& c : clocks) {
      if (c.stream == stream) continue;
      arena.for_each_free_largest_first(c.stream, [&](block_type& b) {
        if (adoptable_.size() == adoptable_.capacity()) return false;  // never grows: noexcept
        if (candidate(b) && whole(b) > 0) adoptable_.push_back(&b);
        return adoptable_.size() < adoptable_.capacity();
      });
    }
    std::stable_sort(adoptable_.begin(), adoptable_.end(),
                     [](const block_type* a, const block_type* b) { return a->size > b->size; });
    std::size_t chosen = 0;
    for (std::size_t covered = 0; chosen < adoptable_.size() && covered < size; ++chosen) {
      covered += whole(*adoptable_[chosen]);
    }
    // One join per stream, on the event that covers the newest free among the chosen blocks.
    bool any = false;
    for (std::size_t i = 0; i < chosen; ++i) {
      block_type* b = adoptable_[i];
      if (!clocks.usable(b->stream, b->free_mark, stream)) {
        std::uint64_t newest = b->free_mark;
        for (std::size_t j = i + 1; j < chosen; ++j) {
          if (adoptable_[j]->stream == b->stream) newest = std::max(newest, adoptable_[j]->free_mark);
        }
        if (!join_ || !clocks.join_through(b->stream, newest, stream)) continue;
      }
      move(arena, clocks, b, stream, moved);
      any = true;
    }
    return any;
  }

  // Whether `stream` may wait on the device for other streams' events now: only on backends
  // that join, and not while it may be capturing a graph (the device could not order it then).
  static bool may_join(Clocks& clocks, [[maybe_unused]] stream_ref stream) noexcept {
    if constexpr (Clocks::can_join) {
      // A reserver that cannot tell capture (no capture_aware_reserver) is taken at its word.
      return !clocks.events().may_be_capturing(stream);
    } else {
      return false;
    }
  }
  // A candidate `b` becomes usable by `stream`: completed, joined already, or joined now.
  bool take(Clocks& clocks, const block_type& b, stream_ref stream) noexcept {
    if (clocks.usable(b.stream, b.free_mark, stream)) return true;
    return join_ && clocks.join_through(b.stream, b.free_mark, stream);
  }

  template <class Moved>
  void move(Arena& arena, Clocks& clocks, block_type* b, stream_ref stream, Moved& moved) noexcept {
    const bool was_whole = b->size == b->segment->mapping.size;
    const std::size_t bytes = b->size;
    const bool joined = clocks.only_joined(b->stream, b->free_mark, stream);
    block_type* merged = arena.restream(b, stream);
    // Its work is ordered before `stream`'s by a join, not done: a free on `stream` from now on.
    if (joined) merged->free_mark = std::max(merged->free_mark, clocks.mark_free(stream));
    moved(bytes, was_whole, merged);
    mixed_ = true;
  }

  std::vector<block_type*> adoptable_;
  std::size_t max_probes_;
  bool join_;
  bool mixed_ = false;
};

}  // namespace glake::detail
