// Everything glake offers that runs without a GPU, in one include.
//
// Every public header but the CUDA backend (glake/backends/cuda.hpp, which needs <cuda.h>);
// tests/glake_header_test.cpp compiles a translation unit that includes only this one.
#pragma once

#include "glake/adaptors/pluggable_allocator.hpp"
#include "glake/adaptors/pmr_resource.hpp"
#include "glake/allocators/borrowed_segment_source.hpp"
#include "glake/allocators/caching_allocator.hpp"
#include "glake/allocators/concepts.hpp"
#include "glake/allocators/device_registry.hpp"
#include "glake/allocators/segment_source.hpp"
#include "glake/allocators/segregator.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/concepts.hpp"
#include "glake/backends/fault_injection.hpp"
#include "glake/backends/host.hpp"
#include "glake/backends/host_dma.hpp"
#include "glake/backends/sim.hpp"
#include "glake/config.hpp"
#include "glake/errors.hpp"
#include "glake/movers/concepts.hpp"
#include "glake/movers/staged_copy.hpp"
#include "glake/movers/staging_ring.hpp"
#include "glake/movers/virtual_buffer.hpp"
#include "glake/policies/admission.hpp"
#include "glake/policies/eviction.hpp"
#include "glake/policies/growth.hpp"
#include "glake/policies/locking.hpp"
#include "glake/policies/stitching.hpp"
#include "glake/statistics.hpp"
#include "glake/stream.hpp"
