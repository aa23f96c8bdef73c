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
#include "glake/allocators/stitching/deferred_frees.hpp"
#include "glake/allocators/stitching/segment_pool.hpp"
#include "glake/allocators/stitching/stitcher.hpp"
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
/// segment's own range; blocks are pieces of a segment, split at `config::large_round_to` (512 B
/// by default, as PyTorch's large pool), so a block's rounding tail serves the next request
/// instead of holding up to a chunk. A stitch maps only whole handles of free blocks; new memory
/// comes in whole chunks. A request above `small_limit` is served by the first step of this ladder
/// that succeeds (`allocate_large`; docs/stitching.md explains each step):
///   the best-fitting free block of its stream; a cached stitched range whose needed chunks are
///   free; another stream's completed free block; a cached range repaired or grown in place;
///   then, at three rungs that reclaim more and more (nothing; deferred frees, cached ranges and
///   free segments for the request; everything free): a new stitch, reclaimed small-pool
///   blocks, other streams' blocks gathered (or waited for), new memory for the shortfall only,
///   a new segment.
/// Admission decides whether and when to stitch, reuse or repair; Stitch which free blocks a new
/// stitch maps; Growth the handle sizes and the address space a stitched range reserves; Evict
/// which cached range or free segment goes first. Requests up to `small_limit` go to a small pool
/// (a caching_allocator) whose segments are borrowed blocks of this pool, returned whenever this
/// pool would otherwise grow.
///
/// A stitched range also stays mapped in its home segments, so cached ranges cost address space
/// and mappings, not memory; their chunks may be in use elsewhere meanwhile, which is why reuse
/// checks that the needed chunks are free. Statistics count physical memory once.
///
/// Complexity: the cached steps are O(log n) (a bounded number of candidates); a stitch costs
/// O(k log n) for k pieces plus one map per handle. No heap allocation on the cached path once warm.
/// Thread safety: as the Lock policy; one lock per public call. The default `no_lock` is for one
/// thread only.
/// Streams: free blocks and stitches belong to a stream and are reused on it at once; other
/// streams take them once the work queued before their free has completed (stitching/stream_clocks
/// records the events, stitching/stream_adoption moves the blocks, stitching/deferred_frees holds
/// record_stream'd frees; see docs/streams.md). A cached range is unmapped, and physical memory
/// released, only once the work that may use it has completed.
/// Errors: allocate throws out_of_memory (state unchanged, allocator usable); try_allocate returns
/// null; misuse throws usage_error; a backend failure throws its error after a full rollback. A
/// failed event query only means "not completed yet".
/// Observation: visit_state shows segments, blocks and stitched ranges (O(blocks), under the
/// lock); a memory_observer, when set, hears of segments added and given back, of each stitched
/// range while it holds an allocation (segment_map / segment_unmap), and of each free once its
/// memory is reusable (free_completed; later than the call for a record_stream'd free).
/// retain_memory(true) keeps every mapping and every byte (for a CUDA graph's private pool).
/// Offload: with far memory attached (attach_far_memory), offload(p) moves a live large
/// allocation's whole handles to far memory and prefetch(p) brings them back, the pointer
/// unchanged (docs/offload.md, "Allocator blocks").
template <physical_provider Provider, address_reserver_for<Provider> Reserver,
          stitching_strategy Stitch = best_fit_tail_stitching, eviction_policy Evict = lru_eviction,
          lock_policy Lock = no_lock, stitch_admission Admission = gmlake_admission,
          growth_policy Growth = power_of_two_growth>
class stitching_allocator {
  using self = stitching_allocator;
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

  // What every step of the ladder is asked.
  struct request {
    std::size_t size;   ///< rounded to large_round_to: what a free block hands out
    std::size_t span;   ///< rounded to chunks: what a stitch maps, or a new segment holds
    std::size_t bytes;  ///< as asked
    stream_ref stream;
    bool may_stitch;
  };

  // The small pool borrows its segments from the large pool.
  struct small_lender {
    stitching_allocator* parent;
    std::size_t lending_granularity() const noexcept { return parent->pool_.chunk(); }
    bool lend(std::size_t bytes, stream_ref stream, std::uintptr_t& base) { return parent->lend(bytes, stream, base); }
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
    bool make_room(std::size_t bytes) { return parent->make_room_for_move(bytes); }
    bool retained() noexcept { return parent->retain_; }
    void release_parked(std::uintptr_t address) noexcept { parent->release_parked(address); }
  };
  static_assert(mover_host<mover_link>);
  using mover_type = allocation_mover<mover_link, typename pool_type::slot_type>;

  static constexpr std::size_t max_candidates = 1024;
  static constexpr std::size_t max_reuse_probes = 32;
  static constexpr const char* name = "glake::stitching_allocator";

 public:
  using provider_type = Provider;
  using reserver_type = Reserver;

