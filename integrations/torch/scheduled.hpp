// The plug-in's swap schedulers: a workload_scheduler over the allocator's own blocks (tensors
// glake allocated), within a budget of this process (shared_budget) or of every process on the
// GPU (coordinated_budget and a glake-budget coordinator), driven through the C interface.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "glake/errors.hpp"
#include "glake/movers/concepts.hpp"
#include "glake/scheduling/budget.hpp"
#include "glake/scheduling/coordinated_budget.hpp"
#include "glake/scheduling/planned_policy.hpp"
#include "glake/scheduling/scheduler.hpp"
#include "glake/stream.hpp"

namespace glake::torch_plugin {

// ---------------------------------------------------------------------------------------------
// plugin_block
//
// The tiered_memory of one live allocation [p, p + bytes) of a pluggable_allocator's devices:
// moved whole by the allocator that holds it (offload / prefetch by pointer, in that device's
// context), as allocation_memory moves one allocator's allocation, deferred or not. Ranges
// outside it are refused; residence_of throws usage_error once nothing holds p live any more.
// ---------------------------------------------------------------------------------------------
template <class Plugin>
class plugin_block {
 public:
  plugin_block(Plugin& plugin, void* p, std::size_t bytes) : plugin_(&plugin), data_(p), size_(bytes) {
    if (p == nullptr || bytes == 0) throw usage_error(usage_error::kind::bad_argument, "a null or empty allocation");
    const std::optional<residence> where = plugin.residence_of(p);
    if (!where) {
      throw usage_error(usage_error::kind::foreign_pointer, "it is not the first address of a live allocation of glake's allocator");
    }
    if (*where == residence::device && plugin.movable_bytes(p) == 0) {
      throw usage_error(usage_error::kind::bad_argument,
                        "it cannot move: it holds no whole handle of its own (its memory shares handles with its "
                        "neighbours), or it is a small allocation");
    }
  }
  void* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  residence residence_of(std::size_t offset) const {
    check("residence_of", offset, 1);
    const std::optional<residence> r = plugin_->residence_of(data_);
    if (!r) throw usage_error(usage_error::kind::foreign_pointer, "the allocation is not live any more");
    return *r;
  }
  // Deferred moves (deferring_tiered_memory): the allocator remaps once the copies are done;
  // settle() completes the move before the block is used.
  // With `copies`, the copies run there after the work queued on `stream`.
  void offload(std::size_t offset, std::size_t bytes, stream_ref stream,
               move_completion when = move_completion::on_return) {
    offload(offset, bytes, stream, when, stream);
  }
  void prefetch(std::size_t offset, std::size_t bytes, stream_ref stream,
                move_completion when = move_completion::on_return) {
    prefetch(offset, bytes, stream, when, stream);
  }
  void offload(std::size_t offset, std::size_t bytes, stream_ref stream, move_completion when, stream_ref copies) {
    check("offload", offset, bytes);
    plugin_->offload(data_, stream, when, copies);
  }
  void prefetch(std::size_t offset, std::size_t bytes, stream_ref stream, move_completion when, stream_ref copies) {
    check("prefetch", offset, bytes);
    plugin_->prefetch(data_, stream, when, copies);
  }
  void settle() { plugin_->complete_move(data_); }
  void settle_on(stream_ref stream) { plugin_->ready_on(data_, stream); }
  void record_stream(stream_ref stream) noexcept { plugin_->record_stream(data_, stream); }

 private:
  void check(const char* who, std::size_t offset, std::size_t bytes) const {
    if (bytes == 0 || offset >= size_ || bytes > size_ - offset) {
      throw usage_error(usage_error::kind::bad_argument, std::string(who) + ": a range outside the allocation");
    }
  }
  Plugin* plugin_;
  void* data_;
  std::size_t size_;
};

/// One scheduled workload as the C interface sees it.
class scheduled_workload {
 public:
  virtual ~scheduled_workload() = default;
  /// Manages the live allocation at p of `bytes` (usage_error: not live, managed already).
  virtual void manage(void* p, std::size_t bytes) = 0;
  /// Stops managing it; its memory stays where it is.
  virtual void unmanage(void* p) = 0;
  /// The next operation uses these (any address inside managed allocations): on the device on return.
  virtual void will_use(std::span<void* const> pointers) = 0;
  virtual void iteration_begin() = 0;
  virtual void idle() = 0;
  /// Every pending (deferred) move of its allocations is complete.
  virtual void settle() = 0;
  virtual scheduler_statistics stats() const = 0;
  /// Moves unpinned managed memory out (settled) until `bytes` went: an allocation the device
  /// refused retries then. The bytes moved.
  virtual std::size_t relieve(std::size_t bytes) = 0;

