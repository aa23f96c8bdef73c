// Shared by the standalone GPU probes (bench/probes/gpu_*.cu): end the program with the failing call's
// name and error when a CUDA driver or runtime call fails, the device memory they create and the
// access they grant to it, and the median they report.
// Probes include it by a relative path, so each still builds with one nvcc command.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <vector>

namespace glake_probe {

inline void check(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) {
    const char* name = nullptr;
    cuGetErrorName(r, &name);
    std::fprintf(stderr, "%s failed: %s\n", what, name ? name : "?");
    std::exit(1);
  }
}

inline void check(cudaError_t r, const char* what) {
  if (r != cudaSuccess) {
    std::fprintf(stderr, "%s failed: %s\n", what, cudaGetErrorString(r));
    std::exit(1);
  }
}

/// Pinned device memory on `device`: what cuMemCreate makes in every probe.
inline CUmemAllocationProp device_memory(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

/// The driver's recommended handle granularity for `prop` (2 MiB on the H100).
inline std::size_t granularity(const CUmemAllocationProp& prop) {
  std::size_t chunk = 0;
  check(cuMemGetAllocationGranularity(&chunk, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "granularity");
  return chunk;
}

/// Read-write access for `device` to memory mapped from handles of device_memory(device).
inline CUmemAccessDesc device_access(int device) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return access;
}

/// The median (the upper one of an even count), or NaN for no values (a helper that never ran).
inline double median(std::vector<double> v) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace glake_probe
