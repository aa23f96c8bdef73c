// The stitching allocator's offload: a live allocation's whole handles moved to far memory and
// back under the same pointer, on real bytes (host backend) and under the simulated driver's
// rules; blocks sharing handles, cached stitched ranges over a moved block, stitched
// allocations, frees while offloaded (parked when the device is full), misuse, running out of
// memory, and a failure at every driver call of a move.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/fault_injection.hpp"
#include "glake/backends/host.hpp"
#include "glake/backends/sim.hpp"
#include "support/evented_reserver.hpp"
#include "support/stamp.hpp"
#include "support/usage_kind.hpp"

namespace {

using namespace glake;
using testing::stamp;
using testing::stamped;
constexpr std::size_t M = MiB;
using host_alloc = stitching_allocator<host_provider, host_reserver>;
using sim_alloc = stitching_allocator<sim_provider, sim_reserver>;

// frag_limit 0: any request that no free block serves may stitch.
config stitchy() {
  config c;
  c.frag_limit = 0;
  return c;
}

bool message_has(const std::exception& e, const std::string& text) {
  return std::string(e.what()).find(text) != std::string::npos;
}

// Eight 8 MiB blocks, the even ones freed: four free blocks apart, which only a stitch joins.
template <class Allocator>
std::vector<void*> checkerboard(Allocator& a) {
  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(a.allocate(8 * M));
  for (int i = 0; i < 8; i += 2) a.deallocate(blocks[i], 8 * M);
  return blocks;
}

}  // namespace

TEST_CASE("offload: a block's memory goes to far memory and back, the pointer and its bytes unchanged") {
  host_provider device(2 * M, 256 * M);
  host_alloc a(device, host_reserver(2 * M));
  host_provider far(2 * M);
  a.attach_far_memory(far, host_copier{});
  void* p = a.allocate(64 * M);
  void* q = a.allocate(16 * M);
  stamp(p, 64 * M, 1);
  stamp(q, 16 * M, 2);
  const statistics before = a.stats();

  CHECK(a.movable_bytes(p) == 64 * M);  // what offload will move: all of it, in whole handles
  a.offload(p);
  CHECK(a.movable_bytes(p) == 0);  // moved already
  CHECK(a.residence_of(p) == residence::host);
  CHECK(a.residence_of(q) == residence::device);
  const statistics out = a.stats();
  CHECK(out.offloaded_bytes == 64 * M);
  CHECK(out.reserved_bytes == before.reserved_bytes - 64 * M);
  CHECK(out.active_bytes == before.active_bytes);
  CHECK(device.created_bytes() == before.reserved_bytes - 64 * M);  // the device handles went back
  CHECK(far.created_bytes() == 64 * M);
  CHECK(stamped(p, 64 * M, 1));  // read through the same pointer, from far memory
  stamp(p, 64 * M, 3);           // and written there
  CHECK(stamped(q, 16 * M, 2));
  a.verify();

  a.prefetch(p);
  CHECK(a.residence_of(p) == residence::device);
  CHECK(stamped(p, 64 * M, 3));
  CHECK(a.stats().offloaded_bytes == 0);
  CHECK(a.stats().reserved_bytes == before.reserved_bytes);
  CHECK(far.created_bytes() == 64 * M);  // kept for the next offload
  a.verify();
  // The next offload reuses it (no far memory made), and release_cached gives it back.
  a.offload(p);
  CHECK(far.created_bytes() == 64 * M);
  CHECK(stamped(p, 64 * M, 3));
  a.prefetch(p);
  CHECK(stamped(p, 64 * M, 3));
  a.release_cached();
  CHECK(far.created_bytes() == 0);
  a.verify();
  a.deallocate(p, 64 * M);
  a.deallocate(q, 16 * M);
  a.verify();
}

