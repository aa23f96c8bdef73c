// Moving a live allocation's handles between the device and far memory in place: new handles
// made, the bytes copied through a temporary mapping, every address that maps the old handles
// remapped to the new ones, the old ones released. All or nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "glake/errors.hpp"
#include "glake/movers/far_memory.hpp"
#include "glake/movers/handle_exchange.hpp"
#include "glake/stream.hpp"

namespace glake::detail {

/// Where one handle of an allocation is mapped: its slot in the home segment (handle, size,
/// whether it is far memory's), the home segment's address of it, and a stitched range's
/// address of it when the allocation is a stitched range (0 otherwise).
template <class Slot>
struct handle_site {
  Slot* slot = nullptr;
  std::uintptr_t home = 0;
  std::uintptr_t range = 0;
};

/// Addresses where a handle should be mapped and is not: a remap failed and putting the old
/// mapping back failed too (the driver refusing maps). Later moves fill them instead of
/// unmapping them, and the allocator maps them again before it unmaps its segments.
template <class Handle>
struct mapping_hole {
  Handle handle{};
  std::size_t size = 0;
};
template <class Handle>
using mapping_holes = std::map<std::uintptr_t, mapping_hole<Handle>>;

/// What move_handles did.
enum class move_outcome {
  moved,          ///< every site maps a new handle; the old ones are released
  out_of_memory,  ///< no new handle, address range or mapping could be had; nothing changed
};

/// Moves the handles at `sites` to far memory (`to_far`) or back to the backend's provider, in
/// two phases, so that the copies can run while the caller goes on:
///
/// - start(copy, stream, wait_copies): new handles are made; with `copy`, they are mapped side by
///   side in one temporary range and the bytes are copied into it from the home addresses on
///   `stream` (after the work queued there). Nothing the caller sees has changed yet. Out of
///   memory: out_of_memory, with nothing made. A throw after copies were queued waits for them
///   (`wait_copies()`) before giving the new handles back.
/// - finish(), once the copies are done: every address of each site is remapped to its new
///   handle, the temporary range goes, and the old handles go back (the backend's counted out
///   of, or into, its physical bytes). Out of memory answers out_of_memory with every site put
///   back as it was and the new handles given back. A driver failure propagates after the same;
///   should putting a mapping back fail in turn, a driver_error says which address, and its
///   handle is kept where the slot says.
/// - abandon(), once the copies are done, instead of finish: the new handles and the temporary
///   range go; the sites are as they were. The destructor abandons a move started and not
///   finished.
///
/// With note_holes, addresses that finish could neither remap nor put back are recorded there
/// (mapping_holes), and a later finish maps them without unmapping them first.
///
/// Cost: per site a create, one or two unmaps, maps and accesses, a release; with `copy` a map
/// and an unmap more and one copy; one reservation. The sites' slots must stay where they are
/// until the move is finished or abandoned.
///
/// Unmapped away (`away_unmapped`): memory in far memory is not mapped at the sites' addresses
/// at all (its user brings it back before any use). Then:
/// - to far memory: start copies into the far handles' own homes (far_memory::home_of; through
///   a temporary range where one has none); finish only unmaps the sites' addresses and releases
///   the device handles, so it cannot fail.
/// - back: start maps the new device handles at the sites' addresses (out of memory: nothing
///   changed) and copies into them from the far handles' homes; finish only releases the far
///   handles; abandon unmaps the addresses again.
/// Per site that is a copy, a create, a map, an access, an unmap and a release in all: no
/// mapping of far memory and no access setting over it per move.
///
/// Handed over (handle_exchange): a move out given an exchange (give_to) leaves the device
/// handles its finish replaces there, where wanted, instead of releasing them; a move back given
/// one (take_from) takes handles of its sites' sizes there before creating any, and its finish
/// counts there those it kept (a start out of memory, or an abandon, releases them: they were not
/// handed over). Finish comes only after the copies, so a handle handed over has no copy pending
/// on it.
///
/// Clean far copies (either residence): keep_replaced() before finish of a move back keeps the
/// far handles it replaces (take_replaced()) instead of releasing them; a move out given such
/// handles (use_handles, before start) creates and copies nothing: start does nothing, and
/// finish unmaps the addresses (mapped away: remaps them to the given handles), releases the
/// device handles and leaves the given handles in the slots. Abandoned, it leaves the given
/// handles to their owner.
template <class Backend, class Slot>
class handle_move {
 public:
  using handle_type = typename Backend::handle_type;

