// Conformance suites for the stitching, eviction and lock policy concepts, run over every model,
// plus what each model does differently.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/sim.hpp"
#include "glake/policies/eviction.hpp"
#include "glake/policies/locking.hpp"
#include "glake/policies/stitching.hpp"

namespace {

using namespace glake;
constexpr std::size_t M = MiB;

// A plan is sound when its picks are distinct, in range, cover the request with the growth, and
// make at least two pieces.
bool sound(const stitch_plan& plan, const stitch_request& request, const std::vector<std::size_t>& sizes) {
  std::set<std::uint32_t> seen;
  std::size_t sum = plan.grow_bytes;
  for (std::uint32_t pick : plan.picks) {
    if (pick >= sizes.size() || !seen.insert(pick).second) return false;
    sum += sizes[pick];
  }
  if (plan.grow_bytes > 0 && !request.may_grow) return false;
  return sum >= request.bytes && plan.pieces() >= 2;
}

}  // namespace

TEST_CASE_TEMPLATE("stitching strategy conformance: every plan made is sound", S, largest_first_stitching,
                   best_fit_tail_stitching, no_stitching) {
  std::mt19937_64 rng(3);
  S strategy;
  stitch_plan plan;
  int made = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<std::size_t> sizes(rng() % 12);
    for (auto& s : sizes) s = (1 + rng() % 64) * 2 * M;
    std::sort(sizes.rbegin(), sizes.rend());
    const stitch_request request{(1 + rng() % 256) * 2 * M, 2 * M, rng() % 2 == 0};
    const std::size_t total = std::accumulate(sizes.begin(), sizes.end(), std::size_t{0});
    if (strategy.plan(request, sizes, plan)) {
      ++made;
      CHECK(sound(plan, request, sizes));
    } else if (!std::is_same_v<S, no_stitching>) {
      // Declining is right only when the free blocks cannot cover it (or one block would do).
      const bool one_fits = !sizes.empty() && sizes.front() >= request.bytes;
      CHECK((one_fits || (!request.may_grow && total < request.bytes) || (sizes.empty() && !request.may_grow) ||
             (sizes.empty() && request.may_grow)));
    }
  }
  if (std::is_same_v<S, no_stitching>) {
    CHECK(made == 0);
  } else {
    CHECK(made > 100);
  }
}

TEST_CASE("stitching strategies: largest-first cuts the largest block, best-fit-tail keeps it whole") {
  const std::vector<std::size_t> sizes = {100 * M, 60 * M, 30 * M};
  const stitch_request request{130 * M, 2 * M, false};
  stitch_plan plan;
  REQUIRE(largest_first_stitching{}.plan(request, sizes, plan));
  CHECK(plan.picks == std::vector<std::uint32_t>{0, 1});  // 100 + 60, 30 MiB left of the 60
  REQUIRE(best_fit_tail_stitching{}.plan(request, sizes, plan));
  CHECK(plan.picks == std::vector<std::uint32_t>{0, 2});  // 100 + 30: exact, the 60 stays whole
}

TEST_CASE("stitching strategies: with may_grow the shortfall becomes new memory") {
  const std::vector<std::size_t> sizes = {40 * M, 20 * M};
  stitch_plan plan;
  CHECK_FALSE(largest_first_stitching{}.plan({100 * M, 2 * M, false}, sizes, plan));
  REQUIRE(largest_first_stitching{}.plan({100 * M, 2 * M, true}, sizes, plan));
  CHECK(plan.grow_bytes == 40 * M);
  REQUIRE(best_fit_tail_stitching{}.plan({100 * M, 2 * M, true}, sizes, plan));
  CHECK(plan.grow_bytes == 40 * M);
  CHECK(plan.pieces() == 3);
}

namespace {
struct entry : eviction_hook {
  int id = 0;
};
}  // namespace

