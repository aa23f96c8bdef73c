// far_residence::unmapped: memory an allocator moved to far memory is not mapped at its
// allocation's addresses while there. Its bytes come back whole (host backend, real bytes), the
// addresses map nothing while away and device memory again once back (simulated driver, its
// rules checked), moves make no mapping of far memory after the first (far homes), frees and
// parking while away, deferred moves and their undoing, destruction with memory away, and a
// failure at every driver call of a move.
#include <doctest/doctest.h>

#include <cstddef>
#include <vector>

#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/fault_injection.hpp"
#include "glake/backends/host.hpp"
#include "glake/backends/sim.hpp"
#include "support/evented_reserver.hpp"
#include "support/stamp.hpp"

namespace {

using namespace glake;
using testing::stamp;
using testing::stamped;
constexpr std::size_t M = MiB;
constexpr auto unmapped = far_residence::unmapped;
using host_alloc = stitching_allocator<host_provider, host_reserver>;
using sim_alloc = stitching_allocator<sim_provider, sim_reserver>;
using evented_alloc = stitching_allocator<sim_provider, testing::evented_reserver>;

config stitchy() {
  config c;
  c.frag_limit = 0;  // any request no free block serves may stitch
  return c;
}

// Whether every handle-sized step of [p, p + bytes) maps nothing / a device handle.
bool maps_nothing(const sim_device& gpu, const void* p, std::size_t bytes) {
  for (std::size_t off = 0; off < bytes; off += 2 * M) {
    if (gpu.resolve(static_cast<const char*>(p) + off)) return false;
  }
  return true;
}
bool maps_device(const sim_device& gpu, const void* p, std::size_t bytes) {
  for (std::size_t off = 0; off < bytes; off += 2 * M) {
    const auto at = gpu.resolve(static_cast<const char*>(p) + off);
    if (!at || !at->accessible || gpu.is_host(sim_handle{at->handle}) != std::optional<bool>(false)) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("far residence unmapped: the bytes of a block and of a stitched allocation come back whole") {
  host_provider device(2 * M, 64 * M);
  host_alloc a(device, host_reserver(2 * M), stitchy());
  host_provider far(2 * M);
  a.attach_far_memory(far, host_copier{}, unmapped);
  CHECK(a.far_residence_of_moves() == unmapped);
  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(a.allocate(8 * M));
  for (int i = 0; i < 8; i += 2) a.deallocate(blocks[i], 8 * M);
  void* big = a.allocate(32 * M);  // stitched over the four free blocks
  REQUIRE(a.stats().stitches == 1);
  void* plain = blocks[1];
  stamp(big, 32 * M, 11);
  stamp(plain, 8 * M, 12);
  stamp(blocks[3], 8 * M, 13);
  for (int round = 0; round < 3; ++round) {
    a.offload(big);
    a.offload(plain);
    CHECK(a.stats().offloaded_bytes == 40 * M);
    CHECK(a.stats().reserved_bytes == 24 * M);  // the other live blocks
    CHECK(stamped(blocks[3], 8 * M, 13));  // a neighbour that stayed
    // The freed device memory serves others meanwhile, at other addresses.
    void* other = a.allocate(16 * M);
    stamp(other, 16 * M, 20);
    a.deallocate(other, 16 * M);
    a.verify();
    a.prefetch(plain);
    a.prefetch(big);
    CHECK(stamped(big, 32 * M, 11));
    CHECK(stamped(plain, 8 * M, 12));
    CHECK(a.stats().offloaded_bytes == 0);
    a.verify();
  }
  CHECK(far.created_bytes() == 40 * M);  // kept for the next offloads, not made again each round
  a.deallocate(big, 32 * M);
  for (int i = 1; i < 8; i += 2) a.deallocate(blocks[i], 8 * M);
  a.release_cached();
  CHECK(far.created_bytes() == 0);
  CHECK(device.created_bytes() == 0);
}

TEST_CASE("far residence unmapped: nothing is mapped at the addresses while away, and moves map no far memory") {
  sim_device gpu(64 * M, 2 * M, 256 * M);
  {
    sim_alloc a{sim_provider(gpu), sim_reserver(gpu)};
    a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu), unmapped);
    void* p = a.allocate(32 * M);
    void* q = a.allocate(16 * M);
    a.offload(p);  // the first: far memory made, with its homes
    CHECK(maps_nothing(gpu, p, 32 * M));
    CHECK(maps_device(gpu, q, 16 * M));
    CHECK(a.residence_of(p) == residence::host);
    CHECK(gpu.host_bytes() == 32 * M);
    a.prefetch(p);
    CHECK(maps_device(gpu, p, 32 * M));
    CHECK(gpu.host_bytes() == 32 * M);  // kept, mapped at its homes

    // Later moves: a copy and an unmap out, a map, an access and a copy back; far memory is
    // neither mapped nor given access again.
    const driver_call_counts before = gpu.calls();
    const std::uint64_t access_before = gpu.set_access_mappings();
    const std::uint64_t copies_before = gpu.copies();
    a.offload(p);
    CHECK(maps_nothing(gpu, p, 32 * M));
    CHECK(gpu.calls()[driver_call::map] == before[driver_call::map]);
    CHECK(gpu.set_access_mappings() == access_before);
    CHECK(gpu.copies() > copies_before);
    a.prefetch(p);
    CHECK(maps_device(gpu, p, 32 * M));
    CHECK(gpu.set_access_mappings() - access_before <= 16);  // the device handles' only
    CHECK(a.stats().offloaded_bytes == 0);
    a.verify();

    SUBCASE("freed while away: the free maps new device memory, no copy") {
      a.offload(p);
      const std::uint64_t copies = gpu.copies();
      a.deallocate(p, 32 * M);
      CHECK(gpu.copies() == copies);
      CHECK(a.stats().offloaded_bytes == 0);
      CHECK(a.stats().active_bytes == 16 * M);
      void* again = a.allocate(32 * M);  // the freed block, mapping device memory
      CHECK(maps_device(gpu, again, 32 * M));
      a.deallocate(again, 32 * M);
    }
    SUBCASE("freed while away with the device full: parked, then back once there is room") {
      a.offload(p);
      void* filler = a.allocate(48 * M);  // with q: the whole device
      a.deallocate(p, 32 * M);
      CHECK(a.stats().offloaded_bytes == 32 * M);
      CHECK(maps_nothing(gpu, p, 32 * M));
      a.verify();
      a.deallocate(filler, 48 * M);
      a.release_cached();
      CHECK(a.stats().offloaded_bytes == 0);
      CHECK(a.stats().allocated_bytes == 16 * M);
      a.verify();
    }
    SUBCASE("destroyed with memory away: everything goes back, nothing misused") {
      a.offload(p);
      a.offload(q);
    }
    SUBCASE("a stitched allocation: its range and its pieces' homes map nothing while away") {
      a.deallocate(p, 32 * M);
      a.deallocate(q, 16 * M);
      a.release_cached();
      sim_alloc b{sim_provider(gpu), sim_reserver(gpu), stitchy()};
      b.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu), unmapped);
      std::vector<void*> blocks;
      for (int i = 0; i < 8; ++i) blocks.push_back(b.allocate(8 * M));
      for (int i = 0; i < 8; i += 2) b.deallocate(blocks[i], 8 * M);
      void* big = b.allocate(32 * M);
      REQUIRE(b.stats().stitches == 1);
      b.offload(big);
      CHECK(maps_nothing(gpu, big, 32 * M));
      for (int i = 0; i < 8; i += 2) CHECK(maps_nothing(gpu, blocks[i], 8 * M));
      for (int i = 1; i < 8; i += 2) CHECK(maps_device(gpu, blocks[i], 8 * M));
      b.verify();
      b.prefetch(big);
      CHECK(maps_device(gpu, big, 32 * M));
      for (int i = 0; i < 8; i += 2) CHECK(maps_device(gpu, blocks[i], 8 * M));
      b.verify();
      b.offload(big);
      b.deallocate(big, 32 * M);  // freed while away
      for (int i = 1; i < 8; i += 2) b.deallocate(blocks[i], 8 * M);
      b.verify();
      b.release_cached();
      CHECK(gpu.physical_bytes() == 0);
      CHECK(gpu.host_bytes() == 0);
    }
  }
  CHECK(gpu.violations() == 0);
  CHECK(gpu.physical_bytes() == 0);
  CHECK(gpu.host_bytes() == 0);
  CHECK(gpu.live_mappings() == 0);
}

