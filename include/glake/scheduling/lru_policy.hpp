// The least-recently-used swap policy: with no record of what comes next, an allocation idle
// for longest is predicted to stay idle for longest.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "glake/scheduling/concepts.hpp"

namespace glake {

// ---------------------------------------------------------------------------------------------
// lru_policy
//
// Predicts an allocation's next use as far ahead as its last use lies behind: next_use(id, t) =
// t - last use (never_used for one not used yet). The furthest-next-use choice then evicts the
// least recently used allocation, across workloads too, since both sides are measured in
// nanoseconds. It prefetches nothing: memory comes back when an operation asks for it.
// Cyclic access over more than the budget is its worst case (every use misses); planned_policy
// is the answer to that.
// Complexity: O(1) per call; memory O(allocations). Thread safety: none (the scheduler locks).
// ---------------------------------------------------------------------------------------------
class lru_policy {
 public:
  void track(allocation_id id, std::size_t) {
    if (id >= last_use_.size()) last_use_.resize(id + 1, unused);
    last_use_[id] = unused;
  }
  void untrack(allocation_id id) noexcept {
    if (id < last_use_.size()) last_use_[id] = unused;
  }
  void iteration_begin(schedule_time) {}
  void use(std::span<const allocation_id> ids, schedule_time t) {
    for (allocation_id id : ids) {
      if (id < last_use_.size()) last_use_[id] = t;
    }
  }
  schedule_time next_use(allocation_id id, schedule_time t) const noexcept {
    if (id >= last_use_.size() || last_use_[id] == unused) return never_used;
    return t > last_use_[id] ? t - last_use_[id] : schedule_time::zero();
  }

 private:
  static constexpr schedule_time unused = schedule_time::min();
  std::vector<schedule_time> last_use_;
};
static_assert(swap_policy<lru_policy>);
static_assert(!prefetching_policy<lru_policy>);

}  // namespace glake
