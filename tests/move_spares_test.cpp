// Spare device handles (config::move_spares): the handles an offload gives back are kept, within
// their bound, for the next prefetch of their size, which then creates nothing; spares count as
// reserved, come back whole with their bytes (host backend), and never cause an out-of-memory:
// a refused request releases them and is tried again, and release_cached gives them back.
#include <doctest/doctest.h>

#include <cstddef>
#include <vector>

#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/host.hpp"
#include "glake/backends/sim.hpp"
#include "support/stamp.hpp"

namespace {

using namespace glake;
using testing::stamp;
using testing::stamped;
constexpr std::size_t M = MiB;
using host_alloc = stitching_allocator<host_provider, host_reserver>;
using sim_alloc = stitching_allocator<sim_provider, sim_reserver>;

config spares(std::size_t bytes) {
  config c;
  c.move_spares = bytes;
  return c;
}

std::uint64_t calls(const sim_alloc& a, driver_call kind) { return a.stats().driver_calls[kind]; }

}  // namespace

TEST_CASE("move spares: a prefetch takes the handles the offload gave back, and creates and releases nothing") {
  for (const far_residence away : {far_residence::unmapped, far_residence::mapped}) {
    CAPTURE(static_cast<int>(away));
    sim_device gpu(128 * M, 2 * M, 256 * M);
    sim_alloc a{sim_provider(gpu), sim_reserver(gpu), spares(64 * M)};
    a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu), away);
    void* p = a.allocate(16 * M);
    void* q = a.allocate(16 * M);
    const std::size_t device = gpu.physical_bytes();
    const std::size_t reserved = a.stats().reserved_bytes;

    a.offload(p);
    CHECK(a.stats().spare_bytes == 16 * M);
    CHECK(a.stats().offloaded_bytes == 16 * M);
    CHECK(a.stats().reserved_bytes == reserved);  // the spares are held, and counted
    CHECK(gpu.physical_bytes() == device);
    a.verify();

    for (int round = 0; round < 3; ++round) {
      const std::uint64_t creates = calls(a, driver_call::create);
      const std::uint64_t releases = calls(a, driver_call::release);
      const std::uint64_t recycled = a.stats().recycled_handles;
      a.prefetch(p);  // takes the spares
      CHECK(a.stats().spare_bytes == 0);
      CHECK(a.stats().recycled_handles == recycled + 8);  // 2 MiB handles
      a.offload(q);  // gives its handles back as spares
      CHECK(a.stats().spare_bytes == 16 * M);
      a.prefetch(q);
      a.offload(p);
      // Far memory keeps its own handles for the next offloads: no create or release at all.
      CHECK(calls(a, driver_call::create) == creates);
      CHECK(calls(a, driver_call::release) == releases);
      CHECK(gpu.physical_bytes() == device);
      a.verify();
    }
    a.prefetch(p);
    CHECK(a.stats().reserved_bytes == reserved);
    CHECK(a.stats().peak_reserved_bytes == reserved);  // moving through spares never adds a byte
    CHECK(gpu.violations() == 0);
    a.deallocate(p, 16 * M);
    a.deallocate(q, 16 * M);
    a.release_cached();
    CHECK(gpu.physical_bytes() == 0);
    CHECK(a.stats().reserved_bytes == 0);
  }
}

TEST_CASE("move spares: bytes come back whole through another allocation's recycled handles") {
  host_provider device_memory(2 * M, 64 * M);
  host_provider far_memory_provider(2 * M);
  host_alloc a{device_memory, host_reserver(2 * M), spares(64 * M)};
  a.attach_far_memory(far_memory_provider, host_copier{});
  void* p = a.allocate(8 * M);
  void* q = a.allocate(8 * M);
  stamp(p, 8 * M, 31);
  stamp(q, 8 * M, 32);
  a.offload(p);
  a.offload(q);
  a.prefetch(q);  // on handles p had
  CHECK(a.stats().recycled_handles == 4);
  CHECK(stamped(q, 8 * M, 32));
  stamp(q, 8 * M, 33);
  a.offload(q);
  a.prefetch(p);
  a.prefetch(q);
  CHECK(stamped(p, 8 * M, 31));
  CHECK(stamped(q, 8 * M, 33));
  CHECK(a.stats().recycled_handles == 12);
  a.verify();
  a.deallocate(p, 8 * M);
  a.deallocate(q, 8 * M);
  a.release_cached();
  CHECK(device_memory.created_bytes() == 0);
}