TEST_CASE("far residence: config::far_unmapped picks it when attach_far_memory does not say") {
  sim_device gpu(64 * M, 2 * M, 256 * M);
  config c;
  c.far_unmapped = true;
  sim_alloc a{sim_provider(gpu), sim_reserver(gpu), c};
  a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu));
  CHECK(a.far_residence_of_moves() == unmapped);
  sim_alloc b{sim_provider(gpu), sim_reserver(gpu)};
  b.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu));
  CHECK(b.far_residence_of_moves() == far_residence::mapped);
  b.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu), unmapped);  // nothing away: may change
  CHECK(b.far_residence_of_moves() == unmapped);
  void* p = a.allocate(8 * M);
  a.offload(p);
  CHECK(maps_nothing(gpu, p, 8 * M));
  a.prefetch(p);
  a.deallocate(p, 8 * M);
}

TEST_CASE("far residence unmapped: deferred moves, and their undoing by the opposite move") {
  constexpr auto deferred = move_completion::deferred;
  const stream_ref own{std::uintptr_t{1}};
  sim_device gpu(256 * M, 2 * M, 256 * M);
  testing::event_log log;
  {
    evented_alloc a{sim_provider(gpu), testing::evented_reserver(gpu, log)};
    a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu), unmapped);
    void* p = a.allocate(32 * M, own);
    const std::size_t device = gpu.physical_bytes();

    a.offload(p, own, deferred);
    CHECK(maps_device(gpu, p, 32 * M));  // until the copies are done
    CHECK(a.residence_of(p) == residence::host);
    log.complete(own);
    CHECK(a.complete_moves(false) == 1);
    CHECK(maps_nothing(gpu, p, 32 * M));
    CHECK(gpu.physical_bytes() == device - 32 * M);
    a.verify();

    a.prefetch(p, own, deferred);
    CHECK(maps_device(gpu, p, 32 * M));  // mapped at once, filled by the queued copies
    CHECK(a.stats().offloaded_bytes == 32 * M);
    a.complete_move(p);
    CHECK(a.stats().offloaded_bytes == 0);
    a.verify();

    SUBCASE("a pending prefetch undone: the addresses map nothing again") {
      a.offload(p, own);
      a.prefetch(p, own, deferred);
      a.offload(p, own, deferred);
      CHECK(maps_nothing(gpu, p, 32 * M));
      CHECK(gpu.physical_bytes() == device - 32 * M);
      CHECK(a.complete_moves(true) == 0);
      a.prefetch(p, own);
      CHECK(maps_device(gpu, p, 32 * M));
    }
    SUBCASE("a pending offload undone: the device memory stays mapped") {
      a.offload(p, own, deferred);
      a.prefetch(p, own);
      CHECK(maps_device(gpu, p, 32 * M));
      CHECK(a.stats().offloaded_bytes == 0);
      CHECK(a.complete_moves(true) == 0);
    }
    SUBCASE("destroyed with a move pending") { a.offload(p, own, deferred); }
    a.verify();
  }
  CHECK(gpu.violations() == 0);
  CHECK(gpu.physical_bytes() == 0);
  CHECK(gpu.live_mappings() == 0);
}

