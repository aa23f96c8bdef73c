// allocation_memory: one live allocation of the stitching allocator as tiered_memory, moved whole
// with its bytes (host backend), refusing ranges outside it, and kept under a budget by a
// workload_scheduler (simulated device: the device's own count stays within the budget).
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/host.hpp"
#include "glake/backends/sim.hpp"
#include "glake/scheduling/allocation_memory.hpp"
#include "glake/scheduling/budget.hpp"
#include "glake/scheduling/lru_policy.hpp"
#include "glake/scheduling/scheduler.hpp"
#include "support/deferred_schedule.hpp"
#include "support/evented_reserver.hpp"
#include "support/stamp.hpp"
#include "support/step_clock.hpp"

namespace {

using namespace glake;
using testing::stamp;
using testing::stamped;

constexpr std::size_t M = 1024 * 1024;

using host_alloc = stitching_allocator<host_provider, host_reserver>;
using sim_alloc = stitching_allocator<sim_provider, sim_reserver>;
static_assert(tiered_memory<allocation_memory<host_alloc>>);
static_assert(tiered_memory<allocation_memory<sim_alloc>>);
using evented_alloc = stitching_allocator<sim_provider, testing::evented_reserver>;
static_assert(deferring_tiered_memory<allocation_memory<evented_alloc>>);
static_assert(deferring_tiered_memory<allocation_memory<sim_alloc>>);

using testing::step_clock;
static_assert(schedule_clock<step_clock>);

}  // namespace

TEST_CASE("allocation_memory: the allocation moves whole, under the same pointer, with its bytes") {
  host_provider device(2 * M, 256 * M);
  host_alloc a(device, host_reserver(2 * M));
  host_provider far(2 * M);
  a.attach_far_memory(far, host_copier{});
  void* p = a.allocate(16 * M);
  stamp(p, 16 * M, 5);
  allocation_memory<host_alloc> m(a, p, 16 * M);
  CHECK(m.data() == p);
  CHECK(m.size() == 16 * M);
  CHECK(m.residence_of(16 * M - 1) == residence::device);

  m.offload(4 * M, 1);  // any range inside moves all of it
  CHECK(m.residence_of(0) == residence::host);
  CHECK(a.residence_of(p) == residence::host);
  CHECK(far.created_bytes() == 16 * M);
  CHECK(stamped(p, 16 * M, 5));
  CHECK_THROWS_AS(m.offload(0, 16 * M), usage_error);  // on the host already: the allocator's refusal

  m.prefetch(0, 16 * M);
  CHECK(m.residence_of(0) == residence::device);
  CHECK(far.created_bytes() == 16 * M);  // kept by the allocator for its next offload
  CHECK(stamped(p, 16 * M, 5));
  m.record_stream(stream_ref{});  // the allocator's own rules: the default stream is no other stream
  a.verify();
  a.deallocate(p, 16 * M);
}

TEST_CASE("allocation_memory: ranges outside the allocation and empty allocations are refused, nothing moves") {
  host_provider device(2 * M, 64 * M);
  host_alloc a(device, host_reserver(2 * M));
  host_provider far(2 * M);
  a.attach_far_memory(far, host_copier{});
  void* p = a.allocate(8 * M);
  allocation_memory<host_alloc> m(a, p, 8 * M);
  CHECK_THROWS_AS(m.residence_of(8 * M), usage_error);
  CHECK_THROWS_AS(m.offload(8 * M, 1), usage_error);
  CHECK_THROWS_AS(m.offload(0, 8 * M + 1), usage_error);
  CHECK_THROWS_AS(m.offload(4 * M, 0), usage_error);
  CHECK_THROWS_AS(m.prefetch(0, 9 * M), usage_error);
  CHECK(a.residence_of(p) == residence::device);
  CHECK(far.created_bytes() == 0);
  CHECK_THROWS_AS(allocation_memory<host_alloc>(a, nullptr, 8 * M), usage_error);
  CHECK_THROWS_AS(allocation_memory<host_alloc>(a, p, 0), usage_error);
  void* small = a.allocate(4096);  // the small pool's: it never moves, so it is refused up front
  CHECK_THROWS_AS(allocation_memory<host_alloc>(a, small, 4096), usage_error);
  host_alloc no_far(device, host_reserver(2 * M));
  void* q = no_far.allocate(8 * M);
  CHECK_THROWS_AS(allocation_memory<host_alloc>(no_far, q, 8 * M), usage_error);  // nowhere to move to
  no_far.deallocate(q, 8 * M);
  a.deallocate(small, 4096);
  a.deallocate(p, 8 * M);
}

