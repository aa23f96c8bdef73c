// Eight threads allocating and freeing at random through one stitching_allocator<..., mutex_lock>
// over the host and the simulated backends, with every block's contents (host) or mapping (sim)
// checked before it is freed. Run under ThreadSanitizer by scripts/test.sh's TSan stage.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/host.hpp"
#include "glake/backends/sim.hpp"
#include "glake/policies/locking.hpp"

namespace {

using namespace glake;

constexpr int thread_count = 8;

struct block {
  void* p;
  std::size_t bytes;
  std::uint64_t id;
};

// Sizes log-uniform from 1 B to 8 MiB: the small pool, plain blocks and, with frag_limit 0,
// stitches of freed blocks.
std::size_t random_size(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> exponent(0.0, 23.0);
  return std::max<std::size_t>(1, static_cast<std::size_t>(std::exp2(exponent(rng))));
}

// The byte at offset o of block `id`; written at the first and last 64 bytes and at every 4 KiB
// in between, so a block handed to two threads, or mapped to the wrong pages, shows.
std::uint8_t pattern(std::uint64_t id, std::size_t offset) {
  return static_cast<std::uint8_t>((id * 0x9e3779b97f4a7c15ull + offset * 31) >> 56);
}

template <class Visit>
void for_each_checked_byte(std::size_t bytes, Visit&& visit) {
  for (std::size_t o = 0; o < bytes; o = o < 64 || o + 64 >= bytes ? o + 1 : std::min(o + 4096, bytes - 64)) {
    visit(o);
  }
}

// Runs the threads; `touch(b)` fills a new block, `intact(b)` checks it before its free.
// Returns the operations done, failed requests included.
template <class Allocator, class Touch, class Intact>
std::size_t hammer(Allocator& allocator, std::size_t operations_per_thread, Touch touch, Intact intact) {
  std::atomic<std::uint64_t> next_id{1};
  std::atomic<std::size_t> done{0}, broken{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < thread_count; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(20261201 + t);
      const stream_ref stream{static_cast<std::uintptr_t>(t % 2)};
      std::vector<block> live;
      for (std::size_t i = 0; i < operations_per_thread; ++i) {
        if (live.empty() || (live.size() < 16 && rng() % 100 < 55)) {
          const std::size_t bytes = random_size(rng);
          if (void* p = allocator.try_allocate(bytes, stream)) {
            live.push_back({p, bytes, next_id++});
            touch(live.back());
          }
        } else {
          const std::size_t k = rng() % live.size();
          if (!intact(live[k])) ++broken;
          allocator.deallocate(live[k].p, live[k].bytes, stream);
          live[k] = live.back();
          live.pop_back();
        }
        if (i % 997 == 0 && t == 0) allocator.release_cached();
        ++done;
      }
      for (const auto& b : live) {
        if (!intact(b)) ++broken;
        allocator.deallocate(b.p, b.bytes, stream);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  CHECK(broken.load() == 0);
  allocator.verify();
  CHECK(allocator.stats().active_bytes == 0);
  return done.load();
}

config stitch_everything() {
  config cfg;
  cfg.frag_limit = 0;  // stitch at every size above the small pool
  cfg.grow_stitch = true;
  cfg.auto_gc = 64 * MiB;
  return cfg;
}

}  // namespace

TEST_CASE("threads: eight threads through a mutex_lock stitching allocator on the host backend keep every block's bytes") {
  constexpr std::size_t g = 64 * KiB;
  host_provider provider(g, 256 * MiB);
  stitching_allocator<host_provider, host_reserver, best_fit_tail_stitching, lru_eviction, mutex_lock> allocator(
      provider, host_reserver(g), stitch_everything());
  const auto touch = [](const block& b) {
    auto* bytes = static_cast<std::uint8_t*>(b.p);
    for_each_checked_byte(b.bytes, [&](std::size_t o) { bytes[o] = pattern(b.id, o); });
  };
  const auto intact = [](const block& b) {
    const auto* bytes = static_cast<const std::uint8_t*>(b.p);
    bool ok = true;
    for_each_checked_byte(b.bytes, [&](std::size_t o) { ok = ok && bytes[o] == pattern(b.id, o); });
    return ok;
  };
  CHECK(hammer(allocator, 3000, touch, intact) == thread_count * 3000);
  CHECK(allocator.stats().stitches > 0);
  allocator.release_cached();
  CHECK(provider.created_bytes() == 0);
}

TEST_CASE("threads: eight threads through a mutex_lock stitching allocator on the sim backend map every block") {
  sim_device device(1 * GiB);
  stitching_allocator<sim_provider, sim_reserver, best_fit_tail_stitching, lru_eviction, mutex_lock> allocator(
      sim_provider{device}, sim_reserver{device}, stitch_everything());
  // The sim device has no bytes; its page tables say whether each end of a block is mapped.
  const auto touch = [](const block&) {};
  const auto intact = [&device](const block& b) {
    const auto first = device.resolve(b.p);
    const auto last = device.resolve(static_cast<const std::byte*>(b.p) + b.bytes - 1);
    return first && first->accessible && last && last->accessible;
  };
  CHECK(hammer(allocator, 5000, touch, intact) == thread_count * 5000);
  CHECK(allocator.stats().stitches > 0);
  allocator.release_cached();
  CHECK(device.physical_bytes() == 0);
  CHECK(device.violations() == 0);
}
