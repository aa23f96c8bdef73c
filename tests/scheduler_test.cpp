// Swap scheduling across workloads sharing one device budget: the policies' contracts, the
// budget's accounts, and workloads of virtual_buffers on the simulated device (driver rules) and
// on host memory (bytes) kept under a budget smaller than their peak, alone, together, arriving,
// leaving and waiting for each other.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "glake/backends/host.hpp"
#include "glake/backends/sim.hpp"
#include "glake/movers/virtual_buffer.hpp"
#include "glake/scheduling/budget.hpp"
#include "glake/scheduling/budget_ledger.hpp"
#include "glake/scheduling/lru_policy.hpp"
#include "glake/scheduling/planned_policy.hpp"
#include "glake/scheduling/scheduler.hpp"
#include "support/stamp.hpp"

namespace {

using namespace glake;
using namespace std::chrono_literals;
using testing::stamp;
using testing::stamped;

constexpr std::size_t K = 1024;
constexpr std::size_t G = 64 * K;  // the tests' granularity: small, so real memory stays small

using sim_buffer = virtual_buffer<sim_provider, sim_host_provider, sim_reserver, sim_copier>;
using host_buffer = virtual_buffer<host_provider, host_provider, host_reserver, host_copier>;

/// Time the test sets: each operation "computes" for as long as the test advances it.
struct manual_clock {
  using time_point = std::chrono::time_point<std::chrono::steady_clock, std::chrono::nanoseconds>;
  std::shared_ptr<std::atomic<std::int64_t>> ns = std::make_shared<std::atomic<std::int64_t>>(0);
  time_point now() const { return time_point(std::chrono::nanoseconds(ns->load())); }
  void advance(std::chrono::nanoseconds d) const { ns->fetch_add(d.count()); }
};
static_assert(schedule_clock<manual_clock>);

// 1 byte per ns, no fixed part: moving b bytes takes b ns, easy to reason about.
constexpr transfer_model byte_per_ns{1e9, schedule_time::zero()};
// The simulated workloads: a 4G buffer moves in 262 us, an operation computes for 100 us, so a
// prefetch must start two or three operations ahead.
constexpr transfer_model test_link{1e9, std::chrono::microseconds(5)};
constexpr auto op_time = 100us;

using sim_lru = workload_scheduler<sim_buffer, lru_policy, manual_clock>;
using sim_planned = workload_scheduler<sim_buffer, planned_policy, manual_clock>;
using host_planned = workload_scheduler<host_buffer, planned_policy, manual_clock>;
static_assert(swap_policy<lru_policy>);
static_assert(prefetching_policy<planned_policy>);

template <class P>
P make_policy() {
  if constexpr (std::is_same_v<P, planned_policy>) {
    return planned_policy(test_link);
  } else {
    return P{};
  }
}

// Buffers on one simulated device, each one piece, made on the device (or moved to the host).
struct sim_world {
  sim_device gpu{1024 * G, G, 1024 * G};
  std::vector<std::unique_ptr<sim_buffer>> buffers;
  sim_buffer& make(std::size_t bytes, bool on_device = true) {
    buffers.push_back(std::make_unique<sim_buffer>(sim_provider(gpu), sim_host_provider(gpu), sim_reserver(gpu),
                                                   sim_copier(gpu), bytes, bytes));
    sim_buffer& b = *buffers.back();
    b.commit(0, bytes);
    if (!on_device) b.offload(0, bytes);
    return b;
  }
};

// One workload: its allocations and the operations of one iteration (indices into ids).
template <class Scheduler>
struct workload {
  manual_clock clock;
  Scheduler scheduler;
  std::vector<allocation_id> ids;
  std::vector<std::vector<std::size_t>> ops;
  std::vector<std::size_t> sizes;
  std::chrono::nanoseconds step = op_time;  ///< how long each operation computes

  workload(shared_budget& budget, std::string name, typename Scheduler::policy_type policy)
      : scheduler(budget, std::move(name), std::move(policy), scheduler_options{}, clock) {}

  std::size_t peak() const {
    std::size_t sum = 0;
    for (std::size_t s : sizes) sum += s;
    return sum;
  }
  // Runs operation k: will_use, then `check(ids of the op)`, then the operation's time passes.
  template <class Check>
  void run_op(std::size_t k, Check&& check) {
    std::vector<allocation_id> use;
    for (std::size_t i : ops[k]) use.push_back(ids[i]);
    scheduler.will_use(std::span<const allocation_id>(use));
    check(use);
    clock.advance(step);
  }
  template <class Check>
  void run_iteration(Check&& check) {
    scheduler.iteration_begin();
    for (std::size_t k = 0; k < ops.size(); ++k) run_op(k, check);
  }
};

// A cyclic sweep over n allocations of the given sizes, each operation using two neighbours:
// the pattern least-recently-used does worst on (every use misses once the sweep outgrows the
// budget).
template <class Scheduler>
void make_sweep(workload<Scheduler>& w, sim_world& world, const std::vector<std::size_t>& sizes) {
  w.sizes = sizes;
  for (std::size_t s : sizes) w.ids.push_back(w.scheduler.manage(world.make(s, false)));
  for (std::size_t i = 0; i < sizes.size(); ++i) w.ops.push_back({i, (i + 1) % sizes.size()});
}

}  // namespace

