// Moves that hand device memory over (movers/handle_exchange.hpp): a prefetch that needs device
// handles takes those of a pending offload of the same sizes, which completes first, instead of
// the offload releasing them and the prefetch creating new ones. Checked under the simulated
// driver's rules with events the test completes by hand: no handle made or released, the
// offload's copies done before its handles are handed over, the device's count equal to the
// accounting after every call, within a budget under a scheduler, and every driver failure of a
// handover leaving everything usable.
#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "glake/adaptors/pluggable_stats.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/fault_injection.hpp"
#include "glake/backends/sim.hpp"
#include "glake/movers/handle_exchange.hpp"
#include "glake/scheduling/allocation_memory.hpp"
#include "glake/scheduling/budget.hpp"
#include "glake/scheduling/lru_policy.hpp"
#include "glake/scheduling/scheduler.hpp"
#include "support/deferred_schedule.hpp"
#include "support/evented_reserver.hpp"
#include "support/step_clock.hpp"

namespace {

using namespace glake;
constexpr std::size_t M = MiB;
using evented_alloc = stitching_allocator<sim_provider, testing::evented_reserver>;

constexpr auto deferred = move_completion::deferred;
const stream_ref own{std::uintptr_t{1}};

template <class Allocator>
std::uint64_t calls(const Allocator& a, driver_call kind) {
  return a.stats().driver_calls[kind];
}

struct setup {
  sim_device gpu;
  testing::event_log log;
  evented_alloc a;
  explicit setup(std::size_t device_bytes, far_residence away = far_residence::unmapped)
      : gpu(device_bytes, 2 * M, 256 * M), a{sim_provider(gpu), testing::evented_reserver(gpu, log)} {
    a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu), away);
  }
};

// The evented sim reserver whose reservations, maps and access settings fail as a fault_plan says
// (fault_injecting_reserver does not forward events).
class faulty_evented_reserver : public testing::evented_reserver {
 public:
  faulty_evented_reserver(sim_device& device, testing::event_log& log, fault_plan& plan)
      : evented_reserver(device, log), plan_(&plan) {}
  void* try_reserve(std::size_t bytes) {
    return plan_->should_fail(driver_call::reserve) ? nullptr : evented_reserver::try_reserve(bytes);
  }
  bool try_map(void* at, std::size_t bytes, sim_handle h) {
    return !plan_->should_fail(driver_call::map) && evented_reserver::try_map(at, bytes, h);
  }
  bool try_set_access(void* at, std::size_t bytes) {
    return !plan_->should_fail(driver_call::set_access) && evented_reserver::try_set_access(at, bytes);
  }

 private:
  fault_plan* plan_;
};

using testing::step_clock;

}  // namespace

TEST_CASE("handle_exchange: handles go to the sizes wanted, are taken by size, and close releases the rest") {
  handle_exchange<int> x;
  CHECK(!x.wants(2));
  x.want(2);
  x.want(2);
  x.want(4);
  CHECK(x.wanted() == 3);
  CHECK(x.wants(4));
  x.give(7, 4);
  CHECK(!x.wants(4));  // one of 4 wanted, one given
  x.give(8, 2);
  CHECK(x.bytes() == 6);
  CHECK(x.take(8) == std::nullopt);  // no handle of 8 bytes
  CHECK(x.take(4) == std::optional<int>(7));
  CHECK(x.handed() == 0);  // counted once the taker's move finished
  x.served(1);
  CHECK(x.handed() == 1);
  CHECK(x.wanted() == 1);
  std::vector<int> released;
  x.close([&](int h, std::size_t n) {
    CHECK(n == 2);
    released.push_back(h);
  });
  CHECK(released == std::vector<int>{8});
  CHECK(x.wanted() == 0);
  CHECK(x.bytes() == 0);
  CHECK(!x.wants(2));
}

