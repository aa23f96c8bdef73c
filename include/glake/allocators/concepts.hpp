// What every glake allocator offers (the `allocator` concept) and the optional capabilities some
// have (its refinements), so that wrappers and adaptors test for a capability instead of
// restating an interface.
#pragma once

#include <concepts>
#include <cstddef>
#include <optional>

#include "glake/backends/concepts.hpp"
#include "glake/detail/archetypes.hpp"
#include "glake/memory_state.hpp"
#include "glake/movers/concepts.hpp"
#include "glake/statistics.hpp"
#include "glake/stream.hpp"

namespace glake {

// ---------------------------------------------------------------------------------------------
// allocator
//
// Stream-ordered memory with accounting. `a` is an A, `ca` a const A, `n` a byte count, `s` a
// stream_ref, `p` a pointer that `a` returned for `n` bytes.
//
// | expression             | returns     | throws             | meaning
// |------------------------|-------------|--------------------|-----------------------------------
// | a.allocate(n, s)       | void*       | out_of_memory,     | at least n bytes for work on s,
// |                        |             | driver errors      | aligned to ca.alignment(); null for
// |                        |             |                    | n == 0; state unchanged on throw
// | a.try_allocate(n, s)   | void*       | driver errors      | as allocate, but null when out of
// |                        |             |                    | memory
// | a.deallocate(p, n, s)  | void        | usage_error        | gives p back (freed on stream s);
// |                        |             | (checked builds)   | null is ignored; a foreign pointer,
// |                        |             |                    | double free or other n is misuse
// | ca.stats()             | statistics  | no (may lock)      | a snapshot of the accounting
// | ca.reserved_bytes()    | std::size_t | no (may lock)      | stats().reserved_bytes, cheaply:
// |                        |             |                    | wrappers read it after every call
// | ca.alignment()         | std::size_t | no (noexcept)      | every pointer returned is aligned
// |                        |             |                    | to at least this
// | ca.verify()            | void        | std::logic_error   | checks every internal invariant;
// |                        |             |                    | the message names the broken one
//
// reserved_bytes and alignment are required, not optional: every model has them, a segregator
// reads its parts' reserved bytes after every call, and pmr_resource refuses alignments above the
// allocator's. The models have `default_stream` as a default argument for s; the concept does
// not ask for it. Thread safety is each model's own (its Lock policy); the concept promises none.
//
// Smallest model (tests/allocator_concepts_test.cpp compiles it; it has no refinement):
//
//   class malloc_allocator {
//    public:
//     void* allocate(std::size_t n, glake::stream_ref s) {
//       if (void* p = try_allocate(n, s); p != nullptr || n == 0) return p;
//       throw glake::out_of_memory(n, 0, stats_.active_bytes, "malloc_allocator: out of memory");
//     }
//     void* try_allocate(std::size_t n, glake::stream_ref) {
//       void* p = n == 0 ? nullptr : std::malloc(n);
//       if (p != nullptr) stats_.active_bytes += n;
//       return p;
//     }
//     void deallocate(void* p, std::size_t n, glake::stream_ref) {
//       if (p != nullptr) stats_.active_bytes -= n;
//       std::free(p);
//     }
//     glake::statistics stats() const { return stats_; }
//     std::size_t reserved_bytes() const { return 0; }
//     std::size_t alignment() const noexcept { return alignof(std::max_align_t); }
//     void verify() const {}
//    private:
//     glake::statistics stats_;
//   };
//
// Models: caching_allocator, stitching_allocator, segregator.
// ---------------------------------------------------------------------------------------------
template <class A>
concept allocator = requires(A& a, const A& ca, void* p, std::size_t n, stream_ref s) {
  { a.allocate(n, s) } -> std::same_as<void*>;
  { a.try_allocate(n, s) } -> std::same_as<void*>;
  { a.deallocate(p, n, s) } -> std::same_as<void>;
  { ca.stats() } -> std::same_as<statistics>;
  { ca.reserved_bytes() } -> std::same_as<std::size_t>;
  { ca.alignment() } noexcept -> std::same_as<std::size_t>;
  { ca.verify() } -> std::same_as<void>;
};

// ---------------------------------------------------------------------------------------------
// Refinements: the optional capabilities. A type has one only if it really does it, never as a
// stub that always fails; a wrapper has one only when it can forward it (segregator: when both
// parts have it), so a capability is never dropped without a compile-time trace. Adaptors test
// them with `if constexpr (stream_recording_allocator<A>)` and the like. `q` is a const void*.
// capabilities.hpp names each one by a tag (capability::owning, ...), and its
// forward_capabilities gives a wrapper all of them at once.
//
// Which model has which:
//   caching_allocator         owning, cache_releasing, peak_resetting
//   stitching_allocator       every one
//   segregator<Small, Large>  each one that both parts have, but memory_limiting never (a limit
//                             of the sum is not a part's); those that name a pointer but no size
//                             (record_stream, offload, ...) only when both parts are also owning
//                             (owns is how it finds the part)
//   locking_adaptor<A>        exactly A's
//   allocator_ref<Caps...>    those named in Caps (capabilities() says what the allocator has)
// ---------------------------------------------------------------------------------------------

// owning_allocator
//
// | expression  | returns | throws | meaning
// |-------------|---------|--------|--------------------------------------------------------------
// | ca.owns(q)  | bool    | no     | q is a live allocation of this allocator (its start address)
template <class A>
concept owning_allocator = allocator<A> && requires(const A& ca, const void* q) {
  { ca.owns(q) } -> std::same_as<bool>;
};

// cache_releasing_allocator
//
// | expression         | returns | throws        | meaning
// |--------------------|---------|---------------|-------------------------------------------------
// | a.release_cached() | void    | driver errors | memory held but not in use goes back to the
// |                    |         |               | backend (PyTorch's empty_cache); live
// |                    |         |               | allocations stay valid
template <class A>
concept cache_releasing_allocator = allocator<A> && requires(A& a) {
  { a.release_cached() } -> std::same_as<void>;
};

// partly_cache_releasing_allocator (refines cache_releasing_allocator)
//
// | expression          | returns     | throws        | meaning
// |---------------------|-------------|---------------|------------------------------------------
// | a.release_cached(n) | std::size_t | driver errors | held memory not in use goes back until at
// |                     |             |               | least n bytes did (or none is left); how
// |                     |             |               | many went back
template <class A>
concept partly_cache_releasing_allocator = cache_releasing_allocator<A> && requires(A& a, std::size_t bytes) {
  { a.release_cached(bytes) } -> std::same_as<std::size_t>;
};

// completion_releasing_allocator (refines partly_cache_releasing_allocator)
//
// | expression             | returns     | throws        | meaning
// |------------------------|-------------|---------------|---------------------------------------
// | a.release_completed(n) | std::size_t | driver errors | as release_cached(n), but never waits for
// |                        |             |               | the device: only memory whose last use is
// |                        |             |               | known complete goes back
template <class A>
concept completion_releasing_allocator = partly_cache_releasing_allocator<A> && requires(A& a, std::size_t bytes) {
  { a.release_completed(bytes) } -> std::same_as<std::size_t>;
};

// offloading_allocator (refines owning_allocator)
//
// Live allocations whose memory moves to far memory (the host) and back while their addresses
// stay the same (the tiered_memory contract of movers/concepts.hpp, per allocation).
//
// | expression          | returns   | throws                                | meaning
// |---------------------|-----------|---------------------------------------|-------------------------
// | a.offload(p, s)     | void      | usage_error (not live here, moved     | p's memory goes to far
// |                     |           | already, nothing of it movable),      | memory after the work
// |                     |           | out_of_memory (far memory), driver    | queued on s; p stays
// |                     |           | errors; nothing moved on a throw      | valid
// | a.prefetch(p, s)    | void      | usage_error, out_of_memory (device),  | and back
// |                     |           | driver errors; nothing moved on a     |
// |                     |           | throw                                 |
// | a.residence_of(p)   | residence | usage_error (not live here)           | where p's memory is
template <class A>
concept offloading_allocator =
    owning_allocator<A> && requires(A& a, const A& ca, void* p, const void* cp, stream_ref stream) {
      { a.offload(p, stream) } -> std::same_as<void>;
      { a.prefetch(p, stream) } -> std::same_as<void>;
      { ca.residence_of(cp) } -> std::same_as<residence>;
    };

// deferring_offloading_allocator (refines offloading_allocator)
//
// Moves whose remap may come after the call (move_completion, movers/concepts.hpp).
//
// | expression             | returns     | throws              | meaning
// |------------------------|-------------|---------------------|--------------------------------------
// | a.offload(p, s, when)  | void        | as offload          | with `deferred`: the copies are queued
// |                        |             |                     | and the call returns; p's memory moves
// |                        |             |                     | once they completed
// | a.prefetch(p, s, when) | void        | as prefetch         | likewise
// | a.offload(p, s, when,  | void        | as offload          | the copies queued on c, after the
// |           c)           |             |                     | work queued on s
// | a.prefetch(p, s, when, | void        | as prefetch         | likewise
// |            c)          |             |                     |
// | a.complete_move(p)     | void        | driver errors       | p's deferred move, if any, is complete
// |                        |             |                     | (waits for its copies)
// | a.complete_moves(wait) | std::size_t | no                  | completes the deferred moves whose
// |                        |             |                     | copies are done (every one with
// |                        |             |                     | `wait`); returns how many completed
template <class A>
concept deferring_offloading_allocator =
    offloading_allocator<A> && requires(A& a, void* p, const void* cp, stream_ref stream, move_completion when, bool wait) {
      { a.offload(p, stream, when) } -> std::same_as<void>;
      { a.prefetch(p, stream, when) } -> std::same_as<void>;
      { a.offload(p, stream, when, stream) } -> std::same_as<void>;
      { a.prefetch(p, stream, when, stream) } -> std::same_as<void>;
      { a.complete_move(cp) } -> std::same_as<void>;
      { a.complete_moves(wait) } -> std::same_as<std::size_t>;
    };

// far_copy_keeping_allocator (refines offloading_allocator)
//
// Allocations marked as not written while on the device keep their far copy once they have been
// away and back, so that their next offload copies nothing.
//
// | expression            | returns     | throws                       | meaning
// |-----------------------|-------------|------------------------------|----------------------------
// | a.keep_far_copy(p, k) | void        | usage_error (no far memory,  | k: p is marked (a write to
// |                       |             | p not a live large           | it on the device is lost at
// |                       |             | allocation); nothing changed | its next offload); !k: the
// |                       |             |                              | mark and its copy go
// | ca.far_copy_bytes()   | std::size_t | no                           | far memory the copies of
// |                       |             |                              | marked allocations hold
template <class A>
concept far_copy_keeping_allocator = offloading_allocator<A> && requires(A& a, const A& ca, const void* cp, bool keep) {
  { a.keep_far_copy(cp, keep) } -> std::same_as<void>;
  { ca.far_copy_bytes() } -> std::same_as<std::size_t>;
};

// peak_resetting_allocator
//
// | expression      | returns    | throws | meaning
// |-----------------|------------|--------|---------------------------------------------------------
// | a.reset_peaks() | statistics | no     | the peaks (active, allocated, reserved) restart from the
// |                 |            |        | current values; returns the statistics just before, so
// |                 |            |        | no peak between reading and resetting is lost
template <class A>
concept peak_resetting_allocator = allocator<A> && requires(A& a) {
  { a.reset_peaks() } -> std::same_as<statistics>;
};

// memory_limiting_allocator
//
// | expression            | returns     | throws        | meaning
// |-----------------------|-------------|---------------|------------------------------------------
// | a.set_memory_limit(n) | void        | driver errors | at most n physical bytes from now on (0:
// |                       |             |               | none); above it, cached memory goes back
// |                       |             |               | at once and growth waits for frees; live
// |                       |             |               | allocations stay valid
// | ca.memory_limit()     | std::size_t | no            | the limit in force (0: none)
template <class A>
concept memory_limiting_allocator = allocator<A> && requires(A& a, const A& ca, std::size_t n) {
  { a.set_memory_limit(n) } -> std::same_as<void>;
  { ca.memory_limit() } -> std::same_as<std::size_t>;
};

// stream_recording_allocator
//
// | expression            | returns | throws             | meaning
// |-----------------------|---------|--------------------|------------------------------------------
// | a.record_stream(p, s) | void    | usage_error for a  | p is also used by work queued on s
// |                       |         | p not live here;   | (PyTorch's record_stream): once p is
// |                       |         | driver errors      | freed, its memory is reused only after
// |                       |         |                    | the work queued on s by then completed
template <class A>
concept stream_recording_allocator = allocator<A> && requires(A& a, void* p, stream_ref s) {
  { a.record_stream(p, s) } -> std::same_as<void>;
};

// snapshotting_allocator
//
// `v` is a state_visitor (memory_state.hpp).
//
// | expression        | returns | throws | meaning
// |-------------------|---------|--------|----------------------------------------------------------
// | ca.visit_state(v) | void    | what v | every segment with its blocks, then every stitched range
// |                   |         | throws | with its pieces, under the allocator's lock: one
// |                   |         |        | consistent picture, O(blocks); changes nothing
template <class A>
concept snapshotting_allocator = allocator<A> && requires(const A& ca, detail::state_visitor_archetype& v) {
  { ca.visit_state(v) } -> std::same_as<void>;
};

// observable_allocator
//
// `f` is a memory_observer (memory_state.hpp), `c` a void*.
//
// | expression                  | returns | throws | meaning
// |-----------------------------|---------|--------|-------------------------------------------------
// | a.set_memory_observer(f, c) | void    | no     | from now on f(c, event) is told, under the
// |                             |         |        | allocator's lock, of each segment_alloc /
// |                             |         |        | segment_free / segment_map / segment_unmap and
// |                             |         |        | each free_completed (when the memory is
// |                             |         |        | reusable); f null: nobody is. Costs a test of f
// |                             |         |        | where an event could happen
template <class A>
concept observable_allocator = allocator<A> && requires(A& a, memory_observer f, void* c) {
  { a.set_memory_observer(f, c) } -> std::same_as<void>;
};

// memory_retaining_allocator
//
// | expression          | returns | throws | meaning
// |---------------------|---------|--------|--------------------------------------------------------
// | a.retain_memory(b)  | void    | no     | while b is true: no memory goes back to the backend and
// |                     |         |        | no mapping is removed or changed, so every address it
// |                     |         |        | ever handed out keeps its physical memory (what a CUDA
// |                     |         |        | graph's private pool needs: replays use the addresses
// |                     |         |        | captured, freed or not); it may still grow and reuse
// |                     |         |        | its own free memory
template <class A>
concept memory_retaining_allocator = allocator<A> && requires(A& a, bool b) {
  { a.retain_memory(b) } -> std::same_as<void>;
};

// ---------------------------------------------------------------------------------------------
// allocator_location_v<A>: where A's memory lives, when A's type says so; empty otherwise.
//
// Read from the provider, through `A::provider_type` (stitching_allocator),
// `A::source_type::provider_type` (caching_allocator over a vmm or expandable source), or both
// parts of a segregator (`small_type`, `large_type`) when they agree. Adaptors that must declare
// the memory's kind in a type (cuda_mr_resource's device_accessible / host_accessible) use it as
// their default and ask for the property explicitly when it is empty.
// ---------------------------------------------------------------------------------------------
namespace detail {
template <class A>
constexpr std::optional<memory_location> allocator_location_of() {
  if constexpr (requires { typename A::provider_type; }) {
    return static_location_v<typename A::provider_type>;
  } else if constexpr (requires { typename A::source_type::provider_type; }) {
    return static_location_v<typename A::source_type::provider_type>;
  } else if constexpr (requires {
                         typename A::small_type;
                         typename A::large_type;
                       }) {
    constexpr auto small = allocator_location_of<typename A::small_type>();
    constexpr auto large = allocator_location_of<typename A::large_type>();
    return small == large ? small : std::nullopt;
  } else {
    return std::nullopt;
  }
}
}  // namespace detail

template <class A>
inline constexpr std::optional<memory_location> allocator_location_v = detail::allocator_location_of<A>();

}  // namespace glake