TEST_CASE("allocation_memory: a workload_scheduler keeps allocator blocks within a budget below their sum") {
  sim_device gpu(256 * M, 2 * M, 256 * M);
  sim_alloc a{sim_provider(gpu), sim_reserver(gpu)};
  a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu));
  using memory = allocation_memory<sim_alloc>;
  const std::vector<std::size_t> sizes = {16 * M, 8 * M, 12 * M, 16 * M, 8 * M, 12 * M};  // 72 MiB
  std::vector<void*> blocks;
  std::vector<std::unique_ptr<memory>> memories;
  for (std::size_t s : sizes) {
    blocks.push_back(a.allocate(s));
    memories.push_back(std::make_unique<memory>(a, blocks.back(), s));
  }
  a.release_cached();
  REQUIRE(gpu.physical_bytes() == 72 * M);  // whole 2 MiB handles: the budget's count is exact

  const std::size_t budget_bytes = 40 * M;  // 55% of the sum
  {
    shared_budget budget(budget_bytes);
    step_clock clock;
    workload_scheduler<memory, lru_policy, step_clock> w(budget, "tensors", lru_policy{}, scheduler_options{}, clock);
    std::vector<allocation_id> ids;
    for (auto& m : memories) ids.push_back(w.manage(*m));  // on the device: earlier ones move out to fit
    CHECK(gpu.physical_bytes() <= budget_bytes);
    CHECK(budget.used() == gpu.physical_bytes());
    for (int iteration = 0; iteration < 3; ++iteration) {
      w.iteration_begin();
      for (std::size_t k = 0; k < ids.size(); ++k) {
        const allocation_id use[] = {ids[k], ids[(k + 1) % ids.size()]};
        w.will_use(std::span<const allocation_id>(use));
        CHECK(a.residence_of(blocks[k]) == residence::device);
        CHECK(a.residence_of(blocks[(k + 1) % ids.size()]) == residence::device);
        CHECK(gpu.physical_bytes() <= budget_bytes);
        CHECK(budget.used() == gpu.physical_bytes());  // the allocator keeps no moved memory cached
        clock.ns->fetch_add(100'000);
      }
    }
    CHECK(w.stats().offloads > 0);
    CHECK(w.stats().peak_device_bytes <= budget_bytes);
    w.idle();
    for (allocation_id id : ids) w.unmanage(id);
  }
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (a.residence_of(blocks[i]) == residence::host) a.prefetch(blocks[i]);
    a.deallocate(blocks[i], sizes[i]);
  }
  a.verify();
  CHECK(gpu.violations() == 0);
}