TEST_CASE("move costs: the plug-in's flat statistics carry each move kind's costs under their names") {
  statistics st;
  st.offloads = move_costs{1, 2, 3, 4, 5, 6};
  st.prefetches = move_costs{7, 8, 9, 10, 11, 12};
  std::array<std::uint64_t, pluggable_stat_names.size()> v{};
  const std::size_t written = detail::write_statistics(st, v.data());
  CHECK(written == pluggable_stat_names.size() - 3);  // the adaptor's own three follow
  const auto value = [&](std::string_view name) {
    for (std::size_t i = 0; i < written; ++i) {
      if (pluggable_stat_names[i] == name) return v[i];
    }
    return ~std::uint64_t{0};
  };
  CHECK(value("offload_moves") == 1);
  CHECK(value("offload_handed_over") == 5);
  CHECK(value("offload_host_ns") == 6);
  CHECK(value("prefetch_moves") == 7);
  CHECK(value("prefetch_handles_made") == 9);
  CHECK(value("prefetch_handed_over") == 11);
  CHECK(value("prefetch_host_ns") == 12);
  move_costs back;
  detail::read_move_costs(back, v.data() + (written - 2 * detail::move_cost_values));
  CHECK(back == st.offloads);
}

TEST_CASE("move handover: a prefetch displacing a pending offload takes its device handles and makes none") {
  for (const far_residence away : {far_residence::unmapped, far_residence::mapped}) {
    for (const bool copies_done : {true, false}) {
      CAPTURE(static_cast<int>(away));
      CAPTURE(copies_done);
      setup s(40 * M, away);  // room for one of the two allocations on the device
      void* p = s.a.allocate(32 * M, own);
      s.a.offload(p, own);
      s.a.release_cached();
      void* q = s.a.allocate(32 * M, own);
      CHECK(s.gpu.physical_bytes() == 32 * M);
      const statistics before = s.a.stats();
      const std::uint64_t creates = calls(s.a, driver_call::create), releases = calls(s.a, driver_call::release);

      s.a.offload(q, own, deferred);  // q's device handles stay until its copies are done
      if (copies_done) s.log.complete(own);
      const std::size_t waits = s.log.waited;
      s.a.prefetch(p, own, deferred);  // displaces q: takes its handles
      CHECK(s.a.residence_of(q) == residence::host);
      CHECK(s.a.stats().offloaded_bytes == 64 * M);  // q's move completed; p's is pending
      // The offload's copies were done before its handles were handed over: waited for, or
      // known done.
      CHECK(s.log.waited == waits + (copies_done ? 0 : 1));
      CHECK(calls(s.a, driver_call::create) == creates);  // no device handle made
      CHECK(calls(s.a, driver_call::release) == releases);  // nor released
      CHECK(s.gpu.physical_bytes() == 32 * M);
      s.a.verify();

      s.a.complete_move(p);
      CHECK(s.a.residence_of(p) == residence::device);
      CHECK(s.gpu.physical_bytes() == s.a.stats().reserved_bytes);
      const statistics after = s.a.stats();
      CHECK(after.prefetches.moves == before.prefetches.moves + 1);
      CHECK(after.prefetches.handed_over == before.prefetches.handed_over + 16);  // 2 MiB handles
      CHECK(after.prefetches.handles_reused == before.prefetches.handles_reused + 16);
      CHECK(after.prefetches.handles_made == before.prefetches.handles_made);
      CHECK(after.offloads.handed_over == before.offloads.handed_over + 16);
      CHECK(after.offloads.moves == before.offloads.moves + 1);
      CHECK(after.prefetches.driver_calls > before.prefetches.driver_calls);  // maps, at least
      CHECK(after.prefetches.host_ns > before.prefetches.host_ns);
      CHECK(calls(s.a, driver_call::create) == creates);
      s.a.verify();

      s.a.deallocate(p, 32 * M, own);
      s.a.deallocate(q, 32 * M, own);
      s.a.release_cached();
      CHECK(s.gpu.physical_bytes() == 0);
      CHECK(s.gpu.host_bytes() == 0);
      CHECK(s.gpu.violations() == 0);
    }
  }
}

