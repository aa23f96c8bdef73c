// The allocation ladder: how the stitching allocator serves a large request, as one list of
// named attempts (free block, cached stitch, other streams, repair, then three rungs that
// reclaim more and more), and how it lends blocks to its small pool.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <type_traits>
#include <utility>

#include "glake/allocators/stitching/segment_release.hpp"
#include "glake/allocators/stitching/stitcher.hpp"
#include "glake/detail/accounting.hpp"
#include "glake/policies/growth.hpp"
#include "glake/stream.hpp"

namespace glake::detail {

// ---------------------------------------------------------------------------------------------
// ladder_host
//
// What an allocation_ladder asks of the allocator above it: the three rungs that reclaim memory
// the ladder does not own (the small pool, deferred frees, moves still copying), and whether an
// allocation is moved (a segment that grows in place must not move its handles' slots then).
//
// | expression          | returns | throws | meaning
// |---------------------|---------|--------|-------------------------------------------------
// | h.reclaim_small()   | bool    | no     | the small pool's empty segments given back (free
// |                     |         |        | blocks of this pool again); whether any were
// | h.finish_deferred() | bool    | no     | frees waiting for other streams finished, waiting
// |                     |         |        | for them; whether any were waiting
// | h.finish_moves()    | void    | no     | deferred moves completed, waiting for their copies
// |                     |         |        | (their device memory given back)
// | ch.moving()         | bool    | no     | an allocation is moved or moving (its handles'
// |                     |         |        | slots are pointed to)
//
// Model: stitching_allocator's ladder_link (allocators/stitching_allocator.hpp).
// ---------------------------------------------------------------------------------------------
template <class H>
concept ladder_host = requires(H& h, const H& ch) {
  { h.reclaim_small() } noexcept -> std::same_as<bool>;
  { h.finish_deferred() } noexcept -> std::same_as<bool>;
  { h.finish_moves() } noexcept;
  { ch.moving() } noexcept -> std::same_as<bool>;
};

// ---------------------------------------------------------------------------------------------
// allocation_laddering
//
// What the stitching allocator asks of its ladder. `n` is a request's size in bytes (above
// small_limit for allocate), `s` its stream, `o` the small pool (the owner of a lent block).
//
// | expression            | returns | throws                  | meaning
// |-----------------------|---------|-------------------------|-----------------------------------
// | l.allocate(n, s)      | void*   | the backend's, after a  | the first attempt that serves n
// |                       |         | full rollback           | bytes on s; null when none does
// | l.lend(n, s, o, base) | bool    | as allocate             | a block of n bytes for the small
// |                       |         |                         | pool at `base`, owned by o
// | cl.large_round()      | size_t  | no                      | what a large block's size and
// |                       |         |                         | offset are multiples of
//
// Model: allocation_ladder.
// ---------------------------------------------------------------------------------------------
template <class L>
concept allocation_laddering = requires(L& l, const L& cl, std::size_t n, stream_ref s, void* o, std::uintptr_t& base) {
  { l.allocate(n, s) } -> std::same_as<void*>;
  { l.lend(n, s, o, base) } -> std::same_as<bool>;
  { cl.large_round() } noexcept -> std::same_as<std::size_t>;
};

/// A request above small_limit is served by the first attempt that succeeds, in this order
/// (docs/stitching.md explains each): the best-fitting free block of its stream; a cached
/// stitched range whose needed chunks are free; another stream's completed free block; a cached
/// range repaired or grown in place; then, at three rungs that reclaim more and more (nothing;
/// deferred frees, cached ranges and free segments for the request; everything free): a new
/// stitch, reclaimed small-pool blocks, other streams' blocks gathered (or waited for), the
/// stream's segment grown in place (with a segment_growth_policy), new memory for the shortfall
/// only, a new segment. Admission decides at which rungs a new stitch
/// is tried and whether reuse, repair and growing the shortfall are; Stitcher (or no_stitcher)
/// does them; Release gives memory back; Host reclaims what the ladder does not own.
/// The attempts are template arguments of one fold, so each is a direct call; attempts that only
/// make room return null.
/// Complexity: the cached attempts O(log n) (a bounded number of candidates); a stitch O(k log n)
/// for k pieces plus one map per handle. No heap allocation on the cached path once warm.
/// Thread safety: none (the allocator serialises access).
template <class Pool, class Clocks, class Stitcher, class Admission, class Adoption, segment_releasing Release,
          ladder_host Host>
class allocation_ladder {
  using self = allocation_ladder;
  using block_type = typename Pool::block_type;
  using growth_type = std::remove_cvref_t<decltype(std::declval<const Pool&>().growth())>;
  static constexpr bool stitches = !std::is_same_v<Stitcher, no_stitcher>;

  // What every attempt is asked.
  struct request {
    std::size_t size;   ///< rounded to large_round: what a free block hands out
    std::size_t span;   ///< rounded to chunks: what a stitch maps, or a new segment holds
    std::size_t bytes;  ///< as asked
    stream_ref stream;
    bool may_stitch;
  };

