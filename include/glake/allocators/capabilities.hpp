// The optional capabilities of allocators (concepts.hpp's refinements) as tag types, so that code
// can name a capability, ask whether an allocator has it, and forward all of them at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <utility>

#include "glake/allocators/concepts.hpp"
#include "glake/detail/archetypes.hpp"
#include "glake/memory_state.hpp"
#include "glake/movers/concepts.hpp"
#include "glake/statistics.hpp"
#include "glake/stream.hpp"

namespace glake {

// ---------------------------------------------------------------------------------------------
// capability_tag
//
// One type per refinement of concepts.hpp, in namespace glake::capability (as CCCL's memory
// kinds are property types). `P` is a tag, `A` an allocator type.
//
// | expression           | type                  | meaning
// |----------------------|-----------------------|---------------------------------------------
// | P::bit               | unsigned (constexpr)  | its place in a capability_set, below 32
// | P::name              | const char* constexpr | the refinement's name without "_allocator"
// | P::template of<A>    | bool (constexpr)      | A models the refinement
//
// Models: every tag below (static_asserts after the list).
// ---------------------------------------------------------------------------------------------
template <class P>
concept capability_tag = requires {
  { P::bit } -> std::convertible_to<unsigned>;
  { P::name } -> std::convertible_to<const char*>;
  { P::template of<detail::allocator_archetype> } -> std::convertible_to<bool>;
};

namespace capability {
// clang-format off
struct owning { static constexpr unsigned bit = 0; static constexpr const char* name = "owning";
  template <class A> static constexpr bool of = owning_allocator<A>; };
struct cache_releasing { static constexpr unsigned bit = 1; static constexpr const char* name = "cache_releasing";
  template <class A> static constexpr bool of = cache_releasing_allocator<A>; };
struct partly_cache_releasing { static constexpr unsigned bit = 2; static constexpr const char* name = "partly_cache_releasing";
  template <class A> static constexpr bool of = partly_cache_releasing_allocator<A>; };
struct completion_releasing { static constexpr unsigned bit = 3; static constexpr const char* name = "completion_releasing";
  template <class A> static constexpr bool of = completion_releasing_allocator<A>; };
struct offloading { static constexpr unsigned bit = 4; static constexpr const char* name = "offloading";
  template <class A> static constexpr bool of = offloading_allocator<A>; };
struct deferring_offloading { static constexpr unsigned bit = 5; static constexpr const char* name = "deferring_offloading";
  template <class A> static constexpr bool of = deferring_offloading_allocator<A>; };
struct far_copy_keeping { static constexpr unsigned bit = 6; static constexpr const char* name = "far_copy_keeping";
  template <class A> static constexpr bool of = far_copy_keeping_allocator<A>; };
struct peak_resetting { static constexpr unsigned bit = 7; static constexpr const char* name = "peak_resetting";
  template <class A> static constexpr bool of = peak_resetting_allocator<A>; };
struct memory_limiting { static constexpr unsigned bit = 8; static constexpr const char* name = "memory_limiting";
  template <class A> static constexpr bool of = memory_limiting_allocator<A>; };
struct stream_recording { static constexpr unsigned bit = 9; static constexpr const char* name = "stream_recording";
  template <class A> static constexpr bool of = stream_recording_allocator<A>; };
struct snapshotting { static constexpr unsigned bit = 10; static constexpr const char* name = "snapshotting";
  template <class A> static constexpr bool of = snapshotting_allocator<A>; };
struct observable { static constexpr unsigned bit = 11; static constexpr const char* name = "observable";
  template <class A> static constexpr bool of = observable_allocator<A>; };
struct memory_retaining { static constexpr unsigned bit = 12; static constexpr const char* name = "memory_retaining";
  template <class A> static constexpr bool of = memory_retaining_allocator<A>; };
// clang-format on

/// Every tag, in bit order.
using all = std::tuple<owning, cache_releasing, partly_cache_releasing, completion_releasing, offloading,
                       deferring_offloading, far_copy_keeping, peak_resetting, memory_limiting, stream_recording,
                       snapshotting, observable, memory_retaining>;
}  // namespace capability

static_assert(capability_tag<capability::owning>);
static_assert(capability_tag<capability::cache_releasing>);
static_assert(capability_tag<capability::partly_cache_releasing>);
static_assert(capability_tag<capability::completion_releasing>);
static_assert(capability_tag<capability::offloading>);
static_assert(capability_tag<capability::deferring_offloading>);
static_assert(capability_tag<capability::far_copy_keeping>);
static_assert(capability_tag<capability::peak_resetting>);
static_assert(capability_tag<capability::memory_limiting>);
static_assert(capability_tag<capability::stream_recording>);
static_assert(capability_tag<capability::snapshotting>);
static_assert(capability_tag<capability::observable>);
static_assert(capability_tag<capability::memory_retaining>);

/// A has capability P: the same test as P's refinement concept, reached through the tag.
template <class A, class P>
concept has_capability = capability_tag<P> && P::template of<A>;

/// Every one of As has capability P (what a wrapper of several parts can forward).
template <class P, class... As>
concept capability_of_all = (has_capability<As, P> && ...);

/// A set of capabilities, one bit per tag: what an allocator type has, read at run time (the
/// type-erased allocator_ref keeps one).
class capability_set {
 public:
  constexpr capability_set() noexcept = default;
  template <capability_tag P>
  constexpr bool contains(P = {}) const noexcept {
    return (bits_ >> P::bit & 1u) != 0;
  }
  template <capability_tag P>
  constexpr capability_set with(P = {}) const noexcept {
    return capability_set(bits_ | 1u << P::bit);
  }
  constexpr std::uint32_t bits() const noexcept { return bits_; }
  friend constexpr bool operator==(capability_set, capability_set) noexcept = default;

