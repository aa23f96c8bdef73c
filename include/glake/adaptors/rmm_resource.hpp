// glake allocators as RMM memory resources: set as RMM's per-device resource, stacked under RMM's
// adaptors, or handed to rmm::device_buffer / device_uvector / exec_policy.
//
// RMM (26.06 on) takes any copyable CCCL value type that models the stream-ordered
// `cuda::mr::resource` concept of CCCL >= 3.1 with the `device_accessible` property, holding it as
// `cuda::mr::any_resource<cuda::mr::device_accessible>`. cuda_mr_resource already is one; what RMM
// adds is its out-of-memory type: failure_callback_resource_adaptor (and the spilling frameworks
// built on it, cuDF's and Dask's) catch only rmm::out_of_memory, so this header's resource turns
// glake::out_of_memory into one.
//
// Needs RMM's headers with the CCCL RMM was built with (RMM's wheels bundle it under
// include/rapids; that directory must come before the CUDA toolkit's include directory, whose
// CCCL 3.0 is too old), and librmm for rmm::out_of_memory's constructor.
#pragma once

#include <cuda/version>

#if !(CCCL_MAJOR_VERSION > 3 || (CCCL_MAJOR_VERSION == 3 && CCCL_MINOR_VERSION >= 1))
#error "glake/adaptors/rmm_resource.hpp needs CCCL >= 3.1, the one RMM is built with (RMM's wheels bundle it in include/rapids: put that directory before the CUDA toolkit's include directory); the CCCL found is older (the CUDA 13.0 toolkit's own is 3.0)"
#endif

#include <rmm/error.hpp>
#include <rmm/resource_ref.hpp>
#include <rmm/version_config.hpp>

#if RMM_VERSION_MAJOR < 26 || (RMM_VERSION_MAJOR == 26 && RMM_VERSION_MINOR < 6)
#error "glake/adaptors/rmm_resource.hpp needs RMM >= 26.06 (resources as CCCL value types); older RMM derives resources from rmm::mr::device_memory_resource"
#endif

#include <cuda/memory_resource>
#include <cuda/stream_ref>

#include <cstddef>
#include <exception>
#include <memory>
#include <type_traits>
#include <utility>

#include "glake/adaptors/cuda_mr_resource.hpp"
#include "glake/detail/archetypes.hpp"
#include "glake/errors.hpp"

namespace glake {

/// A cuda_mr_resource that RMM accepts as a device resource: the same copyable handle to one
/// shared allocator, whose allocation members throw rmm::out_of_memory where the allocator throws
/// glake::out_of_memory. The thrown exception carries glake's message (what was asked, what the
/// allocator held) and nests glake's own exception (std::throw_with_nested), so
/// `std::rethrow_if_nested` gives back glake::out_of_memory with its byte counts. Every other
/// error passes unchanged: usage_error for an alignment above the allocator's guarantee (stack
/// rmm::mr::aligned_resource_adaptor for those), driver_error for a driver failure.
///
/// Properties: `Properties...` when named, else the allocator's kind of memory, as for
/// cuda_mr_resource; the result must be device_accessible (RMM holds nothing else), so an
/// allocator over host memory must name it (tests do: rmm_resource<host_allocator,
/// cuda::mr::device_accessible>).
///
/// Streams, alignment, deallocation (noexcept; misuse to the resource_misuse_report) and cost:
/// those of cuda_mr_resource, plus a try block around allocation. RMM's containers
/// (device_buffer, device_uvector) and exec_policy call the stream-ordered members.
///
/// Devices: the memory is that of the device the allocator's backend was made for
/// (cuda_provider(d), cuda_reserver(d)); register the resource for that device only
/// (rmm::mr::set_per_device_resource(rmm::cuda_device_id{d}, r), or set_current_device_resource
/// with d current), one allocator per device.
///
/// Thread safety: that of the allocator. RMM's per-device resource is one object used from every
/// thread that allocates on the device, so an allocator set there must lock:
/// `stitching_allocator<cuda_provider, cuda_reserver, best_fit_tail_stitching, lru_eviction,
/// mutex_lock>`. The default `no_lock` is right only where one thread uses the resource and its
/// copies (a benchmark, a single-threaded tool).
template <cuda_mr_adaptable Allocator, class... Properties>
class rmm_resource : public cuda_mr_resource<Allocator, Properties...> {
  using base = cuda_mr_resource<Allocator, Properties...>;
  static_assert(cuda::has_property<base, cuda::mr::device_accessible>,
                "glake::rmm_resource: RMM holds only device_accessible resources; this allocator's memory is not "
                "device memory (name the property to use it anyway: rmm_resource<A, cuda::mr::device_accessible>)");

 public:
  using base::base;
  /// Shares the allocator of `resource`.
  explicit rmm_resource(const base& resource) : base(resource) {}

  /// As cuda_mr_resource::allocate; out of memory throws rmm::out_of_memory.
  void* allocate(cuda::stream_ref stream, std::size_t bytes, std::size_t alignment = base::default_alignment) {
    try {
      return base::allocate(stream, bytes, alignment);
    } catch (const out_of_memory& e) {
      std::throw_with_nested(rmm::out_of_memory(e.what()));
    }
  }
  /// As cuda_mr_resource::allocate_sync; out of memory throws rmm::out_of_memory.
  void* allocate_sync(std::size_t bytes, std::size_t alignment = base::default_alignment) {
    try {
      return base::allocate_sync(bytes, alignment);
    } catch (const out_of_memory& e) {
      std::throw_with_nested(rmm::out_of_memory(e.what()));
    }
  }
  using base::deallocate;
  using base::deallocate_sync;
};

/// Makes the allocator (constructed from `args`) and the first handle to it.
template <cuda_mr_adaptable Allocator, class... Properties, class... Args>
rmm_resource<Allocator, Properties...> make_rmm_resource(Args&&... args) {
  return rmm_resource<Allocator, Properties...>(std::make_shared<Allocator>(std::forward<Args>(args)...));
}

namespace detail {
using rmm_resource_archetype = rmm_resource<allocator_archetype, cuda::mr::device_accessible>;
}  // namespace detail

static_assert(cuda::mr::resource_with<detail::rmm_resource_archetype, cuda::mr::device_accessible>);
static_assert(cuda::mr::synchronous_resource_with<detail::rmm_resource_archetype, cuda::mr::device_accessible>);
static_assert(std::is_constructible_v<rmm::device_async_resource_ref, detail::rmm_resource_archetype&>);
static_assert(std::is_constructible_v<rmm::device_resource_ref, detail::rmm_resource_archetype&>);
static_assert(
    std::is_constructible_v<cuda::mr::any_resource<cuda::mr::device_accessible>, detail::rmm_resource_archetype>);

}  // namespace glake
