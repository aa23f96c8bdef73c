// One workload's swap scheduler: it keeps the workload's movable allocations within its share of
// a shared device budget, moving them out and back so that every operation finds its memory on
// the device.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "glake/errors.hpp"
#include "glake/movers/concepts.hpp"
#include "glake/scheduling/budget.hpp"
#include "glake/scheduling/concepts.hpp"
#include "glake/scheduling/lru_policy.hpp"
#include "glake/stream.hpp"

namespace glake {

/// How a workload_scheduler moves memory and how long it waits for the budget.
struct scheduler_options {
  stream_ref stream = default_stream;  ///< offloads and prefetches are queued here
  std::chrono::nanoseconds wait_timeout = std::chrono::seconds(30);  ///< then out_of_memory
  /// With memory that can (deferring_tiered_memory), moves do not wait for the device: their
  /// copies are queued and the memory is remapped later; will_use settles the moves of what it
  /// pins before returning. The thread that queues the work then never waits for the GPU to
  /// drain, but copies still run on `stream`, in line with the work queued there.
  move_completion moves = move_completion::on_return;
  /// Where deferrable memory's copies run (unset: on `stream`, in line with its work). On a stream
  /// of their own they start once the work queued on `stream` before the move has completed and
  /// run beside what is queued after it: with `moves` deferred, transfers overlap compute. Two
  /// streams let offloads and prefetches use the device's two copy directions at once.
  std::optional<stream_ref> offload_copies;
  std::optional<stream_ref> prefetch_copies;
};

/// A workload_scheduler's counters.
struct scheduler_statistics {
  std::uint64_t iterations = 0;
  std::uint64_t operations = 0;       ///< will_use calls
  std::uint64_t uses = 0;             ///< allocations named by them
  std::uint64_t ready = 0;            ///< uses that found their allocation on the device
  std::uint64_t demand_fetches = 0;   ///< uses whose allocation came back only when asked for
  std::uint64_t prefetches = 0;       ///< allocations brought back ahead of their use
  std::uint64_t skipped_prefetches = 0;  ///< tries that found no room without evicting sooner uses
  std::uint64_t offloads = 0;         ///< allocations moved out (asked by any workload)
  std::uint64_t offloaded_bytes = 0;
  std::uint64_t prefetched_bytes = 0; ///< ahead of time and on demand
  std::uint64_t waits = 0;            ///< operations that waited for the budget
  std::uint64_t reliefs = 0;          ///< allocations moved out because the device itself was full
  std::size_t managed_bytes = 0;      ///< all allocations it manages
  std::size_t device_bytes = 0;       ///< of them on the device now
  std::size_t peak_device_bytes = 0;
};

// ---------------------------------------------------------------------------------------------
// workload_scheduler
//
// Manages whole allocations (objects modelling tiered_memory, such as virtual_buffer) of one
// workload that shares a budget_service (a shared_budget in one process, a coordinated_budget
// across processes) with others. The framework says where iterations begin
// (iteration_begin) and, before each operation, which allocations it is about to use
// (will_use). will_use pins them (they are never moved out until the next operation, idle() or
// iteration_begin), tells the policy, brings back those on the host (acquiring their bytes from
// the budget, which moves out other memory, of any workload, furthest predicted next use first,
// or waits for room), and then, for a prefetching_policy, starts the prefetches it says are due
// when the budget has room or can make it from memory used later. On return every pinned
// allocation is on the device, or its copy back is queued on the stream before the work the
// framework queues next.
//
// The budget holds exactly the bytes of the managed allocations on the device (plus, briefly,
// bytes granted for a move about to be made): bytes are acquired before a prefetch and released
// after an offload, so device memory of managed allocations never exceeds the budget. An
// operation needing more than the whole budget throws out_of_memory naming the workload and the
// bytes (see budget_ledger::set_pinned).
//
// Complexity: will_use O(k) for its k allocations, plus per eviction O(allocations) of every
// workload (each offers its furthest-next-use victim); manage and the pointer lookup O(log n).
// Thread safety: one thread drives a workload (manage, will_use, iteration_begin, idle,
// unmanage); other workloads' threads move its unpinned memory out concurrently, under its
// mutex. The mutex is never held while waiting for the budget. While its own operation waits for
// room, its pinned allocations already on the device may be moved out for workloads that began
// waiting before it (they come back before it proceeds): of two workloads that each pin part of
// what the other needs, the first to wait goes first instead of both waiting forever.
// Streams: every move is queued on options.stream. Work on other streams that uses managed memory
// must be recorded on it (tiered_memory::record_stream) so that an offload waits for it. With
// options.moves deferred (memory that can defer), a move's remap comes after its call; will_use
// settles the pinned allocations' moves before it returns, so work queued after it finds them
// in place, and memory not pinned is never used by the workload (its use comes through will_use).
// Lifetime: managed memory must outlive the scheduler or be unmanaged first; the scheduler's
// share of the budget goes back when it is destroyed (or an allocation is unmanaged), wherever
// its memory then is: free it, or move it out first, or the device holds more than the budget
// says. Likewise memory handed to manage while on the device is there before the budget grants
// it (manage may move other memory out, or wait, to make the accounts right).
// ---------------------------------------------------------------------------------------------
template <tiered_memory Memory, swap_policy Policy = lru_policy, schedule_clock Clock = std::chrono::steady_clock,
          budget_service Budget = shared_budget>
class workload_scheduler final : public budget_member {
  struct slot {
    Memory* memory = nullptr;
    std::size_t bytes = 0;
    bool alive = false;
    bool on_device = false;
    bool pinned = false;
  };

