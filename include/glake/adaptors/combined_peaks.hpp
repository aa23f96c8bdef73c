// Combined peaks: the peak reserved of a general allocator and the pools beside it (CUDA graphs'
// private pools), each byte counted once, and the peaks that outlive a reset. Used by
// pluggable_allocator, one per device.
#pragma once

#include <algorithm>
#include <atomic>
#include <concepts>
#include <cstddef>

namespace glake {

// ---------------------------------------------------------------------------------------------
// peak_combining: how the highest general + pools reserved sum is kept. Adding the two peaks
// would count memory twice when they came apart (a model's load, then a graph's capture), so the
// sum is sampled while pools hold memory, and the general allocator says when it grew.
//
// | expression                         | returns | throws | meaning
// |------------------------------------|---------|--------|----------------------------------------
// | m.note_growth(pools)               | void    | no     | the general allocator added memory while
// |                                    |         |        | the pools held `pools` bytes (from its
// |                                    |         |        | observer, under its lock: only a flag)
// | m.take_growth()                    | bool    | no     | whether growth was noted since the last
// |                                    |         |        | call (and forgets it)
// | m.sample(pools, general)           | void    | no     | while pools != 0: raises the sampled sum
// |                                    |         |        | to general() + pools; a general() that
// |                                    |         |        | throws loses the sample
// | cm.peak(general_peak, summed_peak, | size_t  | no     | the combined peak reserved: the general
// |         summed_now)                |         |        | peak without pools, else the highest of
// |                                    |         |        | it, the samples and the sum now, never
// |                                    |         |        | above the sum of the peaks
// | m.reset(active_peak, reserved_peak,| void    | no     | peaks restart at `now`; the old ones
// |         now)                       |         |        | stay in the lifetime peaks
// | cm.lifetime_active(current)        | size_t  | no     | the highest active peak across resets
// | cm.lifetime_reserved(current)      | size_t  | no     | the same for reserved
// Thread safety: every member may be called concurrently (relaxed atomics: peaks, not ordering).
//
// Model: combined_peaks.
// ---------------------------------------------------------------------------------------------
template <class M>
concept peak_combining = requires(M& m, const M& cm, std::size_t n, std::size_t (*general)()) {
  { m.note_growth(n) } noexcept -> std::same_as<void>;
  { m.take_growth() } noexcept -> std::same_as<bool>;
  { m.sample(n, general) } noexcept -> std::same_as<void>;
  { cm.peak(n, n, n) } noexcept -> std::same_as<std::size_t>;
  { m.reset(n, n, n) } noexcept -> std::same_as<void>;
  { cm.lifetime_active(n) } noexcept -> std::same_as<std::size_t>;
  { cm.lifetime_reserved(n) } noexcept -> std::same_as<std::size_t>;
};

/// The combined peak of a general allocator and its pools, and the lifetime peaks across resets.
/// Complexity: O(1) per call. Thread safety: see peak_combining.
class combined_peaks {
 public:
  void note_growth(std::size_t pools) noexcept {
    if (pools != 0) grew_.store(true, std::memory_order_relaxed);
  }

  bool take_growth() noexcept {
    return grew_.load(std::memory_order_relaxed) && grew_.exchange(false, std::memory_order_relaxed);
  }

  /// `general()` gives the general allocator's reserved bytes (it may take that allocator's
  /// lock, so it is called only while the pools hold memory).
  template <class General>
  void sample(std::size_t pools, General&& general) noexcept {
    if (pools == 0) return;
    try {
      raise(sampled_, general() + pools);
    } catch (...) {
    }  // a lock that failed: the sample is lost, the peak stays a lower bound
  }

  std::size_t peak(std::size_t general_peak, std::size_t summed_peak, std::size_t summed_now) const noexcept {
    if (summed_peak == general_peak) return general_peak;  // no pool held memory
    return std::min(summed_peak, std::max({general_peak, sampled_.load(std::memory_order_relaxed), summed_now}));
  }

  void reset(std::size_t active_peak, std::size_t reserved_peak, std::size_t now) noexcept {
    raise(lifetime_active_, active_peak);
    raise(lifetime_reserved_, reserved_peak);
    sampled_.store(now, std::memory_order_relaxed);
  }

  std::size_t lifetime_active(std::size_t current) const noexcept {
    return std::max(lifetime_active_.load(std::memory_order_relaxed), current);
  }
  std::size_t lifetime_reserved(std::size_t current) const noexcept {
    return std::max(lifetime_reserved_.load(std::memory_order_relaxed), current);
  }

 private:
  static void raise(std::atomic<std::size_t>& peak, std::size_t value) noexcept {
    std::size_t seen = peak.load(std::memory_order_relaxed);
    while (seen < value && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
    }
  }

  std::atomic<std::size_t> sampled_{0};  // the highest general + pools sum sampled since reset
  std::atomic<bool> grew_{false};        // the general allocator grew while pools held memory
  std::atomic<std::size_t> lifetime_active_{0};    // the highest peaks before the last reset
  std::atomic<std::size_t> lifetime_reserved_{0};
};
static_assert(peak_combining<combined_peaks>);

}  // namespace glake
