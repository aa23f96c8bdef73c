// Stream clocks: where the stitching allocator records, polls and waits for events, so that it
// knows when the work queued on a stream before a free has completed.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

#include "glake/backends/concepts.hpp"
#include "glake/detail/driver_meter.hpp"
#include "glake/statistics.hpp"
#include "glake/stream.hpp"

namespace glake::detail {

/// A stream-ordered reserver's events, counted and timed in `statistics` (events_recorded,
/// event_queries, event_ns, device_waits): every event call of the allocator goes through here.
template <stream_ordered_reserver Reserver>
class counted_events {
 public:
  using event_type = typename Reserver::event_type;
  static constexpr bool real = true;

  counted_events(Reserver& reserver, statistics& stats) noexcept : reserver_(&reserver), stats_(&stats) {}

  event_type record(stream_ref stream) {
    ++stats_->events_recorded;
    const stopwatch watch{stats_->event_ns};
    return reserver_->record_event(stream);
  }
  bool done(const event_type& e) {
    ++stats_->event_queries;
    const stopwatch watch{stats_->event_ns};
    return reserver_->event_done(e);
  }
  /// Whether `e` has completed; a failed query counts as "not yet".
  bool done_or_not_yet(const event_type& e) noexcept {
    try {
      return done(e);
    } catch (...) {
      return false;
    }
  }
  void recycle(const event_type& e) noexcept { reserver_->recycle_event(e); }
  /// Work queued on `stream` from now on waits for `e` (stream_joining_reserver only). Throws
  /// the backend's driver_error; counted in statistics::stream_joins when it went through.
  void join(stream_ref stream, const event_type& e)
    requires stream_joining_reserver<Reserver>
  {
    {
      const stopwatch watch{stats_->event_ns};
      reserver_->stream_wait_event(stream, e);
    }
    ++stats_->stream_joins;
  }
  /// Whether `stream` may be capturing a graph: what the reserver says (capture_aware_reserver),
  /// true when asking fails; false for a reserver that cannot tell.
  bool may_be_capturing([[maybe_unused]] stream_ref stream) const noexcept {
    if constexpr (capture_aware_reserver<Reserver>) {
      try {
        return reserver_->is_capturing(stream);
      } catch (...) {
        return true;
      }
    } else {
      return false;
    }
  }
  /// The only places the host blocks on the device; each counts in statistics::device_waits.
  void wait(const event_type& e) noexcept {
    ++stats_->device_waits;
    reserver_->wait_event(e);
  }
  void synchronize() noexcept {
    ++stats_->device_waits;
    reserver_->synchronize_device();
  }

 private:
  Reserver* reserver_;
  statistics* stats_;
};

/// For backends without events (host, sim): a free has completed when it returns.
struct no_events {
  struct event_type {};
  static constexpr bool real = false;
};

/// The event source of a reserver: counted_events where it has events, else no_events.
template <class Reserver, bool = stream_ordered_reserver<Reserver>>
struct events_of {
  using type = no_events;
};
template <class Reserver>
struct events_of<Reserver, true> {
  using type = counted_events<Reserver>;
};

/// One clock per stream that has called the allocator. Frees on a stream are marked with its
/// clock's `next`; an event recorded for that mark (while the clock is `dirty`) tells when they
/// have completed; every mark up to `done` has. Events are recorded only during a call on their
/// stream (a stream may be destroyed once its calls end), and at most once per interval while
/// one is in flight, so one event covers many frees and a stream's events are queried at most
/// once per interval. Without events every mark is 0 and every free has completed.
///
/// With joins (config::stream_join), a stream may instead wait on another's event on the device
/// (join_wanted): the marks that event covers are then usable by it for the current request.
///
/// Complexity: O(streams) to find a clock, O(1) amortised per event. Thread safety: none (the
/// allocator serialises access). Never waits except in `synchronize_all` and `wait_for_wanted`.
template <class Events>
class stream_clocks {
 public:
  using event_type = typename Events::event_type;
  static constexpr bool has_events = Events::real;

  struct clock {
    stream_ref stream;
    std::uint64_t next = 1;
    std::uint64_t done = 0;
    bool dirty = false;
    std::chrono::steady_clock::time_point recorded{};  ///< of the newest event
    std::deque<std::pair<std::uint64_t, event_type>> in_flight;
    std::uint64_t wanted = 0;  ///< scratch: the newest mark a waiter needs
    std::uint64_t joined = 0;  ///< scratch: marks up to this are ordered before the joiner's
                               ///< stream by a join during the current request
  };

