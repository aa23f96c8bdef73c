// The stitcher: builds, reuses, repairs, caches and evicts the stitching allocator's stitched
// ranges over its segment pool. The allocator decides when to call it; this file does the work.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "glake/config.hpp"
#include "glake/detail/accounting.hpp"
#include "glake/allocators/stitching/stitch_cache.hpp"
#include "glake/allocators/stitching/stitch_repair.hpp"
#include "glake/policies/admission.hpp"
#include "glake/policies/eviction.hpp"
#include "glake/policies/stitching.hpp"
#include "glake/stream.hpp"

namespace glake::detail {

/// Stitched ranges over a segment_pool, with the stream clocks for their events:
/// - reuse: a cached range of the stream whose first R bytes are free, R <= S <= the
///   admission's reuse bound (at most `max_probes` looked at);
/// - repair: the cached range that needs the fewest bytes mapped anew (handles taken since,
///   replaced by free handles of the same size; or handles appended to a smaller range within
///   its reservation), under the admission's repair budget (stitch_repair.hpp plans it);
/// - stitch: free blocks of the stream that Stitch picks, mapped side by side into a new range
///   that Growth's reservation leaves room to grow in;
/// - release, evict: a freed range is cached (with an event for the work queued before its
///   free); ranges are unmapped in Evict order, only once that work has completed.
/// Claiming a range's prefix carves its blocks out of the free blocks of its home segments.
/// Complexity and allocation: O(log n) lookups, O(k log n) for k pieces plus a driver call per
/// handle mapped; scratch vectors are kept, so it does not allocate once warm.
/// While frozen (the allocator retains its memory), no range is evicted or repaired: a mapping
/// once made stays as it is.
/// Thread safety: none (the allocator serialises access).
template <class Pool, class Clocks, stitching_strategy Stitch, eviction_policy Evict, stitch_admission Admission>
class stitcher {
  using segment = typename Pool::segment;
  using block_type = typename Pool::block_type;
  using slot_type = typename Pool::slot_type;
  using handle_type = typename Pool::handle_type;
  using whole_run = typename Pool::whole_run;

 public:
  using range = stitched_range<segment, block_type, typename Clocks::event_type>;
  using piece = typename range::piece;

  stitcher(Pool& pool, Clocks& clocks, usage_counters& counters, const Admission& admission,
           std::size_t auto_gc, std::size_t max_candidates, std::size_t max_probes)
      : pool_(&pool), clocks_(&clocks), counters_(&counters), admission_(&admission), auto_gc_(auto_gc),
        max_candidates_(max_candidates), max_probes_(max_probes) {
    candidates_.reserve(max_candidates);
    candidate_sizes_.reserve(max_candidates);
    plan_.picks.reserve(max_candidates);
  }

  range* find(std::uintptr_t address) noexcept { return cache_.find(address); }
  const range* find(std::uintptr_t address) const noexcept { return cache_.find(address); }
  std::size_t cached_bytes() const noexcept { return cache_.cached_bytes(); }
  const stitch_cache<range, Evict>& cache() const noexcept { return cache_; }
  /// Frozen: no eviction, no repair (see the class comment).
  void freeze(bool frozen) noexcept { frozen_ = frozen; }

  /// A cached range of `stream` whose first `size` bytes are all free, claimed; or null.
  void* reuse(std::size_t size, std::size_t requested, stream_ref stream) {
    const double limit = admission_->reuse_bound(size);
    std::size_t probes = 0;
    for (auto it = cache_.lower_bound(stream, size); it != cache_.end_cached() && it->stream == stream &&
                                                     static_cast<double>(it->size) <= limit && probes < max_probes_;
         ++it, ++probes) {
      range& s = *it;
      if (!prefix_free(s, size)) continue;
      pool_->arena().reserve_nodes(2 * s.pieces.size());
      leave_cache(s);
      claim_prefix(s, size, requested);
      ++counters_->s.stitch_cache_hits;
      return reinterpret_cast<void*>(s.base);
    }
    return nullptr;
  }

