// The stitching allocator: GMLake's virtual memory stitching. Free physical chunks of several
// blocks are mapped side by side into a fresh virtual range to serve a request no single free
// block can; stitched ranges are cached for reuse and dropped by an eviction policy.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "glake/allocators/borrowed_segment_source.hpp"
#include "glake/allocators/caching_allocator.hpp"
#include "glake/backends/concepts.hpp"
#include "glake/config.hpp"
#include "glake/allocators/concepts.hpp"
#include "glake/detail/accounting.hpp"
#include "glake/detail/archetypes.hpp"
#include "glake/allocators/stitching/allocation_ladder.hpp"
#include "glake/allocators/stitching/deferred_frees.hpp"
#include "glake/allocators/stitching/segment_pool.hpp"
#include "glake/allocators/stitching/segment_release.hpp"
#include "glake/allocators/stitching/stitcher.hpp"
#include "glake/allocators/stitching/stitching_offload.hpp"
#include "glake/allocators/stitching/stream_adoption.hpp"
#include "glake/allocators/stitching/stream_clocks.hpp"
#include "glake/memory_state.hpp"
#include "glake/movers/allocation_mover.hpp"
#include "glake/movers/concepts.hpp"
#include "glake/movers/far_memory.hpp"
#include "glake/policies/admission.hpp"
#include "glake/policies/eviction.hpp"
#include "glake/policies/growth.hpp"
#include "glake/policies/locking.hpp"
#include "glake/policies/stitching.hpp"
#include "glake/statistics.hpp"
#include "glake/stream.hpp"

namespace glake {

/// Physical memory comes in handles (Growth decides their sizes) mapped back to back into a
/// segment's own range; blocks are pieces of a segment, split at `config::large_round_to`. A
/// request above `small_limit` is served by the first rung of a ladder that succeeds: free block,
/// cached stitch, other streams, repair, then three rungs that reclaim more and more
/// (stitching/allocation_ladder.hpp lists them; docs/stitching.md explains each). Admission
/// decides whether and when to stitch, reuse or repair; Stitch which free blocks a new stitch
/// maps; Growth the handle sizes; Evict which cached range or free segment goes first. Requests up
/// to `small_limit` go to a small pool (a caching_allocator) over borrowed blocks of this pool.
/// A stitched range also stays mapped in its home segments: cached ranges cost address space and
/// mappings, not memory. Statistics count physical memory once.
///
/// Complexity: the cached steps are O(log n); a stitch costs O(k log n) for k pieces plus one map
/// per handle. No heap allocation on the cached path once warm.
/// Thread safety: as the Lock policy; one lock per public call (`no_lock`: one thread only).
/// Streams: blocks and stitches belong to a stream; other streams take them once the work queued
/// before their free has completed (docs/streams.md). Memory is unmapped or released only once
/// the work that may use it has completed.
/// Errors: allocate throws out_of_memory (state unchanged, allocator usable); try_allocate returns
/// null; misuse throws usage_error; a backend failure throws its error after a full rollback.
/// Observation: visit_state (under the lock); a memory_observer hears of segments added and given
/// back, of stitched ranges while they hold an allocation, and of each free once its memory is
/// reusable. retain_memory(true) keeps every mapping and every byte (a CUDA graph's pool).
/// Offload: with far memory attached, offload(p) / prefetch(p) move a live large allocation's
/// whole handles to far memory and back, the pointer unchanged: offload_ (stitching_offload)
/// finds and checks them, mover_ (allocation_mover) moves them (docs/offload.md).
template <physical_provider Provider, address_reserver_for<Provider> Reserver,
          stitching_strategy Stitch = best_fit_tail_stitching, eviction_policy Evict = lru_eviction,
          lock_policy Lock = no_lock, stitch_admission Admission = gmlake_admission,
          growth_policy Growth = power_of_two_growth>
class stitching_allocator {
  using pool_type = detail::segment_pool<Provider, Reserver, Growth, Evict>;
  using segment = typename pool_type::segment;
  using block_type = typename pool_type::block_type;
  using events_type = typename detail::events_of<Reserver>::type;
  using clocks_type = detail::stream_clocks<events_type>;
  static constexpr bool has_events = clocks_type::has_events;
  /// Whether this composition can stitch at all; if not, no stitcher (nor its cache) is built.
  static constexpr bool stitches = Admission::enabled && !never_stitches<Stitch>;
  using stitcher_type = std::conditional_t<stitches, detail::stitcher<pool_type, clocks_type, Stitch, Evict, Admission>,
                                           detail::no_stitcher>;
  using stitched = typename detail::stitcher<pool_type, clocks_type, Stitch, Evict, Admission>::range;
  using deferred_type =
      std::conditional_t<has_events, detail::deferred_frees<events_type>, detail::no_deferred_frees>;
  using adoption_type = detail::stream_adoption<typename pool_type::arena_type, clocks_type>;