TEST_CASE("move spares: the bound holds, other sizes are created, and a smaller bound releases now") {
  sim_device gpu(128 * M, 2 * M, 256 * M);
  sim_alloc a{sim_provider(gpu), sim_reserver(gpu), spares(6 * M)};
  a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu), far_residence::unmapped);
  void* p = a.allocate(16 * M);
  const std::size_t device = gpu.physical_bytes();
  a.offload(p);
  CHECK(a.stats().spare_bytes == 6 * M);  // three of its eight handles
  CHECK(gpu.physical_bytes() == device - 10 * M);
  a.verify();
  a.prefetch(p);
  CHECK(a.stats().recycled_handles == 3);
  CHECK(gpu.physical_bytes() == device);
  a.deallocate(p, 16 * M);
  a.release_cached();
  CHECK(gpu.physical_bytes() == 0);

  // Another allocator, handles of 8 MiB: a spare of one size serves no other.
  config c = spares(32 * M);
  c.max_handle = 8 * M;
  c.min_handles = 1;
  sim_alloc b{sim_provider(gpu), sim_reserver(gpu), c};
  b.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu), far_residence::unmapped);
  void* big = b.allocate(16 * M);    // two 8 MiB handles
  void* small = b.allocate(4 * M);   // a 4 MiB segment
  b.offload(big);
  CHECK(b.stats().spare_bytes == 16 * M);
  b.offload(small);
  CHECK(b.stats().spare_bytes == 20 * M);
  b.prefetch(small);
  CHECK(b.stats().recycled_handles == 1);
  CHECK(b.stats().spare_bytes == 16 * M);
  b.verify();
  b.prefetch(big);
  CHECK(b.stats().recycled_handles == 3);
  b.deallocate(big, 16 * M);
  b.deallocate(small, 4 * M);
  b.release_cached();
  CHECK(gpu.physical_bytes() == 0);
}

TEST_CASE("move spares: spares never cause an out-of-memory: a refused request releases them and is tried again") {
  SUBCASE("the device is full") {
    sim_device gpu(32 * M, 2 * M, 256 * M);
    sim_alloc a{sim_provider(gpu), sim_reserver(gpu), spares(64 * M)};
    a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu), far_residence::unmapped);
    void* p = a.allocate(16 * M);
    void* q = a.allocate(16 * M);
    a.offload(p);
    a.offload(q);
    CHECK(a.stats().spare_bytes == 32 * M);
    CHECK(gpu.physical_bytes() == 32 * M);
    void* r = a.allocate(10 * M);  // a new segment: refused by the device, then served
    CHECK(r != nullptr);
    CHECK(a.stats().spare_bytes == 0);
    CHECK(gpu.physical_bytes() == 10 * M);
    a.verify();
    a.deallocate(r, 10 * M);
    a.prefetch(q);  // created anew
    a.prefetch(p);  // room only once r's cached segment goes: what it made first waits as spares
    CHECK(a.stats().offloaded_bytes == 0);
    CHECK(gpu.physical_bytes() == 32 * M);
    a.verify();
    a.deallocate(p, 16 * M);
    a.deallocate(q, 16 * M);
  }
  SUBCASE("the memory limit") {
    sim_device gpu(128 * M, 2 * M, 256 * M);
    config c = spares(64 * M);
    c.memory_limit = 32 * M;
    sim_alloc a{sim_provider(gpu), sim_reserver(gpu), c};
    a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu), far_residence::unmapped);
    void* p = a.allocate(16 * M);
    void* q = a.allocate(16 * M);
    a.offload(p);
    CHECK(a.stats().spare_bytes == 16 * M);
    void* r = a.try_allocate(12 * M);  // within the limit once the spares go
    REQUIRE(r != nullptr);
    CHECK(a.stats().spare_bytes == 0);
    CHECK(a.stats().reserved_bytes <= 32 * M);
    a.verify();
    a.deallocate(r, 12 * M);
    a.deallocate(q, 16 * M);
    a.release_cached();
    a.prefetch(p);  // makes new handles within the limit
    CHECK(a.stats().reserved_bytes == 16 * M);
    a.offload(p);
    CHECK(a.stats().spare_bytes == 16 * M);
    a.set_memory_limit(8 * M);  // above the new limit: every spare goes
    CHECK(a.stats().spare_bytes == 0);
    CHECK(gpu.physical_bytes() == 0);
    a.verify();
    a.deallocate(p, 16 * M);  // parked in far memory: the device has no room under the limit
  }
  SUBCASE("complete_move of an offloaded allocation gives its device memory back, spares included") {
    sim_device gpu(128 * M, 2 * M, 256 * M);
    sim_alloc a{sim_provider(gpu), sim_reserver(gpu), spares(64 * M)};
    a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu), far_residence::unmapped);
    void* p = a.allocate(16 * M);
    void* q = a.allocate(16 * M);
    a.offload(p);
    a.complete_move(q);  // on the device: the spares stay
    CHECK(a.stats().spare_bytes == 16 * M);
    a.complete_move(p);  // a shared budget hands its bytes on after this
    CHECK(a.stats().spare_bytes == 0);
    CHECK(gpu.physical_bytes() == 16 * M);
    a.verify();
    a.deallocate(p, 16 * M);
    a.deallocate(q, 16 * M);
  }
  SUBCASE("release_cached and release_completed give them back") {
    sim_device gpu(128 * M, 2 * M, 256 * M);
    sim_alloc a{sim_provider(gpu), sim_reserver(gpu), spares(64 * M)};
    a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu), far_residence::unmapped);
    void* p = a.allocate(16 * M);
    a.offload(p);
    CHECK(a.release_completed(4 * M) == 16 * M);  // the spares first, all of them
    CHECK(gpu.physical_bytes() == 0);
    a.prefetch(p);
    a.offload(p);
    CHECK(a.stats().spare_bytes == 16 * M);
    a.release_cached();
    CHECK(a.stats().spare_bytes == 0);
    CHECK(gpu.physical_bytes() == 0);
    a.verify();
    a.deallocate(p, 16 * M);
  }
}
