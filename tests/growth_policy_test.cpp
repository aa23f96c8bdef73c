// Growth policies (policies/growth.hpp): a conformance suite run over every model, then what
// power_of_two_growth and chunk_growth each promise.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "glake/policies/growth.hpp"

namespace {

using namespace glake;
constexpr std::size_t M = MiB;

// Not models: the reservation may throw; no constructor from (config, chunk); a plan that
// returns something.
struct throwing_reservation {
  throwing_reservation(const config&, std::size_t) {}
  void plan_handles(std::size_t, std::vector<std::size_t>&) {}
  std::size_t reservation(std::size_t n) const { return n; }
};
struct no_config_constructor {
  void plan_handles(std::size_t, std::vector<std::size_t>&) {}
  std::size_t reservation(std::size_t n) const noexcept { return n; }
};
struct plan_returns_count {
  plan_returns_count(const config&, std::size_t) {}
  std::size_t plan_handles(std::size_t, std::vector<std::size_t>&) { return 0; }
  std::size_t reservation(std::size_t n) const noexcept { return n; }
};

static_assert(growth_policy<power_of_two_growth>);
static_assert(growth_policy<chunk_growth>);
static_assert(!growth_policy<throwing_reservation>);
static_assert(!growth_policy<no_config_constructor>);
static_assert(!growth_policy<plan_returns_count>);
static_assert(!growth_policy<int>);

config with_handles(std::size_t max_handle, int min_handles = 8, double stitch_reserve = 2.0) {
  config cfg;
  cfg.max_handle = max_handle;
  cfg.min_handles = min_handles;
  cfg.stitch_reserve = stitch_reserve;
  return cfg;
}

std::size_t sum(const std::vector<std::size_t>& sizes) {
  return std::accumulate(sizes.begin(), sizes.end(), std::size_t{0});
}

}  // namespace

TEST_CASE_TEMPLATE("growth policy conformance: plans are chunk multiples summing to the segment, reservations cover it",
                   G, power_of_two_growth, chunk_growth) {
  const std::size_t chunk = 2 * M;
  G growth(with_handles(64 * M, 4, 3.0), chunk);  // plan_handles may be non-const
  std::vector<std::size_t> plan{123, 456};  // a plan replaces what the vector held
  for (std::size_t chunks : {1, 2, 3, 7, 8, 31, 32, 33, 100, 512, 1000}) {
    const std::size_t bytes = chunks * chunk;
    CAPTURE(bytes);
    growth.plan_handles(bytes, plan);
    REQUIRE_FALSE(plan.empty());
    CHECK(sum(plan) == bytes);
    CHECK(std::all_of(plan.begin(), plan.end(), [&](std::size_t h) { return h > 0 && h % chunk == 0; }));
    const std::size_t reserved = growth.reservation(bytes);
    CHECK(reserved >= bytes);
    CHECK(reserved % chunk == 0);
  }
}

TEST_CASE("power_of_two_growth: handles are chunk x 2^k, largest first, within max_handle and 1/min_handles of the segment") {
  const std::size_t chunk = 2 * M;
  for (const std::size_t max_handle : {std::size_t{0}, 2 * M, 8 * M, 64 * M, 1 * GiB}) {
    for (const int min_handles : {1, 2, 8, 16}) {
      const power_of_two_growth growth(with_handles(max_handle, min_handles), chunk);
      CHECK(growth.max_handle() == std::max(max_handle, chunk));
      std::vector<std::size_t> plan;
      for (std::size_t chunks = 1; chunks <= 600; chunks += chunks < 40 ? 1 : 37) {
        const std::size_t bytes = chunks * chunk;
        CAPTURE(max_handle);
        CAPTURE(min_handles);
        CAPTURE(bytes);
        growth.plan_handles(bytes, plan);
        CHECK(sum(plan) == bytes);
        CHECK(std::is_sorted(plan.rbegin(), plan.rend()));  // largest first
        const std::size_t share = bytes / static_cast<std::size_t>(min_handles);
        const auto each = [&](auto&& pred) { return std::all_of(plan.begin(), plan.end(), pred); };
        CHECK(each([&](std::size_t h) { return h % chunk == 0 && std::has_single_bit(h / chunk); }));
        CHECK(each([&](std::size_t h) { return h <= growth.max_handle(); }));
        // Above a share only when the share is below one chunk (then every handle is a chunk).
        CHECK(each([&](std::size_t h) { return h <= share || h == chunk; }));
        // Fewest handles for that largest size: each smaller size at most once.
        CHECK(std::adjacent_find(std::find_if(plan.begin(), plan.end(), [&](std::size_t h) { return h != plan.front(); }),
                                 plan.end()) == plan.end());
        // The largest handle is as large as the bounds allow.
        const std::size_t bound = std::max(chunk, std::min(growth.max_handle(), share));
        CHECK(plan.front() * 2 > bound);
      }
    }
  }
}

