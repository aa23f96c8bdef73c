// Replaying a trace through one configuration, and what comes out of it.
#pragma once

#include <time.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "configurations.hpp"
#include "latency.hpp"
#include "snapshot.hpp"
#include "trace.hpp"

namespace glake::replay {

struct replay_result {
  std::string trace;
  std::string allocator;
  std::size_t events = 0;
  std::size_t peak_active_bytes = 0;
  std::size_t peak_reserved_bytes = 0;
  double utilization = 0;
  std::size_t failed_allocations = 0;
  driver_call_counts driver_calls{};
  std::uint64_t segments_created = 0;  ///< cudaMalloc calls under the cuda_malloc model
  std::uint64_t segments_released = 0;
  std::uint64_t stitches = 0;
  std::uint64_t stitch_cache_hits = 0;
  std::uint64_t stitch_repairs = 0;
  std::uint64_t stitch_grows = 0;
  std::uint64_t cross_stream_bytes = 0;  ///< free bytes that moved to another stream
  std::uint64_t splits = 0;
  std::uint64_t merges = 0;
  std::uint64_t stitch_evictions = 0;
  std::size_t peak_allocated_bytes = 0;
  /// FNV-1a over every a/f event's outcome (the address handed out, or 0, and the bytes reserved
  /// after it): equal digests mean the allocator made the same placement decisions throughout.
  std::uint64_t placement_digest = 0;
  double modeled_driver_us = 0;
  /// The thread's CPU time per a/f event inside the allocator (the replay's own bookkeeping
  /// included, its free-memory probe at each new peak excluded): unlike wall time, it does not
  /// grow when other processes share the host's cores.
  double host_ns_per_operation = 0;
  std::size_t recorded_peak_reserved = 0;  ///< PyTorch's own, from the trace (0 if none)
  std::optional<free_breakdown> free_at_peak;  ///< where free memory sat at peak reserved
  std::vector<double> reserved_series;     ///< after each a/f event, when asked for
  std::vector<double> active_series;
};

/// A replay's snapshot for memory_viz, when asked for (see snapshot.hpp): its history while
/// replaying, then the snapshot's JSON.
struct replay_snapshot {
  explicit replay_snapshot(std::size_t max_entries) : history(max_entries) {}
  replay_history history;
  std::string json;           ///< the snapshot at the end of the trace
  bool has_segments = false;  ///< the configuration showed its segments (a snapshotting_allocator)
  bool observed = false;      ///< it reported its segment actions (an observable_allocator)
};

/// An exception that ended a replay, with where it happened: "<source>:<line>: <configuration>,
/// event <n> (<the event>): <what the exception said>".
class replay_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

/// This thread's CPU time in nanoseconds (CLOCK_THREAD_CPUTIME_ID), or wall time where the
/// system has no per-thread clock.
inline std::int64_t thread_cpu_ns() {
  timespec ts{};
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0) {
    return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
  }
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline std::string describe(const trace_event& e) {
  switch (e.what) {
    case trace_event::kind::alloc:
      return "a," + std::to_string(e.id) + "," + std::to_string(e.bytes) + "," + std::to_string(e.stream);
    case trace_event::kind::free:
      return "f," + std::to_string(e.id);
    case trace_event::kind::segment_alloc:
      return "S," + std::to_string(e.bytes);
    case trace_event::kind::segment_free:
      return "U," + std::to_string(e.bytes);
  }
  return "?";
}

inline replay_result replay_events(const trace& t, const configuration& c, std::size_t capacity, bool series,
                                   const std::function<void(double)>& progress, replay_snapshot* snapshot,
                                   std::size_t& i);

}  // namespace detail

/// Replays the a/f events of `t` in order through a fresh instance of `c` on a simulated device
/// of `capacity` bytes. A request the allocator cannot meet counts as failed and its free is
/// skipped. `progress(fraction)` is called every 1/64 of the trace when given. With `snapshot`,
/// the replay's memory history and the allocator's state at the end go into it. Any exception
/// (std::bad_alloc from a host out of memory, a broken allocator invariant) comes out as
/// replay_error naming the trace's file, the event's line and the configuration.
inline replay_result replay_trace(const trace& t, const configuration& c, std::size_t capacity, bool series,
                                  const std::function<void(double)>& progress = {},
                                  replay_snapshot* snapshot = nullptr) {
  std::size_t i = std::numeric_limits<std::size_t>::max();  // not yet at an event
  try {
    return detail::replay_events(t, c, capacity, series, progress, snapshot, i);
  } catch (const replay_error&) {
    throw;
  } catch (const std::exception& e) {
    const std::string what = dynamic_cast<const std::bad_alloc*>(&e) != nullptr
                                 ? std::string("out of host memory (") + e.what() + ")"
                                 : std::string(e.what());
    if (i < t.events.size()) {
      throw replay_error(t.source + ":" + std::to_string(t.line_of(i)) + ": " + c.name + ", event " +
                         std::to_string(i + 1) + " (" + detail::describe(t.events[i]) + "): " + what);
    }
    throw replay_error(t.source + ": " + c.name + (i == t.events.size() ? ", after the last event: " : ", setting up: ") +
                       what);
  }
}