  /// The cached range that serves `size` with the fewest bytes mapped anew, below the repair
  /// budget, repaired or grown and claimed; replacing a mapped handle needs the range's free to
  /// have completed. With `may_grow`, new memory makes up for too few free handles.
  void* repair(std::size_t size, std::size_t requested, stream_ref stream, bool may_grow) {
    if (frozen_ || !cache_.any_cached()) return nullptr;
    const double limit = admission_->reuse_bound(size);
    range* best = nullptr;
    std::size_t best_cost = admission_->repair_budget(size);  // bytes to map anew
    const auto consider = [&](range& s) {
      const std::size_t grow = s.size < size ? size - s.size : 0;
      if (grow >= best_cost || s.reserved < size) return;
      // Past best_cost - grow the range cannot win: missing_bytes stops counting there.
      const std::size_t missing = missing_bytes(s, std::min(size, s.size), best_cost - grow);
      if (missing + grow < best_cost && (missing == 0 || queue_drained(s))) {
        best = &s;
        best_cost = missing + grow;
      }
    };
    const auto from = cache_.lower_bound(stream, size);
    std::size_t probes = 0;
    for (auto it = from; it != cache_.end_cached() && it->stream == stream &&
                         static_cast<double>(it->size) <= limit && probes < max_probes_;
         ++it, ++probes) {
      consider(*it);
    }
    // Smaller ranges, largest first, while growing one would cost less than the best so far.
    probes = 0;
    for (auto it = from; it != cache_.begin_cached() && probes < max_probes_; ++probes) {
      --it;
      if (it->stream != stream || it->size + best_cost <= size) break;
      consider(*it);
    }
    return best == nullptr ? nullptr : restitch(*best, size, requested, stream, may_grow);
  }

  /// A new range over free blocks of `stream` (and, with `may_grow`, new memory for the
  /// shortfall), claimed; or null with nothing changed.
  void* stitch(std::size_t size, std::size_t requested, stream_ref stream, bool may_grow) {
    return plan(size, stream, may_grow) ? map_new(size, requested, stream) : nullptr;
  }

  /// The new memory a stitch with growth would make for `size` on `stream` now (whole chunks);
  /// `size` when it would take no free block. Changes nothing but scratch space.
  std::size_t shortfall(std::size_t size, stream_ref stream) {
    return plan(size, stream, true) ? round_up(plan_.grow_bytes, pool_->chunk()) : size;
  }

 private:
  bool plan(std::size_t size, stream_ref stream, bool may_grow) {
    candidates_.clear();
    candidate_sizes_.clear();
    // Without growth a plan covers `size` with free blocks' whole handles: when all free bytes
    // together fall short, no walk over the free blocks can find one.
    if (!may_grow && pool_->arena().free_bytes() < size) return false;
    const std::size_t chunk = pool_->chunk();
    pool_->arena().for_each_free_largest_first(stream, [&](block_type& b) {
      // Handles are whole chunks: from here on, blocks are tails in handles partly in use.
      if (b.size < chunk) return false;
      if (const whole_run c = pool_->whole_handles_of(b); c.size > 0) candidates_.push_back(c);
      return candidates_.size() < max_candidates_;
    });
    if (candidates_.empty() || (!may_grow && candidates_.size() < 2)) return false;
    // Blocks came largest first; their whole-handle parts need not, when handles vary in size.
    std::stable_sort(candidates_.begin(), candidates_.end(),
                     [](const whole_run& a, const whole_run& b) { return a.size > b.size; });
    for (const whole_run& c : candidates_) candidate_sizes_.push_back(c.size);
    const stitch_request ask{size, pool_->chunk(), may_grow};
    return strategy_.plan(ask, candidate_sizes_, plan_) && plan_is_sound(size);
  }

 public:

  /// A live range was freed: its blocks go back to their segments and it is cached. `counted`
  /// false: its free was counted already (an allocation freed while offloaded, whose memory came
  /// back since), only its bytes leave allocated_bytes.
  void release(range& s, bool counted = true) noexcept {
    const std::uint64_t mark = clocks_->mark_free(s.stream);
    for (piece& pc : s.pieces) {
      if (pc.claimed == nullptr) continue;
      pool_->enter_free_queue(pool_->arena().give_back(pc.claimed, mark));
      pc.claimed = nullptr;
    }
    if (counted) {
      counters_->on_deallocate(s.requested, s.claimed_bytes);
    } else {
      counters_->s.allocated_bytes -= s.claimed_bytes;
    }
    s.live = false;
    s.requested = 0;
    s.claimed_bytes = 0;
    if constexpr (Clocks::has_events) {
      // Work queued on the stream may still use the range: evict it only once this completes.
      try {
        s.free_event = clocks_->events().record(s.stream);
        s.has_free_event = true;
      } catch (...) {
        s.has_free_event = false;  // eviction will synchronize the stream instead
      }
    }
    cache_.cache(s);
    if (cache_.cached_bytes() > auto_gc_) evict(cache_.cached_bytes() - auto_gc_, false);
  }

