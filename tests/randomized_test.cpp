// Randomized operation sequences on the simulated backend, with every invariant checked after
// every step and an independent oracle: the sim device's own page tables.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <new>
#include <random>
#include <vector>

#include "glake/allocators/caching_allocator.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/sim.hpp"

namespace {

using namespace glake;

struct live_allocation {
  void* p;
  std::size_t bytes;
  stream_ref stream;
};

// Which physical bytes live allocations occupy, keyed by (handle, offset): an allocation whose
// physical bytes overlap another live one's is a bug no matter what the allocator believes.
class physical_oracle {
 public:
  explicit physical_oracle(const sim_device& device) : device_(device) {}

  // Records [p, p + bytes) chunk by chunk; fails the test on overlap or unmapped memory.
  void claim(const live_allocation& a, std::size_t id) {
    for_each_physical(a, [&](std::uint64_t handle, std::size_t offset, std::size_t length) {
      auto key = std::make_pair(handle, offset);
      auto next = claimed_.lower_bound(key);
      if (next != claimed_.end() && next->first.first == handle) {
        REQUIRE_MESSAGE(next->first.second >= offset + length, "physical overlap with a live allocation");
      }
      if (next != claimed_.begin()) {
        auto prev = std::prev(next);
        if (prev->first.first == handle) {
          REQUIRE_MESSAGE(prev->first.second + prev->second.first <= offset,
                          "physical overlap with a live allocation");
        }
      }
      claimed_.emplace(key, std::make_pair(length, id));
    });
  }

  void release(const live_allocation& a) {
    for_each_physical(a, [&](std::uint64_t handle, std::size_t offset, std::size_t) {
      REQUIRE(claimed_.erase(std::make_pair(handle, offset)) == 1);
    });
  }

  std::size_t ranges() const { return claimed_.size(); }

 private:
  template <class F>
  void for_each_physical(const live_allocation& a, F&& f) {
    const std::size_t g = device_.granularity();
    auto address = reinterpret_cast<std::uintptr_t>(a.p);
    const std::uintptr_t end = address + a.bytes;
    while (address < end) {
      auto where = device_.resolve(reinterpret_cast<void*>(address));
      REQUIRE_MESSAGE(where.has_value(), "a live allocation covers unmapped memory");
      REQUIRE_MESSAGE(where->accessible, "a live allocation covers memory without access");
      const std::size_t length = std::min<std::uintptr_t>(end - address, g - address % g);
      f(where->handle, where->offset, length);
      address += length;
    }
  }

