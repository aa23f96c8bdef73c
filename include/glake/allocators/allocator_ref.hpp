// A non-owning, type-erased reference to any glake allocator, for code that should not be a
// template over the allocator (a scheduler, a plug-in, a tool's driver loop).
#pragma once

#include <concepts>
#include <cstddef>
#include <optional>
#include <string>
#include <type_traits>

#include "glake/allocators/capabilities.hpp"
#include "glake/allocators/concepts.hpp"
#include "glake/errors.hpp"
#include "glake/memory_state.hpp"
#include "glake/movers/concepts.hpp"
#include "glake/statistics.hpp"
#include "glake/stream.hpp"

namespace glake {

template <class P>
concept erased_capability =
    capability_tag<P> && (std::same_as<P, capability::owning> || std::same_as<P, capability::cache_releasing> ||
                          std::same_as<P, capability::peak_resetting> || std::same_as<P, capability::stream_recording> ||
                          std::same_as<P, capability::offloading> || std::same_as<P, capability::memory_limiting>);

namespace detail {
// One table per allocator type: the required operations, the capability set, and one entry per
// erased optional operation, null where the type lacks it.
struct allocator_table {
  void* (*allocate)(void*, std::size_t, stream_ref);
  void* (*try_allocate)(void*, std::size_t, stream_ref);
  void (*deallocate)(void*, void*, std::size_t, stream_ref);
  statistics (*stats)(const void*);
  std::size_t (*reserved_bytes)(const void*);
  std::size_t (*alignment)(const void*) noexcept;
  void (*verify)(const void*);
  capability_set capabilities;
  bool (*owns)(const void*, const void*);
  void (*release_cached)(void*);
  statistics (*reset_peaks)(void*);
  void (*record_stream)(void*, void*, stream_ref);
  void (*offload)(void*, void*, stream_ref);
  void (*prefetch)(void*, void*, stream_ref);
  residence (*residence_of)(const void*, const void*);
  void (*set_memory_limit)(void*, std::size_t);
  std::size_t (*memory_limit)(const void*);
};

template <class A>
A& self(void* a) noexcept {
  return *static_cast<A*>(a);
}
template <class A>
const A& self(const void* a) noexcept {
  return *static_cast<const A*>(a);
}

template <allocator A>
inline constexpr allocator_table allocator_table_of = {
    [](void* a, std::size_t n, stream_ref s) { return self<A>(a).allocate(n, s); },
    [](void* a, std::size_t n, stream_ref s) { return self<A>(a).try_allocate(n, s); },
    [](void* a, void* p, std::size_t n, stream_ref s) { self<A>(a).deallocate(p, n, s); },
    [](const void* a) { return self<A>(a).stats(); },
    [](const void* a) { return self<A>(a).reserved_bytes(); },
    [](const void* a) noexcept { return self<A>(a).alignment(); },
    [](const void* a) { self<A>(a).verify(); },
    capabilities_of_v<A>,
    [] {
      if constexpr (owning_allocator<A>) return +[](const void* a, const void* p) { return self<A>(a).owns(p); };
      else return static_cast<bool (*)(const void*, const void*)>(nullptr);
    }(),
    [] {
      if constexpr (cache_releasing_allocator<A>) return +[](void* a) { self<A>(a).release_cached(); };
      else return static_cast<void (*)(void*)>(nullptr);
    }(),
    [] {
      if constexpr (peak_resetting_allocator<A>) return +[](void* a) { return self<A>(a).reset_peaks(); };
      else return static_cast<statistics (*)(void*)>(nullptr);
    }(),
    [] {
      if constexpr (stream_recording_allocator<A>) {
        return +[](void* a, void* p, stream_ref s) { self<A>(a).record_stream(p, s); };
      } else {
        return static_cast<void (*)(void*, void*, stream_ref)>(nullptr);
      }
    }(),
    [] {
      if constexpr (offloading_allocator<A>) return +[](void* a, void* p, stream_ref s) { self<A>(a).offload(p, s); };
      else return static_cast<void (*)(void*, void*, stream_ref)>(nullptr);
    }(),
    [] {
      if constexpr (offloading_allocator<A>) return +[](void* a, void* p, stream_ref s) { self<A>(a).prefetch(p, s); };
      else return static_cast<void (*)(void*, void*, stream_ref)>(nullptr);
    }(),
    [] {
      if constexpr (offloading_allocator<A>) {
        return +[](const void* a, const void* p) { return self<A>(a).residence_of(p); };
      } else {
        return static_cast<residence (*)(const void*, const void*)>(nullptr);
      }
    }(),
    [] {
      if constexpr (memory_limiting_allocator<A>) {
        return +[](void* a, std::size_t n) { self<A>(a).set_memory_limit(n); };
      } else {
        return static_cast<void (*)(void*, std::size_t)>(nullptr);
      }
    }(),
    [] {
      if constexpr (memory_limiting_allocator<A>) return +[](const void* a) { return self<A>(a).memory_limit(); };
      else return static_cast<std::size_t (*)(const void*)>(nullptr);
    }(),
};
}  // namespace detail

template <erased_capability... Caps>
class allocator_ref;

template <class T>
inline constexpr bool is_allocator_ref_v = false;
template <erased_capability... Caps>
inline constexpr bool is_allocator_ref_v<allocator_ref<Caps...>> = true;

/// allocator_ref<Caps...>: a pointer to an allocator and its type's static table of operations
/// (one indirect call per operation, no allocation, copyable; the allocator must outlive it).
/// It is itself an `allocator`, and each refinement named in Caps, which the referenced
/// allocator must have (CCCL's resource_ref<Properties...> works the same way): those
/// operations are members, so templates that test `if constexpr (owning_allocator<R>)` see
/// exactly what the reference guarantees. What else the allocator has is read at run time:
/// `capabilities()` (a capability_set) and `with<More...>()`, an allocator_ref that also
/// guarantees More, or empty when the allocator lacks one of them.
///
/// Erased optional operations (erased_capability): owns; release_cached(); reset_peaks;
/// record_stream; offload, prefetch and residence_of (the two-argument forms); set_memory_limit
/// and memory_limit. capabilities() reports every capability, erased or not.
///
/// | expression             | returns                          | meaning
/// |------------------------|----------------------------------|-----------------------------------
/// | allocator_ref<C...>(a) | allocator_ref                    | refers to a; needs each C of a
/// | r.allocate(n, s) ...   | as the allocator concept         | a's, through the table
/// | r.capabilities()       | capability_set                   | capabilities_of_v<A> of a's type
/// | r.has(P{})             | bool                             | r.capabilities().contains(P{})
/// | r.with<M...>()         | optional<allocator_ref<C..., M...>> | r, guaranteeing M too; empty
/// |                        |                                  | when a lacks one (checked, never UB)
/// | allocator_ref<C...>(r2)| allocator_ref                    | from one guaranteeing more
///
/// Thread safety, streams and errors: the referenced allocator's.
template <erased_capability... Caps>
class allocator_ref {
  template <class P>
  static constexpr bool guarantees = (std::same_as<P, Caps> || ...);

