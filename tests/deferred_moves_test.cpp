// Deferred moves of the stitching allocator (move_completion::deferred): the call queues the
// copies and returns without waiting for the device; the remap comes with the first call that
// finds the copies done, or complete_move / complete_moves. Checked under the simulated
// driver's rules with events the test completes by hand: nothing waits on the move's stream,
// the device memory goes only at completion, a move the other way undoes a pending one, frees
// and memory pressure settle pending moves, and nothing leaks.
#include <doctest/doctest.h>

#include <cstddef>
#include <string>

#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/sim.hpp"
#include "support/evented_reserver.hpp"

namespace {

using namespace glake;
constexpr std::size_t M = MiB;
using evented_alloc = stitching_allocator<sim_provider, testing::evented_reserver>;
static_assert(deferring_offloading_allocator<evented_alloc>);
static_assert(deferring_offloading_allocator<stitching_allocator<sim_provider, sim_reserver>>);

constexpr auto deferred = move_completion::deferred;
const stream_ref own{std::uintptr_t{1}};
const stream_ref other{std::uintptr_t{2}};

struct setup {
  sim_device gpu;
  testing::event_log log;
  evented_alloc a;
  explicit setup(std::size_t device_bytes = 256 * M)
      : gpu(device_bytes, 2 * M, 256 * M), a{sim_provider(gpu), testing::evented_reserver(gpu, log)} {
    a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu));
  }
};

}  // namespace

TEST_CASE("deferred moves: an offload returns without waiting, and its memory moves once its copies are done") {
  setup s;
  void* p = s.a.allocate(32 * M, own);
  const std::size_t device_before = s.gpu.physical_bytes();
  const std::size_t waits = s.log.waited, syncs = s.log.device_synchronized;

  s.a.offload(p, own, deferred);
  CHECK(s.log.waited == waits);  // nothing waited for the stream the copies are queued on
  CHECK(s.log.device_synchronized == syncs);
  CHECK(s.a.residence_of(p) == residence::host);  // where it is going
  CHECK(s.a.movable_bytes(p) == 0);
  CHECK(s.gpu.physical_bytes() == device_before);  // the device memory stays until completion
  CHECK(s.gpu.host_bytes() == 32 * M);             // the far memory the copies go to
  CHECK(s.a.stats().offloaded_bytes == 0);
  CHECK_THROWS_AS(s.a.offload(p, own, deferred), usage_error);  // offloaded already
  CHECK(s.a.complete_moves(false) == 0);                          // its copies are not done
  s.a.verify();

  s.log.complete(own);
  CHECK(s.a.complete_moves(false) == 1);
  CHECK(s.gpu.physical_bytes() == device_before - 32 * M);
  CHECK(s.a.stats().offloaded_bytes == 32 * M);
  CHECK(s.a.residence_of(p) == residence::host);
  s.a.verify();

  // Back the same way; completed by complete_move, which waits.
  s.a.prefetch(p, own, deferred);
  CHECK(s.a.residence_of(p) == residence::device);
  CHECK(s.gpu.physical_bytes() == device_before);  // new device handles, filling
  CHECK(s.a.stats().offloaded_bytes == 32 * M);    // still mapped on far memory
  const std::size_t waits_before = s.log.waited;
  s.a.complete_move(p);
  CHECK(s.log.waited == waits_before + 1);
  CHECK(s.a.stats().offloaded_bytes == 0);
  CHECK(s.a.residence_of(p) == residence::device);
  s.a.complete_move(p);  // none pending: nothing
  s.a.verify();

  s.a.deallocate(p, 32 * M, own);
  s.a.release_cached();
  CHECK(s.gpu.physical_bytes() == 0);
  CHECK(s.gpu.host_bytes() == 0);
  CHECK(s.gpu.violations() == 0);
}

TEST_CASE("deferred moves: the next call that finds the copies done completes them") {
  setup s;
  void* p = s.a.allocate(32 * M, own);
  s.a.offload(p, own, deferred);
  s.log.complete(own);
  void* q = s.a.allocate(16 * M, own);  // any call polls
  CHECK(s.a.stats().offloaded_bytes == 32 * M);
  s.a.deallocate(q, 16 * M, own);
  s.a.verify();
  s.a.deallocate(p, 32 * M, own);
  CHECK(s.a.stats().active_bytes == 0);
  s.a.verify();
  CHECK(s.gpu.violations() == 0);
}