  // The small pool borrows its segments from the large pool.
  struct small_lender {
    stitching_allocator* parent;
    std::size_t lending_granularity() const noexcept { return parent->pool_.chunk(); }
    bool lend(std::size_t bytes, stream_ref stream, std::uintptr_t& base) {
      return parent->ladder_.lend(bytes, stream, &parent->small_, base);
    }
    void take_back(std::uintptr_t base) noexcept { parent->take_back(base); }
  };
  using small_pool = caching_allocator<borrowed_segment_source<small_lender>, no_lock, Evict>;

  // The mover calls back into this allocator only through this (mover_host).
  struct mover_link {
    using backend_type = std::remove_reference_t<decltype(std::declval<pool_type&>().backend())>;
    using events_type = typename detail::events_of<Reserver>::type;
    stitching_allocator* parent;
    backend_type& backend() noexcept { return parent->pool_.backend(); }
    events_type& events() noexcept { return parent->clocks_.events(); }
    detail::usage_counters& counters() noexcept { return parent->counters_; }
    // Device memory this allocator caches makes room for `bytes` coming back; whether any went.
    bool make_room(std::size_t bytes) {
      parent->release_.evict(~std::size_t{0}, true);
      parent->small_.release_free_segments(~std::size_t{0});
      return parent->release_.release(bytes, true) > 0;
    }
    bool retained() noexcept { return parent->release_.retained(); }
    void release_parked(std::uintptr_t address) noexcept { parent->offload_.release_parked(address); }
  };
  static_assert(mover_host<mover_link>);
  using mover_type = allocation_mover<mover_link, typename pool_type::slot_type>;
  using release_type = detail::segment_release<pool_type, clocks_type, adoption_type, stitcher_type, mover_type>;
  static_assert(detail::segment_releasing<release_type>);

  // The ladder's rungs that reclaim what this allocator owns beside it (ladder_host).
  struct ladder_link {
    stitching_allocator* parent;
    bool reclaim_small() noexcept { return parent->small_.release_free_segments(~std::size_t{0}) > 0; }
    bool finish_deferred() noexcept {
      if constexpr (has_events) {
        if (parent->deferred_.pending()) {
          parent->finish_deferred(true);
          return true;
        }
      }
      return false;
    }
    void finish_moves() noexcept {
      if constexpr (has_events) {
        if (parent->mover_.any_pending()) parent->mover_.complete_ready(true);
      }
    }
    bool moving() const noexcept { return parent->mover_.busy() != 0; }
  };
  using ladder_type = detail::allocation_ladder<pool_type, clocks_type, stitcher_type, Admission, adoption_type,
                                                release_type, ladder_link>;
  static_assert(detail::allocation_laddering<ladder_type>);

  // What offload asks of this allocator beside the parts it is built over (offload_host).
  struct offload_link {
    stitching_allocator* parent;
    bool small_owns(const void* p) { return parent->small_.owns(p); }
    std::size_t small_limit() noexcept { return parent->config_.small_limit; }
    bool retained() noexcept { return parent->release_.retained(); }
    void tell(memory_action act, std::uintptr_t address, std::size_t size, stream_ref stream) noexcept {
      parent->tell(act, address, size, stream);
    }
  };
  using offload_type = detail::stitching_offload<pool_type, clocks_type, stitcher_type, stitched, deferred_type,
                                                 mover_type, offload_link>;
  static_assert(detail::allocation_offloading<offload_type>);

  static constexpr std::size_t max_candidates = 1024;
  static constexpr std::size_t max_reuse_probes = 32;
  static constexpr const char* name = "glake::stitching_allocator";

 public:
  using provider_type = Provider;
  using reserver_type = Reserver;

  stitching_allocator(Provider provider, Reserver reserver, config cfg = {});
  stitching_allocator(const stitching_allocator&) = delete;
  stitching_allocator& operator=(const stitching_allocator&) = delete;
  /// Gives every segment back, live allocations or not, and tells the live_report of live ones.
  ~stitching_allocator();

  /// At least `bytes` bytes on `stream`: aligned to `round_to` for small requests and to
  /// `large_round_to` (at least `round_to`) for large ones. Zero bytes gives null.
  void* allocate(std::size_t bytes, stream_ref stream = default_stream);

  /// As allocate, but null when out of memory.
  void* try_allocate(std::size_t bytes, stream_ref stream = default_stream);

  /// Returns memory. `bytes` must be the size given to allocate. Null is ignored.
  void deallocate(void* p, std::size_t bytes, stream_ref stream = default_stream);

