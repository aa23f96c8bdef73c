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
  /// Work queued on `stream` from now on waits for `e` (stream_joining_reserver only).
  void join(stream_ref stream, const event_type& e)
    requires stream_joining_reserver<Reserver>
  {
    const stopwatch watch{stats_->event_ns};
    reserver_->stream_wait_event(stream, e);
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
  };

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
};

}  // namespace glake::detail
