// A ring of pinned host buffers that copies pass through on their way to or from the device,
// each reused only once the copy that last used it has completed.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "glake/backends/concepts.hpp"
#include "glake/errors.hpp"
#include "glake/stream.hpp"

namespace glake {

// ---------------------------------------------------------------------------------------------
// staging_ring
//
// `count` slots of `slot_bytes` pinned bytes each, from a copy_backend. A slot is made on first
// use (an engine that only ever copies pinned memory pins nothing). The user takes slot i with
// acquire(i), which waits until the slot is free, fills or drains it, and, when it queued a
// copy that reads or writes the slot, gives it back with release_after(i, stream): an event
// recorded there after the copy. The next acquire of that slot waits for the event. A slot
// acquired and given back without a copy needs nothing (no event is pending on it).
// slot(k) turns a running chunk number k into a slot, oldest first across calls (advance moves
// the start past the chunks a call used), so a new call starts on the slot whose copy was queued
// longest ago.
//
// Failures: acquire throws out_of_memory when the backend has no pinned memory left, or the
// backend's error, leaving the slot free and unmade or with its event still pending; a slot
// whose event cannot be recorded is made free by waiting for the whole stream (wait_stream)
// before the error propagates. Nothing leaks: the destructor waits for every pending event and
// frees every slot.
// Complexity: O(1) per call besides the backend's work; O(count) for trim and the destructor.
// Thread safety: none; one owner calls it. Streams: any; a slot's event is recorded on the
// stream of the copy that used it, and waited for on the host.
// ---------------------------------------------------------------------------------------------
template <copy_backend Backend>
class staging_ring {
  using event_type = typename Backend::event_type;
  struct slot_state {
    void* data = nullptr;
    std::optional<event_type> pending;  ///< recorded after the last copy that used the slot
  };

 public:
  staging_ring(Backend backend, std::size_t count, std::size_t slot_bytes)
      : backend_(std::move(backend)), bytes_(slot_bytes), slots_(count) {
    if (count == 0 || slot_bytes == 0) {
      throw usage_error(usage_error::kind::bad_argument, "glake::staging_ring: " + std::to_string(count) +
                                                             " slots of " + std::to_string(slot_bytes) +
                                                             " bytes: both must be positive");
    }
  }
  staging_ring(const staging_ring&) = delete;
  staging_ring& operator=(const staging_ring&) = delete;
  ~staging_ring() { trim(); }

  std::size_t count() const noexcept { return slots_.size(); }
  std::size_t slot_bytes() const noexcept { return bytes_; }
  /// Pinned bytes held now.
  std::size_t allocated_bytes() const noexcept { return made_ * bytes_; }
  Backend& backend() noexcept { return backend_; }

  /// The slot of running chunk number k of the current call.
  std::size_t slot(std::size_t k) const noexcept { return (start_ + k) % slots_.size(); }
  /// The next call's chunk 0 comes after the `used` chunks of this one.
  void advance(std::size_t used) noexcept { start_ = (start_ + used) % slots_.size(); }

  /// The pinned memory of slot i (null before its first acquire).
  void* data(std::size_t i) const noexcept { return slots_[i].data; }

  /// Whether slot i can be acquired without waiting: it is not made yet, or its last copy has
  /// completed. Throws what the backend's event_done throws.
  bool ready(std::size_t i) {
    slot_state& s = slots_[i];
    if (!s.pending) return true;
    if (!backend_.event_done(*s.pending)) return false;
    backend_.recycle_event(*s.pending);
    s.pending.reset();
    return true;
  }

  /// The pinned memory of slot i, once the copy that used it last has completed (waiting for
  /// it on the host). Makes the slot on first use: out_of_memory when the backend has none.
  void* acquire(std::size_t i) {
    slot_state& s = slots_[i];
    if (s.pending) {
      backend_.wait_event(*s.pending);
      backend_.recycle_event(*s.pending);
      s.pending.reset();
    }
    if (s.data == nullptr) {
      s.data = backend_.try_allocate_staging(bytes_);
      if (s.data == nullptr) {
        throw out_of_memory(bytes_, allocated_bytes(), 0,
                            "glake::staging_ring: allocating a pinned staging buffer of " + format_bytes(bytes_) +
                                " failed (out of pinned host memory; the ring holds " +
                                format_bytes(allocated_bytes()) + ")");
      }
      ++made_;
    }
    return s.data;
  }

  /// Slot i was used by copies queued on `stream` up to now: it is free again once they
  /// complete. When the event cannot be recorded, waits for the stream, then throws the error.
  void release_after(std::size_t i, stream_ref stream) {
    slot_state& s = slots_[i];
    try {
      s.pending = backend_.record_event(stream);
    } catch (...) {
      backend_.wait_stream(stream);
      throw;
    }
  }

  /// Waits for every slot's last copy, then gives all pinned memory back.
  void trim() noexcept {
    for (slot_state& s : slots_) {
      if (s.pending) {
        backend_.wait_event(*s.pending);
        backend_.recycle_event(*s.pending);
        s.pending.reset();
      }
      if (s.data != nullptr) {
        backend_.free_staging(s.data, bytes_);
        s.data = nullptr;
      }
    }
    made_ = 0;
  }

 private:
  Backend backend_;
  std::size_t bytes_;
  std::vector<slot_state> slots_;
  std::size_t made_ = 0;
  std::size_t start_ = 0;
};

}  // namespace glake
