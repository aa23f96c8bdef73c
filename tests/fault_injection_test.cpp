// The fault-injecting wrappers: which calls a plan fails, what it counts, and the rollback sweep
// they exist for.
#include <doctest/doctest.h>

#include <cstddef>
#include <optional>
#include <vector>

#include "glake/backends/fault_injection.hpp"
#include "glake/backends/host.hpp"
#include "glake/backends/sim.hpp"
#include "support/usage_kind.hpp"

namespace {

using namespace glake;

constexpr std::size_t g = 2 * MiB;

struct fixture {
  sim_device device{64 * g, g};
  fault_plan plan;
  fault_injecting_provider<sim_provider> provider{sim_provider{device}, plan};
  fault_injecting_reserver<sim_reserver> reserver{sim_reserver{device}, plan};
};

// A stitched range of `count` fresh handles, built the way an allocator must: each step either
// succeeds or the steps before it are undone, so a failure leaves the backend as it was.
struct stitched {
  void* range = nullptr;
  std::size_t bytes = 0;
  std::vector<sim_handle> handles;
};

template <class Provider, class Reserver>
std::optional<stitched> build_stitched(Provider& provider, Reserver& reserver, std::size_t count) {
  stitched result;
  result.bytes = count * g;
  std::size_t mapped = 0;
  auto roll_back = [&] {
    for (std::size_t i = mapped; i-- > 0;) {
      reserver.unmap(static_cast<std::byte*>(result.range) + i * g, g);
    }
    if (result.range != nullptr) reserver.free(result.range, result.bytes);
    for (const auto handle : result.handles) provider.release(handle);
    return std::nullopt;
  };
  for (std::size_t i = 0; i < count; ++i) {
    const auto handle = provider.try_create(g);
    if (!handle) return roll_back();
    result.handles.push_back(*handle);
  }
  result.range = reserver.try_reserve(result.bytes);
  if (result.range == nullptr) return roll_back();
  for (; mapped < count; ++mapped) {
    auto* at = static_cast<std::byte*>(result.range) + mapped * g;
    if (!reserver.try_map(at, g, result.handles[mapped])) return roll_back();
  }
  if (!reserver.try_set_access(result.range, result.bytes)) return roll_back();
  return result;
}

template <class Provider, class Reserver>
void tear_down(Provider& provider, Reserver& reserver, const stitched& s) {
  for (std::size_t i = 0; i < s.handles.size(); ++i) {
    reserver.unmap(static_cast<std::byte*>(s.range) + i * g, g);
  }
  reserver.free(s.range, s.bytes);
  for (const auto handle : s.handles) provider.release(handle);
}

void check_clean(const sim_device& device) {
  CHECK(device.live_handles() == 0);
  CHECK(device.reserved_bytes() == 0);
  CHECK(device.live_mappings() == 0);
  CHECK(device.violations() == 0);
}

}  // namespace

TEST_CASE("a plan with no rule forwards every call and counts it") {
  fixture f;
  CHECK_FALSE(f.plan.armed());
  const auto s = build_stitched(f.provider, f.reserver, 3);
  REQUIRE(s.has_value());
  CHECK(f.device.resolve(s->range)->accessible);
  tear_down(f.provider, f.reserver, *s);
  check_clean(f.device);
  CHECK(f.plan.faults_injected() == 0);
  CHECK(f.plan.calls() == f.device.calls());
  CHECK(f.plan.calls()[driver_call::create] == 3);
  CHECK(f.plan.calls()[driver_call::release] == 3);
  CHECK(f.plan.fallible_calls() == 3 + 1 + 3 + 1);
  CHECK(f.provider.granularity() == g);
  CHECK(f.provider.location() == memory_location::simulated);
  CHECK(&f.provider.upstream().device() == &f.device);
  CHECK(&f.reserver.plan() == &f.plan);
}

TEST_CASE("fail_nth_call fails the nth fallible call from now, without calling the backend") {
  fixture f;
  const auto first = f.provider.try_create(g);  // before the rule: not counted towards n
  REQUIRE(first.has_value());
  f.plan.fail_nth_call(3);
  CHECK(f.plan.armed());
  void* range = f.reserver.try_reserve(2 * g);            // 1
  REQUIRE(range != nullptr);
  f.provider.release(*first);                             // noexcept: not counted towards n
  const auto second = f.provider.try_create(2 * g);       // 2
  REQUIRE(second.has_value());
  CHECK_FALSE(f.reserver.try_map(range, 2 * g, *second));  // 3: injected
  CHECK(f.device.calls()[driver_call::map] == 0);
  CHECK(f.plan.calls()[driver_call::map] == 1);
  CHECK(f.plan.faults_injected() == 1);
  CHECK_FALSE(f.plan.armed());  // one shot
  CHECK(f.reserver.try_map(range, 2 * g, *second));
  CHECK(f.reserver.try_set_access(range, 2 * g));
  CHECK(f.plan.faults_injected() == 1);
  f.reserver.unmap(range, 2 * g);
  f.reserver.free(range, 2 * g);
  f.provider.release(*second);
  check_clean(f.device);
}

