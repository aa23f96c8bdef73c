// A sim reserver whose events the test completes by hand, so that stream-ordering rules are
// checked without a GPU. Shared by the tests of the stitching allocator and of its stream clocks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "glake/backends/concepts.hpp"
#include "glake/backends/sim.hpp"
#include "glake/errors.hpp"
#include "glake/stream.hpp"

namespace glake::testing {

// Shared by the reserver copies: which events exist, which completed, what was synchronized.
struct event_log {
  std::uint64_t next = 1;
  std::map<std::uint64_t, std::pair<stream_ref, bool>> events;  // id -> (stream, done)
  std::size_t device_synchronized = 0;
  std::size_t waited = 0;
  std::size_t recycled = 0;
  std::size_t queried = 0;
  bool fail_queries = false;  // event_done throws, as a CUDA error would
  bool fail_joins = false;    // stream_wait_event throws, as a CUDA error would
  std::vector<std::pair<stream_ref, stream_ref>> joins;  // (waiting stream, stream of the event)

  void complete(stream_ref stream) {
    for (auto& [id, e] : events) {
      if (e.first == stream) e.second = true;
    }
  }
};

// A sim reserver with manually completed events: a stream_ordered_reserver for tests.
class evented_reserver : public sim_reserver {
 public:
  using event_type = std::uint64_t;
  evented_reserver(sim_device& device, event_log& log) : sim_reserver(device), log_(&log) {}
  event_type record_event(stream_ref stream) {
    const auto id = log_->next++;
    log_->events[id] = {stream, false};
    return id;
  }
  bool event_done(event_type e) {
    ++log_->queried;
    if (log_->fail_queries) throw driver_error("cuEventQuery", 999, "injected");
    return log_->events.at(e).second;
  }
  void recycle_event(event_type) noexcept { ++log_->recycled; }
  void wait_event(event_type e) noexcept {
    ++log_->waited;
    log_->events.at(e).second = true;
  }
  void synchronize_device() noexcept {
    ++log_->device_synchronized;
    for (auto& [id, e] : log_->events) e.second = true;
  }

 private:
  event_log* log_;
};
static_assert(stream_ordered_reserver<evented_reserver>);
static_assert(!stream_joining_reserver<evented_reserver>);
static_assert(!stream_ordered_reserver<sim_reserver>);

// The same whose streams wait for events: a stream_joining_reserver. The log records each wait;
// the test completes streams in the order the waits imply.
class joining_reserver : public evented_reserver {
 public:
  joining_reserver(sim_device& device, event_log& log) : evented_reserver(device, log), log_(&log) {}
  void stream_wait_event(stream_ref stream, event_type e) {
    if (log_->fail_joins) throw driver_error("cuStreamWaitEvent", 999, "injected");
    log_->joins.emplace_back(stream, log_->events.at(e).first);
  }

 private:
  event_log* log_;
};
static_assert(stream_joining_reserver<joining_reserver>);

}  // namespace glake::testing
