// The caching allocator: best fit with splitting and coalescing over segments it caches, no
// stitching. The baseline the stitching allocator is measured against, and its small pool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "glake/allocators/concepts.hpp"
#include "glake/allocators/segment_source.hpp"
#include "glake/detail/archetypes.hpp"
#include "glake/detail/accounting.hpp"
#include "glake/detail/block_arena.hpp"
#include "glake/detail/node_pool.hpp"
#include "glake/policies/eviction.hpp"
#include "glake/policies/locking.hpp"
#include "glake/statistics.hpp"
#include "glake/stream.hpp"

namespace glake {

/// How a caching allocator sizes requests and segments; runtime data, not a hot-path decision.
/// The defaults are PyTorch's small-pool rules generalised: 512 B rounding, segments of at
/// least 2 MiB, split whenever the remainder is at least one rounding unit.
struct caching_rules {
  std::size_t round_to = 512;              ///< requests rounded up to a multiple (a power of two),
                                           ///< pointers aligned to it (CUDA code wants >= 256)
  std::size_t min_segment = 2 << 20;       ///< requests below `segment_threshold` get a segment
                                           ///< this large
  std::size_t segment_threshold = 1 << 20; ///< requests at or above it get a segment of their own
                                           ///< size (rounded to the source's granularity)
  std::size_t min_split_remainder = 512;   ///< split a free block only if this much is left over
};

/// Best fit with splitting and coalescing. A request is rounded (caching_rules), served by the
/// smallest free block of its stream that fits (split when the remainder is large enough), or by
/// a new segment from the Source. Freed blocks merge with free neighbours at once and stay
/// cached; fully free segments go back to the Source only when a new segment cannot be had
/// (least valuable first, by the Evict policy) or on `release_cached()`.
///
/// Complexity: O(log n) per call in the number of blocks; no heap allocation once warm.
/// Thread safety: as the Lock policy; one lock per public call.
/// Streams: blocks are reused only on the stream they were allocated on; the stream given at
/// deallocation is accepted as is (cross-stream ordering is the CUDA layer's business).
/// Errors: allocate throws out_of_memory, try_allocate returns null; misuse throws usage_error.
template <segment_source Source, lock_policy Lock = no_lock, eviction_policy Evict = lru_eviction>
class caching_allocator {
  struct segment : eviction_hook {
    typename Source::lease_type lease;
  };
  using arena_type = detail::block_arena<segment>;
  using block_type = typename arena_type::block_type;

 public:
  using source_type = Source;

  explicit caching_allocator(Source source, caching_rules rules = {})
      : source_(std::move(source)), rules_(rules) {
    const auto power_of_two = [](std::size_t n) { return n != 0 && (n & (n - 1)) == 0; };
    if (!power_of_two(rules_.round_to)) {
      throw std::invalid_argument("caching_allocator: round_to must be a power of two");
    }
    if (rules_.min_segment == 0 || rules_.min_segment % source_.granularity() != 0) {
      throw std::invalid_argument(
          "caching_allocator: min_segment must be a non-zero multiple of the source's granularity");
    }
  }
  caching_allocator(const caching_allocator&) = delete;
  caching_allocator& operator=(const caching_allocator&) = delete;
  /// Gives every segment back, live blocks or not, and tells the live_report of live ones.
  ~caching_allocator() {
    detail::report_live(live_report_, "glake::caching_allocator", counters_.s);
    release_all_segments();
  }

  /// At least `bytes` bytes on `stream`, aligned to `round_to`. Zero bytes gives null.
  void* allocate(std::size_t bytes, stream_ref stream = default_stream) {
    std::lock_guard guard(lock_);
    if (bytes == 0) return nullptr;
    if (void* p = allocate_locked(bytes, stream)) return p;
    ++counters_.s.failed_allocations;
    detail::throw_out_of_memory("glake::caching_allocator", bytes, stream, stats_locked(),
                                largest_free_block(), source_memory_limit());
  }

  /// As allocate, but null when out of memory.
  void* try_allocate(std::size_t bytes, stream_ref stream = default_stream) {
    std::lock_guard guard(lock_);
    if (bytes == 0) return nullptr;
    void* p = allocate_locked(bytes, stream);
    if (p == nullptr) ++counters_.s.failed_allocations;
    return p;
  }