 private:
  constexpr explicit capability_set(std::uint32_t bits) noexcept : bits_(bits) {}
  std::uint32_t bits_ = 0;
};

namespace detail {
template <class A, class... P>
constexpr capability_set capabilities_of(std::tuple<P...>*) noexcept {
  capability_set set;
  ((set = has_capability<A, P> ? set.with(P{}) : set), ...);
  return set;
}
}  // namespace detail

/// The capabilities A has.
template <class A>
inline constexpr capability_set capabilities_of_v = detail::capabilities_of<A>(static_cast<capability::all*>(nullptr));

static_assert(capabilities_of_v<detail::allocator_archetype> == capability_set{});
static_assert(capabilities_of_v<detail::full_allocator_archetype> ==
              capability_set{}
                  .with(capability::owning{})
                  .with(capability::cache_releasing{})
                  .with(capability::peak_resetting{})
                  .with(capability::stream_recording{}));

// ---------------------------------------------------------------------------------------------
// forward_capabilities<Derived, Parts...>: a base that gives a wrapper of one or more allocators
// (its parts) every capability that all parts have, so the wrapper restates none of them.
//
// Derived (which befriends this base) supplies, privately:
//
// | expression                   | returns              | meaning
// |------------------------------|----------------------|------------------------------------------
// | d.capability_parts()         | std::tuple<Parts&...>| the parts, in order (also on a const d,
// |                              | (const&... on const) | as const references)
// | d.capability_guard()         | a lock guard         | held around every forwarded call (const)
// | d.capabilities_changed()     | void                 | after each call that may change what the
// |                              |                      | parts hold (release, offload): Derived's
// |                              |                      | own accounting reads them again
//
// How each capability is forwarded, when every part has it:
//   owns: any part owns the pointer. release_cached(), retain_memory, set_memory_observer,
//   visit_state: each part in order. release_cached(n), release_completed(n): parts in order until
//   n bytes went back; the sum. record_stream, offload, prefetch, residence_of, keep_far_copy,
//   complete_move: the part that owns the pointer (with several parts, only when every part is
//   owning too, since these calls name no size); a pointer no part owns goes to the last part,
//   which reports it. complete_moves, far_copy_bytes: summed. reset_peaks, set_memory_limit and
//   memory_limit: only with one part (a peak or limit of a sum is not the parts' own; a wrapper
//   of several writes its own, which hides these).
// A name Derived declares itself hides the forwarded one (C++ name hiding), so a wrapper can
// still refine one capability by hand. Complexity: the parts' own, plus one owns per part for a
// routed call. Thread safety and streams: Derived's guard, the parts' streams.
// ---------------------------------------------------------------------------------------------
template <class Derived, allocator... Parts>
class forward_capabilities {
  static_assert(sizeof...(Parts) >= 1);
  static constexpr bool single = sizeof...(Parts) == 1;
  // Calls that name a pointer but no size reach the right part through owns.
  static constexpr bool routable = single || capability_of_all<capability::owning, Parts...>;

