// The access sequence of one iteration of a workload: its operations in order, each with the
// allocations it uses and when it started.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "glake/scheduling/concepts.hpp"

namespace glake {

// ---------------------------------------------------------------------------------------------
// access_trace
//
// A plain value: operations in the order they ran, each a time (from the iteration's start) and
// a run of allocation ids, all ids in one array (no allocation per operation), plus the
// iteration's duration once it has ended. Two traces are equal when the same allocations were
// used in the same order; the times are not compared (a workload's timing jitters, its sequence
// does not). planned_policy records one per iteration and plans from it; a coordinator in
// another process could receive one as it is.
// Complexity: record O(ids), same_sequence O(total ids). Thread safety: a value; none.
// ---------------------------------------------------------------------------------------------
class access_trace {
 public:
  struct operation {
    schedule_time at{};      ///< start, from the iteration's start
    std::uint32_t first = 0; ///< its first id in ids()
    std::uint32_t count = 0;
  };

  void clear() noexcept {
    operations_.clear();
    ids_.clear();
    duration_ = schedule_time::zero();
  }
  void record(std::span<const allocation_id> ids, schedule_time at) {
    ids_.insert(ids_.end(), ids.begin(), ids.end());
    operations_.push_back(operation{at, static_cast<std::uint32_t>(ids_.size() - ids.size()),
                                    static_cast<std::uint32_t>(ids.size())});
  }
  /// The iteration ended `d` after its start (at least just after its last operation).
  void finish(schedule_time d) noexcept {
    const schedule_time last = operations_.empty() ? schedule_time::zero() : operations_.back().at;
    duration_ = d > last ? d : last + schedule_time(1);
  }

  std::size_t size() const noexcept { return operations_.size(); }
  bool empty() const noexcept { return operations_.empty(); }
  const operation& operator[](std::size_t i) const noexcept { return operations_[i]; }
  std::span<const allocation_id> ids(std::size_t i) const noexcept {
    return {ids_.data() + operations_[i].first, operations_[i].count};
  }
  schedule_time duration() const noexcept { return duration_; }

  bool same_sequence(const access_trace& other) const noexcept {
    if (operations_.size() != other.operations_.size() || ids_ != other.ids_) return false;
    for (std::size_t i = 0; i < operations_.size(); ++i) {
      if (operations_[i].count != other.operations_[i].count) return false;
    }
    return true;
  }

 private:
  std::vector<operation> operations_;
  std::vector<allocation_id> ids_;
  schedule_time duration_{};
};

}  // namespace glake
