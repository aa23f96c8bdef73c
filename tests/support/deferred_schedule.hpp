// Six allocations (72 MiB) of a stitching allocator over the evented simulated device, with far
// memory, each managed by a workload_scheduler with deferred moves under a 40 MiB budget; the
// work runs on one stream whose queued work the test completes by hand (event_log::complete).
// The allocation_memory and handover tests drive it step by step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/sim.hpp"
#include "glake/scheduling/allocation_memory.hpp"
#include "glake/scheduling/budget.hpp"
#include "glake/scheduling/lru_policy.hpp"
#include "glake/scheduling/scheduler.hpp"
#include "support/evented_reserver.hpp"
#include "support/step_clock.hpp"

namespace glake::testing {

struct deferred_schedule {
  using alloc = stitching_allocator<sim_provider, evented_reserver>;
  using memory = allocation_memory<alloc>;
  static constexpr std::size_t budget_bytes = 40 * MiB;

  sim_device gpu{256 * MiB, 2 * MiB, 256 * MiB};
  event_log log;
  alloc a{sim_provider(gpu), evented_reserver(gpu, log)};
  const stream_ref work{std::uintptr_t{1}};
  const std::vector<std::size_t> sizes = {16 * MiB, 8 * MiB, 12 * MiB, 16 * MiB, 8 * MiB, 12 * MiB};
  std::vector<void*> blocks;
  std::vector<std::unique_ptr<memory>> memories;
  shared_budget budget{budget_bytes};
  step_clock clock;
  workload_scheduler<memory, lru_policy, step_clock> w;
  std::vector<allocation_id> ids;

  deferred_schedule() : w(budget, "tensors", lru_policy{}, options(work), clock) {
    a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu));
    for (std::size_t n : sizes) {
      blocks.push_back(a.allocate(n, work));
      memories.push_back(std::make_unique<memory>(a, blocks.back(), n));
    }
    for (auto& m : memories) ids.push_back(w.manage(*m));
  }

  /// The scheduler lets go of every allocation, and every pending move completes.
  void unmanage_all() {
    w.idle();
    for (allocation_id id : ids) w.unmanage(id);
    a.complete_moves(true);
  }

  /// Frees the allocations (bringing back those away first).
  void free_all() {
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      if (a.residence_of(blocks[i]) == residence::host) a.prefetch(blocks[i], work);
      a.deallocate(blocks[i], sizes[i], work);
    }
    a.verify();
  }

 private:
  static scheduler_options options(stream_ref stream) {
    scheduler_options o;
    o.stream = stream;
    o.moves = move_completion::deferred;
    return o;
  }
};

}  // namespace glake::testing