  /// Drops cached ranges in Evict order until `bytes` of them are gone. Without `wait`, stops at
  /// the first range whose free has not completed (GMLake's StitchFree); with it, waits for it.
  std::size_t evict(std::size_t bytes, [[maybe_unused]] bool wait) noexcept {
    std::size_t dropped = 0;
    if (frozen_) return 0;
    while (dropped < bytes) {
      range* s = cache_.victim();
      if (s == nullptr) break;
      if constexpr (Clocks::has_events) {
        if (!(s->has_free_event && clocks_->events().done_or_not_yet(s->free_event))) {
          if (!wait) break;
          if (s->has_free_event) {
            clocks_->events().wait(s->free_event);
          } else {
            clocks_->events().synchronize();
          }
        }
      }
      dropped += s->size;
      drop(s);
    }
    return dropped;
  }

  /// Drops the cached ranges that map memory of `home` (not while frozen: the allocator then
  /// releases no segment).
  void drop_over(segment* home) noexcept {
    for (auto it = cache_.begin(); it != cache_.end();) {
      range& s = *it++;
      if (s.live) continue;
      for (const piece& pc : s.pieces) {
        if (pc.home == home) {
          drop(&s);
          break;
        }
      }
    }
  }

  /// Drops the cached ranges that map any of the bytes [lo, hi) of `home` (an allocation there
  /// is about to have its handles replaced), once the work queued before their frees completed.
  /// Not while frozen: the allocator moves nothing then. Returns how many it dropped.
  std::size_t drop_mapping(segment* home, std::size_t lo, std::size_t hi) noexcept {
    std::size_t dropped = 0;
    for (auto it = cache_.begin(); it != cache_.end();) {
      range& s = *it++;
      if (s.live) continue;
      bool maps = false;
      for (const piece& pc : s.pieces) maps = maps || (pc.home == home && pc.offset < hi && lo < pc.offset + pc.size);
      if (!maps) continue;
      if constexpr (Clocks::has_events) {
        if (s.has_free_event) {
          clocks_->events().wait(s.free_event);
        } else {
          clocks_->events().synchronize();
        }
      }
      drop(&s);
      ++dropped;
    }
    return dropped;
  }

  /// Whether a live range other than `except` maps any of the bytes [lo, hi) of `home` (a live
  /// range maps whole pieces, so handles past the part it claims stay mapped while free blocks
  /// of their segment serve other allocations).
  bool live_maps(const segment* home, std::size_t lo, std::size_t hi, const range* except) const noexcept {
    for (const range& s : cache_) {
      if (!s.live || &s == except) continue;
      for (const piece& pc : s.pieces) {
        if (pc.home == home && pc.offset < hi && lo < pc.offset + pc.size) return true;
      }
    }
    return false;
  }

  /// Whether a cached range maps any of the bytes [lo, hi) of `home`.
  bool cached_maps(const segment* home, std::size_t lo, std::size_t hi) const noexcept {
    for (const range& s : cache_) {
      if (s.live) continue;
      for (const piece& pc : s.pieces) {
        if (pc.home == home && pc.offset < hi && lo < pc.offset + pc.size) return true;
      }
    }
    return false;
  }

  /// `from` was split at `offset` into itself and `to` (segment_pool::split): the pieces at or
  /// past `offset` now lie in `to`. O(pieces of all ranges).
  void rehome(segment* from, segment* to, std::size_t offset) noexcept {
    if (from->stitch_refs == 0) return;
    for (range& s : cache_) {
      for (piece& pc : s.pieces) {
        if (pc.home != from || pc.offset < offset) continue;
        pc.home = to;
        pc.offset -= offset;
        --from->stitch_refs;
        ++to->stitch_refs;
      }
    }
  }

  /// At destruction (the device synchronized): every range unmapped, live ones too (a live one
  /// is the caller's leak).
  void release_all() noexcept {
    for (range& st : cache_) {
      if constexpr (Clocks::has_events) {
        if (st.has_free_event) clocks_->events().recycle(st.free_event);
      }
      st.has_free_event = false;
    }
    while (!cache_.empty()) {
      range& s = *cache_.begin();
      if (!s.live) {
        drop(&s);
        continue;
      }
      unmap(s);
      cache_.remove(s);
    }
  }

