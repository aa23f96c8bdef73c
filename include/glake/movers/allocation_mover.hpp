// The mover of an allocator's memory: which live allocations are in far memory, which moves
// are still copying, which allocations keep a clean far copy, which freed ones wait there, and
// which addresses a failed remap left unmapped; the allocator finds the handle sites, this moves
// them.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "glake/backends/concepts.hpp"
#include "glake/detail/accounting.hpp"
#include "glake/detail/archetypes.hpp"
#include "glake/detail/driver_meter.hpp"
#include "glake/detail/vmm_backend.hpp"
#include "glake/errors.hpp"
#include "glake/movers/concepts.hpp"
#include "glake/movers/far_memory.hpp"
#include "glake/movers/handle_exchange.hpp"
#include "glake/movers/handle_mover.hpp"
#include "glake/statistics.hpp"
#include "glake/stream.hpp"

namespace glake {

// ---------------------------------------------------------------------------------------------
// mover_host
//
// What an allocation_mover asks of the allocator whose memory it moves: the narrow interface
// through which the mover calls back. The allocator finds an allocation's handle sites (its
// lookups) and hands them to the mover; the mover makes, copies, maps and releases handles
// through the backend, and calls back only through these.
//
// | expression          | returns          | throws | meaning
// |---------------------|------------------|--------|-----------------------------------------
// | h.backend()         | H::backend_type& | no     | the allocator's vmm backend: handles,
// |                     |                  |        | ranges and maps of device memory
// | h.events()          | H::events_type&  | no     | its counted events (only where
// |                     |                  |        | H::events_type::real)
// | h.counters()        | usage_counters&  | no     | its statistics: offloaded and reserved
// |                     |                  |        | bytes change with each move
// | h.make_room(n)      | bool             | no     | gives cached device memory back for n
// |                     |                  |        | bytes coming back; whether any went
// | h.retained()        | bool             | no     | memory is retained: no mapping may change
// | h.release_parked(a) | void             | no     | the parked allocation at a, its memory
// |                     |                  |        | back on the device, finishes its free
//
// Model: stitching_allocator's mover_link (allocators/stitching_allocator.hpp).
// ---------------------------------------------------------------------------------------------
template <class H>
concept mover_host = requires(H& h, std::size_t bytes, std::uintptr_t address) {
  typename H::backend_type;
  typename H::events_type;
  { h.backend() } noexcept -> std::same_as<typename H::backend_type&>;
  { h.counters() } noexcept -> std::same_as<detail::usage_counters&>;
  { h.make_room(bytes) } -> std::same_as<bool>;
  { h.retained() } noexcept -> std::same_as<bool>;
  { h.release_parked(address) } noexcept -> std::same_as<void>;
} && (!H::events_type::real || requires(H& h) {
  { h.events() } noexcept -> std::same_as<typename H::events_type&>;
});

// ---------------------------------------------------------------------------------------------
// allocation_moving
//
// What an allocator asks of its mover. `a` is an allocation's address, `sites` its handle sites
// as the allocator found them (detail::handle_site), `w` the message prefix of errors.
//
// | expression                           | returns   | throws            | meaning
// |--------------------------------------|-----------|-------------------|------------------------
// | m.attach(far, unmapped)              | void      | no                | far memory to move to
// | m.attached()                         | bool      | no                | whether there is some
// | m.moved(a) / m.moving(a)             | bool      | no                | in far memory / a move
// |                                      |           |                   | of it still copying
// | m.parked(a)                          | bool      | no                | freed while away
// | m.residence_at(a)                    | residence | no                | where it is, or where
// |                                      |           |                   | its pending move goes
// | m.move(w, p, sites, n, out, deferred,| void      | out_of_memory,    | moves its sites out
// |        s, c)                         |           | driver_error      | (`out`) or back; all or
// |                                      |           |                   | nothing
// | m.complete_ready(wait)               | size_t    | no                | deferred moves whose
// |                                      |           |                   | copies are done complete
// | m.bring_back_dead(a, s)              | bool      | no                | a free's memory back
// |                                      |           |                   | without a copy
// | m.park(a) / m.unpark()               | void      | no                | a freed allocation waits
// |                                      |           |                   | away / those that fit
// |                                      |           |                   | come back
// | m.mark_clean(a) / m.unmark_clean(a)  | void      | bad_alloc / no    | keep_far_copy
// | m.clean_bytes()                      | size_t    | no                | far memory clean copies
// |                                      |           |                   | hold
// | m.restore_mappings()                 | void      | no                | before teardown: every
// |                                      |           |                   | address mapped again
//
// Model: allocation_mover.
// ---------------------------------------------------------------------------------------------
template <class M>
concept allocation_moving = requires(M& m, const M& cm, std::uintptr_t a, const std::string& w, void* p,
                                     std::vector<typename M::site_type> sites, std::size_t n, bool b, stream_ref s,
                                     std::unique_ptr<typename M::far_type> far) {
  { m.attach(std::move(far), b) } noexcept;
  { cm.attached() } noexcept -> std::same_as<bool>;
  { cm.moved(a) } -> std::same_as<bool>;
  { cm.moving(a) } -> std::same_as<bool>;
  { cm.parked(a) } -> std::same_as<bool>;
  { cm.residence_at(a) } -> std::same_as<residence>;
  { m.move(w, p, std::move(sites), n, b, b, s, s) } -> std::same_as<void>;
  { m.complete_ready(b) } noexcept -> std::same_as<std::size_t>;
  { m.bring_back_dead(a, s) } noexcept -> std::same_as<bool>;
  { m.park(a) } noexcept;
  { m.unpark() } noexcept;
  { m.mark_clean(a) };
  { m.unmark_clean(a) } noexcept;
  { cm.clean_bytes() } noexcept -> std::same_as<std::size_t>;
  { m.restore_mappings() } noexcept;
};

/// Moves an allocator's live allocations between the device and far memory under the same
/// addresses, and keeps what that needs: the allocations in far memory (with their sites), the
/// deferred moves still copying, the clean far copies of allocations marked keep_far_copy, the
/// allocations freed while away (parked), and the mapping holes a failed remap left.
///
/// The allocator looks an allocation up and hands its handle sites over (detail::handle_site);
/// each move runs through detail::handle_move to the backend, and back into the allocator only
/// through the Host (mover_host). docs/offload.md, "Who owns what", says where the line runs.
///
/// Handover: a move back needs device handles; pending offloads (deferred, still holding theirs)
/// whose handles have the sizes wanted complete first and hand them over through a
/// handle_exchange, so neither releases nor creates one and the device never holds both. Those
/// whose copies are done go first; the others only when the device has no room for the move
/// back, waiting for their copies (a handle is handed over only after the copies out of it).
///
/// Costs: each move's backend calls, handles made and reused, and host time are counted by kind
/// (statistics::offloads, statistics::prefetches; a free's move back is neither).
///
/// Complexity: O(log n) per lookup for n allocations in far memory or moving; a move costs
/// O(its handles) driver calls, and a move back O(pending moves) more to find handles to take
/// over. Thread safety: none; the allocator calls it under its lock.
/// Streams: copies are ordered on the stream given; a deferred move completes once the event
/// recorded after its copies has (Host's events).
template <mover_host Host, class Slot>
class allocation_mover {
  using backend_type = typename Host::backend_type;
  using events_type = typename Host::events_type;
  using reserver_type = std::remove_reference_t<decltype(std::declval<backend_type&>().reserver())>;
  static constexpr bool has_events = events_type::real;