  handle_move(Backend& backend, far_memory<handle_type>& far, std::span<const handle_site<Slot>> sites, bool to_far,
              bool away_unmapped = false)
      : backend_(&backend), far_(&far), sites_(sites.begin(), sites.end()), to_far_(to_far), unmapped_(away_unmapped) {
    for (const handle_site<Slot>& s : sites_) total_ += s.slot->size;
  }
  handle_move(const handle_move&) = delete;
  handle_move& operator=(const handle_move&) = delete;
  ~handle_move() { abandon(); }

  bool to_far() const noexcept { return to_far_; }
  const std::vector<handle_site<Slot>>& sites() const noexcept { return sites_; }
  /// The sites, moved out: only after finish (nothing of the move needs them then).
  std::vector<handle_site<Slot>> take_sites() noexcept { return std::move(sites_); }
  std::size_t bytes() const noexcept { return total_; }

  /// Moving back: the far handles replaced are kept, not released (take_replaced after finish).
  void keep_replaced() {
    replaced_.reserve(sites_.size());
    keep_replaced_ = true;
  }
  /// The far handles a finished move back replaced, in site order (keep_replaced).
  std::vector<handle_type> take_replaced() noexcept { return std::move(replaced_); }
  /// Moving out: the device handles finish replaces go to `x` where it wants them.
  void give_to(handle_exchange<handle_type>* x) noexcept { use_exchange(x, true); }
  /// Moving back: start takes device handles from `x` before it creates any, and finish tells
  /// `x` how many of them the move kept (handle_exchange::served), so `x` must outlive the move.
  void take_from(handle_exchange<handle_type>* x) noexcept { use_exchange(x, false); }
  /// Whether it moves out to handles given by use_handles.
  bool uses_given_handles() const noexcept { return given_; }
  /// Where addresses left unmapped by a failed remap are recorded, and looked up (memory away
  /// mapped only; see mapping_holes).
  void note_holes(mapping_holes<handle_type>* holes) noexcept { holes_ = holes; }
  /// Moving out: these handles (a clean far copy of every site, in site order; still the
  /// caller's until finish) take the sites' place; start copies nothing.
  void use_handles(std::span<const handle_type> handles) {
    made_.assign(handles.begin(), handles.end());
    given_ = true;
  }

