// Stitch admission (policies/admission.hpp) and the never_stitches trait of stitching strategies
// (policies/stitching.hpp): a conformance suite over every admission, then each knob of
// gmlake_admission.
#include <doctest/doctest.h>

#include <cstddef>
#include <limits>

#include "glake/policies/admission.hpp"
#include "glake/policies/stitching.hpp"

namespace {

using namespace glake;
constexpr std::size_t M = MiB;

// Not models: a member that may throw; no `enabled`; no constructor from a config.
struct throwing_stitch_check {
  static constexpr bool enabled = true;
  explicit throwing_stitch_check(const config&) {}
  bool may_reuse() const noexcept { return true; }
  double reuse_bound(std::size_t) const noexcept { return 0; }
  bool may_stitch(std::size_t) const { return true; }
  std::size_t repair_budget(std::size_t) const noexcept { return 0; }
  bool stitch_on_rung(int) const noexcept { return true; }
  bool grow_shortfall() const noexcept { return false; }
};
struct no_enabled {
  explicit no_enabled(const config&) {}
  bool may_reuse() const noexcept { return true; }
  double reuse_bound(std::size_t) const noexcept { return 0; }
  bool may_stitch(std::size_t) const noexcept { return true; }
  std::size_t repair_budget(std::size_t) const noexcept { return 0; }
  bool stitch_on_rung(int) const noexcept { return true; }
  bool grow_shortfall() const noexcept { return false; }
};
struct no_config {
  static constexpr bool enabled = true;
  bool may_reuse() const noexcept { return true; }
  double reuse_bound(std::size_t) const noexcept { return 0; }
  bool may_stitch(std::size_t) const noexcept { return true; }
  std::size_t repair_budget(std::size_t) const noexcept { return 0; }
  bool stitch_on_rung(int) const noexcept { return true; }
  bool grow_shortfall() const noexcept { return false; }
};

static_assert(stitch_admission<gmlake_admission>);
static_assert(stitch_admission<never_stitch>);
static_assert(!stitch_admission<throwing_stitch_check>);
static_assert(!stitch_admission<no_enabled>);
static_assert(!stitch_admission<no_config>);

// A strategy that declares nothing, and one that declares it does stitch.
struct undeclared_strategy {
  bool plan(const stitch_request&, std::span<const std::size_t>, stitch_plan&) const { return false; }
};
struct declares_stitching {
  static constexpr bool never_stitches = false;
  bool plan(const stitch_request&, std::span<const std::size_t>, stitch_plan&) const { return false; }
};

static_assert(never_stitches<no_stitching>);
static_assert(!never_stitches<best_fit_tail_stitching>);
static_assert(!never_stitches<largest_first_stitching>);
static_assert(!never_stitches<undeclared_strategy>);
static_assert(!never_stitches<declares_stitching>);

}  // namespace

TEST_CASE_TEMPLATE("stitch admission conformance: a disabled admission admits nothing, an enabled one follows its config",
                   A, gmlake_admission, never_stitch) {
  config cfg;
  cfg.frag_limit = 0;
  cfg.defrag_level = 0;
  cfg.grow_stitch = true;
  const A admission(cfg);
  if constexpr (A::enabled) {
    CHECK(admission.may_reuse());
    CHECK(admission.may_stitch(2 * M));
    CHECK(admission.stitch_on_rung(0));
    CHECK(admission.reuse_bound(2 * M) >= 2.0 * M);
    CHECK(admission.repair_budget(2 * M) > 0);
    CHECK(admission.grow_shortfall());
  } else {
    CHECK_FALSE(admission.may_reuse());
    CHECK_FALSE(admission.may_stitch(2 * M));
    CHECK_FALSE(admission.stitch_on_rung(0));
    CHECK(admission.repair_budget(2 * M) == 0);
    CHECK_FALSE(admission.grow_shortfall());
  }
}

