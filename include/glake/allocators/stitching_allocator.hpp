// The stitching allocator: GMLake's virtual memory stitching. Free physical chunks of several
// blocks are mapped side by side into a fresh virtual range to serve a request no single free
// block can; stitched ranges are cached for reuse and dropped by an eviction policy.
#pragma once

#include <algorithm>
#include <chrono>
#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <boost/intrusive/set.hpp>

#include "glake/allocators/caching_allocator.hpp"
#include "glake/backends/concepts.hpp"
#include "glake/config.hpp"
#include "glake/detail/accounting.hpp"
#include "glake/detail/block_arena.hpp"
#include "glake/detail/node_pool.hpp"
#include "glake/detail/vmm_backend.hpp"
#include "glake/policies/eviction.hpp"
#include "glake/policies/locking.hpp"
#include "glake/policies/stitching.hpp"
#include "glake/statistics.hpp"
#include "glake/stream.hpp"

namespace glake {

/// Physical memory is created in chunks (one provider handle each, `config::chunk_size`, by
/// default the granularity) that are mapped back to back into a segment's own range; blocks are
/// runs of whole chunks of a segment. A request larger than `small_limit` is rounded to chunks
/// and served, in GMLake's order:
///   1. the best-fitting free block of its stream (split at a chunk boundary);
///   2. a cached stitched range of size S with R <= S <= R * reuse_limit whose first R bytes of
///      chunks are all free: those chunks are claimed, the rest stay free for others; failing
///      that (for requests that may stitch), such a range with at most half of those bytes taken
///      since, once the handles taken are replaced in it by free handles of the same size from
///      elsewhere (an unmap, a map and access per replaced handle, not per handle of R); or a
///      smaller cached range grown in place: every stitched range reserves `stitch_reserve` times
///      its size of address space, and free handles are mapped after its end (a map and access
///      each), when at most half of R's bytes are mapped anew this way;
///   3. a new stitch: the Stitch strategy picks free blocks of the stream, their chunks are mapped
///      side by side into a fresh range (one map per chunk, one set-access), and the blocks are
///      claimed (the last one split so the total is exact);
///   4. new physical memory: a segment of R bytes; with `grow_stitch`, only the shortfall over the
///      free blocks, used to grow a cached range as in step 2 or stitched with the free blocks;
///   5. under pressure: drop cached stitched mappings and fully free segments (Evict order),
///      reclaim the small pool's empty segments, and retry; stitching is tried at the ladder's
///      rung `defrag_level` and above, and only for requests of at least `frag_limit`.
/// Requests up to `small_limit` go to a caching allocator (the small pool) that borrows
/// `small_segment`-sized blocks from this pool, never stitches, and returns its empty blocks
/// whenever this pool would otherwise have to grow.
///
/// A stitched range is a new virtual mapping of physical memory that also stays mapped in its
/// home segment, so cached stitched ranges cost address space and mappings but no memory; their
/// chunks may be in use elsewhere meanwhile, which is why reuse checks that the needed chunks are
/// free. Statistics count physical memory once.
///
/// Complexity: steps 1 and 2 are O(log n) (step 2 checks a bounded number of candidates); a
/// stitch costs O(k log n) for k pieces plus one driver map per chunk. No heap allocation on the
/// cached path once warm.
/// Thread safety: as the Lock policy; one lock per public call.
/// Streams: free blocks, and the stitches built from them, belong to a stream and are reused on it
/// at once. A request that its own stream cannot serve from free memory takes other streams'
/// free blocks whose frees have completed (the work queued on their stream before the free is
/// done) before it stitches or grows: the best fit if one block will do, else the largest ones
/// until they cover it. On backends with events (stream_ordered_reserver, e.g. CUDA) "completed"
/// is an event recorded on the freeing stream, only during a call on that stream (a stream may be
/// destroyed once its calls end), and only when none is in flight or the newest is older than
/// `event_interval_us`, so one event covers many frees and a stream's events are queried at most
/// once per interval, not on every call; with a single stream none is recorded for frees (a
/// stitched range's free gets one, a record_stream'd free one per other stream; statistics count
/// the records and queries, and their host time). Without events (host, sim) a
/// free completes when it returns. An allocation marked with record_stream is freed only once the work queued on
/// those streams has completed; a cached stitched range is unmapped only once the work queued
/// before its free has completed; physical memory is released only after the device is
/// synchronized.
/// Errors: allocate throws out_of_memory (state unchanged, allocator usable); try_allocate returns
/// null; misuse throws usage_error; a backend failure throws its error after a full rollback. A
/// failed event query only means "not completed yet" (no repair, no eviction without waiting).
template <physical_provider Provider, address_reserver_for<Provider> Reserver,
          stitching_strategy Stitch = best_fit_tail_stitching, eviction_policy Evict = lru_eviction,
          lock_policy Lock = no_lock>
class stitching_allocator {
  using handle_type = typename Provider::handle_type;
  using backend_type = detail::vmm_backend<Provider, Reserver>;
  using slot_type = detail::handle_slot<handle_type>;
  static constexpr bool has_events = stream_ordered_reserver<Reserver>;
  struct no_event {};
  template <class R, bool = stream_ordered_reserver<R>>
  struct event_of {
    using type = no_event;
  };
  template <class R>
  struct event_of<R, true> {
    using type = typename R::event_type;
  };
  using event_type = typename event_of<Reserver>::type;

  // A free deferred until work queued on other streams (record_stream) has completed.
  struct pending_free {
    void* p;
    std::size_t bytes;
    stream_ref stream;
    std::vector<std::pair<stream_ref, event_type>> events;  ///< one per other stream that used it
  };

  // A stream's clock: frees on it are marked with `next`; an event recorded for that mark (when
  // `dirty`) tells when they have completed; every mark up to `done` has.
  struct stream_clock {
    stream_ref stream;
    std::uint64_t next = 1;
    std::uint64_t done = 0;
    bool dirty = false;
    std::chrono::steady_clock::time_point recorded{};  ///< of the newest event
    std::deque<std::pair<std::uint64_t, event_type>> in_flight;
    std::uint64_t wanted = 0;  ///< scratch for wait_for_other_streams: the newest mark it needs
  };


  struct segment : eviction_hook {
    detail::mapped_segment<handle_type> mapping;
    std::size_t stitch_refs = 0;  ///< pieces of stitched ranges (live or cached) inside it
  };
  using arena_type = detail::block_arena<segment>;
  using block_type = typename arena_type::block_type;

  struct piece {
    segment* home;
    std::size_t offset;            ///< into the home segment, at a handle boundary
    std::size_t size;              ///< whole handles
    block_type* claimed = nullptr; ///< the live block holding (a prefix of) it while the stitch
                                   ///< holds it; the rest of its handles stays free in place
  };
  // A free block's stitchable part: the whole handles inside it.
  struct candidate {
    block_type* block;
    std::size_t offset;  ///< of the first whole handle, into the segment
    std::size_t size;    ///< of the whole handles
  };

  struct stitch_address_tag;
  struct stitch_size_tag;
  using stitch_address_hook =
      boost::intrusive::set_base_hook<boost::intrusive::tag<stitch_address_tag>,
                                      boost::intrusive::link_mode<boost::intrusive::normal_link>>;
  using stitch_size_hook =
      boost::intrusive::set_base_hook<boost::intrusive::tag<stitch_size_tag>,
                                      boost::intrusive::link_mode<boost::intrusive::normal_link>>;

  struct stitched : eviction_hook, stitch_address_hook, stitch_size_hook {
    std::uintptr_t base = 0;
    std::size_t size = 0;           ///< mapped, from base
    std::size_t reserved = 0;       ///< address space reserved at base (>= size): room to grow
    stream_ref stream{};
    std::vector<piece> pieces;
    bool live = false;
    std::size_t requested = 0;
    std::size_t claimed_bytes = 0;  ///< the prefix of `size` claimed while live
    bool has_free_event = false;    ///< free_event marks the work queued before it was cached
    event_type free_event{};
  };
  struct stitch_by_address {
    bool operator()(const stitched& a, const stitched& b) const noexcept { return a.base < b.base; }
    bool operator()(std::uintptr_t a, const stitched& b) const noexcept { return a < b.base; }
    bool operator()(const stitched& a, std::uintptr_t b) const noexcept { return a.base < b; }
  };
  struct stitch_key {
    stream_ref stream;
    std::size_t size;
  };
  struct stitch_by_size {
    bool operator()(const stitched& a, const stitched& b) const noexcept {
      return a.stream != b.stream ? a.stream < b.stream : a.size < b.size;
    }
    bool operator()(const stitch_key& a, const stitched& b) const noexcept {
      return a.stream != b.stream ? a.stream < b.stream : a.size < b.size;
    }
    bool operator()(const stitched& a, const stitch_key& b) const noexcept {
      return a.stream != b.stream ? a.stream < b.stream : a.size < b.size;
    }
  };
  using stitch_address_set =
      boost::intrusive::set<stitched, boost::intrusive::base_hook<stitch_address_hook>,
                            boost::intrusive::compare<stitch_by_address>,
                            boost::intrusive::constant_time_size<true>>;
  using stitch_size_set =
      boost::intrusive::multiset<stitched, boost::intrusive::base_hook<stitch_size_hook>,
                                 boost::intrusive::compare<stitch_by_size>,
                                 boost::intrusive::constant_time_size<true>>;