  template <class WaitCopies>
  move_outcome start(bool copy, stream_ref stream, WaitCopies&& wait_copies) {
    if (given_) return move_outcome::moved;  // a clean far copy: nothing to make or copy
    made_.reserve(sites_.size());
    bool copies_queued = false;
    try {
      for (const handle_site<Slot>& s : sites_) {
        std::optional<handle_type> h = to_far_ ? far_->try_create(s.slot->size) : take_or_create(s.slot->size);
        if (!h) {
          release_made();
          return move_outcome::out_of_memory;
        }
        made_.push_back(*h);
      }
      if (unmapped_) {
        if (!to_far_ && !map_sites()) {
          release_made();
          return move_outcome::out_of_memory;
        }
        if (copy) {
          // The far side of each site: its far handle's home, or a temporary range over them all.
          std::vector<void*> far_at(sites_.size(), nullptr);
          bool homes = true;
          for (std::size_t i = 0; i < sites_.size() && homes; ++i) {
            far_at[i] = far_->home_of(to_far_ ? made_[i] : sites_[i].slot->handle);
            homes = far_at[i] != nullptr;
          }
          if (!homes) {
            if (!map_temp(to_far_)) {
              if (!to_far_) unmap_sites();
              release_made();
              return move_outcome::out_of_memory;
            }
            std::size_t off = 0;
            for (std::size_t i = 0; i < sites_.size(); off += sites_[i++].slot->size) far_at[i] = static_cast<char*>(temp_) + off;
          }
          for (std::size_t i = 0; i < sites_.size(); ++i) {
            copies_queued = true;
            void* home = at(sites_[i].home);
            if (to_far_) {
              far_->copy(far_at[i], home, sites_[i].slot->size, stream);
            } else {
              far_->copy(home, far_at[i], sites_[i].slot->size, stream);
            }
          }
        }
      } else if (copy) {
        temp_ = backend_->try_reserve_range(total_);
        if (temp_ == nullptr) {
          release_made();
          return move_outcome::out_of_memory;
        }
        for (std::size_t off = 0; temp_mapped_ < sites_.size(); off += sites_[temp_mapped_++].slot->size) {
          if (!backend_->try_map_handle(static_cast<char*>(temp_) + off, sites_[temp_mapped_].slot->size,
                                        made_[temp_mapped_])) {
            drop_temp();
            release_made();
            return move_outcome::out_of_memory;
          }
        }
        std::size_t off = 0;
        for (const handle_site<Slot>& s : sites_) {
          copies_queued = true;
          far_->copy(static_cast<char*>(temp_) + off, at(s.home), s.slot->size, stream);
          off += s.slot->size;
        }
      }
    } catch (...) {
      if (copies_queued) {
        try {
          wait_copies();  // no copy may still write a handle about to be released
        } catch (...) {
        }
      }
      drop_temp();
      unmap_sites();
      release_made();
      throw;
    }
    return move_outcome::moved;
  }

  move_outcome finish() {
    if (unmapped_) {
      // Out: the addresses go unmapped (the device handles are released below). Back: they map
      // the new handles since start.
      if (to_far_) {
        for (const handle_site<Slot>& s : sites_) {
          backend_->unmap_handle(at(s.home), s.slot->size);
          if (s.range != 0) backend_->unmap_handle(at(s.range), s.slot->size);
        }
      }
      sites_mapped_ = 0;
      drop_temp();
      hand_over();
      return move_outcome::moved;
    }
    // Remapping, site by site: sites [0, done) map their new handle at every address; site
    // `done` is at `stage`: 0 untouched, 1 home unmapped, 2 home maps the new handle, 3 and
    // its range address unmapped.
    std::size_t done = 0;
    int stage = 0;
    const auto restore = [&]() noexcept -> std::uintptr_t {
      std::uintptr_t failed = 0;
      const auto put_back = [&](std::uintptr_t a, const Slot& slot, bool new_mapped) {
        if (new_mapped) backend_->unmap_handle(at(a), slot.size);
        try {
          if (backend_->try_map_handle(at(a), slot.size, slot.handle)) {
            filled(a);
            return;
          }
        } catch (...) {
        }
        if (failed == 0) failed = a;
        if (holes_ != nullptr) {
          try {
            holes_->insert_or_assign(a, mapping_hole<handle_type>{slot.handle, slot.size});
          } catch (...) {
          }
        }
      };
      for (std::size_t i = 0; i < done; ++i) {
        put_back(sites_[i].home, *sites_[i].slot, true);
        if (sites_[i].range != 0) put_back(sites_[i].range, *sites_[i].slot, true);
      }
      if (done < sites_.size() && stage > 0) {
        const handle_site<Slot>& s = sites_[done];
        put_back(s.home, *s.slot, stage >= 2);
        if (stage == 3) put_back(s.range, *s.slot, false);
      }
      return failed;
    };
    const auto undo_all = [&]() {
      const std::uintptr_t failed = restore();
      abandon();
      if (failed != 0) {
        throw driver_error("glake: remapping an allocation", 0,
                           "moving its memory failed, and mapping its old memory back at " + std::to_string(failed) +
                               " failed too; that memory stays in its old handle");
      }
    };
    try {
      for (; done < sites_.size(); ++done, stage = 0) {
        const handle_site<Slot>& s = sites_[done];
        const std::size_t n = s.slot->size;
        if (!hole(s.home)) backend_->unmap_handle(at(s.home), n);
        stage = 1;
        if (!backend_->try_map_handle(at(s.home), n, made_[done])) {
          undo_all();
          return move_outcome::out_of_memory;
        }
        filled(s.home);
        stage = 2;
        if (s.range != 0) {
          if (!hole(s.range)) backend_->unmap_handle(at(s.range), n);
          stage = 3;
          if (!backend_->try_map_handle(at(s.range), n, made_[done])) {
            undo_all();
            return move_outcome::out_of_memory;
          }
          filled(s.range);
        }
      }
    } catch (...) {
      undo_all();
      throw;
    }
    drop_temp();
    hand_over();
    return move_outcome::moved;
  }