 public:
  using memory_type = Memory;
  using policy_type = Policy;
  using budget_type = Budget;

  /// Joins `budget` as `name`. The policy and the clock are the scheduler's own.
  workload_scheduler(Budget& budget, std::string name, Policy policy = Policy{},
                     scheduler_options options = {}, Clock clock = Clock{})
      : budget_(budget),
        name_(std::move(name)),
        policy_(std::move(policy)),
        options_(options),
        clock_(std::move(clock)) {
    id_ = budget_.join(name_, *this);
  }
  workload_scheduler(const workload_scheduler&) = delete;
  workload_scheduler& operator=(const workload_scheduler&) = delete;
  /// Leaves the budget, giving back its share; managed memory stays where it is.
  ~workload_scheduler() { budget_.leave(id_); }

  workload_id id() const noexcept { return id_; }
  const std::string& name() const noexcept { return name_; }

  /// Manages `memory` from now on; it must be wholly on the device or wholly on the host (a
  /// virtual_buffer committed in full). Memory on the device takes its bytes from the budget,
  /// moving other memory out or waiting as will_use does. usage_error for memory with pieces
  /// nowhere or in both places, or already managed.
  allocation_id manage(Memory& memory) {
    const std::size_t bytes = memory.size();
    const residence first = memory.residence_of(0);
    const residence last = memory.residence_of(bytes - 1);
    if (first == residence::none || first != last) {
      throw usage_error(usage_error::kind::bad_argument,
                        "glake::workload_scheduler '" + name_ + "': memory at " + address(memory.data()) +
                            " must lie wholly on the device or wholly on the host (its first byte is on " +
                            to_string(first) + ", its last on " + to_string(last) + ")");
    }
    allocation_id id = 0;
    {
      std::lock_guard lock(mutex_);
      const auto base = reinterpret_cast<std::uintptr_t>(memory.data());
      const auto it = by_address_.find(base);
      if (it != by_address_.end()) {
        throw usage_error(usage_error::kind::bad_state, "glake::workload_scheduler '" + name_ + "': memory at " +
                                                               address(memory.data()) + " is managed already (id " +
                                                               std::to_string(it->second) + ")");
      }
      id = static_cast<allocation_id>(slots_.size());
      slots_.push_back(slot{&memory, bytes, true, false, false});
      try {
        by_address_.emplace(base, id);
        policy_.track(id, bytes);
      } catch (...) {
        by_address_.erase(base);
        slots_.pop_back();
        throw;
      }
      stats_.managed_bytes += bytes;
      budget_.set_predicted(id_, stats_.managed_bytes);
    }
    if (first == residence::device) {
      try {
        budget_.acquire(id_, bytes, options_.wait_timeout);
      } catch (...) {
        unmanage(id);
        throw;
      }
      std::lock_guard lock(mutex_);
      slots_[id].on_device = true;
      note_device(static_cast<std::ptrdiff_t>(bytes));
    }
    return id;
  }

  /// Stops managing `id`: its device bytes go back to the budget; the memory stays where it is.
  void unmanage(allocation_id id) {
    {
      std::lock_guard lock(mutex_);
      slot& s = live(id, "unmanage");
      if (s.on_device) {
        budget_.release(id_, s.bytes);
        note_device(-static_cast<std::ptrdiff_t>(s.bytes));
      }
      std::erase(op_, id);
      by_address_.erase(reinterpret_cast<std::uintptr_t>(s.memory->data()));
      policy_.untrack(id);
      stats_.managed_bytes -= s.bytes;
      s = slot{};
      budget_.set_pinned(id_, pinned_bytes());
    }
    budget_.changed();
  }

