// A device's memory history as PyTorch's _record_memory_history keeps it: the newest entries
// (action, address, size, stream, time) in a ring of fixed capacity.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "glake/memory_state.hpp"
#include "glake/stream.hpp"

namespace glake {

/// One entry of a device's memory history: PyTorch's trace entry (action, addr, size, stream,
/// time_us) and the device.
struct history_entry {
  memory_action action = memory_action::alloc;
  std::uintptr_t address = 0;
  std::size_t size = 0;
  stream_ref stream{};
  std::uint64_t time_us = 0;  ///< microseconds since the Unix epoch (a replay: the event's number)
  int device = 0;
};

/// The newest `capacity` history entries of one device, in a ring (PyTorch's
/// `_record_memory_history(max_entries=...)`): the ring is allocated by reset, so recording
/// never allocates; once full, each entry replaces the oldest.
/// Thread safety: every member may be called from any thread (one mutex); `record` is noexcept
/// and may be called under an allocator's lock (nothing here calls back).
class memory_history {
 public:
  /// Empties the history and keeps at most `capacity` entries from now on (0: none).
  void reset(std::size_t capacity) {
    std::vector<history_entry> ring(capacity);
    std::lock_guard guard(mutex_);
    ring_.swap(ring);
    next_ = 0;
    count_ = 0;
  }

  void record(const history_entry& e) noexcept {
    std::lock_guard guard(mutex_);
    if (ring_.empty()) return;
    ring_[next_] = e;
    next_ = next_ + 1 == ring_.size() ? 0 : next_ + 1;
    count_ = std::min(count_ + 1, ring_.size());
  }

  /// The entries kept, oldest first.
  std::vector<history_entry> entries() const {
    std::lock_guard guard(mutex_);
    std::vector<history_entry> out;
    out.reserve(count_);
    const std::size_t first = count_ < ring_.size() ? 0 : next_;
    for (std::size_t i = 0; i < count_; ++i) out.push_back(ring_[(first + i) % ring_.size()]);
    return out;
  }

  std::size_t capacity() const {
    std::lock_guard guard(mutex_);
    return ring_.size();
  }

 private:
  mutable std::mutex mutex_;
  std::vector<history_entry> ring_;
  std::size_t next_ = 0;   // where the next entry goes
  std::size_t count_ = 0;  // entries kept (at most ring_.size())
};

}  // namespace glake
