// The planned swap policy: from a recorded iteration, each allocation's next use is known
// (Belady's furthest-next-use victims) and each prefetch starts early enough to hide its copy.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "glake/scheduling/access_trace.hpp"
#include "glake/scheduling/concepts.hpp"

namespace glake {

// ---------------------------------------------------------------------------------------------
// planned_policy
//
// Records every iteration's access_trace. Once `record_iterations` iterations have been seen,
// the last one becomes the plan, taken to repeat: its operations at positions 0..m-1 with their
// times, and for each allocation the positions where it is used. While the live operations match
// the plan, a cursor follows them and
//   - next_use(id) is the predicted time from the current operation to id's next use in the
//     plan (wrapping into the next iteration; never_used for an allocation the plan never uses);
//     victims are therefore chosen furthest-next-use first (Belady), across workloads too;
//   - after each operation, due_prefetches() lists the allocations whose copy back must start now:
//     for a use at position u whose previous use was at p (in this iteration or the previous
//     one), the prefetch point is the latest operation i in (p, u) with time(u) - time(i) >=
//     transfer cost (model.cost(bytes)), else p + 1, the earliest point after it was last needed
//     (the copy then overlaps as much as the gap allows). Adjacent uses get no prefetch point.
// When a live operation differs from the plan's next one (or an iteration ends early or late),
// the policy says so (divergences()) and falls back to least-recently-used predictions; the
// iteration it was in, recorded whole, becomes the new plan at the next iteration_begin
// (plans_built()). untrack of an allocation the plan uses also re-plans then.
//
// Complexity: planning O(U log m) for U uses over m operations (one binary search over the
// operation times per use); use() O(ids) plus O(1) to advance the cursor; next_use O(log k) over
// the k uses of that allocation. Memory O(U + allocations). Thread safety: none (the scheduler's
// lock covers it).
// ---------------------------------------------------------------------------------------------
class planned_policy {
 public:
  explicit planned_policy(transfer_model model = {}, unsigned record_iterations = 1)
      : model_(model), record_iterations_(record_iterations == 0 ? 1 : record_iterations) {}

  void track(allocation_id id, std::size_t bytes) {
    if (id >= bytes_.size()) {
      bytes_.resize(id + 1, 0);
      last_use_.resize(id + 1, unused);
    }
    bytes_[id] = bytes;
    last_use_[id] = unused;
  }
  void untrack(allocation_id id) noexcept {
    if (id >= bytes_.size()) return;
    bytes_[id] = 0;
    last_use_[id] = unused;
    if (planned() && id < uses_.size() && !uses_[id].empty()) diverge();
  }

  void iteration_begin(schedule_time t) {
    if (open_) {
      current_.finish(t - begin_);
      if (planned() && !diverged_ && cursor_ + 1 != static_cast<std::int64_t>(plan_.size())) diverge();
      ++seen_;
      // An iteration without operations plans nothing (a warm-up, an evaluation pass).
      if (((!planned() && seen_ >= record_iterations_) || diverged_) && !current_.empty()) build_plan();
    }
    current_.clear();
    begin_ = t;
    open_ = true;
    cursor_ = -1;
    diverged_ = false;
    due_.clear();
  }

  void use(std::span<const allocation_id> ids, schedule_time t) {
    due_.clear();
    for (allocation_id id : ids) {
      if (id < last_use_.size()) last_use_[id] = t;
    }
    if (!open_) return;  // nothing is recorded before the first iteration_begin
    current_.record(ids, t - begin_);
    if (!planned() || diverged_) return;
    const std::size_t next = static_cast<std::size_t>(cursor_ + 1);
    const auto expected = next < plan_.size() ? plan_.ids(next) : std::span<const allocation_id>{};
    if (next >= plan_.size() || !std::equal(ids.begin(), ids.end(), expected.begin(), expected.end())) {
      diverge();
      return;
    }
    cursor_ = static_cast<std::int64_t>(next);
    for (allocation_id id : triggers_[next]) {
      if (id < bytes_.size() && bytes_[id] != 0) due_.push_back(id);
    }
  }

  schedule_time next_use(allocation_id id, schedule_time t) const noexcept {
    if (planned() && !diverged_ && id < uses_.size() && id < bytes_.size() && bytes_[id] != 0) {
      const std::vector<std::uint32_t>& uses = uses_[id];
      if (uses.empty()) return never_used;
      const schedule_time now = cursor_ < 0 ? schedule_time::zero() : plan_[static_cast<std::size_t>(cursor_)].at;
      const auto after = std::upper_bound(uses.begin(), uses.end(), cursor_, [](std::int64_t c, std::uint32_t u) {
        return c < static_cast<std::int64_t>(u);
      });
      if (after != uses.end()) return plan_[*after].at - now;
      return plan_.duration() - now + plan_[uses.front()].at;
    }
    if (id >= last_use_.size() || last_use_[id] == unused) return never_used;
    return t > last_use_[id] ? t - last_use_[id] : schedule_time::zero();
  }

