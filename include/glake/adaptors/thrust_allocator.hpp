// A thrust allocator and execution policies over any glake allocator, so that thrust's containers
// and the temporary storage of its algorithms take their device memory from glake, on one stream.
//
// This header includes thrust, so it compiles only where thrust does: in .cu files built by nvcc
// with -std=c++20 (thrust's CUDA device system, the default). A host compiler can include it only
// with another device system (THRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP, as
// tests/thrust_allocator_test.cpp does); then the CUDA policies (thrust_policy,
// thrust_policy_nosync) are absent. For that reason glake/glake.hpp does not include it.
#pragma once

#include <cstddef>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>

#include <thrust/device_malloc_allocator.h>
#include <thrust/device_ptr.h>
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
#include <cuda_runtime_api.h>
#include <thrust/system/cuda/execution_policy.h>
#endif

#include "glake/allocators/concepts.hpp"
#include "glake/detail/archetypes.hpp"
#include "glake/errors.hpp"
#include "glake/stream.hpp"

namespace glake {

/// What thrust_allocator needs of an allocator: any glake allocator (it uses allocate,
/// deallocate and alignment, and no optional capability).
template <class A>
concept thrust_adaptable = allocator<A>;

/// A thrust allocator of T (what `thrust::device_vector<T, Alloc>` and thrust's temporary
/// buffers ask for) that takes every byte from a glake allocator the caller owns, through a
/// non-owning pointer, on one stream fixed at construction: `allocate(n)` is
/// `allocator.allocate(n * sizeof(T), stream)`, `deallocate(p, n)` the matching free on the same
/// stream. It derives from `thrust::device_malloc_allocator<T>`, as thrust's own device
/// allocators and RMM's `thrust_allocator` do, so thrust treats its pointers as device memory.
///
/// Sizes: zero elements get a distinct one-byte allocation (cub reads a null temporary buffer as
/// "only tell me the size"); more than max_size() elements is a usage_error (the byte count would
/// overflow); alignof(T) above the allocator's alignment() is a usage_error rather than served
/// misaligned. Out of memory is glake's out_of_memory, a std::bad_alloc, thrown as is.
/// deallocate is noexcept, as thrust's containers require: misuse that a checked build catches
/// there (a foreign pointer, a size mismatch) ends the program through std::terminate with the
/// usage_error's message.
///
/// Copies and rebinds share the allocator and the stream. Two thrust_allocators are equal when
/// they name the same allocator object and the same stream: either frees what the other
/// allocated, on the same stream. They propagate on move assignment and swap: thrust's
/// device_vector move assignment takes the other vector's memory without comparing allocators, so
/// the allocator that frees that memory must travel with it; copy assignment keeps the target's.
///
/// Complexity: one call of the allocator per allocate or deallocate. Thread safety: the
/// allocator's (its Lock policy); the adaptor itself is a pointer and a stream, copied by value.
/// Streams: memory is allocated and freed on the adaptor's stream, which is what glake orders it
/// by: a block freed on that stream may be handed out again at once for work queued on it later.
/// thrust's algorithms run with thrust_policy(allocator, stream) keep to that stream. device_vector
/// does not: it runs its own kernels (construct, fill, copy on growth) through thrust's default
/// policy on the default stream, synchronizing after each. So give a device_vector's allocator the
/// default stream or a blocking stream (one created without cudaStreamNonBlocking, which the
/// default stream waits for); with a non-blocking stream, synchronize it before a device_vector
/// operation that allocates while work queued on it (a thrust_policy_nosync algorithm, say) may
/// still run. Memory also used on another stream must be recorded there (`record_stream`, on
/// allocators that have it) before it is freed.
template <class T, thrust_adaptable Allocator>
class thrust_allocator : public thrust::device_malloc_allocator<T> {
  using base = thrust::device_malloc_allocator<T>;

 public:
  using value_type = T;
  using pointer = typename base::pointer;
  using const_pointer = typename base::const_pointer;
  using size_type = typename base::size_type;
  using difference_type = typename base::difference_type;
  using propagate_on_container_copy_assignment = std::false_type;
  using propagate_on_container_move_assignment = std::true_type;
  using propagate_on_container_swap = std::true_type;
  using is_always_equal = std::false_type;

  /// Replaces device_malloc_allocator's rebind, which would lose the allocator.
  template <class U>
  struct rebind {
    using other = thrust_allocator<U, Allocator>;
  };

  explicit thrust_allocator(Allocator& allocator, stream_ref stream = default_stream) noexcept
      : allocator_(&allocator), stream_(stream) {}
  thrust_allocator(const thrust_allocator&) noexcept = default;
  thrust_allocator& operator=(const thrust_allocator&) noexcept = default;
  /// Implicit, as the allocator requirements ask of rebinds.
  template <class U>
  thrust_allocator(const thrust_allocator<U, Allocator>& other) noexcept
      : allocator_(&other.allocator()), stream_(other.stream()) {}