// ------------------------------------------------------------------------------------------
// swap_policy conformance

TEST_CASE_TEMPLATE("swap_policy: unused allocations are the best victims, used ones are not, untracked ones never count",
                   P, lru_policy, planned_policy) {
  P p = make_policy<P>();
  p.track(0, G);
  p.track(1, G);
  p.track(2, 2 * G);
  p.iteration_begin(0us);
  const allocation_id first[] = {0};
  const allocation_id second[] = {1};
  p.use(first, 10us);
  p.use(second, 20us);

  CHECK(p.next_use(2, 30us) == never_used);  // never used: nothing predicts a use
  CHECK(p.next_use(0, 30us) < never_used);
  CHECK(p.next_use(1, 30us) < never_used);
  CHECK(p.next_use(0, 30us) >= schedule_time::zero());
  // With no repetition seen yet, the allocation idle longer is the better victim.
  CHECK(p.next_use(0, 30us) >= p.next_use(1, 30us));

  p.untrack(0);
  CHECK(p.next_use(0, 40us) == never_used);
  // A second iteration of the same shape keeps the contract.
  p.iteration_begin(50us);
  p.use(second, 60us);
  CHECK(p.next_use(1, 70us) < never_used);
  CHECK(p.next_use(2, 70us) == never_used);
}

TEST_CASE_TEMPLATE("prefetching_policy: due prefetches name tracked allocations ahead of their use", P,
                   planned_policy) {
  P p = make_policy<P>();
  p.track(0, 4 * G);
  p.track(1, G);
  p.track(2, G);
  // 0 is used at operations 0 and 3 of each iteration, 1 and 2 in between.
  const std::vector<std::vector<allocation_id>> ops = {{0}, {1}, {2}, {0}, {1}, {2}};
  std::vector<std::vector<allocation_id>> due_after(ops.size());
  schedule_time t{};
  for (int iteration = 0; iteration < 3; ++iteration) {
    p.iteration_begin(t);
    for (std::size_t k = 0; k < ops.size(); ++k) {
      p.use(ops[k], t);
      const auto due = p.due_prefetches();
      if (iteration == 2) due_after[k].assign(due.begin(), due.end());
      for (allocation_id id : due) CHECK(id <= 2);
      t += 1ms;
    }
  }
  // Something is prefetched ahead, and never the allocation the same operation uses.
  std::size_t total = 0;
  for (std::size_t k = 0; k < ops.size(); ++k) {
    total += due_after[k].size();
    for (allocation_id id : due_after[k]) CHECK(id != ops[k][0]);
  }
  CHECK(total > 0);
}

// ------------------------------------------------------------------------------------------
// planned_policy

TEST_CASE("planned_policy: prefetch points are as late as the transfer time allows, wrapping into the previous iteration") {
  // Ten operations 10 us apart in a 100 us iteration; allocation 0 is used at operations 0 and
  // 6, allocation 1 at every other operation (adjacent uses: no prefetch point).
  const auto run = [](std::size_t bytes) {
    planned_policy p(byte_per_ns);
    p.track(0, bytes);
    p.track(1, G);
    const allocation_id zero[] = {0};
    const allocation_id one[] = {1};
    for (int iteration = 0; iteration < 2; ++iteration) {
      const schedule_time start = iteration * 100us;
      p.iteration_begin(start);
      for (int k = 0; k < 10; ++k) {
        if (k == 0 || k == 6) {
          p.use(zero, start + k * 10us);
        } else {
          p.use(one, start + k * 10us);
        }
      }
    }
    return p;
  };
  {
    const planned_policy p = run(5000);  // 5 us: the operation just before each use
    CHECK(p.plans_built() == 1);
    CHECK(p.prefetch_point(0, 6) == 5);
    CHECK(p.prefetch_point(0, 0) == 9);  // in the previous iteration
    CHECK(p.prefetch_point(1, 2) == -1);  // used by the operation before: no prefetch
  }
  {
    const planned_policy p = run(25000);  // 25 us: three operations ahead
    CHECK(p.prefetch_point(0, 6) == 3);
    CHECK(p.prefetch_point(0, 0) == 7);
  }
  {
    const planned_policy p = run(1000000);  // 1 ms: longer than the gap, so as early as possible
    CHECK(p.prefetch_point(0, 6) == 1);
    CHECK(p.prefetch_point(0, 0) == 7);
  }
}

