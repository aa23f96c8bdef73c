// Stream rules on a backend with events: record_stream defers a free until work on the other
// stream completes; cached stitched ranges are unmapped only once work queued before their free
// has completed; memory is released only after its stream is synchronized. The events here are
// completed by the test, so every ordering is checked without a GPU.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/sim.hpp"
#include "support/evented_reserver.hpp"

namespace {

using namespace glake;
constexpr std::size_t M = MiB;

using testing::event_log;
using testing::evented_reserver;

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
  void* again = allocator.allocate(8 * M, A);
  CHECK(again == p);
  allocator.deallocate(again, 8 * M, A);
  CHECK(log.events.empty());
  CHECK_THROWS_AS(allocator.record_stream(reinterpret_cast<void*>(0x1234), B), usage_error);
}

TEST_CASE("stream order: record_stream on the allocation's own stream frees it at once") {
  sim_device device(1 * GiB);
  event_log log;
  evented_stitching allocator(sim_provider{device}, evented_reserver{device, log});
  void* p = allocator.allocate(8 * M, A);
  allocator.record_stream(p, A);  // PyTorch allows it; there is nothing to wait for
  allocator.deallocate(p, 8 * M, A);
  CHECK(allocator.stats().active_bytes == 0);
  CHECK(allocator.stats().deallocations == 1);
  CHECK(log.events.empty());
  void* again = allocator.allocate(8 * M, A);
  CHECK(again == p);
  allocator.deallocate(again, 8 * M, A);
  allocator.verify();
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
  // Every time the host blocked on the device counts: synchronizations and event waits.
  CHECK(log.waited > 0);
  CHECK(allocator.stats().device_waits == log.device_synchronized + log.waited);
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
  CHECK(allocator.stats().device_waits == 1);
  allocator.deallocate(q, 16 * M, A);
  allocator.verify();
}

TEST_CASE("stream order: a free block moves to another stream only once its free has completed") {
  sim_device device(1 * GiB);
  event_log log;
  evented_stitching allocator(sim_provider{device}, evented_reserver{device, log});
  void* b0 = allocator.allocate(64 * M, B);
  void* p = allocator.allocate(64 * M, A);
  CHECK(log.events.empty());
  allocator.deallocate(p, 64 * M, A);  // two streams: the free gets an event, during A's call
  REQUIRE(log.events.size() == 1);
  CHECK(log.events.begin()->second.first == A);

  void* q = allocator.allocate(128 * M, B);
  CHECK(q != p);  // A's work may still use p, which could not serve 128 MiB anyway: B grows
  CHECK(allocator.stats().reserved_bytes == 256 * M);
  CHECK(allocator.stats().cross_stream_bytes == 0);
  CHECK(log.device_synchronized == 0);

  log.complete(A);
  void* r = allocator.allocate(64 * M, B);  // now p's block is B's, without waiting or growing
  CHECK(r == p);
  CHECK(allocator.stats().reserved_bytes == 256 * M);
  CHECK(allocator.stats().cross_stream_bytes == 64 * M);
  CHECK(log.waited == 0);
  CHECK(log.device_synchronized == 0);
  CHECK(allocator.stats().device_waits == 0);
  CHECK(log.events.size() == 1);  // B's calls recorded nothing on A (it might be gone)
  allocator.deallocate(r, 64 * M, B);
  allocator.deallocate(q, 128 * M, B);
  allocator.deallocate(b0, 64 * M, B);
  allocator.verify();
  CHECK(device.violations() == 0);
}

TEST_CASE("stream order: free blocks of another stream that would serve a request are waited for (their event), not grown past") {
  sim_device device(1 * GiB);
  event_log log;
  evented_stitching allocator(sim_provider{device}, evented_reserver{device, log});
  void* b0 = allocator.allocate(64 * M, B);
  void* p = allocator.allocate(64 * M, A);
  allocator.deallocate(p, 64 * M, A);  // its event is pending
  void* q = allocator.allocate(64 * M, B);
  CHECK(q == p);  // taken only after A's event for that free was waited for
  CHECK(log.waited == 1);
  CHECK(log.device_synchronized == 0);
  CHECK(allocator.stats().device_waits == 1);
  CHECK(log.events.begin()->second.second);
  CHECK(allocator.stats().reserved_bytes == 128 * M);
  CHECK(allocator.stats().cross_stream_bytes == 64 * M);
  allocator.deallocate(q, 64 * M, B);
  allocator.deallocate(b0, 64 * M, B);
  allocator.verify();
  CHECK(device.violations() == 0);
}