TEST_CASE("offload: handles a block shares with its neighbours stay on the device") {
  host_provider device(2 * M, 256 * M);
  config c;
  c.max_handle = 0;  // 2 MiB handles
  host_alloc a(device, host_reserver(2 * M), c);
  a.attach_far_memory(host_provider(2 * M), host_copier{});
  // One 12 MiB segment cut into 5 MiB + 7 MiB: they share the handle [4, 6) MiB.
  void* whole = a.allocate(12 * M);
  a.deallocate(whole, 12 * M);
  void* first = a.allocate(5 * M);
  void* second = a.allocate(7 * M);
  REQUIRE(static_cast<char*>(second) == static_cast<char*>(first) + 5 * M);
  stamp(first, 5 * M, 11);
  stamp(second, 7 * M, 12);
  a.offload(second);
  CHECK(a.stats().offloaded_bytes == 6 * M);  // [6, 12) MiB: its whole handles; [5, 6) stays
  CHECK(stamped(first, 5 * M, 11));
  CHECK(stamped(second, 7 * M, 12));
  a.offload(first);
  CHECK(a.stats().offloaded_bytes == 10 * M);
  a.prefetch(second);
  a.prefetch(first);
  CHECK(stamped(first, 5 * M, 11));
  CHECK(stamped(second, 7 * M, 12));
  a.verify();

  // A block inside one handle has no handle of its own: nothing of it can move.
  a.deallocate(first, 5 * M);
  void* tiny = a.allocate(1536 * 1024);  // 1.5 MiB, above small_limit, inside [0, 2) MiB
  try {
    a.offload(tiny);
    FAIL("a block without a whole handle must not move");
  } catch (const usage_error& e) {
    CHECK(message_has(e, "holds no whole handle"));
  }
  CHECK(a.residence_of(tiny) == residence::device);
  a.deallocate(tiny, 1536 * 1024);
  a.deallocate(second, 7 * M);
  a.verify();
}

TEST_CASE("offload: cached stitched ranges over a moved block are dropped first") {
  host_provider device(2 * M, 64 * M);
  host_alloc a(device, host_reserver(2 * M), stitchy());
  a.attach_far_memory(host_provider(2 * M), host_copier{});
  const std::vector<void*> blocks = checkerboard(a);
  void* big = a.allocate(32 * M);  // the device is full: a stitch of the four free blocks
  REQUIRE(a.stats().stitches == 1);
  a.deallocate(big, 32 * M);  // cached: it still maps those blocks' handles
  REQUIRE(a.stats().cached_stitch_bytes == 32 * M);
  void* b = a.allocate(8 * M);  // one of the four blocks again, its handles mapped by the cache
  stamp(b, 8 * M, 21);
  a.offload(b);
  CHECK(a.stats().cached_stitch_bytes == 0);  // the range that mapped b's handles is gone
  CHECK(a.stats().stitch_evictions == 1);
  CHECK(stamped(b, 8 * M, 21));
  a.prefetch(b);
  CHECK(stamped(b, 8 * M, 21));
  a.verify();
  a.deallocate(b, 8 * M);
  for (int i = 1; i < 8; i += 2) a.deallocate(blocks[i], 8 * M);
  a.verify();
}