TEST_CASE("allocation_memory: a scheduler with deferred moves never waits on its stream but for what it uses") {
  testing::deferred_schedule f;
  auto& gpu = f.gpu;
  auto& log = f.log;
  auto& a = f.a;
  auto& w = f.w;
  const auto& ids = f.ids;
  const auto& blocks = f.blocks;
  log.complete(f.work);
  const std::size_t waits_before = log.waited;
  const scheduler_statistics stats_before = w.stats();
  for (int iteration = 0; iteration < 3; ++iteration) {
    w.iteration_begin();
    for (std::size_t k = 0; k < ids.size(); ++k) {
      const std::size_t waits = log.waited;
      const allocation_id use[] = {ids[k], ids[(k + 1) % ids.size()]};
      w.will_use(std::span<const allocation_id>(use));
      // What the operation uses is in place: no move of it is pending.
      for (void* p : {blocks[k], blocks[(k + 1) % ids.size()]}) {
        CHECK(a.residence_of(p) == residence::device);
        CHECK(a.movable_bytes(p) > 0);  // 0 while a move of it is pending
      }
      // Waits, if any, were for the moves of what it uses (one each at most).
      CHECK(log.waited - waits <= 2);
      CHECK(f.budget.used() <= f.budget_bytes);
      log.complete(f.work);  // the queued work (and copies) ran
      f.clock.ns->fetch_add(100'000);
    }
  }
  // Offloads never waited; only what an operation fetched on demand, right before its use.
  CHECK(w.stats().offloads > stats_before.offloads);
  CHECK(log.waited - waits_before <= w.stats().demand_fetches - stats_before.demand_fetches);
  // Whatever is still pending completes, as before an optimizer step that uses everything.
  w.settle();
  CHECK(a.complete_moves(true) == 0);
  for (std::size_t i = 0; i < blocks.size(); ++i) CHECK(w.residence_of(ids[i]) == a.residence_of(blocks[i]));
  f.unmanage_all();
  CHECK(gpu.physical_bytes() + gpu.host_bytes() >= 72 * M);
  f.free_all();
  CHECK(gpu.violations() == 0);
}

TEST_CASE("allocation_memory: a scheduler's copy streams wait for its stream by events, one per move") {
  using joining_alloc = stitching_allocator<sim_provider, testing::joining_reserver>;
  using memory = allocation_memory<joining_alloc>;
  static_assert(deferring_tiered_memory<memory>);
  sim_device gpu(256 * M, 2 * M, 256 * M);
  testing::event_log log;
  joining_alloc a{sim_provider(gpu), testing::joining_reserver(gpu, log)};
  a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu));
  const stream_ref work{std::uintptr_t{1}}, out{std::uintptr_t{2}}, in{std::uintptr_t{3}};
  std::vector<void*> blocks;
  std::vector<std::unique_ptr<memory>> memories;
  for (int i = 0; i < 6; ++i) {
    blocks.push_back(a.allocate(12 * M, work));
    memories.push_back(std::make_unique<memory>(a, blocks.back(), 12 * M));
  }
  {
    shared_budget budget(36 * M);
    step_clock clock;
    scheduler_options options;
    options.stream = work;
    options.moves = move_completion::deferred;
    options.offload_copies = out;
    options.prefetch_copies = in;
    workload_scheduler<memory, lru_policy, step_clock> w(budget, "tensors", lru_policy{}, options, clock);
    std::vector<allocation_id> ids;
    for (auto& m : memories) ids.push_back(w.manage(*m));
    for (int iteration = 0; iteration < 2; ++iteration) {
      w.iteration_begin();
      for (std::size_t k = 0; k < ids.size(); ++k) {
        w.will_use(ids[k]);
        CHECK(a.residence_of(blocks[k]) == residence::device);
        CHECK(a.movable_bytes(blocks[k]) > 0);  // settled: no move of it is pending
        CHECK(budget.used() <= 36 * M);
        for (stream_ref s : {work, out, in}) log.complete(s);
        clock.ns->fetch_add(100'000);
      }
    }
    const scheduler_statistics stats = w.stats();
    std::size_t offload_joins = 0, prefetch_joins = 0;
    for (const auto& [waiting, on] : log.joins) {
      CHECK(on == work);  // every copy waits for the work queued before its move
      offload_joins += waiting == out ? 1 : 0;
      prefetch_joins += waiting == in ? 1 : 0;
    }
    // A prefetch of a block whose offload is still pending undoes it, with no copy to order.
    CHECK(offload_joins <= stats.offloads);
    CHECK(offload_joins > 0);
    CHECK(prefetch_joins > 0);
    CHECK(prefetch_joins * 12 * M <= stats.prefetched_bytes);
    CHECK(offload_joins + prefetch_joins == log.joins.size());
    w.settle();
    CHECK(a.complete_moves(true) == 0);
    w.idle();
    for (allocation_id id : ids) w.unmanage(id);
  }
  for (void* p : blocks) {
    if (a.residence_of(p) == residence::host) a.prefetch(p, work);
    a.deallocate(p, 12 * M, work);
  }
  a.verify();
  CHECK(gpu.violations() == 0);
}