  /// The managed allocation holding `p`; usage_error when none does. O(log n).
  allocation_id find(const void* p) const {
    std::lock_guard lock(mutex_);
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    auto it = by_address_.upper_bound(a);
    if (it != by_address_.begin()) {
      --it;
      if (a - it->first < slots_[it->second].bytes) return it->second;
    }
    throw usage_error(usage_error::kind::foreign_pointer, "glake::workload_scheduler '" + name_ + "': " + address(p) +
                                                              " lies in no allocation it manages");
  }

  /// An iteration begins: nothing is pinned; the policy learns the boundary.
  void iteration_begin() {
    {
      std::lock_guard lock(mutex_);
      unpin_all();
      budget_.set_pinned(id_, 0);
      policy_.iteration_begin(now());
      ++stats_.iterations;
    }
    budget_.changed();
  }

  /// The operation about to run uses `ids` (see the class comment). Throws out_of_memory when
  /// they need more than the whole budget or the budget has no room for them within the timeout
  /// (nothing is pinned then), usage_error for an id it does not manage.
  void will_use(std::span<const allocation_id> ids) {
    {
      std::lock_guard lock(mutex_);
      for (allocation_id id : ids) live(id, "will_use");
      unpin_all();
      std::size_t bytes = 0;
      for (allocation_id id : ids) {
        if (slots_[id].pinned) continue;  // named twice
        slots_[id].pinned = true;
        op_.push_back(id);
        bytes += slots_[id].bytes;
        ++stats_.uses;
        if (slots_[id].on_device) ++stats_.ready;
      }
      try {
        budget_.set_pinned(id_, bytes);
      } catch (...) {
        unpin_all();
        budget_.set_pinned(id_, 0);
        throw;
      }
      policy_.use(op_, now());
      ++stats_.operations;
    }
    bring_in();
    if constexpr (prefetching_policy<Policy>) prefetch_due();
    budget_.changed();  // the previous operation's memory may move now
    if constexpr (deferring_tiered_memory<Memory>) {
      if (options_.moves == move_completion::deferred) {
        // What the operation uses must be where it is going before the work is queued on the
        // scheduler's stream (which may wait for copies itself, settle_on).
        std::lock_guard lock(mutex_);
        for (allocation_id id : op_) {
          if constexpr (requires(Memory& m) { m.settle_on(options_.stream); }) {
            slots_[id].memory->settle_on(options_.stream);
          } else {
            slots_[id].memory->settle();
          }
        }
      }
    }
  }
  void will_use(std::initializer_list<allocation_id> ids) {
    will_use(std::span<const allocation_id>(ids.begin(), ids.size()));
  }
  void will_use(allocation_id id) { will_use(std::span<const allocation_id>(&id, 1)); }
  void will_use(const void* p) { will_use(find(p)); }

  /// The current operation is over and no other is announced: nothing is pinned.
  void idle() {
    {
      std::lock_guard lock(mutex_);
      unpin_all();
      budget_.set_pinned(id_, 0);
    }
    budget_.changed();
  }

  /// Completes every pending (deferred) move of the memory it manages, waiting for the copies:
  /// before work that uses managed memory without will_use. Nothing for memory whose moves
  /// complete on return.
  void settle() {
    if constexpr (deferring_tiered_memory<Memory>) {
      std::lock_guard lock(mutex_);
      for (slot& s : slots_) {
        if (s.alive) s.memory->settle();
      }
    }
  }

  /// Moves this workload's unpinned memory out, furthest next use first, until `bytes` went or
  /// nothing unpinned is left on the device; the bytes moved. Settled: the device memory is free
  /// on return. For memory outside the budget that needs the device now, such as an allocation
  /// the device refused while the budget had room (another process's memory, or this one's
  /// unmanaged memory, fills it).
  std::size_t relieve(std::size_t bytes) {
    std::lock_guard lock(mutex_);
    return relieve_locked(bytes);
  }

  /// Where the scheduler keeps `id` now: device or host.
  residence residence_of(allocation_id id) const {
    std::lock_guard lock(mutex_);
    return live(id, "residence_of").on_device ? residence::device : residence::host;
  }

  scheduler_statistics stats() const {
    std::lock_guard lock(mutex_);
    return stats_;
  }

  /// Calls f(const Policy&) under the scheduler's lock (for tests and tools).
  template <class F>
  decltype(auto) inspect_policy(F&& f) const {
    std::lock_guard lock(mutex_);
    return std::forward<F>(f)(std::as_const(policy_));
  }

  // --- budget_member: called by the budget, from any thread ---