TEST_CASE("offload: a stitched allocation moves whole, at its own addresses and its pieces' home ones") {
  host_provider device(2 * M, 64 * M);
  host_alloc a(device, host_reserver(2 * M), stitchy());
  a.attach_far_memory(host_provider(2 * M), host_copier{});
  const std::vector<void*> blocks = checkerboard(a);
  void* big = a.allocate(32 * M);
  REQUIRE(a.stats().stitches == 1);
  stamp(big, 32 * M, 31);
  for (int i = 1; i < 8; i += 2) stamp(blocks[i], 8 * M, 40 + static_cast<unsigned>(i));
  a.offload(big);
  CHECK(a.residence_of(big) == residence::host);
  CHECK(a.stats().offloaded_bytes == 32 * M);
  CHECK(a.stats().reserved_bytes == 32 * M);  // the live neighbours only
  CHECK(stamped(big, 32 * M, 31));
  for (int i = 1; i < 8; i += 2) CHECK(stamped(blocks[i], 8 * M, 40 + static_cast<unsigned>(i)));
  a.verify();
  // The freed device memory serves others meanwhile.
  void* other = a.allocate(16 * M);
  stamp(other, 16 * M, 50);
  CHECK(stamped(big, 32 * M, 31));
  a.deallocate(other, 16 * M);
  a.prefetch(big);
  CHECK(stamped(big, 32 * M, 31));
  a.verify();
  // Freed, it is cached mapping device memory, and serves the same request again.
  a.deallocate(big, 32 * M);
  void* again = a.allocate(32 * M);
  CHECK(a.stats().stitch_cache_hits == 1);
  stamp(again, 32 * M, 32);
  CHECK(stamped(again, 32 * M, 32));
  a.deallocate(again, 32 * M);
  for (int i = 1; i < 8; i += 2) a.deallocate(blocks[i], 8 * M);
  a.verify();
}

TEST_CASE("offload: a block whose handles a live stitched allocation also maps is refused") {
  host_provider device(2 * M, 64 * M);
  config c = stitchy();
  c.max_handle = 0;  // 2 MiB handles: a stitched range's unclaimed tail is whole handles
  host_alloc a(device, host_reserver(2 * M), c);
  a.attach_far_memory(host_provider(2 * M), host_copier{});
  const std::vector<void*> blocks = checkerboard(a);
  void* stitched = a.allocate(20 * M);  // three 8 MiB pieces, the last 4 MiB unclaimed
  REQUIRE(a.stats().stitches == 1);
  void* tail = a.allocate(4 * M);  // best fit: the free 4 MiB the live range maps, unclaimed
  stamp(tail, 4 * M, 81);
  try {
    a.offload(tail);
    // Served from elsewhere: nothing to refuse here (the layout is the stitcher's choice).
    a.prefetch(tail);
  } catch (const usage_error& e) {
    CHECK(message_has(e, "live stitched allocation"));
    CHECK(a.residence_of(tail) == residence::device);
  }
  CHECK(stamped(tail, 4 * M, 81));
  CHECK(a.stats().reserved_bytes == device.created_bytes());
  a.verify();
  a.deallocate(tail, 4 * M);
  a.deallocate(stitched, 20 * M);
  for (int i = 1; i < 8; i += 2) a.deallocate(blocks[i], 8 * M);
  a.verify();
}

// The state and requested bytes visit_state shows for the block (or stitched range) at p.
std::pair<block_state, std::size_t> state_of(const sim_alloc& a, const void* p) {
  struct finder {
    std::uintptr_t at;
    std::pair<block_state, std::size_t> found{block_state::free, ~std::size_t{0}};
    void segment(const segment_view&) {}
    void block(const block_view& b) {
      if (b.address == at && b.stitched_into == 0) found = {b.state, b.requested};
    }
    void stitched(const stitched_view& r) {
      if (r.address == at && r.live) found = {r.state, r.requested};
    }
    void piece(const stitched_piece_view&) {}
  } v{reinterpret_cast<std::uintptr_t>(p)};
  a.visit_state(v);
  return v.found;
}

