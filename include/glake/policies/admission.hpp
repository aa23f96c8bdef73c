// Stitch admission: whether the stitching allocator may stitch for a request, reuse or repair a
// cached stitched range, at which rung of its ladder, and whether new memory may make up a
// shortfall. The stitching strategy (policies/stitching.hpp) then decides which blocks.
#pragma once

#include <concepts>
#include <cstddef>

#include "glake/config.hpp"

namespace glake {

// ---------------------------------------------------------------------------------------------
// stitch_admission
//
// | expression              | returns     | throws       | meaning
// |-------------------------|-------------|--------------|---------------------------------------
// | A(cfg)                  |             | config_error | the rules for these settings
// | A::enabled              | bool        |              | constant; false: the allocator never
// |                         | (constexpr) |              | stitches and keeps no stitch cache
// | ca.may_reuse()          | bool        | no           | a cached range may serve a request
// |                         |             |              | whose chunks in it are all free
// | ca.reuse_bound(n)       | double      | no           | the largest cached range that may serve
// |                         |             |              | n bytes (reused, repaired or grown)
// | ca.may_stitch(n)        | bool        | no           | a request of n bytes (rounded) may be
// |                         |             |              | served by a new stitch or by repairing
// |                         |             |              | or growing a cached range
// | ca.repair_budget(n)     | std::size_t | no           | a cached range is repaired or grown for
// |                         |             |              | n bytes only when fewer bytes than this
// |                         |             |              | are mapped anew (0: never)
// | ca.stitch_on_rung(k)    | bool        | no           | a new stitch is tried at rung k of the
// |                         |             |              | ladder: 0 before anything is reclaimed,
// |                         |             |              | 1 after cached ranges and free segments
// |                         |             |              | are released for the request, 2 after
// |                         |             |              | everything free is released
// | ca.grow_shortfall()     | bool        | no           | when free blocks fall short, new memory
// |                         |             |              | is made only for the shortfall and
// |                         |             |              | stitched with them (GMLake's reAlloc)
// ---------------------------------------------------------------------------------------------
template <class A>
concept stitch_admission =
    std::constructible_from<A, const config&> && requires(const A& ca, std::size_t bytes, int rung) {
      { A::enabled } -> std::convertible_to<bool>;
      { ca.may_reuse() } noexcept -> std::same_as<bool>;
      { ca.reuse_bound(bytes) } noexcept -> std::same_as<double>;
      { ca.may_stitch(bytes) } noexcept -> std::same_as<bool>;
      { ca.repair_budget(bytes) } noexcept -> std::same_as<std::size_t>;
      { ca.stitch_on_rung(rung) } noexcept -> std::same_as<bool>;
      { ca.grow_shortfall() } noexcept -> std::same_as<bool>;
    };

/// GMLake's rules with its knobs from config: `stitching` (vmmDefragment), `frag_limit`
/// (fragLimit), `reuse_limit` (reuseLimit), `defrag_level` (defragLevel) and `grow_stitch`
/// (reAlloc); a cached range is repaired or grown when at most half the request is mapped anew.
class gmlake_admission {
 public:
  static constexpr bool enabled = true;

  explicit gmlake_admission(const config& cfg) noexcept
      : stitching_(cfg.stitching), grow_(cfg.grow_stitch), defrag_level_(cfg.defrag_level),
        frag_limit_(cfg.frag_limit), reuse_limit_(cfg.reuse_limit) {}

  bool may_reuse() const noexcept { return stitching_; }
  double reuse_bound(std::size_t bytes) const noexcept { return static_cast<double>(bytes) * reuse_limit_; }
  bool may_stitch(std::size_t bytes) const noexcept { return stitching_ && bytes >= frag_limit_; }
  std::size_t repair_budget(std::size_t bytes) const noexcept { return bytes / 2 + 1; }
  bool stitch_on_rung(int rung) const noexcept { return rung >= defrag_level_; }
  bool grow_shortfall() const noexcept { return grow_; }

 private:
  bool stitching_;
  bool grow_;
  int defrag_level_;
  std::size_t frag_limit_;
  double reuse_limit_;
};
static_assert(stitch_admission<gmlake_admission>);

/// Never stitches: the stitching allocator is then a caching allocator over chunks, with no stitch
/// cache compiled in.
struct never_stitch {
  static constexpr bool enabled = false;

  explicit never_stitch(const config&) noexcept {}
  bool may_reuse() const noexcept { return false; }
  double reuse_bound(std::size_t) const noexcept { return 0.0; }
  bool may_stitch(std::size_t) const noexcept { return false; }
  std::size_t repair_budget(std::size_t) const noexcept { return 0; }
  bool stitch_on_rung(int) const noexcept { return false; }
  bool grow_shortfall() const noexcept { return false; }
};
static_assert(stitch_admission<never_stitch>);

}  // namespace glake
