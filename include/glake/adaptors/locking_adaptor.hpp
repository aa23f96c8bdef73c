// An allocator shared between threads: one lock around every call of an allocator built without
// one, with each of its optional capabilities forwarded.
#pragma once

#include <concepts>
#include <cstddef>
#include <mutex>
#include <tuple>
#include <utility>

#include "glake/allocators/capabilities.hpp"
#include "glake/allocators/concepts.hpp"
#include "glake/detail/archetypes.hpp"
#include "glake/policies/locking.hpp"
#include "glake/statistics.hpp"
#include "glake/stream.hpp"

namespace glake {

/// locking_adaptor<A, Lock> holds an A (built in place from the constructor's arguments) and
/// takes Lock around each of its calls (RMM's thread_safe_resource_adaptor), so an allocator
/// written for one thread (no lock policy of its own, or one given no_lock) can serve several.
/// It has exactly A's capabilities: forward_capabilities (capabilities.hpp) forwards each one A
/// has under the same lock, so none is restated here and none is dropped.
///
/// Complexity: A's, plus one lock and unlock per call. Thread safety: every member may be called
/// from any thread with a Lock such as mutex_lock; `upstream()` is not locked. Streams and
/// errors: A's. alignment() is not locked (it is constant for every model).
template <allocator A, lock_policy Lock = mutex_lock>
class locking_adaptor : public forward_capabilities<locking_adaptor<A, Lock>, A> {
  friend class forward_capabilities<locking_adaptor, A>;

 public:
  using upstream_type = A;
  template <class... Args>
    requires std::constructible_from<A, Args...>
  explicit locking_adaptor(std::in_place_t, Args&&... args) : upstream_(std::forward<Args>(args)...) {}
  locking_adaptor(const locking_adaptor&) = delete;
  locking_adaptor& operator=(const locking_adaptor&) = delete;

  void* allocate(std::size_t bytes, stream_ref stream = default_stream) {
    std::lock_guard guard(lock_);
    return upstream_.allocate(bytes, stream);
  }
  void* try_allocate(std::size_t bytes, stream_ref stream = default_stream) {
    std::lock_guard guard(lock_);
    return upstream_.try_allocate(bytes, stream);
  }
  void deallocate(void* p, std::size_t bytes, stream_ref stream = default_stream) {
    std::lock_guard guard(lock_);
    upstream_.deallocate(p, bytes, stream);
  }
  statistics stats() const {
    std::lock_guard guard(lock_);
    return upstream_.stats();
  }
  std::size_t reserved_bytes() const {
    std::lock_guard guard(lock_);
    return upstream_.reserved_bytes();
  }
  std::size_t alignment() const noexcept { return upstream_.alignment(); }
  void verify() const {
    std::lock_guard guard(lock_);
    upstream_.verify();
  }

  /// The allocator itself, unlocked: for setup before other threads see the adaptor.
  A& upstream() noexcept { return upstream_; }
  const A& upstream() const noexcept { return upstream_; }

 private:
  std::tuple<A&> capability_parts() noexcept { return {upstream_}; }
  std::tuple<const A&> capability_parts() const noexcept { return {upstream_}; }
  std::lock_guard<Lock> capability_guard() const { return std::lock_guard<Lock>(lock_); }
  void capabilities_changed() noexcept {}

  A upstream_;
  [[no_unique_address]] mutable Lock lock_;
};

// Exactly the capabilities of the allocator adapted.
static_assert(allocator<locking_adaptor<detail::allocator_archetype>>);
static_assert(capabilities_of_v<locking_adaptor<detail::allocator_archetype>> == capability_set{});
static_assert(capabilities_of_v<locking_adaptor<detail::full_allocator_archetype>> ==
              capabilities_of_v<detail::full_allocator_archetype>);

}  // namespace glake