TEST_CASE("offload: freed while offloaded, memory comes back to the device, or waits there when the device is full") {
  sim_device gpu(64 * M, 2 * M, 256 * M);
  sim_alloc a{sim_provider(gpu), sim_reserver(gpu)};
  a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu));

  SUBCASE("room on the device: the free takes new device memory and is an ordinary free") {
    void* p = a.allocate(32 * M);
    a.offload(p);
    CHECK(gpu.physical_bytes() == 0);
    a.deallocate(p, 32 * M);
    CHECK(a.stats().offloaded_bytes == 0);
    CHECK(a.stats().reserved_bytes == 32 * M);  // a free segment, cached as usual
    CHECK(gpu.host_bytes() == 32 * M);          // far memory kept for the next offload
    a.release_cached();
    CHECK(gpu.host_bytes() == 0);
    CHECK(a.stats().active_bytes == 0);
    a.verify();
  }
  SUBCASE("no room: parked, then its memory comes back once release_cached finds room") {
    void* p = a.allocate(32 * M);
    a.offload(p);
    void* filler = a.allocate(64 * M);  // the whole device
    a.deallocate(p, 32 * M);
    CHECK(a.stats().active_bytes == 64 * M);  // freed for the caller
    CHECK(a.stats().offloaded_bytes == 32 * M);  // its memory still far
    CHECK_FALSE(a.owns(p));
    CHECK_THROWS_AS(a.deallocate(p, 32 * M), usage_error);  // a double free is still one
    CHECK_THROWS_AS(a.prefetch(p), usage_error);
    CHECK(state_of(a, p) == std::pair{block_state::pending_free, std::size_t{0}});  // freed, not reusable yet
    CHECK(state_of(a, filler) == std::pair{block_state::allocated, 64 * M});
    a.verify();
    a.deallocate(filler, 64 * M);
    a.release_cached();  // gives the free segment back, then finds room for the parked one
    CHECK(a.stats().offloaded_bytes == 0);
    CHECK(gpu.host_bytes() == 0);
    CHECK(a.stats().active_bytes == 0);
    CHECK(a.stats().allocated_bytes == 0);
    CHECK(a.stats().deallocations == a.stats().allocations);
    a.verify();
    a.release_cached();
    CHECK(gpu.physical_bytes() == 0);
  }
  CHECK(gpu.violations() == 0);
}

TEST_CASE("offload: a free while offloaded whose remap and whose undoing both fail parks it, and nothing is unmapped twice") {
  // The driver refuses every map: the free's new device handles cannot be mapped, nor can the far
  // ones be mapped back, so the addresses map nothing. The allocation is parked with those
  // addresses recorded; a later move fills them instead of unmapping them again.
  sim_device gpu(64 * M, 2 * M, 256 * M);
  fault_plan plan;
  {
    using faulty = stitching_allocator<fault_injecting_provider<sim_provider>, fault_injecting_reserver<sim_reserver>>;
    faulty a(fault_injecting_provider<sim_provider>(sim_provider(gpu), plan),
             fault_injecting_reserver<sim_reserver>(sim_reserver(gpu), plan));
    a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu));
    void* p = a.allocate(16 * M);
    void* q = a.allocate(16 * M);
    a.offload(p);
    plan.fail_every_call_of(driver_call::map);
    a.deallocate(p, 16 * M);
    CHECK(a.stats().offloaded_bytes == 16 * M);  // parked
    CHECK(a.stats().active_bytes == 16 * M);
    a.release_cached();  // maps still fail: it stays parked
    CHECK(a.stats().offloaded_bytes == 16 * M);
    CHECK(gpu.violations() == 0);
    plan.never_fail();
    SUBCASE("back once the driver maps again") {
      a.release_cached();
      CHECK(a.stats().offloaded_bytes == 0);
      CHECK(gpu.host_bytes() == 0);
      void* again = a.allocate(16 * M);
      CHECK(gpu.resolve(again).has_value());
      a.deallocate(again, 16 * M);
    }
    SUBCASE("destroyed while parked") {}
    a.verify();
    a.deallocate(q, 16 * M);
  }
  CHECK(gpu.violations() == 0);
  CHECK(gpu.physical_bytes() == 0);
  CHECK(gpu.host_bytes() == 0);
  CHECK(gpu.live_mappings() == 0);
}

