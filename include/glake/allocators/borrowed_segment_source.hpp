// A segment source that borrows its segments from another allocator's pool: how the stitching
// allocator's small pool (a caching_allocator) gets its segments and gives empty ones back.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "glake/allocators/segment_source.hpp"
#include "glake/stream.hpp"

namespace glake {

// ---------------------------------------------------------------------------------------------
// segment_lender
//
// | expression                  | returns     | throws        | meaning
// |-----------------------------|-------------|---------------|-----------------------------------
// | cl.lending_granularity()    | std::size_t | no            | lent sizes are multiples of it
// | l.lend(n, stream, base)     | bool        | driver errors | lends n bytes for `stream` at
// |                             |             |               | `base`; false when out of memory
// | l.take_back(base)           | void        | no            | the range lent at `base` is
// |                             |             |               | returned, free
// ---------------------------------------------------------------------------------------------
template <class L>
concept segment_lender = std::copyable<L> && requires(L& l, const L& cl, std::size_t bytes, stream_ref stream,
                                                      std::uintptr_t& base, std::uintptr_t address) {
  { cl.lending_granularity() } noexcept -> std::same_as<std::size_t>;
  { l.lend(bytes, stream, base) } -> std::same_as<bool>;
  { l.take_back(address) } noexcept;
};

/// Each segment is a range lent by `Lender`; releasing it gives the range back. O(1) on top of
/// the lender's cost. Thread safety and streams: the lender's.
template <segment_lender Lender>
class borrowed_segment_source {
 public:
  struct lease_type {
    std::uintptr_t base = 0;
    std::size_t size = 0;
  };

  explicit borrowed_segment_source(Lender lender) noexcept(std::is_nothrow_move_constructible_v<Lender>)
      : lender_(std::move(lender)) {}

  std::size_t granularity() const noexcept { return lender_.lending_granularity(); }
  bool try_acquire(std::size_t bytes, stream_ref stream, lease_type& out) {
    std::uintptr_t base = 0;
    if (!lender_.lend(bytes, stream, base)) return false;
    out.base = base;
    out.size = bytes;
    return true;
  }
  void release(lease_type& lease) noexcept { lender_.take_back(lease.base); }

 private:
  Lender lender_;
};

namespace detail {
/// The smallest lender, for the concept checks.
struct lender_probe {
  std::size_t lending_granularity() const noexcept { return 1; }
  bool lend(std::size_t, stream_ref, std::uintptr_t&) { return false; }
  void take_back(std::uintptr_t) noexcept {}
};
}  // namespace detail
static_assert(segment_lender<detail::lender_probe>);
static_assert(segment_source<borrowed_segment_source<detail::lender_probe>>);

}  // namespace glake