  /// The allocation at `p` is also used by work on `stream` (PyTorch's record_stream): when it is
  /// freed, its memory is reused only after the work queued on `stream` by then has completed.
  /// Backends without events need nothing of this. Throws usage_error for a pointer not live here.
  void record_stream(void* p, stream_ref stream) {
    std::lock_guard guard(lock_);
    if (!owns_unlocked(p)) detail::throw_record_stream_not_live(name, p);
    if constexpr (has_events) deferred_.record_use(p, stream);
  }

  /// Drops every cached stitched mapping and gives every fully free segment back to the backend
  /// (PyTorch's empty_cache), and the far memory kept for offloads; while memory is retained,
  /// only finishes deferred frees.
  void release_cached() {
    std::lock_guard guard(lock_);
    release_cached_locked();
  }

  /// Gives spare handles (config::move_spares), then fully free segments back until at least
  /// `bytes` went back, or none is left; returns the bytes that went (memory moving in from
  /// elsewhere takes their place). While retaining memory, only the spares go.
  std::size_t release_cached(std::size_t bytes) {
    std::lock_guard guard(lock_);
    mover_.complete_ready(true);
    finish_deferred(true);
    std::size_t released = pool_.backend().release_spares();
    if (released < bytes) released += release_.release(bytes - released);
    if (released < bytes && !release_.retained()) {
      // Empty small-pool segments are borrowed blocks of this pool: returned, they may free one.
      small_.release_free_segments(~std::size_t{0});
      released += release_.release(bytes - released);
    }
    if (mover_.parked_count() > 0 && !release_.retained()) mover_.unpark();
    return released;
  }

  /// As release_cached(bytes), never waiting for the device: spares and fully free segments whose
  /// last free's work is known complete go (a hot path's caller: a prefetch during backward).
  /// With one stream, frees get events from the first call on, to become releasable.
  std::size_t release_completed(std::size_t bytes) {
    std::lock_guard guard(lock_);
    track_completion_ = true;
    const std::size_t spares = pool_.backend().release_spares();  // unmapped, their work done
    return spares >= bytes ? spares : spares + release_.release(bytes - spares, false);
  }

  /// Physical memory is held up to `bytes` from now on (0: no limit); above it, cached memory goes
  /// at once, live allocations stay and growth is refused until enough is freed.
  void set_memory_limit(std::size_t bytes) {
    std::lock_guard guard(lock_);
    pool_.backend().set_memory_limit(bytes);
    config_.memory_limit = bytes;
    if (bytes != 0 && pool_.backend().physical_bytes() > bytes) release_cached_locked();
  }
  std::size_t memory_limit() const {
    std::lock_guard guard(lock_);
    return pool_.backend().memory_limit();
  }

  statistics stats() const;

  /// Spare handles are kept up to `bytes` from now on (config::move_spares); those above go now.
  void keep_move_spares(std::size_t bytes) {
    std::lock_guard guard(lock_);
    pool_.backend().keep_spares(bytes, &counters_);
    config_.move_spares = bytes;
  }

  /// While `retain` holds, no memory goes back and no mapping changes: free segments and cached
  /// ranges stay (reused as they are, not repaired); growth goes on. Every address keeps its
  /// memory, as a CUDA graph captured over it needs. A request only releasing would serve fails.
  void retain_memory(bool retain) {
    std::lock_guard guard(lock_);
    if (retain) mover_.complete_ready(true);  // no remap may come later
    release_.retain(retain);
  }

  /// From now on `observer(context, event)` is told of the changes the class comment lists
  /// (null: nobody is), under the lock.
  void set_memory_observer(memory_observer observer, void* context) {
    std::lock_guard guard(lock_);
    observer_ = observer;
    observer_context_ = context;
    pool_.set_observer(observer, context);
  }

  /// Shows `v` every segment (address order) with its blocks (the small pool's in place of those
  /// it borrowed), then every stitched range with its pieces; a block a live range claims shows
  /// `stitched_into` and `requested` 0; a parked freed allocation is pending_free. O(blocks +
  /// pieces + p log p) for p record_stream'd frees waiting.
  template <state_visitor V>
  void visit_state(V& v) const;

  // ------------------------------------------------------------------ offload
  /// Far memory for offload: `host` makes its handles and `copier` moves the bytes; `away` says
  /// whether memory away stays mapped at its addresses (default: config::far_unmapped).
  /// config_error for handles not multiples of host's granularity; usage_error while in use.
  template <physical_provider Host, byte_copier Copier>
    requires std::same_as<typename Host::handle_type, typename Provider::handle_type> &&
             address_reserver_for<Reserver, Host> && copier_fits_reserver<Copier, Reserver>
  void attach_far_memory(Host host, Copier copier) {
    attach_far_memory(std::move(host), std::move(copier),
                      config_.far_unmapped ? far_residence::unmapped : far_residence::mapped);
  }
  template <physical_provider Host, byte_copier Copier>
    requires std::same_as<typename Host::handle_type, typename Provider::handle_type> &&
             address_reserver_for<Reserver, Host> && copier_fits_reserver<Copier, Reserver>
  void attach_far_memory(Host host, Copier copier, far_residence away) {
    std::lock_guard guard(lock_);
    offload_.attach(std::move(host), std::move(copier), away);
  }

