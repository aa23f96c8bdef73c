// A memory snapshot in the shape of PyTorch's torch.cuda.memory._snapshot(), the dict that
// torch/cuda/_memory_viz.py and pytorch.org/memory_viz read, written as JSON: one writer for
// the PyTorch plug-in (integrations/torch/glake_torch.cpp) and glake-replay --snapshot.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "glake/memory_history.hpp"
#include "glake/memory_state.hpp"
#include "glake/stream.hpp"

namespace glake {

/// A state_visitor that writes what it is shown as a snapshot's "segments" and glake's own
/// "stitched_ranges", and joins them with the devices' histories as "device_traces".
///
/// Physical segments are "large" segments; the small pool's blocks sit in place of the blocks it
/// borrowed (marked "pool": "small"). A live stitched allocation is a segment of its own, of
/// segment_type "stitched", holding one block; its memory is its pieces' blocks in their home
/// segments, shown there "inactive" with "stitched_into", so each allocated byte is counted once
/// and the history's segment_map / alloc at the stitched address land in a segment (docs/pytorch.md).
/// Stacks are not recorded: "frames" are empty. What is visited belongs to the device and pool
/// last set by `device` and `pool` (0 and (0, 0) until then).
///
/// Cost: linear in what is visited (string appends). Thread safety: none; one visit at a time.
class memory_snapshot_writer {
 public:
  /// What follows belongs to device `d`; closes what the previous device left open.
  void device(int d) {
    finish();
    device_ = d;
  }
  /// What follows belongs to the private pool `id` (PyTorch's MempoolId_t; (0, 0): the general one).
  void pool(std::uint64_t first, std::uint64_t second) {
    finish();
    pool_first_ = first;
    pool_second_ = second;
  }

  // state_visitor
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
    finish();
    range_ = r;
    in_range_ = true;
    pieces_.clear();
  }
  void piece(const stitched_piece_view& p) {
    pieces_ += pieces_.empty() ? "" : ",";
    pieces_ += R"({"address":)" + std::to_string(p.address) + R"(,"size":)" + std::to_string(p.size) + "}";
  }

  /// Closes the segment or stitched range still open.
  void finish() {
    close_segment();
    close_range();
  }

  /// The snapshot: the segments and ranges visited, and `traces[d]` as device d's history.
  std::string json(const std::vector<std::vector<history_entry>>& traces) {
    finish();
    std::string text = R"({"segments":[)" + segments_ + R"(],"device_traces":[)";
    for (std::size_t d = 0; d < traces.size(); ++d) {
      text += d == 0 ? "[" : ",[";
      append_trace(text, traces[d]);
      text += "]";
    }
    return text + R"(],"stitched_ranges":[)" + ranges_ + "]}";
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
  static void append_trace(std::string& text, const std::vector<history_entry>& history) {
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
  }
  std::string pool_text() const { return std::to_string(pool_first_) + "," + std::to_string(pool_second_); }
  std::string common(std::uintptr_t address, std::size_t size, stream_ref stream, const char* type,
                     std::size_t allocated, std::size_t active, std::size_t requested) const {
    return R"({"device":)" + std::to_string(device_) + R"(,"address":)" + std::to_string(address) +
           R"(,"total_size":)" + std::to_string(size) + R"(,"allocated_size":)" + std::to_string(allocated) +
           R"(,"active_size":)" + std::to_string(active) + R"(,"requested_size":)" + std::to_string(requested) +
           R"(,"stream":)" + std::to_string(stream.id()) + R"(,"segment_type":")" + type +
           R"(","segment_pool_id":[)" + pool_text() + R"(],"is_expandable":false,"frames":[])";
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
    ranges_ += R"({"device":)" + std::to_string(device_) + R"(,"address":)" + std::to_string(r.address) +
               R"(,"size":)" + std::to_string(r.size) + R"(,"live":)" + (r.live ? "true" : "false") +
               R"(,"stream":)" + std::to_string(r.stream.id()) + R"(,"segment_pool_id":[)" + pool_text() +
               R"(],"pieces":[)" + pieces_ + "]}";
    if (!r.live) return;
    const bool allocated = r.state == block_state::allocated;
    add_segment(common(r.address, r.claimed, r.stream, "stitched", allocated ? r.claimed : 0, r.claimed, r.requested) +
                R"(,"blocks":[{"address":)" + std::to_string(r.address) + R"(,"size":)" + std::to_string(r.claimed) +
                R"(,"requested_size":)" + std::to_string(r.requested) + R"(,"state":")" + torch_state(r.state) +
                R"(","frames":[]}],"pieces":[)" + pieces_ + "]}");
  }

  std::string segments_, ranges_, blocks_, pieces_;
  int device_ = 0;
  std::uint64_t pool_first_ = 0, pool_second_ = 0;
  segment_view segment_{};
  stitched_view range_{};
  bool in_segment_ = false, in_range_ = false;
  std::size_t allocated_ = 0, active_ = 0, requested_ = 0;
};

static_assert(state_visitor<memory_snapshot_writer>);

}  // namespace glake