 public:
  using handle_type = typename backend_type::handle_type;
  using site_type = detail::handle_site<Slot>;
  using far_type = far_memory<handle_type>;
  using move_type = detail::handle_move<backend_type, Slot>;

  /// An allocation whose memory is in far memory: its handles' sites, their bytes, and whether
  /// it was freed meanwhile (parked: its memory waits there for device memory to come back to).
  struct moved_allocation {
    std::vector<site_type> sites;
    std::size_t bytes = 0;
    bool parked = false;
  };
  /// A marked allocation's clean far copy (keep_far_copy): the far handles of its sites, in
  /// their order, while it is on the device; empty otherwise.
  struct far_copy {
    std::vector<handle_type> handles;
    std::size_t bytes = 0;
  };
  using moved_map = std::map<std::uintptr_t, moved_allocation>;
  using far_copy_map = std::map<std::uintptr_t, far_copy>;
  /// A move whose copies were queued and whose remap waits for them (move_completion::deferred):
  /// the allocation at its address is, until then, physically where it was.
  struct pending_move {
    std::unique_ptr<move_type> move;
    typename events_type::event_type copied{};  // recorded after the copies
    typename moved_map::node_type record;       // an offload's entry in moved_, made up front
    bool joined = false;                        // a stream waits for its copies (ready_on)
  };
  using pending_map = std::map<std::uintptr_t, pending_move>;