TEST_CASE("planned_policy: next use follows the plan (Belady), and a changed sequence is re-planned") {
  planned_policy p(byte_per_ns);
  for (allocation_id id = 0; id < 3; ++id) p.track(id, G);
  const allocation_id a[] = {0};
  const allocation_id b[] = {1};
  const allocation_id c[] = {2};
  const auto iteration = [&](schedule_time start, std::span<const allocation_id> first) {
    p.iteration_begin(start);
    p.use(first, start);
    p.use(b, start + 10us);
    p.use(c, start + 20us);
    p.use(b, start + 30us);
  };
  iteration(0us, a);
  CHECK(p.plans_built() == 0);
  iteration(40us, a);  // plan: a b c b, 40 us
  CHECK(p.plans_built() == 1);
  CHECK(p.following());
  // At the last operation (b at 30 us): c comes at 20 us of the next iteration, a at 0 us.
  CHECK(p.next_use(0, 70us) == 10us);
  CHECK(p.next_use(2, 70us) == 30us);
  // Least recently used would say the opposite: a was used longest ago.
  lru_policy lru;
  for (allocation_id id = 0; id < 3; ++id) lru.track(id, G);
  lru.use(a, 40us);
  lru.use(c, 60us);
  CHECK(lru.next_use(0, 70us) > lru.next_use(2, 70us));

  // The sequence changes: c first. The policy notices and falls back, then plans the new one.
  p.iteration_begin(80us);
  p.use(c, 80us);
  CHECK(p.divergences() == 1);
  CHECK_FALSE(p.following());
  CHECK(p.next_use(2, 85us) == 5us);  // least recently used meanwhile: used 5 us ago
  p.use(b, 90us);
  p.use(c, 100us);
  p.use(b, 110us);
  p.iteration_begin(120us);
  CHECK(p.plans_built() == 2);
  CHECK(p.following());
  p.use(c, 120us);
  CHECK(p.following());
  CHECK(p.next_use(0, 120us) == never_used);  // the new plan never uses a

  // An iteration without operations (a warm-up, an evaluation pass) is not made the plan.
  p.use(b, 130us);
  p.use(c, 140us);
  p.use(b, 150us);
  p.iteration_begin(160us);
  p.iteration_begin(170us);
  CHECK(p.plans_built() == 2);
  p.use(c, 170us);
  CHECK(p.following());
}

// ------------------------------------------------------------------------------------------
// budget_ledger and shared_budget

TEST_CASE("budget_ledger: requests and replies are plain values, refusals say what and who") {
  budget_ledger ledger(10 * G);
  const budget_reply joined = ledger.handle({budget_request::kind::join, 0, 2 * G, "trainer"});
  REQUIRE(joined.result == budget_reply::status::granted);
  const workload_id w = joined.workload;
  CHECK(ledger.handle({budget_request::kind::acquire, w, 6 * G, {}}).result == budget_reply::status::granted);
  const budget_reply over = ledger.handle({budget_request::kind::acquire, w, 6 * G, {}});
  CHECK(over.result == budget_reply::status::over_budget);
  CHECK(over.bytes == 2 * G);  // missing
  CHECK(ledger.used() == 6 * G);

  const budget_reply too_much = ledger.handle({budget_request::kind::release, w, 7 * G, {}});
  CHECK(too_much.result == budget_reply::status::refused);
  CHECK(too_much.message.find("trainer") != std::string::npos);
  const budget_reply pinned = ledger.handle({budget_request::kind::set_pinned, w, 11 * G, {}});
  CHECK(pinned.result == budget_reply::status::refused);
  CHECK(pinned.message.find("'trainer' needs " + std::to_string(11 * G) + " bytes") != std::string::npos);
  CHECK(ledger.usage(w).pinned == 2 * G);  // unchanged
  CHECK(ledger.handle({budget_request::kind::acquire, 77, G, {}}).result == budget_reply::status::refused);

  // A workload that leaves (or whose process died) gives back everything it held.
  const workload_id other = ledger.join("server");
  CHECK(ledger.try_acquire(other, 4 * G));
  CHECK(ledger.available() == 0);
  ledger.handle({budget_request::kind::leave, w, 0, {}});
  CHECK(ledger.available() == 6 * G);
  CHECK(ledger.workloads() == 1);

  CHECK_THROWS_AS(budget_ledger(0), usage_error);
  CHECK(budget_ledger::fraction_of(100 * G, 0.25).budget() == 25 * G);
  CHECK_THROWS_AS(budget_ledger::fraction_of(100 * G, 1.5), usage_error);
  try {
    budget_ledger small(4 * G);
    small.join("giant", 5 * G);
    FAIL("a workload needing more than the budget at once must be refused");
  } catch (const out_of_memory& e) {
    CHECK(std::string(e.what()).find("'giant' needs " + std::to_string(5 * G) + " bytes") != std::string::npos);
  }
}

// ------------------------------------------------------------------------------------------
// workload_scheduler on the simulated device