  // The small pool's segment source: blocks of this allocator's large pool.
  class small_source {
   public:
    struct lease_type {
      std::uintptr_t base = 0;
      std::size_t size = 0;
    };
    explicit small_source(stitching_allocator* parent) noexcept : parent_(parent) {}
    std::size_t granularity() const noexcept { return parent_->chunk_; }
    bool try_acquire(std::size_t bytes, stream_ref stream, lease_type& out) {
      return parent_->lend_to_small(bytes, stream, out);
    }
    void release(lease_type& lease) noexcept { parent_->return_from_small(lease); }

   private:
    stitching_allocator* parent_;
  };
  using small_pool = caching_allocator<small_source, no_lock, Evict>;

  static constexpr std::size_t max_candidates = 1024;
  static constexpr std::size_t max_reuse_probes = 32;

 public:
  using provider_type = Provider;
  using reserver_type = Reserver;

  stitching_allocator(Provider provider, Reserver reserver, config cfg = {})
      : config_(validated(cfg)),
        backend_(std::move(provider), std::move(reserver), cfg.memory_limit),
        chunk_(chosen_chunk(config_, backend_.granularity())),
        max_handle_(chosen_max_handle(config_, chunk_)),
        small_(small_source(this), small_rules(config_, chunk_)) {
    candidates_.reserve(max_candidates);
    candidate_sizes_.reserve(max_candidates);
    handle_sizes_.reserve(64);
    plan_.picks.reserve(max_candidates);
    pinned_.reserve(256);
    adoptable_.reserve(max_candidates);
  }
  stitching_allocator(const stitching_allocator&) = delete;
  stitching_allocator& operator=(const stitching_allocator&) = delete;
  ~stitching_allocator() { release_everything(); }

  /// At least `bytes` bytes on `stream`: aligned to `round_to` for small requests and to the
  /// chunk size for large ones. Zero bytes gives null.
  void* allocate(std::size_t bytes, stream_ref stream = default_stream) {
    std::lock_guard guard(lock_);
    if (bytes == 0) return nullptr;
    if (void* p = allocate_locked(bytes, stream)) return p;
    ++counters_.s.failed_allocations;
    detail::throw_out_of_memory("glake::stitching_allocator", bytes, stream, stats_locked(),
                                largest_free_block(), backend_.memory_limit());
  }

  /// As allocate, but null when out of memory.
  void* try_allocate(std::size_t bytes, stream_ref stream = default_stream) {
    std::lock_guard guard(lock_);
    if (bytes == 0) return nullptr;
    void* p = allocate_locked(bytes, stream);
    if (p == nullptr) ++counters_.s.failed_allocations;
    return p;
  }

  /// Returns memory. `bytes` must be the size given to allocate. Null is ignored.
  void deallocate(void* p, std::size_t bytes, stream_ref stream = default_stream) {
    std::lock_guard guard(lock_);
    deallocate_locked(p, bytes, stream);
  }

  /// The allocation at `p` is also used by work on `stream` (PyTorch's record_stream): when it is
  /// freed, its memory is reused only after the work queued on `stream` by then has completed.
  /// Backends without events need nothing of this. Throws usage_error for a pointer not live here.
  void record_stream(void* p, stream_ref stream) {
    std::lock_guard guard(lock_);
    if (!owns_unlocked(p)) detail::throw_not_live(name, p, false);
    if constexpr (has_events) {
      const auto address = reinterpret_cast<std::uintptr_t>(p);
      for (const auto& [a, s] : extra_uses_) {
        if (a == address && s == stream) return;
      }
      extra_uses_.emplace_back(address, stream);
    }
  }

