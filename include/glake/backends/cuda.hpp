// The CUDA backend: physical handles from cuMemCreate and address ranges from
// cuMemAddressReserve, mapped with cuMemMap and made accessible with cuMemSetAccess.
// Needs <cuda.h> and the driver library (CMake target glake::cuda).
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "glake/backends/concepts.hpp"
#include "glake/errors.hpp"
#include "glake/stream.hpp"

namespace glake {

/// A CUDA driver call failed; the message names the call and its CUresult by name.
class cuda_error : public driver_error {
 public:
  cuda_error(const char* call, CUresult result)
      : driver_error(call, static_cast<int>(result), describe(result)), result_(result) {}
  CUresult result() const noexcept { return result_; }

 private:
  static std::string describe(CUresult result) {
    const char* name = nullptr;
    const char* text = nullptr;
    cuGetErrorName(result, &name);
    cuGetErrorString(result, &text);
    return std::string(name != nullptr ? name : "CUDA_ERROR_UNKNOWN") + " (" +
           (text != nullptr ? text : "no description") + ")";
  }
  CUresult result_;
};

namespace detail {
inline void cuda_check(CUresult result, const char* call) {
  if (result != CUDA_SUCCESS) throw cuda_error(call, result);
}
// Out of memory is an answer, not an error: the allocator falls back and retries.
inline bool cuda_out_of_memory(CUresult result) noexcept { return result == CUDA_ERROR_OUT_OF_MEMORY; }

/// The properties of pinned memory on `device`, exportable as a POSIX file descriptor when
/// `shareable`: what every device handle of this backend (and of cuda_sharing) is made with.
inline CUmemAllocationProp cuda_device_properties(int device, bool shareable = false) noexcept {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = shareable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  return prop;
}

/// Access to a range for `device` (read-write unless told).
inline CUmemAccessDesc cuda_access(int device, CUmemAccess_flags flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE) noexcept {
  CUmemAccessDesc desc{};
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = device;
  desc.flags = flags;
  return desc;
}

/// Events with timing disabled, created once and reused: take one, give it back when its
/// work is known to be done. Thread safety: take and give may be called concurrently.
class cuda_event_pool {
 public:
  cuda_event_pool() = default;
  cuda_event_pool(const cuda_event_pool&) = delete;
  cuda_event_pool& operator=(const cuda_event_pool&) = delete;
  ~cuda_event_pool() {
    for (CUevent e : free_) (void)cuEventDestroy(e);
  }
  CUevent take() {
    {
      std::lock_guard guard(mutex_);
      if (!free_.empty()) {
        CUevent e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    CUevent e = nullptr;
    cuda_check(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    return e;
  }
  void give(CUevent e) noexcept {
    std::lock_guard guard(mutex_);
    try {
      free_.push_back(e);
    } catch (...) {
      (void)cuEventDestroy(e);
    }
  }

 private:
  std::mutex mutex_;
  std::vector<CUevent> free_;
};

// One retained reference to a device's primary context (the one the CUDA runtime and PyTorch
// use), released by the destructor; it does not make the context current.
struct cuda_primary_context {
  explicit cuda_primary_context(int ordinal) {
    cuda_check(cuInit(0), "cuInit");
    cuda_check(cuDeviceGet(&device, ordinal), "cuDeviceGet");
    cuda_check(cuDevicePrimaryCtxRetain(&context, device), "cuDevicePrimaryCtxRetain");
  }
  cuda_primary_context(const cuda_primary_context&) = delete;
  cuda_primary_context& operator=(const cuda_primary_context&) = delete;
  ~cuda_primary_context() { (void)cuDevicePrimaryCtxRelease(device); }
  CUdevice device{};
  CUcontext context = nullptr;
};

}  // namespace detail

/// Physical device memory: pinned allocations on one device, optionally exportable as POSIX file
/// descriptors (for sharing between processes). The granularity is queried from the driver
/// (CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), never assumed.
/// Thread safety: the driver's (its calls are thread-safe); the object itself is immutable.
/// Construction initialises the driver and retains the device's primary context; copies share it.
class cuda_provider {
 public:
  using handle_type = CUmemGenericAllocationHandle;

  explicit cuda_provider(int device = 0, bool shareable = false) : device_(device), shareable_(shareable) {
    detail::cuda_check(cuInit(0), "cuInit");
    CUdevice dev{};
    detail::cuda_check(cuDeviceGet(&dev, device), "cuDeviceGet");
    // The VMM calls need a current context; without one, use the device's primary context (the
    // one the CUDA runtime and PyTorch use), retained for the life of the process.
    CUcontext current = nullptr;
    detail::cuda_check(cuCtxGetCurrent(&current), "cuCtxGetCurrent");
    if (current == nullptr) {
      CUcontext primary = nullptr;
      detail::cuda_check(cuDevicePrimaryCtxRetain(&primary, dev), "cuDevicePrimaryCtxRetain");
      detail::cuda_check(cuCtxSetCurrent(primary), "cuCtxSetCurrent");
    }
    int supported = 0;
    detail::cuda_check(
        cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev),
        "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)");
    if (supported == 0) {
      throw cuda_error("cuda_provider: device does not support virtual memory management",
                       CUDA_ERROR_NOT_SUPPORTED);
    }
    const CUmemAllocationProp prop = properties();
    detail::cuda_check(cuMemGetAllocationGranularity(&granularity_, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                       "cuMemGetAllocationGranularity");
    detail::cuda_check(cuDeviceTotalMem(&capacity_, dev), "cuDeviceTotalMem");
  }

  std::size_t granularity() const noexcept { return granularity_; }
  static constexpr memory_location location() noexcept { return memory_location::device; }
  /// The device's total memory: no request above it can succeed.
  std::size_t capacity() const noexcept { return capacity_; }
  int device() const noexcept { return device_; }
  bool shareable() const noexcept { return shareable_; }

  std::optional<handle_type> try_create(std::size_t bytes) {
    if (bytes == 0 || bytes % granularity_ != 0) {
      throw usage_error(usage_error::kind::bad_argument,
                        "cuda_provider::try_create: " + std::to_string(bytes) +
                            " bytes is not a positive multiple of the granularity " + std::to_string(granularity_));
    }
    handle_type handle{};
    const CUmemAllocationProp prop = properties();
    const CUresult result = cuMemCreate(&handle, bytes, &prop, 0);
    if (detail::cuda_out_of_memory(result)) return std::nullopt;
    detail::cuda_check(result, "cuMemCreate");
    return handle;
  }

  void release(handle_type handle) noexcept { (void)cuMemRelease(handle); }

  /// A POSIX file descriptor for a handle of a shareable provider (the caller closes it).
  int export_fd(handle_type handle) const {
    int fd = -1;
    detail::cuda_check(cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                       "cuMemExportToShareableHandle");
    return fd;
  }

  friend bool operator==(const cuda_provider&, const cuda_provider&) noexcept = default;

 private:
  CUmemAllocationProp properties() const noexcept { return detail::cuda_device_properties(device_, shareable_); }

  int device_;
  bool shareable_;
  std::size_t granularity_ = 0;
  std::size_t capacity_ = 0;
};
static_assert(physical_provider<cuda_provider>);
static_assert(capacity_reporting_provider<cuda_provider>);

/// Physical host memory for the device's far tier: pinned pages on a host NUMA node, made with
/// cuMemCreate (CU_MEM_LOCATION_TYPE_HOST_NUMA) and mapped by a cuda_reserver into the device's
/// address space like device handles, so the GPU reads and writes them over the bus through the
/// same virtual addresses (what stable-address offload swaps in). The node is the device's own
/// (CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID) unless named; a machine without NUMA reports none and gets 0.
/// Creating a handle pins its pages, which costs far more than a device handle: keep handles
/// for reuse (virtual_buffer does). Thread safety: the driver's; the object is immutable.
class cuda_host_provider {
 public:
  using handle_type = CUmemGenericAllocationHandle;

  explicit cuda_host_provider(int device = 0, int numa_node = -1) : device_(device), node_(numa_node) {
    detail::cuda_check(cuInit(0), "cuInit");
    CUdevice dev{};
    detail::cuda_check(cuDeviceGet(&dev, device), "cuDeviceGet");
    if (node_ < 0) {
      int id = -1;
      if (cuDeviceGetAttribute(&id, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, dev) != CUDA_SUCCESS || id < 0) id = 0;
      node_ = id;
    }
    const CUmemAllocationProp prop = properties();
    detail::cuda_check(cuMemGetAllocationGranularity(&granularity_, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                       "cuMemGetAllocationGranularity(HOST_NUMA)");
  }

  std::size_t granularity() const noexcept { return granularity_; }
  static constexpr memory_location location() noexcept { return memory_location::host; }
  int device() const noexcept { return device_; }
  int numa_node() const noexcept { return node_; }

  std::optional<handle_type> try_create(std::size_t bytes) {
    if (bytes == 0 || bytes % granularity_ != 0) {
      throw usage_error(usage_error::kind::bad_argument,
                        "cuda_host_provider::try_create: " + std::to_string(bytes) +
                            " bytes is not a positive multiple of the granularity " + std::to_string(granularity_));
    }
    handle_type handle{};
    const CUmemAllocationProp prop = properties();
    const CUresult result = cuMemCreate(&handle, bytes, &prop, 0);
    if (detail::cuda_out_of_memory(result)) return std::nullopt;
    detail::cuda_check(result, "cuMemCreate(HOST_NUMA)");
    return handle;
  }

  void release(handle_type handle) noexcept { (void)cuMemRelease(handle); }

  friend bool operator==(const cuda_host_provider&, const cuda_host_provider&) noexcept = default;

 private:
  CUmemAllocationProp properties() const noexcept {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    prop.location.id = node_;
    return prop;
  }

  int device_;
  int node_;
  std::size_t granularity_ = 0;
};
static_assert(physical_provider<cuda_host_provider>);

/// The byte_copier of the CUDA backend: cuMemcpyAsync on the stream, between any two ranges of
/// the unified address space (device or host-NUMA handles mapped by a cuda_reserver, pinned or
/// pageable host memory). It returns once the copy is queued.
struct cuda_copier {
  static constexpr bool synchronous = false;
  void copy(void* to, const void* from, std::size_t bytes, stream_ref stream) const {
    if (bytes == 0) return;
    detail::cuda_check(cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(to), reinterpret_cast<CUdeviceptr>(from), bytes,
                                     stream.as<CUstream_st>()),
                       "cuMemcpyAsync");
  }
};
static_assert(byte_copier<cuda_copier>);

/// Virtual address ranges on the device's address space. Access is granted read-write to the
/// owning device and to each peer device named at construction (peer access on request).
/// Thread safety: the driver's; the object is immutable after construction.
class cuda_reserver {
 public:
  using handle_type = CUmemGenericAllocationHandle;

  explicit cuda_reserver(int device = 0, std::vector<int> peers = {}) : device_(device) {
    detail::cuda_check(cuInit(0), "cuInit");
    const CUmemAllocationProp prop = detail::cuda_device_properties(device);
    detail::cuda_check(cuMemGetAllocationGranularity(&granularity_, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                       "cuMemGetAllocationGranularity");
    access_.push_back(detail::cuda_access(device));
    for (int peer : peers) {
      if (peer != device) access_.push_back(detail::cuda_access(peer));
    }
  }

  std::size_t granularity() const noexcept { return granularity_; }
  int device() const noexcept { return device_; }

  void* try_reserve(std::size_t bytes) {
    CUdeviceptr address = 0;
    const CUresult result = cuMemAddressReserve(&address, bytes, granularity_, 0, 0);
    if (detail::cuda_out_of_memory(result)) return nullptr;
    detail::cuda_check(result, "cuMemAddressReserve");
    return reinterpret_cast<void*>(address);
  }

  void free(void* at, std::size_t bytes) noexcept { (void)cuMemAddressFree(to_device(at), bytes); }

  bool try_map(void* at, std::size_t bytes, handle_type handle) {
    const CUresult result = cuMemMap(to_device(at), bytes, 0, handle, 0);
    if (detail::cuda_out_of_memory(result)) return false;
    detail::cuda_check(result, "cuMemMap");
    return true;
  }

  bool try_set_access(void* at, std::size_t bytes) {
    const CUresult result = cuMemSetAccess(to_device(at), bytes, access_.data(), access_.size());
    if (detail::cuda_out_of_memory(result)) return false;
    detail::cuda_check(result, "cuMemSetAccess");
    return true;
  }

  void unmap(void* at, std::size_t bytes) noexcept { (void)cuMemUnmap(to_device(at), bytes); }

  // --- events (stream_ordered_reserver): pooled, timing disabled ---
  using event_type = CUevent;

  event_type record_event(stream_ref stream) {
    CUevent event = events_->take();
    const CUresult result = cuEventRecord(event, stream.as<CUstream_st>());
    if (result != CUDA_SUCCESS) {
      events_->give(event);
      detail::cuda_check(result, "cuEventRecord");
    }
    return event;
  }
  bool event_done(event_type event) {
    const CUresult result = cuEventQuery(event);
    if (result == CUDA_ERROR_NOT_READY) return false;
    detail::cuda_check(result, "cuEventQuery");
    return true;
  }
  void recycle_event(event_type event) noexcept { events_->give(event); }
  void wait_event(event_type event) noexcept { (void)cuEventSynchronize(event); }
  // --- stream_joining_reserver ---
  void stream_wait_event(stream_ref stream, event_type event) {
    detail::cuda_check(cuStreamWaitEvent(stream.as<CUstream_st>(), event, 0), "cuStreamWaitEvent");
  }
  void synchronize_device() noexcept { (void)cuCtxSynchronize(); }

  // --- capture_aware_reserver ---
  /// Whether `stream` is capturing a graph. The legacy default stream, while another stream
  /// captures in global mode, counts as capturing (the driver refuses to say otherwise).
  bool is_capturing(stream_ref stream) const {
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    const CUresult result = cuStreamIsCapturing(stream.as<CUstream_st>(), &status);
    if (result == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) return true;
    detail::cuda_check(result, "cuStreamIsCapturing");
    return status != CU_STREAM_CAPTURE_STATUS_NONE;
  }

  friend bool operator==(const cuda_reserver& a, const cuda_reserver& b) noexcept { return a.device_ == b.device_; }

 private:
  static CUdeviceptr to_device(void* p) noexcept { return reinterpret_cast<CUdeviceptr>(p); }
  int device_;
  std::size_t granularity_ = 0;
  std::vector<CUmemAccessDesc> access_;
  // Events are created once and reused; copies of a reserver share the pool.
  std::shared_ptr<detail::cuda_event_pool> events_ = std::make_shared<detail::cuda_event_pool>();
};
static_assert(address_reserver_for<cuda_reserver, cuda_provider>);
static_assert(address_reserver_for<cuda_reserver, cuda_host_provider>);
static_assert(stream_ordered_reserver<cuda_reserver>);
static_assert(stream_joining_reserver<cuda_reserver>);
static_assert(capture_aware_reserver<cuda_reserver>);

}  // namespace glake
