// Clean far copies (keep_far_copy): an allocation marked as not written while on the device keeps
// its far copy when it comes back, so its next offload copies nothing. Its bytes come back whole
// (host backend, real bytes), the offload copies nothing and maps nothing afterwards (simulated
// driver), deferred offloads complete once the work on their stream is done (no copy stream),
// unmarking, frees and destruction give the copy back, and a failure at every driver call of a
// move loses no byte and no far handle.
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
constexpr auto deferred = move_completion::deferred;
using host_alloc = stitching_allocator<host_provider, host_reserver>;
using sim_alloc = stitching_allocator<sim_provider, sim_reserver>;

static_assert(far_copy_keeping_allocator<host_alloc>);
static_assert(far_copy_keeping_allocator<sim_alloc>);

config stitchy() {
  config c;
  c.frag_limit = 0;  // any request no free block serves may stitch
  return c;
}

bool maps_nothing(const sim_device& gpu, const void* p, std::size_t bytes) {
  for (std::size_t off = 0; off < bytes; off += 2 * M) {
    if (gpu.resolve(static_cast<const char*>(p) + off)) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("far copy: a marked allocation's bytes come back whole, and its second offload copies nothing") {
  for (const far_residence away : {unmapped, far_residence::mapped}) {
    CAPTURE(static_cast<int>(away));
    sim_device gpu(128 * M, 2 * M, 256 * M);
    {
      sim_alloc a{sim_provider(gpu), sim_reserver(gpu), stitchy()};
      a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu), away);
      std::vector<void*> blocks;
      for (int i = 0; i < 8; ++i) blocks.push_back(a.allocate(8 * M));
      for (int i = 0; i < 8; i += 2) a.deallocate(blocks[i], 8 * M);
      void* big = a.allocate(32 * M);  // stitched over the four free blocks
      REQUIRE(a.stats().stitches == 1);
      void* plain = blocks[1];
      a.keep_far_copy(big);
      a.keep_far_copy(plain);
      CHECK(a.far_copy_bytes() == 0);  // a copy exists once memory has been away and back

      a.offload(big);
      a.offload(plain);
      a.prefetch(big);
      a.prefetch(plain);
      CHECK(a.far_copy_bytes() == 40 * M);
      CHECK(gpu.host_bytes() == 40 * M);
      for (int round = 0; round < 3; ++round) {
        const std::uint64_t copies = gpu.copies();
        const std::size_t device = gpu.physical_bytes();
        a.offload(big);
        a.offload(plain);
        CHECK(gpu.copies() == copies);  // out: no copy
        CHECK(gpu.physical_bytes() == device - 40 * M);
        CHECK(a.stats().offloaded_bytes == 40 * M);
        CHECK(a.far_copy_bytes() == 0);  // the copy is the memory away now
        if (away == unmapped) CHECK(maps_nothing(gpu, big, 32 * M));
        a.verify();
        a.prefetch(plain);
        a.prefetch(big);
        CHECK(gpu.copies() > copies);  // back: copied
        CHECK(a.far_copy_bytes() == 40 * M);
        CHECK(gpu.host_bytes() == 40 * M);  // no far memory made beside the copies
        a.verify();
      }
      SUBCASE("unmarking gives the copy back; the next offload copies again") {
        a.keep_far_copy(big, false);
        CHECK(a.far_copy_bytes() == 8 * M);
        const std::uint64_t copies = gpu.copies();
        a.offload(big);
        CHECK(gpu.copies() > copies);
        a.prefetch(big);
        CHECK(a.far_copy_bytes() == 8 * M);
      }
      SUBCASE("a free gives the copy back, and the address reused is not marked") {
        a.deallocate(big, 32 * M);
        CHECK(a.far_copy_bytes() == 8 * M);
        void* again = a.allocate(32 * M);
        a.offload(again);
        a.prefetch(again);
        CHECK(a.far_copy_bytes() == 8 * M);
        big = again;
      }
      SUBCASE("freed while away: the mark and the far memory go") {
        a.offload(big);
        a.deallocate(big, 32 * M);
        CHECK(a.far_copy_bytes() == 8 * M);
        CHECK(a.stats().offloaded_bytes == 0);
        big = a.allocate(32 * M);
      }
      SUBCASE("destroyed with copies kept") {}
      a.verify();
      a.deallocate(big, 32 * M);
      for (int i = 1; i < 8; i += 2) a.deallocate(blocks[i], 8 * M);
      a.release_cached();
      CHECK(a.far_copy_bytes() == 0);
    }
    CHECK(gpu.violations() == 0);
    CHECK(gpu.physical_bytes() == 0);
    CHECK(gpu.host_bytes() == 0);
    CHECK(gpu.live_mappings() == 0);
  }
}