TEST_CASE("fail_nth_call_of fails the nth call of one kind only") {
  fixture f;
  f.plan.fail_nth_call_of(driver_call::create, 2);
  const auto a = f.provider.try_create(g);
  void* range = f.reserver.try_reserve(g);
  const auto b = f.provider.try_create(g);
  const auto c = f.provider.try_create(g);
  CHECK(a.has_value());
  CHECK(range != nullptr);
  CHECK_FALSE(b.has_value());
  CHECK(c.has_value());
  CHECK(f.device.calls()[driver_call::create] == 2);
  CHECK(f.plan.calls()[driver_call::create] == 3);
  CHECK(f.plan.faults_injected() == 1);
  f.reserver.free(range, g);
  f.provider.release(*a);
  f.provider.release(*c);
  check_clean(f.device);
}

TEST_CASE("fail_every_call_of keeps failing until cleared, reset clears everything") {
  fixture f;
  const auto handle = f.provider.try_create(g);
  REQUIRE(handle.has_value());
  void* range = f.reserver.try_reserve(g);
  REQUIRE(range != nullptr);
  REQUIRE(f.reserver.try_map(range, g, *handle));
  f.plan.fail_every_call_of(driver_call::set_access);
  for (int i = 0; i < 5; ++i) CHECK_FALSE(f.reserver.try_set_access(range, g));
  CHECK(f.plan.armed());
  CHECK(f.plan.faults_injected() == 5);
  CHECK(f.device.calls()[driver_call::set_access] == 0);
  CHECK_FALSE(f.device.resolve(range)->accessible);

  SUBCASE("never_fail clears the rule and keeps the counts") {
    f.plan.never_fail();
    CHECK(f.plan.faults_injected() == 5);
    CHECK(f.plan.calls()[driver_call::set_access] == 5);
  }
  SUBCASE("reset clears the rule and the counts") {
    f.plan.reset();
    CHECK(f.plan.faults_injected() == 0);
    CHECK(f.plan.calls().total() == 0);
    CHECK(f.plan.fallible_calls() == 0);
  }
  CHECK_FALSE(f.plan.armed());
  CHECK(f.reserver.try_set_access(range, g));
  CHECK(f.device.resolve(range)->accessible);
  f.reserver.unmap(range, g);
  f.reserver.free(range, g);
  f.provider.release(*handle);
  check_clean(f.device);
}

TEST_CASE("noexcept calls are counted but never failed") {
  fixture f;
  // A noexcept call cannot fail at all (unsupported); n = 0 is an argument out of range.
  const auto unsupported = usage_error::kind::unsupported, bad_argument = usage_error::kind::bad_argument;
  CHECK(testing::usage_kind([&] { f.plan.fail_nth_call_of(driver_call::release, 1); }) == unsupported);
  CHECK(testing::usage_kind([&] { f.plan.fail_every_call_of(driver_call::unmap); }) == unsupported);
  CHECK(testing::usage_kind([&] { f.plan.fail_nth_call_of(driver_call::address_free, 1); }) == unsupported);
  CHECK(testing::usage_kind([&] { f.plan.fail_nth_call(0); }) == bad_argument);
  CHECK(testing::usage_kind([&] { f.plan.fail_nth_call_of(driver_call::map, 0); }) == bad_argument);
  CHECK_FALSE(f.plan.armed());
  CHECK(fault_plan::fallible(driver_call::create));
  CHECK_FALSE(fault_plan::fallible(driver_call::release));

  f.plan.fail_nth_call(1);
  const auto handle = f.device.try_create(g);  // straight to the device, past the plan
  REQUIRE(handle.has_value());
  f.provider.release(*handle);
  CHECK(f.device.live_handles() == 0);  // the release went through although a fault was armed
  CHECK(f.plan.calls()[driver_call::release] == 1);
  CHECK(f.plan.fallible_calls() == 0);
  CHECK(f.plan.armed());
  CHECK(f.plan.faults_injected() == 0);
}

TEST_CASE("sweeping a fault over every call of an operation proves its rollback") {
  fixture f;
  constexpr std::size_t count = 3;
  const std::size_t calls = 2 * count + 2;  // creates, reserve, maps, set_access
  std::size_t faults = 0;
  for (std::uint64_t n = 1;; ++n) {
    CAPTURE(n);
    f.plan.reset();
    f.plan.fail_nth_call(n);
    const auto s = build_stitched(f.provider, f.reserver, count);
    if (f.plan.faults_injected() == 0) {
      REQUIRE(s.has_value());
      CHECK(f.plan.fallible_calls() == calls);
      tear_down(f.provider, f.reserver, *s);
      check_clean(f.device);
      break;
    }
    ++faults;
    CHECK_FALSE(s.has_value());
    check_clean(f.device);
    REQUIRE(n <= calls);
  }
  CHECK(faults == calls);
}

TEST_CASE("the wrappers work over the host backend too") {
  fault_plan plan;
  fault_injecting_provider<host_provider> provider{host_provider{g}, plan};
  fault_injecting_reserver<host_reserver> reserver{host_reserver{g}, plan};
  static_assert(address_reserver_for<decltype(reserver), decltype(provider)>);
  plan.fail_nth_call_of(driver_call::reserve, 1);
  CHECK(reserver.try_reserve(g) == nullptr);
  plan.fail_nth_call_of(driver_call::create, 1);
  CHECK_FALSE(provider.try_create(g).has_value());
  CHECK(provider.upstream().created_bytes() == 0);
  CHECK(plan.faults_injected() == 2);
  CHECK(provider.location() == memory_location::host);
}
