// The CUDA models of copy_backend and pointer_classifier: pinned staging memory from
// cuMemHostAlloc, cuMemcpyAsync, pooled events, and cuPointerGetAttributes to tell pageable
// host memory from pinned host memory and device memory. Needs <cuda.h> and the driver
// library (CMake target glake::cuda).
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

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
// CUDA runtime and PyTorch use). Each call runs in the calling thread's current context when
// that is this device's; in the primary context where the thread has none current (which then
// stays current, as the runtime does); in the primary context pushed for the call where the
// current one is another device's, so one thread may drive the backends of several devices.
// Streams given to it must belong to the context the call runs in.
// The peer_copy_backend members run in the device's primary context, pushed for the call:
// scratch memory is cuMemAlloc, a peer copy is cuMemcpyAsync between the two devices' memory
// (unified addressing; it goes over the peer link once cuda_enable_peer_access was called for
// the pair, through host memory otherwise), stream_wait_event is cuStreamWaitEvent.
// Copies of the object share the context reference and the event pool (a handle).
// Thread safety: every member may be called concurrently (the driver's, and the pool's mutex).
// ---------------------------------------------------------------------------------------------
class cuda_copy_backend {
 public:
  using event_type = CUevent;

  explicit cuda_copy_backend(int device = 0) : state_(std::make_shared<state>(device)) {}

  int device() const noexcept { return state_->device; }

  void* try_allocate_staging(std::size_t bytes) {
    const device_scope scope(*this);
    void* p = nullptr;
    const CUresult result = cuMemHostAlloc(&p, bytes, CU_MEMHOSTALLOC_PORTABLE);
    if (detail::cuda_out_of_memory(result)) return nullptr;
    detail::cuda_check(result, "cuMemHostAlloc");
    return p;
  }

  void free_staging(void* p, std::size_t) noexcept {
    const device_scope scope(*this);
    (void)cuMemFreeHost(p);
  }

  void enqueue_copy(void* to, const void* from, std::size_t bytes, stream_ref stream) {
    if (bytes == 0) return;
    const device_scope scope(*this);
    detail::cuda_check(cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(to), reinterpret_cast<CUdeviceptr>(from), bytes,
                                     stream.as<CUstream_st>()),
                       "cuMemcpyAsync");
  }

  event_type record_event(stream_ref stream) {
    const device_scope scope(*this);
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

  void* try_allocate_device(std::size_t bytes) {
    const context_scope scope(state_->primary.context);
    CUdeviceptr p = 0;
    const CUresult result = cuMemAlloc(&p, bytes);
    if (detail::cuda_out_of_memory(result)) return nullptr;
    detail::cuda_check(result, "cuMemAlloc");
    return reinterpret_cast<void*>(p);
  }

  void free_device(void* p, std::size_t) noexcept {
    const context_scope scope(state_->primary.context);
    (void)cuMemFree(reinterpret_cast<CUdeviceptr>(p));
  }

  void enqueue_peer_copy(void* to, int, const void* from, int, std::size_t bytes, stream_ref stream) {
    if (bytes == 0) return;
    const context_scope scope(state_->primary.context);
    detail::cuda_check(cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(to), reinterpret_cast<CUdeviceptr>(from), bytes,
                                     stream.as<CUstream_st>()),
                       "cuMemcpyAsync (peer)");
  }

  void stream_wait_event(stream_ref stream, event_type event) {
    const context_scope scope(state_->primary.context);
    detail::cuda_check(cuStreamWaitEvent(stream.as<CUstream_st>(), event, 0), "cuStreamWaitEvent");
  }

  /// The device's primary context, retained for the life of the backend.
  CUcontext context() const noexcept { return state_->primary.context; }

  void wait_event(event_type event) noexcept { (void)cuEventSynchronize(event); }
  void recycle_event(event_type event) noexcept { state_->events.give(event); }
  void wait_stream(stream_ref stream) noexcept {
    const device_scope scope(*this);
    (void)cuStreamSynchronize(stream.as<CUstream_st>());
  }

 private:
  // The context a call runs in: the calling thread's current one when it is this device's; the
  // primary context where the thread has none (it then stays current, as the runtime does); the
  // primary context pushed for the call where the current one is another device's (a thread that
  // works with several devices: events and streams of this device belong to its context).
  struct device_scope {
    explicit device_scope(const cuda_copy_backend& b) noexcept {
      CUcontext current = nullptr;
      if (cuCtxGetCurrent(&current) != CUDA_SUCCESS) return;
      if (current == nullptr) {
        (void)cuCtxSetCurrent(b.state_->primary.context);
        return;
      }
      CUdevice device{};
      if (cuCtxGetDevice(&device) == CUDA_SUCCESS && device != b.state_->primary.device) {
        pushed = cuCtxPushCurrent(b.state_->primary.context) == CUDA_SUCCESS;
      }
    }
    device_scope(const device_scope&) = delete;
    device_scope& operator=(const device_scope&) = delete;
    ~device_scope() {
      CUcontext popped = nullptr;
      if (pushed) (void)cuCtxPopCurrent(&popped);
    }
    bool pushed = false;
  };

  // Makes `context` current for a scope, then restores the thread's previous one.
  struct context_scope {
    explicit context_scope(CUcontext context) noexcept : pushed(cuCtxPushCurrent(context) == CUDA_SUCCESS) {}
    context_scope(const context_scope&) = delete;
    context_scope& operator=(const context_scope&) = delete;
    ~context_scope() {
      CUcontext popped = nullptr;
      if (pushed) (void)cuCtxPopCurrent(&popped);
    }
    bool pushed;
  };

  struct state {
    explicit state(int ordinal) : device(ordinal), primary(ordinal) {}
    int device;
    detail::cuda_primary_context primary;  // released last: the events below live in it
    detail::cuda_event_pool events;
  };
  std::shared_ptr<state> state_;
};
static_assert(peer_copy_backend<cuda_copy_backend>);