TEST_CASE("far residence unmapped: a failure at any driver call of a move leaves every byte and mapping usable") {
  fault_plan plan;
  using faulty_alloc = stitching_allocator<fault_injecting_provider<host_provider>, fault_injecting_reserver<host_reserver>>;
  std::uint64_t faults = 0;
  for (std::uint64_t n = 1;; ++n) {
    CAPTURE(n);
    host_provider device_memory(2 * M, 128 * M);
    host_provider far_memory_provider(2 * M);
    faulty_alloc a(fault_injecting_provider<host_provider>(device_memory, plan),
                   fault_injecting_reserver<host_reserver>(host_reserver(2 * M), plan), stitchy());
    a.attach_far_memory(fault_injecting_provider<host_provider>(far_memory_provider, plan), host_copier{}, unmapped);
    std::vector<void*> blocks;
    for (int i = 0; i < 6; ++i) blocks.push_back(a.allocate(8 * M));
    for (int i = 0; i < 6; i += 2) a.deallocate(blocks[i], 8 * M);
    void* big = a.allocate(24 * M);  // a stitch over the three free blocks
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
      a.offload(plain);  // again: far memory kept from the first
      a.prefetch(plain);
    } catch (const out_of_memory&) {
      threw = true;
    }
    plan.never_fail();
    const bool fired = plan.faults_injected() > injected;
    CHECK((fired || !threw));
    a.verify();
    // Whatever moved, everything comes back with its bytes (read only once back: away, the
    // addresses map nothing).
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
    if (!fired) break;
    ++faults;
    REQUIRE(n < 500);
  }
  CHECK(faults >= 20);
}

