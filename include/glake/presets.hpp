// Named compositions of allocators, backends and policies: the ones people use, so that choosing
// the lock does not mean restating every policy before it.
#pragma once

#include "glake/allocators/caching_allocator.hpp"
#include "glake/allocators/concepts.hpp"
#include "glake/allocators/segment_source.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/host.hpp"
#include "glake/backends/sim.hpp"
#include "glake/policies/eviction.hpp"
#include "glake/policies/locking.hpp"
#include "glake/policies/stitching.hpp"

namespace glake {

// ---------------------------------------------------------------------------------------------
// Presets
//
// | preset                                   | is                                                   |
// |------------------------------------------|------------------------------------------------------|
// | default_stitching_allocator<P, R, Lock>  | stitching_allocator<P, R> with its default policies  |
// |                                          | (best-fit-tail stitching, LRU eviction, GMLake's     |
// |                                          | admission, power-of-two growth) and the lock Lock    |
// | pytorch_caching_allocator<P, R, Lock>    | caching_allocator over one handle per segment        |
// |                                          | (vmm_segment_source): PyTorch's caching allocator    |
// | host_stitching_allocator<Lock>           | default_stitching_allocator over host_provider/      |
// |                                          | host_reserver (Linux memfd + mmap)                   |
// | shared_host_stitching_allocator          | the same with mutex_lock: usable from any thread     |
// | host_caching_allocator<Lock>             | pytorch_caching_allocator over the host backend      |
// | sim_stitching_allocator<Lock>            | default_stitching_allocator over a sim_device        |
// | shared_sim_stitching_allocator           | the same with mutex_lock                             |
// | sim_caching_allocator<Lock>              | pytorch_caching_allocator over a sim_device          |
//
// The GPU presets (gpu_stitching_allocator, shared_gpu_stitching_allocator, gpu_caching_allocator)
// are in glake/cuda_presets.hpp, which needs the CUDA driver's headers.
// Lock is no_lock by default: one thread at a time. with_lock_t<A, Lock> is A with another lock
// and every other policy kept, for compositions that are not presets.
// ---------------------------------------------------------------------------------------------

/// The stitching allocator with its default policies; only the lock is chosen.
template <physical_provider Provider, address_reserver_for<Provider> Reserver, lock_policy Lock = no_lock>
using default_stitching_allocator = stitching_allocator<Provider, Reserver, best_fit_tail_stitching, lru_eviction, Lock>;

/// PyTorch's caching allocator: best fit with splitting over segments of one handle each.
template <physical_provider Provider, address_reserver_for<Provider> Reserver, lock_policy Lock = no_lock>
using pytorch_caching_allocator = caching_allocator<vmm_segment_source<Provider, Reserver>, Lock, lru_eviction>;

template <lock_policy Lock = no_lock>
using host_stitching_allocator = default_stitching_allocator<host_provider, host_reserver, Lock>;
using shared_host_stitching_allocator = host_stitching_allocator<mutex_lock>;
template <lock_policy Lock = no_lock>
using host_caching_allocator = pytorch_caching_allocator<host_provider, host_reserver, Lock>;

template <lock_policy Lock = no_lock>
using sim_stitching_allocator = default_stitching_allocator<sim_provider, sim_reserver, Lock>;
using shared_sim_stitching_allocator = sim_stitching_allocator<mutex_lock>;
template <lock_policy Lock = no_lock>
using sim_caching_allocator = pytorch_caching_allocator<sim_provider, sim_reserver, Lock>;

/// with_lock<A, Lock>::type: the allocator A with its lock policy replaced by Lock, every other
/// template argument kept. Defined for stitching_allocator and caching_allocator; lock_of_t<A>
/// names A's lock.
template <class Allocator, lock_policy Lock>
struct with_lock;

template <class P, class R, class Stitch, class Evict, class OldLock, class Admission, class Growth, lock_policy Lock>
struct with_lock<stitching_allocator<P, R, Stitch, Evict, OldLock, Admission, Growth>, Lock> {
  using type = stitching_allocator<P, R, Stitch, Evict, Lock, Admission, Growth>;
  using old_lock = OldLock;
};

template <class Source, class OldLock, class Evict, lock_policy Lock>
struct with_lock<caching_allocator<Source, OldLock, Evict>, Lock> {
  using type = caching_allocator<Source, Lock, Evict>;
  using old_lock = OldLock;
};

template <class Allocator, lock_policy Lock>
using with_lock_t = typename with_lock<Allocator, Lock>::type;

template <class Allocator>
using lock_of_t = typename with_lock<Allocator, no_lock>::old_lock;

// With GLAKE_PRESETS_EXTERN defined (the CMake target glake::presets defines it and links
// src/presets.cpp), the members every user calls (constructor, destructor, allocate,
// try_allocate, deallocate, stats) of the host and simulated presets are instantiated once in
// that library, and translation units that use them skip generating that code. Whole classes
// cannot be instantiated explicitly: some members exist only for backends with events. Without
// the macro the header stands alone.
#define GLAKE_PRESET_STITCHING_MEMBERS(prefix, ...)                                      \
  prefix __VA_ARGS__::stitching_allocator(__VA_ARGS__::provider_type, __VA_ARGS__::reserver_type, config); \
  prefix __VA_ARGS__::~stitching_allocator();                                           \
  prefix void* __VA_ARGS__::allocate(std::size_t, stream_ref);                          \
  prefix void* __VA_ARGS__::try_allocate(std::size_t, stream_ref);                      \
  prefix void __VA_ARGS__::deallocate(void*, std::size_t, stream_ref);                  \
  prefix statistics __VA_ARGS__::stats() const;
#define GLAKE_PRESET_CACHING_MEMBERS(prefix, ...)                                        \
  prefix __VA_ARGS__::caching_allocator(__VA_ARGS__::source_type, caching_rules);       \
  prefix __VA_ARGS__::~caching_allocator();                                             \
  prefix void* __VA_ARGS__::allocate(std::size_t, stream_ref);                          \
  prefix void* __VA_ARGS__::try_allocate(std::size_t, stream_ref);                      \
  prefix void __VA_ARGS__::deallocate(void*, std::size_t, stream_ref);                  \
  prefix statistics __VA_ARGS__::stats() const;
#define GLAKE_PRESETS_INSTANTIATE(prefix)                                                \
  GLAKE_PRESET_STITCHING_MEMBERS(prefix, host_stitching_allocator<no_lock>)             \
  GLAKE_PRESET_STITCHING_MEMBERS(prefix, host_stitching_allocator<mutex_lock>)          \
  GLAKE_PRESET_STITCHING_MEMBERS(prefix, sim_stitching_allocator<no_lock>)              \
  GLAKE_PRESET_STITCHING_MEMBERS(prefix, sim_stitching_allocator<mutex_lock>)           \
  GLAKE_PRESET_CACHING_MEMBERS(prefix, host_caching_allocator<no_lock>)                 \
  GLAKE_PRESET_CACHING_MEMBERS(prefix, host_caching_allocator<mutex_lock>)              \
  GLAKE_PRESET_CACHING_MEMBERS(prefix, sim_caching_allocator<no_lock>)                  \
  GLAKE_PRESET_CACHING_MEMBERS(prefix, sim_caching_allocator<mutex_lock>)
#if defined(GLAKE_PRESETS_EXTERN)
GLAKE_PRESETS_INSTANTIATE(extern template)
#endif

// The preset types themselves are checked against the concepts in tests/presets_test.cpp: doing it
// here would instantiate every preset class in every file that includes this header.
static_assert(std::is_same_v<lock_of_t<shared_host_stitching_allocator>, mutex_lock>);
static_assert(std::is_same_v<lock_of_t<shared_sim_stitching_allocator>, mutex_lock>);
static_assert(std::is_same_v<with_lock_t<host_stitching_allocator<>, mutex_lock>, shared_host_stitching_allocator>);

}  // namespace glake
