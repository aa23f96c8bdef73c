// The CUDA models of copy_backend and pointer_classifier: pinned staging memory from
// cuMemHostAlloc, cuMemcpyAsync, pooled events, and cuPointerGetAttributes to tell pageable
// host memory from pinned host memory and device memory. Needs <cuda.h> and the driver
// library (CMake target glake::cuda).
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "glake/backends/concepts.hpp"
#include "glake/backends/cuda.hpp"
#include "glake/stream.hpp"

namespace glake {

// ---------------------------------------------------------------------------------------------
// cuda_copy_backend
//
// copy_backend for one device. Staging memory is page-locked with cuMemHostAlloc (portable, so
// any context may copy from it; not write-combined, because device-to-host copies read it back
// on the host). Copies are cuMemcpyAsync on the caller's stream; events come from a pool
// (timing disabled) and are waited for with cuEventSynchronize.
//
// Contexts: the device's primary context is retained for the life of the backend (the one the
// CUDA runtime and PyTorch use). Each call runs in the calling thread's current context, or in
// the primary context where the thread has none current (which then stays current, as the
// runtime does). Streams given to it must belong to that context.
// Copies of the object share the context reference and the event pool (a handle).
// Thread safety: every member may be called concurrently (the driver's, and the pool's mutex).
// ---------------------------------------------------------------------------------------------
class cuda_copy_backend {
 public:
  using event_type = CUevent;

  explicit cuda_copy_backend(int device = 0) : state_(std::make_shared<state>(device)) {}

  int device() const noexcept { return state_->device; }

  void* try_allocate_staging(std::size_t bytes) {
    use_context();
    void* p = nullptr;
    const CUresult result = cuMemHostAlloc(&p, bytes, CU_MEMHOSTALLOC_PORTABLE);
    if (detail::cuda_out_of_memory(result)) return nullptr;
    detail::cuda_check(result, "cuMemHostAlloc");
    return p;
  }

  void free_staging(void* p, std::size_t) noexcept {
    use_context();
    (void)cuMemFreeHost(p);
  }

  void enqueue_copy(void* to, const void* from, std::size_t bytes, stream_ref stream) {
    if (bytes == 0) return;
    use_context();
    detail::cuda_check(cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(to), reinterpret_cast<CUdeviceptr>(from), bytes,
                                     stream.as<CUstream_st>()),
                       "cuMemcpyAsync");
  }

  event_type record_event(stream_ref stream) {
    use_context();
    CUevent event = state_->events.take();
    const CUresult result = cuEventRecord(event, stream.as<CUstream_st>());
    if (result != CUDA_SUCCESS) {
      state_->events.give(event);
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

  void wait_event(event_type event) noexcept { (void)cuEventSynchronize(event); }
  void recycle_event(event_type event) noexcept { state_->events.give(event); }
  void wait_stream(stream_ref stream) noexcept {
    use_context();
    (void)cuStreamSynchronize(stream.as<CUstream_st>());
  }

 private:
  void use_context() const noexcept {
    CUcontext current = nullptr;
    if (cuCtxGetCurrent(&current) == CUDA_SUCCESS && current == nullptr) (void)cuCtxSetCurrent(state_->primary.context);
  }

  struct primary_context {
    explicit primary_context(int ordinal) {
      detail::cuda_check(cuInit(0), "cuInit");
      detail::cuda_check(cuDeviceGet(&device, ordinal), "cuDeviceGet");
      detail::cuda_check(cuDevicePrimaryCtxRetain(&context, device), "cuDevicePrimaryCtxRetain");
    }
    primary_context(const primary_context&) = delete;
    primary_context& operator=(const primary_context&) = delete;
    ~primary_context() { (void)cuDevicePrimaryCtxRelease(device); }
    CUdevice device{};
    CUcontext context = nullptr;
  };
  struct state {
    explicit state(int ordinal) : device(ordinal), primary(ordinal) {}
    int device;
    primary_context primary;        // released last: the events below live in it
    detail::cuda_event_pool events;
  };
  std::shared_ptr<state> state_;
};
static_assert(copy_backend<cuda_copy_backend>);

// ---------------------------------------------------------------------------------------------
// cuda_pointer_classifier
//
// pointer_classifier from one cuPointerGetAttributes call (memory type, managed, device
// ordinal): memory the driver does not know is pageable; host memory from cuMemHostAlloc,
// cudaMallocHost or registered with cuMemHostRegister / cudaHostRegister is pinned; managed
// memory is managed; the rest is device memory of its device (cuMemAlloc, cudaMalloc, stream
// pools, cuMemCreate ranges). Stateless; thread safety: the driver's.
// ---------------------------------------------------------------------------------------------
struct cuda_pointer_classifier {
  pointer_info locate(const void* p) const {
    unsigned int type = 0;  // CUmemorytype; 0 for memory the driver does not know
    int managed = 0;
    int ordinal = -1;
    CUpointer_attribute attributes[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_IS_MANAGED,
                                        CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
    void* values[] = {&type, &managed, &ordinal};
    detail::cuda_check(cuPointerGetAttributes(3, attributes, values, reinterpret_cast<CUdeviceptr>(p)),
                       "cuPointerGetAttributes");
    if (managed != 0) return {memory_kind::managed, -1};
    switch (type) {
      case CU_MEMORYTYPE_DEVICE: return {memory_kind::device, ordinal};
      case CU_MEMORYTYPE_HOST: return {memory_kind::pinned, -1};
      default: return {memory_kind::pageable, -1};
    }
  }
};
static_assert(pointer_classifier<cuda_pointer_classifier>);

}  // namespace glake
