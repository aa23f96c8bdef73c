// Stream rules on a backend with events: record_stream defers a free until work on the other
// stream completes; cached stitched ranges are unmapped only once work queued before their free
// has completed; memory is released only after its stream is synchronized. The events here are
// completed by the test, so every ordering is checked without a GPU.
#include <doctest/doctest.h>

#include <cstdint>
#include <map>
#include <vector>

#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/sim.hpp"

namespace {

using namespace glake;
constexpr std::size_t M = MiB;

// Shared by the reserver copies: which events exist, which completed, what was synchronized.
struct event_log {
  std::uint64_t next = 1;
  std::map<std::uint64_t, std::pair<stream_ref, bool>> events;  // id -> (stream, done)
  std::size_t device_synchronized = 0;
  std::size_t waited = 0;
  std::size_t recycled = 0;

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
  bool event_done(event_type e) { return log_->events.at(e).second; }
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
static_assert(!stream_ordered_reserver<sim_reserver>);

using evented_stitching = stitching_allocator<sim_provider, evented_reserver>;
const stream_ref A{1}, B{2};

}  // namespace

TEST_CASE("stream order: a block used on another stream is reused only after that stream's work completes") {
  sim_device device(1 * GiB);
  event_log log;
  evented_stitching allocator(sim_provider{device}, evented_reserver{device, log});
  void* p = allocator.allocate(8 * M, A);
  allocator.record_stream(p, B);
  allocator.record_stream(p, B);  // recorded once
  allocator.deallocate(p, 8 * M, A);
  CHECK(log.events.size() == 1);  // an event on B marks the work that may still read p
  CHECK(allocator.stats().active_bytes == 8 * M);  // not freed yet

  void* q = allocator.allocate(8 * M, A);
  CHECK(q != p);  // p's memory is not reused while B's work may run
  CHECK_THROWS_AS(allocator.deallocate(p, 8 * M, A), usage_error);  // freeing it again is a double free

  log.complete(B);
  void* r = allocator.allocate(8 * M, A);  // now the deferred free has run
  CHECK(log.waited == 0);                  // without waiting for anything
  CHECK(r == p);
  CHECK(log.recycled == 1);
  allocator.deallocate(q, 8 * M, A);
  allocator.deallocate(r, 8 * M, A);
  allocator.verify();
  CHECK(allocator.stats().active_bytes == 0);
}

TEST_CASE("stream order: a block freed on its own stream is reused on it at once, without events") {
  sim_device device(1 * GiB);
  event_log log;
  evented_stitching allocator(sim_provider{device}, evented_reserver{device, log});
  void* p = allocator.allocate(8 * M, A);
  allocator.deallocate(p, 8 * M, A);
  CHECK(allocator.allocate(8 * M, A) == p);
  CHECK(log.events.empty());
  CHECK_THROWS_AS(allocator.record_stream(reinterpret_cast<void*>(0x1234), B), usage_error);
}

TEST_CASE("stream order: cached stitched ranges are unmapped only after work queued before their free completed") {
  sim_device device(2 * GiB);
  event_log log;
  config cfg;
  cfg.frag_limit = 0;
  cfg.auto_gc = 150 * M;
  evented_stitching allocator(sim_provider{device}, evented_reserver{device, log}, cfg);
  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(allocator.allocate(50 * M, A));
  for (int i = 0; i < 8; i += 2) allocator.deallocate(blocks[i], 50 * M, A);
  void* s1 = allocator.allocate(100 * M, A);
  void* s2 = allocator.allocate(100 * M, A);
  allocator.deallocate(s1, 100 * M, A);  // cached; an event marks A's work so far
  allocator.deallocate(s2, 100 * M, A);  // 200 MiB cached > 150: but A's work has not completed
  CHECK(allocator.stats().stitch_evictions == 0);
  CHECK(allocator.stats().cached_stitch_bytes == 200 * M);

  log.complete(A);
  void* s3 = allocator.allocate(100 * M, A);  // reuses a cached range: no eviction needed
  allocator.deallocate(s3, 100 * M, A);       // over the cap again, and now the events are done
  CHECK(allocator.stats().stitch_evictions == 1);
  CHECK(allocator.stats().cached_stitch_bytes == 100 * M);
  allocator.verify();

  const std::size_t syncs = log.device_synchronized;
  for (int i = 1; i < 8; i += 2) allocator.deallocate(blocks[i], 50 * M, A);
  allocator.release_cached();  // releases physical memory: queued work must be done first
  CHECK(log.device_synchronized == syncs + 1);
  CHECK(allocator.stats().reserved_bytes == 0);
  CHECK(device.violations() == 0);
}

TEST_CASE("stream order: under memory pressure a pending free waits for its event instead of failing") {
  sim_device device(16 * M);
  event_log log;
  evented_stitching allocator(sim_provider{device}, evented_reserver{device, log});
  void* p = allocator.allocate(16 * M, A);
  allocator.record_stream(p, B);
  allocator.deallocate(p, 16 * M, A);
  void* q = allocator.allocate(16 * M, A);  // the device is full: waits for B's event, then reuses p
  CHECK(q == p);
  CHECK(log.waited == 1);
  allocator.deallocate(q, 16 * M, A);
  allocator.verify();
}