 public:
  allocation_ladder(Pool& pool, Clocks& clocks, usage_counters& counters, const Admission& admission,
                    Stitcher& stitcher, Adoption& adoption, Release& release, Host host, std::size_t large_round)
      : pool_(pool), clocks_(clocks), counters_(counters), admission_(admission), stitcher_(stitcher),
        adoption_(adoption), release_(release), host_(host), large_round_(large_round) {}
  allocation_ladder(const allocation_ladder&) = delete;
  allocation_ladder& operator=(const allocation_ladder&) = delete;

  std::size_t large_round() const noexcept { return large_round_; }

  void* allocate(std::size_t bytes, stream_ref stream) {
    if (round_up_overflows(bytes, pool_.chunk())) return nullptr;
    const std::size_t size = round_up(bytes, large_round_);
    pool_.arena().reserve_nodes(2);
    // The first attempt, the common case, written out here so that it stays inline.
    if (block_type* b = pool_.arena().best_fit(stream, size)) return hand_out(b, size, bytes);
    const std::size_t span = round_up(bytes, pool_.chunk());
    return allocate_large(request{size, span, bytes, stream, stitches && admission_.may_stitch(span)});
  }

  bool lend(std::size_t bytes, stream_ref stream, void* owner, std::uintptr_t& base) {
    auto& arena = pool_.arena();
    arena.reserve_nodes(1);
    block_type* b = arena.best_fit(stream, bytes);
    if (b == nullptr && adopt(bytes, stream, false)) b = arena.best_fit(stream, bytes);
    if (b == nullptr) b = pool_.add_segment(bytes, stream);
    if (b == nullptr) {
      // Under pressure, cached mappings and fully free large segments make room for small ones.
      release_.evict(~std::size_t{0}, true);
      if (release_.release(bytes, true) > 0) b = pool_.add_segment(bytes, stream);
    }
    if (b == nullptr) return false;
    pool_.leave_free_queue(b);
    arena.take(b, bytes);
    b->owner = owner;
    base = b->address;
    return true;
  }

 private:
  void* allocate_large(const request& r) {
    // More than the backend can ever hold: no attempt could serve it, and the later rungs would
    // empty the caches for nothing.
    if (r.size > pool_.backend().capacity()) return nullptr;
    return first_of<
        // What else is free for this request now.
        &self::reuse_cached_stitch, &self::adopt_one_block, &self::repair_cached_stitch,
        // Rung 0: nothing reclaimed.
        &self::template new_stitch_on<0>, &self::reclaim_small_pool, &self::gather_other_streams,
        &self::wait_for_other_streams, &self::grow_in_place, &self::grow_shortfall, &self::new_segment,
        // Rung 1: deferred frees, then cached ranges and free segments for the request.
        &self::template new_stitch_on<1>, &self::finish_deferred_frees, &self::finish_pending_moves,
        &self::release_for_request,
        &self::grow_in_place, &self::grow_shortfall, &self::new_segment,
        // Rung 2: everything free released.
        &self::template new_stitch_on<2>, &self::release_all_free, &self::grow_in_place, &self::grow_shortfall,
        &self::new_segment>(r);
  }
  template <auto... Steps>
  void* first_of(const request& r) {
    void* p = nullptr;
    (void)(... || ((p = (this->*Steps)(r)) != nullptr));
    return p;
  }

