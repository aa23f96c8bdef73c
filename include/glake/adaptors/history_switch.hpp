// The memory history's switch: whether an adaptor's devices record their memory history, how
// many entries each keeps, and the lock that keeps a device joining from passing a start or a
// stop. Used by pluggable_allocator, one for all its devices.
#pragma once

#include <atomic>
#include <concepts>
#include <cstddef>
#include <mutex>
#include <utility>

namespace glake {

// ---------------------------------------------------------------------------------------------
// history_switching: the memory history's on/off state, shared by every device. Recorders read
// `on()` on every allocation and free (one relaxed load); starting, stopping and a device's
// joining are serialised, so each device ends up in the state the last start or stop set.
//
// | expression                    | returns  | throws          | meaning
// |-------------------------------|----------|-----------------|-------------------------------
// | ch.on()                       | bool     | no              | whether the history records
// |                               |          |                 | (relaxed: exact only inside
// |                               |          |                 | set's or locked's callbacks)
// | h.set(e, n, reset, apply)     | void     | what reset or   | with e: capacity n, then
// |                               |          | apply throw,    | reset(n) (empty every ring),
// |                               |          | with recording  | then on; without e: off, the
// |                               |          | off             | capacity kept. Then apply(e)
// |                               |          |                 | (bring every device along)
// | h.locked(f)                   | f's      | f's             | f(on, capacity) while no set
// |                               |          |                 | runs (a device joining)
// Thread safety: on() from any thread at any time; set and locked from any thread, serialised.
//
// Model: history_switch.
// ---------------------------------------------------------------------------------------------
template <class H>
concept history_switching =
    requires(H& h, const H& ch, bool e, std::size_t n, void (*reset)(std::size_t), void (*apply)(bool),
             int (*f)(bool, std::size_t)) {
      { ch.on() } noexcept -> std::same_as<bool>;
      { h.set(e, n, reset, apply) } -> std::same_as<void>;
      { h.locked(f) } -> std::same_as<int>;
    };

/// The switch: an atomic flag for the readers, a mutex and the capacity for the writers.
/// Complexity: O(1) besides the callbacks. Thread safety: see history_switching.
class history_switch {
 public:
  bool on() const noexcept { return on_.load(std::memory_order_relaxed); }

  template <class Reset, class Apply>
  void set(bool enabled, std::size_t capacity, Reset&& reset, Apply&& apply) {
    std::lock_guard guard(mutex_);
    try {
      if (enabled) {
        capacity_ = capacity;
        std::forward<Reset>(reset)(capacity);
      }
      on_.store(enabled, std::memory_order_relaxed);
      std::forward<Apply>(apply)(enabled);
    } catch (...) {
      on_.store(false, std::memory_order_relaxed);
      throw;
    }
  }

  template <class F>
  decltype(auto) locked(F&& f) {
    std::lock_guard guard(mutex_);
    return std::forward<F>(f)(on(), capacity_);
  }

 private:
  std::atomic<bool> on_{false};
  std::mutex mutex_;           // serialises set and locked
  std::size_t capacity_ = 0;   // entries a device keeps; under mutex_
};
static_assert(history_switching<history_switch>);

}  // namespace glake
