// One live allocation of an offloading allocator seen as tiered_memory, so that a
// workload_scheduler keeps an allocator's blocks (a framework's tensors) under a budget as it
// keeps virtual_buffers.
#pragma once

#include <cstddef>
#include <string>

#include "glake/allocators/concepts.hpp"
#include "glake/errors.hpp"
#include "glake/movers/concepts.hpp"
#include "glake/stream.hpp"

namespace glake {

// ---------------------------------------------------------------------------------------------
// allocation_memory
//
// The tiered_memory of one live allocation [p, p + bytes) of an offloading_allocator A that also
// takes record_stream(p, s). The allocation moves whole, as A moves it: its one piece is the
// whole allocation, so an offload or prefetch of any range inside it moves all of it (the
// contract's "pieces covering the range"), and residence_of answers for all of it.
//
// | expression            | what A is asked                 | throws
// |-----------------------|---------------------------------|-------------------------------------
// | construction          | a.movable_bytes(p), if it has it| usage_error: an allocation that
// |                       |                                 | cannot move, null or empty
// | m.data(), m.size()    | nothing: p and bytes            | no
// | m.residence_of(off)   | a.residence_of(p)               | usage_error (off outside)
// | m.offload(off, n, s)  | a.offload(p, s)                 | usage_error (range outside), A's
// | m.prefetch(off, n, s) | a.prefetch(p, s)                | usage_error (range outside), A's
// | m.record_stream(s)    | a.record_stream(p, s)           | no (A's errors are dropped)
// | m.offload(off, n, s,  | a.offload(p, s, w) (a deferring | as offload
// |   w), prefetch too    | offloading allocator only)      |
// | m.settle()            | a.complete_move(p)              | A's
// | m.settle_on(s)        | a.ready_on(p, s), if A has it   | A's
//
// What an allocator moves: the stitching allocator moves the allocation's whole handles; bytes in
// a handle it shares with a neighbouring block stay on the device (at most two handles' worth, at
// its ends). A budget counting size() is then short by those bytes: allocations of many handles,
// or handle-aligned ones, keep it exact. The object holds a reference to the allocator and the
// allocation's address; it does not own the allocation (free it after the scheduler stops
// managing it). Complexity: as A's calls. Thread safety: A's.
// ---------------------------------------------------------------------------------------------
template <offloading_allocator A>
  requires requires(A& a, void* p, stream_ref s) { a.record_stream(p, s); }
class allocation_memory {
 public:
  allocation_memory(A& allocator, void* p, std::size_t bytes)
      : allocator_(&allocator), data_(p), size_(bytes) {
    if (p == nullptr || bytes == 0) {
      throw usage_error(usage_error::kind::bad_argument, "glake::allocation_memory: a null or empty allocation");
    }
    if constexpr (requires { allocator.movable_bytes(p); }) {
      // Refused now rather than when a scheduler first needs it moved.
      if (allocator.residence_of(p) == residence::device && allocator.movable_bytes(p) == 0) {
        throw usage_error(usage_error::kind::bad_argument,
                          "glake::allocation_memory: the allocation cannot move (no whole handle of its own, "
                          "handles a live stitch maps, retained memory, or no far memory attached)");
      }
    }
  }

  void* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

  residence residence_of(std::size_t offset) const {
    if (offset >= size_) throw_outside("residence_of", offset, 1);
    return allocator_->residence_of(data_);
  }

  void offload(std::size_t offset, std::size_t bytes, stream_ref stream = default_stream) {
    check_range("offload", offset, bytes);
    allocator_->offload(data_, stream);
  }

  void prefetch(std::size_t offset, std::size_t bytes, stream_ref stream = default_stream) {
    check_range("prefetch", offset, bytes);
    allocator_->prefetch(data_, stream);
  }

  /// As above, the move's completion deferred or not, the copies on `copies` after the work
  /// queued on `stream` (deferring_tiered_memory).
  void offload(std::size_t offset, std::size_t bytes, stream_ref stream, move_completion when)
    requires deferring_offloading_allocator<A>
  {
    offload(offset, bytes, stream, when, stream);
  }
  void prefetch(std::size_t offset, std::size_t bytes, stream_ref stream, move_completion when)
    requires deferring_offloading_allocator<A>
  {
    prefetch(offset, bytes, stream, when, stream);
  }
  void offload(std::size_t offset, std::size_t bytes, stream_ref stream, move_completion when, stream_ref copies)
    requires deferring_offloading_allocator<A>
  {
    check_range("offload", offset, bytes);
    allocator_->offload(data_, stream, when, copies);
  }
  void prefetch(std::size_t offset, std::size_t bytes, stream_ref stream, move_completion when, stream_ref copies)
    requires deferring_offloading_allocator<A>
  {
    check_range("prefetch", offset, bytes);
    allocator_->prefetch(data_, stream, when, copies);
  }
  /// The allocation's deferred move, if any, is complete.
  void settle()
    requires deferring_offloading_allocator<A>
  {
    allocator_->complete_move(data_);
  }
  /// Work queued on `stream` from now on may use the allocation (A's ready_on: a move that
  /// needs only its copies is waited for by the stream, not by the host).
  void settle_on(stream_ref stream)
    requires deferring_offloading_allocator<A> && requires(A& a, const void* q, stream_ref s) { a.ready_on(q, s); }
  {
    allocator_->ready_on(data_, stream);
  }

  void record_stream(stream_ref stream) noexcept {
    try {
      allocator_->record_stream(data_, stream);
    } catch (...) {
    }
  }

 private:
  void check_range(const char* who, std::size_t offset, std::size_t bytes) const {
    if (bytes == 0 || offset >= size_ || bytes > size_ - offset) throw_outside(who, offset, bytes);
  }

  [[noreturn]] void throw_outside(const char* who, std::size_t offset, std::size_t bytes) const {
    throw usage_error(usage_error::kind::bad_argument,
                      std::string("glake::allocation_memory::") + who + ": [" + std::to_string(offset) + ", +" +
                          std::to_string(bytes) + ") is not inside the allocation of " + std::to_string(size_) +
                          " bytes");
  }

  A* allocator_;
  void* data_;
  std::size_t size_;
};

}  // namespace glake