TEST_CASE("offload: misuse and running out of memory are refused and change nothing") {
  sim_device gpu(64 * M, 2 * M, 48 * M);
  sim_alloc a{sim_provider(gpu), sim_reserver(gpu)};
  void* p = a.allocate(32 * M);
  CHECK(a.movable_bytes(p) == 0);  // it would refuse: no far memory
  try {
    a.offload(p);
    FAIL("no far memory attached");
  } catch (const usage_error& e) {
    CHECK(message_has(e, "no far memory"));
    CHECK(e.which() == usage_error::kind::bad_state);  // a state: attach_far_memory ends it
  }
  a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu));
  int local = 0;
  CHECK(testing::usage_kind([&] { a.offload(&local); }) == usage_error::kind::foreign_pointer);
  CHECK(a.movable_bytes(&local) == 0);
  CHECK(a.movable_bytes(p) == 32 * M);
  CHECK(testing::usage_kind([&] { a.prefetch(p); }) == usage_error::kind::bad_state);  // not offloaded
  void* small = a.allocate(4096);
  CHECK(a.movable_bytes(small) == 0);
  try {
    a.offload(small);
    FAIL("a small allocation does not move");
  } catch (const usage_error& e) {
    CHECK(message_has(e, "small allocation"));
    CHECK(e.which() == usage_error::kind::bad_argument);
  }
  a.offload(p);
  CHECK(testing::usage_kind([&] { a.offload(p); }) == usage_error::kind::bad_state);  // already offloaded
  CHECK(testing::usage_kind([&] { a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu)); }) ==
        usage_error::kind::bad_state);  // one is away

  // Far memory runs out (48 MiB of it, 32 taken): out_of_memory, and nothing moved.
  void* q = a.allocate(24 * M);
  const statistics before = a.stats();
  CHECK_THROWS_AS(a.offload(q), out_of_memory);
  CHECK(a.residence_of(q) == residence::device);
  CHECK(a.stats().reserved_bytes == before.reserved_bytes);
  CHECK(a.stats().offloaded_bytes == before.offloaded_bytes);
  a.verify();

  // The device runs out: the prefetch first releases cached memory, then gives up.
  void* fill = a.allocate(36 * M);  // 36 + 24 + the small pool's 2: no room for 32
  CHECK_THROWS_AS(a.prefetch(p), out_of_memory);
  CHECK(a.residence_of(p) == residence::host);
  a.verify();
  a.deallocate(fill, 36 * M);  // cached, not given back: the prefetch releases it itself
  a.prefetch(p);
  CHECK(a.residence_of(p) == residence::device);

  // A stream capturing a graph, and memory retained for a graph: refused.
  const stream_ref capture{std::uintptr_t{9}};
  gpu.begin_capture(capture);
  CHECK(testing::usage_kind([&] { a.offload(p, capture); }) == usage_error::kind::bad_state);
  gpu.end_capture(capture);
  a.retain_memory(true);
  CHECK(testing::usage_kind([&] { a.offload(p); }) == usage_error::kind::bad_state);
  a.retain_memory(false);
  CHECK(a.residence_of(p) == residence::device);
  a.deallocate(q, 24 * M);
  a.deallocate(small, 4096);
  a.deallocate(p, 32 * M);
  a.verify();
  CHECK(gpu.violations() == 0);
}

TEST_CASE("offload: moves wait for the work queued on their stream, the allocation's, and recorded ones") {
  sim_device gpu(256 * M, 2 * M, 256 * M);
  testing::event_log log;
  stitching_allocator<sim_provider, testing::evented_reserver> a{sim_provider(gpu), testing::evented_reserver(gpu, log)};
  a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu));
  const stream_ref own{std::uintptr_t{1}}, mover{std::uintptr_t{2}}, other{std::uintptr_t{3}};
  void* p = a.allocate(32 * M, own);
  const auto waited_on = [&](stream_ref s, std::size_t from_id) {
    for (const auto& [id, e] : log.events) {
      if (id >= from_id && e.first == s && e.second) return true;
    }
    return false;
  };
  std::uint64_t first = log.next;
  a.offload(p, mover);
  CHECK(waited_on(mover, first));
  CHECK(waited_on(own, first));
  CHECK(log.device_synchronized == 0);
  a.record_stream(p, other);  // work on `other` may use it: a move waits for the device then
  first = log.next;
  a.prefetch(p, mover);
  CHECK(waited_on(mover, first));
  CHECK(log.device_synchronized == 1);
  CHECK(a.residence_of(p) == residence::device);
  a.deallocate(p, 32 * M, own);
  a.verify();
  // A free waiting for another stream, of an offloaded allocation: it finishes later (here in
  // release_cached), taking device memory back then.
  void* q = a.allocate(32 * M, own);
  a.record_stream(q, other);
  a.offload(q, own);
  a.deallocate(q, 32 * M, own);  // deferred: `other` may still use it
  CHECK(a.stats().offloaded_bytes == 32 * M);
  log.complete(other);
  a.release_cached();
  CHECK(a.stats().offloaded_bytes == 0);
  CHECK(a.stats().active_bytes == 0);
  CHECK(gpu.host_bytes() == 0);
  a.verify();
  CHECK(gpu.violations() == 0);
}