TEST_CASE_TEMPLATE("eviction policy conformance: every pushed entry is evicted exactly once", E, lru_eviction,
                   largest_first_eviction) {
  typename E::template queue<entry> q;
  std::vector<entry> entries(50);
  for (int i = 0; i < 50; ++i) {
    entries[i].id = i;
    entries[i].eviction_bytes_ = static_cast<std::size_t>((i * 37) % 50 + 1);
    q.push(entries[i]);
  }
  CHECK(q.size() == 50);
  for (int i = 0; i < 50; i += 5) q.erase(entries[i]);  // reused entries leave the queue
  CHECK(q.size() == 40);
  std::set<int> evicted;
  while (entry* victim = q.victim()) {
    CHECK(victim->id % 5 != 0);
    CHECK(evicted.insert(victim->id).second);
    q.erase(*victim);
  }
  CHECK(evicted.size() == 40);
  CHECK(q.empty());
  CHECK(q.victim() == nullptr);
}

TEST_CASE("eviction policies: LRU drops the longest cached first, largest-first the biggest") {
  std::vector<entry> entries(3);
  const std::size_t bytes[] = {10, 30, 20};
  for (int i = 0; i < 3; ++i) {
    entries[i].id = i;
    entries[i].eviction_bytes_ = bytes[i];
  }
  lru_eviction::queue<entry> lru;
  largest_first_eviction::queue<entry> largest;
  for (auto& e : entries) lru.push(e);
  for (auto& e : entries) largest.push(e);
  CHECK(lru.victim()->id == 0);
  CHECK(largest.victim()->id == 1);
  lru.erase(entries[0]);
  lru.push(entries[0]);  // reused and cached again: now the most recent
  CHECK(lru.victim()->id == 1);
}

TEST_CASE_TEMPLATE("lock policy conformance: BasicLockable, mutual exclusion where it promises it", L, no_lock,
                   mutex_lock) {
  L lock;
  {
    std::lock_guard guard(lock);  // compiles and locks
  }
  if constexpr (std::is_same_v<L, mutex_lock>) {
    long counter = 0;
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&] {
        for (int i = 0; i < 20000; ++i) {
          std::lock_guard guard(lock);
          ++counter;
        }
      });
    }
    for (auto& t : threads) t.join();
    CHECK(counter == 80000);
  } else {
    CHECK(sizeof(L) == 1);  // empty: free as a [[no_unique_address]] member
  }
}

TEST_CASE("locking: a mutex_lock stitching allocator shared by four threads stays consistent") {
  sim_device device(16 * GiB);
  config cfg;
  cfg.frag_limit = 0;
  stitching_allocator<sim_provider, sim_reserver, best_fit_tail_stitching, lru_eviction, mutex_lock> allocator(
      sim_provider{device}, sim_reserver{device}, cfg);
  std::atomic<std::size_t> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      std::vector<std::pair<void*, std::size_t>> mine;
      const stream_ref stream{static_cast<std::uintptr_t>(t % 2)};
      for (int i = 0; i < 20000; ++i) {
        if (mine.empty() || (mine.size() < 16 && rng() % 2 == 0)) {
          const std::size_t bytes = rng() % 3 == 0 ? 1 + rng() % (256 * M) : 1 + rng() % 65536;
          if (void* p = allocator.try_allocate(bytes, stream)) {
            mine.emplace_back(p, bytes);
          } else {
            ++failures;
          }
        } else {
          const std::size_t k = rng() % mine.size();
          allocator.deallocate(mine[k].first, mine[k].second, stream);
          mine[k] = mine.back();
          mine.pop_back();
        }
      }
      for (auto [p, n] : mine) allocator.deallocate(p, n, stream);
    });
  }
  for (auto& t : threads) t.join();
  allocator.verify();
  const statistics s = allocator.stats();
  CHECK(s.active_bytes == 0);
  CHECK(s.allocations == s.deallocations);
  CHECK(failures.load() == 0);
  CHECK(device.violations() == 0);
}
