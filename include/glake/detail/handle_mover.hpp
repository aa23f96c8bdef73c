// Moving a live allocation's handles between the device and far memory in place: new handles
// made, the bytes copied through a temporary mapping, every address that maps the old handles
// remapped to the new ones, the old ones released. All or nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
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

/// Moves the handles at `sites` to far memory (`to_far`) or back to the backend's provider.
/// With `copy`, the bytes go along: each new handle is mapped in one temporary range, the bytes
/// are copied into it from the home addresses on `stream` (after the work queued there),
/// `wait_copies()` returns once those copies are done; without, the new handles hold whatever
/// they hold (the allocation was freed). Then every address of each site is remapped to its new
/// handle, and the old handles go back (the backend's counted out of, or into, its physical
/// bytes). Out of memory answers out_of_memory with nothing changed. A driver failure
/// propagates after every site is put back as it was; should putting a mapping back fail in
/// turn, a driver_error says which address, and its handle is kept where the slot says.
/// Cost: per site a create, one or two unmaps, maps and accesses, a release; with `copy` a map
/// and an unmap more and one copy; one reservation.
template <class Backend, class Slot, class WaitCopies>
move_outcome move_handles(Backend& backend, far_memory<typename Backend::handle_type>& far,
                          std::span<const handle_site<Slot>> sites, bool to_far, bool copy, stream_ref stream,
                          WaitCopies&& wait_copies) {
  using handle_type = typename Backend::handle_type;
  const auto at = [](std::uintptr_t a) { return reinterpret_cast<void*>(a); };
  std::vector<handle_type> made;
  made.reserve(sites.size());
  std::size_t total = 0;
  for (const handle_site<Slot>& s : sites) total += s.slot->size;

  // The new handles, and the temporary range the copies go through.
  void* temp = nullptr;
  std::size_t temp_mapped = 0;
  const auto release_made = [&]() noexcept {
    for (std::size_t i = made.size(); i-- > 0;) {
      if (to_far) {
        far.release(made[i]);
      } else {
        backend.release_handle(made[i], sites[i].slot->size);
      }
    }
    made.clear();
  };
  const auto drop_temp = [&]() noexcept {
    std::size_t off = 0;
    for (std::size_t i = 0; i < temp_mapped; ++i) {
      backend.unmap_handle(static_cast<char*>(temp) + off, sites[i].slot->size);
      off += sites[i].slot->size;
    }
    temp_mapped = 0;
    if (temp != nullptr) backend.free_reserved_range(temp, total);
    temp = nullptr;
  };

  // Remapping, site by site: sites [0, done) map their new handle at every address; site
  // `done` is at `stage`: 0 untouched, 1 home unmapped, 2 home maps the new handle, 3 and its
  // range address unmapped.
  std::size_t done = 0;
  int stage = 0;
  const auto restore = [&]() noexcept -> std::uintptr_t {
    std::uintptr_t failed = 0;
    const auto put_back = [&](std::uintptr_t a, const Slot& slot, bool new_mapped) {
      if (new_mapped) backend.unmap_handle(at(a), slot.size);
      try {
        if (backend.try_map_handle(at(a), slot.size, slot.handle)) return;
      } catch (...) {
      }
      if (failed == 0) failed = a;
    };
    for (std::size_t i = 0; i < done; ++i) {
      put_back(sites[i].home, *sites[i].slot, true);
      if (sites[i].range != 0) put_back(sites[i].range, *sites[i].slot, true);
    }
    if (done < sites.size() && stage > 0) {
      const handle_site<Slot>& s = sites[done];
      put_back(s.home, *s.slot, stage >= 2);
      if (stage == 3) put_back(s.range, *s.slot, false);
    }
    return failed;
  };
  const auto undo_all = [&]() {
    const std::uintptr_t failed = restore();
    drop_temp();
    release_made();
    if (failed != 0) {
      throw driver_error("glake: remapping an allocation", 0,
                         "moving its memory failed, and mapping its old memory back at " + std::to_string(failed) +
                             " failed too; that memory stays in its old handle");
    }
  };

  bool copies_queued = false;
  try {
    for (const handle_site<Slot>& s : sites) {
      std::optional<handle_type> h = to_far ? far.try_create(s.slot->size) : backend.try_create_handle(s.slot->size);
      if (!h) {
        release_made();
        return move_outcome::out_of_memory;
      }
      made.push_back(*h);
    }
    if (copy) {
      temp = backend.try_reserve_range(total);
      if (temp == nullptr) {
        release_made();
        return move_outcome::out_of_memory;
      }
      for (std::size_t off = 0; temp_mapped < sites.size(); off += sites[temp_mapped++].slot->size) {
        if (!backend.try_map_handle(static_cast<char*>(temp) + off, sites[temp_mapped].slot->size, made[temp_mapped])) {
          drop_temp();
          release_made();
          return move_outcome::out_of_memory;
        }
      }
      std::size_t off = 0;
      for (const handle_site<Slot>& s : sites) {
        copies_queued = true;
        far.copy(static_cast<char*>(temp) + off, at(s.home), s.slot->size, stream);
        off += s.slot->size;
      }
      wait_copies();
      copies_queued = false;
    }
    for (; done < sites.size(); ++done, stage = 0) {
      const handle_site<Slot>& s = sites[done];
      const std::size_t n = s.slot->size;
      backend.unmap_handle(at(s.home), n);
      stage = 1;
      if (!backend.try_map_handle(at(s.home), n, made[done])) {
        undo_all();
        return move_outcome::out_of_memory;
      }
      stage = 2;
      if (s.range != 0) {
        backend.unmap_handle(at(s.range), n);
        stage = 3;
        if (!backend.try_map_handle(at(s.range), n, made[done])) {
          undo_all();
          return move_outcome::out_of_memory;
        }
      }
    }
  } catch (...) {
    if (copies_queued) {
      try {
        wait_copies();  // no copy may still write a handle about to be released
      } catch (...) {
      }
    }
    undo_all();
    throw;
  }
  drop_temp();
  for (std::size_t i = 0; i < sites.size(); ++i) {
    Slot& slot = *sites[i].slot;
    if (slot.far) {
      far.release(slot.handle);
    } else {
      backend.release_handle(slot.handle, slot.size);
    }
    slot.handle = made[i];
    slot.far = to_far;
  }
  return move_outcome::moved;
}

}  // namespace glake::detail