TEST_CASE_TEMPLATE("workload_scheduler: one workload under 60% of its peak finds every allocation on the device, "
                   "and never holds more than the budget",
                   S, sim_lru, sim_planned) {
  sim_world world;
  const std::vector<std::size_t> sizes = {4 * G, 2 * G, 3 * G, 4 * G, 2 * G, 4 * G, 3 * G, 2 * G};  // 24G
  const std::size_t budget_bytes = 24 * G * 6 / 10;
  shared_budget budget(budget_bytes);
  workload<S> w(budget, "trainer", make_policy<typename S::policy_type>());
  make_sweep(w, world, sizes);
  REQUIRE(w.peak() == 24 * G);

  std::size_t checked = 0;
  const auto check = [&](const std::vector<allocation_id>& use) {
    for (allocation_id id : use) {
      REQUIRE(w.scheduler.residence_of(id) == residence::device);
      REQUIRE(world.buffers[id]->residence_of(0) == residence::device);
    }
    REQUIRE(world.gpu.physical_bytes() <= budget_bytes);
    REQUIRE(budget.used() <= budget_bytes);
    ++checked;
  };
  for (int i = 0; i < 6; ++i) w.run_iteration(check);
  CHECK(checked == 6 * sizes.size());
  const scheduler_statistics s = w.scheduler.stats();
  CHECK(s.peak_device_bytes <= budget_bytes);
  CHECK(s.offloads > 0);  // the budget really was too small
  CHECK(s.uses == 6 * 2 * sizes.size());
  CHECK(world.gpu.violations() == 0);
  if constexpr (std::is_same_v<S, sim_planned>) {
    CHECK(s.prefetches > 0);
    CHECK(w.scheduler.inspect_policy([](const planned_policy& p) { return p.following(); }));
  } else {
    CHECK(s.prefetches == 0);
  }
}

TEST_CASE("workload_scheduler: on a cyclic sweep the planned policy prefetches everything least-recently-used fetches on demand") {
  const std::vector<std::size_t> sizes = {4 * G, 2 * G, 3 * G, 4 * G, 2 * G, 4 * G, 3 * G, 2 * G};
  const std::size_t budget_bytes = 24 * G * 6 / 10;
  const auto steady_demand = [&](auto policy) {
    using S = workload_scheduler<sim_buffer, decltype(policy), manual_clock>;
    sim_world world;
    shared_budget budget(budget_bytes);
    workload<S> w(budget, "sweep", policy);
    make_sweep(w, world, sizes);
    const auto none = [](const std::vector<allocation_id>&) {};
    for (int i = 0; i < 3; ++i) w.run_iteration(none);
    const scheduler_statistics before = w.scheduler.stats();
    for (int i = 0; i < 4; ++i) w.run_iteration(none);
    return w.scheduler.stats().demand_fetches - before.demand_fetches;
  };
  const std::uint64_t lru = steady_demand(lru_policy{});
  const std::uint64_t planned = steady_demand(planned_policy(test_link));
  CHECK(lru >= 4 * 4);  // several misses every iteration
  CHECK(planned == 0);  // every one prefetched ahead instead
}

TEST_CASE("workload_scheduler: two workloads share a budget of 75% of their summed peaks, victims taken across them") {
  sim_world world;
  const std::size_t budget_bytes = (24 * G + 16 * G) * 3 / 4;
  shared_budget budget(budget_bytes);
  workload<sim_planned> a(budget, "a", planned_policy(test_link));
  workload<sim_planned> b(budget, "b", planned_policy(test_link));
  make_sweep(a, world, {4 * G, 2 * G, 3 * G, 4 * G, 2 * G, 4 * G, 3 * G, 2 * G});
  make_sweep(b, world, {4 * G, 4 * G, 4 * G, 4 * G});
  b.step = 3 * op_time;  // b's operations are slower: its memory waits longer between uses
  REQUIRE(a.peak() + b.peak() == 40 * G);

  std::size_t checked = 0;
  const auto checker = [&](auto& w, std::size_t first_buffer) {
    return [&, first_buffer](const std::vector<allocation_id>& use) {
      for (allocation_id id : use) {
        REQUIRE(w.scheduler.residence_of(id) == residence::device);
        REQUIRE(world.buffers[first_buffer + id]->residence_of(0) == residence::device);
      }
      REQUIRE(world.gpu.physical_bytes() <= budget_bytes);
      ++checked;
    };
  };
  const auto check_a = checker(a, 0);
  const auto check_b = checker(b, 8);
  // Interleaved operation by operation: b runs two iterations for each of a's.
  for (int i = 0; i < 5; ++i) {
    a.scheduler.iteration_begin();
    b.scheduler.iteration_begin();
    for (std::size_t k = 0; k < a.ops.size(); ++k) {
      a.run_op(k, check_a);
      b.run_op(k % b.ops.size(), check_b);
      if (k % b.ops.size() == b.ops.size() - 1 && k + 1 < a.ops.size()) b.scheduler.iteration_begin();
    }
  }
  CHECK(checked == 5 * 8 * 2);
  CHECK(budget.stats().peak_used <= budget_bytes);
  CHECK(budget.stats().cross_evictions > 0);
  CHECK(a.scheduler.stats().offloads > 0);
  CHECK(b.scheduler.stats().offloads > 0);
  CHECK(world.gpu.violations() == 0);
}