  const sim_device& device_;
  std::map<std::pair<std::uint64_t, std::size_t>, std::pair<std::size_t, std::size_t>> claimed_;
};

// Sizes log-uniform from 1 B to 1 GiB, like tensors: many small, some huge.
std::size_t random_size(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> exponent(0.0, 30.0);
  const auto bytes = static_cast<std::size_t>(std::exp2(exponent(rng)));
  return std::clamp<std::size_t>(bytes, 1, std::size_t{1} << 30);
}

// Returns how many requests were answered with out-of-memory.
template <class Allocator>
std::size_t run_random_sequence(Allocator& allocator, sim_device& device, std::uint64_t seed,
                         std::size_t operations, std::size_t max_live) {
  std::mt19937_64 rng(seed);
  physical_oracle oracle(device);
  std::vector<live_allocation> live;
  std::size_t active = 0, failures = 0, next_id = 0;
  const stream_ref streams[] = {stream_ref{0}, stream_ref{7}};

  for (std::size_t step = 0; step < operations; ++step) {
    const bool allocate = live.empty() || (live.size() < max_live && rng() % 100 < 52);
    if (allocate) {
      const live_allocation a{nullptr, random_size(rng), streams[rng() % 8 == 0 ? 1 : 0]};
      void* p = nullptr;
      if (rng() % 2 == 0) {
        p = allocator.try_allocate(a.bytes, a.stream);
      } else {
        try {
          p = allocator.allocate(a.bytes, a.stream);
        } catch (const out_of_memory& e) {
          REQUIRE(e.requested_bytes() == a.bytes);
        }
      }
      if (p == nullptr) {
        ++failures;
      } else {
        live.push_back({p, a.bytes, a.stream});
        oracle.claim(live.back(), next_id++);
        active += a.bytes;
      }
    } else {
      const std::size_t i = rng() % live.size();
      oracle.release(live[i]);
      allocator.deallocate(live[i].p, live[i].bytes, live[i].stream);
      active -= live[i].bytes;
      live[i] = live.back();
      live.pop_back();
    }
    if (step % 50'000 == 0 && rng() % 2 == 0) allocator.release_cached();

    allocator.verify();
    const statistics s = allocator.stats();
    REQUIRE(s.active_bytes == active);
    REQUIRE(s.peak_active_bytes >= s.active_bytes);
    REQUIRE(s.reserved_bytes == device.physical_bytes());
    REQUIRE(s.peak_reserved_bytes >= s.reserved_bytes);
    REQUIRE(device.violations() == 0);
  }
  for (const auto& a : live) {
    oracle.release(a);
    allocator.deallocate(a.p, a.bytes, a.stream);
  }
  allocator.verify();
  allocator.release_cached();
  allocator.verify();
  CHECK(oracle.ranges() == 0);
  CHECK(allocator.stats().active_bytes == 0);
  CHECK(device.physical_bytes() == 0);
  CHECK(device.live_mappings() == 0);
  CHECK(device.violations() == 0);
  MESSAGE("seed " << seed << ": " << operations << " operations, " << failures
                  << " out-of-memory answers, peak reserved "
                  << allocator.stats().peak_reserved_bytes / (1 << 20) << " MiB");
  CHECK(failures < operations / 4);  // the capacity is meant to bind sometimes, not always
  return failures;
}

}  // namespace

TEST_CASE("randomized: one million operations through the stitching allocator, invariants after each") {
  // Aggressive knobs so that every path runs often: stitch everything, grow only the shortfall,
  // keep few cached stitches, and a device small enough to run out.
  sim_device device(6 * GiB);
  config cfg;
  cfg.frag_limit = 0;
  cfg.grow_stitch = true;
  cfg.reuse_limit = 2.0;
  cfg.auto_gc = 4 * GiB;
  stitching_allocator<sim_provider, sim_reserver> allocator(sim_provider{device}, sim_reserver{device}, cfg);
  CHECK(run_random_sequence(allocator, device, 20261121, 1'000'000, 48) > 50);
  const statistics s = allocator.stats();
  CHECK(s.stitches > 1000);
  CHECK(s.stitch_cache_hits > 100);
  CHECK(s.stitch_evictions > 100);
  CHECK(s.splits > 1000);
}

TEST_CASE("randomized: GMLake's default knobs, largest-first stitching, largest-first eviction, memory limit") {
  sim_device device(64 * GiB);
  config cfg;  // GMLake defaults: stitch requests of 512 MiB and more
  cfg.memory_limit = 5 * GiB;
  cfg.auto_gc = 2 * GiB;
  stitching_allocator<sim_provider, sim_reserver, largest_first_stitching, largest_first_eviction>
      allocator(sim_provider{device}, sim_reserver{device}, cfg);
  CHECK(run_random_sequence(allocator, device, 42, 200'000, 32) > 10);
  CHECK(allocator.stats().stitches > 10);
}

TEST_CASE("randomized: defragLevel 2 stitches only as the last resort") {
  sim_device device(4 * GiB + 512 * MiB);
  config cfg;
  cfg.frag_limit = 64 * MiB;
  cfg.defrag_level = 2;
  stitching_allocator<sim_provider, sim_reserver> allocator(sim_provider{device}, sim_reserver{device}, cfg);
  CHECK(run_random_sequence(allocator, device, 7, 150'000, 32) > 10);
}

TEST_CASE("randomized: the caching allocator under the same sequences") {
  sim_device device(8 * GiB);
  using source = vmm_segment_source<sim_provider, sim_reserver>;
  caching_allocator<source> allocator(source(sim_provider{device}, sim_reserver{device}));
  CHECK(run_random_sequence(allocator, device, 99, 200'000, 48) > 0);
}

TEST_CASE("randomized: handles of varying size (max_handle) stitch, repair and grow by whole handles, invariants after each") {
  sim_device device(5 * GiB + 512 * MiB);
  config cfg;
  cfg.frag_limit = 0;
  cfg.grow_stitch = true;
  cfg.max_handle = 256 * MiB;
  cfg.auto_gc = 2 * GiB;
  stitching_allocator<sim_provider, sim_reserver> allocator(sim_provider{device}, sim_reserver{device}, cfg);
  CHECK(run_random_sequence(allocator, device, 314, 200'000, 48) > 10);
  const statistics s = allocator.stats();
  MESSAGE("stitches " << s.stitches << ", repairs " << s.stitch_repairs << ", grows " << s.stitch_grows);
  CHECK(s.stitches > 100);
  CHECK(s.stitch_repairs > 100);  // cached ranges repaired and grown with mixed handle sizes
  CHECK(s.stitch_grows > 100);
}

TEST_CASE("randomized: segments that grow in place, split and released from inside under pressure, invariants after each") {
  sim_device device(6 * GiB);
  config cfg;
  cfg.frag_limit = 0;
  cfg.grow_stitch = true;
  cfg.max_handle = 8 * MiB;
  cfg.segment_reserve = 64 * GiB;  // clamped to the device's 6 GiB
  cfg.auto_gc = 2 * GiB;
  stitching_allocator<sim_provider, sim_reserver> allocator(sim_provider{device}, sim_reserver{device}, cfg);
  CHECK(run_random_sequence(allocator, device, 20261128, 300'000, 48) > 10);
  const statistics s = allocator.stats();
  MESSAGE("segments " << s.segments_created << " made, " << s.segments_released << " released, stitches "
                      << s.stitches);
  CHECK(s.stitches > 100);
  // More released than made: free handles were split off growing segments and released.
  CHECK(s.segments_released > s.segments_created);
}
