// Spare device handles counted by a budget: an allocator's spares (config::move_spares) as a
// workload of their own, whose grant bounds them and which gives them up first when room is
// needed, in this process or, under a coordinator, in another.
#pragma once

#include <atomic>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "glake/scheduling/budget.hpp"
#include "glake/scheduling/concepts.hpp"

namespace glake {

// ---------------------------------------------------------------------------------------------
// spare_keeping_allocator
//
// An allocator that keeps device handles its moves give back, within a bound that can change.
//
// | expression              | returns | throws    | meaning
// |-------------------------|---------|-----------|---------------------------------------------
// | a.keep_move_spares(n)   | void    | bad_alloc | spares kept up to n bytes from now on (0:
// |                         |         |           | none); those above are released at once
// | a.stats().spare_bytes   | size_t  | no        | bytes held as spares now, at most the bound
//
// Model: stitching_allocator.
// ---------------------------------------------------------------------------------------------
template <class A>
concept spare_keeping_allocator = requires(A& a, std::size_t n) {
  { a.keep_move_spares(n) } -> std::same_as<void>;
  { a.stats().spare_bytes } -> std::convertible_to<std::size_t>;
};

namespace detail {
/// A spare_keeping_allocator and nothing more.
struct spare_keeping_archetype {
  struct stats_type {
    std::size_t spare_bytes = 0;
  };
  void keep_move_spares(std::size_t bytes);
  stats_type stats() const;
};
}  // namespace detail
static_assert(spare_keeping_allocator<detail::spare_keeping_archetype>);

/// An allocator's spare handles as a workload of `Budget` ("move spares"): request(n) asks the
/// budget for n bytes without moving anything out (spares never cost another workload its
/// memory) and sets the allocator's spare bound to what was granted, so the spares never hold
/// a byte the budget does not count. As a budget_member it offers the whole grant as the best
/// victim (never used: spares are only a saving of driver calls) and, evicted, releases the
/// spares at once (nothing left pending: a settled move out) and gives the bytes back. Under a
/// coordinated_budget it is a workload of the coordinator's ledger like any other, so another
/// process's reclaim takes the spares first. After an eviction the bound stays 0 until the next
/// request.
///
/// Complexity: O(1) besides the budget's calls and the release of the spares (O(spares)).
/// Thread safety: every member function may be called from any thread; offer_victim and evict
/// answer nothing while a request or another eviction runs (the budget's try-lock rule). It
/// must outlive no budget it joined; its destructor releases the spares and leaves. Lock order:
/// the budget calls it without its mutex held; it calls the allocator (its lock) and the budget.
template <spare_keeping_allocator A, budget_service Budget = shared_budget>
class spare_account final : public budget_member {
 public:
  spare_account(Budget& budget, A& allocator, std::string name = "move spares")
      : budget_(budget), allocator_(allocator) {
    allocator_.keep_move_spares(0);  // only what the budget grants
    id_ = budget_.join(std::move(name), *this);
  }
  spare_account(const spare_account&) = delete;
  spare_account& operator=(const spare_account&) = delete;
  ~spare_account() {
    lock();
    try {
      allocator_.keep_move_spares(0);
      if (granted_ != 0) budget_.release(id_, granted_);
    } catch (...) {
    }
    granted_ = 0;
    unlock();
    budget_.leave(id_);
  }

  workload_id id() const noexcept { return id_; }
  /// Bytes the budget granted for spares: the allocator's spare bound.
  std::size_t granted() const noexcept { return granted_.load(); }
  /// Times a reclaim took the spares.
  std::uint64_t evictions() const noexcept { return evictions_.load(); }

  /// Brings the grant to `bytes`: more asked of the budget, without moving anything out (nothing
  /// granted when it has no room), or less given back after the spares above it went. The bytes
  /// granted now.
  std::size_t request(std::size_t bytes) {
    lock();
    try {
      const std::size_t had = granted_;
      if (bytes < had) {
        allocator_.keep_move_spares(bytes);
        budget_.release(id_, had - bytes);
        granted_ = bytes;
      } else if (bytes > had && budget_.try_acquire(id_, bytes - had, never_used)) {
        granted_ = bytes;
        allocator_.keep_move_spares(bytes);
      }
    } catch (...) {
      unlock();
      throw;
    }
    unlock();
    return granted_;
  }

  std::optional<victim> offer_victim(const ask& a) override {
    if (a.asker == id_ || !(never_used > a.later_than) || !try_lock()) return std::nullopt;
    std::optional<victim> v;
    if (granted_ != 0) v = victim{never_used, granted_, 0};
    unlock();
    return v;
  }
  std::size_t evict(const ask& a, allocation_id) override {
    if (a.asker == id_ || !(never_used > a.later_than) || !try_lock()) return 0;
    const std::size_t bytes = granted_;
    if (bytes != 0) {
      try {
        allocator_.keep_move_spares(0);  // released now: the bytes may go to another process
      } catch (...) {
        unlock();
        throw;
      }
      granted_ = 0;
      ++evictions_;
    }
    unlock();
    if (bytes != 0) budget_.release(id_, bytes);
    return bytes;
  }

 private:
  bool try_lock() noexcept { return !busy_.exchange(true, std::memory_order_acquire); }
  void lock() noexcept {
    while (!try_lock()) std::this_thread::yield();
  }
  void unlock() noexcept { busy_.store(false, std::memory_order_release); }

  Budget& budget_;
  A& allocator_;
  workload_id id_ = 0;
  std::atomic<bool> busy_{false};  // a try-lock: the budget may call back on the same thread
  std::atomic<std::size_t> granted_{0};
  std::atomic<std::uint64_t> evictions_{0};
};

static_assert(std::derived_from<spare_account<detail::spare_keeping_archetype>, budget_member>);

}  // namespace glake
