// The GPU presets (glake/presets.hpp's table): the stitching and caching allocators over the CUDA
// backend. Needs <cuda.h> and the driver library (CMake target glake::cuda).
#pragma once

#include "glake/backends/cuda.hpp"
#include "glake/presets.hpp"

namespace glake {

/// The stitching allocator over cuMemCreate/cuMemMap with its default policies; one thread at a
/// time unless Lock says otherwise.
template <lock_policy Lock = no_lock>
using gpu_stitching_allocator = default_stitching_allocator<cuda_provider, cuda_reserver, Lock>;
/// The same, usable from any thread (mutex_lock): what the plug-in and shared resources use.
using shared_gpu_stitching_allocator = gpu_stitching_allocator<mutex_lock>;
/// PyTorch's caching allocator over the CUDA backend, one handle per segment.
template <lock_policy Lock = no_lock>
using gpu_caching_allocator = pytorch_caching_allocator<cuda_provider, cuda_reserver, Lock>;

static_assert(stream_recording_allocator<gpu_stitching_allocator<>>);
static_assert(offloading_allocator<shared_gpu_stitching_allocator>);
static_assert(std::is_same_v<lock_of_t<shared_gpu_stitching_allocator>, mutex_lock>);
static_assert(owning_allocator<gpu_caching_allocator<>> && cache_releasing_allocator<gpu_caching_allocator<mutex_lock>>);

}  // namespace glake
