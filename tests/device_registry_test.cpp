// The per-device registry: one allocator per device, made once, even under concurrent first use.
#include <doctest/doctest.h>

#include <atomic>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "glake/allocators/device_registry.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/sim.hpp"

using namespace glake;

namespace {
// Each "device" is a simulated GPU of its own.
struct simulated_gpu {
  explicit simulated_gpu(int id) : device(1 * GiB), allocator(sim_provider{device}, sim_reserver{device}), id(id) {}
  sim_device device;
  stitching_allocator<sim_provider, sim_reserver, best_fit_tail_stitching, lru_eviction, mutex_lock> allocator;
  int id;
};
}  // namespace

TEST_CASE("device_registry: one allocator per device, made on first use, even from many threads at once") {
  std::atomic<int> made{0};
  device_registry<simulated_gpu, 8> registry([&](int device) {
    ++made;
    return std::make_unique<simulated_gpu>(device);
  });
  CHECK(registry.find(3) == nullptr);
  std::vector<std::thread> threads;
  std::vector<simulated_gpu*> seen(16);
  for (int t = 0; t < 16; ++t) {
    threads.emplace_back([&, t] {
      simulated_gpu& gpu = registry.for_device(t % 4);
      void* p = gpu.allocator.allocate(3 * MiB);
      gpu.allocator.deallocate(p, 3 * MiB);
      seen[t] = &gpu;
    });
  }
  for (auto& th : threads) th.join();
  CHECK(made == 4);
  for (int t = 0; t < 16; ++t) {
    CHECK(seen[t] == seen[t % 4]);
    CHECK(seen[t]->id == t % 4);
  }
  int visited = 0;
  registry.for_each([&](int device, simulated_gpu& gpu) {
    CHECK(gpu.id == device);
    CHECK(gpu.allocator.stats().allocations == 4);
    ++visited;
  });
  CHECK(visited == 4);
  CHECK(registry.find(3) == seen[3]);
}

TEST_CASE("device_registry: bad device ids and failing factories leave it usable") {
  int calls = 0;
  device_registry<simulated_gpu, 4> registry([&](int device) -> std::unique_ptr<simulated_gpu> {
    if (++calls == 1) throw std::runtime_error("driver not ready");
    return std::make_unique<simulated_gpu>(device);
  });
  CHECK_THROWS_AS(registry.for_device(4), usage_error);
  CHECK_THROWS_AS(registry.for_device(-1), usage_error);
  CHECK_THROWS_AS(registry.for_device(0), std::runtime_error);
  CHECK(registry.find(0) == nullptr);
  CHECK(registry.for_device(0).id == 0);  // the next call retries the factory
  CHECK(calls == 2);
}