  explicit allocation_mover(Host host) noexcept : host_(std::move(host)) {}
  allocation_mover(const allocation_mover&) = delete;
  allocation_mover& operator=(const allocation_mover&) = delete;

  // ---------------------------------------------------------------- far memory
  bool attached() const noexcept { return far_ != nullptr; }
  bool away_unmapped() const noexcept { return away_unmapped_; }
  /// Allocations in (or moving to or from) far memory.
  std::size_t busy() const noexcept { return moved_.size() + pending_.size(); }
  /// Copies in the far memory attached now go; the marks stay.
  void release_far_copies() noexcept {
    for (auto& [address, c] : clean_) release_far_copy(c);
  }
  void attach(std::unique_ptr<far_type> far, bool away_unmapped) noexcept {
    far_ = std::move(far);
    away_unmapped_ = away_unmapped;
  }
  /// Far handles kept for the next offloads go back.
  void trim() noexcept {
    if (far_) far_->trim();
  }
  /// For the backend's segments given back (vmm_backend::destroy_segment): far handles go to far
  /// memory. `context` is the mover.
  static void release_far_handle(void* context, handle_type handle) noexcept {
    static_cast<allocation_mover*>(context)->far_->release(handle);
  }

  // ---------------------------------------------------------------- where allocations are
  bool moved(std::uintptr_t address) const { return moved_.contains(address); }
  bool moving(std::uintptr_t address) const { return pending_.contains(address); }
  bool any_moved() const noexcept { return !moved_.empty(); }
  bool any_pending() const noexcept { return !pending_.empty(); }
  /// Freed while away, its memory still in far memory.
  bool parked(std::uintptr_t address) const {
    if (moved_.empty()) return false;
    const auto it = moved_.find(address);
    return it != moved_.end() && it->second.parked;
  }
  std::size_t parked_count() const noexcept { return parked_; }
  /// The sites of an allocation in far memory (moved(address)).
  const std::vector<site_type>& sites_of(std::uintptr_t address) const { return moved_.find(address)->second.sites; }
  /// Where the live allocation at `address` is, or where its pending move takes it.
  residence residence_at(std::uintptr_t address) const {
    if (auto it = pending_.find(address); it != pending_.end()) {
      return it->second.move->to_far() ? residence::host : residence::device;
    }
    return moved_.contains(address) ? residence::host : residence::device;
  }

  // ---------------------------------------------------------------- clean far copies
  void mark_clean(std::uintptr_t address) { clean_.try_emplace(address); }
  bool marked_clean(std::uintptr_t address) const { return !clean_.empty() && clean_.contains(address); }
  /// Unmarks `address`: a pending move of it completes first, then its copy goes.
  void unmark_clean(std::uintptr_t address) noexcept {
    const auto it = clean_.find(address);
    if (it == clean_.end()) return;
    if constexpr (has_events) {
      if (auto pit = pending_.find(address); pit != pending_.end()) complete_pending(pit, true);
    }
    drop_far_copy(it);
  }
  /// A free of `address`: its clean copy and its mark go.
  void forget_clean(std::uintptr_t address) noexcept {
    if (clean_.empty()) return;
    if (const auto c = clean_.find(address); c != clean_.end()) drop_far_copy(c);
  }
  std::size_t clean_bytes() const noexcept { return clean_bytes_; }

  // ---------------------------------------------------------------- moves
  /// Completes the pending move of `address`, if any, waiting for its copies.
  void complete(std::uintptr_t address) noexcept {
    if constexpr (has_events) {
      if (auto it = pending_.find(address); it != pending_.end()) complete_pending(it, true);
    }
  }

  /// Work queued on `stream` from now on may use the allocation at `address` (ready_on).
  void ready_on([[maybe_unused]] std::uintptr_t address, [[maybe_unused]] stream_ref stream) {
    if constexpr (has_events) {
      const auto it = pending_.find(address);
      if (it == pending_.end()) return;
      if constexpr (stream_joining_reserver<reserver_type>) {
        if (away_unmapped_ && !it->second.move->to_far()) {
          host_.events().join(stream, it->second.copied);
          it->second.joined = true;
          return;
        }
      }
      complete_pending(it, true);
    }
  }

