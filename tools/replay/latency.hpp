// Modeled driver time: backend calls priced with the latencies measured on an H100.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>

#include "glake/backends/sim.hpp"
#include "glake/statistics.hpp"

namespace glake::replay {

/// Median latencies in microseconds, measured on one H100 80GB (driver 580.159.04, CUDA 13.0) by
/// timing each driver call 100-400 times and whole stitches of 1-256 handles 20 times each,
/// 2 MiB handles unless noted.
/// cuMemSetAccess costs about 30.7 us for one handle and about 21.8 us per handle over a range
/// of many (5.6 ms for 256), so it is priced per mapping covered.
struct h100_latency {
  static constexpr double create = 11.81;
  static constexpr double release = 14.34;
  static constexpr double reserve = 0.68;
  static constexpr double address_free = 0.73;
  static constexpr double map = 1.11;
  static constexpr double unmap = 20.50;
  static constexpr double set_access_first = 30.74;
  static constexpr double set_access_each_more = 21.78;

  // cudaMalloc / cudaFree by size, measured at 512 B, 2 MiB, 64 MiB and 1 GiB; linear in between.
  static constexpr std::array<double, 4> malloc_sizes = {512.0, 2097152.0, 67108864.0, 1073741824.0};
  static constexpr std::array<double, 4> malloc_us = {44.70, 46.24, 46.59, 115.71};
  static constexpr std::array<double, 4> free_us = {37.42, 37.75, 59.06, 322.29};
};

namespace detail {
inline double interpolate(double bytes, const std::array<double, 4>& sizes, const std::array<double, 4>& us) {
  if (bytes <= sizes.front()) return us.front();
  for (std::size_t i = 1; i < sizes.size(); ++i) {
    if (bytes <= sizes[i]) {
      const double t = (bytes - sizes[i - 1]) / (sizes[i] - sizes[i - 1]);
      return us[i - 1] + t * (us[i] - us[i - 1]);
    }
  }
  // Past 1 GiB: grow with size at the last segment's slope.
  const double slope = (us[3] - us[2]) / (sizes[3] - sizes[2]);
  return us[3] + (bytes - sizes[3]) * slope;
}
}  // namespace detail

/// Driver time of the VMM calls a simulated device saw.
inline double modeled_vmm_us(const sim_device& device) {
  using L = h100_latency;
  const driver_call_counts c = device.calls();
  const double set_access_calls = static_cast<double>(c[driver_call::set_access]);
  const double set_access_more =
      std::max(0.0, static_cast<double>(device.set_access_mappings()) - set_access_calls);
  return static_cast<double>(c[driver_call::create]) * L::create +
         static_cast<double>(c[driver_call::release]) * L::release +
         static_cast<double>(c[driver_call::reserve]) * L::reserve +
         static_cast<double>(c[driver_call::address_free]) * L::address_free +
         static_cast<double>(c[driver_call::map]) * L::map +
         static_cast<double>(c[driver_call::unmap]) * L::unmap + set_access_calls * L::set_access_first +
         set_access_more * L::set_access_each_more;
}

inline double modeled_cuda_malloc_us(std::size_t bytes) {
  return detail::interpolate(static_cast<double>(bytes), h100_latency::malloc_sizes, h100_latency::malloc_us);
}
inline double modeled_cuda_free_us(std::size_t bytes) {
  return detail::interpolate(static_cast<double>(bytes), h100_latency::malloc_sizes, h100_latency::free_us);
}

}  // namespace glake::replay