TEST_CASE("gmlake_admission: may_stitch from frag_limit on, and never with stitching off") {
  config cfg;
  cfg.frag_limit = 64 * M;
  const gmlake_admission admission(cfg);
  CHECK(gmlake_admission::enabled);
  CHECK(admission.may_stitch(64 * M));  // at the limit exactly
  CHECK(admission.may_stitch(64 * M + 1));
  CHECK(admission.may_stitch(1 * GiB));
  CHECK_FALSE(admission.may_stitch(64 * M - 1));
  CHECK_FALSE(admission.may_stitch(0));
  CHECK(admission.may_reuse());

  cfg.frag_limit = 0;
  CHECK(gmlake_admission(cfg).may_stitch(0));

  cfg.stitching = false;
  const gmlake_admission off(cfg);
  CHECK_FALSE(off.may_stitch(64 * M));
  CHECK_FALSE(off.may_stitch(1 * GiB));
  CHECK_FALSE(off.may_reuse());
  CHECK(gmlake_admission::enabled);  // a run-time knob: the machinery stays compiled in
}

TEST_CASE("gmlake_admission: reuse_bound is the request times reuse_limit") {
  config cfg;
  cfg.reuse_limit = 10.0;
  CHECK(gmlake_admission(cfg).reuse_bound(4 * M) == doctest::Approx(40.0 * M));
  cfg.reuse_limit = 1.0;
  CHECK(gmlake_admission(cfg).reuse_bound(4 * M) == doctest::Approx(4.0 * M));
  cfg.reuse_limit = 1.5;
  CHECK(gmlake_admission(cfg).reuse_bound(4 * M) == doctest::Approx(6.0 * M));
  // In double, so that a huge request times the limit does not wrap.
  cfg.reuse_limit = 10.0;
  const std::size_t most = std::numeric_limits<std::size_t>::max();
  CHECK(gmlake_admission(cfg).reuse_bound(most) > static_cast<double>(most));
}

TEST_CASE("gmlake_admission: a cached range is repaired when at most half the request is mapped anew") {
  const gmlake_admission admission(config{});
  CHECK(admission.repair_budget(0) == 1);
  CHECK(admission.repair_budget(1) == 1);
  CHECK(admission.repair_budget(2 * M) == 1 * M + 1);
  CHECK(admission.repair_budget(6 * M) == 3 * M + 1);
  CHECK(admission.repair_budget(7) == 4);
  // "fewer bytes than this": exactly half is still admitted, one byte more is not.
  const std::size_t n = 10 * M;
  CHECK(n / 2 < admission.repair_budget(n));
  CHECK_FALSE(n / 2 + 1 < admission.repair_budget(n));
}

TEST_CASE("gmlake_admission: new stitches from the defrag_level rung on, grow_shortfall from grow_stitch") {
  config cfg;
  for (int level = 0; level <= 2; ++level) {
    cfg.defrag_level = level;
    const gmlake_admission admission(cfg);
    CAPTURE(level);
    for (int rung = 0; rung <= 2; ++rung) CHECK(admission.stitch_on_rung(rung) == (rung >= level));
  }
  cfg.grow_stitch = false;
  CHECK_FALSE(gmlake_admission(cfg).grow_shortfall());
  cfg.grow_stitch = true;
  CHECK(gmlake_admission(cfg).grow_shortfall());
}

TEST_CASE("never_stitch: says no to everything, whatever the config") {
  config cfg;
  cfg.stitching = true;
  cfg.frag_limit = 0;
  cfg.reuse_limit = 64;
  cfg.grow_stitch = true;
  const never_stitch admission(cfg);
  static_assert(!never_stitch::enabled);
  CHECK_FALSE(never_stitch::enabled);
  CHECK_FALSE(admission.may_reuse());
  CHECK(admission.reuse_bound(1 * GiB) == 0.0);
  for (std::size_t n : {std::size_t{0}, 2 * M, 1 * GiB}) {
    CHECK_FALSE(admission.may_stitch(n));
    CHECK(admission.repair_budget(n) == 0);
  }
  for (int rung = 0; rung <= 2; ++rung) CHECK_FALSE(admission.stitch_on_rung(rung));
  CHECK_FALSE(admission.grow_shortfall());
}

TEST_CASE("never_stitches: true only for strategies that declare it") {
  CHECK(never_stitches<no_stitching>);
  CHECK_FALSE(never_stitches<best_fit_tail_stitching>);
  CHECK_FALSE(never_stitches<largest_first_stitching>);
  CHECK_FALSE(never_stitches<declares_stitching>);
  // no_stitching's plans agree with its declaration.
  stitch_plan plan;
  const std::size_t sizes[] = {4 * M, 2 * M};
  CHECK_FALSE(no_stitching{}.plan(stitch_request{6 * M, 2 * M, true}, sizes, plan));
}
