// Stream joins (config::stream_join): a request that another stream's pending frees would serve
// makes its stream wait on that stream's event on the device and takes the blocks at once; the
// host does not wait and nothing grows. Events are completed (or not) by the test, so every
// ordering is checked without a GPU.
#include <doctest/doctest.h>

#include <cstddef>
#include <utility>
#include <vector>

#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/sim.hpp"
#include "support/evented_reserver.hpp"

namespace {

using namespace glake;
constexpr std::size_t M = MiB;

using testing::event_log;
using testing::joining_reserver;

using joining_stitching = stitching_allocator<sim_provider, joining_reserver>;
const stream_ref A{1}, B{2}, C{3};

config with_join(bool join) {
  config cfg;
  cfg.stream_join = join;
  cfg.event_interval_us = 1'000'000;  // one event per stream while it is pending: deterministic
  return cfg;
}

// B holds 64 MiB; A allocated `bytes` and freed it, its event still pending.
struct pending_free_on_a {
  sim_device device{1 * GiB};
  event_log log;
  joining_stitching allocator;
  void* b0;
  void* p;
  std::size_t bytes;

  pending_free_on_a(bool join, std::size_t n)
      : allocator(sim_provider{device}, joining_reserver{device, log}, with_join(join)), bytes(n) {
    b0 = allocator.allocate(64 * M, B);
    p = allocator.allocate(n, A);
    allocator.deallocate(p, n, A);  // A's event for it is recorded, and pending
    REQUIRE(log.events.size() == 1);
    REQUIRE_FALSE(log.events.begin()->second.second);
  }
};

}  // namespace

TEST_CASE("stream join: with the option on, a request takes another stream's pending free block with one join") {
  pending_free_on_a f(true, 64 * M);
  const std::size_t reserved = f.allocator.stats().reserved_bytes;

  void* q = f.allocator.allocate(64 * M, B);
  CHECK(q == f.p);  // A's block, at once
  REQUIRE(f.log.joins.size() == 1);
  CHECK(f.log.joins[0] == std::pair{B, A});  // B waits on A's event, on the device
  CHECK(f.log.waited == 0);                  // the host did not
  CHECK(f.log.device_synchronized == 0);
  CHECK_FALSE(f.log.events.begin()->second.second);  // A's work may still run
  const statistics s = f.allocator.stats();
  CHECK(s.stream_joins == 1);
  CHECK(s.device_waits == 0);
  CHECK(s.reserved_bytes == reserved);  // no growth
  CHECK(s.segments_created == 2);
  CHECK(s.cross_stream_bytes == 64 * M);
  f.allocator.deallocate(q, 64 * M, B);
  f.allocator.deallocate(f.b0, 64 * M, B);
  f.allocator.verify();
  CHECK(f.device.violations() == 0);
}

TEST_CASE("stream join: with the option off, the host waits for the event as before") {
  pending_free_on_a f(false, 64 * M);
  const std::size_t reserved = f.allocator.stats().reserved_bytes;

  void* q = f.allocator.allocate(64 * M, B);
  CHECK(q == f.p);
  CHECK(f.log.joins.empty());
  CHECK(f.log.waited == 1);
  CHECK(f.log.events.begin()->second.second);  // waited for: complete
  const statistics s = f.allocator.stats();
  CHECK(s.stream_joins == 0);
  CHECK(s.device_waits == 1);
  CHECK(s.reserved_bytes == reserved);
  f.allocator.deallocate(q, 64 * M, B);
  f.allocator.deallocate(f.b0, 64 * M, B);
  f.allocator.verify();
}

