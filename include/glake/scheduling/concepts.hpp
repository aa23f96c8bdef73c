// The contracts of tensor-granularity swap scheduling: the policy that says which allocation to
// move out and which to bring back early, the clock it is timed by, and the transfer-time model.
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

namespace glake {

/// Names one allocation a workload_scheduler manages: dense, from 0, never reused by the same
/// scheduler (an id the scheduler stopped managing stays unknown).
using allocation_id = std::uint32_t;

/// Names one workload registered with a budget.
using workload_id = std::uint32_t;

/// Times, in nanoseconds from a clock's epoch. Policies take the time as an argument, so they
/// can be driven without a clock; the scheduler reads its Clock.
using schedule_time = std::chrono::nanoseconds;

/// "Not expected to be used again": the best possible victim.
inline constexpr schedule_time never_used = schedule_time::max();

/// How long moving `bytes` takes: fixed + bytes / bandwidth. The default is a PCIe gen5 x16
/// link's pinned copy on an H100/H200 (about 50 GB/s, bench/results/offload.md) plus the remap
/// of one piece (~30 us). A planned policy starts a prefetch this long before the use it serves.
struct transfer_model {
  double bytes_per_second = 50e9;
  schedule_time fixed = std::chrono::microseconds(30);

  schedule_time cost(std::size_t bytes) const noexcept {
    const double seconds = bytes_per_second > 0 ? static_cast<double>(bytes) / bytes_per_second : 0.0;
    return fixed + std::chrono::duration_cast<schedule_time>(std::chrono::duration<double>(seconds));
  }
};

// ---------------------------------------------------------------------------------------------
// swap_policy
//
// Decides, for one workload, how good a victim each of its allocations is: the predicted time
// until its next use. The scheduler reports every allocation, every iteration boundary and
// every operation (the allocations it is about to use, in order); when device memory must be
// freed, the allocation with the furthest predicted next use, over every workload sharing the
// budget, is moved to the host first. Times are comparable across workloads because they are
// measured (or predicted) in nanoseconds, not in steps.
//
// | expression              | returns       | throws | meaning
// |-------------------------|---------------|--------|--------------------------------------------
// | p.track(id, bytes)      | void          | may    | allocation `id` of `bytes` joins (bad_alloc)
// | p.untrack(id)           | void          | no     | it leaves; never named again
// | p.iteration_begin(t)    | void          | may    | an iteration of the workload starts at t
// | p.use(ids, t)           | void          | may    | an operation about to use `ids`
// |                         |               |        | (span<const allocation_id>) starts at t
// | cp.next_use(id, t)      | schedule_time | no     | predicted time from t until id's next use;
// |                         |               |        | never_used when none is expected. Larger:
// |                         |               |        | the better victim
//
// A smallest model: `struct s { void track(allocation_id, size_t) {} void untrack(allocation_id)
// noexcept {} void iteration_begin(schedule_time) {} void use(span<const allocation_id>,
// schedule_time) {} schedule_time next_use(allocation_id, schedule_time) const noexcept { return
// never_used; } };` (every allocation equally good: the scheduler takes the first it finds).
// Models: lru_policy (scheduling/lru_policy.hpp), planned_policy (scheduling/planned_policy.hpp).
// Not thread-safe: the scheduler's lock covers every call.
// ---------------------------------------------------------------------------------------------
template <class P>
concept swap_policy = std::movable<P> && requires(P& p, const P& cp, allocation_id id, std::size_t bytes,
                                                  schedule_time t, std::span<const allocation_id> ids) {
  { p.track(id, bytes) } -> std::same_as<void>;
  { p.untrack(id) } noexcept -> std::same_as<void>;
  { p.iteration_begin(t) } -> std::same_as<void>;
  { p.use(ids, t) } -> std::same_as<void>;
  { cp.next_use(id, t) } noexcept -> std::same_as<schedule_time>;
};

// ---------------------------------------------------------------------------------------------
// prefetching_policy: a swap_policy that also says when to bring memory back before it is asked
// for, so that the copy overlaps the operations before its use.
//
// | expression              | returns                        | throws | meaning
// |-------------------------|--------------------------------|--------|----------------------------
// | cp.due_prefetches()     | span<const allocation_id>      | no     | after the last use(): the
// |                         |                                |        | allocations whose prefetch
// |                         |                                |        | should start now; valid
// |                         |                                |        | until the next call on p
//
// The scheduler prefetches each one that is on the host only when the budget has room or can
// make room by moving out allocations used later than it (Belady's rule: a prefetch never
// evicts something needed sooner). Models: planned_policy.
// ---------------------------------------------------------------------------------------------
template <class P>
concept prefetching_policy = swap_policy<P> && requires(const P& cp) {
  { cp.due_prefetches() } noexcept -> std::same_as<std::span<const allocation_id>>;
};

// ---------------------------------------------------------------------------------------------
// schedule_clock: what the scheduler reads the time from.
//
// | expression              | returns                               | meaning
// |-------------------------|---------------------------------------|------------------------------
// | c.now()                 | a std::chrono::time_point             | the current time; never goes
// |                         |                                       | back
//
// Models: std::chrono::steady_clock (the default); tests use a clock that ticks per call.
// ---------------------------------------------------------------------------------------------
template <class C>
concept schedule_clock = std::copy_constructible<C> && requires(const C& c) {
  { std::chrono::duration_cast<schedule_time>(c.now().time_since_epoch()) } -> std::same_as<schedule_time>;
};

static_assert(schedule_clock<std::chrono::steady_clock>);

}  // namespace glake