  void abandon() noexcept {
    drop_temp();
    unmap_sites();
    release_made();
  }

 private:
  static void* at(std::uintptr_t a) noexcept { return reinterpret_cast<void*>(a); }
  // An exchange serves one direction: a call for the other changes nothing.
  void use_exchange(handle_exchange<handle_type>* x, bool giving) noexcept {
    if (giving == to_far_) exchange_ = x;
  }
  bool hole(std::uintptr_t a) const noexcept { return holes_ != nullptr && !holes_->empty() && holes_->contains(a); }
  void filled(std::uintptr_t a) noexcept {
    if (holes_ != nullptr && !holes_->empty()) holes_->erase(a);
  }

  // The old handles go, the slots hold the new ones.
  void hand_over() noexcept {
    for (std::size_t i = 0; i < sites_.size(); ++i) {
      Slot& slot = *sites_[i].slot;
      if (slot.far && keep_replaced_) {
        replaced_.push_back(slot.handle);  // reserved by keep_replaced
      } else if (slot.far) {
        far_->release(slot.handle);
      } else if (exchange_ != nullptr && exchange_->wants(slot.size)) {
        exchange_->give(slot.handle, slot.size);  // still counted in the backend's bytes
      } else {
        backend_->release_handle(slot.handle, slot.size, true);  // counted reserved until the move out
      }
      slot.handle = made_[i];
      slot.far = to_far_;
    }
    made_.clear();
    if (taken_ != 0) exchange_->served(taken_);  // handed over for good
    taken_ = 0;
  }

  std::optional<handle_type> take_or_create(std::size_t bytes) {
    if (exchange_ != nullptr) {
      if (std::optional<handle_type> h = exchange_->take(bytes)) {
        ++taken_;
        return h;
      }
    }
    return backend_->try_create_handle(bytes);
  }

  // Unmapped away, coming back: the new handles mapped at every address of their sites; false
  // (nothing left mapped) when a mapping cannot be had.
  bool map_sites() {
    const auto map_one = [&](std::uintptr_t a, std::size_t i) {
      return backend_->try_map_handle(at(a), sites_[i].slot->size, made_[i]);
    };
    try {
      for (; sites_mapped_ < sites_.size(); ++sites_mapped_) {
        const handle_site<Slot>& s = sites_[sites_mapped_];
        if (!map_one(s.home, sites_mapped_)) break;
        bool range_mapped = s.range == 0;
        try {
          if (!range_mapped) range_mapped = map_one(s.range, sites_mapped_);
        } catch (...) {
          backend_->unmap_handle(at(s.home), s.slot->size);
          throw;
        }
        if (!range_mapped) {
          backend_->unmap_handle(at(s.home), s.slot->size);
          break;
        }
      }
    } catch (...) {
      unmap_sites();
      throw;
    }
    if (sites_mapped_ == sites_.size()) return true;
    unmap_sites();
    return false;
  }
  void unmap_sites() noexcept {
    for (std::size_t i = 0; i < sites_mapped_; ++i) {
      backend_->unmap_handle(at(sites_[i].home), sites_[i].slot->size);
      if (sites_[i].range != 0) backend_->unmap_handle(at(sites_[i].range), sites_[i].slot->size);
    }
    sites_mapped_ = 0;
  }