TEST_CASE("deferred moves: the opposite move undoes a pending one, with nothing copied back") {
  setup s;
  void* p = s.a.allocate(32 * M, own);
  const statistics before = s.a.stats();

  SUBCASE("a pending offload, then prefetch") {
    s.a.offload(p, own, deferred);
    s.a.prefetch(p, own);  // waits for the copies, then drops them
    CHECK(s.a.residence_of(p) == residence::device);
    CHECK(s.a.stats().offloaded_bytes == 0);
    CHECK(s.a.stats().reserved_bytes == before.reserved_bytes);
    CHECK(s.a.complete_moves(true) == 0);  // nothing left pending
  }
  SUBCASE("a pending prefetch, then offload") {
    s.a.offload(p, own);
    s.a.prefetch(p, own, deferred);
    const std::size_t device = s.gpu.physical_bytes();
    s.a.offload(p, own, deferred);  // undoes the prefetch at once: it is in far memory still
    CHECK(s.a.residence_of(p) == residence::host);
    CHECK(s.a.stats().offloaded_bytes == 32 * M);
    CHECK(s.gpu.physical_bytes() == device - 32 * M);  // the prefetch's device handles went back
    CHECK(s.a.complete_moves(true) == 0);
    s.a.prefetch(p, own);
    CHECK(s.a.residence_of(p) == residence::device);
  }
  s.a.verify();
  s.a.deallocate(p, 32 * M, own);
  s.a.verify();
  CHECK(s.gpu.violations() == 0);
}

TEST_CASE("deferred moves: a free settles a pending move first") {
  setup s;
  void* p = s.a.allocate(32 * M, own);
  SUBCASE("pending offload") { s.a.offload(p, own, deferred); }
  SUBCASE("pending prefetch") {
    s.a.offload(p, own);
    s.a.prefetch(p, own, deferred);
  }
  s.a.deallocate(p, 32 * M, own);
  CHECK(s.a.stats().active_bytes == 0);
  CHECK(s.a.stats().offloaded_bytes == 0);
  s.a.verify();
  s.a.release_cached();
  CHECK(s.gpu.physical_bytes() == 0);
  CHECK(s.gpu.violations() == 0);
}

TEST_CASE("deferred moves: an allocation the device cannot serve completes pending offloads for room") {
  setup s(64 * M);
  void* p = s.a.allocate(48 * M, own);
  s.a.offload(p, own, deferred);  // the device memory stays until its copies are done
  void* q = s.a.allocate(48 * M, own);  // needs it: the pending offload completes (waiting)
  CHECK(q != nullptr);
  CHECK(s.a.residence_of(p) == residence::host);
  CHECK(s.a.stats().offloaded_bytes == 48 * M);
  s.a.verify();
  s.a.deallocate(q, 48 * M, own);
  s.a.deallocate(p, 48 * M, own);
  s.a.verify();
  CHECK(s.gpu.violations() == 0);
}

TEST_CASE("deferred moves: release_cached and retain_memory complete them, destruction undoes them") {
  sim_device gpu(256 * M, 2 * M, 256 * M);
  testing::event_log log;
  {
    evented_alloc a{sim_provider(gpu), testing::evented_reserver(gpu, log)};
    a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu));
    void* p = a.allocate(32 * M, own);
    void* q = a.allocate(32 * M, own);
    a.offload(p, own, deferred);
    a.release_cached();
    CHECK(a.stats().offloaded_bytes == 32 * M);
    a.offload(q, own, deferred);
    a.retain_memory(true);
    CHECK(a.stats().offloaded_bytes == 64 * M);
    CHECK_THROWS_AS(a.prefetch(p, own, deferred), usage_error);  // no remap while retained
    a.retain_memory(false);
    a.prefetch(p, own, deferred);  // pending at destruction, with q offloaded and r live
    void* r = a.allocate(16 * M, own);
    (void)r;
    a.verify();
  }
  CHECK(gpu.physical_bytes() == 0);
  CHECK(gpu.host_bytes() == 0);
  CHECK(gpu.live_mappings() == 0);
  CHECK(gpu.violations() == 0);
}

TEST_CASE("deferred moves: other streams' uses are still waited for, and a synchronous backend completes on return") {
  setup s;
  void* p = s.a.allocate(32 * M, own);
  s.a.record_stream(p, other);
  const std::size_t syncs = s.log.device_synchronized;
  s.a.offload(p, own, deferred);
  CHECK(s.log.device_synchronized == syncs + 1);  // a recorded stream: the device, once
  s.log.complete(own);
  s.a.complete_moves(false);
  s.a.prefetch(p, own);
  s.a.deallocate(p, 32 * M, own);
  s.a.verify();

  sim_device gpu(64 * M, 2 * M, 64 * M);
  stitching_allocator<sim_provider, sim_reserver> plain{sim_provider(gpu), sim_reserver(gpu)};
  plain.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu));
  void* x = plain.allocate(16 * M);
  plain.offload(x, {}, deferred);
  CHECK(plain.stats().offloaded_bytes == 16 * M);  // no events: done on return
  plain.prefetch(x, {}, deferred);
  CHECK(plain.stats().offloaded_bytes == 0);
  plain.deallocate(x, 16 * M);
  CHECK(gpu.violations() == 0);
}

