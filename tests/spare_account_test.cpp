// spare_account: an allocator's spare device handles as a workload of a budget. The grant bounds
// the spares, a request never moves anything out, and a reclaim (another workload of the process,
// or another process through the coordinator) takes the spares first, released at once, on the
// simulated device.
#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <thread>

#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/sim.hpp"
#include "glake/scheduling/budget.hpp"
#include "glake/scheduling/budget_coordinator.hpp"
#include "glake/scheduling/coordinated_budget.hpp"
#include "glake/scheduling/spare_account.hpp"
#include "support/processes.hpp"

namespace {

using namespace glake;
using namespace std::chrono_literals;
constexpr std::size_t M = MiB;
using sim_alloc = stitching_allocator<sim_provider, sim_reserver>;
static_assert(spare_keeping_allocator<sim_alloc>);

struct nothing_to_give final : budget_member {
  std::optional<victim> offer_victim(const ask&) override { return std::nullopt; }
  std::size_t evict(const ask&, allocation_id) override { return 0; }
};

struct world {
  sim_device gpu{256 * M, 2 * M, 256 * M};
  sim_alloc a{sim_provider(gpu), sim_reserver(gpu), [] {
                config c;
                c.move_spares = 64 * M;  // the account sets the bound: what the budget grants
                return c;
              }()};
  world() { a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu), far_residence::unmapped); }
};

}  // namespace

TEST_CASE("spare_account: spares stay within the grant, and a workload that needs the room takes them first") {
  world w;
  shared_budget budget(64 * M);
  std::optional<spare_account<sim_alloc>> spares(std::in_place, budget, w.a);
  CHECK(w.a.settings().move_spares == 0);  // nothing kept before a grant
  CHECK(spares->request(16 * M) == 16 * M);
  CHECK(budget.used() == 16 * M);
  CHECK(w.a.settings().move_spares == 16 * M);

  void* p = w.a.allocate(32 * M);
  const std::size_t device = w.gpu.physical_bytes();
  w.a.offload(p);
  CHECK(w.a.stats().spare_bytes == 16 * M);  // 8 of its 16 handles kept: the grant
  CHECK(w.gpu.physical_bytes() == device - 16 * M);
  w.a.verify();

  // Another workload needs all but 8 MiB: the spares go, at once.
  nothing_to_give other;
  const workload_id o = budget.join("trainer", other);
  CHECK_FALSE(budget.acquire(o, 56 * M, 1s));  // no wait: the spares were moved out
  CHECK(spares->granted() == 0);
  CHECK(spares->evictions() == 1);
  CHECK(w.a.stats().spare_bytes == 0);
  CHECK(w.gpu.physical_bytes() == device - 32 * M);
  CHECK(budget.used() == 56 * M);

  // A request finds no room and moves nothing out: the allocator keeps no spare.
  CHECK(spares->request(16 * M) == 0);
  CHECK(budget.usage(o).held == 56 * M);
  w.a.prefetch(p);
  w.a.offload(p);
  CHECK(w.a.stats().spare_bytes == 0);
  // Room again: granted, and a smaller request gives back what is above it, spares first.
  budget.release(o, 56 * M);
  CHECK(spares->request(16 * M) == 16 * M);
  w.a.prefetch(p);
  w.a.offload(p);
  CHECK(w.a.stats().spare_bytes == 16 * M);
  CHECK(spares->request(4 * M) == 4 * M);
  CHECK(w.a.stats().spare_bytes <= 4 * M);
  CHECK(budget.used() == 4 * M);
  spares.reset();  // leaves: the spares go, the budget is whole again
  CHECK(w.a.stats().spare_bytes == 0);
  CHECK(budget.used() == 0);
  budget.leave(o);
  w.a.prefetch(p);
  w.a.deallocate(p, 32 * M);
  w.a.release_cached();
  CHECK(w.gpu.physical_bytes() == 0);
  CHECK(w.gpu.violations() == 0);
}

TEST_CASE("spare_account: under a coordinator another process's need takes the spares, released before the bytes move") {
  testing::temp_dir dir;
  budget_coordinator coordinator(dir.socket(), 64 * M);
  testing::channel stop;
  std::thread server([&] { coordinator.run(stop.fds[0]); });
  {
    world w;
    coordinated_budget mine(dir.socket(), 64 * M), theirs(dir.socket(), 64 * M);
    REQUIRE(mine.coordinated());
    REQUIRE(theirs.coordinated());
    spare_account<sim_alloc, coordinated_budget> spares(mine, w.a);
    CHECK(spares.request(32 * M) == 32 * M);
    void* p = w.a.allocate(32 * M);
    w.a.offload(p);
    CHECK(w.a.stats().spare_bytes == 32 * M);
    const std::size_t device = w.gpu.physical_bytes();

    nothing_to_give other;
    const workload_id o = theirs.join("other process", other);
    theirs.acquire(o, 48 * M, 5s);  // the coordinator reclaims from the process holding the spares
    CHECK(spares.granted() == 0);
    CHECK(spares.evictions() == 1);
    CHECK(w.a.stats().spare_bytes == 0);
    CHECK(w.gpu.physical_bytes() == device - 32 * M);
    theirs.release(o, 48 * M);
    theirs.leave(o);
    w.a.prefetch(p);
    w.a.deallocate(p, 32 * M);
  }
  stop.put('S');
  server.join();
  CHECK(coordinator.stats().peak_used <= 64 * M);
}