  /// Returns a block. `bytes` must be the size given to allocate. Null is ignored.
  void deallocate(void* p, std::size_t bytes, stream_ref stream = default_stream) {
    std::lock_guard guard(lock_);
    deallocate_locked(p, bytes, stream);
  }

  /// Gives every fully free segment back to the source (PyTorch's empty_cache).
  void release_cached() {
    std::lock_guard guard(lock_);
    release_free_segments(~std::size_t{0});
  }

  statistics stats() const {
    std::lock_guard guard(lock_);
    return stats_locked();
  }

  /// Peaks (active, allocated, reserved) start again from the current values; returns the
  /// statistics as they were just before, so no peak between reading and resetting is lost.
  statistics reset_peaks() {
    std::lock_guard guard(lock_);
    const statistics before = stats_locked();
    counters_.reset_peaks();
    return before;
  }

  /// True when `p` is the start of a live block of this allocator.
  bool owns(const void* p) const {
    std::lock_guard guard(lock_);
    const block_type* b = const_cast<arena_type&>(arena_).find(reinterpret_cast<std::uintptr_t>(p));
    return b != nullptr && !b->free;
  }

  /// Physical bytes held now (what stats().reserved_bytes says, without copying the rest).
  std::size_t reserved_bytes() const {
    std::lock_guard guard(lock_);
    return counters_.s.reserved_bytes;
  }

  /// Checks every internal invariant; throws std::logic_error naming the first broken one.
  void verify() const {
    std::lock_guard guard(lock_);
    verify_locked();
  }

  /// Bytes of the fully free segments it would give back on release_cached().
  std::size_t cached_segment_bytes() const {
    std::lock_guard guard(lock_);
    std::size_t sum = 0;
    arena_.for_each_block([&](const block_type& b) {
      if (b.free && b.size == b.segment->lease.size) sum += b.size;
    });
    return sum;
  }

  /// Every pointer returned is aligned to at least this.
  std::size_t alignment() const noexcept { return rules_.round_to; }
  /// Who is told, at destruction, of allocations still live (null: nobody; see live_report).
  void set_live_report(live_report report) noexcept { live_report_ = report; }
  const caching_rules& rules() const noexcept { return rules_; }
  Source& source() noexcept { return source_; }

  // --- unlocked building blocks for allocators that embed this one under their own lock ---

  void* allocate_unlocked(std::size_t bytes, stream_ref stream) { return allocate_locked(bytes, stream); }
  /// False when `p` is not a live block of this allocator (nothing changed then).
  bool deallocate_if_owned(void* p, std::size_t bytes, stream_ref) {
    block_type* b = arena_.find(reinterpret_cast<std::uintptr_t>(p));
    if (b == nullptr || b->free) return false;
    release_block(b, p, bytes);
    return true;
  }
  /// Releases fully free segments until at least `bytes` were released; returns what was.
  std::size_t release_free_segments(std::size_t bytes) noexcept {
    std::size_t released = 0;
    while (released < bytes) {
      segment* victim = free_segments_.victim();
      if (victim == nullptr) break;
      released += victim->lease.size;
      drop_segment(victim);
    }
    return released;
  }
  /// What the caller asked for when `p` was allocated; 0 when `p` is not live here.
  std::size_t requested_of(const void* p) noexcept {
    const block_type* b = arena_.find(reinterpret_cast<std::uintptr_t>(p));
    return b != nullptr && !b->free ? b->requested : 0;
  }

  /// True when `p` points into a free block (a double free looks like this).
  bool inside_free_block(const void* p) noexcept {
    const block_type* c = arena_.containing(reinterpret_cast<std::uintptr_t>(p));
    return c != nullptr && c->free;
  }
  /// Calls f(block) for each block of the segment at `base`, in address order (nothing when no
  /// segment starts there). O(its blocks).
  template <class F>
  void for_each_block_of_segment_unlocked(std::uintptr_t base, F&& f) const {
    auto& arena = const_cast<arena_type&>(arena_);
    block_type* b = arena.find(base);
    if (b == nullptr || b->segment->lease.base != base) return;
    const std::uintptr_t end = base + b->segment->lease.size;
    for (; b != nullptr && b->address < end; b = arena.next(b)) f(static_cast<const block_type&>(*b));
  }
  statistics stats_unlocked() const { return stats_locked(); }
  void verify_unlocked() const { verify_locked(); }

 private:
  std::size_t source_memory_limit() const noexcept {
    if constexpr (requires { source_.memory_limit(); }) {
      return source_.memory_limit();
    } else {
      return 0;
    }
  }