  /// Calls f(piece, slot) for each handle `s` maps, in the range's order.
  template <class F>
  static void for_each_handle(const range& s, F&& f) {
    for (const piece& pc : s.pieces) {
      const auto& m = pc.home->mapping;
      for (std::size_t i = m.first_at_or_after(pc.offset); i < m.count && m.slots[i].offset < pc.offset + pc.size; ++i) {
        f(pc, m.slots[i]);
      }
    }
  }

 private:
  // On its own stream, work queued before a cached range's free comes before work on its new
  // use, so its free event is no longer needed.
  void leave_cache(range& s) noexcept {
    cache_.uncache(s);
    if constexpr (Clocks::has_events) {
      if (s.has_free_event) clocks_->events().recycle(s.free_event);
    }
    s.has_free_event = false;
  }

  // Bytes of the handles mapping the first `size` bytes of `s` whose part there is not free on
  // its stream: each such handle counts whole, as it is replaced whole. Counting stops once
  // `cap` is reached (the result is then >= cap): the caller only compares it below a budget,
  // and a long range mostly in use would otherwise be walked block by block on every probe.
  std::size_t missing_bytes(range& s, std::size_t size,
                            std::size_t cap = std::numeric_limits<std::size_t>::max()) noexcept {
    auto& arena = pool_->arena();
    std::size_t need = size, missing = 0;
    for (piece& pc : s.pieces) {
      if (need == 0 || missing >= cap) break;
      const std::size_t take = std::min(pc.size, need);
      const auto& m = pc.home->mapping;
      const std::uintptr_t begin = m.base + pc.offset, end = begin + take;
      std::size_t counted = m.count;  // the last handle counted (none yet)
      for (block_type* b = arena.containing(begin); b != nullptr && b->address < end; b = arena.next(b)) {
        if (!b->free || b->stream != s.stream) {
          const std::size_t from = std::max(b->address, begin) - m.base, to = std::min(b->end(), end) - m.base;
          // The handle holding `from`, without a search where it can: blocks come in address
          // order, so one starting inside the handle counted last (often, when handles hold
          // several blocks) continues from it, and at the piece's start the hint names it.
          std::size_t i = 0;
          if (counted != m.count && from < m.slots[counted].offset + m.slots[counted].size) {
            i = counted;
          } else if (from == pc.offset) {
            i = m.index_of(pc.offset, pc.first_slot);
          } else {
            i = m.first_at_or_after(from + 1) - 1;
          }
          for (; i < m.count && m.slots[i].offset < to; ++i) {
            if (i != counted) missing += m.slots[i].size;
            counted = i;
          }
        }
        if (b->end() >= end || missing >= cap) break;
      }
      need -= take;
    }
    return missing;
  }

  // Whether the work queued before `s`'s free has completed ("not yet" when the query fails).
  bool queue_drained([[maybe_unused]] const range& s) noexcept {
    if constexpr (Clocks::has_events) {
      return s.has_free_event && clocks_->events().done_or_not_yet(s.free_event);
    } else {
      return true;
    }
  }