  /// Before a move of `p` (to far memory with `to_far`): a pending move of it the same way is
  /// a usage_error; one the other way is undone (true: nothing more to do) or, when work may use
  /// the memory already (ready_on), completed. Other pending moves whose copies are done complete.
  bool settle_before_move([[maybe_unused]] const std::string& where, [[maybe_unused]] const void* p,
                          [[maybe_unused]] bool to_far) {
    if constexpr (has_events) {
      if (!pending_.empty()) {
        if (auto pit = pending_.find(reinterpret_cast<std::uintptr_t>(p)); pit != pending_.end()) {
          if (pit->second.move->to_far() == to_far) {
            throw usage_error(usage_error::kind::bad_state,
                              where + detail::pointer_text(p) +
                                  (to_far ? " is offloaded already (its move is pending)"
                                          : " is not offloaded (it is coming back to the device)"));
          }
          if (!pit->second.joined) {
            // The opposite of a pending move: undone once its copies are done, nothing copied back.
            cancel_pending(pit);
            return true;
          }
          // Work may use the memory already (ready_on): the move completes, then this one runs.
          complete_pending(pit, true);
        }
        // Offloads whose copies are done wait for a move back: it takes their handles over.
        complete_ready(false, to_far);
      }
    }
    return false;
  }

  /// Moves the allocation at `p`, whose uses the allocator has waited for, with `sites`
  /// (`bytes` in all): to far memory (`to_far`) or back. Deferred (`deferred`), the copies are
  /// queued on `copies` and the remap comes later (start_deferred); otherwise the move completes
  /// here. Marked allocations (keep_far_copy) move out to their clean copy and back keeping the
  /// far handles. out_of_memory (nothing moved) when far memory, or the device, runs out.
  void move(const std::string& where, void* p, std::vector<site_type> sites, std::size_t bytes, bool to_far,
            bool deferred, stream_ref stream, stream_ref copies) {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    far_copy* clean = to_far ? usable_far_copy(address, sites, bytes) : nullptr;
    const bool keep = !to_far && marked_clean(address);
    if (deferred) {
      start_deferred(where, p, sites, bytes, to_far, stream, copies, clean, keep);
      return;
    }
    // Every use has completed (waited for by the allocator): the copies may go on any stream.
    if (to_far) {
      // The entry in moved_ is made first, so that recording the finished move cannot fail.
      const auto entry = moved_.emplace(address, moved_allocation{}).first;
      try {
        const move_meter meter(*this, true);
        if (move_sites(sites, true, true, copies, clean) == detail::move_outcome::out_of_memory) {
          throw_move_out_of_memory(where, p, bytes, to_far);
        }
      } catch (...) {
        moved_.erase(entry);
        throw;
      }
      if (clean != nullptr) far_copy_used(*clean);
      host_.counters().on_move_out(bytes);
      ++host_.counters().s.offloads.moves;
      entry->second = moved_allocation{std::move(sites), bytes, false};
      return;
    }
    std::vector<handle_type> kept;
    const detail::move_outcome r = with_handover(sites, bytes, [&] {
      const move_meter meter(*this, false);
      return move_sites(sites, false, true, copies, nullptr, keep ? &kept : nullptr, &exchange_);
    });
    if (r == detail::move_outcome::out_of_memory) throw_move_out_of_memory(where, p, bytes, to_far);
    host_.counters().on_move_in(bytes);
    ++host_.counters().s.prefetches.moves;
    moved_.erase(address);
    keep_replaced(address, std::move(kept), bytes);
  }

  /// A free of the offloaded allocation at `address`: its memory back on the device without a
  /// copy (the bytes are dead), making room from the cache if needed. True when it came back;
  /// false when the device has no room (the allocator parks it then). Never throws.
  bool bring_back_dead(std::uintptr_t address, stream_ref stream) noexcept {
    moved_allocation& m = moved_.find(address)->second;
    detail::move_outcome r = detail::move_outcome::out_of_memory;
    try {
      r = move_sites(m.sites, false, false, stream);
      if (r == detail::move_outcome::out_of_memory && !host_.retained() && host_.make_room(m.bytes)) {
        r = move_sites(m.sites, false, false, stream);
      }
    } catch (...) {
      r = detail::move_outcome::out_of_memory;  // a free does not fail: park it
    }
    if (r != detail::move_outcome::moved) return false;
    host_.counters().on_move_in(m.bytes);
    moved_.erase(address);
    return true;
  }
  /// The allocation at `address` (in far memory) was freed: its memory waits there.
  void park(std::uintptr_t address) noexcept {
    moved_.find(address)->second.parked = true;
    ++parked_;
  }
  /// Parked allocations whose memory can come back to the device now finish their free
  /// (Host::release_parked).
  void unpark() noexcept {
    for (auto it = moved_.begin(); it != moved_.end();) {
      moved_allocation& m = it->second;
      if (!m.parked) {
        ++it;
        continue;
      }
      detail::move_outcome r = detail::move_outcome::out_of_memory;
      try {
        r = move_sites(m.sites, false, false, default_stream);
      } catch (...) {
      }
      if (r != detail::move_outcome::moved) {
        ++it;
        continue;
      }
      host_.counters().on_move_in(m.bytes);
      const std::uintptr_t address = it->first;
      it = moved_.erase(it);
      --parked_;
      host_.release_parked(address);
    }
  }