TEST_CASE("stream order: a wait for another stream's frees ends at the newest one needed, and counts the earlier ones done") {
  sim_device device(1 * GiB);
  event_log log;
  evented_stitching allocator(sim_provider{device}, evented_reserver{device, log});
  void* b0 = allocator.allocate(16 * M, B);
  void* p1 = allocator.allocate(64 * M, A);
  void* p2 = allocator.allocate(96 * M, A);
  allocator.deallocate(p1, 64 * M, A);  // A's first event
  std::this_thread::sleep_for(std::chrono::milliseconds(3));  // A's events are >= 1 ms apart
  allocator.deallocate(p2, 96 * M, A);  // A's second event
  REQUIRE(log.events.size() == 2);

  void* q = allocator.allocate(80 * M, B);  // only p2's block would do: wait for its event alone
  CHECK(q == p2);
  CHECK(log.waited == 1);
  CHECK(log.device_synchronized == 0);
  CHECK(log.recycled == 2);  // the first event went with it: A's work up to it is done too
  void* r = allocator.allocate(64 * M, B);  // p1's block, done by the same wait
  CHECK(r == p1);
  CHECK(log.waited == 1);
  CHECK(allocator.stats().device_waits == 1);
  CHECK(allocator.stats().reserved_bytes == 176 * M);
  allocator.verify();
  allocator.deallocate(r, 64 * M, B);
  allocator.deallocate(q, 80 * M, B);
  allocator.deallocate(b0, 16 * M, B);
  allocator.verify();
  CHECK(device.violations() == 0);
}

TEST_CASE("stream order: several pending free blocks of another stream are waited for and stitched") {
  sim_device device(1 * GiB);
  event_log log;
  config cfg;
  cfg.frag_limit = 0;
  evented_stitching allocator(sim_provider{device}, evented_reserver{device, log}, cfg);
  void* b0 = allocator.allocate(32 * M, B);
  std::vector<void*> a;
  for (int i = 0; i < 4; ++i) a.push_back(allocator.allocate(32 * M, A));
  allocator.deallocate(a[0], 32 * M, A);
  allocator.deallocate(a[2], 32 * M, A);  // two pending blocks of 32 MiB, not neighbours

  void* big = allocator.allocate(96 * M, B);  // they cannot cover 96 MiB: B grows, no wait
  CHECK(log.device_synchronized == 0);
  CHECK(allocator.stats().cross_stream_bytes == 0);
  const std::size_t reserved = allocator.stats().reserved_bytes;
  const std::size_t stitches = allocator.stats().stitches;

  void* c = allocator.allocate(64 * M, B);  // they cover 64 MiB: wait once, take both, stitch
  CHECK(c != nullptr);
  // On A's event for the second free, or on the device when that free has no event yet (A's
  // events are at most one per millisecond): once either way.
  CHECK(log.device_synchronized + log.waited == 1);
  CHECK(allocator.stats().device_waits == 1);
  CHECK(allocator.stats().reserved_bytes == reserved);
  CHECK(allocator.stats().cross_stream_bytes == 64 * M);
  CHECK(allocator.stats().stitches == stitches + 1);
  allocator.deallocate(c, 64 * M, B);
  allocator.deallocate(big, 96 * M, B);
  allocator.deallocate(a[1], 32 * M, A);
  allocator.deallocate(a[3], 32 * M, A);
  allocator.deallocate(b0, 32 * M, B);
  allocator.verify();
  CHECK(device.violations() == 0);
}