  void* allocate_locked(std::size_t bytes, stream_ref stream) {
    if (detail::round_up_overflows(bytes, rules_.round_to)) return nullptr;
    const std::size_t size = detail::round_up(bytes, rules_.round_to);
    arena_.reserve_nodes(1);  // a split must not fail halfway
    block_type* b = arena_.best_fit(stream, size);
    if (b == nullptr) b = grow(size, stream);
    if (b == nullptr) return nullptr;
    if (b->size == b->segment->lease.size) free_segments_.erase(*b->segment);
    const std::size_t keep = b->size - size >= rules_.min_split_remainder ? size : b->size;
    arena_.take(b, keep);
    b->requested = bytes;
    counters_.on_allocate(bytes, b->size);
    return reinterpret_cast<void*>(b->address);
  }

  void deallocate_locked(void* p, std::size_t bytes, stream_ref) {
    if (p == nullptr) return;
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    block_type* b = arena_.find(address);
    if (b == nullptr || b->free) {
      const block_type* c = arena_.containing(address);
      detail::throw_not_live("glake::caching_allocator", p, c != nullptr && c->free);
    }
    release_block(b, p, bytes);
  }

  // Frees live block `b`, which the caller found at `p`.
  void release_block(block_type* b, [[maybe_unused]] void* p, std::size_t bytes) {
#if GLAKE_CHECKED
    if (b->requested != bytes) detail::throw_size_mismatch("glake::caching_allocator", p, bytes, b->requested);
#else
    (void)bytes;
#endif
    counters_.on_deallocate(b->requested, b->size);
    block_type* merged = arena_.give_back(b);
    if (merged->size == merged->segment->lease.size) {
      merged->segment->eviction_bytes_ = merged->size;
      free_segments_.push(*merged->segment);
    }
  }

  // A new segment for a request of `size` bytes; under memory pressure, cached free segments
  // are given back first and the request is tried again.
  block_type* grow(std::size_t size, stream_ref stream) {
    const std::size_t granularity = source_.granularity();
    if (detail::round_up_overflows(size, granularity)) return nullptr;
    if constexpr (requires { source_.capacity(); }) {
      if (size > source_.capacity()) return nullptr;  // never fits: keep the cache
    }
    if constexpr (extensible_segment_source<Source>) {
      // One segment per stream that grows at its end, so its last free block and the new pages
      // form one block (PyTorch's expandable segments).
      if (segment* s = segment_of(stream)) return extend(s, size, stream);
    }
    const std::size_t bytes = size < rules_.segment_threshold
                                  ? std::max(rules_.min_segment, detail::round_up(size, granularity))
                                  : detail::round_up(size, granularity);
    if (block_type* b = try_add_segment(bytes, stream)) return b;
    if (release_free_segments(bytes) == 0) return nullptr;
    if (block_type* b = try_add_segment(bytes, stream)) return b;
    if (release_free_segments(~std::size_t{0}) == 0) return nullptr;
    return try_add_segment(bytes, stream);
  }

  segment* segment_of(stream_ref stream) const noexcept {
    for (const auto& [owner, s] : stream_segments_) {
      if (owner == stream) return s;
    }
    return nullptr;
  }

  block_type* extend(segment* s, std::size_t size, stream_ref stream) {
    const std::uintptr_t end = s->lease.base + s->lease.size;
    const block_type* last = arena_.containing(end - 1);
    const std::size_t tail = last->free ? last->size : 0;
    const bool was_whole_free = last->free && last->size == s->lease.size;
    const std::size_t bytes = detail::round_up(size - tail, source_.granularity());
    arena_.reserve_nodes(1);
    if (!source_.try_extend(s->lease, bytes)) return nullptr;
    if (was_whole_free) free_segments_.erase(*s);
    block_type* b = arena_.extend_segment(s, end, bytes, stream);
    counters_.on_extend(bytes);
    if (b->size == s->lease.size) {
      s->eviction_bytes_ = b->size;
      free_segments_.push(*s);
    }
    return b;
  }