TEST_CASE("far copy: real bytes come back from the copy, and a write while marked is lost as documented") {
  host_provider device(2 * M, 64 * M);
  host_alloc a(device, host_reserver(2 * M));
  host_provider far(2 * M);
  a.attach_far_memory(far, host_copier{}, unmapped);
  void* p = a.allocate(16 * M);
  stamp(p, 16 * M, 31);
  a.keep_far_copy(p);
  a.offload(p);
  a.prefetch(p);
  CHECK(stamped(p, 16 * M, 31));
  a.offload(p);
  a.prefetch(p);
  CHECK(stamped(p, 16 * M, 31));
  stamp(p, 16 * M, 32);  // breaks the contract
  a.offload(p);
  a.prefetch(p);
  CHECK(stamped(p, 16 * M, 31));
  // Unmarked, a write survives.
  a.keep_far_copy(p, false);
  stamp(p, 16 * M, 33);
  a.offload(p);
  a.prefetch(p);
  CHECK(stamped(p, 16 * M, 33));
  a.deallocate(p, 16 * M);
  a.release_cached();
  CHECK(far.created_bytes() == 0);
  CHECK(device.created_bytes() == 0);
}

TEST_CASE("far copy: bad input is refused with nothing changed") {
  sim_device gpu(64 * M, 2 * M, 256 * M);
  sim_alloc a{sim_provider(gpu), sim_reserver(gpu)};
  void* p = a.allocate(8 * M);
  CHECK_THROWS_AS(a.keep_far_copy(p), usage_error);  // no far memory
  a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu), unmapped);
  int on_host = 0;
  CHECK_THROWS_AS(a.keep_far_copy(&on_host), usage_error);
  CHECK_THROWS_AS(a.keep_far_copy(static_cast<char*>(p) + 2 * M), usage_error);
  void* small = a.allocate(1024);
  CHECK_THROWS_AS(a.keep_far_copy(small), usage_error);
  a.keep_far_copy(p);
  a.keep_far_copy(p);  // marking twice is marking
  a.keep_far_copy(p, false);
  a.keep_far_copy(p, false);
  a.offload(p);
  a.prefetch(p);
  CHECK(a.far_copy_bytes() == 0);
  a.deallocate(small, 1024);
  a.deallocate(p, 8 * M);
  CHECK(gpu.violations() == 0);
}

