// One device budget shared by the workloads of a process: grants device bytes, moves memory out
// of whichever workload uses it last to make room, and makes a workload wait when nothing can be
// moved.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "glake/errors.hpp"
#include "glake/scheduling/budget_ledger.hpp"
#include "glake/scheduling/concepts.hpp"

namespace glake {

// ---------------------------------------------------------------------------------------------
// budget_member
//
// What a workload offers the budget it joined: its best victim, and moving that victim out on
// request. workload_scheduler implements it. Both calls come from other workloads' threads (and
// from its own, while it waits for the budget) and must never block on the member's own work:
// a member that is busy answers "nothing" (try-lock), and the asker looks elsewhere or retries.
//
// An ask names who asks, the ticket of its wait (0: it is not waiting; tickets come from
// shared_budget::take_ticket, older ones are smaller) and the time after which a victim's next
// use must lie. Memory pinned by the member's current operation is offered only to an asker
// whose ticket is older than the member's own wait: of the workloads waiting for room, the
// oldest may take what the younger ones pinned, never the reverse, so waiters neither deadlock
// nor take turns forever.
//
// | expression                 | returns                        | meaning
// |----------------------------|--------------------------------|---------------------------------
// | m.offer_victim(ask)        | optional<victim>               | the allocation it would move out
// |                            |                                | first for `ask`; empty when none,
// |                            |                                | or busy
// | m.evict(ask, id)           | size_t (throws what offload    | moves `id` out if it still
// |                            | throws)                        | qualifies and gives its bytes
// |                            |                                | back; the bytes, or 0
// ---------------------------------------------------------------------------------------------
class budget_member {
 public:
  struct ask {
    workload_id asker = 0;
    std::uint64_t ticket = 0;                          ///< 0: not waiting
    schedule_time later_than = schedule_time::min();   ///< victims used after this only
    /// The memory moved out must have left the device when evict returns (deferred moves
    /// complete first): the bytes go to another process, which allocates them at once.
    bool settle = false;
  };
  struct victim {
    schedule_time next_use{};
    std::size_t bytes = 0;
    allocation_id id = 0;
  };
  virtual std::optional<victim> offer_victim(const ask& a) = 0;
  virtual std::size_t evict(const ask& a, allocation_id id) = 0;

 protected:
  budget_member() = default;
  budget_member(const budget_member&) = default;
  budget_member& operator=(const budget_member&) = default;
  ~budget_member() = default;
};

/// A shared_budget's counters.
struct budget_statistics {
  std::uint64_t grants = 0;          ///< acquire / try_acquire calls that got their bytes
  std::uint64_t refusals = 0;        ///< try_acquire calls that did not
  std::uint64_t waits = 0;           ///< acquire calls that had to wait (back-pressure)
  std::uint64_t timeouts = 0;        ///< acquire calls that gave up
  std::uint64_t evictions = 0;       ///< allocations moved out to make room
  std::uint64_t cross_evictions = 0; ///< ... of them out of another workload than the asker
  std::size_t peak_used = 0;         ///< the most bytes held at once
};

// ---------------------------------------------------------------------------------------------
// shared_budget
//
// A budget_ledger behind a mutex, with the members that joined it. acquire(w, n): grant n bytes
// if they fit; otherwise ask every member for its best victim (the allocation with the furthest
// predicted next use it may give up), move out the furthest of all, and repeat until n fit or no
// member offers anything; then wait (back-pressure) until something changes (a release, a
// member's operation ending, a workload leaving) and try again, up to a timeout, after which
// out_of_memory names the workload, the bytes, and what every workload holds. try_acquire(w, n,
// t) is the same without waiting and moving out only victims used after t: a prefetch never
// evicts memory needed sooner than its own.
//
// Complexity: a grant O(log W); each eviction asks each of the W members for a victim (O(its
// allocations) for a workload_scheduler). A waiting acquire is woken by notifications, and looks
// again every millisecond regardless (a busy member answers nothing and need not say when it is
// free).
// Thread safety: every member function may be called from any thread. The budget's mutex is
// never held while a member is called; members are called only under a shared lock that leave()
// takes exclusively, so a member that left is never called again. Lock order: a member's own
// lock, then the budget's (a member may call release while holding its lock; the budget only
// try-locks members).
// Transport: the ledger's requests and replies are plain values; a coordinator serving several
// processes keeps a budget_ledger and does this class's loop with messages instead of calls.
// Lifetime: it must outlive every workload that joined it (a workload_scheduler leaves in its
// destructor).
// ---------------------------------------------------------------------------------------------
class shared_budget {
 public:
  explicit shared_budget(std::size_t budget_bytes) : ledger_(budget_bytes) {}
  explicit shared_budget(budget_ledger ledger) : ledger_(std::move(ledger)) {}
  shared_budget(const shared_budget&) = delete;
  shared_budget& operator=(const shared_budget&) = delete;

