// glake allocators as CCCL `cuda::mr` memory resources, for code that takes a resource (RMM, CCCL
// containers, anything written against cuda::mr) instead of a glake allocator.
//
// CCCL has two generations of these concepts, and this header models whichever it is compiled
// with:
//
// | CCCL           | synchronous                          | stream-ordered
// |----------------|--------------------------------------|-----------------------------------------
// | 3.0 (CUDA 13.0)| resource: allocate(n, align),        | async_resource: allocate_async(n, align,
// |                | deallocate(p, n, align)              | s), deallocate_async(p, n, align, s)
// | >= 3.1 (RMM    | synchronous_resource: allocate_sync, | resource: allocate(s, n, align),
// | 26.x)          | deallocate_sync                      | deallocate(s, p, n, align)
//
// CCCL 3.0 hides cuda::mr behind LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE; including this
// header opts in, so it defines the macro when it is not defined. That works only if no CCCL
// header came before this one: otherwise define the macro yourself first (the static_asserts
// below then say so at compile time). Needs the CUDA toolkit's include directory (CCCL and
// cuda_runtime_api.h); the runtime library only for device allocators' `_sync` members.
#pragma once

#ifndef LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
#define LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
#endif

#include <cuda_runtime_api.h>

#include <cuda/memory_resource>
#include <cuda/stream_ref>
#include <cuda/version>

#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "glake/allocators/concepts.hpp"
#include "glake/errors.hpp"
#include "glake/stream.hpp"

#if CCCL_MAJOR_VERSION > 3 || (CCCL_MAJOR_VERSION == 3 && CCCL_MINOR_VERSION >= 1)
/// 1 when the CCCL in use has the stream-ordered `resource` concept (>= 3.1), 0 for CCCL 3.0.
#define GLAKE_CCCL_STREAM_ORDERED_RESOURCE 1
#else
#define GLAKE_CCCL_STREAM_ORDERED_RESOURCE 0
#endif

namespace glake {

/// How a cuda_mr_resource reports misuse it cannot throw: `deallocate` is noexcept (CCCL and RMM
/// require it), so a foreign pointer, double free or size mismatch caught by the allocator is
/// handed here as one line, and the memory is not freed. The default, print_resource_misuse,
/// writes it to stderr. Must not throw.
using resource_misuse_report = void (*)(const char* message) noexcept;

inline void print_resource_misuse(const char* message) noexcept {
  std::fprintf(stderr, "glake::cuda_mr_resource: %s\n", message);
}

namespace detail {

template <class T, class... List>
inline constexpr bool one_of_v = (std::same_as<T, List> || ...);

// The properties a cuda_mr_resource declares: those named, else the allocator's own kind.
template <class Allocator, class... Named>
struct mr_properties {
  using type = mr_properties;
  template <class P>
  static constexpr bool has = one_of_v<P, Named...>;
};
template <class Allocator>
struct mr_properties<Allocator> {
  static constexpr std::optional<memory_location> where = allocator_location_v<Allocator>;
  static_assert(where.has_value(),
                "glake::cuda_mr_resource: this allocator's type does not say where its memory lives; name "
                "the properties explicitly, e.g. cuda_mr_resource<A, cuda::mr::device_accessible>");
  template <class P>
  static constexpr bool has =
      (std::same_as<P, cuda::mr::device_accessible> && where == memory_location::device) ||
      (std::same_as<P, cuda::mr::host_accessible> && where == memory_location::host);
};

}  // namespace detail

/// What cuda_mr_resource needs of an allocator: any glake allocator (allocate, deallocate,
/// alignment; no optional capability).
template <class A>
concept cuda_mr_adaptable = allocator<A>;

/// A copyable handle to one glake allocator, shared by all copies (a std::shared_ptr), that models
/// CCCL's memory-resource concepts: `resource` and `async_resource` on CCCL 3.0,
/// `synchronous_resource` and the stream-ordered `resource` on CCCL >= 3.1 (see the table at the
/// top of this file). Copies compare equal when they share the allocator, so memory from one may
/// be freed through another.
///
/// Properties: `Properties...` when named; otherwise the allocator's kind of memory
/// (allocator_location_v): `device_accessible` for the CUDA backend, `host_accessible` for the
/// host backend, none for the simulated one.
///
/// Alignment: every request for an alignment up to the allocator's alignment() (256 B and more
/// for glake's allocators, CUDA's own guarantee) is met by every pointer returned; a larger
/// alignment, 0, or one that is not a power of two is refused with usage_error (stack RMM's
/// aligned_resource_adaptor on top for larger ones). Zero bytes give null, which deallocate ignores.
///
/// Streams: the stream-ordered members pass their stream to the allocator, which orders reuse
/// across streams itself. The synchronous members use the default stream; allocate's synchronous
/// form then synchronizes that stream (as RMM's resources do), so the memory is ready for any use
/// on return; deallocate's does not wait (the caller has finished with the memory).
///
/// Errors: out of memory throws glake::out_of_memory (a std::bad_alloc) with the allocator's
/// message; driver failures their driver_error. Deallocation is noexcept: misuse the allocator
/// catches (checked builds) goes to the resource_misuse_report, never through it.
///
/// Thread safety: that of the allocator; copies used from several threads (RMM's per-device
/// resource is) need an allocator with a locking policy (mutex_lock). Cost: one indirection over
/// the allocator's own call.
template <cuda_mr_adaptable Allocator, class... Properties>
class cuda_mr_resource {
  using properties = detail::mr_properties<Allocator, Properties...>;

