// Lock policies: how an allocator serialises its public calls (a mutex, or nothing).
#pragma once

#include <concepts>
#include <mutex>

namespace glake {

// ---------------------------------------------------------------------------------------------
// lock_policy
//
// | expression   | returns | throws | meaning
// |--------------|---------|--------|--------------------------------------------
// | l.lock()     | void    | maybe  | blocks until this caller holds the lock
// | l.unlock()   | void    | no     | releases it
//
// It is BasicLockable, so std::lock_guard works. Allocators take the lock once per public call.
// ---------------------------------------------------------------------------------------------
template <class L>
concept lock_policy = std::default_initializable<L> && requires(L& l) {
  l.lock();
  { l.unlock() } noexcept;
};

/// No locking: for allocators used from one thread at a time (or under the caller's own lock).
/// Empty, so it costs nothing as a [[no_unique_address]] member.
struct no_lock {
  constexpr void lock() noexcept {}
  constexpr void unlock() noexcept {}
};
static_assert(lock_policy<no_lock>);

/// A std::mutex: allocators may be shared between threads.
class mutex_lock {
 public:
  void lock() { mutex_.lock(); }
  void unlock() noexcept { mutex_.unlock(); }

 private:
  std::mutex mutex_;
};
static_assert(lock_policy<mutex_lock>);

}  // namespace glake