  /// Where memory moved to far memory is kept while there (attach_far_memory's `away`).
  far_residence far_residence_of_moves() const noexcept {
    return mover_.away_unmapped() ? far_residence::unmapped : far_residence::mapped;
  }

  /// Marks the live allocation at `p` as not written on the device (frozen weights), or unmarks
  /// it: it keeps its far copy when prefetched, so its next offload copies nothing (writes on the
  /// device are lost then). The copy holds far memory (far_copy_bytes) until unmarked or freed.
  /// usage_error with no far memory or for a pointer not a live large allocation. O(log n).
  void keep_far_copy(const void* p, bool keep = true) {
    std::lock_guard guard(lock_);
    offload_.keep_far_copy(p, keep);
  }

  /// Far memory held by the clean copies of allocations on the device (keep_far_copy).
  std::size_t far_copy_bytes() const {
    std::lock_guard guard(lock_);
    return mover_.clean_bytes();
  }

  /// Moves the memory of the live allocation at `p` to far memory, ordered on `stream`: every
  /// whole handle inside it (a stitched allocation: inside the part it claims) is copied into a
  /// new far handle after the work queued on `stream`, on the allocation's own stream and on
  /// streams given to record_stream has completed, then mapped in its place, at every address
  /// that maps it; the device handle goes back to the backend (reserved_bytes falls, the device
  /// has it again). The pointer stays valid; device code reads and writes far memory through it
  /// (slowly), unless far memory was attached with far_residence::unmapped: then the addresses
  /// are unmapped until prefetch(p) (or a free) and a use faults. Bytes in handles it shares with neighbouring blocks stay on the device. Cached
  /// stitched ranges over its memory are dropped. All or nothing: out_of_memory when far memory
  /// runs out; usage_error for a pointer that is not a live allocation of at least one whole
  /// handle, one offloaded already, no far memory attached, memory retained (retain_memory), or
  /// a stream capturing a graph (capture_aware_reserver). Waits for the device.
  ///
  /// With move_completion::deferred (backends with events; others complete on return), the call
  /// waits only for work on other streams that uses p (its own stream, recorded ones), queues
  /// the copies on `stream` and returns; the memory is remapped, and the device memory given
  /// back, by the first later call of this allocator that finds the copies done, or by
  /// complete_move(p) / complete_moves. Until then p must not be used by any work (queued or
  /// new) but the move: prefetch(p) undoes the move instead (once its copies are done, without a
  /// copy back), deallocate(p) likewise before freeing, and complete_move(p) finishes it.
  /// residence_of(p) says host from the call on; reserved_bytes and offloaded_bytes change at
  /// completion. A remap that fails at completion (out of mapping resources) leaves the memory
  /// where it was; residence_of says so.
  void offload(void* p, stream_ref stream = default_stream, move_completion when = move_completion::on_return) {
    std::lock_guard guard(lock_);
    offload_.move("offload", p, stream, true, when, stream);
  }

  /// As above, the copies queued on `copies` instead of `stream`: they start once the work
  /// queued on `stream` has completed (an event wait, stream_joining_reserver: the host does
  /// not wait) and run beside the work queued there afterwards. A deferred move completes once
  /// they are done, as above. usage_error when `copies` is not `stream` and the reserver has
  /// events but no stream_joining_reserver, or when either stream is capturing a graph.
  void offload(void* p, stream_ref stream, move_completion when, stream_ref copies) {
    std::lock_guard guard(lock_);
    offload_.move("offload", p, stream, true, when, copies);
  }

  /// Brings an offloaded allocation's memory back to the device (the reverse of offload, new
  /// device handles, the same pointer). When the device is short, cached memory is released
  /// first; out_of_memory when that is not enough, with nothing changed. Deferred as offload
  /// is: until the move completes, p must not be used (complete_move(p) before the work that
  /// uses it is queued); offload(p) undoes a pending prefetch.
  void prefetch(void* p, stream_ref stream = default_stream, move_completion when = move_completion::on_return) {
    std::lock_guard guard(lock_);
    offload_.move("prefetch", p, stream, false, when, stream);
  }

  /// As above, the copies queued on `copies` after the work queued on `stream` (see offload).
  void prefetch(void* p, stream_ref stream, move_completion when, stream_ref copies) {
    std::lock_guard guard(lock_);
    offload_.move("prefetch", p, stream, false, when, copies);
  }