  // Carries out repair's choice through the planner: null, with nothing changed, when too few
  // free handles (and no new memory) can be had; null with `s` dropped when the driver fails to
  // remap.
  void* restitch(range& s, std::size_t size, std::size_t requested, stream_ref stream, bool may_grow) {
    auto& arena = pool_->arena();
    repair_.begin();
    std::size_t at = 0;
    for_each_handle(s, [&](const piece& pc, const slot_type& h) {
      block_type* b = nullptr;
      bool replace = false;
      if (at < size) {
        const std::uintptr_t address = pc.home->mapping.base + h.offset;
        b = arena.containing(address);
        replace = !(b->free && b->stream == s.stream && b->end() >= address + std::min(h.size, size - at));
      }
      repair_.add_current(pc.home, h, b, replace);
      at += h.size;
    });
    repair_.expect(size, s.reserved);
    if (repair_.needs_handles()) {
      const std::size_t chunk = pool_->chunk();
      arena.for_each_free_largest_first(stream, [&](block_type& b) {
        // Handles are whole chunks: from here on no block holds one (as in plan).
        if (b.size < chunk) return false;
        const auto& m = b.segment->mapping;
        const std::size_t begin = b.address - m.base, stop = begin + b.size;
        for (std::size_t i = m.first_at_or_after(begin); i < m.count && m.slots[i].offset + m.slots[i].size <= stop; ++i) {
          if (!repair_.is_member(b.segment, m.slots[i].offset)) repair_.offer(b.segment, m.slots[i], &b);
        }
        return !repair_.satisfied();
      });
    }
    block_type* grown = nullptr;
    if (!repair_.satisfied()) {
      if (!may_grow) return nullptr;
      grown = pool_->add_segment(repair_.wanted_bytes() + round_up(repair_.short_bytes(), pool_->chunk()), stream);
      if (grown == nullptr) return nullptr;
      const auto& m = grown->segment->mapping;
      for (std::size_t i = 0; i < m.count; ++i) repair_.offer(grown->segment, m.slots[i], grown);
      if (!repair_.satisfied()) {  // handles of other sizes than the ones replaced
        pool_->drop_segment(grown->segment);
        return nullptr;
      }
    }
    const std::size_t mapped = repair_.finish(size, pieces_);
    try {
      arena.reserve_nodes(2 * pieces_.size());  // before anything is remapped: `s` stays cached
    } catch (...) {
      if (grown != nullptr) pool_->drop_segment(grown->segment);
      throw;
    }
    bool done = false;
    try {
      done = pool_->backend().try_restitch(reinterpret_cast<void*>(s.base), s.reserved, repair_.layout(),
                                           repair_.changes());
    } catch (...) {
      forget(&s);
      if (grown != nullptr) pool_->drop_segment(grown->segment);
      throw;
    }
    if (!done) {
      forget(&s);
      if (grown != nullptr) pool_->drop_segment(grown->segment);
      return nullptr;
    }
    for (const piece& pc : s.pieces) --pc.home->stitch_refs;
    for (const piece& pc : pieces_) ++pc.home->stitch_refs;
    leave_cache(s);
    s.pieces.swap(pieces_);  // the old pieces' storage is the next repair's scratch
    s.size = std::max(s.size, mapped);
    claim_prefix(s, size, requested);
    ++counters_->s.stitch_cache_hits;
    if (repair_.replaced() > 0) ++counters_->s.stitch_repairs;
    if (repair_.appended() > 0) ++counters_->s.stitch_grows;
    return reinterpret_cast<void*>(s.base);
  }

  // Free on the range's own stream: a block another stream has taken over is that stream's.
  bool prefix_free(const range& s, std::size_t size) noexcept {
    std::size_t need = size;
    for (const piece& pc : s.pieces) {
      if (need == 0) break;
      const std::size_t take = std::min(pc.size, need);
      const std::uintptr_t at = pc.home->mapping.base + pc.offset;
      const block_type* b = pool_->arena().containing(at);
      if (b == nullptr || !b->free || b->stream != s.stream || b->end() < at + take) return false;
      need -= take;
    }
    return need == 0;
  }

  // Claims the first `size` bytes of `s`'s pieces (all free, nodes reserved): cannot fail.
  void claim_prefix(range& s, std::size_t size, std::size_t requested) noexcept {
    std::size_t need = size;
    for (piece& pc : s.pieces) {
      if (need == 0) break;
      const std::size_t take = std::min(pc.size, need);
      const std::uintptr_t at = pc.home->mapping.base + pc.offset;
      block_type* b = pool_->arena().containing(at);
      pool_->leave_free_queue(b);
      block_type* claimed = pool_->arena().carve(b, at, take);
      claimed->owner = &s;
      pc.claimed = claimed;
      need -= take;
    }
    s.live = true;
    s.requested = requested;
    s.claimed_bytes = size;
    counters_->on_allocate(requested, size);
  }