TEST_CASE("move handover: handles of sizes not wanted are released, a prefetch on return takes what fits") {
  setup s(256 * M);
  void* p = s.a.allocate(8 * M, own);
  void* q = s.a.allocate(24 * M, own);
  s.a.offload(p, own);
  s.a.offload(q, own, deferred);
  s.log.complete(own);
  const std::size_t device = s.gpu.physical_bytes();
  const std::uint64_t creates = calls(s.a, driver_call::create), releases = calls(s.a, driver_call::release);
  s.a.prefetch(p, own);  // completes on return: 4 of q's 12 handles, the other 8 released
  CHECK(calls(s.a, driver_call::create) == creates);
  CHECK(calls(s.a, driver_call::release) == releases + 8);
  CHECK(s.gpu.physical_bytes() == device - 16 * M);
  CHECK(s.gpu.physical_bytes() == s.a.stats().reserved_bytes);
  CHECK(s.a.stats().prefetches.handed_over == 4);
  s.a.verify();
  s.a.deallocate(p, 8 * M, own);
  s.a.deallocate(q, 24 * M, own);
  s.a.release_cached();
  CHECK(s.gpu.physical_bytes() == 0);
  CHECK(s.gpu.violations() == 0);
}

TEST_CASE("move handover: a scheduler with deferred moves keeps the device's own count within its budget") {
  testing::deferred_schedule f;
  auto& gpu = f.gpu;
  auto& log = f.log;
  auto& a = f.a;
  const stream_ref work = f.work;
  const auto& ids = f.ids;
  const std::size_t budget_bytes = f.budget_bytes;
  const auto step = [&](std::size_t k) {
    const allocation_id use[] = {ids[k], ids[(k + 1) % ids.size()]};
    f.w.will_use(std::span<const allocation_id>(use));
    log.complete(work);  // the queued work (and copies) ran
    f.clock.ns->fetch_add(100'000);
  };
  for (std::size_t k = 0; k < ids.size(); ++k) step(k);
  a.complete_moves(true);
  a.release_cached();
  REQUIRE(gpu.physical_bytes() <= budget_bytes);
  a.set_memory_limit(budget_bytes);  // the device serves no byte beyond the budget
  const statistics before = a.stats();
  for (int iteration = 0; iteration < 3; ++iteration) {
    for (std::size_t k = 0; k < ids.size(); ++k) {
      step(k);
      CHECK(gpu.physical_bytes() <= budget_bytes);
      a.verify();  // the device's count agrees with the accounting, pending moves included
    }
  }
  const statistics after = a.stats();
  CHECK(after.prefetches.moves > before.prefetches.moves);
  CHECK(after.prefetches.handed_over > before.prefetches.handed_over);
  CHECK(after.prefetches.handles_made == before.prefetches.handles_made);  // every one handed over
  CHECK(after.offloads.handed_over - before.offloads.handed_over ==
        after.prefetches.handed_over - before.prefetches.handed_over);
  f.w.settle();
  f.unmanage_all();
  a.set_memory_limit(0);
  f.free_all();
  a.release_cached();
  CHECK(gpu.physical_bytes() == 0);
  CHECK(gpu.violations() == 0);
}

TEST_CASE("move handover: a failure at any driver call of a handover leaves everything usable") {
  using faulty_alloc = stitching_allocator<fault_injecting_provider<sim_provider>, faulty_evented_reserver>;
  fault_plan plan;
  std::uint64_t faults = 0;
  for (std::uint64_t n = 1;; ++n) {
    CAPTURE(n);
    sim_device gpu(16 * M, 2 * M, 256 * M);
    testing::event_log log;
    faulty_alloc a(fault_injecting_provider<sim_provider>(sim_provider(gpu), plan),
                   faulty_evented_reserver(gpu, log, plan));
    a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu), far_residence::mapped);  // remaps: more calls
    void* p = a.allocate(8 * M, own);
    a.offload(p, own);
    a.release_cached();
    void* q = a.allocate(8 * M, own);
    a.offload(q, own, deferred);
    log.complete(own);  // its copies done: the prefetch of p takes q's handles
    const std::uint64_t injected = plan.faults_injected();
    const statistics before = a.stats();
    plan.fail_nth_call(n);
    bool threw = false;
    try {
      a.prefetch(p, own, deferred);
      a.complete_move(p);
    } catch (const out_of_memory&) {
      threw = true;
    }
    plan.never_fail();
    const bool fired = plan.faults_injected() > injected;
    CHECK((fired || !threw));
    if (!fired) CHECK(a.stats().prefetches.handed_over == 4);
    // Handed over are only the handles p's finished move kept: each of its 4 was handed over or
    // made; handles taken by a start that failed, or by a move undone, went back to the backend.
    const statistics after = a.stats();
    const std::uint64_t handed = after.prefetches.handed_over - before.prefetches.handed_over;
    const std::uint64_t made = after.prefetches.handles_made - before.prefetches.handles_made;
    CHECK(after.offloads.handed_over - before.offloads.handed_over == handed);
    CHECK(after.prefetches.handles_reused - before.prefetches.handles_reused == handed);
    if (a.residence_of(p) == residence::device) {
      CHECK(handed + made == 4);
    } else {
      CHECK(handed == 0);
    }
    a.verify();
    CHECK(gpu.physical_bytes() == a.stats().reserved_bytes);  // nothing pending now
    // Whatever moved, everything can be brought back and freed.
    a.complete_moves(true);
    for (void* x : {p, q}) {
      if (a.residence_of(x) == residence::host) a.prefetch(x, own);
      CHECK(a.residence_of(x) == residence::device);
    }
    CHECK(a.stats().offloaded_bytes == 0);
    a.deallocate(p, 8 * M, own);
    a.deallocate(q, 8 * M, own);
    a.verify();
    a.release_cached();
    CHECK(gpu.physical_bytes() == 0);
    CHECK(gpu.host_bytes() == 0);
    CHECK(gpu.violations() == 0);
    if (!fired) break;
    ++faults;
    REQUIRE(n < 200);
  }
  CHECK(faults >= 4);  // the prefetch's reservation, maps and access setting (no create)
}