  /// Storage for n objects of T on the stream; see the class comment for zero, overflow and
  /// alignment.
  pointer allocate(size_type n) {
    if (n > max_size()) {
      throw usage_error(usage_error::kind::bad_argument,
                        "glake::thrust_allocator: " + std::to_string(n) + " elements of " +
                            std::to_string(sizeof(T)) + " bytes overflow std::size_t (max_size " +
                            std::to_string(max_size()) + ")");
    }
    if (alignof(T) > allocator_->alignment()) {
      throw usage_error(usage_error::kind::unsupported,
                        "glake::thrust_allocator: alignof(T) " + std::to_string(alignof(T)) +
                            " exceeds the allocator's guaranteed " + std::to_string(allocator_->alignment()));
    }
    return pointer(static_cast<T*>(allocator_->allocate(bytes_of(n), stream_)));
  }

  /// Gives back what allocate(n) returned, on the same stream. Null is ignored.
  void deallocate(pointer p, size_type n) noexcept {
    if (T* raw = thrust::raw_pointer_cast(p); raw != nullptr) allocator_->deallocate(raw, bytes_of(n), stream_);
  }

  size_type max_size() const noexcept { return std::numeric_limits<size_type>::max() / sizeof(T); }

  Allocator& allocator() const noexcept { return *allocator_; }
  stream_ref stream() const noexcept { return stream_; }

  template <class U>
  friend bool operator==(const thrust_allocator& a, const thrust_allocator<U, Allocator>& b) noexcept {
    return &a.allocator() == &b.allocator() && a.stream() == b.stream();
  }
  // Spelled out: device_malloc_allocator's own != (always false) must not be the one found.
  template <class U>
  friend bool operator!=(const thrust_allocator& a, const thrust_allocator<U, Allocator>& b) noexcept {
    return !(a == b);
  }

 private:
  static constexpr std::size_t bytes_of(size_type n) noexcept { return n == 0 ? 1 : n * sizeof(T); }

  Allocator* allocator_;
  stream_ref stream_;
};

static_assert(thrust_adaptable<detail::allocator_archetype>);
// What thrust and std::allocator_traits read off the type: device pointers, a rebind that keeps
// the allocator, conversions across T, and no default construction (there is no default allocator).
namespace detail {
using thrust_allocator_of_int = thrust_allocator<int, allocator_archetype>;
static_assert(std::is_base_of_v<thrust::device_malloc_allocator<int>, thrust_allocator_of_int>);
static_assert(std::is_same_v<std::allocator_traits<thrust_allocator_of_int>::pointer, thrust::device_ptr<int>>);
static_assert(std::is_same_v<std::allocator_traits<thrust_allocator_of_int>::rebind_alloc<char>,
                             thrust_allocator<char, allocator_archetype>>);
static_assert(std::is_nothrow_convertible_v<thrust_allocator<char, allocator_archetype>, thrust_allocator_of_int>);
static_assert(!std::is_default_constructible_v<thrust_allocator_of_int>);
static_assert(std::allocator_traits<thrust_allocator_of_int>::propagate_on_container_move_assignment::value);
}  // namespace detail

#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA

/// `thrust::cuda::par.on(stream)` whose temporary storage (sort's, reduce's, scan's buffers) comes
/// from `allocator` on `stream`, through a thrust_allocator<char, Allocator> (char: thrust asks for
/// temporary storage in bytes). Built on `par`, not `par_nosync`, so that it is a drop-in for the
/// policy a caller would otherwise write: algorithms synchronize the stream before they return, as
/// thrust's default does, and their results may be read at once. The allocator must outlive every
/// algorithm run with the policy.
template <thrust_adaptable Allocator>
auto thrust_policy(Allocator& allocator, cudaStream_t stream) {
  return thrust::cuda::par(thrust_allocator<char, Allocator>(allocator, stream_ref{stream})).on(stream);
}

/// As thrust_policy, built on `par_nosync`: algorithms skip the stream synchronizations that
/// correctness does not need and may return before their kernels finish, so the caller
/// synchronizes before reading results on the host. Safe for the temporary storage: it is freed
/// on `stream` while those kernels may still run, and a glake allocator reuses such memory on
/// `stream` only for work queued after them, and on other streams only once they have completed
/// (but see thrust_allocator's stream rules for a device_vector allocating on `stream` meanwhile).
template <thrust_adaptable Allocator>
auto thrust_policy_nosync(Allocator& allocator, cudaStream_t stream) {
  return thrust::cuda::par_nosync(thrust_allocator<char, Allocator>(allocator, stream_ref{stream})).on(stream);
}

#endif

}  // namespace glake