/// Lets each of the two devices read and write the other's memory directly (cuCtxEnablePeerAccess
/// both ways), so that peer copies between them take the peer link; access already enabled is
/// not an error. driver_error when the pair has no peer access (see cuda_link_weights).
inline void cuda_enable_peer_access(const cuda_copy_backend& a, const cuda_copy_backend& b) {
  const auto enable = [](CUcontext from, CUcontext to) {
    detail::cuda_check(cuCtxPushCurrent(from), "cuCtxPushCurrent");
    const CUresult result = cuCtxEnablePeerAccess(to, 0);
    CUcontext popped = nullptr;
    (void)cuCtxPopCurrent(&popped);
    if (result != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED) detail::cuda_check(result, "cuCtxEnablePeerAccess");
  };
  enable(a.context(), b.context());
  enable(b.context(), a.context());
}

/// Default weights of the peer paths to `target`, in the unit of a direct path of weight 1, for
/// peer_route::weight: 0 for a peer without peer access to the target (its forward copy would go
/// through host memory), else 1 / (1 + the driver's performance rank of the link peer -> target)
/// (rank 0, the best link such as NVLink, gives 1: the peer's host link is then the bottleneck,
/// as fast as the target's own). cuDeviceGetP2PAttribute ranks links; it does not measure them:
/// measured bandwidths, where known, should replace these weights.
inline std::vector<double> cuda_link_weights(int target, std::span<const int> peers) {
  detail::cuda_check(cuInit(0), "cuInit");
  CUdevice to{};
  detail::cuda_check(cuDeviceGet(&to, target), "cuDeviceGet");
  std::vector<double> weights;
  weights.reserve(peers.size());
  for (const int peer : peers) {
    CUdevice from{};
    detail::cuda_check(cuDeviceGet(&from, peer), "cuDeviceGet");
    int access = 0;
    int rank = 0;
    detail::cuda_check(cuDeviceGetP2PAttribute(&access, CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED, from, to),
                       "cuDeviceGetP2PAttribute");
    if (access == 0 || peer == target) {
      weights.push_back(0.0);
      continue;
    }
    detail::cuda_check(cuDeviceGetP2PAttribute(&rank, CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK, from, to),
                       "cuDeviceGetP2PAttribute");
    weights.push_back(1.0 / (1.0 + static_cast<double>(rank < 0 ? 0 : rank)));
  }
  return weights;
}

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
