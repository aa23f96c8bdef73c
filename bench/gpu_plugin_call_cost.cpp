// What one call into the PyTorch plug-in costs on this machine, and what GLAKE_HOST_TIMING adds
// to it: the clock read that timing makes twice per call, the cuCtxGetCurrent of the plug-in's
// device scope, and cached glake_malloc + glake_free pairs (with a live neighbour of the same
// size) through the plug-in's C functions, as PyTorch calls them. Run it twice, with and without
// GLAKE_HOST_TIMING=1, to price the timing (bench/results/gpu_alloc_latency.md, session 9).
//
//   bench/torch/build_plugin.sh
//   g++ -std=c++20 -O2 bench/gpu_plugin_call_cost.cpp -I/usr/local/cuda/include
//       -L/usr/local/cuda/lib64/stubs -lcuda -ldl -o /tmp/call_cost
//   /tmp/call_cost build/torch/libglake_torch.so; GLAKE_HOST_TIMING=1 /tmp/call_cost build/torch/libglake_torch.so
#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <vector>

#include "gpu_check.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

// Median over 15 batches of `n` calls of f, in ns per call.
template <class F>
double ns_per_call(F&& f, int n) {
  std::vector<double> batches;
  for (int k = 0; k < 15; ++k) {
    const auto start = clock_type::now();
    for (int i = 0; i < n; ++i) f();
    batches.push_back(std::chrono::duration<double, std::nano>(clock_type::now() - start).count() / n);
  }
  std::sort(batches.begin(), batches.end());
  return batches[batches.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s path/to/libglake_torch.so\n", argv[0]);
    return 2;
  }
  using glake_probe::check;
  check(cuInit(0), "cuInit");
  CUdevice device{};
  check(cuDeviceGet(&device, 0), "cuDeviceGet");
  CUcontext context = nullptr;
  check(cuDevicePrimaryCtxRetain(&context, device), "cuDevicePrimaryCtxRetain");
  check(cuCtxSetCurrent(context), "cuCtxSetCurrent");

  volatile long sink = 0;
  std::printf("steady_clock::now: %.1f ns\n",
              ns_per_call([&] { sink = sink + clock_type::now().time_since_epoch().count(); }, 100000));
  std::printf("cuCtxGetCurrent: %.1f ns\n", ns_per_call([&] {
                CUcontext current = nullptr;
                (void)cuCtxGetCurrent(&current);
                sink = sink + (current != nullptr);
              }, 100000));

  void* library = dlopen(argv[1], RTLD_NOW);
  if (library == nullptr) {
    std::fprintf(stderr, "dlopen: %s\n", dlerror());
    return 1;
  }
  using malloc_fn = void* (*)(std::size_t, int, void*);
  using free_fn = void (*)(void*, std::size_t, int, void*);
  const auto allocate = reinterpret_cast<malloc_fn>(dlsym(library, "glake_malloc"));
  const auto release = reinterpret_cast<free_fn>(dlsym(library, "glake_free"));
  if (allocate == nullptr || release == nullptr) {
    std::fprintf(stderr, "%s has no glake_malloc / glake_free\n", argv[1]);
    return 1;
  }
  for (const std::size_t bytes : {std::size_t{4096}, std::size_t{1} << 20, std::size_t{64} << 20}) {
    void* neighbour = allocate(bytes, 0, nullptr);
    if (neighbour == nullptr) {
      std::fprintf(stderr, "glake_malloc(%zu) failed\n", bytes);
      return 1;
    }
    std::printf("glake_malloc + glake_free, %zu B: %.1f ns per pair\n", bytes, ns_per_call([&] {
                  void* p = allocate(bytes, 0, nullptr);
                  release(p, bytes, 0, nullptr);
                }, 20000));
    release(neighbour, bytes, 0, nullptr);
  }
  return 0;
}
