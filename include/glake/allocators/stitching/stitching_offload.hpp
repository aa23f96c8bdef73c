// The stitching allocator's side of offload: the lookups (the live allocation at an address, its
// handle sites), the checks only the allocator can make, and the calls that hand the sites to its
// mover (movers/allocation_mover.hpp), which moves them through the backend.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "glake/allocators/stitching/stitcher.hpp"
#include "glake/backends/concepts.hpp"
#include "glake/detail/accounting.hpp"
#include "glake/errors.hpp"
#include "glake/memory_state.hpp"
#include "glake/movers/allocation_mover.hpp"
#include "glake/movers/concepts.hpp"
#include "glake/movers/far_memory.hpp"
#include "glake/statistics.hpp"
#include "glake/stream.hpp"

namespace glake::detail {

// ---------------------------------------------------------------------------------------------
// offload_host
//
// What a stitching_offload asks of the allocator above it, beyond the parts it is built over
// (segment pool, stitcher, clocks, deferred frees, mover): what only the allocator knows.
//
// | expression              | returns | throws | meaning
// |-------------------------|---------|--------|-----------------------------------------------
// | h.small_owns(p)         | bool    | no     | p is a live allocation of the small pool
// | h.small_limit()         | size_t  | no     | the largest request the small pool serves
// | h.retained()            | bool    | no     | memory is retained: no mapping may change
// | h.tell(act, a, n, s)    | void    | no     | the memory observer, if any, hears of it
//
// Model: stitching_allocator's offload_link (allocators/stitching_allocator.hpp).
// ---------------------------------------------------------------------------------------------
template <class H>
concept offload_host = requires(H& h, const void* p, memory_action act, std::uintptr_t a, std::size_t n,
                                stream_ref s) {
  { h.small_owns(p) } -> std::same_as<bool>;
  { h.small_limit() } noexcept -> std::same_as<std::size_t>;
  { h.retained() } noexcept -> std::same_as<bool>;
  { h.tell(act, a, n, s) } noexcept;
};

// ---------------------------------------------------------------------------------------------
// allocation_offloading
//
// What the stitching allocator asks of its offload part, under its lock. `p` is an allocation's
// address, `w` the name of the public call ("offload", "prefetch") for error messages, `out`
// whether the move goes to far memory, `mc` a move_completion, `s` / `c` the stream ordering the
// move and the one its copies run on.
//
// | expression                    | returns | throws              | meaning
// |-------------------------------|---------|---------------------|-------------------------------
// | o.move(w, p, s, out, mc, c)   | void    | usage_error,        | p checked, its handle sites
// |                               |         | out_of_memory,      | found and handed to the mover;
// |                               |         | driver_error        | all or nothing
// | o.keep_far_copy(p, b)         | void    | usage_error,        | marks (b) or unmarks p
// |                               |         | bad_alloc           |
// | o.movable_bytes(p)            | size_t  | bad_alloc           | what move would move now; 0
// |                               |         |                     | when it would refuse
// | o.bring_back_for_free(p, n, s)| bool    | usage_error (size,  | a free of p while offloaded:
// |                               |         | checked builds)     | true when its memory came back
// |                               |         |                     | (the free goes on), false when
// |                               |         |                     | it was parked
// | o.release_parked(a)           | void    | no                  | a parked allocation finishes
// |                               |         |                     | its free
//
// Model: stitching_offload. attach(host, copier, away), a template, attaches far memory.
// ---------------------------------------------------------------------------------------------
template <class O>
concept allocation_offloading = requires(O& o, const char* w, void* p, stream_ref s, bool b, move_completion mc,
                                         std::size_t n, std::uintptr_t a) {
  { o.move(w, p, s, b, mc, s) } -> std::same_as<void>;
  { o.keep_far_copy(p, b) } -> std::same_as<void>;
  { o.movable_bytes(p) } -> std::same_as<std::size_t>;
  { o.bring_back_for_free(p, n, s) } -> std::same_as<bool>;
  { o.release_parked(a) } noexcept;
};

/// Finds a live large allocation of a stitching allocator (a block of its segment pool, or a
/// stitched range of its stitcher) and its whole handles, checks what the allocator alone can
/// check (far memory attached, not small, not retained, no graph capturing, no other live stitch
/// mapping its handles), waits for the work that may use it, drops the cached stitched ranges
/// over its handles, and hands the sites to the Mover (allocation_moving), which keeps every
/// offload's state and moves the handles through the backend. docs/offload.md, "Who owns what",
/// says where the lines run.
/// Complexity: O(log n) per lookup; O(handles + live stitches) per check; a move costs O(its
/// handles) driver calls (the Mover's). Thread safety: none (the allocator calls it under its
/// lock). Streams: as the allocator's offload (it waits for the allocation's own stream and the
/// streams recorded for it).
template <class Pool, class Clocks, class Stitcher, class Stitched, class Deferred, allocation_moving Mover,
          offload_host Host>
class stitching_offload {
  using segment = typename Pool::segment;
  using block_type = typename Pool::block_type;
  using site_type = typename Mover::site_type;
  using reserver_type = std::remove_reference_t<decltype(std::declval<Pool&>().backend().reserver())>;
  static constexpr bool stitches = !std::is_same_v<Stitcher, no_stitcher>;
  static constexpr bool has_events = Clocks::has_events;
  static constexpr const char* name = "glake::stitching_allocator";