  // ---------------------------------------------------------------- deferred moves
  /// Completes the pending moves whose copies are done (all, waiting, with `wait`); how many.
  /// Without `offloads`, only moves back.
  std::size_t complete_ready([[maybe_unused]] bool wait, [[maybe_unused]] bool offloads = true) noexcept {
    std::size_t completed = 0;
    if constexpr (has_events) {
      for (auto it = pending_.begin(); it != pending_.end();) {
        auto next = std::next(it);
        if ((offloads || !it->second.move->to_far()) &&
            (wait || host_.events().done_or_not_yet(it->second.copied))) {
          complete_pending(it, wait);
          ++completed;
        }
        it = next;
      }
    }
    return completed;
  }
  /// A free of `address`: a move of it still copying is undone first, the memory stays where it
  /// was (one that work may use already, ready_on, completes instead).
  void undo(std::uintptr_t address) noexcept {
    if (auto it = pending_.find(address); it != pending_.end()) undo_pending(it);
  }

  // ---------------------------------------------------------------- teardown
  /// Every pending move undone (or completed, where work may use it).
  void undo_all() noexcept {
    while (!pending_.empty()) undo_pending(pending_.begin());
  }
  /// Before the allocator gives its segments and ranges back: clean copies go, and every address
  /// a failed remap left unmapped, or (far_residence::unmapped) an allocation still away left
  /// unmapped, is mapped again, so that giving them back unmaps what is mapped.
  void restore_mappings() noexcept {
    while (!clean_.empty()) drop_far_copy(clean_.begin());
    auto& backend = host_.backend();
    for (const auto& [address, h] : holes_) {
      try {
        backend.try_map_handle(reinterpret_cast<void*>(address), h.size, h.handle);
      } catch (...) {
      }
    }
    holes_.clear();
    if (away_unmapped_) {
      for (auto& [address, m] : moved_) {
        for (const site_type& site : m.sites) {
          const std::uintptr_t addresses[] = {site.home, site.range};
          for (const std::uintptr_t at : addresses) {
            if (at == 0) continue;
            try {
              backend.try_map_handle(reinterpret_cast<void*>(at), site.slot->size, site.slot->handle);
            } catch (...) {
            }
          }
        }
      }
    }
  }

  // ---------------------------------------------------------------- invariants
  /// Device bytes pending prefetches hold (made, not mapped home yet); `fail` when a pending move
  /// disagrees with the allocations in far memory.
  template <class Fail>
  std::size_t verify_pending(Fail&& fail) const {
    std::size_t coming_in = 0;
    for (const auto& [address, m] : pending_) {
      if (!m.move->to_far()) coming_in += m.move->bytes();
      if (!m.move->to_far() != moved_.contains(address)) fail("a pending move disagrees with the moved allocations");
    }
    return coming_in;
  }
  /// `fail` unless the allocations in far memory agree with their handles, `offloaded` bytes
  /// and the parked count.
  template <class Fail>
  void verify_moved(Fail&& fail, std::size_t offloaded) const {
    std::size_t moved_bytes = 0, parked = 0;
    for (const auto& [address, m] : moved_) {
      std::size_t bytes = 0;
      for (const auto& site : m.sites) {
        if (!site.slot->far) fail("an offloaded allocation's handle is not far memory's");
        bytes += site.slot->size;
      }
      if (bytes != m.bytes) fail("an offloaded allocation's bytes disagree with its handles");
      moved_bytes += bytes;
      parked += m.parked ? 1 : 0;
    }
    if (moved_bytes != offloaded) fail("offloaded bytes disagree with offloaded allocations");
    if (parked != parked_) fail("parked allocations miscounted");
  }

