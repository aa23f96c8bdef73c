// Counts and times the backend calls an allocator makes, by kind.
#pragma once

#include <chrono>
#include <cstdint>
#include <utility>

#include "glake/statistics.hpp"

namespace glake::detail {

/// Adds the steady-clock nanoseconds from its construction to its destruction to a counter.
class stopwatch {
 public:
  explicit stopwatch(std::uint64_t& ns) noexcept : ns_(ns) {}
  stopwatch(const stopwatch&) = delete;
  stopwatch& operator=(const stopwatch&) = delete;
  ~stopwatch() {
    ns_ += static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_).count());
  }

 private:
  std::uint64_t& ns_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

/// Every backend call goes through operator(): it is counted, then timed on the steady clock
/// (failed and throwing calls too). Two clock reads per call: nothing beside a driver call that
/// takes a microsecond or more, and never on an allocation that makes no call.
class driver_meter {
 public:
  /// Calls `call()`, counted and timed as a call of `kind`, and returns what it returns.
  template <class F>
  decltype(auto) operator()(driver_call kind, F&& call) {
    ++counts_[kind];
    const stopwatch watch{times_[kind]};
    return std::forward<F>(call)();
  }

  const driver_call_counts& counts() const noexcept { return counts_; }
  const driver_call_times& times() const noexcept { return times_; }

 private:
  driver_call_counts counts_{};
  driver_call_times times_{};
};

}  // namespace glake::detail