 public:
  template <allocator A>
    requires(!std::is_const_v<A> && !is_allocator_ref_v<A> && (has_capability<A, Caps> && ...))
  allocator_ref(A& a) noexcept : object_(&a), table_(&detail::allocator_table_of<A>) {}

  /// From a reference that guarantees at least Caps.
  template <erased_capability... Other>
    requires((!std::same_as<allocator_ref<Other...>, allocator_ref>) &&
             (allocator_ref<Other...>::template guarantees<Caps> && ...))
  allocator_ref(const allocator_ref<Other...>& other) noexcept : object_(other.object_), table_(other.table_) {}

  void* allocate(std::size_t bytes, stream_ref stream = default_stream) {
    return table_->allocate(object_, bytes, stream);
  }
  void* try_allocate(std::size_t bytes, stream_ref stream = default_stream) {
    return table_->try_allocate(object_, bytes, stream);
  }
  void deallocate(void* p, std::size_t bytes, stream_ref stream = default_stream) {
    table_->deallocate(object_, p, bytes, stream);
  }
  statistics stats() const { return table_->stats(object_); }
  std::size_t reserved_bytes() const { return table_->reserved_bytes(object_); }
  std::size_t alignment() const noexcept { return table_->alignment(object_); }
  void verify() const { table_->verify(object_); }

