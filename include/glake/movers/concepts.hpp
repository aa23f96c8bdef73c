// The contract of memory that moves between the device and the host while its addresses stay
// the same: what offload and prefetch promise, whoever implements them.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>

#include "glake/stream.hpp"

namespace glake {

/// Where a piece of tiered memory lives now.
enum class residence : std::uint8_t {
  none,    ///< no physical memory (reserved addresses only; reading it faults)
  device,  ///< the device's own memory
  host,    ///< host memory mapped at the same addresses: the device reads it over the bus
};

/// When a move's remap happens: before the call returns (on_return: the call waits for the work
/// queued before the move and for its copies), or later, once its copies have completed
/// (deferred: the call queues the copies and returns; the memory is remapped by a later call
/// that finds them done, or by a call that settles the move). Backends without events (whose
/// copies are done when they return) complete every move on return.
enum class move_completion : std::uint8_t { on_return, deferred };

constexpr const char* to_string(residence r) noexcept {
  switch (r) {
    case residence::none: return "none";
    case residence::device: return "device";
    case residence::host: return "host";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------
// tiered_memory
//
// Memory whose physical backing moves between the device and the host in pieces while every
// pointer into it stays valid. Moves are ordered on a stream: an offload's copy runs after the
// work queued on its stream, and work queued there afterwards sees the moved memory; memory is
// never unmapped while work queued on the stream (or on a stream recorded for it) may still
// touch it. Each call is all-or-nothing: when it throws, every piece is where it was, with its
// bytes.
//
// | expression              | returns   | throws                                   | meaning
// |-------------------------|-----------|------------------------------------------|---------------------------
// | m.data()                | void*     | no                                       | the first address; stable
// | m.size()                | size_t    | no                                       | bytes addressable from data()
// | m.residence_of(off)     | residence | usage_error (off out of range)           | where the piece holding
// |                         |           |                                          | byte `off` lives
// | m.offload(off, n, s)    | void      | out_of_memory (host memory), usage_error | the pieces covering
// |                         |           | (a piece not on the device), driver_error| [off, off+n) move to the
// |                         |           |                                          | host; their device memory
// |                         |           |                                          | is given back
// | m.prefetch(off, n, s)   | void      | out_of_memory (device memory),           | they move back
// |                         |           | usage_error (a piece not on the host),   |
// |                         |           | driver_error                             |
// | m.record_stream(s)      | void      | no                                       | work on s also uses it
//
// Models: virtual_buffer (movers/virtual_buffer.hpp).
// ---------------------------------------------------------------------------------------------
template <class M>
concept tiered_memory = requires(M& m, const M& cm, std::size_t offset, std::size_t bytes, stream_ref stream) {
  { cm.data() } noexcept -> std::same_as<void*>;
  { cm.size() } noexcept -> std::same_as<std::size_t>;
  { cm.residence_of(offset) } -> std::same_as<residence>;
  { m.offload(offset, bytes, stream) } -> std::same_as<void>;
  { m.prefetch(offset, bytes, stream) } -> std::same_as<void>;
  { m.record_stream(stream) } -> std::same_as<void>;
};

// ---------------------------------------------------------------------------------------------
// deferring_tiered_memory (refines tiered_memory)
//
// Moves whose remap may come after the call (move_completion::deferred): the calling thread does
// not wait for the device, so copies overlap the work it queues next. Between such a call and
// the move's completion, no work may touch the memory moved (queued before the call on a stream
// other than the move's, or queued after it): the remap may come at any later call. settle() is
// that completion, before the memory is used again.
//
// | expression                 | returns | throws                | meaning
// |----------------------------|---------|-----------------------|----------------------------------
// | m.offload(off, n, s, when) | void    | as offload            | as offload; with `deferred` the
// |                            |         |                       | device memory goes back once the
// |                            |         |                       | copies completed
// | m.prefetch(off, n, s, when)| void    | as prefetch           | as prefetch, likewise
// | m.offload(off, n, s, when, | void    | as offload            | the copies queued on c after the
// |           c)               |         |                       | work queued on s (c may be s)
// | m.prefetch(off, n, s, when,| void    | as prefetch           | likewise
// |            c)              |         |                       |
// | m.settle()                 | void    | driver_error          | every deferred move of m is
// |                            |         |                       | complete (waits for its copies);
// |                            |         |                       | the memory may be used
//
// Optional: m.settle_on(s), after which work queued on s may use the memory; a move that needs
// nothing but its copies may then be waited for by s (an event wait) rather than by the host.
// A scheduler uses it where present, settle() otherwise.
// ---------------------------------------------------------------------------------------------
template <class M>
concept deferring_tiered_memory =
    tiered_memory<M> && requires(M& m, std::size_t offset, std::size_t bytes, stream_ref stream, move_completion when) {
      { m.offload(offset, bytes, stream, when) } -> std::same_as<void>;
      { m.prefetch(offset, bytes, stream, when) } -> std::same_as<void>;
      { m.offload(offset, bytes, stream, when, stream) } -> std::same_as<void>;
      { m.prefetch(offset, bytes, stream, when, stream) } -> std::same_as<void>;
      { m.settle() } -> std::same_as<void>;
    };

}  // namespace glake
