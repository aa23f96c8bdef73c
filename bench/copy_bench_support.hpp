// What the copy benchmarks (copy_bench.cu, multipath_bench.cu) share: CUDA error checks, timing
// of one copy to the end of a stream, interleaved rounds of methods, medians and percentiles, the
// driver's version, a fill pattern, and the host buffers a copy is measured from and to.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace glake::bench {

using clock_type = std::chrono::steady_clock;

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

struct summary {
  double median, p10, p90;
};
inline summary summarize(std::vector<double> v) {
  if (v.empty()) return {std::nan(""), std::nan(""), std::nan("")};  // a method that could not run
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[static_cast<std::size_t>(q * static_cast<double>(v.size() - 1) + 0.5)]; };
  return {at(0.5), at(0.1), at(0.9)};
}

inline double gbps(std::size_t bytes, double seconds) { return static_cast<double>(bytes) / seconds / 1e9; }

inline double time_once(const std::function<void()>& run, cudaStream_t stream) {
  const auto start = clock_type::now();
  run();
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

struct method {
  std::string name;
  std::function<void()> run;
  std::vector<double> rates;
};

// Times every method `repeats` times, interleaved, the order reversed every other round.
// A method without `run` is skipped (its rates stay empty).
inline void measure(std::vector<method>& methods, std::size_t bytes, int repeats, cudaStream_t stream) {
  for (method& m : methods) {
    if (m.run) (void)time_once(m.run, stream);  // warm-up: first-use costs out
  }
  for (int round = 0; round < repeats; ++round) {
    for (std::size_t k = 0; k < methods.size(); ++k) {
      method& m = methods[round % 2 == 0 ? k : methods.size() - 1 - k];
      if (m.run) m.rates.push_back(gbps(bytes, time_once(m.run, stream)));
    }
  }
}

inline std::string driver_version() {
  std::ifstream in("/proc/driver/nvidia/version");
  std::string line;
  std::getline(in, line);
  // "NVRM version: NVIDIA UNIX x86_64 Kernel Module for x86_64  580.159.04  ...": the first word
  // that starts with a digit and holds a dot.
  std::istringstream words(line);
  for (std::string w; words >> w;) {
    if (!w.empty() && w[0] >= '0' && w[0] <= '9' && w.find('.') != std::string::npos) return w;
  }
  int v = 0;
  cudaDriverGetVersion(&v);
  return "CUDA driver API " + std::to_string(v);
}

inline std::string number(double x) {  // JSON has no NaN: a method that did not run is null
  if (std::isnan(x)) return "null";
  char b[32];
  std::snprintf(b, sizeof b, "%.2f", x);
  return b;
}

inline std::string cell(const summary& s) {
  char b[64];
  std::snprintf(b, sizeof b, "%.1f (%.1f-%.1f)", s.median, s.p10, s.p90);
  return b;
}

inline bool same_bytes(const void* a, const void* b, std::size_t n) { return std::memcmp(a, b, n) == 0; }

inline void fill_pattern(unsigned char* p, std::size_t n, unsigned seed) {
  auto* w = reinterpret_cast<std::uint64_t*>(p);
  for (std::size_t i = 0; i < n / 8; ++i) w[i] = (i * 0x9E3779B97F4A7C15ull) ^ seed;
  for (std::size_t i = n / 8 * 8; i < n; ++i) p[i] = static_cast<unsigned char>(i ^ seed);
}

// The host side of a copy benchmark of n bytes: `pageable` filled with a pattern, `pinned`
// (cudaMallocHost) holding the same bytes, and `back`, zeroed, for copies to the host.
struct host_buffers {
  explicit host_buffers(std::size_t n, unsigned seed) : bytes(n) {
    check(cudaMallocHost(&pinned, n), "cudaMallocHost");
    pageable = static_cast<unsigned char*>(std::malloc(n));
    back = static_cast<unsigned char*>(std::malloc(n));
    if (pageable == nullptr || back == nullptr) {
      std::fprintf(stderr, "malloc of %zu bytes failed\n", n);
      std::exit(1);
    }
    fill_pattern(pageable, n, seed);
    std::memset(back, 0, n);
    std::memcpy(pinned, pageable, n);
  }
  host_buffers(const host_buffers&) = delete;
  host_buffers& operator=(const host_buffers&) = delete;
  ~host_buffers() {
    std::free(back);
    std::free(pageable);
    (void)cudaFreeHost(pinned);
  }

  std::size_t bytes;
  void* pinned = nullptr;
  unsigned char* pageable = nullptr;
  unsigned char* back = nullptr;
};

}  // namespace glake::bench