  void* from_free_block(const request& r) {
    block_type* b = pool_.arena().best_fit(r.stream, r.size);
    return b == nullptr ? nullptr : hand_out(b, r.size, r.bytes);
  }
  void* reuse_cached_stitch([[maybe_unused]] const request& r) {
    if constexpr (stitches) {
      if (admission_.may_reuse()) return stitcher_.reuse(r.span, r.bytes, r.stream);
    }
    return nullptr;
  }
  void* adopt_one_block(const request& r) { return adopt(r.size, r.stream, false) ? from_free_block(r) : nullptr; }
  void* repair_cached_stitch(const request& r) { return repair(r, false); }
  template <int Rung>
  void* new_stitch_on(const request& r) {
    return r.may_stitch && admission_.stitch_on_rung(Rung) ? stitch(r, false) : nullptr;
  }
  // Empty small-pool blocks cost nothing to take back and may merge into a fit.
  void* reclaim_small_pool(const request& r) { return host_.reclaim_small() ? from_free_block(r) : nullptr; }
  // Other streams' completed free blocks, gathered until they cover the request.
  void* gather_other_streams(const request& r) {
    if (!r.may_stitch || !adopt(r.span, r.stream, true)) return nullptr;
    if (void* p = from_free_block(r)) return p;
    return stitch(r, false);
  }
  // Other streams' free blocks whose frees have not completed yet: when they alone would cover
  // the request, waiting for those streams once costs less than growing by it.
  void* wait_for_other_streams(const request& r) {
    const auto whole = [this](block_type& b) { return pool_.whole_handles_of(b).size; };
    const std::size_t size = r.may_stitch ? r.span : r.size;
    if (!adoption_.wait_for_other_streams(pool_.arena(), clocks_, size, r.stream, r.may_stitch, whole) ||
        !adopt(size, r.stream, r.may_stitch)) {
      return nullptr;
    }
    if (void* p = from_free_block(r)) return p;
    return stitch(r, false);
  }
  void* grow_shortfall(const request& r) {
    if (!r.may_stitch || !admission_.grow_shortfall()) return nullptr;
    if (void* p = repair(r, true)) return p;
    return stitch(r, true);
  }
  // New memory mapped after the end of the stream's growing segment, so that its free last
  // block (often the tail of a handle partly in use) starts the request; or a new growing
  // segment. Only with a Growth that reserves room for segments (segment_growth_policy), and
  // only when a stitch with growth would not make less new memory (grow_shortfall then runs).
  void* grow_in_place([[maybe_unused]] const request& r) {
    if constexpr (segment_growth_policy<growth_type>) {
      // Never more address space than the device could ever fill.
      const std::size_t ceiling = pool_.backend().capacity() / pool_.chunk() * pool_.chunk();
      const std::size_t reserve = std::min(pool_.growth().segment_reservation(r.span), ceiling);
      if (reserve <= r.span) return nullptr;
      // Extending moves a segment's slots, which moved allocations point to.
      if (host_.moving()) return nullptr;
      std::size_t need = r.span;
      auto* s = pool_.growing(r.stream);
      if (s != nullptr) {
        const block_type* last = pool_.arena().containing(s->mapping.base + s->mapping.size - 1);
        const std::size_t have = last->free && last->stream == r.stream ? std::min(last->size, r.size) : 0;
        need = round_up(r.size - have, pool_.chunk());
        if (need > s->mapping.room()) s = nullptr;
      }
      if constexpr (stitches) {
        if (r.may_stitch && admission_.grow_shortfall() && stitcher_.shortfall(r.span, r.stream) < need) return nullptr;
      }
      block_type* b = s != nullptr ? pool_.extend(s, need, r.stream) : pool_.add_segment(r.span, r.stream, reserve);
      return b == nullptr ? nullptr : hand_out(b, r.size, r.bytes);
    }
    return nullptr;
  }
  void* new_segment(const request& r) {
    block_type* b = pool_.add_segment(r.span, r.stream);
    return b == nullptr ? nullptr : hand_out(b, r.size, r.bytes);
  }
  // Deferred frees may be what is missing.
  void* finish_deferred_frees(const request& r) { return host_.finish_deferred() ? from_free_block(r) : nullptr; }
  // Offloads still copying hold device memory that their completion gives back.
  void* finish_pending_moves(const request&) {
    host_.finish_moves();
    return nullptr;
  }
  void* release_for_request(const request& r) {
    release_.evict(~std::size_t{0}, true);
    release_.release(r.span, true);
    return nullptr;
  }
  void* release_all_free(const request&) {
    release_.release(~std::size_t{0}, true);
    return nullptr;
  }

  // The stitcher's attempts, for requests that may stitch.
  void* repair([[maybe_unused]] const request& r, [[maybe_unused]] bool may_grow) {
    if constexpr (stitches) {
      if (r.may_stitch) return stitcher_.repair(r.span, r.bytes, r.stream, may_grow);
    }
    return nullptr;
  }
  void* stitch([[maybe_unused]] const request& r, [[maybe_unused]] bool may_grow) {
    if constexpr (stitches) {
      if (r.may_stitch) return stitcher_.stitch(r.span, r.bytes, r.stream, may_grow);
    }
    return nullptr;
  }

  void* hand_out(block_type* b, std::size_t size, std::size_t requested) {
    pool_.leave_free_queue(b);
    pool_.arena().take(b, size);
    b->requested = requested;
    counters_.on_allocate(requested, size);
    return reinterpret_cast<void*>(b->address);
  }

  // Other streams' completed free blocks moved to `stream` (stream_adoption); true if any moved.
  bool adopt(std::size_t size, stream_ref stream, bool gather) noexcept {
    const auto whole = [this](block_type& b) { return pool_.whole_handles_of(b).size; };
    const auto moved = [this](std::size_t bytes, bool was_whole, block_type* merged) {
      counters_.s.cross_stream_bytes += bytes;
      if (!was_whole) pool_.enter_free_queue(merged);
    };
    return adoption_.adopt(pool_.arena(), clocks_, size, stream, gather, whole, moved);
  }

  Pool& pool_;
  Clocks& clocks_;
  usage_counters& counters_;
  const Admission& admission_;
  Stitcher& stitcher_;
  Adoption& adoption_;
  Release& release_;
  Host host_;
  std::size_t large_round_;  ///< config::large_round_to, or the chunk size
};

}  // namespace glake::detail
