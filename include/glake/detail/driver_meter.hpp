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
/// Inside a sequence (calls made back to back, as a segment's creates, maps and access grant),
/// one read per call: each call is timed from the end of the one before it (the sequence's
/// start for the first), so the few instructions between them count as the next call's. On a
/// simulated device, where a call costs about as much as two clock reads, that halves what the
/// meter adds.
class driver_meter {
 public:
  /// Calls `call()`, counted and timed as a call of `kind`, and returns what it returns.
  template <class F>
  decltype(auto) operator()(driver_call kind, F&& call) {
    ++counts_[kind];
    if (in_sequence_) {
      const lap watch{times_[kind], lap_start_};
      return std::forward<F>(call)();
    }
    const stopwatch watch{times_[kind]};
    return std::forward<F>(call)();
  }

  /// Calls made while it lives form a sequence (see the class comment). One inside another
  /// changes nothing.
  class sequence {
   public:
    explicit sequence(driver_meter& meter) noexcept : meter_(meter.in_sequence_ ? nullptr : &meter) {
      if (meter_ == nullptr) return;
      meter_->in_sequence_ = true;
      meter_->lap_start_ = std::chrono::steady_clock::now();
    }
    sequence(const sequence&) = delete;
    sequence& operator=(const sequence&) = delete;
    ~sequence() {
      if (meter_ != nullptr) meter_->in_sequence_ = false;
    }

   private:
    driver_meter* meter_;
  };

  const driver_call_counts& counts() const noexcept { return counts_; }
  const driver_call_times& times() const noexcept { return times_; }

 private:
  // Adds the steady-clock nanoseconds from `start` to its destruction to a counter, and moves
  // `start` there.
  class lap {
   public:
    lap(std::uint64_t& ns, std::chrono::steady_clock::time_point& start) noexcept : ns_(ns), start_(start) {}
    lap(const lap&) = delete;
    lap& operator=(const lap&) = delete;
    ~lap() {
      const auto now = std::chrono::steady_clock::now();
      ns_ += static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(now - start_).count());
      start_ = now;
    }

   private:
    std::uint64_t& ns_;
    std::chrono::steady_clock::time_point& start_;
  };

  driver_call_counts counts_{};
  driver_call_times times_{};
  bool in_sequence_ = false;
  std::chrono::steady_clock::time_point lap_start_{};
};

/// Adds what the backend work in its scope costs to `costs` (move_costs): the backend's calls,
/// the device handles it created, those it reused (spares the backend recycled, and handles the
/// exchange counted as served: kept by a move that finished), and the steady-clock time. The
/// handles served count as handed over in `givers` too (the moves that gave them), where given.
/// Backend: vmm_backend; Exchange: anything with handed() (handle_exchange).
template <class Backend, class Exchange>
class move_cost_meter {
 public:
  move_cost_meter(const Backend& backend, move_costs& costs, const Exchange& exchange,
                  move_costs* givers = nullptr) noexcept
      : backend_(backend), costs_(costs), exchange_(exchange), givers_(givers), calls_(backend.calls().total()),
        made_(backend.calls()[driver_call::create]), recycled_(backend.recycled_handles()),
        handed_(exchange.handed()) {}
  move_cost_meter(const move_cost_meter&) = delete;
  move_cost_meter& operator=(const move_cost_meter&) = delete;
  ~move_cost_meter() {
    const std::uint64_t handed = exchange_.handed() - handed_;
    costs_.driver_calls += backend_.calls().total() - calls_;
    costs_.handles_made += backend_.calls()[driver_call::create] - made_;
    costs_.handles_reused += backend_.recycled_handles() - recycled_ + handed;
    costs_.handed_over += handed;
    if (givers_ != nullptr) givers_->handed_over += handed;
  }

 private:
  const Backend& backend_;
  move_costs& costs_;
  const Exchange& exchange_;
  move_costs* givers_;
  std::uint64_t calls_, made_, recycled_, handed_;
  stopwatch watch_{costs_.host_ns};
};

}  // namespace glake::detail
