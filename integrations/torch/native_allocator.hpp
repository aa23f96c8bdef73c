// glake as PyTorch's own CUDA allocator: a c10::cuda::CUDACachingAllocator::CUDAAllocator whose
// every hook is answered by the plug-in's per-device glake allocators (plugin_core.hpp), installed
// the way torch installs CUDAPluggableAllocator (changeCurrentAllocator). Built only against
// torch's headers (GLAKE_TORCH_NATIVE=1); see docs/pytorch.md, "The native allocator".
//
// What each hook does, and where glake differs from PyTorch's caching allocator on purpose:
//
// | hook                                   | glake                                              |
// |----------------------------------------|----------------------------------------------------|
// | allocate / raw_alloc[_with_stream]     | the device's glake allocator on the current (or    |
// |                                        | given) stream; a capture's pool when one takes the |
// |                                        | stream; out of memory is torch's OutOfMemoryError  |
// |                                        | after the OOM observers ran                        |
// | raw_delete / the DataPtr deleter       | glake_free with the size and stream of the request |
// | recordStream                           | glake_record_stream (reuse waits for that stream)  |
// | emptyCache                             | glake_empty_cache of every device                  |
// | set/getMemoryFraction                  | glake's memory limit (general allocator only)      |
// | getDeviceStats                         | PyTorch's full key set: allocations, active and    |
// |                                        | requested bytes counted here per small (<= 1 MiB)  |
// |                                        | and large pool; reserved bytes and segments are    |
// |                                        | glake's (all in the large pool)                    |
// | recordHistory / snapshot               | stacks from torch's context recorder; segments and |
// |                                        | blocks from glake's state, stitched allocations    |
// |                                        | shown on their pieces (each byte once)             |
// | begin/endAllocateToPool, releasePool,  | glake's private pools (graph_pools), one stitching |
// | createOrIncrefPool, getPoolUseCount    | allocator each; use counts are the pools' own      |
// | checkPoolLiveAllocations               | exact, from the pool's live blocks (graph_pools)   |
// | getCheckpointState / setCheckpoint...  | live allocations of the pool; restoring frees the  |
// |                                        | extra ones and revives missing ones: held (see     |
// |                                        | native_allocator::hold) or allocated again at      |
// |                                        | their old addresses (else a clear error)           |
// | shareIpcHandle / getIpcDevPtr          | refused with a message naming the alternative      |
//
// Thread safety: every hook may be called from any thread; one mutex guards the bookkeeping of
// live allocations and statistics, never held while glake allocates or frees.
#pragma once

#if defined(__GNUC__)
#define GLAKE_TORCH_NATIVE_API __attribute__((visibility("default")))
#else
#define GLAKE_TORCH_NATIVE_API
#endif

extern "C" {
/// Makes glake PyTorch's current CUDA allocator. 0; -1 when PyTorch refused (its own allocator
/// was used already), with the reason written into `message` (truncated to `size`).
GLAKE_TORCH_NATIVE_API int glake_native_install(char* message, unsigned long size);
}
