// glake/glake.hpp on its own: a translation unit that includes nothing else of glake compiles and
// can name every component that runs without a GPU.
#include "glake/glake.hpp"

#include <doctest/doctest.h>

#include <memory>
#include <tuple>

namespace {

using namespace glake;

// A GMLake-like composition made only of names that glake.hpp brings in: PyTorch's small pool
// beside a stitching pool whose driver calls go through the fault-injection wrappers.
using faulty_provider = fault_injecting_provider<sim_provider>;
using faulty_reserver = fault_injecting_reserver<sim_reserver>;
using sim_source = vmm_segment_source<sim_provider, sim_reserver>;
using small_pool = caching_allocator<sim_source>;
using large_pool = stitching_allocator<faulty_provider, faulty_reserver, largest_first_stitching>;
using composed = segregator<small_pool, large_pool, mutex_lock>;

static_assert(physical_provider<faulty_provider>);
static_assert(address_reserver<faulty_reserver>);
static_assert(physical_provider<host_provider>);
static_assert(address_reserver<host_reserver>);

struct gpu {
  explicit gpu(fault_plan& plan)
      : allocator(MiB, std::tuple{sim_source{sim_provider{device}, sim_reserver{device}}},
                  std::tuple{faulty_provider{sim_provider{device}, plan}, faulty_reserver{sim_reserver{device}, plan},
                             small_pool_off()}) {}
  static config small_pool_off() {
    config cfg;
    cfg.small_limit = 0;
    return cfg;
  }
  sim_device device{1 * GiB};
  composed allocator;
};

}  // namespace

TEST_CASE("glake.hpp: one include is enough for a registry of segregated, fault-injected allocators") {
  fault_plan plan;
  device_registry<gpu, 2> registry([&](int) { return std::make_unique<gpu>(plan); });
  composed& allocator = registry.for_device(1).allocator;

  void* small = allocator.allocate(4096);
  void* large = allocator.allocate(8 * MiB);
  CHECK(small != nullptr);
  CHECK(large != nullptr);
  CHECK(allocator.stats().active_bytes == 4096 + 8 * MiB);

  plan.fail_every_call_of(driver_call::create);
  CHECK(allocator.try_allocate(64 * MiB) == nullptr);
  CHECK(plan.faults_injected() >= 1);
  plan.reset();

  allocator.deallocate(large, 8 * MiB);
  allocator.deallocate(small, 4096);
  CHECK(allocator.stats().active_bytes == 0);
  CHECK(registry.find(0) == nullptr);
}
