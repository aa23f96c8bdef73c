// What an allocator shows of its memory: its segments, blocks and stitched ranges to a visitor
// (for snapshots), and the changes to them as events to an observer (for memory histories).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "glake/stream.hpp"

namespace glake {

/// Where a block stands. `pending_free`: the caller freed it, but other streams recorded on it
/// (record_stream) may still use it, so its memory is not reusable yet (PyTorch's
/// active_pending_free).
enum class block_state : std::uint8_t { allocated, pending_free, free };

constexpr std::string_view to_string(block_state s) noexcept {
  switch (s) {
    case block_state::allocated:
      return "allocated";
    case block_state::pending_free:
      return "pending_free";
    case block_state::free:
      return "free";
  }
  return "?";
}

/// A segment: a range of physical memory the allocator holds, mapped at `address`. Its blocks
/// tile it in address order. `stream` is the stream it was made for; its free blocks may have
/// moved to other streams since.
struct segment_view {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  stream_ref stream{};
};

/// A block of the segment visited last.
struct block_view {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  std::size_t requested = 0;  ///< what the caller asked for while allocated or pending; else 0
  block_state state = block_state::free;
  stream_ref stream{};
  std::uintptr_t small_segment = 0;  ///< the small pool's segment (a borrowed block) holding it; 0: none
  std::uintptr_t stitched_into = 0;  ///< the live stitched range that claims it; 0: none
};

/// A stitched range: pieces of segments (their physical memory) mapped side by side at
/// `address`. While live, its first `claimed` bytes are one allocation; a cached one (not live)
/// holds no memory of its own and is reused or unmapped later.
struct stitched_view {
  std::uintptr_t address = 0;
  std::size_t size = 0;     ///< mapped from address
  std::size_t claimed = 0;  ///< the allocation's bytes, while live
  std::size_t requested = 0;
  stream_ref stream{};
  bool live = false;
  block_state state = block_state::free;  ///< allocated or pending_free while live
};

/// One piece of the stitched range visited last: `size` bytes of a segment from `address`.
struct stitched_piece_view {
  std::uintptr_t address = 0;
  std::size_t size = 0;
};

// ---------------------------------------------------------------------------------------------
// state_visitor
//
// What snapshotting_allocator::visit_state calls. `v` is a V, `s` a segment_view, `b` a
// block_view, `r` a stitched_view, `p` a stitched_piece_view.
//
// | expression    | returns | meaning
// |---------------|---------|-------------------------------------------------------------------
// | v.segment(s)  | void    | a segment; its blocks follow, in address order
// | v.block(b)    | void    | a block of the last segment
// | v.stitched(r) | void    | a stitched range (after every segment); its pieces follow in order
// | v.piece(p)    | void    | a piece of the last stitched range
//
// The calls come under the allocator's lock: a visitor must not call back into it.
// ---------------------------------------------------------------------------------------------
template <class V>
concept state_visitor = requires(V& v, const segment_view& s, const block_view& b, const stitched_view& r,
                                 const stitched_piece_view& p) {
  v.segment(s);
  v.block(b);
  v.stitched(r);
  v.piece(p);
};

/// What happened to memory, as PyTorch's memory history names it (the `action` of its trace
/// entries). Allocators report the segment actions and free_completed; an adaptor that sees
/// the calls adds alloc, free_requested and oom.
enum class memory_action : std::uint8_t {
  alloc,           ///< an allocation was handed out
  free_requested,  ///< the caller freed it
  free_completed,  ///< its memory is reusable (at once, or once recorded streams' work is done)
  segment_alloc,   ///< physical memory was added as a new segment
  segment_free,    ///< a segment went back to the backend
  segment_map,     ///< a stitched range now holds a live allocation (its memory is a segment's)
  segment_unmap,   ///< that allocation was freed: the range holds none
  oom,             ///< an allocation failed for want of memory
};

constexpr std::string_view to_string(memory_action a) noexcept {
  switch (a) {
    case memory_action::alloc:
      return "alloc";
    case memory_action::free_requested:
      return "free_requested";
    case memory_action::free_completed:
      return "free_completed";
    case memory_action::segment_alloc:
      return "segment_alloc";
    case memory_action::segment_free:
      return "segment_free";
    case memory_action::segment_map:
      return "segment_map";
    case memory_action::segment_unmap:
      return "segment_unmap";
    case memory_action::oom:
      return "oom";
  }
  return "?";
}

/// One change: `size` bytes at `address`, on `stream`.
struct memory_event {
  memory_action action = memory_action::alloc;
  std::uintptr_t address = 0;
  std::size_t size = 0;
  stream_ref stream{};
};

/// Told of each change, with the context it was registered with. Called under the allocator's
/// lock, so it must be quick, must not throw and must not call back into the allocator.
using memory_observer = void (*)(void* context, const memory_event& event) noexcept;

}  // namespace glake