TEST_CASE("workload_scheduler: workloads arriving and leaving change who gives up memory, and a changed sequence is re-planned") {
  sim_world world;
  const std::size_t budget_bytes = 30 * G;
  shared_budget budget(budget_bytes);
  workload<sim_planned> a(budget, "a", planned_policy(test_link));
  make_sweep(a, world, {4 * G, 2 * G, 3 * G, 4 * G, 2 * G, 4 * G, 3 * G, 2 * G});  // 24G: fits alone
  const auto check = [&](const std::vector<allocation_id>& use) {
    for (allocation_id id : use) REQUIRE(a.scheduler.residence_of(id) == residence::device);
    REQUIRE(world.gpu.physical_bytes() <= budget_bytes);
  };
  for (int i = 0; i < 3; ++i) a.run_iteration(check);
  CHECK(a.scheduler.stats().offloads == 0);
  CHECK(a.scheduler.stats().device_bytes == 24 * G);

  {
    // b arrives with 16G, on the device: a gives up memory for it at once.
    workload<sim_planned> b(budget, "b", planned_policy(test_link));
    b.sizes = {4 * G, 4 * G, 4 * G, 4 * G};
    for (std::size_t s : b.sizes) b.ids.push_back(b.scheduler.manage(world.make(s, true)));
    for (std::size_t i = 0; i < 4; ++i) b.ops.push_back({i, (i + 1) % 4});
    CHECK(world.gpu.physical_bytes() <= budget_bytes);
    // Memory never used yet is the furthest-next-use victim of all: b's own goes first.
    CHECK(b.scheduler.stats().offloads > 0);
    CHECK(a.scheduler.stats().offloads == 0);
    CHECK(budget.snapshot().size() == 2);
    for (int i = 0; i < 3; ++i) {
      a.scheduler.iteration_begin();
      b.scheduler.iteration_begin();
      for (std::size_t k = 0; k < a.ops.size(); ++k) {
        a.run_op(k, check);
        if (k < b.ops.size()) b.run_op(k, [&](const std::vector<allocation_id>& use) {
          for (allocation_id id : use) REQUIRE(b.scheduler.residence_of(id) == residence::device);
          REQUIRE(world.gpu.physical_bytes() <= budget_bytes);
        });
      }
    }
    CHECK(b.scheduler.stats().device_bytes > 0);
    CHECK(a.scheduler.stats().offloads > 0);  // once b runs, a gives up memory for it
  }
  // b left: its share came back. b's buffers still exist (outside the budget now): give their
  // device memory back as a finished workload's frees would.
  CHECK(budget.snapshot().size() == 1);
  CHECK(budget.used() == a.scheduler.stats().device_bytes);
  for (std::size_t i = 8; i < 12; ++i) world.buffers[i]->decommit(0, world.buffers[i]->size());
  a.run_iteration(check);  // a's memory comes back as it is used
  const scheduler_statistics settled = a.scheduler.stats();
  CHECK(settled.device_bytes == 24 * G);
  a.run_iteration(check);
  CHECK(a.scheduler.stats().offloads == settled.offloads);  // fits again: nothing moves
  CHECK(a.scheduler.stats().demand_fetches == settled.demand_fetches);

  // a's sequence changes (its operations now run backwards): it is followed again after one
  // iteration.
  const auto plans = [&] {
    return a.scheduler.inspect_policy([](const planned_policy& p) { return p.plans_built(); });
  };
  const std::uint64_t plans_before = plans();
  std::reverse(a.ops.begin(), a.ops.end());
  a.run_iteration(check);
  CHECK(a.scheduler.inspect_policy([](const planned_policy& p) { return p.divergences(); }) == 1);
  a.run_iteration(check);
  CHECK(plans() == plans_before + 1);
  CHECK(a.scheduler.inspect_policy([](const planned_policy& p) { return p.following(); }));
  CHECK(world.gpu.violations() == 0);
}

