// Shared by the standalone GPU probes (bench/gpu_*.cu): end the program with the failing call's
// name and error when a CUDA driver or runtime call fails. Probes include it by a relative path,
// so each still builds with one nvcc command.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

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

}  // namespace glake_probe