TEST_CASE("move handover: handles a prefetch took and gave back, when it ran out of memory, are not handed over") {
  using faulty_alloc = stitching_allocator<fault_injecting_provider<sim_provider>, faulty_evented_reserver>;
  fault_plan plan;
  sim_device gpu(16 * M, 2 * M, 256 * M);
  testing::event_log log;
  faulty_alloc a(fault_injecting_provider<sim_provider>(sim_provider(gpu), plan),
                 faulty_evented_reserver(gpu, log, plan));
  a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu), far_residence::mapped);
  void* p = a.allocate(8 * M, own);
  a.offload(p, own);
  a.release_cached();
  void* q = a.allocate(8 * M, own);
  a.offload(q, own, deferred);
  log.complete(own);  // q completes when p's prefetch starts, giving it q's 4 handles
  const statistics before = a.stats();
  const std::uint64_t creates = calls(a, driver_call::create);
  plan.fail_nth_call_of(driver_call::reserve, 1);  // p's copy range, after it took q's handles
  try {
    a.prefetch(p, own);
  } catch (const out_of_memory&) {
  }
  plan.never_fail();
  REQUIRE(plan.faults_injected() == 1);
  CHECK(a.residence_of(q) == residence::host);
  const statistics after = a.stats();
  CHECK(after.prefetches.handed_over == before.prefetches.handed_over);
  CHECK(after.prefetches.handles_reused == before.prefetches.handles_reused);
  CHECK(after.offloads.handed_over == before.offloads.handed_over);
  if (a.residence_of(p) == residence::device) {  // a second start made its own
    CHECK(calls(a, driver_call::create) == creates + 4);
    CHECK(after.prefetches.handles_made == before.prefetches.handles_made + 4);
  }
  a.verify();
  if (a.residence_of(p) == residence::host) a.prefetch(p, own);
  a.deallocate(p, 8 * M, own);
  a.deallocate(q, 8 * M, own);
  a.release_cached();
  CHECK(gpu.physical_bytes() == 0);
  CHECK(gpu.violations() == 0);
}