  std::optional<victim> offer_victim(const ask& a) override {
    std::unique_lock lock(mutex_, std::try_to_lock);
    if (!lock.owns_lock()) return std::nullopt;
    return furthest_locked(a, now());
  }

  std::size_t evict(const ask& a, allocation_id id) override {
    std::unique_lock lock(mutex_, std::try_to_lock);
    if (!lock.owns_lock() || id >= slots_.size()) return 0;
    return evict_locked(a, id);
  }

 private:
  // Under mutex_.
  std::size_t relieve_locked(std::size_t bytes) {
    const ask a{id_, 0, schedule_time::min(), true};
    const schedule_time t = now();
    std::size_t freed = 0;
    while (freed < bytes) {
      const std::optional<victim> best = furthest_locked(a, t);
      if (!best) break;
      const std::size_t got = evict_locked(a, best->id);
      if (got == 0) break;
      freed += got;
      ++stats_.reliefs;
    }
    return freed;
  }

  // Under mutex_: the movable allocation used furthest ahead (after a.later_than), if any.
  std::optional<victim> furthest_locked(const ask& a, schedule_time t) const {
    std::optional<victim> best;
    for (allocation_id id = 0; id < slots_.size(); ++id) {
      if (!movable(slots_[id], a)) continue;
      const schedule_time next = policy_.next_use(id, t);
      if (next > a.later_than && (!best || next > best->next_use)) best = victim{next, slots_[id].bytes, id};
    }
    return best;
  }

  // Under mutex_.
  std::size_t evict_locked(const ask& a, allocation_id id) {
    slot& s = slots_[id];
    if (!movable(s, a) || !(policy_.next_use(id, now()) > a.later_than)) return 0;
    offload_now(s);
    s.on_device = false;
    ++stats_.offloads;
    stats_.offloaded_bytes += s.bytes;
    note_device(-static_cast<std::ptrdiff_t>(s.bytes));
    if constexpr (deferring_tiered_memory<Memory>) {
      // The device memory is free before the bytes are given back. The move was queued, so a
      // failure to complete it still gives them back (the memory's residence says where it is).
      if (a.settle) {
        try {
          s.memory->settle();
        } catch (...) {
          budget_.release(id_, s.bytes);
          throw;
        }
      }
    }
    budget_.release(id_, s.bytes);
    return s.bytes;
  }

  static std::string address(const void* p) {
    char text[32];
    std::snprintf(text, sizeof text, "%p", p);
    return text;
  }

  schedule_time now() const { return std::chrono::duration_cast<schedule_time>(clock_.now().time_since_epoch()); }

  // Under mutex_.
  slot& live(allocation_id id, const char* what) {
    return const_cast<slot&>(std::as_const(*this).live(id, what));
  }
  const slot& live(allocation_id id, const char* what) const {
    if (id >= slots_.size() || !slots_[id].alive) {
      throw usage_error(usage_error::kind::foreign_pointer, "glake::workload_scheduler '" + name_ + "'::" + what +
                                                                ": allocation " + std::to_string(id) +
                                                                " is not managed (never, or no longer)");
    }
    return slots_[id];
  }
  // Pinned memory goes only to a waiter older than this workload's own wait.
  bool movable(const slot& s, const ask& a) const noexcept {
    return s.alive && s.on_device &&
           (!s.pinned || (ticket_ != 0 && a.ticket != 0 && a.ticket < ticket_ && a.asker != id_));
  }
  void unpin_all() noexcept {
    for (allocation_id id : op_) slots_[id].pinned = false;
    op_.clear();
  }
  std::size_t pinned_bytes() const noexcept {
    std::size_t bytes = 0;
    for (allocation_id id : op_) bytes += slots_[id].bytes;
    return bytes;
  }
  void note_device(std::ptrdiff_t delta) noexcept {
    stats_.device_bytes = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(stats_.device_bytes) + delta);
    stats_.peak_device_bytes = std::max(stats_.peak_device_bytes, stats_.device_bytes);
  }
  void offload_now(slot& s) {
    if constexpr (deferring_tiered_memory<Memory>) {
      s.memory->offload(0, s.bytes, options_.stream, options_.moves, options_.offload_copies.value_or(options_.stream));
    } else {
      s.memory->offload(0, s.bytes, options_.stream);
    }
  }
  void prefetch_now(slot& s) {
    if constexpr (deferring_tiered_memory<Memory>) {
      s.memory->prefetch(0, s.bytes, options_.stream, options_.moves,
                         options_.prefetch_copies.value_or(options_.stream));
    } else {
      s.memory->prefetch(0, s.bytes, options_.stream);
    }
    s.on_device = true;
    stats_.prefetched_bytes += s.bytes;
    note_device(static_cast<std::ptrdiff_t>(s.bytes));
  }