TEST_CASE("workload_scheduler: an operation needing more than the whole budget names the workload and the bytes") {
  sim_world world;
  shared_budget budget(4 * G);
  workload_scheduler<sim_buffer, planned_policy, manual_clock> w(budget, "big-model", planned_policy{});
  const allocation_id x = w.manage(world.make(3 * G, false));
  const allocation_id y = w.manage(world.make(2 * G, false));
  w.will_use(x);
  try {
    w.will_use({x, y});
    FAIL("5G at once under a budget of 4G must be refused");
  } catch (const out_of_memory& e) {
    const std::string what = e.what();
    CHECK(what.find("'big-model'") != std::string::npos);
    CHECK(what.find(std::to_string(5 * G) + " bytes") != std::string::npos);
    CHECK(what.find(std::to_string(4 * G) + " bytes") != std::string::npos);  // the budget
  }
  CHECK(budget.usage(w.id()).pinned == 0);  // nothing stays pinned
  w.will_use(y);                            // and the workload goes on with what fits
  CHECK(w.residence_of(y) == residence::device);
  CHECK(budget.used() <= 4 * G);

  // One allocation larger than the budget is refused at once, not after the wait's timeout.
  const std::size_t managed = w.stats().managed_bytes;
  const auto start = std::chrono::steady_clock::now();
  try {
    w.manage(world.make(5 * G, true));
    FAIL("an allocation of 5G cannot be on the device under a budget of 4G");
  } catch (const out_of_memory& e) {
    CHECK(std::string(e.what()).find("'big-model' needs " + std::to_string(5 * G) + " bytes") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - start < 10s);  // the wait's timeout is 30 s
  CHECK(w.stats().managed_bytes == managed);
}

TEST_CASE("workload_scheduler: a workload that cannot get room in time gets out_of_memory naming it and the bytes") {
  sim_world world;
  shared_budget budget(8 * G);
  workload_scheduler<sim_buffer, lru_policy, manual_clock> a(budget, "holder", lru_policy{});
  scheduler_options quick;
  quick.wait_timeout = 30ms;
  workload_scheduler<sim_buffer, lru_policy, manual_clock> b(budget, "waiter", lru_policy{}, quick);
  const allocation_id held = a.manage(world.make(6 * G, true));
  const allocation_id wanted = b.manage(world.make(4 * G, false));
  a.will_use(held);  // pinned until a's next operation
  const auto start = std::chrono::steady_clock::now();
  try {
    b.will_use(wanted);
    FAIL("b must not get 4G while a pins 6G of 8G");
  } catch (const out_of_memory& e) {
    const std::string what = e.what();
    CHECK(what.find("'waiter'") != std::string::npos);
    CHECK(what.find(std::to_string(4 * G) + " bytes") != std::string::npos);
    CHECK(what.find("'holder' holds") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - start >= 30ms);
  CHECK(b.residence_of(wanted) == residence::host);
  CHECK(a.residence_of(held) == residence::device);
  CHECK(budget.stats().timeouts == 1);
  // Once a's operation is over, b gets its memory at once.
  a.idle();
  b.will_use(wanted);
  CHECK(b.residence_of(wanted) == residence::device);
  CHECK(a.residence_of(held) == residence::host);
  CHECK(world.gpu.physical_bytes() <= 8 * G);
}

TEST_CASE("workload_scheduler: misuse is refused") {
  sim_world world;
  shared_budget budget(8 * G);
  workload_scheduler<sim_buffer, lru_policy, manual_clock> w(budget, "w", lru_policy{});
  sim_buffer& half = world.make(4 * G, true);
  sim_buffer split(sim_provider(world.gpu), sim_host_provider(world.gpu), sim_reserver(world.gpu), sim_copier(world.gpu),
                   4 * G, 2 * G);
  split.commit(0, 4 * G);
  split.offload(0, 2 * G);
  CHECK_THROWS_AS(w.manage(split), usage_error);  // half on the host, half on the device
  sim_buffer empty(sim_provider(world.gpu), sim_host_provider(world.gpu), sim_reserver(world.gpu), sim_copier(world.gpu),
                   2 * G, 2 * G);
  CHECK_THROWS_AS(w.manage(empty), usage_error);  // nothing committed
  const allocation_id id = w.manage(half);
  CHECK_THROWS_AS(w.manage(half), usage_error);
  CHECK_THROWS_AS(w.will_use(allocation_id{id + 5}), usage_error);
  int outside = 0;
  CHECK_THROWS_AS(w.will_use(static_cast<const void*>(&outside)), usage_error);
  // A pointer anywhere inside a managed allocation names it.
  CHECK(w.find(static_cast<char*>(half.data()) + 3 * G) == id);
  w.will_use(static_cast<const void*>(static_cast<char*>(half.data()) + G));
  CHECK(w.residence_of(id) == residence::device);
  w.unmanage(id);
  CHECK(budget.used() == 0);
  CHECK_THROWS_AS(w.will_use(id), usage_error);
  CHECK(world.gpu.violations() == 0);
}

// ------------------------------------------------------------------------------------------
// Bytes: host memory under the scheduler

TEST_CASE("workload_scheduler: data survives every move (host memory, stamped pages)") {
  host_provider device(G, 12 * G);  // the "device" itself is smaller than the workload
  host_provider host(G, 0);
  std::vector<std::unique_ptr<host_buffer>> buffers;
  const std::vector<std::size_t> sizes = {3 * G, 2 * G, 4 * G, 2 * G, 3 * G, 2 * G};  // 16G
  std::vector<std::uint64_t> tags;
  for (std::size_t s : sizes) {
    buffers.push_back(std::make_unique<host_buffer>(device, host, host_reserver(G), host_copier{}, s, G));
    tags.push_back(0x5eed0000 + tags.size());
    buffers.back()->commit(0, s);
    stamp(buffers.back()->data(), s, tags.back());
    buffers.back()->offload(0, s);
  }
  const std::size_t budget_bytes = 10 * G;
  shared_budget budget(budget_bytes);
  manual_clock clock;
  host_planned w(budget, "bytes", planned_policy(test_link), scheduler_options{}, clock);
  std::vector<allocation_id> ids;
  for (auto& b : buffers) ids.push_back(w.manage(*b));
  for (int iteration = 0; iteration < 4; ++iteration) {
    w.iteration_begin();
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      const std::size_t next = (k + 2) % sizes.size();
      w.will_use({ids[k], ids[next]});
      for (std::size_t i : {k, next}) {
        REQUIRE(buffers[i]->residence_of(0) == residence::device);
        REQUIRE(stamped(buffers[i]->data(), sizes[i], tags[i]));
      }
      REQUIRE(device.created_bytes() <= budget_bytes);
      // The operation writes its first allocation: the new bytes must survive the next moves.
      tags[k] += 0x1000;
      stamp(buffers[k]->data(), sizes[k], tags[k]);
      clock.advance(op_time);
    }
  }
  CHECK(w.stats().offloads > 0);
  CHECK(w.stats().prefetches + w.stats().demand_fetches > 0);
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    CHECK(buffers[i]->residence_of(0) == w.residence_of(ids[i]));
    CHECK(stamped(buffers[i]->data(), sizes[i], tags[i]));
  }
}