 private:
  // The copy's far handles go back; the mark stays.
  void release_far_copy(far_copy& c) noexcept {
    for (const auto& h : c.handles) far_->release(h);
    clean_bytes_ -= c.bytes;
    c = far_copy{};
  }
  // The copy and the mark go.
  void drop_far_copy(typename far_copy_map::iterator it) noexcept {
    release_far_copy(it->second);
    clean_.erase(it);
  }
  // The clean far copy to use for moving the allocation at `address` out with `sites`: none
  // when it is unmarked, has no copy, or its sites no longer match the copy (then it goes).
  far_copy* usable_far_copy(std::uintptr_t address, std::span<const site_type> sites, std::size_t bytes) noexcept {
    if (clean_.empty()) return nullptr;
    const auto it = clean_.find(address);
    if (it == clean_.end() || it->second.handles.empty()) return nullptr;
    if (it->second.handles.size() == sites.size() && it->second.bytes == bytes) return &it->second;
    release_far_copy(it->second);
    return nullptr;
  }
  // A move out that used the clean far copy finished: its handles are the slots' now.
  void far_copy_used(far_copy& c) noexcept {
    clean_bytes_ -= c.bytes;
    c.handles.clear();
    c.bytes = 0;
  }
  // A move back of a marked allocation finished: the far handles it replaced become its clean
  // copy (released when it was unmarked meanwhile, or when recording it fails).
  void keep_replaced(std::uintptr_t address, std::vector<handle_type> handles, std::size_t bytes) noexcept {
    if (handles.empty()) return;
    const auto it = clean_.find(address);
    if (it == clean_.end() || !it->second.handles.empty()) {
      for (const auto& h : handles) far_->release(h);
      return;
    }
    it->second.handles = std::move(handles);
    it->second.bytes = bytes;
    clean_bytes_ += bytes;
  }

  // A move in one call; out to a marked allocation's clean far copy (`clean`), or back keeping
  // the far handles it replaces (in `kept`).
  detail::move_outcome move_sites(std::span<const site_type> sites, bool to_far, bool copy, stream_ref stream,
                                  const far_copy* clean = nullptr, std::vector<handle_type>* kept = nullptr,
                                  handle_exchange<handle_type>* exchange = nullptr) {
    const auto wait_copies = [&] {
      if constexpr (has_events) {
        auto& events = host_.events();
        const auto e = events.record(stream);
        events.wait(e);
        events.recycle(e);
      }
    };
    return detail::move_handles(host_.backend(), *far_, sites, to_far, copy, stream, wait_copies, away_unmapped_,
                                clean != nullptr ? std::span<const handle_type>(clean->handles)
                                                 : std::span<const handle_type>(),
                                kept, &holes_, exchange);
  }

  // Queues the copies of a deferred move and records it; completes it at once when the copies
  // are done already. Out of memory for the new handles: out_of_memory, nothing changed.
  // With `copies` other than `stream`, the copies wait there for the work queued on `stream`.
  // A move out to a clean far copy (`clean`) copies nothing: it completes once the work queued
  // on `stream` is done. A move back with `keep` keeps the far handles it replaces.
  void start_deferred([[maybe_unused]] const std::string& where, [[maybe_unused]] void* p,
                      [[maybe_unused]] const std::vector<site_type>& sites, [[maybe_unused]] std::size_t bytes,
                      [[maybe_unused]] bool to_far, [[maybe_unused]] stream_ref stream,
                      [[maybe_unused]] stream_ref copies, [[maybe_unused]] far_copy* clean,
                      [[maybe_unused]] bool keep) {
    if constexpr (has_events) {
      auto& events = host_.events();
      const auto wait_copies = [&] {
        const auto e = events.record(copies);
        events.wait(e);
        events.recycle(e);
      };
      auto move = std::make_unique<move_type>(host_.backend(), *far_, std::span<const site_type>(sites), to_far,
                                              away_unmapped_);
      if (clean != nullptr) move->use_handles(clean->handles);
      if (keep) move->keep_replaced();
      if (!to_far) move->take_from(&exchange_);
      move->note_holes(&holes_);
      // The event completion waits for: after the copies, or after the work on `stream`.
      const stream_ref done_on = clean != nullptr ? stream : copies;
      const auto start = [&] {
        if constexpr (stream_joining_reserver<reserver_type>) {
          if (copies != stream && clean == nullptr) {
            const auto used = events.record(stream);
            try {
              events.join(copies, used);
            } catch (...) {
              events.recycle(used);
              throw;
            }
            events.recycle(used);
          }
        }
        const move_meter meter(*this, to_far);
        return move->start(clean == nullptr, copies, wait_copies);
      };
      // A move back keeps exchange_ (a member: it outlives the move) to count there, once
      // finished, the handles it took.
      const detail::move_outcome r = to_far ? start() : with_handover(sites, bytes, start);
      if (r == detail::move_outcome::out_of_memory) throw_move_out_of_memory(where, p, bytes, to_far);
      const auto address = reinterpret_cast<std::uintptr_t>(p);
      typename pending_map::iterator it;
      try {
        it = pending_.emplace(address, pending_move{}).first;
        try {
          if (to_far) {
            moved_map one;  // the entry completion will add to moved_, so that adding cannot fail
            one.emplace(address, moved_allocation{});
            it->second.record = one.extract(one.begin());
          }
          it->second.copied = events.record(done_on);
        } catch (...) {
          pending_.erase(it);
          throw;
        }
      } catch (...) {
        events.synchronize();  // the copies may still write the new handles
        throw;                 // move's destructor gives them back
      }
      it->second.move = std::move(move);
      if (events.done_or_not_yet(it->second.copied)) complete_pending(it, false);
    }
  }