  stitching_allocator(Provider provider, Reserver reserver, config cfg = {})
      : config_(validated(cfg)),
        admission_(config_),
        mover_(mover_link{this}),
        pool_(std::move(provider), std::move(reserver), config_, counters_),
        large_round_(config_.large_round_to == 0
                         ? pool_.chunk()
                         : std::min(std::max(config_.large_round_to, config_.round_to), pool_.chunk())),
        clocks_(make_events(), config_.event_interval_us),
        stitcher_(make_stitcher()),
        adoption_(max_candidates, max_reuse_probes),
        small_(borrowed_segment_source<small_lender>(small_lender{this}), small_rules(config_)) {
    pinned_.reserve(256);
    pool_.backend().keep_spares(config_.move_spares, &counters_);
    small_.set_live_report(nullptr);  // its live blocks are this allocator's, reported here
  }
  stitching_allocator(const stitching_allocator&) = delete;
  stitching_allocator& operator=(const stitching_allocator&) = delete;
  /// Gives every segment back, live allocations or not, and tells the live_report of live ones.
  ~stitching_allocator() {
    release_everything();
    detail::report_live(live_report_, name, counters_.s);
  }

  /// At least `bytes` bytes on `stream`: aligned to `round_to` for small requests and to
  /// `large_round_to` (at least `round_to`) for large ones. Zero bytes gives null.
  void* allocate(std::size_t bytes, stream_ref stream = default_stream) {
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

  /// As allocate, but null when out of memory.
  void* try_allocate(std::size_t bytes, stream_ref stream = default_stream) {
    std::lock_guard guard(lock_);
    if (bytes == 0) return nullptr;
    void* p = allocate_locked(bytes, stream);
    if (p == nullptr) ++counters_.s.failed_allocations;
    if (p != nullptr && observer_ != nullptr) tell_if_stitched(p, bytes);
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
  /// `bytes` went back, or none is left; returns how many bytes went back. Lets memory that
  /// moves into the device from elsewhere (a virtual_buffer's prefetch) take the place of what
  /// this allocator caches, without emptying the whole cache. While retaining memory
  /// (retain_memory), only the spares (mapped nowhere) go.
  std::size_t release_cached(std::size_t bytes) {
    std::lock_guard guard(lock_);
    mover_.complete_ready(true);
    finish_deferred(true);
    std::size_t released = pool_.backend().release_spares();
    if (released < bytes) released += release_free_segments(bytes - released);
    if (released < bytes && !retain_) {
      // Empty small-pool segments are borrowed blocks of this pool: returned, they may free one.
      small_.release_free_segments(~std::size_t{0});
      released += release_free_segments(bytes - released);
    }
    if (mover_.parked_count() > 0 && !retain_) mover_.unpark();
    return released;
  }

  /// As release_cached(bytes), but never waits for the device: spare handles (no work uses
  /// them) and only fully free segments whose last free's work is known complete (the streams'
  /// events, polled) go back; the others stay.
  /// For a caller on a hot path that can take fresh memory instead (a prefetch during backward).
  /// With one stream, frees are not followed by events (nothing else needs them); the first call
  /// turns that on, so from then on frees become releasable once their work completed.
  std::size_t release_completed(std::size_t bytes) {
    std::lock_guard guard(lock_);
    track_completion_ = true;
    const std::size_t spares = pool_.backend().release_spares();  // unmapped, their work done
    return spares >= bytes ? spares : spares + release_free_segments(bytes - spares, false);
  }

  /// Physical memory is held up to `bytes` from now on (0: no limit; PyTorch's
  /// set_per_process_memory_fraction). When more is held than the new limit, cached memory is
  /// released at once; live allocations stay valid, and growth is refused until enough of them
  /// is freed. settings().memory_limit follows.
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

  statistics stats() const {
    std::lock_guard guard(lock_);
    return stats_locked();
  }

  /// While `retain` holds, no memory goes back to the backend and no mapping is removed or
  /// changed: fully free segments and cached stitched ranges stay, cached ranges are reused as
  /// they are but not repaired; growth and reuse of its own free memory go on. Every address
  /// handed out keeps its physical memory, which a CUDA graph captured over this allocator's
  /// memory needs (its replays use the addresses captured, freed since or not). A request that
  /// only releasing would serve fails instead.
  void retain_memory(bool retain) {
    std::lock_guard guard(lock_);
    if (retain) mover_.complete_ready(true);  // no remap may come later
    retain_ = retain;
    if constexpr (stitches) stitcher_.freeze(retain);
  }

  /// From now on `observer(context, event)` is told of the changes the class comment lists
  /// (null: nobody is), under the lock.
  void set_memory_observer(memory_observer observer, void* context) {
    std::lock_guard guard(lock_);
    observer_ = observer;
    observer_context_ = context;
    pool_.set_observer(observer, context);
  }

  /// Shows `v` every segment (address order) with its blocks, the small pool's blocks in place
  /// of the blocks it borrowed, then every stitched range, live or cached, with its pieces.
  /// A block that a live stitched range claims is shown allocated (or pending) with
  /// `stitched_into` set and `requested` 0: the request is the range's. An allocation freed
  /// while offloaded and parked (its memory waiting in far memory) is pending_free, requested 0. O(blocks + pieces +
  /// p log p) for p record_stream'd frees waiting; allocates a little scratch when p > 0.
  template <state_visitor V>
  void visit_state(V& v) const {
    std::lock_guard guard(lock_);
    std::vector<const void*> pending;
    if constexpr (has_events) {
      deferred_.for_each_pending([&](const void* p) { pending.push_back(p); });
      std::sort(pending.begin(), pending.end());
    }
    // Freed but not reusable yet: a free waiting for recorded streams, or an allocation parked
    // in far memory (freed while offloaded, its memory waiting for room on the device).
    const auto live_state = [&](std::uintptr_t address) {
      if (std::binary_search(pending.begin(), pending.end(), reinterpret_cast<const void*>(address))) {
        return block_state::pending_free;
      }
      if (mover_.parked_count() > 0 && mover_.parked(address)) return block_state::pending_free;
      return block_state::allocated;
    };
    pool_.arena().for_each_block([&](const block_type& b) {
      if (b.address == b.segment->mapping.base) {
        v.segment(segment_view{b.segment->mapping.base, b.segment->mapping.size, b.segment->stream});
      }
      if (b.free) {
        v.block(block_view{b.address, b.size, 0, block_state::free, b.stream, 0, 0});
      } else if (b.owner == nullptr) {
        v.block(block_view{b.address, b.size, b.requested, live_state(b.address), b.stream, 0, 0});
      } else if (b.owner == &small_) {
        small_.for_each_block_of_segment_unlocked(b.address, [&](const auto& sb) {
          v.block(block_view{sb.address, sb.size, sb.free ? 0 : sb.requested,
                             sb.free ? block_state::free : live_state(sb.address), sb.stream, b.address, 0});
        });
      } else if constexpr (stitches) {
        const auto* range = static_cast<const stitched*>(b.owner);
        v.block(block_view{b.address, b.size, 0, live_state(range->base), b.stream, 0, range->base});
      }
    });
    if constexpr (stitches) {
      for (const stitched& r : stitcher_.cache()) {
        v.stitched(stitched_view{r.base, r.size, r.live ? r.claimed_bytes : 0, r.requested, r.stream, r.live,
                                 r.live ? live_state(r.base) : block_state::free});
        for (const auto& pc : r.pieces) v.piece(stitched_piece_view{pc.home->mapping.base + pc.offset, pc.size});
      }
    }
  }

  // ------------------------------------------------------------------ offload
  /// Far memory for offload: `host` makes its handles (this allocator's handle type, which its
  /// reserver maps) and `copier` moves the bytes; `away` says whether memory in far memory stays
  /// mapped at its allocation's addresses (far_residence; by default as config::far_unmapped
  /// says). config_error when this allocator's handles are not multiples of host's granularity;
  /// usage_error while an allocation is in the far memory attached now.
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
    if (mover_.busy() != 0) {
      throw usage_error(usage_error::kind::bad_argument,
                        std::string(name) + "::attach_far_memory: " + std::to_string(mover_.busy()) +
                            " allocation(s) are in (or moving to or from) the far memory attached now");
    }
    const std::size_t g = host.granularity();
    if (g == 0 || pool_.chunk() % g != 0) {
      throw config_error(std::string(name) + "::attach_far_memory: handles of " + format_bytes(pool_.chunk()) +
                         " are not multiples of the far memory's granularity (" + format_bytes(g) + ")");
    }
    // Copies in the far memory attached before go; the marks stay.
    mover_.release_far_copies();
    std::unique_ptr<typename mover_type::far_type> far;
    if (away == far_residence::unmapped) {
      // Far handles keep a home mapping of their own (a copy of this reserver maps it): moves
      // copy straight to and from it.
      far = std::make_unique<far_memory_of<Host, Copier, Reserver>>(std::move(host), std::move(copier),
                                                                     Reserver(pool_.backend().reserver()));
    } else {
      far = std::make_unique<far_memory_of<Host, Copier>>(std::move(host), std::move(copier));
    }
    mover_.attach(std::move(far), away == far_residence::unmapped);
    pool_.set_far_releaser(&mover_type::release_far_handle, &mover_);
  }

  /// Where memory moved to far memory is kept while there (attach_far_memory's `away`).
  far_residence far_residence_of_moves() const noexcept {
    return mover_.away_unmapped() ? far_residence::unmapped : far_residence::mapped;
  }

  /// Marks the live allocation at `p` as not written while it is on the device (frozen weights,
  /// lookup tables), or unmarks it (`keep` false). A marked allocation keeps its far copy when
  /// it comes back (prefetch), so its next offload copies nothing: once the work using it is
  /// done, its addresses take the far handles back (unmapped, with far_residence::unmapped)
  /// and its device memory goes. The copy holds far memory while the allocation is on the
  /// device (far_copy_bytes); unmarking or freeing it releases the copy (a pending move of p
  /// completes first). Writing a marked allocation on the device is lost at its next offload.
  /// usage_error with no far memory attached or for a pointer that is not a live large
  /// allocation here. O(log allocations).
  void keep_far_copy(const void* p, bool keep = true) {
    std::lock_guard guard(lock_);
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    const std::string where = std::string(name) + "::keep_far_copy: ";
    if (!mover_.attached()) throw usage_error(usage_error::kind::bad_argument, where + "no far memory is attached (attach_far_memory)");
    const live_allocation a = find_live(address);
    if ((a.block == nullptr && a.range == nullptr) || mover_.parked(address)) {
      throw usage_error(usage_error::kind::foreign_pointer,
                        where + detail::pointer_text(p) + " is not a live large allocation of this allocator");
    }
    if (keep) {
      mover_.mark_clean(address);
      return;
    }
    mover_.unmark_clean(address);
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
    move_locked("offload", p, stream, true, when, stream);
  }

  /// As above, the copies queued on `copies` instead of `stream`: they start once the work
  /// queued on `stream` has completed (an event wait, stream_joining_reserver: the host does
  /// not wait) and run beside the work queued there afterwards. A deferred move completes once
  /// they are done, as above. usage_error when `copies` is not `stream` and the reserver has
  /// events but no stream_joining_reserver, or when either stream is capturing a graph.
  void offload(void* p, stream_ref stream, move_completion when, stream_ref copies) {
    std::lock_guard guard(lock_);
    move_locked("offload", p, stream, true, when, copies);
  }

  /// Brings an offloaded allocation's memory back to the device (the reverse of offload, new
  /// device handles, the same pointer). When the device is short, cached memory is released
  /// first; out_of_memory when that is not enough, with nothing changed. Deferred as offload
  /// is: until the move completes, p must not be used (complete_move(p) before the work that
  /// uses it is queued); offload(p) undoes a pending prefetch.
  void prefetch(void* p, stream_ref stream = default_stream, move_completion when = move_completion::on_return) {
    std::lock_guard guard(lock_);
    move_locked("prefetch", p, stream, false, when, stream);
  }

  /// As above, the copies queued on `copies` after the work queued on `stream` (see offload).
  void prefetch(void* p, stream_ref stream, move_completion when, stream_ref copies) {
    std::lock_guard guard(lock_);
    move_locked("prefetch", p, stream, false, when, copies);
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
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    if (!mover_.attached() || retain_ || mover_.moved(address) || mover_.moving(address)) return 0;
    const live_allocation a = find_live(address);
    if (a.block == nullptr && a.range == nullptr) return 0;
    std::vector<site_type> sites;
    std::vector<segment*> homes;
    sites_of(a, sites, homes);
    std::size_t bytes = 0;
    for (std::size_t i = 0; i < sites.size(); ++i) {
      if constexpr (stitches) {
        const std::size_t lo = sites[i].slot->offset;
        if (stitcher_.live_maps(homes[i], lo, lo + sites[i].slot->size, a.range)) return 0;
      }
      bytes += sites[i].slot->size;
    }
    return bytes;
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

 private:
  void release_cached_locked() {
    mover_.complete_ready(true);
    finish_deferred(true);
    pool_.backend().release_spares();  // mapped nowhere: retained memory or not
    if (retain_) return;
    evict_stitches(~std::size_t{0}, true);
    small_.release_free_segments(~std::size_t{0});
    release_free_segments(~std::size_t{0});
    if (mover_.parked_count() > 0) mover_.unpark();
    mover_.trim();  // far handles kept for the next offloads
  }

 public:

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

  /// Where free memory sits, for diagnosing fragmentation: bytes of free blocks in the large pool
  /// that are whole handles (stitchable), bytes of free blocks inside partly used handles (usable
  /// only in place), and bytes of the small pool's borrowed blocks that are free. Also where the
  /// partly used handles' free bytes sit (`partial_at_segment_end`: in a free block that ends its
  /// segment) and what live allocations hold beyond their requests (`block_rounding`: blocks
  /// rounded to large_round_to; `stitched_tails`: stitched ranges claim whole chunks).
  /// O(blocks + stitched ranges).
  struct free_memory_report {
    std::size_t whole_handles = 0;
    std::size_t partial_handles = 0;
    std::size_t small_pool = 0;
    std::size_t partial_at_segment_end = 0;
    std::size_t block_rounding = 0;
    std::size_t stitched_tails = 0;
  };
  free_memory_report free_memory() const {
    std::lock_guard guard(lock_);
    free_memory_report r;
    pool_.arena().for_each_block([&](const block_type& b) {
      if (!b.free) {
        if (b.owner == nullptr) r.block_rounding += b.size - b.requested;
        return;
      }
      const std::size_t whole = pool_.whole_handles_of(const_cast<block_type&>(b)).size;
      r.whole_handles += whole;
      r.partial_handles += b.size - whole;
      if (b.end() == b.segment->mapping.base + b.segment->mapping.size) r.partial_at_segment_end += b.size - whole;
    });
    if constexpr (stitches) {
      for (const stitched& s : stitcher_.cache()) {
        if (s.live) r.stitched_tails += s.claimed_bytes - s.requested;
      }
    }
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

  // ------------------------------------------------------------------ the ladder
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
    if (detail::round_up_overflows(bytes, pool_.chunk())) return nullptr;
    const std::size_t size = detail::round_up(bytes, large_round_);
    pool_.arena().reserve_nodes(2);
    // The ladder's first step, the common case, written out here so that it stays inline.
    if (block_type* b = pool_.arena().best_fit(stream, size)) return hand_out(b, size, bytes);
    const std::size_t span = detail::round_up(bytes, pool_.chunk());
    return allocate_large(request{size, span, bytes, stream, stitches && admission_.may_stitch(span)});
  }

  // Once no free block of the stream fits (allocate_locked's first step): the first step that
  // serves the request wins; steps that only make room return null. The steps are template
  // arguments, so each is a direct call.
  void* allocate_large(const request& r) {
    // More than the backend can ever hold: no step could serve it, and the later rungs would
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
  void* reclaim_small_pool(const request& r) {
    return small_.release_free_segments(~std::size_t{0}) > 0 ? from_free_block(r) : nullptr;
  }
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
  void* grow_in_place(const request& r) {
    if constexpr (segment_growth_policy<Growth>) {
      // Never more address space than the device could ever fill.
      const std::size_t ceiling = pool_.backend().capacity() / pool_.chunk() * pool_.chunk();
      const std::size_t reserve = std::min(pool_.growth().segment_reservation(r.span), ceiling);
      if (reserve <= r.span) return nullptr;
      // Extending moves a segment's slots, which moved allocations point to.
      if (mover_.busy() != 0) return nullptr;
      std::size_t need = r.span;
      segment* s = pool_.growing(r.stream);
      if (s != nullptr) {
        const block_type* last = pool_.arena().containing(s->mapping.base + s->mapping.size - 1);
        const std::size_t have = last->free && last->stream == r.stream ? std::min(last->size, r.size) : 0;
        need = detail::round_up(r.size - have, pool_.chunk());
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
  void* finish_deferred_frees([[maybe_unused]] const request& r) {
    if constexpr (has_events) {
      if (deferred_.pending()) {
        finish_deferred(true);  // deferred frees may be what is missing
        return from_free_block(r);
      }
    }
    return nullptr;
  }
  // Offloads still copying hold device memory that their completion gives back.
  void* finish_pending_moves(const request&) {
    if constexpr (has_events) {
      if (mover_.any_pending()) mover_.complete_ready(true);
    }
    return nullptr;
  }
  void* release_for_request(const request& r) {
    evict_stitches(~std::size_t{0}, true);
    release_free_segments(r.span);
    return nullptr;
  }
  void* release_all_free(const request&) {
    release_free_segments(~std::size_t{0});
    return nullptr;
  }

  // The stitcher's steps, for requests that may stitch.
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

  // ------------------------------------------------------------------ the small pool's segments
  bool lend(std::size_t bytes, stream_ref stream, std::uintptr_t& base) {
    auto& arena = pool_.arena();
    arena.reserve_nodes(1);
    block_type* b = arena.best_fit(stream, bytes);
    if (b == nullptr && adopt(bytes, stream, false)) b = arena.best_fit(stream, bytes);
    if (b == nullptr) b = pool_.add_segment(bytes, stream);
    if (b == nullptr) {
      // Under pressure, cached mappings and fully free large segments make room for small ones.
      evict_stitches(~std::size_t{0}, true);
      if (release_free_segments(bytes) > 0) b = pool_.add_segment(bytes, stream);
    }
    if (b == nullptr) return false;
    pool_.leave_free_queue(b);
    arena.take(b, bytes);
    b->owner = &small_;
    base = b->address;
    return true;
  }
  void take_back(std::uintptr_t base) noexcept {
    block_type* b = pool_.arena().find(base);
    pool_.enter_free_queue(pool_.arena().give_back(b, clocks_.mark_free(b->stream)));
  }

  // ------------------------------------------------------------------ streams
  bool adopt(std::size_t size, stream_ref stream, bool gather) noexcept {
    const auto whole = [this](block_type& b) { return pool_.whole_handles_of(b).size; };
    const auto moved = [this](std::size_t bytes, bool was_whole, block_type* merged) {
      counters_.s.cross_stream_bytes += bytes;
      if (!was_whole) pool_.enter_free_queue(merged);
    };
    return adoption_.adopt(pool_.arena(), clocks_, size, stream, gather, whole, moved);
  }

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
      if (!bring_back_for_free(p, bytes, stream)) return;  // parked: its memory stays far for now
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

  // ------------------------------------------------------------------ eviction and release
  std::size_t evict_stitches([[maybe_unused]] std::size_t bytes, [[maybe_unused]] bool wait) noexcept {
    if constexpr (stitches) {
      return stitcher_.evict(bytes, wait);
    } else {
      return 0;
    }
  }

  // Gives fully free segments back to the backend in Evict order until `bytes` are released.
  // A segment still mapped by a live stitched range stays; cached ranges mapping it are dropped.
  // Memory that queued work may still read is never released: with events, the device is
  // synchronized once per call first (the memory-pressure path, as in PyTorch).
  // With `wait` false nothing waits for the device: segments whose free may still be used by
  // queued work are skipped (kept) instead, and free blocks of different streams are not merged.
  std::size_t release_free_segments(std::size_t bytes, bool wait = true) noexcept {
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
      if constexpr (has_events) {
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
      if constexpr (has_events) {
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

  // The whole free handles inside segments that grow in place (a stream's segment is seldom
  // fully free): each run is split off into a segment of its own and released, highest address
  // first, until `bytes` are. Skipped: runs a live stitched range maps; without `wait`, runs
  // whose free may still be used by queued work or that a cached range maps; everything while an
  // allocation is moved (moves point into segments' handles). O(blocks + runs x ranges).
  std::size_t release_inside_segments(std::size_t bytes, bool wait, bool synchronized) noexcept {
    if (pool_.growable_segments() == 0 || mover_.busy() != 0) return 0;
    struct run {
      segment* home;
      std::size_t lo, hi;
    };
    std::vector<run> runs;
    try {
      pool_.arena().for_each_block([&](const block_type& b) {
        if (!b.free || !pool_type::grows(*b.segment) || b.size < pool_.chunk()) return;
        const auto c = pool_.whole_handles_of(const_cast<block_type&>(b));
        if (c.size == 0 || c.size == b.segment->mapping.size) return;  // a whole free segment went above
        if constexpr (has_events) {
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
        if constexpr (has_events) {
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


  // ------------------------------------------------------------------ offload: the lookups
  // The mover (mover_) keeps every offload's state and does the moves; this allocator finds the
  // allocation and its handle sites, checks what only it knows, and hands the sites over.
  using slot_type = typename pool_type::slot_type;
  using site_type = typename mover_type::site_type;

  /// A live large allocation: its block, or its stitched range.
  struct live_allocation {
    block_type* block = nullptr;
    stitched* range = nullptr;
    stream_ref stream{};
    std::size_t requested = 0;
  };

  live_allocation find_live(std::uintptr_t address) {
    live_allocation a;
    if (block_type* b = pool_.arena().find(address); b != nullptr && !b->free && b->owner == nullptr) {
      a.block = b;
      a.stream = b->stream;
      a.requested = b->requested;
    } else if (stitched* r = find_stitch(address); r != nullptr && r->live) {
      a.range = r;
      a.stream = r->stream;
      a.requested = r->requested;
    }
    return a;
  }

  // The whole handles of a live allocation, where they are mapped, and the segments they are in
  // (for dropping cached stitched ranges over them).
  void sites_of(const live_allocation& a, std::vector<site_type>& sites, std::vector<segment*>& homes) {
    const auto add_within = [&](segment* home, std::size_t lo, std::size_t hi, std::uintptr_t range_at) {
      auto& m = home->mapping;
      for (std::size_t i = m.first_at_or_after(lo); i < m.count && m.slots[i].offset + m.slots[i].size <= hi; ++i) {
        sites.push_back(site_type{&m.slots[i], m.base + m.slots[i].offset,
                                  range_at == 0 ? 0 : range_at + (m.slots[i].offset - lo)});
        homes.push_back(home);
      }
    };
    if (a.block != nullptr) {
      const auto& m = a.block->segment->mapping;
      add_within(a.block->segment, a.block->address - m.base, a.block->address - m.base + a.block->size, 0);
      return;
    }
    if constexpr (stitches) {
      // A range maps its pieces side by side; a piece's claimed block starts where the piece does.
      std::uintptr_t at = a.range->base;
      for (const auto& pc : a.range->pieces) {
        if (pc.claimed != nullptr) add_within(pc.home, pc.offset, pc.offset + pc.claimed->size, at);
        at += pc.size;
      }
    }
  }

  // Nothing queued before now may still use the allocation: the work on `stream` (unless
  // `on_stream` is false: a copy queued there comes after it anyway), on its own stream and on
  // the streams recorded for it has completed.
  void wait_for_uses([[maybe_unused]] const void* p, [[maybe_unused]] stream_ref stream,
                     [[maybe_unused]] stream_ref own, [[maybe_unused]] bool on_stream = true) {
    if constexpr (has_events) {
      auto& events = clocks_.events();
      const auto wait_on = [&](stream_ref s) {
        const auto e = events.record(s);
        events.wait(e);
        events.recycle(e);
      };
      if (on_stream) wait_on(stream);
      if (own != stream) wait_on(own);
      bool used = false;
      deferred_.for_each_use(p, [&](stream_ref) { used = true; });
      // Streams given to record_stream may be gone by now: the device, once.
      if (used) events.synchronize();
    }
  }

  void refuse_capture([[maybe_unused]] const std::string& where, [[maybe_unused]] stream_ref stream,
                      [[maybe_unused]] stream_ref own) {
    if constexpr (capture_aware_reserver<Reserver>) {
      auto& reserver = pool_.backend().reserver();
      if (reserver.is_capturing(stream) || reserver.is_capturing(own)) {
        throw usage_error(usage_error::kind::bad_argument,
                          where + "a stream is capturing a graph: moving memory remaps it at once and would record "
                                  "its copies in the graph instead of running them; move before or after the capture");
      }
    }
  }

  // offload / prefetch: the allocation looked up and checked here, its sites moved by mover_.
  void move_locked(const char* what, void* p, stream_ref stream, bool to_far, move_completion when,
                   stream_ref copies) {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    const std::string where = std::string(name) + "::" + what + ": ";
    if (!mover_.attached()) {
      throw usage_error(usage_error::kind::bad_argument, where + "no far memory is attached (attach_far_memory)");
    }
    if constexpr (has_events && !stream_joining_reserver<Reserver>) {
      if (copies != stream) {
        throw usage_error(usage_error::kind::bad_argument,
                          where + "copies on a stream of their own need a reserver whose streams wait for events "
                                  "(stream_joining_reserver)");
      }
    }
    if (mover_.settle_before_move(where, p, to_far)) return;  // a pending move the other way undone
    const bool away = mover_.moved(address);
    const live_allocation a = find_live(address);
    if ((a.block == nullptr && a.range == nullptr) || (away && mover_.parked(address))) {
      if (small_.owns(p)) {
        throw usage_error(usage_error::kind::bad_argument,
                          where + detail::pointer_text(p) + " is a small allocation (at most small_limit, " +
                              format_bytes(config_.small_limit) +
                              "): it shares a segment of the small pool and does not move");
      }
      throw usage_error(usage_error::kind::foreign_pointer,
                        where + detail::pointer_text(p) + " is not a live allocation of this allocator");
    }
    if (to_far == away) {
      throw usage_error(usage_error::kind::bad_argument,
                        where + detail::pointer_text(p) + (to_far ? " is offloaded already" : " is not offloaded"));
    }
    if (retain_) {
      throw usage_error(usage_error::kind::bad_argument,
                        where + "memory is retained (retain_memory: a CUDA graph's private pool), so no mapping may "
                                "change");
    }
    refuse_capture(where, stream, a.stream);
    if (copies != stream) refuse_capture(where, copies, copies);
    std::vector<site_type> sites;
    std::vector<segment*> homes;
    if (to_far) {
      sites_of(a, sites, homes);
      if (sites.empty()) {
        throw usage_error(usage_error::kind::bad_argument,
                          where + detail::pointer_text(p) + " (" + format_bytes(a.requested) +
                              ") holds no whole handle of its own: its memory shares handles with its neighbours, "
                              "so none of it can move");
      }
    } else {
      sites = mover_.sites_of(address);
    }
    if constexpr (stitches) {
      // Another live stitched allocation may map these handles past the part it claims; moving
      // them would leave its mapping on the old memory.
      for (std::size_t i = 0; i < homes.size(); ++i) {
        const std::size_t lo = sites[i].slot->offset;
        if (stitcher_.live_maps(homes[i], lo, lo + sites[i].slot->size, a.range)) {
          throw usage_error(usage_error::kind::bad_argument,
                            where + detail::pointer_text(p) +
                                ": its memory is also mapped by a live stitched allocation (past the part that one "
                                "uses); it can move once that allocation is freed");
        }
      }
    }
    std::size_t bytes = 0;
    for (const site_type& s : sites) bytes += s.slot->size;
    // Deferred, the copies are queued after the work on `stream` and the remap waits for them:
    // only other streams' uses are waited for now.
    const bool deferred = has_events && when == move_completion::deferred;
    wait_for_uses(p, stream, a.stream, !deferred);
    if constexpr (stitches) {
      for (std::size_t i = 0; i < homes.size(); ++i) {
        const std::size_t lo = sites[i].slot->offset;
        stitcher_.drop_mapping(homes[i], lo, lo + sites[i].slot->size);
      }
    }
    mover_.move(where, p, std::move(sites), bytes, to_far, deferred, stream, copies);
  }

  // Device memory this allocator caches makes room for `bytes` coming back; whether any went.
  bool make_room_for_move(std::size_t bytes) {
    evict_stitches(~std::size_t{0}, true);
    small_.release_free_segments(~std::size_t{0});
    return release_free_segments(bytes) > 0;
  }

  // A free of an offloaded allocation: its memory back on the device (no copy: the bytes are
  // dead), making room from the cache if needed; true then, and the free goes on. Without device
  // memory for it, the allocation is parked instead (false): freed for the caller, its memory
  // left in far memory until release_cached finds it room.
  bool bring_back_for_free(void* p, std::size_t bytes, stream_ref stream) {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    const live_allocation a = find_live(address);
#if GLAKE_CHECKED
    if (a.requested != bytes) detail::throw_size_mismatch(name, p, bytes, a.requested);
#else
    (void)bytes;
#endif
    // Work queued before the free may still use the memory: it waits, as a remap must. A free
    // may come from a deferred free's completion, where nothing may throw: a failed event record
    // waits for the device instead.
    try {
      wait_for_uses(p, stream, a.stream);
    } catch (...) {
      if constexpr (has_events) clocks_.events().synchronize();
    }
    if (mover_.bring_back_dead(address, stream)) return true;
    counters_.on_park(a.requested);
    tell(memory_action::free_completed, address, a.requested, stream);
    if (a.block != nullptr) a.block->requested = 0;
    if (a.range != nullptr) a.range->requested = 0;
    mover_.park(address);
    return false;
  }

  // A parked allocation whose memory came back to the device (mover_.unpark) finishes its free.
  void release_parked(std::uintptr_t address) noexcept {
    const live_allocation a = find_live(address);
    if (a.block != nullptr) {
      counters_.s.allocated_bytes -= a.block->size;
      pool_.enter_free_queue(pool_.arena().give_back(a.block, clocks_.mark_free(a.block->stream)));
    } else if constexpr (stitches) {
      if (a.range != nullptr) stitcher_.release(*a.range, false);
    }
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
  std::size_t large_round_;  ///< large_round_to, or the chunk size
  clocks_type clocks_;
  stitcher_type stitcher_;
  [[no_unique_address]] deferred_type deferred_;
  adoption_type adoption_;
  small_pool small_;
  std::vector<segment*> pinned_;  // scratch: segments a live stitch keeps from release (bounded)
  bool track_completion_ = false;  // events follow frees even with one stream (release_completed)
  live_report live_report_ = detail::default_live_report;
  memory_observer observer_ = nullptr;
  void* observer_context_ = nullptr;
  bool retain_ = false;  // retain_memory: nothing released, unmapped or remapped
  [[no_unique_address]] mutable Lock lock_;
};

static_assert(stream_recording_allocator<stitching_allocator<detail::provider_archetype, detail::reserver_archetype>>);
static_assert(snapshotting_allocator<stitching_allocator<detail::provider_archetype, detail::reserver_archetype>>);
static_assert(observable_allocator<stitching_allocator<detail::provider_archetype, detail::reserver_archetype>>);
static_assert(memory_retaining_allocator<stitching_allocator<detail::provider_archetype, detail::reserver_archetype>>);
static_assert(snapshotting_allocator<
              stitching_allocator<detail::provider_archetype, detail::evented_reserver_archetype, no_stitching>>);
static_assert(memory_limiting_allocator<stitching_allocator<detail::provider_archetype, detail::reserver_archetype>>);
static_assert(owning_allocator<stitching_allocator<detail::provider_archetype, detail::reserver_archetype>>);
static_assert(cache_releasing_allocator<stitching_allocator<detail::provider_archetype, detail::reserver_archetype>>);
static_assert(partly_cache_releasing_allocator<stitching_allocator<detail::provider_archetype, detail::reserver_archetype>>);
static_assert(completion_releasing_allocator<stitching_allocator<detail::provider_archetype, detail::reserver_archetype>>);
static_assert(peak_resetting_allocator<stitching_allocator<detail::provider_archetype, detail::reserver_archetype>>);
static_assert(offloading_allocator<stitching_allocator<detail::provider_archetype, detail::reserver_archetype>>);
static_assert(far_copy_keeping_allocator<stitching_allocator<detail::provider_archetype, detail::reserver_archetype>>);
static_assert(deferring_offloading_allocator<
              stitching_allocator<detail::provider_archetype, detail::evented_reserver_archetype, no_stitching>>);
static_assert(stream_recording_allocator<
              stitching_allocator<detail::provider_archetype, detail::evented_reserver_archetype, no_stitching>>);

}  // namespace glake

#include "glake/allocators/stitching/stitching_verify.hpp"
