// A replay's memory snapshot in the shape of PyTorch's torch.cuda.memory._snapshot(), the dict
// that torch/cuda/_memory_viz.py and pytorch.org/memory_viz read: the replay's history, and the
// file it is written to (glake/memory_snapshot.hpp writes the JSON).
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "glake/memory_history.hpp"
#include "glake/memory_snapshot.hpp"
#include "glake/memory_state.hpp"
#include "glake/stream.hpp"

namespace glake::replay {

/// The memory history of one replay: the newest `max_entries` entries, as PyTorch's
/// _record_memory_history(max_entries=...) keeps them. A trace carries no times, so an entry's
/// time_us is the number of the trace event it came from. The replay records alloc,
/// free_requested and oom; the allocator, where it is an observable_allocator, the segment
/// actions and free_completed (through observe), else the replay records free_completed too.
/// Not thread-safe beyond memory_history's own lock; one replay at a time.
class replay_history {
 public:
  explicit replay_history(std::size_t max_entries) { ring_.reset(max_entries); }

  /// The trace event whose effects are recorded next.
  void at_event(std::uint64_t number) noexcept { now_ = number; }

  void record(memory_action action, std::uintptr_t address, std::size_t size, stream_ref stream) noexcept {
    ring_.record(history_entry{action, address, size, stream, now_, 0});
  }

  /// A memory_observer whose context is a replay_history.
  static void observe(void* self, const memory_event& e) noexcept {
    static_cast<replay_history*>(self)->record(e.action, e.address, e.size, e.stream);
  }

  std::vector<history_entry> entries() const { return ring_.entries(); }

 private:
  memory_history ring_;
  std::uint64_t now_ = 0;
};

/// Writes `text` to `path`; throws std::runtime_error naming the file when it cannot.
inline void write_text_file(const std::string& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const int write_errno = errno;
  if (std::fclose(f) != 0 || !written) {
    throw std::runtime_error("cannot write " + path + ": " + std::strerror(written ? errno : write_errno));
  }
}

}  // namespace glake::replay