  // Maps plan_'s picks (and its new memory) side by side and claims the request's prefix.
  void* map_new(std::size_t size, std::size_t requested, stream_ref stream) {
    block_type* grown = nullptr;  // new memory first: if it cannot be had, nothing has changed
    if (plan_.grow_bytes > 0) {
      grown = pool_->add_segment(round_up(plan_.grow_bytes, pool_->chunk()), stream);
      if (grown == nullptr) return nullptr;
    }
    range* s = nullptr;
    try {
      s = cache_.create();
      std::size_t need = size;
      const auto add_piece = [&](const whole_run& c) {
        // Whole handles from the run's start until they cover what is still needed.
        const auto& m = c.block->segment->mapping;
        std::size_t taken = 0;
        for (std::size_t i = m.first_at_or_after(c.offset); taken < std::min(need, c.size); ++i) taken += m.slots[i].size;
        s->pieces.push_back(piece{c.block->segment, c.offset, taken});
        need -= std::min(need, taken);
      };
      for (std::uint32_t pick : plan_.picks) add_piece(candidates_[pick]);
      if (grown != nullptr && need > 0) add_piece(whole_run{grown, 0, grown->size});
      handles_.clear();
      std::size_t mapped = 0;
      for_each_handle(*s, [&](const piece&, const slot_type& h) {
        handles_.push_back(h);
        mapped += h.size;
      });
      s->size = mapped;
      s->reserved = pool_->growth().reservation(mapped);
      pool_->arena().reserve_nodes(2 * s->pieces.size());
      void* base = pool_->backend().try_map_stitched(handles_, s->reserved);
      if (base == nullptr && s->reserved > mapped) {
        s->reserved = mapped;  // room to grow is a nicety; the addresses may be what ran out
        base = pool_->backend().try_map_stitched(handles_, s->reserved);
      }
      if (base == nullptr && cache_.queued_count() > 0) {
        evict(~std::size_t{0}, true);  // StitchFree: mappings may be what ran out
        base = pool_->backend().try_map_stitched(handles_, s->reserved);
      }
      if (base == nullptr) {
        abandon(s, grown);
        return nullptr;
      }
      s->base = reinterpret_cast<std::uintptr_t>(base);
    } catch (...) {
      abandon(s, grown);
      throw;
    }
    s->stream = stream;
    for (piece& pc : s->pieces) ++pc.home->stitch_refs;
    cache_.add(*s);
    claim_prefix(*s, size, requested);
    ++counters_->s.stitches;
    return reinterpret_cast<void*>(s->base);
  }

  bool plan_is_sound(std::size_t size) const noexcept {
    std::size_t sum = plan_.grow_bytes;
    for (std::uint32_t pick : plan_.picks) {
      if (pick >= candidates_.size()) return false;
      sum += candidate_sizes_[pick];
    }
    // Picks must be distinct: a block mapped twice in one range would be claimed twice.
    for (std::size_t i = 0; i < plan_.picks.size(); ++i) {
      for (std::size_t j = i + 1; j < plan_.picks.size(); ++j) {
        if (plan_.picks[i] == plan_.picks[j]) return false;
      }
    }
    return sum >= size && plan_.pieces() >= 2;
  }

  void abandon(range* s, block_type* grown) noexcept {
    if (s != nullptr) cache_.destroy(s);
    if (grown != nullptr) pool_->drop_segment(grown->segment);
  }

  void drop(range* s) noexcept {
    unmap(*s);
    forget(s);
  }

  // A cached range's bookkeeping, once its mappings are gone.
  void forget(range* s) noexcept {
    if constexpr (Clocks::has_events) {
      if (s->has_free_event) clocks_->events().recycle(s->free_event);
    }
    for (piece& pc : s->pieces) --pc.home->stitch_refs;
    ++counters_->s.stitch_evictions;
    cache_.remove(*s);
  }

  // Unmaps every handle of a range and frees its addresses; its memory stays home.
  void unmap(const range& s) noexcept {
    std::size_t at = 0;
    for_each_handle(s, [&](const piece&, const slot_type& h) {
      pool_->backend().unmap_stitched(reinterpret_cast<void*>(s.base + at), h.size);
      at += h.size;
    });
    pool_->backend().free_stitched(reinterpret_cast<void*>(s.base), s.reserved);
  }

  Pool* pool_;
  Clocks* clocks_;
  usage_counters* counters_;
  const Admission* admission_;
  std::size_t auto_gc_;
  std::size_t max_candidates_;
  std::size_t max_probes_;
  stitch_cache<range, Evict> cache_;
  [[no_unique_address]] Stitch strategy_;
  std::vector<whole_run> candidates_;
  std::vector<std::size_t> candidate_sizes_;
  stitch_plan plan_;
  std::vector<slot_type> handles_;
  stitch_repair_plan<segment, block_type, handle_type, piece> repair_;
  std::vector<piece> pieces_;
  bool frozen_ = false;
};

/// For allocators that never stitch.
struct no_stitcher {};

}  // namespace glake::detail