// ------------------------------------------------------------------------------------------
// Threads

TEST_CASE("threads: back-pressure: a workload waits while another pins the memory, and proceeds when it is released") {
  sim_world world;
  shared_budget budget(8 * G);
  workload_scheduler<sim_buffer, lru_policy> a(budget, "a", lru_policy{});
  workload_scheduler<sim_buffer, lru_policy> b(budget, "b", lru_policy{});
  const allocation_id held = a.manage(world.make(6 * G, true));
  const allocation_id wanted = b.manage(world.make(4 * G, false));
  a.will_use(held);

  std::atomic<bool> done{false};
  std::thread waiter([&] {
    b.will_use(wanted);
    done = true;
  });
  // b cannot finish before a's operation ends: wait until it is seen waiting.
  const auto give_up = std::chrono::steady_clock::now() + 10s;
  while (budget.stats().waits == 0 && std::chrono::steady_clock::now() < give_up) std::this_thread::sleep_for(1ms);
  CHECK(budget.stats().waits == 1);
  std::this_thread::sleep_for(5ms);
  CHECK_FALSE(done.load());
  CHECK(a.residence_of(held) == residence::device);
  a.idle();
  waiter.join();
  CHECK(done.load());
  CHECK(b.residence_of(wanted) == residence::device);
  CHECK(a.residence_of(held) == residence::host);
  CHECK(b.stats().waits == 1);
  CHECK(budget.stats().cross_evictions == 1);
  CHECK(world.gpu.physical_bytes() <= 8 * G);
  CHECK(world.gpu.violations() == 0);
}

TEST_CASE("threads: of two workloads that each pin part of what the other needs, the first to wait goes first") {
  sim_world world;
  shared_budget budget(8 * G);
  workload_scheduler<sim_buffer, lru_policy> a(budget, "a", lru_policy{});
  workload_scheduler<sim_buffer, lru_policy> b(budget, "b", lru_policy{});
  const allocation_id a1 = a.manage(world.make(3 * G, true));
  const allocation_id a2 = a.manage(world.make(3 * G, false));
  const allocation_id b1 = b.manage(world.make(3 * G, true));
  const allocation_id b2 = b.manage(world.make(3 * G, false));
  b.will_use(b1);  // b pins 3G; 2G are free
  const auto wait_for = [&](std::uint64_t waits) {
    const auto give_up = std::chrono::steady_clock::now() + 10s;
    while (budget.stats().waits < waits && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(1ms);
    }
    return budget.stats().waits;
  };

  std::atomic<bool> a_done{false};
  std::atomic<bool> b_done{false};
  // a needs 3G more: it waits, pinning a1 (b's operation pins b1).
  std::thread first([&] {
    a.will_use({a1, a2});
    a_done = true;
  });
  const bool a_waits = wait_for(1) >= 1;
  // b's next operation needs b1 and 3G more: it waits too, behind a, and a may take b1.
  std::thread second([&] {
    b.will_use({b1, b2});
    b_done = true;
  });
  first.join();
  CHECK(a_waits);
  CHECK(a.residence_of(a1) == residence::device);
  CHECK(a.residence_of(a2) == residence::device);
  CHECK(b.residence_of(b1) == residence::host);  // taken from b, the younger waiter
  const bool b_waits = wait_for(2) >= 2;  // b may wait more than once (for b2, then for b1)
  std::this_thread::sleep_for(5ms);
  const bool b_early = b_done.load();  // a still pins 6G of 8G
  a.idle();
  second.join();
  CHECK(b_waits);
  CHECK_FALSE(b_early);
  CHECK(b_done.load());
  CHECK(b.residence_of(b1) == residence::device);
  CHECK(b.residence_of(b2) == residence::device);
  CHECK(a.residence_of(a1) == residence::host);
  CHECK(a.residence_of(a2) == residence::host);
  CHECK(budget.stats().timeouts == 0);
  CHECK(world.gpu.physical_bytes() <= 8 * G);
  CHECK(world.gpu.violations() == 0);
}