TEST_CASE("far residence unmapped: ready_on lets a stream wait for a prefetch's copies instead of the host") {
  const stream_ref own{std::uintptr_t{1}};
  const stream_ref copies{std::uintptr_t{3}};
  constexpr auto deferred = move_completion::deferred;
  sim_device gpu(256 * M, 2 * M, 256 * M);
  testing::event_log log;
  {
    stitching_allocator<sim_provider, testing::joining_reserver> a{sim_provider(gpu), testing::joining_reserver(gpu, log)};
    a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu), unmapped);
    void* p = a.allocate(32 * M, own);
    a.offload(p, own);
    CHECK(maps_nothing(gpu, p, 32 * M));

    a.prefetch(p, own, deferred, copies);
    const std::size_t waits = log.waited, joins = log.joins.size();
    a.ready_on(p, own);
    CHECK(log.waited == waits);  // the host did not wait
    REQUIRE(log.joins.size() == joins + 1);
    CHECK(log.joins.back() == std::pair{own, copies});  // the stream waits for the copies
    CHECK(maps_device(gpu, p, 32 * M));                 // usable by what is queued on it now
    CHECK(a.stats().offloaded_bytes == 32 * M);         // the far memory goes once copies are done
    a.verify();

    SUBCASE("completed by a later call once the copies are done") {
      log.complete(copies);
      CHECK(a.complete_moves(false) == 1);
      CHECK(a.stats().offloaded_bytes == 0);
      CHECK(maps_device(gpu, p, 32 * M));
    }
    SUBCASE("an offload then completes it first instead of undoing it") {
      a.offload(p, own, deferred, copies);
      CHECK(log.waited == waits + 1);  // the prefetch's copies, waited for
      CHECK(a.residence_of(p) == residence::host);
      CHECK(maps_device(gpu, p, 32 * M));  // until the offload's copies are done
      log.complete(own);
      log.complete(copies);
      CHECK(a.complete_moves(false) == 1);
      CHECK(maps_nothing(gpu, p, 32 * M));
      a.prefetch(p, own);
    }
    SUBCASE("a free completes it too") {
      a.deallocate(p, 32 * M, own);
      CHECK(a.stats().offloaded_bytes == 0);
      CHECK(a.stats().active_bytes == 0);
      p = nullptr;
    }
    SUBCASE("destroyed with it pending") {}
    if (p != nullptr) {
      a.verify();
      a.deallocate(p, 32 * M, own);
    }
  }
  CHECK(gpu.violations() == 0);
  CHECK(gpu.physical_bytes() == 0);
  CHECK(gpu.live_mappings() == 0);

  // Memory away mapped: a prefetch needs its remap after the copies, so ready_on completes it.
  stitching_allocator<sim_provider, testing::joining_reserver> m{sim_provider(gpu), testing::joining_reserver(gpu, log)};
  m.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu));
  void* q = m.allocate(32 * M, own);
  m.offload(q, own);
  m.prefetch(q, own, deferred, copies);
  const std::size_t joins = log.joins.size();
  m.ready_on(q, own);
  CHECK(log.joins.size() == joins);
  CHECK(m.stats().offloaded_bytes == 0);
  m.deallocate(q, 32 * M, own);
  CHECK(gpu.violations() == 0);
}
