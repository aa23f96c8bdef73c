// Segment sources: where a caching allocator gets the contiguous ranges it carves up, and the
// source that makes each segment from a provider and a reserver.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "glake/backends/concepts.hpp"
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
// Optional: `cs.calls()` returning driver_call_counts, reported in the allocator's statistics.
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

/// Makes every segment one physical handle mapped into its own reservation: the virtual-memory
/// equivalent of one cudaMalloc per segment. Optionally holds the physical bytes under a limit.
/// Not thread-safe; the allocator that owns it serialises access.
template <physical_provider Provider, address_reserver_for<Provider> Reserver>
class vmm_segment_source {
 public:
  using lease_type = detail::mapped_segment<typename Provider::handle_type>;

  vmm_segment_source(Provider provider, Reserver reserver, std::size_t memory_limit = 0)
      : backend_(std::move(provider), std::move(reserver), memory_limit) {}

  std::size_t granularity() const noexcept { return backend_.granularity(); }
  bool try_acquire(std::size_t bytes, stream_ref, lease_type& out) {
    return backend_.try_create_segment(bytes, bytes, out);
  }
  void release(lease_type& lease) noexcept { backend_.destroy_segment(lease); }
  const driver_call_counts& calls() const noexcept { return backend_.calls(); }
  std::size_t memory_limit() const noexcept { return backend_.memory_limit(); }

 private:
  detail::vmm_backend<Provider, Reserver> backend_;
};

}  // namespace glake
