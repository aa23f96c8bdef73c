// allocator_ref (allocators/allocator_ref.hpp): one conformance suite over the simulated and
// host backends and a segregator, driven through the type-erased reference by a consumer that is
// not a template.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <tuple>
#include <vector>

#include "glake/allocators/allocator_ref.hpp"
#include "glake/allocators/caching_allocator.hpp"
#include "glake/allocators/segregator.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/host.hpp"
#include "glake/backends/sim.hpp"

namespace {

using namespace glake;
constexpr std::size_t M = MiB;
using sim_source = vmm_segment_source<sim_provider, sim_reserver>;

struct sim_stitching_fixture {
  using allocator_type = stitching_allocator<sim_provider, sim_reserver>;
  sim_device device{1024 * M};
  allocator_type allocator{sim_provider{device}, sim_reserver{device}};
};
struct sim_caching_fixture {
  using allocator_type = caching_allocator<sim_source>;
  sim_device device{1024 * M};
  allocator_type allocator{sim_source{sim_provider{device}, sim_reserver{device}}};
};
struct host_stitching_fixture {
  using allocator_type = stitching_allocator<host_provider, host_reserver>;
  allocator_type allocator{host_provider(2 * M, 256 * M), host_reserver(2 * M)};
};
struct segregator_fixture {
  using allocator_type = segregator<caching_allocator<sim_source>, stitching_allocator<sim_provider, sim_reserver>>;
  sim_device device{1024 * M};
  allocator_type allocator{M, std::tuple{sim_source{sim_provider{device}, sim_reserver{device}}},
                           std::tuple{sim_provider{device}, sim_reserver{device}}};
};

// The consumer: not a template, it sees only what the reference guarantees. Allocates `sizes`,
// writes each block's first and last byte, frees them, gives the cache back, and returns the
// bytes still reserved (0 for every model here).
std::size_t churn(allocator_ref<capability::cache_releasing> a, const std::vector<std::size_t>& sizes) {
  std::vector<void*> blocks;
  for (std::size_t n : sizes) {
    void* p = a.allocate(n);
    REQUIRE(p != nullptr);
    CHECK(reinterpret_cast<std::uintptr_t>(p) % a.alignment() == 0);
    blocks.push_back(p);
  }
  for (std::size_t i = 0; i < blocks.size(); ++i) a.deallocate(blocks[i], sizes[i]);
  a.release_cached();
  a.verify();
  return a.reserved_bytes();
}

}  // namespace

#define GLAKE_REF_FIXTURES sim_stitching_fixture, sim_caching_fixture, host_stitching_fixture, segregator_fixture

TEST_CASE_TEMPLATE("allocator_ref: the required operations reach the allocator", F, GLAKE_REF_FIXTURES) {
  F f;
  allocator_ref<> r = f.allocator;
  CHECK(r.alignment() == f.allocator.alignment());
  std::set<void*> seen;
  std::vector<std::pair<void*, std::size_t>> live;
  for (std::size_t n : {std::size_t{512}, std::size_t{3 * M}, std::size_t{40 * M}, std::size_t{1000}}) {
    void* p = r.allocate(n);
    CHECK(seen.insert(p).second);
    live.emplace_back(p, n);
  }
  CHECK(r.try_allocate(0) == nullptr);
  CHECK(r.stats().active_bytes == f.allocator.stats().active_bytes);
  CHECK(r.stats().active_bytes == 512 + 3 * M + 40 * M + 1000);
  CHECK(r.reserved_bytes() == f.allocator.reserved_bytes());
  CHECK(r.try_allocate(std::size_t{1} << 60) == nullptr);  // out of memory: null, not a throw
  CHECK_THROWS_AS((void)r.allocate(std::size_t{1} << 60), std::bad_alloc);
  for (auto [p, n] : live) r.deallocate(p, n);
  CHECK(r.stats().active_bytes == 0);
  r.verify();
}

TEST_CASE_TEMPLATE("allocator_ref: capabilities are the allocator type's, and with<> guarantees only those",
                   F, GLAKE_REF_FIXTURES) {
  using A = typename F::allocator_type;
  F f;
  allocator_ref<> r = f.allocator;
  CHECK(r.capabilities() == capabilities_of_v<A>);
  CHECK(r.has(capability::owning{}) == owning_allocator<A>);
  CHECK(r.has<capability::offloading>() == offloading_allocator<A>);
  CHECK(r.with<capability::memory_limiting>().has_value() == memory_limiting_allocator<A>);
  CHECK(r.with<capability::stream_recording>().has_value() == stream_recording_allocator<A>);

  auto owning = r.with<capability::owning, capability::peak_resetting>();
  REQUIRE(owning.has_value());  // every model here is owning and resets peaks
  void* p = owning->allocate(2 * M);
  CHECK(owning->owns(p));
  CHECK(f.allocator.owns(p));
  CHECK(owning->reset_peaks().peak_active_bytes >= 2 * M);
  owning->deallocate(p, 2 * M);
  CHECK_FALSE(owning->owns(p));
  // Narrowing keeps the same allocator; equality is identity.
  allocator_ref<capability::owning> narrower = *owning;
  CHECK(narrower == r);
  if constexpr (memory_limiting_allocator<A>) {
    auto limited = r.with<capability::memory_limiting>();
    limited->set_memory_limit(64 * M);
    CHECK(f.allocator.memory_limit() == 64 * M);
    CHECK(limited->memory_limit() == 64 * M);
  }
}

TEST_CASE_TEMPLATE("allocator_ref: a consumer that is not a template drives each model", F, GLAKE_REF_FIXTURES) {
  F f;
  CHECK(churn(f.allocator, {256, 4096, M, 6 * M, 48 * M, 100}) == 0);
  CHECK(f.allocator.stats().allocations == 6);
  CHECK(f.allocator.reserved_bytes() == 0);
}

TEST_CASE("allocator_ref: offload and prefetch through the reference") {
  sim_device gpu(256 * M, 2 * M, 128 * M);
  stitching_allocator<sim_provider, sim_reserver> a{sim_provider{gpu}, sim_reserver{gpu}};
  a.attach_far_memory(sim_host_provider(gpu), sim_copier(gpu));
  allocator_ref<capability::owning, capability::offloading> r = a;
  static_assert(offloading_allocator<decltype(r)>);
  void* p = r.allocate(32 * M);
  r.offload(p);
  CHECK(r.residence_of(p) == residence::host);
  CHECK(a.residence_of(p) == residence::host);
  r.prefetch(p);
  CHECK(r.residence_of(p) == residence::device);
  r.deallocate(p, 32 * M);
  CHECK(gpu.violations() == 0);
}