  std::size_t budget() const noexcept { return ledger_.budget(); }
  std::size_t used() const {
    std::lock_guard lock(mutex_);
    return ledger_.used();
  }
  workload_usage usage(workload_id id) const {
    std::lock_guard lock(mutex_);
    return ledger_.usage(id);
  }
  std::vector<workload_usage> snapshot() const {
    std::lock_guard lock(mutex_);
    return ledger_.snapshot();
  }
  budget_statistics stats() const {
    std::lock_guard lock(mutex_);
    return stats_;
  }

  /// Registers a workload (see budget_ledger::join) whose victims `member` offers until leave.
  workload_id join(std::string name, budget_member& member, std::size_t pinned = 0) {
    std::lock_guard lock(mutex_);
    const workload_id id = ledger_.join(std::move(name), pinned);
    try {
      members_.emplace_back(id, &member);
    } catch (...) {
      ledger_.leave(id);
      throw;
    }
    return id;
  }

  /// The workload's share goes back; its member is never called again once this returns.
  /// Must not be called while holding a lock the member's offer_victim or evict takes.
  void leave(workload_id id) noexcept {
    std::unique_lock guard(members_guard_);
    {
      std::lock_guard lock(mutex_);
      ledger_.leave(id);
      std::erase_if(members_, [id](const auto& m) { return m.first == id; });
      ++generation_;
    }
    changed_.notify_all();
  }

  /// A ticket for a wait about to start: larger than every earlier one (see budget_member).
  std::uint64_t take_ticket() noexcept { return ++tickets_; }

  /// Grants `bytes` to workload `id`, moving other memory out (any workload's, the furthest
  /// next use first, and what younger waiters than `ticket` pinned) and waiting up to `timeout`
  /// for room; true when it had to wait. out_of_memory after the timeout; whatever offload
  /// throws; out_of_memory at once when `bytes` exceed the whole budget. Must not be called
  /// while holding a lock the members take.
  bool acquire(workload_id id, std::size_t bytes, std::chrono::nanoseconds timeout, std::uint64_t ticket = 0) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    bool waited = false;
    {
      std::lock_guard lock(mutex_);
      ledger_.require_fits(id, bytes, "one request");  // waiting could never help
    }
    for (;;) {
      std::uint64_t seen = 0;
      std::size_t shortfall = 0;
      {
        std::lock_guard lock(mutex_);
        if (grant(id, bytes)) return waited;
        seen = generation_;
        shortfall = bytes - ledger_.available();
      }
      if (reclaim(budget_member::ask{id, ticket, schedule_time::min()}, shortfall) > 0) continue;
      std::unique_lock lock(mutex_);
      if (grant(id, bytes)) return waited;
      if (!waited) {
        waited = true;
        ++stats_.waits;
      }
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) {
        ++stats_.timeouts;
        const workload_usage self = ledger_.usage(id);
        throw out_of_memory(bytes, ledger_.used(), self.held,
                            "glake::shared_budget: workload '" + self.name + "' waited " +
                                std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count()) +
                                " ms for " + std::to_string(bytes) + " bytes (" + format_bytes(bytes) +
                                ") of the budget of " + format_bytes(ledger_.budget()) + "; " +
                                format_bytes(ledger_.available()) +
                                " are left and nothing more could be moved out: " + ledger_.describe());
      }
      // A member that was busy (it answers nothing then) may have memory to give once it is
      // free again, and need not say so: look again soon even without a notification.
      changed_.wait_until(lock, std::min(deadline, now + std::chrono::milliseconds(1)),
                          [&] { return generation_ != seen; });
    }
  }

  /// Grants `bytes` without waiting, moving out only victims whose next use is after
  /// `later_than`. false (nothing granted) when that does not make room.
  bool try_acquire(workload_id id, std::size_t bytes, schedule_time later_than) {
    std::size_t shortfall = 0;
    {
      std::lock_guard lock(mutex_);
      if (grant(id, bytes)) return true;
      shortfall = bytes - ledger_.available();
    }
    reclaim(budget_member::ask{id, 0, later_than}, shortfall);
    std::lock_guard lock(mutex_);
    if (grant(id, bytes)) return true;
    ++stats_.refusals;
    return false;
  }

  /// Gives back `bytes` of workload `id` (usage_error if it holds fewer) and wakes waiters.
  void release(workload_id id, std::size_t bytes) {
    {
      std::lock_guard lock(mutex_);
      ledger_.release(id, bytes);
      ++generation_;
    }
    changed_.notify_all();
  }

  /// See budget_ledger::set_pinned: out_of_memory naming the workload when more than the budget.
  void set_pinned(workload_id id, std::size_t bytes) {
    std::lock_guard lock(mutex_);
    ledger_.set_pinned(id, bytes);
  }
  void set_predicted(workload_id id, std::size_t bytes) {
    std::lock_guard lock(mutex_);
    ledger_.set_predicted(id, bytes);
  }

  /// Something may have become movable (a workload's operation ended): waiters look again.
  void changed() noexcept {
    {
      std::lock_guard lock(mutex_);
      ++generation_;
    }
    changed_.notify_all();
  }

  /// Moves victims out for `ask` (any workload's, the furthest next use first) until `bytes`
  /// came back or no member offers anything; the bytes freed. What acquire does before it
  /// waits; a coordinator's reclaim request is served with it. Must not be called while holding
  /// a lock the members take.
  std::size_t move_out(const budget_member::ask& ask, std::size_t bytes) { return reclaim(ask, bytes); }

 private:
  // Under mutex_.
  bool grant(workload_id id, std::size_t bytes) {
    if (!ledger_.try_acquire(id, bytes)) return false;
    ++stats_.grants;
    stats_.peak_used = std::max(stats_.peak_used, ledger_.used());
    return true;
  }

  // Moves victims out until `shortfall` bytes came back or none is offered; the bytes freed.
  std::size_t reclaim(const budget_member::ask& ask, std::size_t shortfall) {
    std::shared_lock guard(members_guard_);
    std::vector<std::pair<workload_id, budget_member*>> members;
    {
      std::lock_guard lock(mutex_);
      members = members_;
    }
    std::size_t freed = 0;
    int fruitless = 0;
    while (freed < shortfall && fruitless <= static_cast<int>(members.size())) {
      std::optional<budget_member::victim> best;
      std::pair<workload_id, budget_member*> owner{};
      for (const auto& m : members) {
        const std::optional<budget_member::victim> v = m.second->offer_victim(ask);
        if (v && (!best || v->next_use > best->next_use)) {
          best = v;
          owner = m;
        }
      }
      if (!best) break;
      const std::size_t got = owner.second->evict(ask, best->id);
      if (got == 0) {
        ++fruitless;  // it changed in between: ask again, a bounded number of times
        continue;
      }
      freed += got;
      std::lock_guard lock(mutex_);
      ++stats_.evictions;
      if (owner.first != ask.asker) ++stats_.cross_evictions;
    }
    return freed;
  }

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  budget_ledger ledger_;
  std::vector<std::pair<workload_id, budget_member*>> members_;
  std::uint64_t generation_ = 0;
  std::atomic<std::uint64_t> tickets_{0};
  budget_statistics stats_;
  std::shared_mutex members_guard_;  ///< shared while members are called; leave takes it alone
};