TEST_CASE("allocation_memory: memory moved out for another process has left the device when the bytes are given") {
  // A coordinator's reclaim asks with `settle`: the other process allocates the bytes as soon as
  // they are reported, so a deferred offload must have completed by then. A local victim's
  // offload stays deferred (this process's own allocations complete pending moves when short).
  sim_device gpu(256 * M, 2 * M, 256 * M);
  testing::event_log log;
  evented_alloc a{sim_provider(gpu), testing::evented_reserver(gpu, log)};
  a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu));
  using memory = allocation_memory<evented_alloc>;
  const stream_ref work{std::uintptr_t{1}};
  std::vector<void*> blocks;
  std::vector<std::unique_ptr<memory>> memories;
  for (int i = 0; i < 4; ++i) {
    blocks.push_back(a.allocate(16 * M, work));
    memories.push_back(std::make_unique<memory>(a, blocks.back(), 16 * M));
  }
  {
    shared_budget budget(64 * M);
    step_clock clock;
    scheduler_options options;
    options.stream = work;
    options.moves = move_completion::deferred;
    workload_scheduler<memory, lru_policy, step_clock> w(budget, "tensors", lru_policy{}, options, clock);
    std::vector<allocation_id> ids;
    for (auto& m : memories) ids.push_back(w.manage(*m));
    w.iteration_begin();
    for (allocation_id id : ids) {
      w.will_use(id);
      clock.ns->fetch_add(100'000);
    }
    w.idle();
    const std::size_t before = gpu.physical_bytes();

    // Local: the offload is queued, its device memory still held.
    CHECK(budget.move_out(budget_member::ask{}, 16 * M) == 16 * M);
    CHECK(gpu.physical_bytes() == before);
    CHECK(a.complete_moves(true) == 1);
    CHECK(gpu.physical_bytes() == before - 16 * M);

    // For another process: given back to the device before move_out returns.
    budget_member::ask remote;
    remote.settle = true;
    CHECK(budget.move_out(remote, 16 * M) == 16 * M);
    CHECK(gpu.physical_bytes() == before - 32 * M);
    CHECK(a.complete_moves(true) == 0);
    CHECK(budget.used() == 32 * M);
    for (allocation_id id : ids) w.unmanage(id);
  }
  for (void* p : blocks) {
    if (a.residence_of(p) == residence::host) a.prefetch(p, work);
    a.deallocate(p, 16 * M, work);
  }
  a.verify();
  CHECK(gpu.violations() == 0);
}

TEST_CASE("allocation_memory: a use the device refuses while the budget has room moves the workload's own memory out") {
  // 64 MiB of device, a 64 MiB budget over four 16 MiB blocks, and 16 MiB the budget does not
  // see (another allocation): bringing the fourth block in finds the budget with room and the
  // device full. The workload's unpinned memory goes (relieve), the pinned stays, the use runs.
  sim_device gpu(64 * M, 2 * M, 256 * M);
  sim_alloc a{sim_provider(gpu), sim_reserver(gpu)};
  a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu));
  using memory = allocation_memory<sim_alloc>;
  std::vector<void*> blocks;
  std::vector<std::unique_ptr<memory>> memories;
  for (int i = 0; i < 4; ++i) {
    blocks.push_back(a.allocate(16 * M));
    memories.push_back(std::make_unique<memory>(a, blocks.back(), 16 * M));
  }
  a.offload(blocks[3]);
  void* outside = a.allocate(16 * M);  // the memory the budget does not see
  {
    shared_budget budget(64 * M);
    step_clock clock;
    workload_scheduler<memory, lru_policy, step_clock> w(budget, "tensors", lru_policy{}, scheduler_options{}, clock);
    std::vector<allocation_id> ids;
    for (auto& m : memories) ids.push_back(w.manage(*m));
    CHECK(budget.used() == 48 * M);
    const allocation_id pair[] = {ids[0], ids[3]};
    w.will_use(std::span<const allocation_id>(pair));
    CHECK(a.residence_of(blocks[0]) == residence::device);  // pinned: stayed
    CHECK(a.residence_of(blocks[3]) == residence::device);  // brought in
    CHECK(w.stats().reliefs == 1);
    CHECK(budget.used() == 48 * M);  // one block went, one came
    CHECK(gpu.physical_bytes() <= 64 * M);

    // relieve moves unpinned memory out at once, and never what the operation pins.
    CHECK(w.relieve(64 * M) == 16 * M);
    CHECK(a.residence_of(blocks[0]) == residence::device);
    CHECK(a.residence_of(blocks[3]) == residence::device);
    CHECK(budget.used() == 32 * M);
    w.idle();
    for (allocation_id id : ids) w.unmanage(id);
  }
  a.deallocate(outside, 16 * M);
  for (void* p : blocks) {
    if (a.residence_of(p) == residence::host) a.prefetch(p);
    a.deallocate(p, 16 * M);
  }
  a.verify();
  CHECK(gpu.violations() == 0);
}