/// replay_trace's work; `i` tells the caller which event was being replayed when it threw.
inline replay_result detail::replay_events(const trace& t, const configuration& c, std::size_t capacity, bool series,
                                           const std::function<void(double)>& progress, replay_snapshot* snapshot,
                                           std::size_t& i) {
  std::unique_ptr<replayable> allocator = c.make(capacity);
  if (snapshot != nullptr) snapshot->observed = allocator->observe(&snapshot->history);
  replay_result r;
  r.trace = t.name;
  r.allocator = c.name;
  r.recorded_peak_reserved = t.recorded_peak_reserved;
  std::unordered_map<std::uint64_t, void*> live;
  live.reserve(t.allocations / 4 + 16);
  if (series) {
    r.reserved_series.reserve(t.allocations + t.frees);
    r.active_series.reserve(t.allocations + t.frees);
  }
  std::size_t active = 0, reserved = 0, peak_seen = 0;
  const std::size_t step = std::max<std::size_t>(1, t.events.size() / 64);
  std::uint64_t digest = 14695981039346656037ull;
  const auto mix = [&digest](std::uint64_t value) {
    for (int byte = 0; byte < 8; ++byte) {
      digest ^= (value >> (8 * byte)) & 0xffu;
      digest *= 1099511628211ull;
    }
  };
  const std::int64_t start = thread_cpu_ns();
  std::int64_t probing = 0;  // CPU time spent in free_memory() probes, not the allocator's
  for (i = 0; i < t.events.size(); ++i) {
    const trace_event& e = t.events[i];
    if (snapshot != nullptr) snapshot->history.at_event(i + 1);
    if (e.what == trace_event::kind::alloc) {
      // A 0-byte request is PyTorch's too: it gets no memory and nothing fails.
      void* p = e.bytes == 0 ? nullptr : allocator->try_allocate(e.bytes, stream_ref{e.stream});
      mix(reinterpret_cast<std::uintptr_t>(p));
      if (snapshot != nullptr && e.bytes != 0) {
        snapshot->history.record(p != nullptr ? memory_action::alloc : memory_action::oom,
                                 reinterpret_cast<std::uintptr_t>(p), e.bytes, stream_ref{e.stream});
      }
      if (e.bytes == 0) {
      } else if (p != nullptr) {
        live.emplace(e.id, p);
        active += e.bytes;
        r.peak_active_bytes = std::max(r.peak_active_bytes, active);
      } else {
        ++r.failed_allocations;
      }
    } else if (e.what == trace_event::kind::free) {
      const auto it = live.find(e.id);
      if (it != live.end()) {
        const auto address = reinterpret_cast<std::uintptr_t>(it->second);
        if (snapshot != nullptr) {
          snapshot->history.record(memory_action::free_requested, address, e.bytes, stream_ref{e.stream});
        }
        allocator->deallocate(it->second, e.bytes, stream_ref{e.stream});
        if (snapshot != nullptr && !snapshot->observed) {
          snapshot->history.record(memory_action::free_completed, address, e.bytes, stream_ref{e.stream});
        }
        active -= e.bytes;
        live.erase(it);
      }
    } else {
      continue;  // S/U lines are PyTorch's own bookkeeping, not requests
    }
    ++r.events;
    const std::size_t now = allocator->reserved_bytes();
    mix(now);
    if (c.model == driver_model::cuda_malloc && now != reserved) {
      r.modeled_driver_us += now > reserved ? modeled_cuda_malloc_us(now - reserved) : modeled_cuda_free_us(reserved - now);
    }
    if (now > peak_seen) {  // a new high-water mark: note where the free memory is
      peak_seen = now;
      const std::int64_t probe_start = thread_cpu_ns();
      r.free_at_peak = allocator->free_memory();
      probing += thread_cpu_ns() - probe_start;
    }
    reserved = now;
    if (series) {
      r.reserved_series.push_back(static_cast<double>(now));
      r.active_series.push_back(static_cast<double>(active));
    }
    if (progress && i % step == 0) progress(static_cast<double>(i) / static_cast<double>(t.events.size()));
  }
  const std::int64_t elapsed = std::max<std::int64_t>(0, thread_cpu_ns() - start - probing);
  r.host_ns_per_operation = r.events == 0 ? 0.0 : static_cast<double>(elapsed) / static_cast<double>(r.events);
  allocator->verify();
  const statistics s = allocator->stats();
  r.peak_reserved_bytes = s.peak_reserved_bytes;
  r.utilization = r.peak_reserved_bytes == 0 ? 0.0
                                             : static_cast<double>(r.peak_active_bytes) /
                                                   static_cast<double>(r.peak_reserved_bytes);
  r.segments_created = s.segments_created;
  r.segments_released = s.segments_released;
  r.stitches = s.stitches;
  r.stitch_cache_hits = s.stitch_cache_hits;
  r.stitch_repairs = s.stitch_repairs;
  r.stitch_grows = s.stitch_grows;
  r.cross_stream_bytes = s.cross_stream_bytes;
  r.splits = s.splits;
  r.merges = s.merges;
  r.stitch_evictions = s.stitch_evictions;
  r.peak_allocated_bytes = s.peak_allocated_bytes;
  r.placement_digest = digest;
  if (snapshot != nullptr) {
    memory_snapshot_writer w;
    snapshot->has_segments = allocator->visit_state(w);
    snapshot->json = w.json({snapshot->history.entries()});
    allocator->observe(nullptr);
  }
  r.driver_calls = allocator->device().calls();
  if (c.model == driver_model::vmm) r.modeled_driver_us = modeled_vmm_us(allocator->device());
  if (allocator->device().violations() != 0) {
    throw std::logic_error(c.name + " broke a CUDA VMM rule on " + t.name + ": " +
                           allocator->device().last_violation());
  }
  return r;
}

}  // namespace glake::replay
