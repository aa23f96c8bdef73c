// Deferred frees: allocations that work on other streams also used (PyTorch's record_stream) are
// freed only once events recorded on those streams at the free have completed.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "glake/stream.hpp"

namespace glake::detail {

/// The uses recorded on live allocations, and the frees waiting for them. `Events` is a
/// counted_events (stream_clocks.hpp): only backends with events defer anything.
///
/// Complexity: O(uses) per record and per free of a used allocation; finishing costs one query
/// per completed event and at most one more per stream, however many frees wait.
/// Thread safety: none (the allocator serialises access).
template <class Events>
class deferred_frees {
 public:
  using event_type = typename Events::event_type;

  /// `p`, live, is also used by work on `stream`.
  void record_use(void* p, stream_ref stream) {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    for (const auto& [a, s] : uses_) {
      if (a == address && s == stream) return;
    }
    uses_.emplace_back(address, stream);
  }

  /// Calls f(stream) for each other stream recorded as using the live allocation at `p`.
  template <class F>
  void for_each_use(const void* p, F&& f) const {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    for (const auto& [a, s] : uses_) {
      if (a == address) f(s);
    }
  }

  /// Whether a free may have to be deferred or a deferred one finished: any use or pending free.
  bool active() const noexcept { return !pending_.empty() || !uses_.empty(); }
  bool pending() const noexcept { return !pending_.empty(); }
  /// Calls f(p) for each allocation whose free waits for other streams.
  template <class F>
  void for_each_pending(F&& f) const {
    for (const pending_free& free : pending_) f(static_cast<const void*>(free.p));
  }

  /// Defers the free of `p` on `stream` when other streams used it: records an event on each,
  /// after `check(p, bytes)` has diagnosed misuse (it throws). True when deferred; on a throw
  /// nothing is freed and the uses stay recorded. `already` names a double free of a pending one.
  template <class Check, class Already>
  bool defer(void* p, std::size_t bytes, stream_ref stream, Events& events, Check&& check, Already&& already) {
    for (const pending_free& f : pending_) {
      if (f.p == p) already(p);
    }
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    const auto first = std::partition(uses_.begin(), uses_.end(),
                                      [address](const auto& use) { return use.first != address; });
    if (first == uses_.end()) return false;
    check(p, bytes);
    pending_free pending{p, bytes, stream, {}};
    pending.events.reserve(static_cast<std::size_t>(uses_.end() - first));
    pending_.reserve(pending_.size() + 1);
    try {
      for (auto it = first; it != uses_.end(); ++it) {
        if (it->second != stream) pending.events.emplace_back(it->second, events.record(it->second));
      }
    } catch (...) {
      for (const auto& [s, e] : pending.events) events.recycle(e);
      throw;
    }
    uses_.erase(first, uses_.end());
    if (pending.events.empty()) return false;  // used only on its own stream: nothing to wait for
    pending_.push_back(std::move(pending));
    return true;
  }

  /// Runs `free_now(p, bytes, stream)` for the deferred frees whose events have completed, oldest
  /// first (all of them, waiting, when `wait`). Events on one stream complete in the order they
  /// were recorded, so once one is found pending, later ones on that stream are not asked.
  template <class FreeNow>
  void finish(bool wait, Events& events, FreeNow&& free_now) noexcept {
    std::array<stream_ref, 8> blocked{};  // streams with an event found pending in this call
    std::size_t blocked_count = 0;
    const auto is_blocked = [&](stream_ref s) {
      return std::find(blocked.begin(), blocked.begin() + blocked_count, s) != blocked.begin() + blocked_count;
    };
    std::size_t kept = 0;
    for (std::size_t i = 0; i < pending_.size(); ++i) {
      pending_free& f = pending_[i];
      bool done = true;
      if (!wait) {
        for (const auto& [s, e] : f.events) {
          const bool complete = !is_blocked(s) && events.done_or_not_yet(e);
          if (!complete) {
            if (!is_blocked(s) && blocked_count < blocked.size()) blocked[blocked_count++] = s;
            done = false;
            break;
          }
        }
      }
      if (!done) {
        if (kept != i) pending_[kept] = std::move(f);
        ++kept;
        continue;
      }
      for (const auto& [s, e] : f.events) {
        if (wait) events.wait(e);
        events.recycle(e);
      }
      try {
        free_now(f.p, f.bytes, f.stream);
      } catch (...) {
        // Checked when deferred; nothing left to report to.
      }
    }
    pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(kept), pending_.end());
  }

 private:
  struct pending_free {
    void* p;
    std::size_t bytes;
    stream_ref stream;
    std::vector<std::pair<stream_ref, event_type>> events;  ///< one per other stream that used it
  };

  std::vector<std::pair<std::uintptr_t, stream_ref>> uses_;  // live allocations' other streams
  std::vector<pending_free> pending_;
};

/// Without events nothing is deferred.
struct no_deferred_frees {};

}  // namespace glake::detail
