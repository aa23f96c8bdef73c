// A replay's memory snapshot in the shape of PyTorch's torch.cuda.memory._snapshot(), the dict
// that torch/cuda/_memory_viz.py and pytorch.org/memory_viz read, written as JSON.
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

/// A state_visitor that writes what it is shown as the snapshot's "segments" and glake's
/// "stitched_ranges", with the keys and conventions of the PyTorch plug-in's snapshot
/// (integrations/torch/glake_torch.cpp, docs/pytorch.md): segments are "large"; a block claimed
/// by a live stitched range is "inactive" with "stitched_into", and the live range is a segment of
/// segment_type "stitched" holding one block, so each allocated byte is counted once. One device
/// (0), pool (0, 0), no frames.
class snapshot_state_writer {
 public:
  void segment(const segment_view& s) {
    close_segment();
    segment_ = s;
    in_segment_ = true;
    blocks_.clear();
    allocated_ = active_ = requested_ = 0;
  }
  void block(const block_view& b) {
    const bool claimed = b.stitched_into != 0;
    const block_state state = claimed ? block_state::free : b.state;
    if (state == block_state::allocated) allocated_ += b.size;
    if (state != block_state::free) {
      active_ += b.size;
      requested_ += b.requested;
    }
    blocks_ += blocks_.empty() ? "" : ",";
    blocks_ += R"({"address":)" + std::to_string(b.address) + R"(,"size":)" + std::to_string(b.size) +
               R"(,"requested_size":)" + std::to_string(state == block_state::free ? 0 : b.requested) +
               R"(,"state":")" + torch_state(state) + R"(","frames":[])";
    if (b.small_segment != 0) blocks_ += R"(,"pool":"small")";
    if (claimed) blocks_ += R"(,"stitched_into":)" + std::to_string(b.stitched_into);
    blocks_ += "}";
  }
  void stitched(const stitched_view& r) {
    close_segment();
    close_range();
    range_ = r;
    in_range_ = true;
    pieces_.clear();
  }
  void piece(const stitched_piece_view& p) {
    pieces_ += pieces_.empty() ? "" : ",";
    pieces_ += R"({"address":)" + std::to_string(p.address) + R"(,"size":)" + std::to_string(p.size) + "}";
  }

  /// The snapshot: the segments and ranges visited, and `history` as device 0's trace.
  std::string json(const std::vector<history_entry>& history) {
    close_segment();
    close_range();
    std::string text = R"({"segments":[)" + segments_ + R"(],"device_traces":[[)";
    bool first = true;
    for (const history_entry& e : history) {
      text += first ? "" : ",";
      first = false;
      text += R"({"action":")" + std::string(to_string(e.action)) + R"(","addr":)" + std::to_string(e.address) +
              R"(,"size":)" + std::to_string(e.size) + R"(,"stream":)" + std::to_string(e.stream.id()) +
              R"(,"time_us":)" + std::to_string(e.time_us) + R"(,"frames":[])";
      if (e.action == memory_action::oom) text += R"(,"device_free":0)";
      text += "}";
    }
    return text + R"(]],"stitched_ranges":[)" + ranges_ + "]}";
  }

 private:
  static const char* torch_state(block_state s) noexcept {
    switch (s) {
      case block_state::allocated:
        return "active_allocated";
      case block_state::pending_free:
        return "active_pending_free";
      case block_state::free:
        break;
    }
    return "inactive";
  }
  static std::string common(std::uintptr_t address, std::size_t size, stream_ref stream, const char* type,
                            std::size_t allocated, std::size_t active, std::size_t requested) {
    return R"({"device":0,"address":)" + std::to_string(address) + R"(,"total_size":)" + std::to_string(size) +
           R"(,"allocated_size":)" + std::to_string(allocated) + R"(,"active_size":)" + std::to_string(active) +
           R"(,"requested_size":)" + std::to_string(requested) + R"(,"stream":)" + std::to_string(stream.id()) +
           R"(,"segment_type":")" + type + R"(","segment_pool_id":[0,0],"is_expandable":false,"frames":[])";
  }
  void add_segment(const std::string& text) {
    segments_ += segments_.empty() ? "" : ",";
    segments_ += text;
  }
  void close_segment() {
    if (!in_segment_) return;
    in_segment_ = false;
    add_segment(common(segment_.address, segment_.size, segment_.stream, "large", allocated_, active_, requested_) +
                R"(,"blocks":[)" + blocks_ + "]}");
  }
  void close_range() {
    if (!in_range_) return;
    in_range_ = false;
    const stitched_view& r = range_;
    ranges_ += ranges_.empty() ? "" : ",";
    ranges_ += R"({"device":0,"address":)" + std::to_string(r.address) + R"(,"size":)" + std::to_string(r.size) +
               R"(,"live":)" + (r.live ? "true" : "false") + R"(,"stream":)" + std::to_string(r.stream.id()) +
               R"(,"segment_pool_id":[0,0],"pieces":[)" + pieces_ + "]}";
    if (!r.live) return;
    const bool allocated = r.state == block_state::allocated;
    add_segment(common(r.address, r.claimed, r.stream, "stitched", allocated ? r.claimed : 0, r.claimed, r.requested) +
                R"(,"blocks":[{"address":)" + std::to_string(r.address) + R"(,"size":)" + std::to_string(r.claimed) +
                R"(,"requested_size":)" + std::to_string(r.requested) + R"(,"state":")" + torch_state(r.state) +
                R"(","frames":[]}],"pieces":[)" + pieces_ + "]}");
  }

  std::string segments_, ranges_, blocks_, pieces_;
  segment_view segment_{};
  stitched_view range_{};
  bool in_segment_ = false, in_range_ = false;
  std::size_t allocated_ = 0, active_ = 0, requested_ = 0;
};

static_assert(state_visitor<snapshot_state_writer>);

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