TEST_CASE("power_of_two_growth: a segment costs O(log) handles, not one per chunk") {
  const std::size_t chunk = 2 * M;
  std::vector<std::size_t> plan;

  // Capped by max_handle: one handle per max_handle.
  const power_of_two_growth capped(with_handles(8 * M, 8), chunk);
  capped.plan_handles(1 * GiB, plan);
  CHECK(plan.size() == 1 * GiB / (8 * M));  // 128, not 512 chunks
  CHECK(std::all_of(plan.begin(), plan.end(), [](std::size_t h) { return h == 8 * M; }));
  capped.plan_handles(1 * GiB - 2 * M, plan);
  CHECK(plan.size() == 127 + 2);  // 127 x 8 MiB, then 4 MiB and 2 MiB
  CHECK(plan[127] == 4 * M);
  CHECK(plan[128] == 2 * M);

  // Capped by the segment's share: between min_handles and 2 x min_handles, plus one handle per
  // smaller power of two.
  const power_of_two_growth shared(with_handles(1 * GiB, 8), chunk);
  shared.plan_handles(1 * GiB, plan);
  CHECK(plan.size() == 8);
  CHECK(plan.front() == 128 * M);
  for (std::size_t chunks = 25; chunks <= 4096; chunks = chunks * 3 + 1) {
    const std::size_t bytes = chunks * chunk;
    CAPTURE(bytes);
    shared.plan_handles(bytes, plan);
    const std::size_t log = static_cast<std::size_t>(std::bit_width(plan.front() / chunk));
    CHECK(plan.size() >= 8);
    CHECK(plan.size() <= 2 * 8 + log);
    CHECK(plan.size() < chunks);
  }
}

TEST_CASE("power_of_two_growth: max_handle must be a multiple of the chunk") {
  const std::size_t chunk = 2 * M;
  CHECK_THROWS_AS(power_of_two_growth(with_handles(5 * M), chunk), config_error);
  try {
    power_of_two_growth growth(with_handles(6 * M + 4 * KiB), chunk);
    FAIL("expected a config_error");
  } catch (const config_error& e) {
    const std::string what = e.what();
    CHECK(what.find("max_handle") != std::string::npos);
    CHECK(what.find("chunk") != std::string::npos);
  }
  // Not above the chunk: every handle is one chunk, whatever max_handle says.
  CHECK_NOTHROW(power_of_two_growth(with_handles(1 * M), chunk));
  CHECK(power_of_two_growth(with_handles(1 * M), chunk).max_handle() == chunk);
  // Any multiple of the chunk is accepted, a power-of-two multiple or not.
  CHECK(power_of_two_growth(with_handles(6 * M), chunk).max_handle() == 6 * M);
}