  std::span<const allocation_id> due_prefetches() const noexcept { return due_; }

  /// Whether a plan is being followed now.
  bool following() const noexcept { return planned() && !diverged_; }
  /// Plans made so far (the first, then one per re-plan).
  std::uint64_t plans_built() const noexcept { return plans_built_; }
  /// Times the live sequence left the plan.
  std::uint64_t divergences() const noexcept { return divergences_; }
  /// The plan's prefetch point for the use of `id` at position `use_position`, or -1 when that
  /// use has none; for tests and tools. O(operations).
  std::int64_t prefetch_point(allocation_id id, std::size_t use_position) const noexcept {
    for (std::size_t i = 0; i < triggers_.size(); ++i) {
      for (std::size_t k = 0; k < triggers_[i].size(); ++k) {
        if (triggers_[i][k] == id && trigger_uses_[i][k] == use_position) return static_cast<std::int64_t>(i);
      }
    }
    return -1;
  }
  const access_trace& plan() const noexcept { return plan_; }

 private:
  static constexpr schedule_time unused = schedule_time::min();

  bool planned() const noexcept { return plans_built_ != 0; }
  void diverge() noexcept {
    if (!diverged_) ++divergences_;
    diverged_ = true;
    due_.clear();
  }

  // Position i of the plan, or of the iteration before it for i < 0.
  schedule_time time_at(std::int64_t i) const noexcept {
    const std::int64_t m = static_cast<std::int64_t>(plan_.size());
    if (i >= 0) return plan_[static_cast<std::size_t>(i)].at;
    return plan_[static_cast<std::size_t>(i + m)].at - plan_.duration();
  }

  void build_plan() {
    std::swap(plan_, current_);
    ++plans_built_;
    const std::size_t m = plan_.size();
    for (auto& u : uses_) u.clear();
    triggers_.assign(m, {});
    trigger_uses_.assign(m, {});
    for (std::size_t i = 0; i < m; ++i) {
      for (allocation_id id : plan_.ids(i)) {
        if (id >= uses_.size()) uses_.resize(id + 1);
        if (uses_[id].empty() || uses_[id].back() != i) uses_[id].push_back(static_cast<std::uint32_t>(i));
      }
    }
    for (allocation_id id = 0; id < uses_.size(); ++id) {
      const std::vector<std::uint32_t>& uses = uses_[id];
      const schedule_time cost = model_.cost(id < bytes_.size() ? bytes_[id] : 0);
      for (std::size_t j = 0; j < uses.size(); ++j) {
        const std::int64_t u = uses[j];
        const std::int64_t previous =
            j > 0 ? std::int64_t{uses[j - 1]} : std::int64_t{uses.back()} - static_cast<std::int64_t>(m);
        if (previous + 1 >= u) continue;  // used by adjacent operations: it stays
        // The latest i in (previous, u) with time(u) - time(i) >= cost; times grow with i.
        const schedule_time latest_start = time_at(u) - cost;
        std::int64_t lo = previous + 1;
        std::int64_t hi = u - 1;
        std::int64_t point = previous + 1;
        while (lo <= hi) {
          const std::int64_t mid = lo + (hi - lo) / 2;
          if (time_at(mid) <= latest_start) {
            point = mid;
            lo = mid + 1;
          } else {
            hi = mid - 1;
          }
        }
        const std::size_t at = static_cast<std::size_t>(point < 0 ? point + static_cast<std::int64_t>(m) : point);
        triggers_[at].push_back(id);
        trigger_uses_[at].push_back(static_cast<std::size_t>(u));
      }
    }
  }

  transfer_model model_;
  unsigned record_iterations_;
  unsigned seen_ = 0;
  std::vector<std::size_t> bytes_;          ///< per id; 0: not tracked
  std::vector<schedule_time> last_use_;     ///< the fallback's record
  access_trace current_;
  access_trace plan_;
  std::vector<std::vector<std::uint32_t>> uses_;         ///< per id: plan positions using it
  std::vector<std::vector<allocation_id>> triggers_;     ///< per position: prefetches to start
  std::vector<std::vector<std::size_t>> trigger_uses_;   ///< the use each trigger serves
  std::vector<allocation_id> due_;
  schedule_time begin_{};
  std::int64_t cursor_ = -1;
  bool open_ = false;
  bool diverged_ = false;
  std::uint64_t plans_built_ = 0;
  std::uint64_t divergences_ = 0;
};
static_assert(swap_policy<planned_policy>);
static_assert(prefetching_policy<planned_policy>);

}  // namespace glake
