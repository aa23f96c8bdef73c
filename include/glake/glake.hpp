// Everything glake offers that runs without a GPU, in one include.
#pragma once

#include "glake/adaptors/pluggable_allocator.hpp"
#include "glake/adaptors/pmr_resource.hpp"
#include "glake/allocators/caching_allocator.hpp"
#include "glake/allocators/concepts.hpp"
#include "glake/allocators/segment_source.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/concepts.hpp"
#include "glake/backends/host.hpp"
#include "glake/backends/sim.hpp"
#include "glake/config.hpp"
#include "glake/errors.hpp"
#include "glake/policies/eviction.hpp"
#include "glake/policies/locking.hpp"
#include "glake/policies/stitching.hpp"
#include "glake/statistics.hpp"
#include "glake/stream.hpp"