TEST_CASE("threads: two workloads on their own threads stay within the shared budget") {
  sim_world world;
  const std::size_t budget_bytes = 30 * G;
  shared_budget budget(budget_bytes);
  workload<sim_planned> a(budget, "a", planned_policy(test_link));
  workload<sim_planned> b(budget, "b", planned_policy(test_link));
  make_sweep(a, world, {4 * G, 2 * G, 3 * G, 4 * G, 2 * G, 4 * G, 3 * G, 2 * G});
  make_sweep(b, world, {4 * G, 4 * G, 4 * G, 4 * G});
  std::atomic<int> broken{0};
  std::atomic<int> ops{0};
  const auto drive = [&](auto& w, std::size_t first_buffer) {
    const auto check = [&](const std::vector<allocation_id>& use) {
      for (allocation_id id : use) {
        if (world.buffers[first_buffer + id]->residence_of(0) != residence::device) ++broken;
      }
      if (world.gpu.physical_bytes() > budget_bytes) ++broken;
      ++ops;
    };
    for (int i = 0; i < 6; ++i) w.run_iteration(check);
  };
  std::thread ta([&] { drive(a, 0); });
  std::thread tb([&] { drive(b, 8); });
  ta.join();
  tb.join();
  CHECK(broken.load() == 0);
  CHECK(ops.load() == 6 * 8 + 6 * 4);
  CHECK(budget.stats().peak_used <= budget_bytes);
  CHECK(budget.stats().timeouts == 0);
  CHECK(world.gpu.violations() == 0);
}

TEST_CASE("threads: workloads arrive and leave while another runs") {
  sim_world world;
  const std::size_t budget_bytes = 20 * G;
  shared_budget budget(budget_bytes);
  workload<sim_planned> a(budget, "a", planned_policy(test_link));
  make_sweep(a, world, {4 * G, 2 * G, 3 * G, 4 * G, 2 * G, 4 * G, 3 * G, 2 * G});
  std::atomic<int> broken{0};
  std::atomic<bool> stop{false};
  std::thread runner([&] {
    const auto check = [&](const std::vector<allocation_id>& use) {
      for (allocation_id id : use) {
        if (world.buffers[id]->residence_of(0) != residence::device) ++broken;
      }
      if (budget.used() > budget_bytes) ++broken;
    };
    int iterations = 0;
    while (!stop.load() || iterations < 3) {
      a.run_iteration(check);
      ++iterations;
    }
  });
  // Visitors, one after another: each arrives with 12G on the device, runs, and leaves; its
  // memory goes with it (buffers made and destroyed here, outside the shared world).
  for (int v = 0; v < 4; ++v) {
    std::vector<std::unique_ptr<sim_buffer>> memory;
    for (int i = 0; i < 3; ++i) {
      memory.push_back(std::make_unique<sim_buffer>(sim_provider(world.gpu), sim_host_provider(world.gpu),
                                                    sim_reserver(world.gpu), sim_copier(world.gpu), 4 * G, 4 * G));
      memory.back()->commit(0, 4 * G);
    }
    workload_scheduler<sim_buffer, lru_policy> visitor(budget, "visitor " + std::to_string(v), lru_policy{});
    std::vector<allocation_id> ids;
    for (auto& m : memory) ids.push_back(visitor.manage(*m));
    for (int iteration = 0; iteration < 3; ++iteration) {
      visitor.iteration_begin();
      for (std::size_t k = 0; k < ids.size(); ++k) {
        visitor.will_use({ids[k], ids[(k + 1) % ids.size()]});
        if (memory[k]->residence_of(0) != residence::device) ++broken;
        if (budget.used() > budget_bytes) ++broken;
      }
    }
    CHECK(budget.snapshot().size() == 2);
  }
  stop = true;
  runner.join();
  CHECK(broken.load() == 0);
  CHECK(budget.snapshot().size() == 1);
  CHECK(budget.used() == a.scheduler.stats().device_bytes);
  CHECK(budget.stats().timeouts == 0);
  CHECK(world.gpu.violations() == 0);
}