  /// Completes the deferred move of the allocation at `p`, waiting for its copies; nothing when
  /// it has none. A remap that fails leaves the memory where it was (residence_of says where).
  /// When `p` is offloaded then, its device memory is given back by the time the call returns,
  /// spare handles included (config::move_spares): what a budget shared with other processes
  /// relies on before it hands the bytes on.
  void complete_move(const void* p) {
    std::lock_guard guard(lock_);
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    mover_.complete(address);
    if (pool_.backend().spare_bytes() != 0 && mover_.moved(address)) pool_.backend().release_spares();
  }

  /// Work queued on `stream` from this call on may use the allocation at `p`: its deferred
  /// move, if any, is complete for that work. A move that needs nothing after its copies but
  /// giving old memory back (a prefetch with far_residence::unmapped: its device memory is
  /// mapped from the start) is not waited for: `stream` waits for the copies (an event wait,
  /// stream_joining_reserver) and the move completes at a later call. Any other completes now,
  /// as complete_move(p). Such a move is never undone afterwards: an offload or a free of p
  /// completes it first.
  void ready_on(const void* p, stream_ref stream) {
    std::lock_guard guard(lock_);
    mover_.ready_on(reinterpret_cast<std::uintptr_t>(p), stream);
  }

  /// Completes the deferred moves whose copies are done; with `wait`, every one, waiting for
  /// them. Returns how many completed (failed remaps included). O(pending moves).
  std::size_t complete_moves(bool wait = false) {
    std::lock_guard guard(lock_);
    return mover_.complete_ready(wait);
  }

  /// The bytes offload(p) would move now: its whole handles (a stitched allocation's in the part
  /// it claims); 0 when it would refuse (no far memory, not a large live allocation here,
  /// retained memory, no whole handle of its own, handles another live stitch maps) or when p is
  /// offloaded already. O(its handles + live stitches).
  std::size_t movable_bytes(const void* p) {
    std::lock_guard guard(lock_);
    return offload_.movable_bytes(p);
  }

