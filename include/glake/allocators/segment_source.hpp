// Segment sources: where a caching allocator gets the contiguous ranges it carves up, and the
// source that makes each segment from a provider and a reserver.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>
#include <algorithm>
#include <stdexcept>

#include "glake/backends/concepts.hpp"
#include "glake/detail/driver_meter.hpp"
#include "glake/detail/vmm_backend.hpp"
#include "glake/statistics.hpp"
#include "glake/stream.hpp"

namespace glake {

// ---------------------------------------------------------------------------------------------
// segment_source
//
// | expression                     | returns     | throws         | meaning
// |--------------------------------|-------------|----------------|-------------------------------
// | S::lease_type                  |             |                | movable; has members
// |                                |             |                | `std::uintptr_t base`, `std::size_t size`
// | cs.granularity()               | std::size_t | no             | segment sizes are multiples of it
// | s.try_acquire(n, stream, out)  | bool        | driver errors  | a segment of n bytes for `stream`;
// |                                |             |                | false when out of memory
// | s.release(lease)               | void        | no             | gives the segment back
//
// Optional: `cs.calls()` returning driver_call_counts and `cs.call_times()` returning
// driver_call_times, reported in the allocator's statistics; `cs.capacity()` returning the most
// bytes its segments can ever hold together (no try_acquire or try_extend beyond it succeeds),
// so that the allocator refuses a larger request at once instead of emptying its cache for it.
// ---------------------------------------------------------------------------------------------
template <class S>
concept segment_source =
    std::movable<typename S::lease_type> &&
    requires(S& s, const S& cs, std::size_t bytes, stream_ref stream, typename S::lease_type& lease) {
      { lease.base } -> std::convertible_to<std::uintptr_t>;
      { lease.size } -> std::convertible_to<std::size_t>;
      { cs.granularity() } noexcept -> std::same_as<std::size_t>;
      { s.try_acquire(bytes, stream, lease) } -> std::same_as<bool>;
      { s.release(lease) } noexcept;
    };

/// A source whose segments can grow in place: `s.try_extend(lease, n)` maps n more bytes right
/// after the lease's end (lease.size grows by n) or returns false, changing nothing. The caching
/// allocator then keeps one growing segment per stream, like PyTorch's expandable segments.
template <class S>
concept extensible_segment_source =
    segment_source<S> && requires(S& s, typename S::lease_type& lease, std::size_t bytes) {
      { s.try_extend(lease, bytes) } -> std::same_as<bool>;
    };

/// Makes every segment one physical handle mapped into its own reservation: the virtual-memory
/// equivalent of one cudaMalloc per segment. Optionally holds the physical bytes under a limit.
/// Not thread-safe; the allocator that owns it serialises access.
template <physical_provider Provider, address_reserver_for<Provider> Reserver>
class vmm_segment_source {
 public:
  using provider_type = Provider;
  using lease_type = detail::mapped_segment<typename Provider::handle_type>;

  vmm_segment_source(Provider provider, Reserver reserver, std::size_t memory_limit = 0)
      : backend_(std::move(provider), std::move(reserver), memory_limit) {}

  std::size_t granularity() const noexcept { return backend_.granularity(); }
  bool try_acquire(std::size_t bytes, stream_ref, lease_type& out) {
    const std::size_t one[] = {bytes};
    return backend_.try_create_segment(one, out);
  }
  void release(lease_type& lease) noexcept { backend_.destroy_segment(lease); }
  const driver_call_counts& calls() const noexcept { return backend_.calls(); }
  const driver_call_times& call_times() const noexcept { return backend_.call_times(); }
  std::size_t memory_limit() const noexcept { return backend_.memory_limit(); }
  std::size_t capacity() const noexcept { return backend_.capacity(); }

 private:
  detail::vmm_backend<Provider, Reserver> backend_;
};

}  // namespace glake

namespace glake {

/// PyTorch's expandable segments: each segment reserves a large virtual range up front and maps
/// `page`-sized physical handles into it as it grows (one create and map per page, one
/// set-access per growth). Freed pages stay mapped until the whole segment is released.
/// Not thread-safe; the allocator that owns it serialises access.
template <physical_provider Provider, address_reserver_for<Provider> Reserver>
class expandable_segment_source {
 public:
  using provider_type = Provider;
  using handle_type = typename Provider::handle_type;
  struct lease_type {
    std::uintptr_t base = 0;
    std::size_t size = 0;      ///< mapped bytes, from base
    std::size_t reserved = 0;  ///< virtual bytes reserved
    std::vector<handle_type> pages;
  };