TEST_CASE("stream join: a block taken by a join is its new stream's, and a third stream waits for that stream's work") {
  // A's 128 MiB block moves to B by a join; B uses 64 MiB, the rest stays free on B. Its mark is
  // B's next, which has no event yet: C cannot take it, nor join it, without the host waiting.
  pending_free_on_a f(true, 128 * M);
  void* q = f.allocator.allocate(64 * M, B);
  CHECK(q == f.p);
  CHECK(f.log.joins.size() == 1);
  const std::size_t reserved = f.allocator.stats().reserved_bytes;

  void* r = f.allocator.allocate(64 * M, C);
  CHECK(r == static_cast<char*>(f.p) + 64 * M);  // the rest of A's block, now B's
  CHECK(f.log.joins.size() == 1);                // no event covers B's mark: no join ...
  CHECK(f.log.device_synchronized == 1);         // ... the host waits, as without joins
  const statistics s = f.allocator.stats();
  CHECK(s.stream_joins == 1);
  CHECK(s.device_waits == 1);
  CHECK(s.reserved_bytes == reserved);
  f.allocator.deallocate(r, 64 * M, C);
  f.allocator.deallocate(q, 64 * M, B);
  f.allocator.deallocate(f.b0, 64 * M, B);
  f.allocator.verify();
  CHECK(f.device.violations() == 0);
}

TEST_CASE("stream join: a pending free with no event yet is not joined: the host waits as before") {
  sim_device device(1 * GiB);
  event_log log;
  joining_stitching allocator(sim_provider{device}, joining_reserver{device, log}, with_join(true));
  void* b0 = allocator.allocate(16 * M, B);
  void* p1 = allocator.allocate(32 * M, A);
  void* p2 = allocator.allocate(64 * M, A);
  allocator.deallocate(p1, 32 * M, A);  // A's event, pending
  allocator.deallocate(p2, 64 * M, A);  // within the interval: no event of its own yet
  REQUIRE(log.events.size() == 1);

  void* q = allocator.allocate(64 * M, B);  // only p2's block serves it
  CHECK(q == p2);
  CHECK(log.joins.empty());
  CHECK(log.device_synchronized == 1);
  CHECK(allocator.stats().stream_joins == 0);
  CHECK(allocator.stats().device_waits == 1);
  allocator.deallocate(q, 64 * M, B);
  allocator.deallocate(b0, 16 * M, B);
  allocator.verify();
}

TEST_CASE("stream join: never while the requesting stream captures a graph") {
  pending_free_on_a f(true, 64 * M);
  f.device.begin_capture(B);
  void* q = f.allocator.allocate(64 * M, B);
  f.device.end_capture(B);
  CHECK(q == f.p);
  CHECK(f.log.joins.empty());
  CHECK(f.log.waited == 1);
  CHECK(f.allocator.stats().stream_joins == 0);
  f.allocator.deallocate(q, 64 * M, B);
  f.allocator.deallocate(f.b0, 64 * M, B);
  f.allocator.verify();
}

TEST_CASE("stream join: a join that fails loses nothing: the host waits instead") {
  pending_free_on_a f(true, 64 * M);
  const std::size_t reserved = f.allocator.stats().reserved_bytes;
  f.log.fail_joins = true;
  void* q = f.allocator.allocate(64 * M, B);
  CHECK(q == f.p);
  CHECK(f.log.joins.empty());
  CHECK(f.log.waited == 1);
  const statistics s = f.allocator.stats();
  CHECK(s.stream_joins == 0);
  CHECK(s.device_waits == 1);
  CHECK(s.reserved_bytes == reserved);
  CHECK(s.active_bytes == 128 * M);
  f.allocator.verify();
  f.allocator.deallocate(q, 64 * M, B);
  f.allocator.deallocate(f.b0, 64 * M, B);
  f.allocator.verify();
  CHECK(f.device.violations() == 0);
}

TEST_CASE("stream join: several pending blocks of another stream are joined once and stitched, without growth") {
  sim_device device(1 * GiB);
  event_log log;
  config cfg = with_join(true);
  cfg.frag_limit = 0;
  cfg.event_interval_us = 0;  // an event for every call that freed
  joining_stitching allocator(sim_provider{device}, joining_reserver{device, log}, cfg);
  void* b0 = allocator.allocate(32 * M, B);
  std::vector<void*> a;
  for (int i = 0; i < 4; ++i) a.push_back(allocator.allocate(32 * M, A));
  allocator.deallocate(a[0], 32 * M, A);
  allocator.deallocate(a[2], 32 * M, A);  // two pending blocks of 32 MiB, not neighbours
  REQUIRE(log.events.size() == 2);
  const std::size_t reserved = allocator.stats().reserved_bytes;
  const std::size_t stitches = allocator.stats().stitches;

  void* c = allocator.allocate(64 * M, B);  // they cover 64 MiB: one join, on the newer event
  CHECK(c != nullptr);
  REQUIRE(log.joins.size() == 1);
  CHECK(log.joins[0] == std::pair{B, A});
  CHECK(log.waited == 0);
  CHECK(log.device_synchronized == 0);
  const statistics s = allocator.stats();
  CHECK(s.stream_joins == 1);
  CHECK(s.device_waits == 0);
  CHECK(s.reserved_bytes == reserved);
  CHECK(s.cross_stream_bytes == 64 * M);
  CHECK(s.stitches == stitches + 1);
  allocator.deallocate(c, 64 * M, B);
  allocator.deallocate(b0, 32 * M, B);
  allocator.deallocate(a[1], 32 * M, A);
  allocator.deallocate(a[3], 32 * M, A);
  allocator.verify();
  CHECK(device.violations() == 0);
}

