// Growth policies: how the stitching allocator cuts new physical memory into handles, and how much
// address space a new stitched range reserves so that it can later grow in place.
#pragma once

#include <concepts>
#include <cstddef>
#include <limits>
#include <string>
#include <vector>

#include "glake/config.hpp"
#include "glake/detail/accounting.hpp"
#include "glake/errors.hpp"

namespace glake {

// ---------------------------------------------------------------------------------------------
// growth_policy
//
// | expression                 | returns     | throws       | meaning
// |----------------------------|-------------|--------------|------------------------------------
// | G(cfg, chunk)              |             | config_error | the policy for these settings; chunk
// |                            |             |              | is the allocator's unit (a multiple of
// |                            |             |              | the backend's granularity)
// | g.plan_handles(n, out)     | void        | bad_alloc    | out = the handle sizes of a new
// |                            |             |              | segment of n bytes (n a multiple of
// |                            |             |              | chunk): multiples of chunk summing to
// |                            |             |              | n, in mapping order
// | cg.reservation(n)          | std::size_t | no           | address space to reserve for a new
// |                            |             |              | stitched range mapping n bytes: at
// |                            |             |              | least n, a multiple of chunk; the rest
// |                            |             |              | is room to grow the range in place
//
// Fewer, larger handles cost fewer driver calls per segment and per stitch, but a handle partly
// in use cannot be stitched, so large handles strand memory (docs/handles.md has the numbers).
// ---------------------------------------------------------------------------------------------
template <class G>
concept growth_policy =
    std::constructible_from<G, const config&, std::size_t> &&
    requires(G& g, const G& cg, std::size_t bytes, std::vector<std::size_t>& out) {
      { g.plan_handles(bytes, out) } -> std::same_as<void>;
      { cg.reservation(bytes) } noexcept -> std::same_as<std::size_t>;
    };

// ---------------------------------------------------------------------------------------------
// segment_growth_policy: a growth_policy whose segments grow in place (an optional capability)
//
// | expression                 | returns     | throws | meaning
// |----------------------------|-------------|--------|------------------------------------------
// | cg.segment_reservation(n)  | std::size_t | no     | address space to reserve for a new segment
// |                            |             |        | of n bytes: at least n, a multiple of
// |                            |             |        | chunk; above n, the segment grows in place
//
// When a stream's growing segment ends in a free block, new memory mapped after it joins that
// block, so the tail of a handle partly in use starts the next request instead of being
// stranded (PyTorch's expandable_segments; docs/stitching.md, "Segments that grow in place").
// ---------------------------------------------------------------------------------------------
template <class G>
concept segment_growth_policy = growth_policy<G> && requires(const G& cg, std::size_t bytes) {
  { cg.segment_reservation(bytes) } noexcept -> std::same_as<std::size_t>;
};

/// glake's: handles of chunk x 2^k, largest first, none above `max_handle` nor above
/// 1/`min_handles` of their segment (so a segment is min_handles to ~2 x min_handles handles
/// below max_handle, O(log) driver calls, not bytes / chunk); a stitched range reserves
/// `stitch_reserve` times its size, a segment `segment_reserve` bytes (0: segments do not grow).
/// O(log(n / chunk) + handles) per plan.
class power_of_two_growth {
 public:
  power_of_two_growth(const config& cfg, std::size_t chunk)
      : chunk_(chunk), max_handle_(largest(cfg, chunk)), min_handles_(cfg.min_handles),
        stitch_reserve_(cfg.stitch_reserve), segment_reserve_(cfg.segment_reserve) {}

  void plan_handles(std::size_t bytes, std::vector<std::size_t>& out) const {
    out.clear();
    const std::size_t share = bytes / static_cast<std::size_t>(min_handles_);
    std::size_t largest = chunk_;
    while (largest <= max_handle_ / 2 && largest <= share / 2) largest *= 2;  // no overflow
    for (std::size_t size = largest; bytes > 0;) {
      if (size <= bytes) {
        out.push_back(size);
        bytes -= size;
      } else {
        size /= 2;
      }
    }
  }

  std::size_t reservation(std::size_t size) const noexcept {
    if (stitch_reserve_ <= 1.0) return size;
    const double want = static_cast<double>(size) * stitch_reserve_;
    if (!(want < static_cast<double>(std::numeric_limits<std::size_t>::max() / 2))) return size;
    const std::size_t rounded = detail::round_up(static_cast<std::size_t>(want), chunk_);
    return rounded > size ? rounded : size;
  }

  /// Address space for a new segment of `size` bytes: `segment_reserve` (whole chunks) when
  /// larger, so that the segment grows in place; else `size`.
  std::size_t segment_reservation(std::size_t size) const noexcept {
    const std::size_t want = segment_reserve_ / chunk_ * chunk_;
    return want > size ? want : size;
  }

  std::size_t max_handle() const noexcept { return max_handle_; }

 private:
  static std::size_t largest(const config& cfg, std::size_t chunk) {
    if (cfg.max_handle == 0 || cfg.max_handle <= chunk) return chunk;
    if (cfg.max_handle % chunk != 0) {
      throw config_error("glake config: max_handle (" + format_bytes(cfg.max_handle) +
                         ") must be a multiple of the chunk size (" + format_bytes(chunk) + ")");
    }
    return cfg.max_handle;
  }

  std::size_t chunk_;
  std::size_t max_handle_;
  int min_handles_;
  double stitch_reserve_;
  std::size_t segment_reserve_;
};
static_assert(segment_growth_policy<power_of_two_growth>);

/// GMLake's: every handle is one chunk and a stitched range reserves exactly what it maps, so
/// cached ranges never grow in place. `max_handle`, `min_handles` and `stitch_reserve` are
/// ignored. O(n / chunk) per plan.
class chunk_growth {
 public:
  chunk_growth(const config&, std::size_t chunk) noexcept : chunk_(chunk) {}

  void plan_handles(std::size_t bytes, std::vector<std::size_t>& out) const {
    out.assign(bytes / chunk_, chunk_);
  }
  std::size_t reservation(std::size_t size) const noexcept { return size; }

 private:
  std::size_t chunk_;
};
static_assert(growth_policy<chunk_growth>);
static_assert(!segment_growth_policy<chunk_growth>);

}  // namespace glake