// ---------------------------------------------------------------------------------------------
// budget_service
//
// What a workload_scheduler needs of the budget it shares: the accounts of its workload and
// room made or waited for. Every call may come from any thread.
//
// | expression                     | returns      | meaning
// |--------------------------------|--------------|------------------------------------------------
// | b.join(name, member, pinned)   | workload_id  | a new workload whose victims `member` offers;
// |                                |              | out_of_memory naming it when pinned > budget
// | b.leave(id)                    | void, noexcept | its share goes back; member never called again
// | b.take_ticket()                | uint64_t     | a ticket for a wait about to start (older: smaller)
// | b.acquire(id, n, timeout, t)   | bool         | grants n bytes, moving memory out or waiting;
// |                                |              | true when it waited; out_of_memory after timeout
// | b.try_acquire(id, n, later)    | bool         | grants n bytes now, moving out only memory used
// |                                |              | after `later`; false when no room
// | b.release(id, n)               | void         | gives n bytes back
// | b.set_pinned(id, n)            | void         | the workload needs n bytes at once; out_of_memory
// |                                |              | naming it when more than the budget
// | b.set_predicted(id, n)         | void         | its predicted peak (reported)
// | b.changed()                    | void, noexcept | memory may have become movable: waiters look again
//
// Models: shared_budget (one process), coordinated_budget (processes sharing a coordinator,
// scheduling/coordinated_budget.hpp).
// ---------------------------------------------------------------------------------------------
template <class B>
concept budget_service = requires(B& b, std::string name, budget_member& member, workload_id id, std::size_t n,
                                  std::chrono::nanoseconds timeout, std::uint64_t ticket, schedule_time later) {
  { b.join(std::move(name), member, n) } -> std::same_as<workload_id>;
  { b.leave(id) } noexcept -> std::same_as<void>;
  { b.take_ticket() } -> std::same_as<std::uint64_t>;
  { b.acquire(id, n, timeout, ticket) } -> std::same_as<bool>;
  { b.try_acquire(id, n, later) } -> std::same_as<bool>;
  { b.release(id, n) } -> std::same_as<void>;
  { b.set_pinned(id, n) } -> std::same_as<void>;
  { b.set_predicted(id, n) } -> std::same_as<void>;
  { b.changed() } noexcept -> std::same_as<void>;
};

static_assert(budget_service<shared_budget>);

}  // namespace glake
