// Segment release: what the stitching allocator gives back to its backend under pressure (fully
// free segments, in Evict order; then the whole free handles inside segments that grow in place)
// and drops (cached stitched ranges), and the retain switch that stops both while a CUDA graph's
// private pool must keep every mapping.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "glake/allocators/stitching/stitcher.hpp"

namespace glake::detail {

// ---------------------------------------------------------------------------------------------
// segment_releasing
//
// What the stitching allocator (its ladder, its release_cached, its mover's make_room) asks of
// the part that gives memory back. `n` is a number of bytes, `w` whether it may wait for the
// device.
//
// | expression        | returns | throws | meaning
// |-------------------|---------|--------|-----------------------------------------------------
// | r.evict(n, w)     | size_t  | no     | cached stitched ranges dropped (Evict order) until n
// |                   |         |        | bytes of mappings went; the bytes dropped
// | r.release(n, w)   | size_t  | no     | fully free segments given back until n bytes went,
// |                   |         |        | then free handles inside growing segments; the
// |                   |         |        | bytes given back (0 while retained)
// | r.retain(b)       | void    | no     | from now on nothing is released, unmapped or
// |                   |         |        | remapped (b true), or it may be again
// | cr.retained()     | bool    | no     | whether retain(true) holds
//
// Model: segment_release.
// ---------------------------------------------------------------------------------------------
template <class R>
concept segment_releasing = requires(R& r, const R& cr, std::size_t n, bool w) {
  { r.evict(n, w) } noexcept -> std::same_as<std::size_t>;
  { r.release(n, w) } noexcept -> std::same_as<std::size_t>;
  { r.retain(w) } noexcept;
  { cr.retained() } noexcept -> std::same_as<bool>;
};

/// No allocation is being moved: the Moves of a segment_release without a mover.
struct no_moves {
  std::size_t busy() const noexcept { return 0; }
};

/// Gives fully free segments of a segment_pool back to its backend in Evict order, and drops the
/// cached stitched ranges of a stitcher (or none: `Stitcher` is no_stitcher). A segment that a
/// live stitched range maps stays; the cached ranges mapping it are dropped first. Memory that
/// queued work may still read is never released: with events, the device is synchronized once
/// per call first (the memory-pressure path, as in PyTorch). Not waiting (`wait` false), a
/// segment whose last free may still be used by queued work, or that a cached range maps, is
/// kept instead, and free blocks of different streams are not merged. When fully free segments
/// were not enough, the whole free handles inside segments that grow in place go too (split off
/// into segments of their own), unless `Moves` (the allocator's mover: `busy()` allocations
/// moved or moving) points into segments' handles.
/// Complexity: O(k log n) for k segments looked at, plus one unmap and release per handle given
/// back; the segments kept are remembered in a bounded scratch (256): past it, a call stops
/// early. No heap allocation once constructed, except a scratch of runs when segments grow in
/// place.
/// Thread safety: none (the allocator serialises access).
template <class Pool, class Clocks, class Adoption, class Stitcher, class Moves = no_moves>
class segment_release {
  using segment = typename Pool::segment;
  using block_type = typename Pool::block_type;
  static constexpr bool stitches = !std::is_same_v<Stitcher, no_stitcher>;

 public:
  segment_release(Pool& pool, Clocks& clocks, Adoption& adoption, Stitcher& stitcher, const Moves* moves = nullptr)
      : pool_(pool), clocks_(clocks), adoption_(adoption), stitcher_(stitcher), moves_(moves) {
    pinned_.reserve(256);
  }
  segment_release(const segment_release&) = delete;
  segment_release& operator=(const segment_release&) = delete;

  bool retained() const noexcept { return retain_; }
  void retain(bool retain) noexcept {
    retain_ = retain;
    if constexpr (stitches) stitcher_.freeze(retain);
  }

  std::size_t evict([[maybe_unused]] std::size_t bytes, [[maybe_unused]] bool wait) noexcept {
    if constexpr (stitches) {
      return stitcher_.evict(bytes, wait);
    } else {
      return 0;
    }
  }

