// The segregator: requests up to a threshold go to one allocator, larger ones to another.
#pragma once

#include <algorithm>
#include <cstddef>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "glake/allocators/capabilities.hpp"
#include "glake/allocators/concepts.hpp"
#include "glake/detail/accounting.hpp"
#include "glake/detail/archetypes.hpp"
#include "glake/errors.hpp"
#include "glake/policies/locking.hpp"
#include "glake/statistics.hpp"
#include "glake/stream.hpp"

namespace glake {

/// A segregator sends requests of at most `threshold` bytes to Small and the rest to Large; a
/// free goes where its size says the allocation went. This is how PyTorch keeps small tensors
/// (2 MiB segments) apart from large ones, and how GMLake puts its stitching pool beside
/// PyTorch's small pool. Both parts are built in place (they are not movable).
///
/// Optional capabilities (allocators/concepts.hpp) are forwarded by forward_capabilities
/// (capabilities.hpp) when both parts have them: owns asks both; release_cached and the other
/// broadcasts go to both; record_stream, offload and the other calls that name a pointer but no
/// size go to the part that owns it, so they need owns of both parts as well. reset_peaks is the
/// segregator's own (its peaks are of the sum). A capability that only one part has is not
/// offered: the segregator could not honour it for the other part's pointers.
///
/// Complexity: one comparison over the parts' own (record_stream: the parts' owns). Thread
/// safety: as the Lock policy, one lock around both parts (give the parts no_lock). Streams and
/// errors: the parts'. Statistics add the parts' event counts and reserved bytes; active bytes
/// and peaks are the segregator's own, so a peak is the peak of the sum, not the sum of the
/// peaks.
template <allocator Small, allocator Large, lock_policy Lock = no_lock>
class segregator : public forward_capabilities<segregator<Small, Large, Lock>, Small, Large> {
  friend class forward_capabilities<segregator, Small, Large>;

 public:
  using small_type = Small;
  using large_type = Large;
  template <class... SmallArgs, class... LargeArgs>
  segregator(std::size_t threshold, std::tuple<SmallArgs...> small_args, std::tuple<LargeArgs...> large_args)
      : threshold_(threshold),
        small_(std::make_from_tuple<Small>(std::move(small_args))),
        large_(std::make_from_tuple<Large>(std::move(large_args))) {}
  segregator(const segregator&) = delete;
  segregator& operator=(const segregator&) = delete;

  void* allocate(std::size_t bytes, stream_ref stream = default_stream) {
    std::lock_guard guard(lock_);
    if (bytes == 0) return nullptr;
    void* p = part_for(bytes, [&](auto& part) { return part.allocate(bytes, stream); });
    after_allocate(bytes);
    return p;
  }

  void* try_allocate(std::size_t bytes, stream_ref stream = default_stream) {
    std::lock_guard guard(lock_);
    if (bytes == 0) return nullptr;
    void* p = part_for(bytes, [&](auto& part) { return part.try_allocate(bytes, stream); });
    if (p != nullptr) after_allocate(bytes);
    return p;
  }

  void deallocate(void* p, std::size_t bytes, stream_ref stream = default_stream) {
    std::lock_guard guard(lock_);
    if (p == nullptr) return;
    try {
      part_for(bytes, [&](auto& part) {
        part.deallocate(p, bytes, stream);
        return 0;
      });
    } catch (const usage_error& e) {
      // A size on the wrong side of the threshold looks foreign to the part it routes to; with
      // owns, the other part can say so and the error names the real mistake.
      if constexpr (owning_allocator<Small> && owning_allocator<Large>) {
        const bool other_owns = bytes <= threshold_ ? large_.owns(p) : small_.owns(p);
        if (e.which() != usage_error::kind::foreign_pointer || !other_owns) throw;
        throw usage_error(usage_error::kind::size_mismatch,
                          "glake::segregator: deallocate of " + detail::pointer_text(p) + " with size " +
                              std::to_string(bytes) + ", but it was allocated with a size on the other side of " +
                              std::to_string(threshold_) + " bytes");
      } else {
        throw;
      }
    }
    counters_.on_deallocate(bytes, 0);
    track_reserved();
  }

  statistics stats() const {
    std::lock_guard guard(lock_);
    return stats_locked();
  }

  /// The segregator's peaks and both parts' restart from the current values; returns the
  /// statistics just before, as stats() would have given them.
  statistics reset_peaks()
    requires peak_resetting_allocator<Small> && peak_resetting_allocator<Large>
  {
    std::lock_guard guard(lock_);
    const statistics before = stats_locked();
    small_.reset_peaks();
    large_.reset_peaks();
    counters_.reset_peaks();
    return before;
  }