  /// Whether Events can make one stream wait for another's event on the device.
  static constexpr bool can_join = requires(Events& e, stream_ref s, const event_type& ev) { e.join(s, ev); };

  stream_clocks(Events events, int interval_us) : events_(events), interval_us_(interval_us) {}

  Events& events() noexcept { return events_; }
  std::size_t size() const noexcept { return clocks_.size(); }
  auto begin() noexcept { return clocks_.begin(); }
  auto end() noexcept { return clocks_.end(); }

  /// A call on `stream`: it gets a clock (so that its frees can be marked) if it has none.
  void enter(stream_ref stream) {
    if (clocks_.empty() || stream != current_) enter_other(stream);  // the common case stays inline
  }

  clock* find(stream_ref stream) noexcept {
    for (clock& c : clocks_) {
      if (c.stream == stream) return &c;
    }
    return nullptr;
  }

  /// The mark for a free on `stream` now; 0 without events. A stream without a clock gets a mark
  /// that completes only when the device is synchronized.
  std::uint64_t mark_free(stream_ref stream) noexcept {
    if constexpr (has_events) {
      clock* c = find(stream);
      if (c == nullptr) return ~std::uint64_t{0};
      c->dirty = true;
      return c->next;
    } else {
      return 0;
    }
  }

  /// Whether the work queued on `stream` before the free marked `mark` has completed.
  bool completed([[maybe_unused]] stream_ref stream, [[maybe_unused]] std::uint64_t mark) noexcept {
    if constexpr (has_events) {
      const clock* c = find(stream);
      return c != nullptr && mark <= c->done;
    } else {
      return true;
    }
  }

  /// During a call on `stream` (so it is alive): records an event for its frees that have none,
  /// unless one is in flight that was recorded less than the interval ago, after polling the
  /// stream's events. A failed record leaves the frees for a later call.
  void tick([[maybe_unused]] stream_ref stream) noexcept {
    if constexpr (has_events) {
      clock* c = find(stream);
      if (c == nullptr || !c->dirty) return;
      const auto now = std::chrono::steady_clock::now();
      if (!c->in_flight.empty() && now - c->recorded < std::chrono::microseconds{interval_us_}) return;
      poll(*c);
      try {
        const event_type e = events_.record(c->stream);
        try {
          c->in_flight.emplace_back(c->next, e);
          ++c->next;
          c->dirty = false;
          c->recorded = now;
        } catch (...) {
          events_.recycle(e);
        }
      } catch (...) {
      }
    }
  }

  /// Advances `c.done` past its completed events. Events outlive their stream, so this is safe
  /// for any stream.
  void poll([[maybe_unused]] clock& c) noexcept {
    if constexpr (has_events) {
      while (!c.in_flight.empty() && events_.done_or_not_yet(c.in_flight.front().second)) retire_oldest(c);
    }
  }

  /// Polls every stream's events (never waits).
  void poll_all() noexcept {
    if constexpr (has_events) {
      for (clock& c : clocks_) poll(c);
    }
  }

  /// The device is synchronized: every free so far has completed.
  void synchronize_all() noexcept {
    if constexpr (has_events) {
      events_.synchronize();
      for (clock& c : clocks_) {
        for (const auto& [mark, e] : c.in_flight) events_.recycle(e);
        c.in_flight.clear();
        c.done = c.next;
        ++c.next;
        c.dirty = false;
      }
    }
  }

  void clear_wanted() noexcept {
    for (clock& c : clocks_) c.wanted = 0;
  }

  /// Whether a free on `stream` marked `mark` may be used now by work queued on `user`: its work
  /// has completed, or `user` joined an event covering it during this request (join_wanted).
  bool usable(stream_ref stream, std::uint64_t mark, [[maybe_unused]] stream_ref user) noexcept {
    if constexpr (has_events) {
      const clock* c = find(stream);
      return c != nullptr && (mark <= c->done || (user == joiner_ && mark <= c->joined));
    } else {
      return true;
    }
  }
  /// Whether the free marked `mark` on `stream` is usable by `user` only through a join.
  bool only_joined(stream_ref stream, std::uint64_t mark, stream_ref user) noexcept {
    return !completed(stream, mark) && usable(stream, mark, user);
  }