  capability_set capabilities() const noexcept { return table_->capabilities; }
  template <capability_tag P>
  bool has(P = {}) const noexcept {
    return capabilities().contains(P{});
  }
  /// This reference, guaranteeing More as well; empty when the allocator lacks one of them.
  template <erased_capability... More>
  std::optional<allocator_ref<Caps..., More...>> with() const noexcept {
    if (!(has<More>() && ...)) return std::nullopt;
    return allocator_ref<Caps..., More...>(object_, table_);
  }

  bool owns(const void* p) const
    requires guarantees<capability::owning>
  {
    return table_->owns(object_, p);
  }
  void release_cached()
    requires guarantees<capability::cache_releasing>
  {
    table_->release_cached(object_);
  }
  statistics reset_peaks()
    requires guarantees<capability::peak_resetting>
  {
    return table_->reset_peaks(object_);
  }
  void record_stream(void* p, stream_ref stream)
    requires guarantees<capability::stream_recording>
  {
    table_->record_stream(object_, p, stream);
  }
  void offload(void* p, stream_ref stream = default_stream)
    requires guarantees<capability::offloading>
  {
    table_->offload(object_, p, stream);
  }
  void prefetch(void* p, stream_ref stream = default_stream)
    requires guarantees<capability::offloading>
  {
    table_->prefetch(object_, p, stream);
  }
  residence residence_of(const void* p) const
    requires guarantees<capability::offloading>
  {
    return table_->residence_of(object_, p);
  }
  void set_memory_limit(std::size_t bytes)
    requires guarantees<capability::memory_limiting>
  {
    table_->set_memory_limit(object_, bytes);
  }
  std::size_t memory_limit() const
    requires guarantees<capability::memory_limiting>
  {
    return table_->memory_limit(object_);
  }

  /// Two references are equal when they refer to the same allocator.
  template <erased_capability... Other>
  bool operator==(const allocator_ref<Other...>& other) const noexcept {
    return object_ == other.object_;
  }

 private:
  template <erased_capability...>
  friend class allocator_ref;
  allocator_ref(void* object, const detail::allocator_table* table) noexcept : object_(object), table_(table) {}

  void* object_;
  const detail::allocator_table* table_;
};

static_assert(allocator<allocator_ref<>>);
static_assert(capabilities_of_v<allocator_ref<>> == capability_set{});
static_assert(std::is_trivially_copyable_v<allocator_ref<>>);
static_assert(owning_allocator<allocator_ref<capability::owning>>);
static_assert(!cache_releasing_allocator<allocator_ref<capability::owning>>);
static_assert(offloading_allocator<allocator_ref<capability::owning, capability::offloading>>);
static_assert(!offloading_allocator<allocator_ref<capability::offloading>>);  // offloading refines owning
static_assert(memory_limiting_allocator<allocator_ref<capability::memory_limiting>>);
static_assert(capabilities_of_v<allocator_ref<capability::owning, capability::cache_releasing,
                                              capability::peak_resetting, capability::stream_recording>> ==
              capabilities_of_v<detail::full_allocator_archetype>);
static_assert(std::constructible_from<allocator_ref<>, detail::full_allocator_archetype&>);
static_assert(std::constructible_from<allocator_ref<capability::owning>, detail::full_allocator_archetype&>);
static_assert(!std::constructible_from<allocator_ref<capability::owning>, detail::allocator_archetype&>);
static_assert(std::constructible_from<allocator_ref<>, const allocator_ref<capability::owning>&>);
static_assert(!std::constructible_from<allocator_ref<capability::owning>, const allocator_ref<>&>);

}  // namespace glake