  void verify() const {
    std::lock_guard guard(lock_);
    small_.verify();
    large_.verify();
  }

  /// Physical bytes held now by both parts.
  std::size_t reserved_bytes() const {
    std::lock_guard guard(lock_);
    return small_.reserved_bytes() + large_.reserved_bytes();
  }

  std::size_t alignment() const noexcept { return std::min(small_.alignment(), large_.alignment()); }
  /// Sets both parts' live_report (each reports its own live allocations when destroyed).
  void set_live_report(live_report report) noexcept
    requires requires(Small& s, Large& l) {
      s.set_live_report(report);
      l.set_live_report(report);
    }
  {
    small_.set_live_report(report);
    large_.set_live_report(report);
  }
  std::size_t threshold() const noexcept { return threshold_; }
  Small& small() noexcept { return small_; }
  Large& large() noexcept { return large_; }

 private:
  // What forward_capabilities needs: the parts, the lock, and the reserved bytes read again.
  std::tuple<Small&, Large&> capability_parts() noexcept { return {small_, large_}; }
  std::tuple<const Small&, const Large&> capability_parts() const noexcept { return {small_, large_}; }
  std::lock_guard<Lock> capability_guard() const { return std::lock_guard<Lock>(lock_); }
  void capabilities_changed() { track_reserved(); }

  statistics stats_locked() const {
    statistics s = small_.stats();
    accumulate(s, large_.stats());
    // The segregator's own: the calls it served, the bytes asked of it, and the peaks of the sums
    // (a sum's peak is not the parts' peaks added, nor the higher of them).
    const statistics& own = counters_.s;
    s.allocations = own.allocations;
    s.deallocations = own.deallocations;
    s.active_bytes = own.active_bytes;
    s.peak_active_bytes = own.peak_active_bytes;
    s.peak_allocated_bytes = std::max(own.peak_allocated_bytes, s.allocated_bytes);
    s.peak_reserved_bytes = own.peak_reserved_bytes;
    return s;
  }

  template <class F>
  auto part_for(std::size_t bytes, F&& f) {
    return bytes <= threshold_ ? f(small_) : f(large_);
  }

  void after_allocate(std::size_t bytes) {
    counters_.on_allocate(bytes, 0);
    track_reserved();
  }

  // The parts hold the memory; the peak of their sum is only visible from here.
  void track_reserved() {
    const std::size_t reserved = small_.reserved_bytes() + large_.reserved_bytes();
    counters_.s.reserved_bytes = reserved;
    counters_.s.peak_reserved_bytes = std::max(counters_.s.peak_reserved_bytes, reserved);
  }

  std::size_t threshold_;
  Small small_;
  Large large_;
  detail::usage_counters counters_;
  [[no_unique_address]] mutable Lock lock_;
};

// Each optional capability exactly when both parts have it.
static_assert(allocator<segregator<detail::allocator_archetype, detail::allocator_archetype>>);
static_assert(!owning_allocator<segregator<detail::allocator_archetype, detail::allocator_archetype>>);
static_assert(!cache_releasing_allocator<segregator<detail::allocator_archetype, detail::allocator_archetype>>);
static_assert(!peak_resetting_allocator<segregator<detail::allocator_archetype, detail::allocator_archetype>>);
static_assert(!stream_recording_allocator<segregator<detail::allocator_archetype, detail::allocator_archetype>>);
static_assert(owning_allocator<segregator<detail::full_allocator_archetype, detail::full_allocator_archetype>>);
static_assert(cache_releasing_allocator<segregator<detail::full_allocator_archetype, detail::full_allocator_archetype>>);
static_assert(peak_resetting_allocator<segregator<detail::full_allocator_archetype, detail::full_allocator_archetype>>);
static_assert(stream_recording_allocator<segregator<detail::full_allocator_archetype, detail::full_allocator_archetype>>);
static_assert(!owning_allocator<segregator<detail::full_allocator_archetype, detail::allocator_archetype>>);
static_assert(!stream_recording_allocator<segregator<detail::allocator_archetype, detail::full_allocator_archetype>>);
static_assert(capabilities_of_v<segregator<detail::full_allocator_archetype, detail::full_allocator_archetype>> ==
              capabilities_of_v<detail::full_allocator_archetype>);
static_assert(capabilities_of_v<segregator<detail::full_allocator_archetype, detail::allocator_archetype>> ==
              capability_set{});

}  // namespace glake