 public:
  stitching_offload(Pool& pool, Clocks& clocks, Stitcher& stitcher, Deferred& deferred, Mover& mover,
                    usage_counters& counters, Host host)
      : pool_(pool), clocks_(clocks), stitcher_(stitcher), deferred_(deferred), mover_(mover), counters_(counters),
        host_(host) {}
  stitching_offload(const stitching_offload&) = delete;
  stitching_offload& operator=(const stitching_offload&) = delete;

  /// Far memory of `host`'s handles, its bytes moved by `copier`; `unmapped`: far handles keep a
  /// home mapping of their own, and an allocation away is unmapped at its addresses.
  template <class FarHost, class Copier>
  void attach(FarHost host, Copier copier, far_residence away) {
    if (mover_.busy() != 0) {
      throw usage_error(usage_error::kind::bad_state,
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
    std::unique_ptr<typename Mover::far_type> far;
    if (away == far_residence::unmapped) {
      // Far handles keep a home mapping of their own (a copy of this reserver maps it): moves
      // copy straight to and from it.
      far = std::make_unique<far_memory_of<FarHost, Copier, reserver_type>>(
          std::move(host), std::move(copier), reserver_type(pool_.backend().reserver()));
    } else {
      far = std::make_unique<far_memory_of<FarHost, Copier>>(std::move(host), std::move(copier));
    }
    mover_.attach(std::move(far), away == far_residence::unmapped);
    pool_.set_far_releaser(&Mover::release_far_handle, &mover_);
  }

  void keep_far_copy(const void* p, bool keep) {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    const std::string where = std::string(name) + "::keep_far_copy: ";
    if (!mover_.attached()) throw usage_error(usage_error::kind::bad_state, where + "no far memory is attached (attach_far_memory)");
    const live_allocation a = find_live(address);
    if ((a.block == nullptr && a.range == nullptr) || mover_.parked(address)) {
      throw usage_error(usage_error::kind::foreign_pointer,
                        where + pointer_text(p) + " is not a live large allocation of this allocator");
    }
    if (keep) {
      mover_.mark_clean(address);
      return;
    }
    mover_.unmark_clean(address);
  }

  std::size_t movable_bytes(const void* p) {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    if (!mover_.attached() || host_.retained() || mover_.moved(address) || mover_.moving(address)) return 0;
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

  // offload / prefetch: the allocation looked up and checked here, its sites moved by the mover.
  void move(const char* what, void* p, stream_ref stream, bool to_far, move_completion when, stream_ref copies) {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    const std::string where = std::string(name) + "::" + what + ": ";
    if (!mover_.attached()) {
      throw usage_error(usage_error::kind::bad_state, where + "no far memory is attached (attach_far_memory)");
    }
    if constexpr (has_events && !stream_joining_reserver<reserver_type>) {
      if (copies != stream) {
        throw usage_error(usage_error::kind::unsupported,
                          where + "copies on a stream of their own need a reserver whose streams wait for events "
                                  "(stream_joining_reserver)");
      }
    }
    if (mover_.settle_before_move(where, p, to_far)) return;  // a pending move the other way undone
    const bool away = mover_.moved(address);
    const live_allocation a = find_live(address);
    if ((a.block == nullptr && a.range == nullptr) || (away && mover_.parked(address))) {
      if (host_.small_owns(p)) {
        throw usage_error(usage_error::kind::bad_argument,
                          where + pointer_text(p) + " is a small allocation (at most small_limit, " +
                              format_bytes(host_.small_limit()) +
                              "): it shares a segment of the small pool and does not move");
      }
      throw usage_error(usage_error::kind::foreign_pointer,
                        where + pointer_text(p) + " is not a live allocation of this allocator");
    }
    if (to_far == away) {
      throw usage_error(usage_error::kind::bad_state,
                        where + pointer_text(p) + (to_far ? " is offloaded already" : " is not offloaded"));
    }
    if (host_.retained()) {
      throw usage_error(usage_error::kind::bad_state,
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
                          where + pointer_text(p) + " (" + format_bytes(a.requested) +
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
          throw usage_error(usage_error::kind::bad_state,
                            where + pointer_text(p) +
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

  // A free of an offloaded allocation: its memory back on the device (no copy: the bytes are
  // dead), making room from the cache if needed; true then, and the free goes on. Without device
  // memory for it, the allocation is parked instead (false): freed for the caller, its memory
  // left in far memory until release_cached finds it room.
  bool bring_back_for_free(void* p, std::size_t bytes, stream_ref stream) {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    const live_allocation a = find_live(address);
#if GLAKE_CHECKED
    if (a.requested != bytes) throw_size_mismatch(name, p, bytes, a.requested);
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
    host_.tell(memory_action::free_completed, address, a.requested, stream);
    if (a.block != nullptr) a.block->requested = 0;
    if (a.range != nullptr) a.range->requested = 0;
    mover_.park(address);
    return false;
  }

  // A parked allocation whose memory came back to the device (the mover's unpark) finishes its free.
  void release_parked(std::uintptr_t address) noexcept {
    const live_allocation a = find_live(address);
    if (a.block != nullptr) {
      counters_.s.allocated_bytes -= a.block->size;
      pool_.enter_free_queue(pool_.arena().give_back(a.block, clocks_.mark_free(a.block->stream)));
    } else if constexpr (stitches) {
      if (a.range != nullptr) stitcher_.release(*a.range, false);
    }
  }

 private:
  /// A live large allocation: its block, or its stitched range.
  struct live_allocation {
    block_type* block = nullptr;
    Stitched* range = nullptr;
    stream_ref stream{};
    std::size_t requested = 0;
  };

  live_allocation find_live(std::uintptr_t address) {
    live_allocation a;
    if (block_type* b = pool_.arena().find(address); b != nullptr && !b->free && b->owner == nullptr) {
      a.block = b;
      a.stream = b->stream;
      a.requested = b->requested;
    } else if constexpr (stitches) {
      if (Stitched* r = stitcher_.find(address); r != nullptr && r->live) {
        a.range = r;
        a.stream = r->stream;
        a.requested = r->requested;
      }
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
    if constexpr (capture_aware_reserver<reserver_type>) {
      auto& reserver = pool_.backend().reserver();
      if (reserver.is_capturing(stream) || reserver.is_capturing(own)) {
        throw usage_error(usage_error::kind::bad_state,
                          where + "a stream is capturing a graph: moving memory remaps it at once and would record "
                                  "its copies in the graph instead of running them; move before or after the capture");
      }
    }
  }

  Pool& pool_;
  Clocks& clocks_;
  Stitcher& stitcher_;
  Deferred& deferred_;
  Mover& mover_;
  usage_counters& counters_;
  Host host_;
};

}  // namespace glake::detail