TEST_CASE("far copy: a deferred offload to the copy waits for its stream's work only, and undoing it keeps the copy") {
  const stream_ref own{std::uintptr_t{1}};
  const stream_ref copies{std::uintptr_t{3}};
  sim_device gpu(256 * M, 2 * M, 256 * M);
  testing::event_log log;
  {
    stitching_allocator<sim_provider, testing::joining_reserver> a{sim_provider(gpu), testing::joining_reserver(gpu, log)};
    a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu), unmapped);
    void* p = a.allocate(32 * M, own);
    a.keep_far_copy(p);
    a.offload(p, own);
    a.prefetch(p, own, deferred, copies);
    a.ready_on(p, own);  // joined: completes later, keeping the far handles
    log.complete(copies);
    CHECK(a.complete_moves(false) == 1);
    CHECK(a.far_copy_bytes() == 32 * M);

    const std::uint64_t copied = gpu.copies();
    const std::size_t joins = log.joins.size();
    a.offload(p, own, deferred, copies);
    CHECK(gpu.copies() == copied);
    CHECK(log.joins.size() == joins);  // the copy stream is not involved
    CHECK(a.residence_of(p) == residence::host);
    log.complete(copies);
    CHECK(a.complete_moves(false) == 0);  // the work on its own stream is not done yet
    log.complete(own);
    CHECK(a.complete_moves(false) == 1);
    CHECK(maps_nothing(gpu, p, 32 * M));
    CHECK(a.far_copy_bytes() == 0);
    a.verify();
    a.prefetch(p, own);
    CHECK(a.far_copy_bytes() == 32 * M);

    SUBCASE("a pending offload to the copy undone by a prefetch: the copy stays") {
      a.offload(p, own, deferred);
      a.prefetch(p, own);
      CHECK(a.stats().offloaded_bytes == 0);
      CHECK(a.far_copy_bytes() == 32 * M);
      const std::uint64_t c = gpu.copies();
      a.offload(p, own);
      CHECK(gpu.copies() == c);
      a.prefetch(p, own);
    }
    SUBCASE("unmarked while its offload is pending: the offload completes first") {
      a.offload(p, own, deferred);
      a.keep_far_copy(p, false);
      CHECK(a.residence_of(p) == residence::host);
      CHECK(a.stats().offloaded_bytes == 32 * M);
      CHECK(a.far_copy_bytes() == 0);
      a.prefetch(p, own);
      CHECK(a.far_copy_bytes() == 0);
    }
    SUBCASE("freed while its offload is pending") {
      a.offload(p, own, deferred);
      a.deallocate(p, 32 * M, own);
      CHECK(a.far_copy_bytes() == 0);
      p = nullptr;
    }
    SUBCASE("destroyed with its offload pending") { a.offload(p, own, deferred); }
    if (p != nullptr && a.residence_of(p) == residence::device) {
      a.verify();
      a.deallocate(p, 32 * M, own);
    }
  }
  CHECK(gpu.violations() == 0);
  CHECK(gpu.physical_bytes() == 0);
  CHECK(gpu.host_bytes() == 0);
  CHECK(gpu.live_mappings() == 0);
}

TEST_CASE("far copy: a failure at any driver call of a move leaves every byte, mapping and far handle accounted") {
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
    stamp(big, 24 * M, 71);
    stamp(plain, 8 * M, 72);
    a.keep_far_copy(big);
    a.keep_far_copy(plain);
    const std::uint64_t injected = plan.faults_injected();
    plan.fail_nth_call(n);
    bool threw = false;
    try {
      a.offload(big);
      a.offload(plain);
      a.prefetch(plain);  // the far handles kept as copies
      a.prefetch(big);
      a.offload(plain);  // to the copy
      a.offload(big);
      a.prefetch(big);
      a.prefetch(plain);
    } catch (const out_of_memory&) {
      threw = true;
    }
    plan.never_fail();
    const bool fired = plan.faults_injected() > injected;
    CHECK((fired || !threw));
    a.verify();
    if (a.residence_of(big) == residence::host) a.prefetch(big);
    if (a.residence_of(plain) == residence::host) a.prefetch(plain);
    CHECK(stamped(big, 24 * M, 71));
    CHECK(stamped(plain, 8 * M, 72));
    // Once away and back without a failure, the next offload copies nothing and loses nothing.
    a.offload(big);
    a.prefetch(big);
    a.offload(big);
    a.prefetch(big);
    CHECK(stamped(big, 24 * M, 71));
    CHECK(a.far_copy_bytes() >= 24 * M);
    CHECK(a.stats().offloaded_bytes == 0);
    a.deallocate(big, 24 * M);
    for (int i = 1; i < 6; i += 2) a.deallocate(blocks[i], 8 * M);
    a.verify();
    CHECK(a.far_copy_bytes() == 0);
    a.release_cached();
    CHECK(far_memory_provider.created_bytes() == 0);
    if (!fired) break;
    ++faults;
    REQUIRE(n < 500);
  }
  CHECK(faults >= 20);
}