 public:
  bool owns(const void* p) const
    requires capability_of_all<capability::owning, Parts...>
  {
    auto guard = self().capability_guard();
    return std::apply([&](const auto&... part) { return (part.owns(p) || ...); }, self().capability_parts());
  }

  void release_cached()
    requires capability_of_all<capability::cache_releasing, Parts...>
  {
    changing([&](auto& part) { part.release_cached(); });
  }
  std::size_t release_cached(std::size_t bytes)
    requires capability_of_all<capability::partly_cache_releasing, Parts...>
  {
    std::size_t released = 0;
    changing([&](auto& part) {
      if (released < bytes) released += part.release_cached(bytes - released);
    });
    return released;
  }
  std::size_t release_completed(std::size_t bytes)
    requires capability_of_all<capability::completion_releasing, Parts...>
  {
    std::size_t released = 0;
    changing([&](auto& part) {
      if (released < bytes) released += part.release_completed(bytes - released);
    });
    return released;
  }

  void record_stream(void* p, stream_ref stream)
    requires capability_of_all<capability::stream_recording, Parts...> && routable
  {
    auto guard = self().capability_guard();
    route(p, [&](auto& part) { part.record_stream(p, stream); });
  }

  void offload(void* p, stream_ref stream)
    requires capability_of_all<capability::offloading, Parts...>
  {
    moving(p, [&](auto& part) { part.offload(p, stream); });
  }
  void prefetch(void* p, stream_ref stream)
    requires capability_of_all<capability::offloading, Parts...>
  {
    moving(p, [&](auto& part) { part.prefetch(p, stream); });
  }
  residence residence_of(const void* p) const
    requires capability_of_all<capability::offloading, Parts...>
  {
    auto guard = self().capability_guard();
    return route(p, [&](const auto& part) { return part.residence_of(p); });
  }

  void offload(void* p, stream_ref stream, move_completion when)
    requires capability_of_all<capability::deferring_offloading, Parts...>
  {
    moving(p, [&](auto& part) { part.offload(p, stream, when); });
  }
  void prefetch(void* p, stream_ref stream, move_completion when)
    requires capability_of_all<capability::deferring_offloading, Parts...>
  {
    moving(p, [&](auto& part) { part.prefetch(p, stream, when); });
  }
  void offload(void* p, stream_ref stream, move_completion when, stream_ref copies)
    requires capability_of_all<capability::deferring_offloading, Parts...>
  {
    moving(p, [&](auto& part) { part.offload(p, stream, when, copies); });
  }
  void prefetch(void* p, stream_ref stream, move_completion when, stream_ref copies)
    requires capability_of_all<capability::deferring_offloading, Parts...>
  {
    moving(p, [&](auto& part) { part.prefetch(p, stream, when, copies); });
  }
  void complete_move(const void* p)
    requires capability_of_all<capability::deferring_offloading, Parts...>
  {
    moving(p, [&](auto& part) { part.complete_move(p); });
  }
  std::size_t complete_moves(bool wait = false)
    requires capability_of_all<capability::deferring_offloading, Parts...>
  {
    std::size_t completed = 0;
    changing([&](auto& part) { completed += part.complete_moves(wait); });
    return completed;
  }