  block_type* try_add_segment(std::size_t bytes, stream_ref stream) {
    segment* s = segments_.create();
    try {
      if (!source_.try_acquire(bytes, stream, s->lease)) {
        segments_.destroy(s);
        return nullptr;
      }
    } catch (...) {
      segments_.destroy(s);
      throw;
    }
    block_type* b = nullptr;
    try {
      b = arena_.add_segment(s, s->lease.base, s->lease.size, stream);
    } catch (...) {
      source_.release(s->lease);
      segments_.destroy(s);
      throw;
    }
    if constexpr (extensible_segment_source<Source>) {
      try {
        stream_segments_.emplace_back(stream, s);
      } catch (...) {
        arena_.remove_segment(b);
        source_.release(s->lease);
        segments_.destroy(s);
        throw;
      }
    }
    counters_.on_reserve(bytes);
    s->eviction_bytes_ = bytes;
    free_segments_.push(*s);  // invariant: queued exactly while its one block is free
    return b;
  }

  void drop_segment(segment* s) noexcept {
    std::erase_if(stream_segments_, [s](const auto& entry) { return entry.second == s; });
    block_type* b = arena_.find(s->lease.base);
    free_segments_.erase(*s);
    arena_.remove_segment(b);
    counters_.on_unreserve(s->lease.size);
    source_.release(s->lease);
    segments_.destroy(s);
  }

  void release_all_segments() noexcept {
    // Live blocks at destruction are the caller's leak; their segments are released regardless,
    // since nothing can return them any more.
    std::vector<segment*> all;
    arena_.for_each_block([&](const block_type& b) {
      if (b.address == b.segment->lease.base) all.push_back(b.segment);
    });
    for (segment* s : all) {
      source_.release(s->lease);
      segments_.destroy(s);
    }
  }

  std::size_t largest_free_block() const {
    std::size_t largest = 0;
    arena_.for_each_block([&](const block_type& b) {
      if (b.free) largest = std::max(largest, b.size);
    });
    return largest;
  }

  statistics stats_locked() const {
    statistics s = counters_.s;
    s.splits = arena_.splits();
    s.merges = arena_.merges();
    if constexpr (requires { source_.calls(); }) s.driver_calls = source_.calls();
    if constexpr (requires { source_.call_times(); }) s.driver_time = source_.call_times();
    return s;
  }

  void verify_locked() const {
    const auto fail = [](const std::string& what) {
      throw std::logic_error("glake::caching_allocator invariant broken: " + what);
    };
    std::size_t active = 0, allocated = 0, free_bytes = 0, reserved = 0, free_segments = 0;
    const auto extent = [](const segment& s) { return std::pair{s.lease.base, s.lease.size}; };
    arena_.check_tiling(extent, fail, [&](const block_type& b) {
      if (b.size == 0 || b.size % rules_.round_to != 0) fail("block size not a positive multiple");
      if (b.address == b.segment->lease.base) reserved += b.segment->lease.size;
      if (b.free) {
        free_bytes += b.size;
        if (b.size == b.segment->lease.size) ++free_segments;
      } else {
        active += b.requested;
        allocated += b.size;
        if (b.requested > b.size) fail("live block smaller than its request");
      }
    });
    if (active != counters_.s.active_bytes) fail("active bytes disagree with live blocks");
    if (allocated != counters_.s.allocated_bytes) fail("allocated bytes disagree with live blocks");
    if (free_bytes != arena_.free_bytes()) fail("free bytes disagree with free blocks");
    if (reserved != counters_.s.reserved_bytes) fail("reserved bytes disagree with segments");
    if (free_segments != free_segments_.size()) fail("free segment queue disagrees with free segments");
  }

  Source source_;
  caching_rules rules_;
  arena_type arena_;
  detail::node_pool<segment> segments_;
  typename Evict::template queue<segment> free_segments_;
  std::vector<std::pair<stream_ref, segment*>> stream_segments_;  // extensible sources only
  detail::usage_counters counters_;
  live_report live_report_ = detail::default_live_report;
  [[no_unique_address]] mutable Lock lock_;
};

// Over any segment source: an owning, cache-releasing, peak-resetting allocator. It records no
// streams: it reuses a block only on its own stream and has no events to defer a free with.
static_assert(owning_allocator<caching_allocator<detail::segment_source_archetype>>);
static_assert(cache_releasing_allocator<caching_allocator<detail::segment_source_archetype>>);
static_assert(peak_resetting_allocator<caching_allocator<detail::segment_source_archetype>>);
static_assert(!stream_recording_allocator<caching_allocator<detail::segment_source_archetype>>);
static_assert(!memory_limiting_allocator<caching_allocator<detail::segment_source_archetype>>);

}  // namespace glake