  // The far side mapped side by side in one temporary range: the new handles (out) or the
  // sites' own (back); false (nothing left) when the range or a mapping cannot be had.
  bool map_temp(bool new_handles) {
    temp_ = backend_->try_reserve_range(total_);
    if (temp_ == nullptr) return false;
    for (std::size_t off = 0; temp_mapped_ < sites_.size(); off += sites_[temp_mapped_++].slot->size) {
      const handle_type& h = new_handles ? made_[temp_mapped_] : sites_[temp_mapped_].slot->handle;
      if (!backend_->try_map_handle(static_cast<char*>(temp_) + off, sites_[temp_mapped_].slot->size, h)) {
        drop_temp();
        return false;
      }
    }
    return true;
  }

  void release_made() noexcept {
    if (given_) {  // their owner keeps them
      made_.clear();
      return;
    }
    for (std::size_t i = made_.size(); i-- > 0;) {
      if (to_far_) {
        far_->release(made_[i]);
      } else {
        backend_->release_handle(made_[i], sites_[i].slot->size);
      }
    }
    made_.clear();
    taken_ = 0;  // released with the rest: not handed over
  }
  void drop_temp() noexcept {
    std::size_t off = 0;
    for (std::size_t i = 0; i < temp_mapped_; ++i) {
      backend_->unmap_handle(static_cast<char*>(temp_) + off, sites_[i].slot->size);
      off += sites_[i].slot->size;
    }
    temp_mapped_ = 0;
    if (temp_ != nullptr) backend_->free_reserved_range(temp_, total_);
    temp_ = nullptr;
  }

  Backend* backend_;
  far_memory<handle_type>* far_;
  std::vector<handle_site<Slot>> sites_;
  bool to_far_;
  bool unmapped_;
  mapping_holes<handle_type>* holes_ = nullptr;
  handle_exchange<handle_type>* exchange_ = nullptr;  // give_to / take_from
  std::size_t taken_ = 0;       // of made_, handles taken from exchange_ (served at finish)
  bool given_ = false;          // made_ holds handles given by use_handles
  bool keep_replaced_ = false;  // hand_over keeps the far handles it replaces in replaced_
  std::vector<handle_type> replaced_;
  std::size_t sites_mapped_ = 0;  // unmapped away, coming back: sites whose addresses map made_
  std::size_t total_ = 0;
  std::vector<handle_type> made_;
  void* temp_ = nullptr;
  std::size_t temp_mapped_ = 0;
};

/// A move in one call: start, wait_copies(), finish (see handle_move). Out to `given` handles
/// (non-empty: a clean far copy, use_handles) it copies nothing; back with `kept`, the far
/// handles replaced are put there (keep_replaced), and with `exchange` it takes device handles
/// there first (take_from).
template <class Backend, class Slot, class WaitCopies>
move_outcome move_handles(Backend& backend, far_memory<typename Backend::handle_type>& far,
                          std::span<const handle_site<Slot>> sites, bool to_far, bool copy, stream_ref stream,
                          WaitCopies&& wait_copies, bool away_unmapped = false,
                          std::span<const typename Backend::handle_type> given = {},
                          std::vector<typename Backend::handle_type>* kept = nullptr,
                          mapping_holes<typename Backend::handle_type>* holes = nullptr,
                          handle_exchange<typename Backend::handle_type>* exchange = nullptr) {
  handle_move<Backend, Slot> move(backend, far, sites, to_far, away_unmapped);
  move.note_holes(holes);
  if (!to_far) move.take_from(exchange);
  if (!given.empty()) {
    move.use_handles(given);
    copy = false;
  }
  if (kept != nullptr) move.keep_replaced();
  if (move.start(copy, stream, wait_copies) == move_outcome::out_of_memory) return move_outcome::out_of_memory;
  if (copy) {
    try {
      wait_copies();
    } catch (...) {
      try {
        wait_copies();  // no copy may still write a handle about to be released
      } catch (...) {
      }
      throw;  // the destructor gives the new handles back
    }
  }
  const move_outcome r = move.finish();
  if (r == move_outcome::moved && kept != nullptr) *kept = move.take_replaced();
  return r;
}

}  // namespace glake::detail