  /// Where the live allocation at `p` is: residence::host once offloaded, else device.
  /// usage_error for a pointer that is not a live allocation here.
  residence residence_of(const void* p) const {
    std::lock_guard guard(lock_);
    if (!owns_unlocked(p)) {
      throw usage_error(usage_error::kind::foreign_pointer,
                        std::string(name) + "::residence_of: " + detail::pointer_text(p) +
                            " is not a live allocation of this allocator");
    }
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    return mover_.residence_at(address);  // a pending move's: where it takes it
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

  /// Where free memory sits, for diagnosing fragmentation, in bytes: free blocks of the large pool
  /// in whole handles (stitchable) or in partly used ones (usable only in place; of those, in a
  /// free block ending its segment), the small pool's free borrowed blocks, and what live
  /// allocations hold beyond their requests (blocks rounded to large_round_to; stitched ranges'
  /// whole chunks). O(blocks + stitched ranges).
  struct free_memory_report {
    std::size_t whole_handles = 0, partial_handles = 0, small_pool = 0;
    std::size_t partial_at_segment_end = 0, block_rounding = 0, stitched_tails = 0;
  };
  free_memory_report free_memory() const;

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
  /// Who is told, at destruction, of allocations still live (null: nobody; see live_report).
  void set_live_report(live_report report) noexcept { live_report_ = report; }
  const config& settings() const noexcept { return config_; }
  std::size_t chunk_size() const noexcept { return pool_.chunk(); }
  /// The backend's provider and reserver (e.g. to read a simulated device's counters).
  Provider& provider() noexcept { return pool_.backend().provider(); }
  Reserver& reserver() noexcept { return pool_.backend().reserver(); }

 private:
  // ------------------------------------------------------------------ set-up
  static config validated(const config& cfg) {
    cfg.validate();
    return cfg;
  }
  static caching_rules small_rules(const config& cfg) {
    caching_rules rules;
    rules.round_to = cfg.round_to;
    rules.min_segment = cfg.small_segment;
    rules.segment_threshold = cfg.small_limit + 1;
    rules.min_split_remainder = cfg.round_to;
    return rules;
  }
  events_type make_events() noexcept {
    if constexpr (has_events) {
      return events_type(pool_.backend().reserver(), counters_.s);
    } else {
      return events_type{};
    }
  }
  stitcher_type make_stitcher() {
    if constexpr (stitches) {
      return stitcher_type(pool_, clocks_, counters_, admission_, config_.auto_gc, max_candidates, max_reuse_probes);
    } else {
      return stitcher_type{};
    }
  }

  stitched* find_stitch([[maybe_unused]] std::uintptr_t address) const noexcept {
    if constexpr (stitches) {
      return const_cast<stitched*>(stitcher_.find(address));
    } else {
      return nullptr;
    }
  }

  bool owns_unlocked(const void* p) const {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    if (mover_.parked(address)) return false;
    auto& arena = const_cast<pool_type&>(pool_).arena();
    if (const block_type* b = arena.find(address); b != nullptr && !b->free && b->owner == nullptr) return true;
    if (const stitched* s = find_stitch(address); s != nullptr && s->live) return true;
    return small_.owns(p);
  }

  // ------------------------------------------------------------------ allocation
  // Small requests go to the small pool, large ones up the ladder (ladder_).
  void* allocate_locked(std::size_t bytes, stream_ref stream) {
    if constexpr (has_events) {
      if (mover_.any_pending()) mover_.complete_ready(false);
    }
    if constexpr (has_events) {
      if (deferred_.pending()) finish_deferred(false);
    }
    clocks_.enter(stream);
    if constexpr (has_events) {
      if (clocks_.size() > 1 || track_completion_) clocks_.tick(stream);
    }
    if (bytes <= config_.small_limit) {
      void* p = small_.allocate_unlocked(bytes, stream);
      if (p != nullptr) counters_.on_allocate(bytes, detail::round_up(bytes, config_.round_to));
      return p;
    }
    return ladder_.allocate(bytes, stream);
  }

  // ------------------------------------------------------------------ the small pool's segments
  void take_back(std::uintptr_t base) noexcept {
    block_type* b = pool_.arena().find(base);
    pool_.enter_free_queue(pool_.arena().give_back(b, clocks_.mark_free(b->stream)));
  }

  // ------------------------------------------------------------------ streams
  void finish_deferred([[maybe_unused]] bool wait) noexcept {
    if constexpr (has_events) {
      deferred_.finish(wait, clocks_.events(),
                       [this](void* p, std::size_t bytes, stream_ref stream) { free_now(p, bytes, stream); });
    }
  }

  // ------------------------------------------------------------------ deallocation
  void deallocate_locked(void* p, std::size_t bytes, stream_ref stream) {
    if (p == nullptr) return;
    if constexpr (has_events) {
      if (mover_.any_pending()) {
        // A move of it still copying is undone first: the memory stays where it was (one that
        // work may use already, ready_on, completes instead).
        mover_.undo(reinterpret_cast<std::uintptr_t>(p));
        mover_.complete_ready(false);
      }
    }
    if constexpr (has_events) {
      if (deferred_.active()) {
        const auto check = [this](void* q, std::size_t n) {
          if (!owns_unlocked(q)) detail::throw_not_live(name, q, false);
          if (const std::size_t expected = requested_of(q); expected != n) detail::throw_size_mismatch(name, q, n, expected);
        };
        const auto already = [](void* q) { detail::throw_not_live(name, q, true); };
        if (deferred_.defer(p, bytes, stream, clocks_.events(), check, already)) return;
      }
    }
    free_now(p, bytes, stream);
    if constexpr (has_events) {
      if (clocks_.size() > 1 || track_completion_) clocks_.tick(stream);
    }
  }

  std::size_t requested_of(const void* p) {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    if (const block_type* b = pool_.arena().find(address); b != nullptr && !b->free && b->owner == nullptr) {
      return b->requested;
    }
    if (const stitched* s = find_stitch(address); s != nullptr && s->live) return s->requested;
    return small_.requested_of(p);
  }

  void free_now(void* p, std::size_t bytes, stream_ref stream) {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    if (bytes != 0 && bytes <= config_.small_limit) {
      // The small pool checks the size itself and throws on a mismatch.
      if (small_.deallocate_if_owned(p, bytes, stream)) {
        counters_.on_deallocate(bytes, detail::round_up(bytes, config_.round_to));
        tell(memory_action::free_completed, address, bytes, stream);
        return;
      }
    }
    mover_.forget_clean(address);
    if (mover_.any_moved() && mover_.moved(address)) {
      if (mover_.parked(address)) diagnose_bad_free(p, bytes, false);
      if (!offload_.bring_back_for_free(p, bytes, stream)) return;  // parked: its memory stays far for now
    }
    if (block_type* b = pool_.arena().find(address); b != nullptr && !b->free && b->owner == nullptr) {
#if GLAKE_CHECKED
      if (b->requested != bytes) detail::throw_size_mismatch(name, p, bytes, b->requested);
#endif
      counters_.on_deallocate(b->requested, b->size);
      tell(memory_action::free_completed, address, b->requested, stream);
      pool_.enter_free_queue(pool_.arena().give_back(b, clocks_.mark_free(b->stream)));
      return;
    }
    stitched* s = find_stitch(address);
    if (s != nullptr && s->live) {
#if GLAKE_CHECKED
      if (s->requested != bytes) detail::throw_size_mismatch(name, p, bytes, s->requested);
#endif
      tell(memory_action::free_completed, address, s->requested, stream);
      tell(memory_action::segment_unmap, s->base, s->claimed_bytes, s->stream);
      if constexpr (stitches) stitcher_.release(*s);
      return;
    }
    diagnose_bad_free(p, bytes, s != nullptr);
  }

  [[noreturn]] void diagnose_bad_free(void* p, std::size_t bytes, bool cached_stitch) {
    // A live small allocation freed with a size that routed it elsewhere (0, or above
    // small_limit): the mistake is the size, not the pointer.
    if (const std::size_t expected = small_.requested_of(p); expected != 0) {
      detail::throw_size_mismatch(name, p, bytes, expected);
    }
    const block_type* c = pool_.arena().containing(reinterpret_cast<std::uintptr_t>(p));
    detail::throw_not_live(name, p, cached_stitch || (c != nullptr && c->free) || small_.inside_free_block(p));
  }

  void release_cached_locked() {
    mover_.complete_ready(true);
    finish_deferred(true);
    pool_.backend().release_spares();  // mapped nowhere: retained memory or not
    if (release_.retained()) return;
    release_.evict(~std::size_t{0}, true);
    small_.release_free_segments(~std::size_t{0});
    release_.release(~std::size_t{0});
    if (mover_.parked_count() > 0) mover_.unpark();
    mover_.trim();  // far handles kept for the next offloads
  }

  void release_everything() noexcept {
    if constexpr (has_events) {
      mover_.undo_all();
      finish_deferred(true);
      clocks_.synchronize_all();
    }
    // Addresses left unmapped (failed remaps, allocations still away) get their handles back.
    mover_.restore_mappings();
    if constexpr (stitches) stitcher_.release_all();
    small_.release_free_segments(~std::size_t{0});
    // The pool gives every segment back when it is destroyed, after the small pool (declared
    // after it) has returned its live blocks.
  }

  // ------------------------------------------------------------------ reporting
  void tell(memory_action action, std::uintptr_t address, std::size_t size, stream_ref stream) const noexcept {
    if (observer_ != nullptr) observer_(observer_context_, memory_event{action, address, size, stream});
  }
  // A stitched range now holds the allocation at `p`: its range is the allocation's segment.
  void tell_if_stitched(void* p, std::size_t bytes) const noexcept {
    if (bytes <= config_.small_limit) return;
    if (const stitched* s = find_stitch(reinterpret_cast<std::uintptr_t>(p)); s != nullptr && s->live) {
      tell(memory_action::segment_map, s->base, s->claimed_bytes, s->stream);
    }
  }

  statistics stats_locked() const {
    statistics s = counters_.s;
    const statistics small = small_.stats_unlocked();
    s.splits = pool_.arena().splits() + small.splits;
    s.merges = pool_.arena().merges() + small.merges;
    s.driver_calls = pool_.backend().calls();
    s.driver_time = pool_.backend().call_times();
    s.spare_bytes = pool_.backend().spare_bytes();
    s.recycled_handles = pool_.backend().recycled_handles();
    if constexpr (stitches) s.cached_stitch_bytes = stitcher_.cached_bytes();
    return s;
  }

  void verify_locked() const;

  config config_;
  [[no_unique_address]] Admission admission_;
  detail::usage_counters counters_;
  mover_type mover_;  ///< before pool_: a segment given back releases its far handles there
  pool_type pool_;
  clocks_type clocks_;
  stitcher_type stitcher_;
  [[no_unique_address]] deferred_type deferred_;
  adoption_type adoption_;
  release_type release_;  ///< also holds retain_memory's switch
  ladder_type ladder_;
  offload_type offload_;
  small_pool small_;
  bool track_completion_ = false;  // events follow frees even with one stream (release_completed)
  live_report live_report_ = detail::default_live_report;
  memory_observer observer_ = nullptr;
  void* observer_context_ = nullptr;
  [[no_unique_address]] mutable Lock lock_;
};

// Its members every user calls are defined out of the class, so that an `extern template` of them
// (presets.hpp, GLAKE_PRESETS_EXTERN) spares a translation unit their instantiation.
template <physical_provider Provider, address_reserver_for<Provider> Reserver, stitching_strategy Stitch,
          eviction_policy Evict, lock_policy Lock, stitch_admission Admission, growth_policy Growth>
stitching_allocator<Provider, Reserver, Stitch, Evict, Lock, Admission, Growth>::stitching_allocator(
    Provider provider, Reserver reserver, config cfg)
    : config_(validated(cfg)),
      admission_(config_),
      mover_(mover_link{this}),
      pool_(std::move(provider), std::move(reserver), config_, counters_),
      clocks_(make_events(), config_.event_interval_us),
      stitcher_(make_stitcher()),
      adoption_(max_candidates, max_reuse_probes, config_.stream_join),
      release_(pool_, clocks_, adoption_, stitcher_, &mover_),
      ladder_(pool_, clocks_, counters_, admission_, stitcher_, adoption_, release_, ladder_link{this},
              config_.large_round_to == 0
                  ? pool_.chunk()
                  : std::min(std::max(config_.large_round_to, config_.round_to), pool_.chunk())),
      offload_(pool_, clocks_, stitcher_, deferred_, mover_, counters_, offload_link{this}),
      small_(borrowed_segment_source<small_lender>(small_lender{this}), small_rules(config_)) {
  pool_.backend().keep_spares(config_.move_spares, &counters_);
  small_.set_live_report(nullptr);  // its live blocks are this allocator's, reported here
}

template <physical_provider Provider, address_reserver_for<Provider> Reserver, stitching_strategy Stitch,
          eviction_policy Evict, lock_policy Lock, stitch_admission Admission, growth_policy Growth>
stitching_allocator<Provider, Reserver, Stitch, Evict, Lock, Admission, Growth>::~stitching_allocator() {
  release_everything();
  detail::report_live(live_report_, name, counters_.s);
}

template <physical_provider Provider, address_reserver_for<Provider> Reserver, stitching_strategy Stitch,
          eviction_policy Evict, lock_policy Lock, stitch_admission Admission, growth_policy Growth>
void* stitching_allocator<Provider, Reserver, Stitch, Evict, Lock, Admission, Growth>::allocate(
    std::size_t bytes, stream_ref stream) {
  std::lock_guard guard(lock_);
  if (bytes == 0) return nullptr;
  if (void* p = allocate_locked(bytes, stream)) {
    if (observer_ != nullptr) tell_if_stitched(p, bytes);
    return p;
  }
  ++counters_.s.failed_allocations;
  detail::throw_out_of_memory(name, bytes, stream, stats_locked(), pool_.largest_free_block(),
                              pool_.backend().memory_limit());
}

template <physical_provider Provider, address_reserver_for<Provider> Reserver, stitching_strategy Stitch,
          eviction_policy Evict, lock_policy Lock, stitch_admission Admission, growth_policy Growth>
void* stitching_allocator<Provider, Reserver, Stitch, Evict, Lock, Admission, Growth>::try_allocate(
    std::size_t bytes, stream_ref stream) {
  std::lock_guard guard(lock_);
  if (bytes == 0) return nullptr;
  void* p = allocate_locked(bytes, stream);
  if (p == nullptr) ++counters_.s.failed_allocations;
  if (p != nullptr && observer_ != nullptr) tell_if_stitched(p, bytes);
  return p;
}

template <physical_provider Provider, address_reserver_for<Provider> Reserver, stitching_strategy Stitch,
          eviction_policy Evict, lock_policy Lock, stitch_admission Admission, growth_policy Growth>
void stitching_allocator<Provider, Reserver, Stitch, Evict, Lock, Admission, Growth>::deallocate(
    void* p, std::size_t bytes, stream_ref stream) {
  std::lock_guard guard(lock_);
  deallocate_locked(p, bytes, stream);
}

template <physical_provider Provider, address_reserver_for<Provider> Reserver, stitching_strategy Stitch,
          eviction_policy Evict, lock_policy Lock, stitch_admission Admission, growth_policy Growth>
statistics stitching_allocator<Provider, Reserver, Stitch, Evict, Lock, Admission, Growth>::stats() const {
  std::lock_guard guard(lock_);
  return stats_locked();
}

namespace detail {
using stitching_archetype = stitching_allocator<provider_archetype, reserver_archetype>;
using evented_stitching_archetype = stitching_allocator<provider_archetype, evented_reserver_archetype, no_stitching>;
}  // namespace detail
static_assert(stream_recording_allocator<detail::stitching_archetype> && snapshotting_allocator<detail::stitching_archetype>);
static_assert(observable_allocator<detail::stitching_archetype> && memory_retaining_allocator<detail::stitching_archetype>);
static_assert(memory_limiting_allocator<detail::stitching_archetype> && owning_allocator<detail::stitching_archetype>);
static_assert(cache_releasing_allocator<detail::stitching_archetype> && partly_cache_releasing_allocator<detail::stitching_archetype>);
static_assert(completion_releasing_allocator<detail::stitching_archetype>);
static_assert(peak_resetting_allocator<detail::stitching_archetype> && offloading_allocator<detail::stitching_archetype>);
static_assert(far_copy_keeping_allocator<detail::stitching_archetype>);
static_assert(snapshotting_allocator<detail::evented_stitching_archetype> && deferring_offloading_allocator<detail::evented_stitching_archetype>);
static_assert(stream_recording_allocator<detail::evented_stitching_archetype>);

}  // namespace glake

#include "glake/allocators/stitching/stitching_state.hpp"
#include "glake/allocators/stitching/stitching_verify.hpp"