  /// Drops every cached stitched mapping and gives every fully free segment back to the backend
  /// (PyTorch's empty_cache).
  void release_cached() {
    std::lock_guard guard(lock_);
    finish_pending_frees(true);
    evict_stitches(~std::size_t{0}, true);
    small_.release_free_segments(~std::size_t{0});
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

  /// True when `p` is a live allocation of this allocator (small, primitive or stitched).
  bool owns(const void* p) const {
    std::lock_guard guard(lock_);
    return owns_unlocked(p);
  }

 private:
  bool owns_unlocked(const void* p) const {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    auto& self = const_cast<stitching_allocator&>(*this);
    if (const block_type* b = self.arena_.find(address); b != nullptr && !b->free && b->owner == nullptr) {
      return true;
    }
    auto it = stitch_by_address_.find(address, stitch_by_address{});
    return (it != stitch_by_address_.end() && it->live) || small_.owns(p);
  }

 public:

  /// Where free memory sits, for diagnosing fragmentation: bytes of free blocks in the large pool
  /// that are whole handles (stitchable), bytes of free blocks inside partly used handles (usable
  /// only in place), and bytes of the small pool's borrowed blocks that are free. O(blocks).
  struct free_memory_report {
    std::size_t whole_handles = 0;
    std::size_t partial_handles = 0;
    std::size_t small_pool = 0;
  };
  free_memory_report free_memory() const {
    std::lock_guard guard(lock_);
    free_memory_report r;
    arena_.for_each_block([&](const block_type& b) {
      if (!b.free) return;
      const std::size_t whole = whole_handles_of(const_cast<block_type&>(b)).size;
      r.whole_handles += whole;
      r.partial_handles += b.size - whole;
    });
    r.small_pool = small_.stats_unlocked().reserved_bytes - small_.stats_unlocked().allocated_bytes;
    return r;
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

  /// Every pointer returned is aligned to at least this.
  std::size_t alignment() const noexcept { return config_.round_to; }
  const config& settings() const noexcept { return config_; }
  std::size_t chunk_size() const noexcept { return chunk_; }
  /// The backend's provider and reserver (e.g. to read a simulated device's counters).
  Provider& provider() noexcept { return backend_.provider(); }
  Reserver& reserver() noexcept { return backend_.reserver(); }

 private:
  // ------------------------------------------------------------------ set-up
  static config validated(const config& cfg) {
    cfg.validate();
    return cfg;
  }
  static std::size_t chosen_chunk(const config& cfg, std::size_t granularity) {
    const std::size_t chunk = cfg.chunk_size == 0 ? granularity : cfg.chunk_size;
    if (chunk % granularity != 0) {
      throw config_error("glake config: chunk_size must be a multiple of the backend's granularity (" +
                         format_bytes(granularity) + "), got " + format_bytes(chunk));
    }
    if (cfg.small_segment % chunk != 0) {
      throw config_error("glake config: small_segment (" + format_bytes(cfg.small_segment) +
                         ") must be a multiple of the chunk size (" + format_bytes(chunk) + ")");
    }
    return chunk;
  }
  static std::size_t chosen_max_handle(const config& cfg, std::size_t chunk) {
    if (cfg.max_handle == 0 || cfg.max_handle <= chunk) return chunk;
    if (cfg.max_handle % chunk != 0) {
      throw config_error("glake config: max_handle (" + format_bytes(cfg.max_handle) +
                         ") must be a multiple of the chunk size (" + format_bytes(chunk) + ")");
    }
    return cfg.max_handle;
  }

  // The handles a new segment of `bytes` is made of: chunk x 2^k pieces, largest first, none
  // above max_handle; so a segment costs O(log) driver calls, not bytes / chunk.
  void plan_handles(std::size_t bytes) {
    handle_sizes_.clear();
    // At most 1/min_handles of the segment per handle: a handle partly in use cannot be
    // stitched, so no handle may strand much of its segment. Below max_handle that makes a
    // segment min_handles to ~2 x min_handles handles.
    const std::size_t share = bytes / static_cast<std::size_t>(config_.min_handles);
    std::size_t largest = chunk_;
    while (largest * 2 <= max_handle_ && largest * 2 <= share) largest *= 2;
    for (std::size_t size = largest; bytes > 0;) {
      if (size <= bytes) {
        handle_sizes_.push_back(size);
        bytes -= size;
      } else {
        size /= 2;
      }
    }
  }

  static caching_rules small_rules(const config& cfg, std::size_t) {
    caching_rules rules;
    rules.round_to = cfg.round_to;
    rules.min_segment = cfg.small_segment;
    rules.segment_threshold = cfg.small_limit + 1;
    rules.min_split_remainder = cfg.round_to;
    return rules;
  }

  // ------------------------------------------------------------------ allocation
  void* allocate_locked(std::size_t bytes, stream_ref stream) {
    if constexpr (has_events) {
      if (!pending_.empty()) finish_pending_frees(false);
    }
    if (clocks_.empty() || stream != current_stream_) enter_stream(stream);
    if constexpr (has_events) {
      if (clocks_.size() > 1) tick(stream);
    }
    if (bytes <= config_.small_limit) {
      void* p = small_.allocate_unlocked(bytes, stream);
      if (p != nullptr) counters_.on_allocate(bytes, detail::round_up(bytes, config_.round_to));
      return p;
    }
    if (detail::round_up_overflows(bytes, chunk_)) return nullptr;
    const std::size_t size = detail::round_up(bytes, chunk_);
    arena_.reserve_nodes(2);

    if (block_type* b = arena_.best_fit(stream, size)) return hand_out(b, size, bytes);
    if (config_.stitching) {
      if (void* p = reuse_stitch(size, bytes, stream)) return p;
    }
    if (adopt(size, stream, false)) {
      if (block_type* b = arena_.best_fit(stream, size)) return hand_out(b, size, bytes);
    }
    const bool may_stitch = config_.stitching && size >= config_.frag_limit;
    if (may_stitch) {
      if (void* p = repair_stitch(size, bytes, stream, false)) return p;
    }
    for (int rung = 0; rung <= 2; ++rung) {
      if (may_stitch && rung >= config_.defrag_level) {
        if (void* p = stitch(size, bytes, stream, false)) return p;
      }
      if (rung == 0) {
        // Empty small-pool blocks cost nothing to take back and may merge into a fit.
        if (small_.release_free_segments(~std::size_t{0}) > 0) {
          if (block_type* b = arena_.best_fit(stream, size)) return hand_out(b, size, bytes);
        }
        // Other streams' completed free blocks, gathered until they cover the request.
        if (may_stitch && adopt(size, stream, true)) {
          if (block_type* b = arena_.best_fit(stream, size)) return hand_out(b, size, bytes);
          if (void* p = stitch(size, bytes, stream, false)) return p;
        }
        // Other streams' free blocks whose frees have not completed yet: when they alone would
        // cover the request, waiting for the device once costs less than growing by it.
        if (wait_for_other_streams(size, stream, may_stitch) && adopt(size, stream, may_stitch)) {
          if (block_type* b = arena_.best_fit(stream, size)) return hand_out(b, size, bytes);
          if (may_stitch) {
            if (void* p = stitch(size, bytes, stream, false)) return p;
          }
        }
      } else if (rung == 1) {
        if constexpr (has_events) {
          if (!pending_.empty()) {
            finish_pending_frees(true);  // deferred frees may be what is missing
            if (block_type* b = arena_.best_fit(stream, size)) return hand_out(b, size, bytes);
          }
        }
        evict_stitches(~std::size_t{0}, true);
        release_free_segments(size);
      } else {
        release_free_segments(~std::size_t{0});
      }
      if (may_stitch && config_.grow_stitch) {
        if (void* p = repair_stitch(size, bytes, stream, true)) return p;
        if (void* p = stitch(size, bytes, stream, true)) return p;
      }
      if (block_type* b = add_segment(size, stream)) return hand_out(b, size, bytes);
    }
    return nullptr;
  }

  void* hand_out(block_type* b, std::size_t size, std::size_t requested) {
    leave_free_queue(b);
    arena_.take(b, size);
    b->requested = requested;
    counters_.on_allocate(requested, size);
    return reinterpret_cast<void*>(b->address);
  }

  // Step 2: a cached stitched range whose needed chunks are all free.
  void* reuse_stitch(std::size_t size, std::size_t requested, stream_ref stream) {
    const double limit = static_cast<double>(size) * config_.reuse_limit;
    std::size_t probes = 0;
    for (auto it = cached_by_size_.lower_bound(stitch_key{stream, size}, stitch_by_size{});
         it != cached_by_size_.end() && it->stream == stream &&
         static_cast<double>(it->size) <= limit && probes < max_reuse_probes;
         ++it, ++probes) {
      stitched& s = *it;
      if (!prefix_free(s, size)) continue;
      arena_.reserve_nodes(2 * s.pieces.size());
      leave_stitch_cache(s);
      claim_prefix(s, size, requested);
      ++counters_.s.stitch_cache_hits;
      return reinterpret_cast<void*>(s.base);
    }
    return nullptr;
  }

  // Takes a cached range out of the cache to be claimed again: on its own stream, work queued
  // before its free comes before work on its new use, so its free event is no longer needed.
  void leave_stitch_cache(stitched& s) noexcept {
    cached_by_size_.erase(cached_by_size_.iterator_to(s));
    stitch_queue_.erase(s);
    counters_.s.cached_stitch_bytes -= s.size;
    if constexpr (has_events) {
      if (s.has_free_event) backend_.reserver().recycle_event(s.free_event);
      s.has_free_event = false;
    }
  }

  // Step 2, repaired or grown (before a new stitch): a cached range most of whose needed handles
  // are free. The others, taken since by blocks allocated in place, are replaced in the range by
  // free handles of the same size from elsewhere: an unmap, a map and access for each replaced
  // handle, where a new stitch maps and grants access to every handle and leaves one more range
  // cached. A range smaller than the request whose reservation has room grows in place: free
  // handles are mapped after its end (a map and access each). Only when at most half the
  // request's bytes are mapped anew, and only over a range whose work queued before its free has
  // completed when a mapped handle is replaced (appending touches no address that work could
  // use). With `may_grow`, new memory makes up for too few free handles.
  void* repair_stitch(std::size_t size, std::size_t requested, stream_ref stream, bool may_grow) {
    if (cached_by_size_.empty()) return nullptr;
    const double limit = static_cast<double>(size) * config_.reuse_limit;
    stitched* best = nullptr;
    std::size_t best_cost = size / 2 + 1;  // bytes to map anew
    const auto consider = [&](stitched& s) {
      const std::size_t grow = s.size < size ? size - s.size : 0;
      if (grow >= best_cost || s.reserved < size) return;
      const std::size_t missing = missing_bytes(s, std::min(size, s.size));
      if (missing + grow < best_cost && (missing == 0 || queue_drained(s))) {
        best = &s;
        best_cost = missing + grow;
      }
    };
    const auto from = cached_by_size_.lower_bound(stitch_key{stream, size}, stitch_by_size{});
    std::size_t probes = 0;
    for (auto it = from; it != cached_by_size_.end() && it->stream == stream &&
                         static_cast<double>(it->size) <= limit && probes < max_reuse_probes;
         ++it, ++probes) {
      consider(*it);
    }
    // Smaller ranges, largest first, while growing one would cost less than the best so far.
    probes = 0;
    for (auto it = from; it != cached_by_size_.begin() && probes < max_reuse_probes; ++probes) {
      --it;
      if (it->stream != stream || it->size + best_cost <= size) break;
      consider(*it);
    }
    return best == nullptr ? nullptr : restitch(*best, size, requested, stream, may_grow);
  }

  // Bytes of the handles mapping the first `size` bytes of `s` whose part there is not free on
  // its stream: each such handle counts whole, as it is replaced whole.
  std::size_t missing_bytes(const stitched& s, std::size_t size) noexcept {
    std::size_t need = size, missing = 0;
    for (const piece& pc : s.pieces) {
      if (need == 0) break;
      const std::size_t take = std::min(pc.size, need);
      const auto& m = pc.home->mapping;
      const std::uintptr_t begin = m.base + pc.offset, end = begin + take;
      std::size_t counted = m.count;  // the last handle counted (none yet)
      for (block_type* b = arena_.containing(begin); b != nullptr && b->address < end; b = arena_.next(b)) {
        if (!b->free || b->stream != s.stream) {
          const std::size_t from = std::max(b->address, begin) - m.base, to = std::min(b->end(), end) - m.base;
          for (std::size_t i = handle_at(m, from); i < m.count && m.slots[i].offset < to; ++i) {
            if (i != counted) missing += m.slots[i].size;
            counted = i;
          }
        }
        if (b->end() >= end) break;
      }
      need -= take;
    }
    return missing;
  }

  // The index of the handle of `m` that maps byte `offset` of it.
  static std::size_t handle_at(const typename backend_type::segment_type& m, std::size_t offset) noexcept {
    return m.first_at_or_after(offset + 1) - 1;
  }

  // Whether the work queued before `s`'s free has completed. A failed query counts as "not
  // yet", as in eviction: the request then goes on to a new stitch instead of failing.
  bool queue_drained(const stitched& s) noexcept {
    if constexpr (has_events) {
      try {
        return s.has_free_event && event_done(s.free_event);
      } catch (...) {
        return false;
      }
    } else {
      return true;
    }
  }

  // Replaces the handles of `s`'s first `size` bytes whose part there is not free by free
  // handles of `stream`, of the same size, that `s` does not map; maps more such handles (of any
  // size) after its end when `size` is larger (new memory for those missing with `may_grow`);
  // then claims the prefix. Null, with nothing changed, when there are too few; null with `s`
  // dropped when the driver fails to remap.
  void* restitch(stitched& s, std::size_t size, std::size_t requested, stream_ref stream, bool may_grow) {
    // What the range maps now, side by side (a handle appears at most once in it), each with the
    // block it lies in when (part of) it is to be claimed; a change, of its size, for each handle
    // of the first `size` bytes whose part there is not free.
    handles_.clear();
    members_.clear();
    next_.clear();
    changes_.clear();
    std::size_t at = 0;
    for_each_handle(s, [&](const piece& pc, const slot_type& h) {
      block_type* b = nullptr;
      if (at < size) {
        const std::uintptr_t address = pc.home->mapping.base + h.offset;
        b = arena_.containing(address);
        if (!(b->free && b->stream == s.stream && b->end() >= address + std::min(h.size, size - at))) {
          changes_.push_back(typename backend_type::replacement{next_.size(), slot_type{{}, 0, h.size}});
          b = nullptr;
        }
      }
      handles_.push_back(h);
      members_.emplace_back(pc.home, h.offset);
      next_.push_back(next_handle{pc.home, h.offset, h.size, b});
      at += h.size;
    });
    std::sort(members_.begin(), members_.end());
    const auto is_member = [&](const segment* home, std::size_t offset) {
      return std::binary_search(members_.begin(), members_.end(), std::pair{home, offset});
    };
    const std::size_t replaced = changes_.size();
    // Handles wanted: one of each replaced handle's size, and any to append until `size`.
    wanted_.clear();
    for (const auto& c : changes_) add_wanted(c.slot.size);
    std::size_t short_by = size > at ? size - at : 0, end = at;
    spares_.clear();
    const auto offer = [&](segment* home, const slot_type& h, block_type* b) {
      if (take_wanted(h.size)) {
        spares_.push_back(next_handle{home, h.offset, h.size, b});
      } else if (short_by > 0 && end + h.size <= s.reserved) {
        appends_.push_back(next_handle{home, h.offset, h.size, b});
        short_by -= std::min(short_by, h.size);
        end += h.size;
      }
    };
    appends_.clear();
    if (replaced > 0 || short_by > 0) {
      arena_.for_each_free_largest_first(stream, [&](block_type& b) {
        const auto& m = b.segment->mapping;
        const std::size_t begin = b.address - m.base, stop = begin + b.size;
        for (std::size_t i = m.first_at_or_after(begin); i < m.count && m.slots[i].offset + m.slots[i].size <= stop; ++i) {
          if (!is_member(b.segment, m.slots[i].offset)) offer(b.segment, m.slots[i], &b);
        }
        return wanted_left() > 0 || short_by > 0;
      });
    }
    block_type* grown = nullptr;
    if (wanted_left() > 0 || short_by > 0) {
      if (!may_grow) return nullptr;
      grown = add_segment(wanted_left() + detail::round_up(short_by, chunk_), stream);
      if (grown == nullptr) return nullptr;
      const auto& m = grown->segment->mapping;
      for (std::size_t i = 0; i < m.count; ++i) offer(grown->segment, m.slots[i], grown);
      if (wanted_left() > 0 || short_by > 0) {  // handles of other sizes than the ones replaced
        drop_segment(grown->segment);
        return nullptr;
      }
    }
    // The k-th replaced handle of a size gets the k-th spare of that size, as they were found
    // (neighbours stay neighbours). Every size has as many spares as replaced handles here.
    for (const auto& w : wanted_) {
      std::size_t k = 0;
      for (std::size_t c = 0; c < replaced; ++c) {
        if (changes_[c].slot.size != w.first) continue;
        while (spares_[k].size != w.first) ++k;
        next_[changes_[c].index] = spares_[k++];
      }
    }
    for (const next_handle& h : appends_) {
      changes_.push_back(typename backend_type::replacement{next_.size(), {}});
      next_.push_back(h);
    }
    for (auto& c : changes_) {
      const next_handle& h = next_[c.index];
      const auto& m = h.home->mapping;
      c.slot = m.slots[m.first_at_or_after(h.offset)];
    }
    // New pieces: runs of neighbouring handles of one home (and, to be claimed, of one block),
    // split where the claimed prefix ends.
    pieces_.clear();
    at = 0;
    for (std::size_t i = 0; i < next_.size(); at += next_[i].size, ++i) {
      const next_handle& h = next_[i];
      const bool joins = i > 0 && at != size && pieces_.back().home == h.home &&
                         pieces_.back().offset + pieces_.back().size == h.offset && next_[i - 1].block == h.block;
      if (joins) {
        pieces_.back().size += h.size;
      } else {
        pieces_.push_back(piece{h.home, h.offset, h.size});
      }
    }
    try {
      arena_.reserve_nodes(2 * pieces_.size());  // before anything is remapped: `s` stays cached
    } catch (...) {
      if (grown != nullptr) drop_segment(grown->segment);
      throw;
    }
    bool done = false;
    try {
      done = backend_.try_restitch(reinterpret_cast<void*>(s.base), s.reserved, handles_, changes_);
    } catch (...) {
      forget_stitch(&s);
      if (grown != nullptr) drop_segment(grown->segment);
      throw;
    }
    if (!done) {
      forget_stitch(&s);
      if (grown != nullptr) drop_segment(grown->segment);
      return nullptr;
    }
    for (const piece& pc : s.pieces) --pc.home->stitch_refs;
    for (const piece& pc : pieces_) ++pc.home->stitch_refs;
    leave_stitch_cache(s);
    s.pieces.swap(pieces_);  // the old pieces' storage is the next repair's scratch
    s.size = std::max(s.size, at);
    claim_prefix(s, size, requested);
    ++counters_.s.stitch_cache_hits;
    if (replaced > 0) ++counters_.s.stitch_repairs;
    if (changes_.size() > replaced) ++counters_.s.stitch_grows;
    return reinterpret_cast<void*>(s.base);
  }

  // Handles wanted by size, for restitch: few distinct sizes (chunk_size x 2^k).
  void add_wanted(std::size_t size) {
    for (auto& w : wanted_) {
      if (w.first == size) {
        ++w.second;
        return;
      }
    }
    wanted_.emplace_back(size, 1);
  }
  bool take_wanted(std::size_t size) noexcept {
    for (auto& w : wanted_) {
      if (w.first == size && w.second > 0) {
        --w.second;
        return true;
      }
    }
    return false;
  }
  std::size_t wanted_left() const noexcept {
    std::size_t bytes = 0;
    for (const auto& w : wanted_) bytes += w.first * w.second;
    return bytes;
  }

  // Calls f(piece, slot) for each handle `s` maps, in the range's order.
  template <class F>
  static void for_each_handle(const stitched& s, F&& f) {
    for (const piece& pc : s.pieces) {
      const auto& m = pc.home->mapping;
      for (std::size_t i = m.first_at_or_after(pc.offset); i < m.count && m.slots[i].offset < pc.offset + pc.size; ++i) {
        f(pc, m.slots[i]);
      }
    }
  }

  // The address space to reserve for a new stitched range of `size`: room to grow in place
  // (stitch_reserve).
  std::size_t reservation_for(std::size_t size) const noexcept {
    if (config_.stitch_reserve <= 1.0) return size;
    const double want = static_cast<double>(size) * config_.stitch_reserve;
    if (!(want < static_cast<double>(std::numeric_limits<std::size_t>::max() / 2))) return size;
    return std::max(size, detail::round_up(static_cast<std::size_t>(want), chunk_));
  }

  // Free on the range's own stream: a block another stream has taken over is that stream's.
  bool prefix_free(const stitched& s, std::size_t size) noexcept {
    std::size_t need = size;
    for (const piece& pc : s.pieces) {
      if (need == 0) break;
      const std::size_t take = std::min(pc.size, need);
      const std::uintptr_t at = pc.home->mapping.base + pc.offset;
      const block_type* b = arena_.containing(at);
      if (b == nullptr || !b->free || b->stream != s.stream || b->end() < at + take) return false;
      need -= take;
    }
    return need == 0;
  }

  // Claims the first `size` bytes of `s`'s pieces (all free, nodes reserved): cannot fail.
  void claim_prefix(stitched& s, std::size_t size, std::size_t requested) noexcept {
    std::size_t need = size;
    for (piece& pc : s.pieces) {
      if (need == 0) break;
      const std::size_t take = std::min(pc.size, need);
      const std::uintptr_t at = pc.home->mapping.base + pc.offset;
      block_type* b = arena_.containing(at);
      leave_free_queue(b);
      block_type* claimed = arena_.carve(b, at, take);
      claimed->owner = &s;
      pc.claimed = claimed;
      need -= take;
    }
    s.live = true;
    s.requested = requested;
    s.claimed_bytes = size;
    counters_.on_allocate(requested, size);
  }

  // Steps 3 and 4 with grow_stitch: a new stitched range over free blocks (and new memory).
  void* stitch(std::size_t size, std::size_t requested, stream_ref stream, bool may_grow) {
    candidates_.clear();
    candidate_sizes_.clear();
    arena_.for_each_free_largest_first(stream, [&](block_type& b) {
      if (const candidate c = whole_handles_of(b); c.size > 0) candidates_.push_back(c);
      return candidates_.size() < max_candidates;
    });
    if (candidates_.empty() || (!may_grow && candidates_.size() < 2)) return nullptr;
    // Blocks came largest first; their whole-handle parts need not, when handles vary in size.
    std::stable_sort(candidates_.begin(), candidates_.end(),
                     [](const candidate& a, const candidate& b) { return a.size > b.size; });
    for (const candidate& c : candidates_) candidate_sizes_.push_back(c.size);
    const stitch_request request{size, chunk_, may_grow};
    if (!strategy_.plan(request, candidate_sizes_, plan_) || !plan_is_sound(size)) return nullptr;

    // New memory first: if it cannot be had, nothing has changed yet.
    block_type* grown = nullptr;
    if (plan_.grow_bytes > 0) {
      grown = add_segment(detail::round_up(plan_.grow_bytes, chunk_), stream);
      if (grown == nullptr) return nullptr;
    }
    stitched* s = nullptr;
    try {
      s = stitches_.create();
      std::size_t need = size;
      const auto add_piece = [&](const candidate& c) {
        // Whole handles from the run's start until they cover what is still needed.
        const auto& m = c.block->segment->mapping;
        std::size_t taken = 0;
        for (std::size_t i = m.first_at_or_after(c.offset); taken < std::min(need, c.size); ++i) {
          taken += m.slots[i].size;
        }
        s->pieces.push_back(piece{c.block->segment, c.offset, taken});
        need -= std::min(need, taken);
      };
      for (std::uint32_t pick : plan_.picks) add_piece(candidates_[pick]);
      if (grown != nullptr && need > 0) add_piece(candidate{grown, 0, grown->size});
      handles_.clear();
      std::size_t mapped = 0;
      for_each_handle(*s, [&](const piece&, const slot_type& h) {
        handles_.push_back(h);
        mapped += h.size;
      });
      s->size = mapped;
      s->reserved = reservation_for(mapped);
      arena_.reserve_nodes(2 * s->pieces.size());
      void* base = backend_.try_map_stitched(handles_, s->reserved);
      if (base == nullptr && s->reserved > mapped) {
        s->reserved = mapped;  // room to grow is a nicety; the addresses may be what ran out
        base = backend_.try_map_stitched(handles_, s->reserved);
      }
      if (base == nullptr && !stitch_queue_.empty()) {
        evict_stitches(~std::size_t{0}, true);  // StitchFree: mappings may be what ran out
        base = backend_.try_map_stitched(handles_, s->reserved);
      }
      if (base == nullptr) {
        abandon_stitch(s, grown);
        return nullptr;
      }
      s->base = reinterpret_cast<std::uintptr_t>(base);
    } catch (...) {
      abandon_stitch(s, grown);
      throw;
    }
    s->stream = stream;
    for (piece& pc : s->pieces) ++pc.home->stitch_refs;
    stitch_by_address_.insert(*s);
    claim_prefix(*s, size, requested);
    ++counters_.s.stitches;
    return reinterpret_cast<void*>(s->base);
  }

  // The whole handles inside free block `b`: what a stitch may map of it.
  candidate whole_handles_of(block_type& b) const noexcept {
    const auto& m = b.segment->mapping;
    const std::size_t begin = b.address - m.base, end = begin + b.size;
    std::size_t i = m.first_at_or_after(begin), size = 0;
    const std::size_t first = i < m.count ? m.slots[i].offset : end;
    for (; i < m.count && m.slots[i].offset + m.slots[i].size <= end; ++i) size += m.slots[i].size;
    return candidate{&b, first, size};
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

  void abandon_stitch(stitched* s, block_type* grown) noexcept {
    if (s != nullptr) stitches_.destroy(s);
    if (grown != nullptr) drop_segment(grown->segment);
  }

  // A new segment of `bytes` (whole chunks) on `stream`, as one free block; null when out of memory.
  block_type* add_segment(std::size_t bytes, stream_ref stream) {
    if (detail::round_up_overflows(bytes, chunk_)) return nullptr;
    segment* s = segments_.create();
    try {
      plan_handles(bytes);
      if (!backend_.try_create_segment(handle_sizes_, s->mapping)) {
        segments_.destroy(s);
        return nullptr;
      }
    } catch (...) {
      segments_.destroy(s);
      throw;
    }
    block_type* b = nullptr;
    try {
      b = arena_.add_segment(s, s->mapping.base, s->mapping.size, stream);
    } catch (...) {
      backend_.destroy_segment(s->mapping);
      segments_.destroy(s);
      throw;
    }
    counters_.on_reserve(bytes);
    s->eviction_bytes_ = bytes;
    free_segments_.push(*s);  // invariant: queued exactly while its one block is free
    return b;
  }

  void leave_free_queue(block_type* b) noexcept {
    if (b->size == b->segment->mapping.size) free_segments_.erase(*b->segment);
  }
  void enter_free_queue(block_type* b) noexcept {
    if (b->size == b->segment->mapping.size) free_segments_.push(*b->segment);
  }

  // ------------------------------------------------------------------ small pool's source
  bool lend_to_small(std::size_t bytes, stream_ref stream, typename small_source::lease_type& out) {
    arena_.reserve_nodes(1);
    block_type* b = arena_.best_fit(stream, bytes);
    if (b == nullptr && adopt(bytes, stream, false)) b = arena_.best_fit(stream, bytes);
    if (b == nullptr) b = add_segment(bytes, stream);
    if (b == nullptr) {
      // Under pressure, cached mappings and fully free large segments make room for small ones.
      evict_stitches(~std::size_t{0}, true);
      if (release_free_segments(bytes) > 0) b = add_segment(bytes, stream);
    }
    if (b == nullptr) return false;
    leave_free_queue(b);
    arena_.take(b, bytes);
    b->owner = &small_;
    out.base = b->address;
    out.size = bytes;
    return true;
  }

  void return_from_small(typename small_source::lease_type& lease) noexcept {
    block_type* b = arena_.find(lease.base);
    enter_free_queue(arena_.give_back(b, mark_free(b->stream)));
  }

  // ------------------------------------------------------------------ deallocation
  void deallocate_locked(void* p, std::size_t bytes, stream_ref stream) {
    if (p == nullptr) return;
    if constexpr (has_events) {
      if (!pending_.empty() || !extra_uses_.empty()) {
        if (defer_free(p, bytes, stream)) return;
      }
    }
    free_now(p, bytes, stream);
    if constexpr (has_events) {
      if (clocks_.size() > 1) tick(stream);
    }
  }

  // Frees an allocation used on other streams later, once events on them have completed. True
  // when deferred. Misuse is diagnosed now, not when the deferred free runs.
  bool defer_free(void* p, std::size_t bytes, stream_ref stream) {
    for (const pending_free& f : pending_) {
      if (f.p == p) detail::throw_not_live(name, p, true);  // freed already, still pending
    }
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    const auto first = std::partition(extra_uses_.begin(), extra_uses_.end(),
                                      [address](const auto& use) { return use.first != address; });
    if (first == extra_uses_.end()) return false;
    if (!owns_unlocked(p)) detail::throw_not_live(name, p, false);
    if (const std::size_t expected = requested_of(p); expected != bytes) {
      detail::throw_size_mismatch(name, p, bytes, expected);
    }
    pending_free pending{p, bytes, stream, {}};
    pending.events.reserve(static_cast<std::size_t>(extra_uses_.end() - first));
    pending_.reserve(pending_.size() + 1);
    try {
      for (auto it = first; it != extra_uses_.end(); ++it) {
        if (it->second != stream) pending.events.emplace_back(it->second, record_event(it->second));
      }
    } catch (...) {
      for (const auto& [s, e] : pending.events) backend_.reserver().recycle_event(e);
      throw;  // nothing freed; the uses stay recorded
    }
    extra_uses_.erase(first, extra_uses_.end());
    pending_.push_back(std::move(pending));
    return true;
  }

  // Runs the deferred frees whose events have completed, oldest first (all of them, waiting, when
  // `wait`). Events on one stream complete in the order they were recorded, so once one is found
  // pending, later ones on that stream are not asked: a call costs one query per completed event
  // and at most one more per stream, however many frees wait.
  void finish_pending_frees(bool wait) noexcept {
    if constexpr (has_events) {
      std::array<stream_ref, 8> blocked{};  // streams with an event found pending in this call
      std::size_t blocked_count = 0;
      const auto is_blocked = [&](stream_ref s) {
        return std::find(blocked.begin(), blocked.begin() + blocked_count, s) != blocked.begin() + blocked_count;
      };
      std::size_t kept = 0;
      for (std::size_t i = 0; i < pending_.size(); ++i) {
        pending_free& f = pending_[i];
        bool done = true;
        if (!wait) {
          for (const auto& [s, e] : f.events) {
            bool complete = false;
            if (!is_blocked(s)) {
              try {
                complete = event_done(e);
              } catch (...) {
                complete = false;
              }
            }
            if (!complete) {
              if (!is_blocked(s) && blocked_count < blocked.size()) blocked[blocked_count++] = s;
              done = false;
              break;
            }
          }
        }
        if (!done) {
          if (kept != i) pending_[kept] = std::move(f);
          ++kept;
          continue;
        }
        for (const auto& [s, e] : f.events) {
          if (wait) wait_for(e);
          backend_.reserver().recycle_event(e);
        }
        try {
          free_now(f.p, f.bytes, f.stream);
        } catch (...) {
          // Checked when deferred; nothing left to report to.
        }
      }
      pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(kept), pending_.end());
    }
  }

  std::size_t requested_of(const void* p) {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    if (const block_type* b = arena_.find(address); b != nullptr && !b->free && b->owner == nullptr) return b->requested;
    auto it = stitch_by_address_.find(address, stitch_by_address{});
    if (it != stitch_by_address_.end() && it->live) return it->requested;
    return small_.requested_of(p);
  }

  void free_now(void* p, std::size_t bytes, stream_ref stream) {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    if (bytes != 0 && bytes <= config_.small_limit) {
      // The small pool checks the size itself and throws on a mismatch.
      if (small_.deallocate_if_owned(p, bytes, stream)) {
        counters_.on_deallocate(bytes, detail::round_up(bytes, config_.round_to));
        return;
      }
    }
    if (block_type* b = arena_.find(address); b != nullptr && !b->free && b->owner == nullptr) {
#if GLAKE_CHECKED
      if (b->requested != bytes) detail::throw_size_mismatch(name, p, bytes, b->requested);
#endif
      counters_.on_deallocate(b->requested, b->size);
      enter_free_queue(arena_.give_back(b, mark_free(b->stream)));
      return;
    }
    auto it = stitch_by_address_.find(address, stitch_by_address{});
    if (it != stitch_by_address_.end() && it->live) {
#if GLAKE_CHECKED
      if (it->requested != bytes) detail::throw_size_mismatch(name, p, bytes, it->requested);
#endif
      release_stitch(*it);
      return;
    }
    diagnose_bad_free(p, bytes, stream, it != stitch_by_address_.end());
  }

  [[noreturn]] void diagnose_bad_free(void* p, std::size_t bytes, stream_ref stream, bool cached_stitch) {
    // A small allocation freed with a large size: the small pool names the mismatch.
    if (bytes > config_.small_limit && small_.deallocate_if_owned(p, bytes, stream)) {
      throw std::logic_error("glake::stitching_allocator: unreachable");
    }
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    const block_type* c = arena_.containing(address);
    detail::throw_not_live(name, p,
                           cached_stitch || (c != nullptr && c->free) || small_.inside_free_block(p));
  }

  void release_stitch(stitched& s) noexcept {
    const std::uint64_t mark = mark_free(s.stream);
    for (piece& pc : s.pieces) {
      if (pc.claimed == nullptr) continue;
      enter_free_queue(arena_.give_back(pc.claimed, mark));
      pc.claimed = nullptr;
    }
    counters_.on_deallocate(s.requested, s.claimed_bytes);
    s.live = false;
    s.requested = 0;
    s.claimed_bytes = 0;
    s.eviction_bytes_ = s.size;
    if constexpr (has_events) {
      // Work queued on the stream may still use the range: evict it only once this completes.
      try {
        s.free_event = record_event(s.stream);
        s.has_free_event = true;
      } catch (...) {
        s.has_free_event = false;  // eviction will synchronize the stream instead
      }
    }
    cached_by_size_.insert(s);
    stitch_queue_.push(s);
    counters_.s.cached_stitch_bytes += s.size;
    if (counters_.s.cached_stitch_bytes > config_.auto_gc) {
      evict_stitches(counters_.s.cached_stitch_bytes - config_.auto_gc, false);
    }
  }

  // ------------------------------------------------------------------ streams
  // The mark for a free on `stream` now (see stream_clock); 0 without events.
  std::uint64_t mark_free(stream_ref stream) noexcept {
    if constexpr (has_events) {
      stream_clock* c = clock_of(stream);
      if (c == nullptr) return ~std::uint64_t{0};  // unknown stream: moves only after a synchronize
      c->dirty = true;
      return c->next;
    } else {
      return 0;
    }
  }

  stream_clock* clock_of(stream_ref stream) noexcept {
    for (stream_clock& c : clocks_) {
      if (c.stream == stream) return &c;
    }
    return nullptr;
  }

  // An allocation on a stream other than the last one: the frees other streams made since their
  // last event get one now, so that by the time memory is short they have likely completed.
  // A call on a stream it has not seen last: the stream gets a clock (so that its frees can be
  // marked) if it has none.
  void enter_stream(stream_ref stream) {
    if (clock_of(stream) == nullptr) {
      stream_clock c;
      c.stream = stream;
      clocks_.push_back(std::move(c));
    }
    current_stream_ = stream;
  }

  // During a call on `stream` (so it is alive): records an event for its frees that have none,
  // unless an earlier one is pending and was recorded less than event_interval_us ago (then a
  // later call records it), after polling the stream's pending ones. So a stream costs at most
  // one record and one round of queries per interval (1 ms by default), however many calls.
  void tick([[maybe_unused]] stream_ref stream) noexcept {
    if constexpr (has_events) {
      stream_clock* c = clock_of(stream);
      if (c == nullptr || !c->dirty) return;
      const auto now = std::chrono::steady_clock::now();
      if (!c->in_flight.empty() && now - c->recorded < std::chrono::microseconds{config_.event_interval_us}) return;
      poll(*c);
      try {
        const event_type e = record_event(c->stream);
        try {
          c->in_flight.emplace_back(c->next, e);
          ++c->next;
          c->dirty = false;
          c->recorded = now;
        } catch (...) {
          backend_.reserver().recycle_event(e);
        }
      } catch (...) {
        // Not recorded: those frees stay with their stream until a later call records one.
      }
    }
  }

  // Advances `done` past `c`'s completed events. Events outlive their stream, so this is safe
  // for any stream.
  void poll([[maybe_unused]] stream_clock& c) noexcept {
    if constexpr (has_events) {
      while (!c.in_flight.empty()) {
        bool complete = false;
        try {
          complete = event_done(c.in_flight.front().second);
        } catch (...) {
          complete = false;
        }
        if (!complete) break;
        retire_oldest(c);
      }
    }
  }

  // `c`'s oldest event has completed: every mark up to its mark has.
  void retire_oldest(stream_clock& c) noexcept {
    c.done = c.in_flight.front().first;
    backend_.reserver().recycle_event(c.in_flight.front().second);
    c.in_flight.pop_front();
  }

  // Every event record and query goes through these: counted and timed in statistics.
  event_type record_event(stream_ref stream) {
    ++counters_.s.events_recorded;
    const detail::stopwatch watch{counters_.s.event_ns};
    return backend_.reserver().record_event(stream);
  }
  bool event_done(const event_type& e) {
    ++counters_.s.event_queries;
    const detail::stopwatch watch{counters_.s.event_ns};
    return backend_.reserver().event_done(e);
  }

  // The only places the host blocks on the device; each counts in statistics::device_waits.
  void wait_for(const event_type& e) noexcept {
    ++counters_.s.device_waits;
    backend_.reserver().wait_event(e);
  }
  void synchronize_device() noexcept {
    ++counters_.s.device_waits;
    backend_.reserver().synchronize_device();
  }

  // The device is synchronized: every free so far has completed.
  void synchronize_all() noexcept {
    if constexpr (has_events) {
      synchronize_device();
      for (stream_clock& c : clocks_) {
        for (const auto& [mark, e] : c.in_flight) backend_.reserver().recycle_event(e);
        c.in_flight.clear();
        c.done = c.next;
        ++c.next;
        c.dirty = false;
      }
    }
  }

  bool completed([[maybe_unused]] const block_type& b) noexcept {
    if constexpr (has_events) {
      const stream_clock* c = clock_of(b.stream);
      return c != nullptr && b.free_mark <= c->done;
    } else {
      return true;
    }
  }

  // Moves other streams' completed free blocks to `stream`: the best fit for `size` when one
  // block will do; else, when `gather`, the largest until their whole handles cover `size`.
  // True when anything moved.
  bool adopt(std::size_t size, stream_ref stream, bool gather) noexcept {
    if (clocks_.size() < 2) return false;
    block_type* best = nullptr;
    for (stream_clock& c : clocks_) {
      if (c.stream == stream) continue;
      poll(c);
      block_type* b = arena_.best_fit_if(c.stream, size, max_reuse_probes,
                                         [&](const block_type& x) { return completed(x); });
      if (b != nullptr && (best == nullptr || b->size < best->size)) best = b;
    }
    if (best != nullptr) {
      move_to(best, stream);
      return true;
    }
    if (!gather) return false;
    adoptable_.clear();
    for (stream_clock& c : clocks_) {
      if (c.stream == stream) continue;
      arena_.for_each_free_largest_first(c.stream, [&](block_type& b) {
        if (completed(b) && whole_handles_of(b).size > 0) adoptable_.push_back(&b);
        return adoptable_.size() < adoptable_.capacity();
      });
    }
    std::stable_sort(adoptable_.begin(), adoptable_.end(),
                     [](const block_type* a, const block_type* b) { return a->size > b->size; });
    std::size_t covered = 0;
    for (block_type* b : adoptable_) {
      if (covered >= size) break;
      covered += whole_handles_of(*b).size;
      move_to(b, stream);
    }
    return covered > 0;
  }

  // Waits when free blocks of streams other than `stream` whose frees have not completed would
  // serve `size`: one such block, or with `gather` their whole handles together. It waits for
  // the events of just those streams, up to the newest free it needs on each, so the host blocks
  // only until that work is done, not until the device has run everything queued; it
  // synchronizes the device instead when a needed free has no event yet. True if it waited.
  bool wait_for_other_streams([[maybe_unused]] std::size_t size, [[maybe_unused]] stream_ref stream,
                              [[maybe_unused]] bool gather) noexcept {
    if constexpr (has_events) {
      if (clocks_.size() < 2) return false;
      bool enough = false;
      std::size_t pending = 0;
      for (stream_clock& c : clocks_) c.wanted = 0;
      for (stream_clock& c : clocks_) {
        if (c.stream == stream) continue;
        arena_.for_each_free_largest_first(c.stream, [&](block_type& b) {
          if (!gather && b.size < size) return false;  // largest first: none further will do
          if (!completed(b)) {
            pending += gather ? whole_handles_of(b).size : b.size;
            enough = gather ? pending >= size : true;
            c.wanted = std::max(c.wanted, b.free_mark);
          }
          return !enough;
        });
        if (enough) break;
      }
      if (!enough) return false;
      // Every needed mark must have an event recorded for it (marks are recorded in order).
      bool recorded = true;
      for (const stream_clock& c : clocks_) {
        if (c.wanted != 0 && (c.in_flight.empty() || c.in_flight.back().first < c.wanted)) recorded = false;
      }
      if (!recorded) {
        synchronize_all();
        return true;
      }
      for (stream_clock& c : clocks_) {
        if (c.wanted == 0 || c.wanted <= c.done) continue;
        auto it = c.in_flight.begin();
        while (it->first < c.wanted) ++it;
        wait_for(it->second);
        // The stream ran in order: that event's work and every earlier one's are done.
        const std::uint64_t through = it->first;
        while (!c.in_flight.empty() && c.in_flight.front().first <= through) retire_oldest(c);
      }
      return true;
    } else {
      return false;
    }
  }

  void move_to(block_type* b, stream_ref stream) noexcept {
    const bool was_whole = b->size == b->segment->mapping.size;
    counters_.s.cross_stream_bytes += b->size;
    block_type* merged = arena_.restream(b, stream);
    if (!was_whole) enter_free_queue(merged);
    mixed_streams_ = true;
  }

  // Merges free neighbours of different streams (left by moves) so that fully free segments are
  // whole blocks again; synchronizes the device first when events exist. True if it did.
  bool merge_across_streams() noexcept {
    bool synchronized = false;
    block_type* b = arena_.first();
    while (b != nullptr) {
      block_type* n = arena_.next(b);
      if (n != nullptr && b->free && n->free && n->segment == b->segment && n->stream != b->stream) {
        if (has_events && !synchronized) {
          synchronize_all();
          synchronized = true;
        }
        b = arena_.restream(n, b->stream);  // merges into b, which stays the block at b's address
        enter_free_queue(b);
        continue;
      }
      b = n;
    }
    return synchronized;
  }

  // ------------------------------------------------------------------ eviction
  // Drops cached stitched ranges in Evict order until `bytes` of them are gone.
  // Without `wait`, stops at the first range whose free event has not completed (GMLake's
  // StitchFree); with it, waits for that stream instead.
  std::size_t evict_stitches(std::size_t bytes, bool wait) noexcept {
    std::size_t dropped = 0;
    while (dropped < bytes) {
      stitched* s = stitch_queue_.victim();
      if (s == nullptr) break;
      if constexpr (has_events) {
        bool done = false;
        try {
          done = s->has_free_event && event_done(s->free_event);
        } catch (...) {
          done = false;
        }
        if (!done) {
          if (!wait) break;
          if (s->has_free_event) {
            wait_for(s->free_event);
          } else {
            synchronize_device();
          }
        }
      }
      dropped += s->size;
      drop_stitch(s);
    }
    return dropped;
  }

  void drop_stitch(stitched* s) noexcept {
    unmap_stitch(*s);
    forget_stitch(s);
  }

  // A cached range's bookkeeping, once its mappings are gone.
  void forget_stitch(stitched* s) noexcept {
    if constexpr (has_events) {
      if (s->has_free_event) backend_.reserver().recycle_event(s->free_event);
    }
    stitch_queue_.erase(*s);
    cached_by_size_.erase(cached_by_size_.iterator_to(*s));
    stitch_by_address_.erase(stitch_by_address_.iterator_to(*s));
    counters_.s.cached_stitch_bytes -= s->size;
    for (piece& pc : s->pieces) --pc.home->stitch_refs;
    ++counters_.s.stitch_evictions;
    stitches_.destroy(s);
  }

  // Unmaps every handle of a stitched range and frees its addresses; its memory stays home.
  void unmap_stitch(const stitched& s) noexcept {
    std::size_t at = 0;
    for_each_handle(s, [&](const piece&, const slot_type& h) {
      backend_.unmap_stitched(reinterpret_cast<void*>(s.base + at), h.size);
      at += h.size;
    });
    backend_.free_stitched(reinterpret_cast<void*>(s.base), s.reserved);
  }

  // Gives fully free segments back to the backend in Evict order until `bytes` are released.
  // A segment still mapped by a live stitched range stays; cached ranges mapping it are dropped.
  std::size_t release_free_segments(std::size_t bytes) noexcept {
    std::size_t released = 0;
    [[maybe_unused]] bool synchronized = mixed_streams_ && merge_across_streams();
    pinned_.clear();
    while (released < bytes) {
      segment* victim = free_segments_.victim();
      if (victim == nullptr) break;
      if (victim->stitch_refs > 0) drop_cached_stitches_over(victim);
      if (victim->stitch_refs > 0) {
        free_segments_.erase(*victim);
        if (pinned_.size() == pinned_.capacity()) break;  // no room to remember it: stop here
        pinned_.push_back(victim);
        continue;
      }
      if constexpr (has_events) {
        // Never release memory that queued work may still read. Its stream may be gone, so wait
        // for the device, once per call: this is the memory-pressure path, as in PyTorch.
        if (!synchronized) synchronize_all();
        synchronized = true;
      }
      released += victim->mapping.size;
      drop_segment(victim);
    }
    for (segment* s : pinned_) free_segments_.push(*s);
    pinned_.clear();
    return released;
  }

  void drop_cached_stitches_over(segment* home) noexcept {
    for (auto it = stitch_by_address_.begin(); it != stitch_by_address_.end();) {
      stitched& s = *it++;
      if (s.live) continue;
      for (const piece& pc : s.pieces) {
        if (pc.home == home) {
          drop_stitch(&s);
          break;
        }
      }
    }
  }

  void drop_segment(segment* s) noexcept {
    block_type* b = arena_.find(s->mapping.base);
    free_segments_.erase(*s);
    arena_.remove_segment(b);
    counters_.on_unreserve(s->mapping.size);
    backend_.destroy_segment(s->mapping);
    segments_.destroy(s);
  }

  void release_everything() noexcept {
    if constexpr (has_events) {
      finish_pending_frees(true);
      synchronize_all();
      for (stitched& st : stitch_by_address_) {
        if (st.has_free_event) backend_.reserver().recycle_event(st.free_event);
        st.has_free_event = false;
      }
    }
    while (!stitch_by_address_.empty()) {
      stitched& s = *stitch_by_address_.begin();
      if (!s.live) {
        drop_stitch(&s);
        continue;
      }
      // A live stitch at destruction is the caller's leak; unmap it all the same.
      stitch_by_address_.erase(stitch_by_address_.iterator_to(s));
      unmap_stitch(s);
      stitches_.destroy(&s);
    }
    small_.release_free_segments(~std::size_t{0});
    std::vector<segment*> all;
    try {
      arena_.for_each_block([&](const block_type& b) {
        if (b.address == b.segment->mapping.base) all.push_back(b.segment);
      });
    } catch (...) {
      return;  // out of host memory while tearing down: leak rather than crash
    }
    for (segment* s : all) backend_.destroy_segment(s->mapping);
  }

  // ------------------------------------------------------------------ reporting
  std::size_t largest_free_block() const {
    std::size_t largest = 0;
    arena_.for_each_block([&](const block_type& b) {
      if (b.free) largest = std::max(largest, b.size);
    });
    return largest;
  }

  statistics stats_locked() const {
    statistics s = counters_.s;
    const statistics small = small_.stats_unlocked();
    s.splits = arena_.splits() + small.splits;
    s.merges = arena_.merges() + small.merges;
    s.driver_calls = backend_.calls();
    s.driver_time = backend_.call_times();
    return s;
  }

  void verify_locked() const {
    const auto fail = [](const std::string& what) {
      throw std::logic_error("glake::stitching_allocator invariant broken: " + what);
    };
    small_.verify_unlocked();
    std::size_t active = small_.stats_unlocked().active_bytes, free_bytes = 0, reserved = 0,
                free_segments = 0, small_blocks = 0, claimed_blocks = 0;
    const auto extent = [](const segment& s) { return std::pair{s.mapping.base, s.mapping.size}; };
    arena_.check_tiling(extent, fail, [&](const block_type& b) {
      const auto& m = b.segment->mapping;
      if (b.size == 0 || b.size % chunk_ != 0 || (b.address - m.base) % chunk_ != 0) {
        fail("block not made of whole chunks");
      }
      if (b.address == m.base) reserved += m.size;
      if (b.free) {
        free_bytes += b.size;
        if (b.size == m.size) ++free_segments;
      } else if (b.owner == nullptr) {
        active += b.requested;
      } else if (b.owner == static_cast<const void*>(&small_)) {
        ++small_blocks;
      } else {
        const auto* s = static_cast<const stitched*>(b.owner);
        bool found = false;
        for (const piece& pc : s->pieces) found |= pc.claimed == &b;
        if (!s->live || !found) fail("a block claimed by a stitch that does not hold it");
        ++claimed_blocks;
      }
    });
    std::size_t cached_bytes = 0, cached = 0, claimed_pieces = 0;
    std::vector<std::pair<const segment*, std::size_t>> refs;
    for (const stitched& s : stitch_by_address_) {
      std::size_t mapped = 0;
      for (const piece& pc : s.pieces) {
        mapped += pc.size;
        auto r = std::find_if(refs.begin(), refs.end(), [&](const auto& e) { return e.first == pc.home; });
        if (r == refs.end()) {
          refs.emplace_back(pc.home, 1);
        } else {
          ++r->second;
        }
        if (pc.claimed != nullptr) {
          ++claimed_pieces;
          if (!s.live) fail("a cached stitch still claims a block");
          const std::uintptr_t at = pc.home->mapping.base + pc.offset;
          if (pc.claimed->address != at || pc.claimed->owner != &s || pc.claimed->free) {
            fail("a stitch's claimed block does not match its piece");
          }
        }
      }
      if (mapped != s.size) fail("a stitch's pieces do not add up to its size");
      if (s.reserved < s.size) fail("a stitch maps more than it reserved");
      if (s.live) {
        active += s.requested;
      } else {
        ++cached;
        cached_bytes += s.size;
      }
    }
    for (const auto& [home, count] : refs) {
      if (home->stitch_refs != count) fail("a segment's stitch reference count is wrong");
    }
    if (claimed_pieces != claimed_blocks) fail("claimed blocks and claimed pieces disagree");
    if (cached != cached_by_size_.size() || cached != stitch_queue_.size()) {
      fail("cached stitch indexes disagree");
    }
    if (cached_bytes != counters_.s.cached_stitch_bytes) fail("cached stitch bytes disagree");
    if (active != counters_.s.active_bytes) fail("active bytes disagree with live allocations");
    if (free_bytes != arena_.free_bytes()) fail("free bytes disagree with free blocks");
    if (reserved != counters_.s.reserved_bytes || reserved != backend_.physical_bytes()) {
      fail("reserved bytes disagree with segments");
    }
    if (free_segments != free_segments_.size()) fail("free segment queue disagrees with free segments");
    if (small_blocks * config_.small_segment != small_.stats_unlocked().reserved_bytes) {
      fail("small pool's segments disagree with blocks lent to it");
    }
  }

  static constexpr const char* name = "glake::stitching_allocator";

  config config_;
  backend_type backend_;
  std::size_t chunk_;
  std::size_t max_handle_;
  arena_type arena_;
  detail::node_pool<segment> segments_;
  detail::node_pool<stitched> stitches_;
  typename Evict::template queue<segment> free_segments_;
  typename Evict::template queue<stitched> stitch_queue_;
  stitch_address_set stitch_by_address_;
  stitch_size_set cached_by_size_;
  small_pool small_;
  [[no_unique_address]] Stitch strategy_;
  detail::usage_counters counters_;
  // Scratch buffers reused across calls so that stitching does not allocate once warm.
  std::vector<candidate> candidates_;
  std::vector<std::size_t> candidate_sizes_;
  stitch_plan plan_;
  std::vector<slot_type> handles_;
  // Scratch for restitch.
  struct next_handle {
    segment* home;
    std::size_t offset;
    std::size_t size;
    block_type* block;  ///< the free block it lies in, when it is to be claimed
  };
  std::vector<std::pair<const segment*, std::size_t>> members_;
  std::vector<next_handle> next_;
  std::vector<next_handle> spares_;   // replacements, in the order found
  std::vector<next_handle> appends_;  // mapped after the range's end
  std::vector<std::pair<std::size_t, std::size_t>> wanted_;  // (handle size, count) still to find
  std::vector<piece> pieces_;
  std::vector<typename backend_type::replacement> changes_;
  std::vector<std::size_t> handle_sizes_;
  std::vector<segment*> pinned_;  // segments a live stitch keeps from release (bounded)
  std::vector<std::pair<std::uintptr_t, stream_ref>> extra_uses_;  // record_stream, live allocations
  std::vector<pending_free> pending_;
  std::vector<stream_clock> clocks_;      // every stream that has allocated here
  stream_ref current_stream_{};           // of the last allocation
  bool mixed_streams_ = false;            // free blocks have moved between streams
  std::vector<block_type*> adoptable_;    // scratch for adopt
  [[no_unique_address]] mutable Lock lock_;
};

}  // namespace glake