  // Remaps a pending move's addresses once its copies are done (waiting for them first with
  // `wait`) and records where the allocation now is; a failed remap leaves everything as it was.
  void complete_pending(typename pending_map::iterator it, bool wait) noexcept {
    auto& events = host_.events();
    if (wait) events.wait(it->second.copied);
    events.recycle(it->second.copied);
    const std::uintptr_t address = it->first;
    std::unique_ptr<move_type> move = std::move(it->second.move);
    typename moved_map::node_type record = std::move(it->second.record);
    pending_.erase(it);
    detail::move_outcome r = detail::move_outcome::out_of_memory;
    {
      const move_meter meter(*this, move->to_far());
      try {
        r = move->finish();
      } catch (...) {
      }
    }
    if (r != detail::move_outcome::moved) return;  // finish gave the new handles back
    const std::size_t bytes = move->bytes();
    if (move->to_far()) {
      if (move->uses_given_handles()) {
        if (const auto c = clean_.find(address); c != clean_.end()) far_copy_used(c->second);
      }
      host_.counters().on_move_out(bytes);
      ++host_.counters().s.offloads.moves;
      record.mapped() = moved_allocation{move->take_sites(), bytes, false};
      moved_.insert(std::move(record));
    } else {
      host_.counters().on_move_in(bytes);
      ++host_.counters().s.prefetches.moves;
      moved_.erase(address);
      keep_replaced(address, move->take_replaced(), bytes);
    }
  }

  // A move back of `sites` (`bytes`), `start` making its device handles (from exchange_ first):
  // pending offloads whose copies are done hand theirs over first; when the backend cannot add
  // the rest (may_add), or start runs out of memory, those still copying are waited for and hand
  // theirs over; then the cache makes room. The exchange is closed after, what it still holds
  // released.
  template <class Start>
  detail::move_outcome with_handover(std::span<const site_type> sites, std::size_t bytes, Start&& start) {
    struct closer {
      allocation_mover* m;
      ~closer() { m->close_exchange(); }
    } const close{this};
    open_exchange(sites);
    take_over(false);
    if (exchange_.wanted() != 0 && device_short(bytes - exchange_.bytes())) take_over(true);
    detail::move_outcome r = start();
    if (r == detail::move_outcome::out_of_memory && any_pending_out()) {
      close_exchange();
      open_exchange(sites);
      take_over(true);
      r = start();
    }
    if (r == detail::move_outcome::out_of_memory && host_.make_room(bytes)) r = start();
    return r;
  }
  // The backend cannot add `bytes` more: its limit, or its capacity less what it holds.
  bool device_short(std::size_t bytes) const noexcept {
    const auto& backend = host_.backend();
    const std::size_t held = backend.physical_bytes() - backend.spare_bytes();
    return !backend.may_add(bytes) || held > backend.capacity() || bytes > backend.capacity() - held;
  }
  void open_exchange(std::span<const site_type> sites) noexcept {
    if constexpr (has_events) {
      if (pending_.empty()) return;
      try {
        for (const site_type& s : sites) exchange_.want(s.slot->size);
      } catch (...) {
        close_exchange();  // no handover: the move back creates its handles
      }
    }
  }
  void close_exchange() noexcept {
    auto& backend = host_.backend();
    exchange_.close([&](handle_type h, std::size_t n) { backend.release_handle(h, n); });
  }
  bool any_pending_out() const noexcept {
    for (const auto& [address, m] : pending_) {
      if (m.move->to_far()) return true;
    }
    return false;
  }
  // Pending offloads complete: those whose copies are done, handing over the device handles the
  // exchange wants (the others released); with `wait`, those still copying too, waiting for
  // their copies, while the exchange wants handles they hold.
  void take_over([[maybe_unused]] bool wait) noexcept {
    if constexpr (has_events) {
      for (auto it = pending_.begin(); it != pending_.end() && !(wait && exchange_.wanted() == 0);) {
        auto next = std::next(it);
        move_type& move = *it->second.move;
        if (!move.to_far()) {
          it = next;
          continue;
        }
        bool fits = false;
        for (const site_type& s : move.sites()) fits = fits || exchange_.wants(s.slot->size);
        if ((wait && fits) || (!wait && host_.events().done_or_not_yet(it->second.copied))) {
          move.give_to(&exchange_);
          complete_pending(it, wait);
        }
        it = next;
      }
    }
  }