  // Brings every pinned allocation on the host back. While it does, workloads that started
  // waiting before it may move its pinned memory out (ticket_); it then brings that back too.
  void bring_in() {
    const auto deadline = std::chrono::steady_clock::now() + options_.wait_timeout;
    bool waited = false;
    for (;;) {
      std::vector<allocation_id> missing;
      std::size_t bytes = 0;
      std::uint64_t ticket = 0;
      {
        std::lock_guard lock(mutex_);
        for (allocation_id id : op_) {
          if (!slots_[id].on_device) {
            missing.push_back(id);
            bytes += slots_[id].bytes;
          }
        }
        if (missing.empty()) {
          ticket_ = 0;
          return;
        }
        if (ticket_ == 0) ticket_ = budget_.take_ticket();
        ticket = ticket_;
      }
      bool waited_now = false;
      try {
        const auto left = deadline - std::chrono::steady_clock::now();
        waited_now = budget_.acquire(id_, bytes, std::max(left, decltype(left)::zero()), ticket);
      } catch (...) {
        // The operation cannot run: nothing of it stays pinned.
        std::lock_guard lock(mutex_);
        ticket_ = 0;
        unpin_all();
        budget_.set_pinned(id_, 0);
        throw;
      }
      std::lock_guard lock(mutex_);
      if (!waited && waited_now) {
        waited = true;
        ++stats_.waits;
      }
      // Only this thread brings its memory back, and pinned memory stays pinned: every missing
      // allocation is still on the host.
      std::size_t done = 0;
      try {
        for (allocation_id id : missing) {
          try {
            prefetch_now(slots_[id]);
          } catch (const out_of_memory&) {
            // The budget had room but the device did not: what fills it is outside the budget.
            // This workload's unpinned memory goes first; the budget keeps its bytes.
            if (relieve_locked(slots_[id].bytes) == 0) throw;
            prefetch_now(slots_[id]);
          }
          ++stats_.demand_fetches;
          done += slots_[id].bytes;
        }
      } catch (...) {
        ticket_ = 0;
        budget_.release(id_, bytes - done);
        throw;
      }
    }
  }

  // Starts the prefetches the policy says are due, and retries those that found no room
  // before, each only if the budget has or can make room from memory used after it. A prefetch
  // stops being retried once it is done or its allocation is used (then it came on demand).
  void prefetch_due()
    requires prefetching_policy<Policy>
  {
    struct due {
      allocation_id id;
      std::size_t bytes;
      schedule_time next_use;
    };
    std::vector<due> list;
    {
      std::lock_guard lock(mutex_);
      for (allocation_id id : policy_.due_prefetches()) {
        if (std::find(deferred_.begin(), deferred_.end(), id) == deferred_.end()) deferred_.push_back(id);
      }
      std::erase_if(deferred_, [&](allocation_id id) {
        return id >= slots_.size() || !slots_[id].alive || slots_[id].on_device || slots_[id].pinned;
      });
      const schedule_time t = now();
      for (allocation_id id : deferred_) list.push_back(due{id, slots_[id].bytes, policy_.next_use(id, t)});
    }
    // Soonest use first.
    std::sort(list.begin(), list.end(), [](const due& x, const due& y) { return x.next_use < y.next_use; });
    for (const due& d : list) {
      if (!budget_.try_acquire(id_, d.bytes, d.next_use)) {
        std::lock_guard lock(mutex_);
        ++stats_.skipped_prefetches;
        continue;
      }
      std::lock_guard lock(mutex_);
      slot& s = slots_[d.id];
      if (!s.alive || s.on_device) {
        budget_.release(id_, d.bytes);
        continue;
      }
      try {
        prefetch_now(s);
        ++stats_.prefetches;
      } catch (const out_of_memory&) {
        // The device itself is full (memory outside the budget): a prefetch is only advice.
        budget_.release(id_, d.bytes);
        ++stats_.skipped_prefetches;
      }
    }
  }

  Budget& budget_;
  std::string name_;
  workload_id id_ = 0;
  mutable std::mutex mutex_;
  Policy policy_;
  scheduler_options options_;
  [[no_unique_address]] Clock clock_;
  std::vector<slot> slots_;
  std::map<std::uintptr_t, allocation_id> by_address_;
  std::vector<allocation_id> op_;  ///< the current operation's allocations (pinned)
  std::vector<allocation_id> deferred_;  ///< due prefetches not done yet (no room)
  std::uint64_t ticket_ = 0;       ///< its operation's wait for the budget (0: none)
  scheduler_statistics stats_;
};

}  // namespace glake