  void keep_far_copy(const void* p, bool keep)
    requires capability_of_all<capability::far_copy_keeping, Parts...>
  {
    auto guard = self().capability_guard();
    route(p, [&](auto& part) { part.keep_far_copy(p, keep); });
  }
  std::size_t far_copy_bytes() const
    requires capability_of_all<capability::far_copy_keeping, Parts...>
  {
    auto guard = self().capability_guard();
    return std::apply([](const auto&... part) { return (std::size_t{0} + ... + part.far_copy_bytes()); },
                      self().capability_parts());
  }

  statistics reset_peaks()
    requires single && capability_of_all<capability::peak_resetting, Parts...>
  {
    auto guard = self().capability_guard();
    return std::get<0>(self().capability_parts()).reset_peaks();
  }
  void set_memory_limit(std::size_t bytes)
    requires single && capability_of_all<capability::memory_limiting, Parts...>
  {
    changing([&](auto& part) { part.set_memory_limit(bytes); });
  }
  std::size_t memory_limit() const
    requires single && capability_of_all<capability::memory_limiting, Parts...>
  {
    auto guard = self().capability_guard();
    return std::get<0>(self().capability_parts()).memory_limit();
  }

  template <class V>
  void visit_state(V& visitor) const
    requires capability_of_all<capability::snapshotting, Parts...>
  {
    auto guard = self().capability_guard();
    std::apply([&](const auto&... part) { (part.visit_state(visitor), ...); }, self().capability_parts());
  }
  void set_memory_observer(memory_observer observer, void* context)
    requires capability_of_all<capability::observable, Parts...>
  {
    auto guard = self().capability_guard();
    std::apply([&](auto&... part) { (part.set_memory_observer(observer, context), ...); }, self().capability_parts());
  }
  void retain_memory(bool retain)
    requires capability_of_all<capability::memory_retaining, Parts...>
  {
    changing([&](auto& part) { part.retain_memory(retain); });
  }

 protected:
  forward_capabilities() = default;

 private:
  Derived& self() noexcept { return static_cast<Derived&>(*this); }
  const Derived& self() const noexcept { return static_cast<const Derived&>(*this); }

  // f on each part in order under the guard, then Derived reads its parts again.
  template <class F>
  void changing(F&& f) {
    auto guard = self().capability_guard();
    std::apply([&](auto&... part) { (f(part), ...); }, self().capability_parts());
    self().capabilities_changed();
  }
  // f on the part that owns p under the guard, then Derived reads its parts again.
  template <class F>
  void moving(const void* p, F&& f) {
    auto guard = self().capability_guard();
    route(p, f);
    self().capabilities_changed();
  }
  // f(the part that owns p); the last part when none does (it reports p as not its own).
  template <class F>
  decltype(auto) route(const void* p, F&& f) {
    return route_in(self().capability_parts(), p, f);
  }
  template <class F>
  decltype(auto) route(const void* p, F&& f) const {
    return route_in(self().capability_parts(), p, f);
  }
  template <std::size_t I = 0, class Tuple, class F>
  static decltype(auto) route_in(Tuple&& parts, const void* p, F& f) {
    if constexpr (I + 1 == std::tuple_size_v<std::remove_cvref_t<Tuple>>) {
      return f(std::get<I>(parts));
    } else {
      if (std::get<I>(parts).owns(p)) return f(std::get<I>(parts));
      return route_in<I + 1>(std::forward<Tuple>(parts), p, f);
    }
  }
};

}  // namespace glake