TEST_CASE("offload: a failure at any driver call of a move leaves every byte and mapping as it was") {
  fault_plan plan;
  using faulty_alloc = stitching_allocator<fault_injecting_provider<host_provider>, fault_injecting_reserver<host_reserver>>;
  // Without spare handles, and with them (the prefetches take what the offloads gave back).
  for (const std::size_t spares : {std::size_t{0}, 32 * M}) {
    CAPTURE(spares);
    config cfg = stitchy();
    cfg.move_spares = spares;
    std::uint64_t faults = 0;
    for (std::uint64_t n = 1;; ++n) {
      CAPTURE(n);
      host_provider device_memory(2 * M, 128 * M);
      host_provider far_memory_provider(2 * M);
      faulty_alloc a(fault_injecting_provider<host_provider>(device_memory, plan),
                     fault_injecting_reserver<host_reserver>(host_reserver(2 * M), plan), cfg);
      a.attach_far_memory(fault_injecting_provider<host_provider>(far_memory_provider, plan), host_copier{});
      std::vector<void*> blocks;
      for (int i = 0; i < 6; ++i) blocks.push_back(a.allocate(8 * M));
      for (int i = 0; i < 6; i += 2) a.deallocate(blocks[i], 8 * M);
      void* big = a.allocate(24 * M);  // a stitch over the three free blocks (frag_limit 0)
      void* plain = blocks[1];
      stamp(big, 24 * M, 61);
      stamp(plain, 8 * M, 62);
      const std::uint64_t injected = plan.faults_injected();
      plan.fail_nth_call(n);
      bool threw = false;
      try {
        a.offload(big);
        a.offload(plain);
        a.prefetch(plain);
        a.prefetch(big);
      } catch (const out_of_memory&) {
        threw = true;
      }
      plan.never_fail();
      // A fault in a prefetch may be absorbed (cached memory released, then tried again); one in an
      // offload never is.
      const bool fired = plan.faults_injected() > injected;
      CHECK((fired || !threw));
      CHECK(stamped(big, 24 * M, 61));
      CHECK(stamped(plain, 8 * M, 62));
      a.verify();
      // Whatever moved, everything can be brought back and freed.
      if (a.residence_of(big) == residence::host) a.prefetch(big);
      if (a.residence_of(plain) == residence::host) a.prefetch(plain);
      CHECK(stamped(big, 24 * M, 61));
      CHECK(stamped(plain, 8 * M, 62));
      CHECK(a.stats().offloaded_bytes == 0);
      a.deallocate(big, 24 * M);
      for (int i = 1; i < 6; i += 2) a.deallocate(blocks[i], 8 * M);
      a.verify();
      a.release_cached();
      CHECK(far_memory_provider.created_bytes() == 0);
      CHECK(a.stats().spare_bytes == 0);
      CHECK(device_memory.created_bytes() == 0);  // spares included
      if (!fired) break;
      ++faults;
      REQUIRE(n < 500);
    }
    // Creates, reservations, maps and accesses of four moves (fewer creates with spares).
    CHECK(faults >= (spares == 0 ? 30u : 20u));
  }
}