  /// The device whose allocator holds its blocks.
  int device = -1;
  /// What must outlive the scheduler, such as the copy streams its options name; released after
  /// it (a base member outlives the derived one's scheduler).
  std::shared_ptr<void> resources;
};

/// The names of the values glake_scheduler_stats writes, in order.
inline constexpr const char* scheduler_stat_names =
    "iterations,operations,uses,ready,demand_fetches,prefetches,skipped_prefetches,offloads,offloaded_bytes,"
    "prefetched_bytes,waits,managed_bytes,device_bytes,peak_device_bytes,reliefs";

inline std::size_t write_scheduler_stats(const scheduler_statistics& s, std::uint64_t* values, std::size_t capacity) {
  const std::uint64_t all[] = {s.iterations,      s.operations,       s.uses,         s.ready,
                               s.demand_fetches,  s.prefetches,       s.skipped_prefetches,
                               s.offloads,        s.offloaded_bytes,  s.prefetched_bytes,
                               s.waits,           s.managed_bytes,    s.device_bytes, s.peak_device_bytes,
                               s.reliefs};
  for (std::size_t i = 0; i < capacity && i < std::size(all); ++i) values[i] = all[i];
  return std::size(all);
}

// ---------------------------------------------------------------------------------------------
// scheduled_workload_of<Plugin, Budget>
//
// A planned_policy workload_scheduler over plugin_blocks, with a budget of its own: a
// shared_budget of `budget_bytes` (this process alone), or a coordinated_budget joining the
// coordinator at a socket (alone with budget_bytes when none answers, which it says once). The
// blocks are kept by their first address. One thread drives it (the C interface's calls are
// serialised by the caller); reclaims from other processes come on the coordinated budget's
// thread, under the scheduler's own lock.
// ---------------------------------------------------------------------------------------------
template <class Plugin, class Budget>
class scheduled_workload_of final : public scheduled_workload {
  using block = plugin_block<Plugin>;
  using scheduler = workload_scheduler<block, planned_policy, std::chrono::steady_clock, Budget>;

 public:
  template <class... BudgetArgs>
  scheduled_workload_of(Plugin& plugin, std::string name, scheduler_options options, BudgetArgs&&... args)
      : plugin_(plugin),
        budget_(std::make_unique<Budget>(std::forward<BudgetArgs>(args)...)),
        scheduler_(std::make_unique<scheduler>(*budget_, std::move(name), planned_policy{}, options)) {}
  ~scheduled_workload_of() override {
    scheduler_.reset();  // leaves the budget before the blocks it names go
  }

  void manage(void* p, std::size_t bytes) override {
    const auto key = reinterpret_cast<std::uintptr_t>(p);
    if (blocks_.contains(key)) throw usage_error(usage_error::kind::bad_state, "the allocation is managed already");
    auto b = std::make_unique<block>(plugin_, p, bytes);
    const allocation_id id = scheduler_->manage(*b);
    try {
      blocks_.emplace(key, entry{std::move(b), id});
    } catch (...) {
      scheduler_->unmanage(id);
      throw;
    }
  }
  void unmanage(void* p) override {
    auto it = blocks_.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == blocks_.end()) throw usage_error(usage_error::kind::foreign_pointer, "it starts no managed allocation");
    scheduler_->unmanage(it->second.id);
    blocks_.erase(it);
  }
  void will_use(std::span<void* const> pointers) override {
    std::vector<allocation_id> ids;
    ids.reserve(pointers.size());
    for (void* p : pointers) ids.push_back(scheduler_->find(p));
    scheduler_->will_use(std::span<const allocation_id>(ids));
  }
  void iteration_begin() override { scheduler_->iteration_begin(); }
  void idle() override { scheduler_->idle(); }
  void settle() override { scheduler_->settle(); }
  scheduler_statistics stats() const override { return scheduler_->stats(); }
  std::size_t relieve(std::size_t bytes) override { return scheduler_->relieve(bytes); }

 private:
  struct entry {
    std::unique_ptr<block> memory;
    allocation_id id = 0;
  };
  Plugin& plugin_;
  std::unique_ptr<Budget> budget_;
  std::map<std::uintptr_t, entry> blocks_;
  std::unique_ptr<scheduler> scheduler_;
};

}  // namespace glake::torch_plugin
