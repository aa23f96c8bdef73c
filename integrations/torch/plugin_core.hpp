// The plug-in's per-device allocators (glake_torch.cpp) seen from C++ inside libglake_torch.so:
// what the native PyTorch allocator (native_allocator.cpp) needs beyond the C interface of
// glake_torch.h, so that both doors into PyTorch drive the same allocators, statistics, private
// pools, traces and offload. Nothing here is exported from the library.
//
// Thread safety: every function may be called from any thread (the allocators lock themselves).
// Streams are CUDA streams (`struct CUstream_st*`, which is also cudaStream_t).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "glake/adaptors/pluggable_allocator.hpp"
#include "glake/memory_state.hpp"
#include "glake/statistics.hpp"

struct CUstream_st;

namespace glake::torch_plugin::core {

/// A private pool's name: PyTorch's MempoolId_t; {0, 0} names a device's general allocator.
using pool_id = std::pair<unsigned long long, unsigned long long>;

/// What visit_device_state shows, in order: pool(id) before each allocator (the general one
/// first, {0, 0}), then that allocator's segments with their blocks and its stitched ranges with
/// their pieces (memory_state.hpp's state_visitor).
class state_sink {
 public:
  virtual ~state_sink() = default;
  virtual void pool(pool_id id) = 0;
  virtual void segment(const segment_view& s) = 0;
  virtual void block(const block_view& b) = 0;
  virtual void stitched(const stitched_view& r) = 0;
  virtual void piece(const stitched_piece_view& p) = 0;
};

/// `bytes` on `device` for work on `stream`, as glake_torch_malloc serves it (a movable buffer in
/// a movable scope, schedulers relieved before giving up); throws glake::out_of_memory (a
/// std::bad_alloc) when memory ran out, or the error that stopped it. Zero bytes give null.
void* allocate(std::size_t bytes, int device, CUstream_st* stream);

/// Shows `device`'s allocators to `sink`; false when the device has no allocator yet.
bool visit_device_state(int device, state_sink& sink);

/// The sums over `device`'s general allocator and its private pools (zeros when it has none).
statistics device_statistics(int device);

/// `device`'s memory history (glake_record_history), oldest first.
std::vector<history_entry> device_history(int device);

/// glake_begin_allocate_to_pool, which says whether the pool now takes the requests.
bool begin_allocate_to_pool(int device, pool_id pool, std::function<bool(CUstream_st*)> filter);

/// The uses of `device`'s private pool `pool` (graph_pools::use_count: begins, creations included,
/// minus releases); 0 when it does not exist.
std::size_t pool_use_count(int device, pool_id pool);

/// Whether a capture into the pool is under way: requests go to it (graph_pools::capturing).
bool allocating_to_pool(int device, pool_id pool);

/// The pool's live allocations, ascending (graph_pools::live); empty when it does not exist.
std::vector<void*> pool_live_allocations(int device, pool_id pool);

/// The device's memory (cuDeviceTotalMem), 0 when the driver cannot say.
std::size_t device_total_bytes(int device);

}  // namespace glake::torch_plugin::core