  // Counts the work in its scope as moves out (`to_far`) or back (detail::move_cost_meter); the
  // handles a move back kept from the exchange count as handed over by the offloads too.
  struct move_meter : detail::move_cost_meter<backend_type, handle_exchange<handle_type>> {
    move_meter(allocation_mover& m, bool to_far) noexcept
        : move_meter::move_cost_meter(m.host_.backend(),
                                      to_far ? m.host_.counters().s.offloads : m.host_.counters().s.prefetches,
                                      m.exchange_, to_far ? nullptr : &m.host_.counters().s.offloads) {}
  };

  // Undoes a pending move, or completes one that work may be using already (ready_on).
  void undo_pending(typename pending_map::iterator it) noexcept {
    if (it->second.joined) {
      complete_pending(it, true);
    } else {
      cancel_pending(it);
    }
  }

  // Undoes a pending move once its copies are done: the new handles go, the allocation stays
  // where it was (its bytes there are intact: nothing may have used it meanwhile).
  void cancel_pending(typename pending_map::iterator it) noexcept {
    auto& events = host_.events();
    events.wait(it->second.copied);
    events.recycle(it->second.copied);
    it->second.move->abandon();
    pending_.erase(it);
  }

 public:
  [[noreturn]] void throw_move_out_of_memory(const std::string& where, const void* p, std::size_t bytes,
                                             bool to_far) const {
    const statistics& s = host_.counters().s;
    throw out_of_memory(bytes, s.reserved_bytes, s.active_bytes,
                        where + "moving " + format_bytes(bytes) + " of " + detail::pointer_text(p) + " " +
                            (to_far ? "to far memory: far memory ran out" : "back to the device: the device ran out") +
                            " (nothing moved; reserved " + format_bytes(s.reserved_bytes) + ", offloaded " +
                            format_bytes(s.offloaded_bytes) + ")");
  }

 private:
  mutable Host host_;
  bool away_unmapped_ = false;  ///< far_residence::unmapped
  std::unique_ptr<far_type> far_;
  moved_map moved_;                          // allocations in far memory, by address
  pending_map pending_;                      // deferred moves still copying, by address
  std::size_t parked_ = 0;                   // of them, freed ones
  far_copy_map clean_;                       // allocations marked keep_far_copy, by address
  detail::mapping_holes<handle_type> holes_;  // addresses a failed remap left unmapped
  std::size_t clean_bytes_ = 0;              // far memory their clean copies hold
  handle_exchange<handle_type> exchange_;    // open only during a move back (with_handover)
};

namespace detail {
/// A mover_host and nothing more (over the archetype backend, without events).
struct mover_host_archetype {
  struct events_type {
    struct event_type {};
    static constexpr bool real = false;
  };
  using backend_type = vmm_backend<provider_archetype, reserver_archetype>;
  backend_type& backend() noexcept;
  usage_counters& counters() noexcept;
  bool make_room(std::size_t bytes);
  bool retained() noexcept;
  void release_parked(std::uintptr_t address) noexcept;
};
}  // namespace detail
static_assert(mover_host<detail::mover_host_archetype>);
static_assert(allocation_moving<allocation_mover<detail::mover_host_archetype, detail::handle_slot<int>>>);

}  // namespace glake
