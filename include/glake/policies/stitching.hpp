// Stitching strategies: which free blocks to map side by side into one new virtual range for a
// request no single free block can serve, and how much new physical memory to add to them.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace glake {

/// What the allocator asks a stitching strategy.
struct stitch_request {
  std::size_t bytes = 0;  ///< the request, rounded to `unit`
  std::size_t unit = 0;   ///< physical handle size: blocks are taken in multiples of it
  bool may_grow = false;  ///< the plan may include new physical memory for a shortfall
};

/// A strategy's answer: which candidates to stitch, in order, and how many new bytes to create
/// and append. The allocator takes each picked block whole, except that it trims the last one so
/// the total is exactly the request.
struct stitch_plan {
  std::vector<std::uint32_t> picks;  ///< indices into the candidate list, in stitch order
  std::size_t grow_bytes = 0;        ///< new physical memory, a multiple of the unit

  void clear() noexcept {
    picks.clear();
    grow_bytes = 0;
  }
  std::size_t pieces() const noexcept { return picks.size() + (grow_bytes > 0 ? 1 : 0); }
};

// ---------------------------------------------------------------------------------------------
// stitching_strategy
//
// | expression                  | returns | throws    | meaning
// |-----------------------------|---------|-----------|---------------------------------------------
// | s.plan(req, sizes, out)     | bool    | bad_alloc | sizes: the stream's free blocks, largest
// |                             |         |           | first. True: `out` covers req.bytes with at
// |                             |         |           | least two pieces, picks distinct. False:
// |                             |         |           | do not stitch (out is then unspecified).
//
// Decisions that depend on the allocator's knobs (fragLimit, defragLevel) are made by the
// allocator before it asks; the strategy decides only which blocks.
// ---------------------------------------------------------------------------------------------
template <class S>
concept stitching_strategy = requires(S& s, const stitch_request& request,
                                      std::span<const std::size_t> sizes, stitch_plan& plan) {
  { s.plan(request, sizes, plan) } -> std::same_as<bool>;
};

/// Never stitches: the stitching allocator then behaves as a caching allocator over chunks, as
/// with the `never_stitch` admission (policies/admission.hpp), and builds no stitch cache.
struct no_stitching {
  static constexpr bool never_stitches = true;
  bool plan(const stitch_request&, std::span<const std::size_t>, stitch_plan&) const noexcept {
    return false;
  }
};
static_assert(stitching_strategy<no_stitching>);

/// True for strategies that declare they never stitch (`S::never_stitches`): an allocator can
/// then leave its stitching machinery out.
template <class S>
inline constexpr bool never_stitches = requires { requires S::never_stitches; };

/// GMLake's greedy rule: largest free blocks first until their sum covers the request; with
/// `may_grow`, all of them plus new memory for the shortfall. Fewest pieces, but it cuts the
/// largest block even when a smaller one would finish the request. O(k) for k candidates.
struct largest_first_stitching {
  bool plan(const stitch_request& request, std::span<const std::size_t> sizes,
            stitch_plan& out) const {
    out.clear();
    std::size_t sum = 0;
    for (std::uint32_t i = 0; i < sizes.size() && sum < request.bytes; ++i) {
      out.picks.push_back(i);
      sum += sizes[i];
    }
    if (sum < request.bytes) {
      if (!request.may_grow) return false;
      out.grow_bytes = request.bytes - sum;
    }
    return out.pieces() >= 2;
  }
};
static_assert(stitching_strategy<largest_first_stitching>);

/// glake's rule: largest blocks first while the remaining need exceeds each, then the smallest
/// single block that covers what is left. Same number of pieces as largest-first, but the tail
/// comes from the best-fitting block, so large free blocks stay whole for later large requests.
/// O(k + log k).
struct best_fit_tail_stitching {
  bool plan(const stitch_request& request, std::span<const std::size_t> sizes,
            stitch_plan& out) const {
    out.clear();
    std::size_t need = request.bytes;
    std::uint32_t i = 0;
    for (; i < sizes.size() && need > 0; ++i) {
      if (sizes[i] >= need) {
        // Sizes descend: the last index in [i, end) whose size still covers `need` fits best.
        auto tail = std::partition_point(sizes.begin() + i, sizes.end(),
                                         [need](std::size_t s) { return s >= need; });
        out.picks.push_back(static_cast<std::uint32_t>(tail - sizes.begin() - 1));
        need = 0;
        break;
      }
      out.picks.push_back(i);
      need -= sizes[i];
    }
    if (need > 0) {
      if (!request.may_grow) return false;
      out.grow_bytes = need;
    }
    return out.pieces() >= 2;
  }
};
static_assert(stitching_strategy<best_fit_tail_stitching>);

}  // namespace glake