  std::size_t release(std::size_t bytes, bool wait = true) noexcept {
    std::size_t released = 0;
    if (retain_) return released;
    [[maybe_unused]] bool synchronized =
        wait && adoption_.mixed() &&
        adoption_.merge_across_streams(pool_.arena(), clocks_, [this](block_type* b) { pool_.enter_free_queue(b); });
    if (!wait) clocks_.poll_all();
    pinned_.clear();
    while (released < bytes) {
      segment* victim = pool_.free_victim();
      if (victim == nullptr) break;
      // Not waiting: a segment whose last free's work may still run, or that a cached stitched
      // range maps (dropping it might wait), stays.
      bool keep = !wait && victim->stitch_refs > 0;
      if constexpr (Clocks::has_events) {
        if (!wait && !keep) {
          const block_type* whole = pool_.arena().find(victim->mapping.base);
          keep = !clocks_.completed(whole->stream, whole->free_mark);
        }
      }
      if constexpr (stitches) {
        if (!keep && victim->stitch_refs > 0) stitcher_.drop_over(victim);
      }
      if (keep || victim->stitch_refs > 0) {
        pool_.unqueue(victim);
        if (pinned_.size() == pinned_.capacity()) break;  // no room to remember it: stop here
        pinned_.push_back(victim);
        continue;
      }
      if constexpr (Clocks::has_events) {
        if (wait && !synchronized) clocks_.synchronize_all();
        synchronized = true;
      }
      released += victim->mapping.size;
      pool_.drop_segment(victim);
    }
    for (segment* s : pinned_) pool_.requeue(s);
    pinned_.clear();
    if (released < bytes) released += release_inside_segments(bytes - released, wait, synchronized);
    return released;
  }

 private:
  // The whole free handles inside segments that grow in place (a stream's segment is seldom
  // fully free): each run is split off into a segment of its own and released, highest address
  // first, until `bytes` are. Skipped: runs a live stitched range maps; without `wait`, runs
  // whose free may still be used by queued work or that a cached range maps; everything while an
  // allocation is moved (moves point into segments' handles). O(blocks + runs x ranges).
  std::size_t release_inside_segments(std::size_t bytes, bool wait, bool synchronized) noexcept {
    if (pool_.growable_segments() == 0 || (moves_ != nullptr && moves_->busy() != 0)) return 0;
    struct run {
      segment* home;
      std::size_t lo, hi;
    };
    std::vector<run> runs;
    try {
      pool_.arena().for_each_block([&](const block_type& b) {
        if (!b.free || !Pool::grows(*b.segment) || b.size < pool_.chunk()) return;
        const auto c = pool_.whole_handles_of(const_cast<block_type&>(b));
        if (c.size == 0 || c.size == b.segment->mapping.size) return;  // a whole free segment went above
        if constexpr (Clocks::has_events) {
          if (!wait && !clocks_.completed(b.stream, b.free_mark)) return;
        }
        if constexpr (stitches) {
          if (stitcher_.live_maps(b.segment, c.offset, c.offset + c.size, nullptr)) return;
          if (!wait && stitcher_.cached_maps(b.segment, c.offset, c.offset + c.size)) return;
        }
        runs.push_back(run{b.segment, c.offset, c.offset + c.size});
      });
    } catch (...) {
      return 0;  // out of host memory: nothing released
    }
    std::size_t released = 0;
    for (auto it = runs.rbegin(); it != runs.rend() && released < bytes; ++it) {
      block_type* taken = nullptr;
      std::uint64_t mark = 0;
      try {
        segment* home = it->home;
        if constexpr (stitches) stitcher_.drop_mapping(home, it->lo, it->hi);
        if constexpr (Clocks::has_events) {
          if (wait && !synchronized) clocks_.synchronize_all();
          synchronized = true;
        }
        pool_.arena().reserve_nodes(2);
        block_type* b = pool_.arena().containing(home->mapping.base + it->lo);
        mark = b->free_mark;
        pool_.leave_free_queue(b);
        taken = pool_.arena().carve(b, home->mapping.base + it->lo, it->hi - it->lo);
        if (it->hi < home->mapping.size) {
          segment* after = pool_.split(home, it->hi);
          if constexpr (stitches) stitcher_.rehome(home, after, it->hi);
        }
        segment* middle = home;
        if (it->lo > 0) {
          middle = pool_.split(home, it->lo);
          if constexpr (stitches) stitcher_.rehome(home, middle, it->lo);
        }
        pool_.enter_free_queue(pool_.arena().give_back(std::exchange(taken, nullptr), mark));
        released += middle->mapping.size;
        pool_.drop_segment(middle);
      } catch (...) {
        // Out of host memory: the run goes back to the free blocks; what was released stays so.
        if (taken != nullptr) pool_.enter_free_queue(pool_.arena().give_back(taken, mark));
        break;
      }
    }
    return released;
  }

  Pool& pool_;
  Clocks& clocks_;
  Adoption& adoption_;
  Stitcher& stitcher_;
  const Moves* moves_;            // allocations moved point into segments' handles (null: none)
  std::vector<segment*> pinned_;  // scratch: segments kept from release in one call (bounded)
  bool retain_ = false;           // retain_memory: nothing released, unmapped or remapped
};

}  // namespace glake::detail
