// Moving a live allocation's handles between the device and far memory in place: new handles
// made, the bytes copied through a temporary mapping, every address that maps the old handles
// remapped to the new ones, the old ones released. All or nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "glake/errors.hpp"
#include "glake/movers/far_memory.hpp"
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
/// Cost: per site a create, one or two unmaps, maps and accesses, a release; with `copy` a map
/// and an unmap more and one copy; one reservation. The sites' slots must stay where they are
/// until the move is finished or abandoned.
template <class Backend, class Slot>
class handle_move {
 public:
  using handle_type = typename Backend::handle_type;

  handle_move(Backend& backend, far_memory<handle_type>& far, std::span<const handle_site<Slot>> sites, bool to_far)
      : backend_(&backend), far_(&far), sites_(sites.begin(), sites.end()), to_far_(to_far) {
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

  template <class WaitCopies>
  move_outcome start(bool copy, stream_ref stream, WaitCopies&& wait_copies) {
    made_.reserve(sites_.size());
    bool copies_queued = false;
    try {
      for (const handle_site<Slot>& s : sites_) {
        std::optional<handle_type> h =
            to_far_ ? far_->try_create(s.slot->size) : backend_->try_create_handle(s.slot->size);
        if (!h) {
          release_made();
          return move_outcome::out_of_memory;
        }
        made_.push_back(*h);
      }
      if (copy) {
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
      release_made();
      throw;
    }
    return move_outcome::moved;
  }

  move_outcome finish() {
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
          if (backend_->try_map_handle(at(a), slot.size, slot.handle)) return;
        } catch (...) {
        }
        if (failed == 0) failed = a;
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
        backend_->unmap_handle(at(s.home), n);
        stage = 1;
        if (!backend_->try_map_handle(at(s.home), n, made_[done])) {
          undo_all();
          return move_outcome::out_of_memory;
        }
        stage = 2;
        if (s.range != 0) {
          backend_->unmap_handle(at(s.range), n);
          stage = 3;
          if (!backend_->try_map_handle(at(s.range), n, made_[done])) {
            undo_all();
            return move_outcome::out_of_memory;
          }
        }
      }
    } catch (...) {
      undo_all();
      throw;
    }
    drop_temp();
    for (std::size_t i = 0; i < sites_.size(); ++i) {
      Slot& slot = *sites_[i].slot;
      if (slot.far) {
        far_->release(slot.handle);
      } else {
        backend_->release_handle(slot.handle, slot.size);
      }
      slot.handle = made_[i];
      slot.far = to_far_;
    }
    made_.clear();
    return move_outcome::moved;
  }

  void abandon() noexcept {
    drop_temp();
    release_made();
  }

 private:
  static void* at(std::uintptr_t a) noexcept { return reinterpret_cast<void*>(a); }

  void release_made() noexcept {
    for (std::size_t i = made_.size(); i-- > 0;) {
      if (to_far_) {
        far_->release(made_[i]);
      } else {
        backend_->release_handle(made_[i], sites_[i].slot->size);
      }
    }
    made_.clear();
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
  std::size_t total_ = 0;
  std::vector<handle_type> made_;
  void* temp_ = nullptr;
  std::size_t temp_mapped_ = 0;
};

/// A move in one call: start, wait_copies(), finish (see handle_move).
template <class Backend, class Slot, class WaitCopies>
move_outcome move_handles(Backend& backend, far_memory<typename Backend::handle_type>& far,
                          std::span<const handle_site<Slot>> sites, bool to_far, bool copy, stream_ref stream,
                          WaitCopies&& wait_copies) {
  handle_move<Backend, Slot> move(backend, far, sites, to_far);
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
  return move.finish();
}

}  // namespace glake::detail