TEST_CASE("stream order: a cached stitch is not reused over chunks another stream has taken, but repaired") {
  sim_device device(1 * GiB);
  event_log log;
  config cfg;
  cfg.frag_limit = 0;
  evented_stitching allocator(sim_provider{device}, evented_reserver{device, log}, cfg);
  void* w = allocator.allocate(32 * M, B);
  std::vector<void*> a;
  for (int i = 0; i < 4; ++i) a.push_back(allocator.allocate(32 * M, A));
  allocator.deallocate(a[0], 32 * M, A);
  allocator.deallocate(a[2], 32 * M, A);
  void* s = allocator.allocate(64 * M, A);  // stitched over a[0] and a[2]
  REQUIRE(allocator.stats().stitches == 1);
  allocator.deallocate(s, 64 * M, A);       // cached
  log.complete(A);
  allocator.deallocate(a[1], 32 * M, A);    // an event now covers every free on A so far
  log.complete(A);

  void* b = allocator.allocate(32 * M, B);  // takes the best fit of A's completed free blocks
  CHECK(b == a[0]);
  CHECK(allocator.stats().cross_stream_bytes == 32 * M);
  allocator.deallocate(b, 32 * M, B);       // free again, but on B, and B's work is not done

  void* t = allocator.allocate(64 * M, A);
  // Half the cached range's chunks are B's now: the range is reused on A only after those are
  // replaced by A's free chunks (a[1]'s), so B's memory is never mapped into A's allocation.
  CHECK(allocator.stats().stitch_repairs == 1);
  CHECK(t == s);
  void* again = allocator.allocate(32 * M, B);
  for (std::size_t off = 0; off < 64 * M; off += 2 * M) {
    const auto where = device.resolve(static_cast<char*>(t) + off);
    REQUIRE(where.has_value());
    for (std::size_t o = 0; o < 32 * M; o += 2 * M) CHECK(where->handle != device.resolve(static_cast<char*>(again) + o)->handle);
  }
  allocator.deallocate(again, 32 * M, B);
  allocator.deallocate(t, 64 * M, A);
  allocator.deallocate(a[3], 32 * M, A);
  allocator.deallocate(w, 32 * M, B);
  allocator.verify();
  allocator.release_cached();
  CHECK(allocator.stats().reserved_bytes == 0);
  CHECK(device.violations() == 0);
}

namespace {

// Four 100 MiB blocks on A; the first and third are freed and stitched into a 200 MiB range,
// which is freed in turn: cached, with an event marking A's work that may still read it.
struct cached_range {
  sim_device device;
  event_log log;
  evented_stitching allocator;
  void* blocks[4];
  void* range;

  explicit cached_range(std::size_t capacity)
      : device(capacity), allocator(sim_provider{device}, evented_reserver{device, log}, stitch_everything()) {
    for (auto& b : blocks) b = allocator.allocate(100 * M, A);
    allocator.deallocate(blocks[0], 100 * M, A);
    allocator.deallocate(blocks[2], 100 * M, A);
    range = allocator.allocate(200 * M, A);
    REQUIRE(allocator.stats().stitches == 1);
    allocator.deallocate(range, 200 * M, A);
  }
  static config stitch_everything() {
    config cfg;
    cfg.frag_limit = 0;
    return cfg;
  }
  // Frees `live` (pointer, bytes) and block 3, and checks that nothing is left behind.
  void finish(std::initializer_list<std::pair<void*, std::size_t>> live) {
    for (const auto& [p, bytes] : live) allocator.deallocate(p, bytes, A);
    allocator.deallocate(blocks[3], 100 * M, A);
    allocator.verify();
    allocator.release_cached();
    CHECK(allocator.stats().reserved_bytes == 0);
    CHECK(device.violations() == 0);
  }
};

}  // namespace

TEST_CASE("stream order: a cached stitch grows in place without waiting for the work queued before its free") {
  cached_range c(1 * GiB);
  c.allocator.deallocate(c.blocks[1], 100 * M, A);
  // Appending maps addresses no queued work can use, and the range's own chunks are reused on
  // their own stream, so nothing waits.
  void* t = c.allocator.allocate(260 * M, A);
  CHECK(t == c.range);
  CHECK(c.allocator.stats().stitch_grows == 1);
  CHECK(c.log.waited == 0);
  CHECK(c.log.device_synchronized == 0);
  c.finish({{t, 260 * M}});
}

TEST_CASE("stream order: a failed event query during a repair serves the request anew and loses nothing") {
  cached_range c(500 * M);
  void* hole = c.allocator.allocate(40 * M, A);  // the range needs a repair now
  c.allocator.deallocate(c.blocks[1], 100 * M, A);
  c.log.complete(A);
  c.log.fail_queries = true;
  void* t = nullptr;
  CHECK_NOTHROW(t = c.allocator.allocate(200 * M, A));
  CHECK(t != nullptr);
  CHECK(t != c.range);  // not repaired: a new stitch
  CHECK(c.allocator.stats().stitch_repairs == 0);
  CHECK(c.allocator.stats().stitches == 2);
  c.log.fail_queries = false;
  c.allocator.verify();
  c.finish({{t, 200 * M}, {hole, 40 * M}});
}

TEST_CASE("stream order: a cached stitch is repaired only once the work queued before its free has completed") {
  for (const bool completed : {false, true}) {
    CAPTURE(completed);
    cached_range c(500 * M);
    void* hole = c.allocator.allocate(40 * M, A);
    c.allocator.deallocate(c.blocks[1], 100 * M, A);
    if (completed) c.log.complete(A);
    void* t = c.allocator.allocate(200 * M, A);
    // Remapping the range under work that may still read it would change what that work reads.
    CHECK(c.allocator.stats().stitch_repairs == (completed ? 1 : 0));
    CHECK((t == c.range) == completed);
    CHECK(c.log.waited == 0);
    c.finish({{t, 200 * M}, {hole, 40 * M}});
  }
}