  expandable_segment_source(Provider provider, Reserver reserver, std::size_t page,
                            std::size_t virtual_size, std::size_t memory_limit = 0)
      : provider_(std::move(provider)),
        reserver_(std::move(reserver)),
        page_(page),
        virtual_size_(virtual_size),
        limit_(memory_limit) {
    const std::size_t g = std::max(provider_.granularity(), reserver_.granularity());
    if (page_ == 0 || page_ % g != 0 || virtual_size_ % page_ != 0) {
      throw std::invalid_argument(
          "expandable_segment_source: page must be a multiple of the granularity and "
          "virtual_size a multiple of page");
    }
  }

  std::size_t granularity() const noexcept { return page_; }
  std::size_t memory_limit() const noexcept { return limit_; }
  /// No segment maps more than virtual_size, nor all of them more than the limit or the
  /// provider's capacity.
  std::size_t capacity() const noexcept { return capacity_within(provider_, limit_, virtual_size_); }
  const driver_call_counts& calls() const noexcept { return meter_.counts(); }
  const driver_call_times& call_times() const noexcept { return meter_.times(); }

  bool try_acquire(std::size_t bytes, stream_ref, lease_type& out) {
    if (bytes > virtual_size_) return false;
    void* base = meter_(driver_call::reserve, [&] { return reserver_.try_reserve(virtual_size_); });
    if (base == nullptr) return false;
    lease_type lease;
    lease.base = reinterpret_cast<std::uintptr_t>(base);
    lease.reserved = virtual_size_;
    try {
      if (!try_extend(lease, bytes)) {
        free_range(base, virtual_size_);
        return false;
      }
    } catch (...) {
      free_range(base, virtual_size_);
      throw;
    }
    out = std::move(lease);
    return true;
  }

  bool try_extend(lease_type& lease, std::size_t bytes) {
    // Written as differences: a sum could wrap and let a huge request through.
    if (bytes % page_ != 0 || bytes > lease.reserved - lease.size) return false;
    if (limit_ != 0 && bytes > limit_ - physical_) return false;
    const std::size_t first = lease.pages.size(), count = bytes / page_;
    lease.pages.reserve(first + count);
    std::size_t created = 0, mapped = 0;
    auto at = [&](std::size_t i) { return reinterpret_cast<void*>(lease.base + (first + i) * page_); };
    auto undo = [&]() noexcept {
      for (std::size_t i = mapped; i-- > 0;) unmap(at(i));
      for (std::size_t i = created; i-- > 0;) release(lease.pages[first + i]);
      lease.pages.resize(first);
    };
    try {
      for (; created < count; ++created) {
        auto h = meter_(driver_call::create, [&] { return provider_.try_create(page_); });
        if (!h) return undo(), false;
        lease.pages.push_back(*h);
      }
      for (; mapped < count; ++mapped) {
        const auto& page = lease.pages[first + mapped];
        const bool ok = meter_(driver_call::map, [&] { return reserver_.try_map(at(mapped), page_, page); });
        if (!ok) return undo(), false;
      }
      const bool ok = meter_(driver_call::set_access, [&] { return reserver_.try_set_access(at(0), bytes); });
      if (!ok) return undo(), false;
    } catch (...) {
      undo();
      throw;
    }
    lease.size += bytes;
    physical_ += bytes;
    return true;
  }

  void release(lease_type& lease) noexcept {
    for (std::size_t i = 0; i < lease.pages.size(); ++i) {
      unmap(reinterpret_cast<void*>(lease.base + i * page_));
    }
    free_range(reinterpret_cast<void*>(lease.base), lease.reserved);
    for (auto& h : lease.pages) release(h);
    physical_ -= lease.size;
    lease = lease_type{};
  }

 private:
  void unmap(void* at) noexcept {
    meter_(driver_call::unmap, [&]() noexcept { reserver_.unmap(at, page_); });
  }
  void free_range(void* base, std::size_t bytes) noexcept {
    meter_(driver_call::address_free, [&]() noexcept { reserver_.free(base, bytes); });
  }
  void release(handle_type& handle) noexcept {
    meter_(driver_call::release, [&]() noexcept { provider_.release(handle); });
  }

  Provider provider_;
  Reserver reserver_;
  std::size_t page_;
  std::size_t virtual_size_;
  std::size_t limit_;
  std::size_t physical_ = 0;
  detail::driver_meter meter_;
};

}  // namespace glake