TEST_CASE("power_of_two_growth: a stitched range reserves stitch_reserve x its size, rounded to the chunk") {
  const std::size_t chunk = 2 * M;
  static_assert(noexcept(std::declval<const power_of_two_growth&>().reservation(std::size_t{})));

  const power_of_two_growth none(with_handles(0, 8, 1.0), chunk);
  CHECK(none.reservation(2 * M) == 2 * M);
  CHECK(none.reservation(1000 * M) == 1000 * M);

  const power_of_two_growth twice(with_handles(0, 8, 2.0), chunk);
  CHECK(twice.reservation(2 * M) == 4 * M);
  CHECK(twice.reservation(1000 * M) == 2000 * M);

  const power_of_two_growth half_again(with_handles(0, 8, 1.5), chunk);
  CHECK(half_again.reservation(2 * M) == 4 * M);   // 3 MiB rounded up to two chunks
  CHECK(half_again.reservation(6 * M) == 10 * M);  // 9 MiB rounded up to five chunks
  CHECK(half_again.reservation(8 * M) == 12 * M);

  // Overflow guard: a factor that would not fit in size_t reserves just the size.
  const power_of_two_growth huge(with_handles(0, 8, 1e30), chunk);
  CHECK(huge.reservation(2 * M) == 2 * M);
  const power_of_two_growth big(with_handles(0, 8, 64.0), chunk);
  const std::size_t large = std::numeric_limits<std::size_t>::max() / 64 / chunk * chunk;
  CHECK(big.reservation(large) == large);
  CHECK(big.reservation(2 * M) == 128 * M);
}

TEST_CASE("chunk_growth: every handle is one chunk and a stitched range reserves exactly its size") {
  const std::size_t chunk = 2 * M;
  // max_handle, min_handles and stitch_reserve are ignored, a max_handle that is no multiple too.
  const chunk_growth growth(with_handles(5 * M, 1, 4.0), chunk);
  std::vector<std::size_t> plan{7};
  growth.plan_handles(64 * M, plan);
  CHECK(plan.size() == 32);
  CHECK(std::all_of(plan.begin(), plan.end(), [&](std::size_t h) { return h == chunk; }));
  growth.plan_handles(chunk, plan);
  CHECK(plan == std::vector<std::size_t>{chunk});
  CHECK(growth.reservation(2 * M) == 2 * M);
  CHECK(growth.reservation(1 * GiB) == 1 * GiB);
  static_assert(noexcept(chunk_growth(config{}, chunk)));
}

static_assert(segment_growth_policy<power_of_two_growth>);
static_assert(!segment_growth_policy<chunk_growth>);  // GMLake's segments never grow

TEST_CASE_TEMPLATE("segment growth policy conformance: a segment's reservation covers it in whole chunks", G,
                   power_of_two_growth) {
  const std::size_t chunk = 2 * M;
  for (const std::size_t reserve : {std::size_t{0}, 3 * M, 64 * M, 1 * GiB}) {
    config cfg;
    cfg.segment_reserve = reserve;
    const G growth(cfg, chunk);
    static_assert(noexcept(growth.segment_reservation(std::size_t{})));
    for (std::size_t chunks : {1, 2, 31, 32, 33, 1000}) {
      const std::size_t bytes = chunks * chunk;
      CAPTURE(reserve);
      CAPTURE(bytes);
      const std::size_t reserved = growth.segment_reservation(bytes);
      CHECK(reserved >= bytes);
      CHECK(reserved % chunk == 0);
    }
  }
}

TEST_CASE("power_of_two_growth: a segment reserves segment_reserve in whole chunks, or just its size") {
  const std::size_t chunk = 2 * M;
  config cfg;
  CHECK(power_of_two_growth(cfg, chunk).segment_reservation(6 * M) == 6 * M);  // 0: no growth
  cfg.segment_reserve = 65 * M;
  const power_of_two_growth growth(cfg, chunk);
  CHECK(growth.segment_reservation(6 * M) == 64 * M);  // rounded down to the chunk
  CHECK(growth.segment_reservation(64 * M) == 64 * M);
  CHECK(growth.segment_reservation(80 * M) == 80 * M);  // larger than the setting: its own size
}