TEST_CASE("stream order: a cached stitch reused on its stream gives its free event back") {
  sim_device device(1 * GiB);
  event_log log;
  config cfg;
  cfg.frag_limit = 0;
  evented_stitching allocator(sim_provider{device}, evented_reserver{device, log}, cfg);
  std::vector<void*> a;
  for (int i = 0; i < 4; ++i) a.push_back(allocator.allocate(32 * M, A));
  allocator.deallocate(a[0], 32 * M, A);
  allocator.deallocate(a[2], 32 * M, A);
  void* s = allocator.allocate(64 * M, A);
  allocator.deallocate(s, 64 * M, A);  // cached: one event
  CHECK(log.events.size() == 1);
  CHECK(allocator.allocate(64 * M, A) == s);  // same stream: reused at once, its event returned
  CHECK(log.recycled == 1);
  allocator.deallocate(s, 64 * M, A);  // a new event for the new free
  CHECK(log.events.size() == 2);
  CHECK(log.recycled == 1);
  allocator.release_cached();
  CHECK(log.recycled == 2);  // every event recorded has been given back
  allocator.deallocate(a[1], 32 * M, A);
  allocator.deallocate(a[3], 32 * M, A);
  allocator.verify();
}

TEST_CASE("stream order: without events, free blocks of other streams are stitched before growing") {
  sim_device device(1 * GiB);
  config cfg;
  cfg.frag_limit = 0;
  stitching_allocator<sim_provider, sim_reserver> allocator(sim_provider{device}, sim_reserver{device}, cfg);
  std::vector<void*> a;
  for (int i = 0; i < 4; ++i) a.push_back(allocator.allocate(32 * M, A));
  allocator.deallocate(a[0], 32 * M, A);
  allocator.deallocate(a[2], 32 * M, A);
  void* b = allocator.allocate(64 * M, B);  // no block of 64 MiB anywhere: A's two are stitched
  CHECK(allocator.stats().stitches == 1);
  CHECK(allocator.stats().cross_stream_bytes == 64 * M);
  CHECK(allocator.stats().reserved_bytes == 128 * M);
  allocator.deallocate(b, 64 * M, B);
  allocator.deallocate(a[1], 32 * M, A);
  allocator.deallocate(a[3], 32 * M, A);
  allocator.verify();
}

TEST_CASE("stream order: a segment left in free blocks of two streams is still released whole") {
  sim_device device(1 * GiB);
  event_log log;
  evented_stitching allocator(sim_provider{device}, evented_reserver{device, log});
  void* w = allocator.allocate(64 * M, B);
  void* x = allocator.allocate(64 * M, A);
  allocator.deallocate(x, 64 * M, A);
  void* y = allocator.allocate(32 * M, A);  // the segment's first half; the rest stays free on A
  CHECK(y == x);
  log.complete(A);
  void* z = allocator.allocate(32 * M, B);  // the second half moves to B
  CHECK(static_cast<char*>(z) == static_cast<char*>(x) + 32 * M);
  CHECK(allocator.stats().reserved_bytes == 128 * M);
  allocator.deallocate(w, 64 * M, B);
  allocator.deallocate(y, 32 * M, A);
  allocator.deallocate(z, 32 * M, B);  // two free halves of one segment, of different streams
  allocator.verify();
  const std::size_t syncs = log.device_synchronized;
  allocator.release_cached();
  CHECK(allocator.stats().reserved_bytes == 0);
  CHECK(log.device_synchronized > syncs);  // merged only after the device was synchronized
  CHECK(device.violations() == 0);
}

TEST_CASE("stream order: waiting frees cost one event query per stream, not one per free") {
  sim_device device(2 * GiB);
  event_log log;
  evented_stitching allocator(sim_provider{device}, evented_reserver{device, log});
  std::vector<void*> used_on_b;
  for (int i = 0; i < 50; ++i) {
    used_on_b.push_back(allocator.allocate(8 * M, A));
    allocator.record_stream(used_on_b.back(), B);
  }
  for (void* p : used_on_b) allocator.deallocate(p, 8 * M, A);  // 50 frees wait for B
  CHECK(allocator.stats().active_bytes == 50 * 8 * M);

  const std::size_t before = log.queried;
  void* q = allocator.allocate(8 * M, A);
  CHECK(log.queried - before == 1);  // the oldest's event is pending, so the rest are too
  log.complete(B);
  void* r = allocator.allocate(8 * M, A);  // now all 50 run, oldest first
  CHECK(allocator.stats().active_bytes == 2 * 8 * M);
  CHECK(log.recycled >= 50);
  allocator.deallocate(q, 8 * M, A);
  allocator.deallocate(r, 8 * M, A);
  allocator.verify();
}