TEST_CASE("stream join: a completed block and a pending one together serve a request that neither serves alone") {
  // C's 32 MiB free has completed, A's has not. Without joins only C's block can move, the
  // pending one alone would not cover 64 MiB, so the host does not wait and B grows. With joins
  // both move (one join, on A's event) and are stitched: nothing grows.
  for (const bool join : {false, true}) {
    CAPTURE(join);
    sim_device device(1 * GiB);
    event_log log;
    config cfg = with_join(join);
    cfg.frag_limit = 0;
    joining_stitching allocator(sim_provider{device}, joining_reserver{device, log}, cfg);
    void* b0 = allocator.allocate(32 * M, B);
    void* a = allocator.allocate(32 * M, A);
    void* c = allocator.allocate(32 * M, C);
    allocator.deallocate(c, 32 * M, C);
    log.complete(C);
    allocator.deallocate(a, 32 * M, A);  // pending
    const std::size_t reserved = allocator.stats().reserved_bytes;

    void* q = allocator.allocate(64 * M, B);
    REQUIRE(q != nullptr);
    const statistics s = allocator.stats();
    CHECK(log.waited == 0);
    CHECK(log.device_synchronized == 0);
    if (join) {
      REQUIRE(log.joins.size() == 1);
      CHECK(log.joins[0] == std::pair{B, A});
      CHECK(s.stream_joins == 1);
      CHECK(s.reserved_bytes == reserved);
      CHECK(s.cross_stream_bytes == 64 * M);
    } else {
      CHECK(log.joins.empty());
      CHECK(s.reserved_bytes > reserved);
    }
    allocator.deallocate(q, 64 * M, B);
    allocator.deallocate(b0, 32 * M, B);
    allocator.verify();
    CHECK(device.violations() == 0);
  }
}

TEST_CASE("stream join: the best-fitting pending block is taken before the stream stitches its own blocks") {
  // B has two free 32 MiB blocks it could stitch; A's pending 64 MiB block fits at once. With
  // joins B takes it (one join, no stitch, no map); without, B stitches its own.
  for (const bool join : {false, true}) {
    CAPTURE(join);
    sim_device device(1 * GiB);
    event_log log;
    config cfg = with_join(join);
    cfg.frag_limit = 0;
    joining_stitching allocator(sim_provider{device}, joining_reserver{device, log}, cfg);
    std::vector<void*> b;
    for (int i = 0; i < 4; ++i) b.push_back(allocator.allocate(32 * M, B));
    void* a = allocator.allocate(64 * M, A);
    allocator.deallocate(b[0], 32 * M, B);
    allocator.deallocate(b[2], 32 * M, B);
    allocator.deallocate(a, 64 * M, A);  // pending
    const std::size_t stitches = allocator.stats().stitches;

    void* q = allocator.allocate(64 * M, B);
    REQUIRE(q != nullptr);
    CHECK((q == a) == join);
    CHECK(allocator.stats().stitches == stitches + (join ? 0 : 1));
    CHECK(log.joins.size() == (join ? 1u : 0u));
    CHECK(log.waited == 0);
    allocator.deallocate(q, 64 * M, B);
    allocator.deallocate(b[1], 32 * M, B);
    allocator.deallocate(b[3], 32 * M, B);
    allocator.verify();
    CHECK(device.violations() == 0);
  }
}