  /// Whether an event in flight on `stream` covers the free marked `mark` (a join could order it
  /// before another stream's work), or it has completed.
  bool joinable([[maybe_unused]] stream_ref stream, [[maybe_unused]] std::uint64_t mark) noexcept {
    if constexpr (has_events) {
      const clock* c = find(stream);
      return c != nullptr && (mark <= c->done || (!c->in_flight.empty() && c->in_flight.back().first >= mark));
    } else {
      return true;
    }
  }

  /// Makes the free marked `mark` on `stream` usable by `user` for this request: true when it is
  /// already (usable), else `user` waits on the device for the oldest event in flight that
  /// covers it (the least work that does). False when no event covers it or the join failed.
  bool join_through([[maybe_unused]] stream_ref stream, [[maybe_unused]] std::uint64_t mark,
                    [[maybe_unused]] stream_ref user) noexcept {
    if (usable(stream, mark, user)) return true;
    if constexpr (can_join) {
      clock* c = find(stream);
      if (c == nullptr) return false;
      const auto it = std::find_if(c->in_flight.begin(), c->in_flight.end(),
                                   [&](const auto& entry) { return entry.first >= mark; });
      if (it == c->in_flight.end()) return false;
      try {
        events_.join(user, it->second);
      } catch (...) {
        return false;
      }
      if (joiner_ != user) {
        for (clock& other : clocks_) other.joined = 0;
        joiner_ = user;
      }
      c->joined = std::max(c->joined, it->first);
      return true;
    } else {
      return false;
    }
  }

  /// Ends the joins of the current request: later requests see completed marks only.
  void clear_joined() noexcept {
    if constexpr (has_events) {
      for (clock& c : clocks_) c.joined = 0;
      joiner_ = stream_ref{};
    }
  }

  /// Makes `user` wait on the device, for each clock with a `wanted` mark, on the oldest event in
  /// flight that covers it (the least work that does), without the host waiting; the marks up to
  /// that event's become usable by `user` for this request (usable) and leave `wanted`. A mark
  /// with no event yet (events are recorded only during a call on their own stream, which may be
  /// gone), or whose join fails, keeps its `wanted` for wait_for_wanted. True when some `wanted`
  /// mark is left. Only for Events that can join (can_join).
  bool join_wanted([[maybe_unused]] stream_ref user) noexcept {
    bool left = false;
    if constexpr (can_join) {
      joiner_ = user;
      for (clock& c : clocks_) {
        if (c.wanted == 0 || c.wanted <= c.done) continue;
        const auto it = std::find_if(c.in_flight.begin(), c.in_flight.end(),
                                     [&](const auto& entry) { return entry.first >= c.wanted; });
        if (it != c.in_flight.end()) {
          try {
            events_.join(user, it->second);
            c.joined = std::max(c.joined, it->first);
            c.wanted = 0;
            continue;
          } catch (...) {
          }
        }
        left = true;
      }
    }
    return left;
  }

  /// Waits until every clock's `wanted` mark has completed: for the events of just those
  /// streams, up to the newest mark needed on each, so the host blocks only until that work is
  /// done; synchronizes the device instead when a needed mark has no event yet.
  void wait_for_wanted() noexcept {
    if constexpr (has_events) {
      bool recorded = true;  // marks are recorded in order
      for (const clock& c : clocks_) {
        if (c.wanted != 0 && (c.in_flight.empty() || c.in_flight.back().first < c.wanted)) recorded = false;
      }
      if (!recorded) {
        synchronize_all();
        return;
      }
      for (clock& c : clocks_) {
        if (c.wanted == 0 || c.wanted <= c.done) continue;
        auto it = c.in_flight.begin();
        while (it->first < c.wanted) ++it;
        events_.wait(it->second);
        // The stream ran in order: that event's work and every earlier one's are done.
        const std::uint64_t through = it->first;
        while (!c.in_flight.empty() && c.in_flight.front().first <= through) retire_oldest(c);
      }
    }
  }

 private:
  void enter_other(stream_ref stream) {
    if (find(stream) == nullptr) {
      clock c;
      c.stream = stream;
      clocks_.push_back(std::move(c));
    }
    current_ = stream;
  }

  void retire_oldest(clock& c) noexcept {
    c.done = c.in_flight.front().first;
    events_.recycle(c.in_flight.front().second);
    c.in_flight.pop_front();
  }

  Events events_;
  int interval_us_;
  std::vector<clock> clocks_;  // every stream that has called the allocator
  stream_ref current_{};       // of the last call that entered
  stream_ref joiner_{};        // the stream whose joins `joined` marks (join_wanted)
};

}  // namespace glake::detail