TEST_CASE("deferred moves: out of far or device memory is refused at the call, with nothing changed") {
  sim_device gpu(64 * M, 2 * M, 32 * M);  // 32 MiB of host memory
  testing::event_log log;
  evented_alloc a{sim_provider(gpu), testing::evented_reserver(gpu, log)};
  a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu));
  void* p = a.allocate(48 * M, own);
  CHECK_THROWS_AS(a.offload(p, own, deferred), out_of_memory);  // 48 MiB do not fit the host
  CHECK(a.residence_of(p) == residence::device);
  CHECK(a.complete_moves(true) == 0);
  a.release_cached();  // far handles made before it ran out were kept for reuse
  CHECK(gpu.host_bytes() == 0);
  a.verify();
  a.deallocate(p, 48 * M, own);

  void* q = a.allocate(32 * M, own);
  a.offload(q, own);
  void* fill = a.allocate(48 * M, own);  // the device is full now
  CHECK_THROWS_AS(a.prefetch(q, own, deferred), out_of_memory);
  CHECK(a.residence_of(q) == residence::host);
  CHECK(a.stats().offloaded_bytes == 32 * M);
  a.verify();
  a.deallocate(fill, 48 * M, own);
  a.prefetch(q, own, deferred);
  a.complete_move(q);
  CHECK(a.residence_of(q) == residence::device);
  a.deallocate(q, 32 * M, own);
  a.verify();
  CHECK(gpu.violations() == 0);
}

TEST_CASE("deferred moves: copies on a stream of their own wait for the move's stream by an event, not on the host") {
  sim_device gpu(256 * M, 2 * M, 256 * M);
  testing::event_log log;
  stitching_allocator<sim_provider, testing::joining_reserver> a{sim_provider(gpu), testing::joining_reserver(gpu, log)};
  static_assert(deferring_offloading_allocator<decltype(a)>);
  a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu));
  const stream_ref copies{std::uintptr_t{7}};
  void* p = a.allocate(32 * M, own);
  const std::size_t waits = log.waited, syncs = log.device_synchronized;

  a.offload(p, own, deferred, copies);
  REQUIRE(log.joins.size() == 1);
  CHECK(log.joins[0] == std::pair{copies, own});  // the copy stream waits for the uses queued on own
  CHECK(log.waited == waits);
  CHECK(log.device_synchronized == syncs);
  log.complete(own);  // the uses are done, the copies are not
  CHECK(a.complete_moves(false) == 0);
  CHECK(a.stats().offloaded_bytes == 0);
  log.complete(copies);
  CHECK(a.complete_moves(false) == 1);
  CHECK(a.stats().offloaded_bytes == 32 * M);
  a.verify();

  a.prefetch(p, own, deferred, copies);
  CHECK(log.joins.size() == 2);
  log.complete(own);
  CHECK(a.complete_moves(false) == 0);  // its copies are on the copy stream
  a.complete_move(p);                   // waits for them
  CHECK(a.residence_of(p) == residence::device);
  CHECK(a.stats().offloaded_bytes == 0);

  // Completing on return, the host has waited for the uses: no event wait is needed.
  a.offload(p, own, move_completion::on_return, copies);
  CHECK(log.joins.size() == 2);
  CHECK(a.stats().offloaded_bytes == 32 * M);
  a.prefetch(p, own, move_completion::on_return, copies);
  a.deallocate(p, 32 * M, own);
  a.verify();
  a.release_cached();
  CHECK(gpu.physical_bytes() == 0);
  CHECK(gpu.violations() == 0);
}

TEST_CASE("deferred moves: a copy stream of its own is refused by a reserver whose streams cannot wait for events") {
  setup s;
  void* p = s.a.allocate(32 * M, own);
  const stream_ref copies{std::uintptr_t{7}};
  CHECK_THROWS_AS(s.a.offload(p, own, deferred, copies), usage_error);
  CHECK(s.a.residence_of(p) == residence::device);
  CHECK(s.a.complete_moves(true) == 0);
  s.a.offload(p, own, deferred, own);  // the same stream is what the three-argument call does
  s.a.complete_move(p);
  CHECK(s.a.residence_of(p) == residence::host);
  s.a.deallocate(p, 32 * M, own);
  s.a.verify();
  CHECK(s.gpu.violations() == 0);
}