 public:
  /// Shares `allocator`; it must not be null.
  explicit cuda_mr_resource(std::shared_ptr<Allocator> allocator,
                            resource_misuse_report report = &print_resource_misuse)
      : allocator_(std::move(allocator)), report_(report) {
    if (allocator_ == nullptr) {
      throw usage_error(usage_error::kind::bad_argument, "glake::cuda_mr_resource: the allocator is null");
    }
  }

  Allocator& allocator() const noexcept { return *allocator_; }
  const std::shared_ptr<Allocator>& shared_allocator() const noexcept { return allocator_; }

  /// Stream-ordered allocation: `bytes` for work on `stream`. The name and argument order of CCCL
  /// >= 3.1's `resource`; CCCL 3.0's allocate_async below is the same call.
  void* allocate(cuda::stream_ref stream, std::size_t bytes, std::size_t alignment = default_alignment) {
    check_alignment(alignment);
    return allocator_->allocate(bytes, to_glake(stream));
  }
  /// Gives `p` back on `stream`: reused by work on `stream` at once, by other streams once the
  /// work queued on `stream` by now has completed.
  void deallocate(cuda::stream_ref stream, void* p, std::size_t bytes,
                  std::size_t alignment = default_alignment) noexcept {
    (void)alignment;
    release(p, bytes, to_glake(stream));
  }

  /// Synchronous allocation: on the default stream, which is then synchronized.
  void* allocate_sync(std::size_t bytes, std::size_t alignment = default_alignment) {
    check_alignment(alignment);
    void* p = allocator_->allocate(bytes, default_stream);
    if (p != nullptr) {
      try {
        synchronize_default_stream();
      } catch (...) {
        release(p, bytes, default_stream);
        throw;
      }
    }
    return p;
  }
  void deallocate_sync(void* p, std::size_t bytes, std::size_t alignment = default_alignment) noexcept {
    (void)alignment;
    release(p, bytes, default_stream);
  }

#if !GLAKE_CCCL_STREAM_ORDERED_RESOURCE
  // CCCL 3.0's names for the same four calls.
  void* allocate(std::size_t bytes, std::size_t alignment = default_alignment) {
    return allocate_sync(bytes, alignment);
  }
  void deallocate(void* p, std::size_t bytes, std::size_t alignment = default_alignment) noexcept {
    deallocate_sync(p, bytes, alignment);
  }
  void* allocate_async(std::size_t bytes, std::size_t alignment, cuda::stream_ref stream) {
    return allocate(stream, bytes, alignment);
  }
  void deallocate_async(void* p, std::size_t bytes, std::size_t alignment, cuda::stream_ref stream) noexcept {
    deallocate(stream, p, bytes, alignment);
  }
#endif

  friend bool operator==(const cuda_mr_resource& a, const cuda_mr_resource& b) noexcept {
    return a.allocator_ == b.allocator_;
  }
  friend bool operator!=(const cuda_mr_resource& a, const cuda_mr_resource& b) noexcept { return !(a == b); }

  template <class Property>
    requires properties::template has<Property>
  friend constexpr void get_property(const cuda_mr_resource&, Property) noexcept {}

  /// CUDA's own guarantee, and RMM's default alignment argument.
  static constexpr std::size_t default_alignment = 256;

 private:
  static stream_ref to_glake(cuda::stream_ref stream) noexcept { return stream_ref{stream.get()}; }

  void check_alignment(std::size_t alignment) const {
    if (alignment == 0 || !std::has_single_bit(alignment)) {
      throw usage_error(usage_error::kind::bad_argument,
                        "glake::cuda_mr_resource: alignment " + std::to_string(alignment) +
                            " is not a power of two");
    }
    if (alignment > allocator_->alignment()) {
      throw usage_error(usage_error::kind::unsupported,
                        "glake::cuda_mr_resource: alignment " + std::to_string(alignment) +
                            " exceeds the allocator's guaranteed " + std::to_string(allocator_->alignment()) +
                            " (stack rmm::mr::aligned_resource_adaptor on top for larger ones)");
    }
  }

  void release(void* p, std::size_t bytes, stream_ref stream) noexcept {
    try {
      allocator_->deallocate(p, bytes, stream);
    } catch (const std::exception& e) {
      if (report_ != nullptr) report_(e.what());
    } catch (...) {
      if (report_ != nullptr) report_("deallocate failed with an unknown exception");
    }
  }

  static void synchronize_default_stream() {
    if constexpr (allocator_location_v<Allocator> == memory_location::device) {
      if (const cudaError_t status = cudaStreamSynchronize(nullptr); status != cudaSuccess) {
        throw driver_error("cudaStreamSynchronize", static_cast<int>(status), cudaGetErrorString(status));
      }
    }
  }

  std::shared_ptr<Allocator> allocator_;
  resource_misuse_report report_;
};

/// Makes the allocator (constructed from `args`) and the first handle to it.
template <cuda_mr_adaptable Allocator, class... Properties, class... Args>
cuda_mr_resource<Allocator, Properties...> make_cuda_mr_resource(Args&&... args) {
  return cuda_mr_resource<Allocator, Properties...>(std::make_shared<Allocator>(std::forward<Args>(args)...));
}

/// The concepts a cuda_mr_resource<A, P...> models under the CCCL in use, with properties P.
template <class R, class... P>
inline constexpr bool models_cuda_mr_v =
#if GLAKE_CCCL_STREAM_ORDERED_RESOURCE
    cuda::mr::synchronous_resource_with<R, P...> && cuda::mr::resource_with<R, P...>;
#else
    cuda::mr::resource_with<R, P...> && cuda::mr::async_resource_with<R, P...>;
#endif

}  // namespace glake