TEST_CASE("stream order: with several streams, calls query a stream's events at most once per event interval") {
  sim_device device(2 * GiB);
  event_log log;
  evented_stitching allocator(sim_provider{device}, evented_reserver{device, log});
  allocator.deallocate(allocator.allocate(8 * M, B), 8 * M, B);  // a second stream
  allocator.deallocate(allocator.allocate(8 * M, A), 8 * M, A);  // A is dirty: an event is recorded
  REQUIRE(log.events.size() >= 1);
  const std::size_t before = log.queried;
  const auto start = std::chrono::steady_clock::now();
  constexpr int calls = 200;
  for (int i = 0; i < calls; ++i) allocator.deallocate(allocator.allocate(8 * M, A), 8 * M, A);
  const auto elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
  // The event is never completed here, so each poll is one query; one poll per 1 ms interval at
  // most (not one per call, as a free makes the stream dirty again every time).
  CHECK(log.queried - before <= static_cast<std::size_t>(elapsed.count()) + 2);
  CHECK(log.queried - before < calls);
  allocator.verify();
}

TEST_CASE("stream order: statistics count event records and queries, event_interval_us spaces a stream's events") {
  for (const int interval : {0, 1'000'000}) {
    CAPTURE(interval);
    sim_device device(2 * GiB);
    event_log log;
    config cfg;
    cfg.event_interval_us = interval;
    evented_stitching allocator(sim_provider{device}, evented_reserver{device, log}, cfg);
    void* on_b = allocator.allocate(8 * M, B);  // a second stream, without a free on it
    REQUIRE(log.events.empty());
    constexpr int frees = 10;
    for (int i = 0; i < frees; ++i) allocator.deallocate(allocator.allocate(8 * M, A), 8 * M, A);
    const statistics s = allocator.stats();
    CHECK(s.events_recorded == log.events.size());
    CHECK(s.event_queries == log.queried);
    // No event completes here. Without an interval each free gets an event of its own, after a
    // query of the pending one; with a second's, the first event covers the other nine frees.
    CHECK(s.events_recorded == (interval == 0 ? frees : 1u));
    CHECK(s.event_queries == (interval == 0 ? frees - 1u : 0u));
    CHECK(s.device_waits == 0);
    allocator.deallocate(on_b, 8 * M, B);
    allocator.verify();
  }
}

TEST_CASE("stream order: release_completed gives back only segments whose frees completed, never waiting") {
  sim_device device(1 * GiB);
  event_log log;
  config cfg;
  cfg.event_interval_us = 0;  // an event for every call's frees
  evented_stitching allocator(sim_provider{device}, evented_reserver{device, log}, cfg);
  // With one stream nothing needs events after frees: the first call turns them on.
  CHECK(allocator.release_completed(0) == 0);
  void* a = allocator.allocate(64 * M, A);
  void* b = allocator.allocate(64 * M, A);
  void* c = allocator.allocate(64 * M, A);
  allocator.deallocate(a, 64 * M, A);
  allocator.deallocate(b, 64 * M, A);
  allocator.deallocate(c, 64 * M, A);
  const std::size_t held = allocator.stats().reserved_bytes;
  REQUIRE(held >= 3 * 64 * M);

  // Their work may still run: nothing goes back, and nothing waited.
  CHECK(allocator.release_completed(~std::size_t{0}) == 0);
  CHECK(allocator.stats().reserved_bytes == held);
  CHECK(log.waited == 0);
  CHECK(log.device_synchronized == 0);

  // The events after the frees completed: everything goes back, still without a wait.
  log.complete(A);
  CHECK(allocator.release_completed(64 * M) >= 64 * M);  // stops once enough went back
  CHECK(allocator.stats().reserved_bytes > 0);
  allocator.release_completed(~std::size_t{0});
  CHECK(allocator.stats().reserved_bytes == 0);
  CHECK(device.physical_bytes() == 0);
  CHECK(log.waited == 0);
  CHECK(log.device_synchronized == 0);
  allocator.verify();
  CHECK(device.violations() == 0);
}
