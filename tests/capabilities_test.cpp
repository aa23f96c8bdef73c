// Capabilities as tags (allocators/capabilities.hpp): what each model has, and
// forward_capabilities as the segregator and locking_adaptor use it.
#include <doctest/doctest.h>

#include <cstddef>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "glake/adaptors/locking_adaptor.hpp"
#include "glake/allocators/caching_allocator.hpp"
#include "glake/allocators/capabilities.hpp"
#include "glake/allocators/segregator.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/sim.hpp"
#include "support/usage_kind.hpp"

namespace {

using namespace glake;
constexpr std::size_t M = MiB;
using sim_source = vmm_segment_source<sim_provider, sim_reserver>;
using caching = caching_allocator<sim_source>;
using stitching = stitching_allocator<sim_provider, sim_reserver>;
using two_stitching = segregator<stitching, stitching, mutex_lock>;

// The names of the capabilities in `set`, in bit order, for messages that say which differ.
std::string names(capability_set set) {
  std::string out;
  std::apply([&](auto... p) { ((out += set.contains(p) ? std::string(p.name) + " " : ""), ...); }, capability::all{});
  return out;
}

template <class A>
std::string names_of() {
  return names(capabilities_of_v<A>);
}

}  // namespace

TEST_CASE("capabilities: each tag answers as its refinement concept, and the sets name what each model has") {
  CHECK(has_capability<stitching, capability::offloading>);
  CHECK_FALSE(has_capability<caching, capability::offloading>);
  CHECK(has_capability<caching, capability::owning>);
  CHECK_FALSE(has_capability<caching, capability::stream_recording>);
  CHECK(names_of<caching>() == "owning cache_releasing peak_resetting ");
  CHECK(names_of<stitching>() ==
        "owning cache_releasing partly_cache_releasing completion_releasing offloading deferring_offloading "
        "far_copy_keeping peak_resetting memory_limiting stream_recording snapshotting observable "
        "memory_retaining ");
  // A segregator has what both parts have, but no memory limit (a limit of the sum is not a
  // part's), and its own reset_peaks.
  CHECK(names_of<segregator<caching, stitching>>() == names_of<caching>());
  CHECK(names_of<two_stitching>() ==
        "owning cache_releasing partly_cache_releasing completion_releasing offloading deferring_offloading "
        "far_copy_keeping peak_resetting stream_recording snapshotting observable memory_retaining ");
  // The adaptor has exactly its upstream's.
  CHECK(names_of<locking_adaptor<stitching, no_lock>>() == names_of<stitching>());
  CHECK(names_of<locking_adaptor<caching>>() == names_of<caching>());
  CHECK(capability_set{}.with(capability::owning{}).bits() == 1u);
  CHECK_FALSE(capability_set{}.contains(capability::owning{}));
}

TEST_CASE("capabilities: a segregator of two stitching parts routes pointer calls to the part that owns them") {
  sim_device gpu(256 * M, 2 * M, 128 * M);
  two_stitching a(4 * M, std::tuple{sim_provider(gpu), sim_reserver(gpu)},
                  std::tuple{sim_provider(gpu), sim_reserver(gpu)});
  a.small().attach_far_memory(sim_host_provider(gpu), sim_copier(gpu));
  a.large().attach_far_memory(sim_host_provider(gpu), sim_copier(gpu));
  void* small = a.allocate(4 * M);  // the small part's (at most the threshold)
  void* large = a.allocate(32 * M);
  CHECK(a.small().owns(small));
  CHECK(a.large().owns(large));
  CHECK(a.owns(small));
  CHECK(a.owns(large));

  a.offload(large, default_stream);
  CHECK(a.residence_of(large) == residence::host);
  CHECK(a.large().residence_of(large) == residence::host);
  CHECK(a.residence_of(small) == residence::device);
  CHECK(a.stats().offloaded_bytes == 32 * M);
  a.prefetch(large, default_stream);
  CHECK(a.residence_of(large) == residence::device);

  // A pointer neither part owns goes to the large part, which says it is not its own.
  int local = 0;
  CHECK(testing::usage_kind([&] { a.record_stream(&local, default_stream); }) ==
        usage_error::kind::foreign_pointer);
  a.record_stream(small, stream_ref{std::uintptr_t{7}});

  // Broadcasts reach both parts; the segregator's reserved bytes follow.
  a.deallocate(small, 4 * M);
  a.deallocate(large, 32 * M);
  CHECK(a.reserved_bytes() > 0);
  a.release_cached();
  CHECK(a.small().reserved_bytes() + a.large().reserved_bytes() == a.reserved_bytes());
  CHECK(a.stats().reserved_bytes == a.reserved_bytes());
  a.verify();
  CHECK(gpu.violations() == 0);
}

TEST_CASE("capabilities: a partial release over a segregator goes part by part until enough went back") {
  sim_device gpu(256 * M, 2 * M);
  two_stitching a(4 * M, std::tuple{sim_provider(gpu), sim_reserver(gpu)},
                  std::tuple{sim_provider(gpu), sim_reserver(gpu)});
  a.deallocate(a.allocate(4 * M), 4 * M);
  a.deallocate(a.allocate(32 * M), 32 * M);
  const std::size_t small_before = a.small().reserved_bytes(), large_before = a.large().reserved_bytes();
  REQUIRE(small_before > 0);
  REQUIRE(large_before > 0);
  // Asking for the small part's bytes only: the large part keeps its memory.
  CHECK(a.release_cached(small_before) >= small_before);
  CHECK(a.small().reserved_bytes() == 0);
  CHECK(a.large().reserved_bytes() == large_before);
  CHECK(a.stats().reserved_bytes == large_before);
  CHECK(a.release_cached(~std::size_t{0}) == large_before);
  CHECK(a.reserved_bytes() == 0);
}

TEST_CASE("capabilities: locking_adaptor serves several threads and forwards its upstream's capabilities") {
  sim_device gpu(1024 * M, 2 * M);
  locking_adaptor<caching_allocator<sim_source, no_lock>> a(std::in_place, sim_source{sim_provider{gpu}, sim_reserver{gpu}});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&a, t] {
      for (int i = 0; i < 200; ++i) {
        const std::size_t bytes = (static_cast<std::size_t>(t) + 1) * 4096 * (1 + i % 5);
        void* p = a.allocate(bytes);
        a.deallocate(p, bytes);
      }
    });
  }
  for (auto& t : threads) t.join();
  const statistics s = a.stats();
  CHECK(s.active_bytes == 0);
  CHECK(s.allocations == 800);
  CHECK(s.deallocations == 800);
  void* p = a.allocate(M);
  CHECK(a.owns(p));  // forwarded
  a.deallocate(p, M);
  CHECK_FALSE(a.owns(p));
  CHECK(a.reset_peaks().peak_active_bytes >= M);  // forwarded: the statistics just before
  a.release_cached();
  CHECK(a.reserved_bytes() == 0);
  a.verify();
}
