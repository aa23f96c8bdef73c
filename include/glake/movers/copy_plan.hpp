// How one host<->device copy is split between the target device's own link and peer devices'
// links: a pure function from the byte count and the paths to contiguous per-path byte ranges.
#pragma once

#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "glake/errors.hpp"

namespace glake {

/// One way bytes can travel between host memory and the target device.
struct copy_path {
  /// The device whose host link carries the share: the target itself (the direct path) or a peer
  /// that stages its share in its own memory and forwards it over the peer link (NVLink).
  int via = 0;
  /// Relative bandwidth of the path (bytes per second, or any unit common to all paths); > 0 to
  /// be used, 0 to leave the path out.
  double weight = 1.0;
  /// The least share worth sending this way (a peer path costs two copies and a stream wait);
  /// a path whose share would be smaller is dropped and its bytes go to the others.
  std::size_t min_bytes = 0;
};

/// One path's contiguous part of a copy: bytes [offset, offset + bytes) of the copy.
struct copy_share {
  std::size_t path = 0;  ///< index into the paths the plan was made from
  int via = 0;           ///< that path's device
  std::size_t offset = 0;
  std::size_t bytes = 0;
  friend constexpr bool operator==(const copy_share&, const copy_share&) noexcept = default;
};

/// The shares of one copy, in offset order, none empty; together they cover [0, bytes) once.
struct copy_plan {
  std::size_t bytes = 0;
  std::vector<copy_share> shares;
};

// ---------------------------------------------------------------------------------------------
// plan_copy
//
// plan_copy(n, target, paths, alignment) splits [0, n) among the paths in their order. Path i's
// ideal share is n * w_i / W (W: the sum of the weights of the paths in use); the boundary after
// path i is the ideal cumulative boundary rounded to the nearest multiple of `alignment` (or to
// n, when n is nearer), so every share but the last starts and ends on an alignment multiple and
// differs from its ideal by at most one alignment unit. A path whose share comes out below its
// min_bytes is dropped (of those, the one of least weight, the later on a tie) and the split is
// made again without it; when every path in use is below its minimum, the path of greatest
// weight (the first on a tie) takes all n bytes. Paths of weight 0 are never used. Empty shares
// are left out, so n == 0 gives no share.
//
// Errors (config_error, before any work): no path; alignment 0 or not a power of two; a weight
// negative, NaN or infinite; no weight positive; a path via the target other than the first, or
// two paths via the same device.
// Complexity: O(p^2) for p paths (at most p splits of O(p)). Pure: no state, thread-safe.
// ---------------------------------------------------------------------------------------------
inline copy_plan plan_copy(std::size_t bytes, int target, std::span<const copy_path> paths, std::size_t alignment) {
  auto fail = [](const std::string& what) { throw config_error("glake::plan_copy: " + what); };
  if (paths.empty()) fail("no path");
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    fail("alignment " + std::to_string(alignment) + " is not a power of two");
  }
  bool any = false;
  for (std::size_t i = 0; i < paths.size(); ++i) {
    const double w = paths[i].weight;
    if (!std::isfinite(w) || w < 0) fail("path " + std::to_string(i) + " has weight " + std::to_string(w));
    any = any || w > 0;
    if (paths[i].via == target && i != 0) {
      fail("path " + std::to_string(i) + " goes via the target device " + std::to_string(target) +
           "; only the first path may be direct");
    }
    for (std::size_t j = 0; j < i; ++j) {
      if (paths[j].via == paths[i].via) {
        fail("paths " + std::to_string(j) + " and " + std::to_string(i) + " both go via device " +
             std::to_string(paths[i].via));
      }
    }
  }
  if (!any) fail("every path has weight 0");

  copy_plan plan;
  plan.bytes = bytes;
  if (bytes == 0) return plan;

  std::vector<bool> used(paths.size());
  for (std::size_t i = 0; i < paths.size(); ++i) used[i] = paths[i].weight > 0;
  std::vector<std::size_t> share(paths.size());

  // The nearest of the multiples of `alignment` in [0, n] and n itself; ties go down.
  const auto round_boundary = [&](long double ideal) -> std::size_t {
    if (ideal <= 0) return 0;
    if (ideal >= static_cast<long double>(bytes)) return bytes;
    const auto below = static_cast<std::size_t>(ideal) / alignment * alignment;
    const std::size_t above = bytes - below > alignment ? below + alignment : bytes;
    return ideal - static_cast<long double>(below) <= static_cast<long double>(above) - ideal ? below : above;
  };
  for (;;) {
    long double total = 0;
    for (std::size_t i = 0; i < paths.size(); ++i) {
      if (used[i]) total += paths[i].weight;
    }
    long double cumulative = 0;
    std::size_t start = 0;
    std::size_t last_used = 0;
    for (std::size_t i = 0; i < paths.size(); ++i) {
      share[i] = 0;
      if (!used[i]) continue;
      cumulative += paths[i].weight;
      const std::size_t end = round_boundary(static_cast<long double>(bytes) * cumulative / total);
      share[i] = end - start;
      start = end;
      last_used = i;
    }
    share[last_used] += bytes - start;  // rounding of the sum; normally nothing

    std::size_t drop = paths.size();  // the path to drop: under its minimum, least weight
    std::size_t in_use = 0;
    for (std::size_t i = 0; i < paths.size(); ++i) {
      if (!used[i]) continue;
      ++in_use;
      if (share[i] < paths[i].min_bytes && (drop == paths.size() || paths[i].weight <= paths[drop].weight)) drop = i;
    }
    if (drop == paths.size()) break;
    if (in_use == 1) break;  // the only path left takes everything
    bool all_under = true;
    for (std::size_t i = 0; i < paths.size(); ++i) {
      if (used[i] && share[i] >= paths[i].min_bytes) all_under = false;
    }
    if (all_under) {
      std::size_t best = paths.size();
      for (std::size_t i = 0; i < paths.size(); ++i) {
        if (used[i] && (best == paths.size() || paths[i].weight > paths[best].weight)) best = i;
      }
      for (std::size_t i = 0; i < paths.size(); ++i) share[i] = i == best ? bytes : 0;
      break;
    }
    used[drop] = false;
  }

  std::size_t offset = 0;
  for (std::size_t i = 0; i < paths.size(); ++i) {
    if (share[i] == 0) continue;
    plan.shares.push_back(copy_share{i, paths[i].via, offset, share[i]});
    offset += share[i];
  }
  return plan;
}

}  // namespace glake
