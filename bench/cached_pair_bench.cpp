// Cost of one cached allocate+deallocate pair on the sim backend: median ns per pair, and a
// mode that only runs pairs so that callgrind can count the instructions per pair.
//
// What a "cached pair" is here. The pair `p = allocate(S); deallocate(p, S);` must be served
// entirely from memory the allocator already holds (no driver call, no new segment), from a pool
// that is not trivially empty. Before measuring, every (size, allocator) run warms up the same way:
//
//   prime  = allocate(3 S); deallocate(prime)   // room for three blocks of S, cached
//   keep1  = allocate(S)                        // live for the whole run
//   x      = allocate(S)
//   keep2  = allocate(S)                        // scenario "exact" only
//   deallocate(x)
//   100 untimed pairs                           // node pools and caches reach steady state
//
// Scenario "exact" (the steady state of a training loop that frees and re-asks the same size):
// x's block is a free block of exactly S between live neighbours, so each pair takes it whole
// and gives it back with nothing to split or merge. Scenario "split" (the worst cached path):
// without keep2, x merged with the free tail behind it, so each pair splits S off a larger free
// block and merges it back on free. Where the pool has no room behind x (the stitching
// allocator's small pool cuts 1 MiB requests from 2 MiB segments, so keep1 and x fill one), the
// split scenario degenerates to exact; the splits/pair column shows what really happened.
// The run checks that no segment was created and no driver call made while measuring, and
// fails otherwise, so a number here is never a cold path in disguise.
//
// Sizes: 512 B, 4 KiB, 64 KiB and 1 MiB take the stitching allocator's small pool (a caching
// allocator over blocks of its large pool); 2 MiB and up take its large pool (best fit over
// chunks). Allocators: stitching_allocator<sim_provider, sim_reserver> with default policies and
// no_lock ("stitching"), the same with mutex_lock ("stitching_mutex"), and
// caching_allocator<vmm_segment_source<sim_provider, sim_reserver>> ("caching"). Each run has
// its own sim_device of 80 GiB and its own allocator. GLAKE_CHECKED keeps its default (on).
//
// Usage:
//   cached_pair_bench [--batch N] [--batches M]     table of ns/pair (markdown) on stdout
//   cached_pair_bench --instructions SIZE ALLOCATOR PAIRS [exact|split]
//       warm up, then run PAIRS untimed pairs. Instructions per pair are
//       (Ir(PAIRS = 2n) - Ir(PAIRS = n)) / n under valgrind --tool=callgrind, which cancels
//       start-up, warm-up and teardown. SIZE is 512, 4K, 64K, 1M, 2M, 16M, 256M or 1G;
//       ALLOCATOR is stitching, stitching_mutex or caching.
// bench/run_cached_pair.sh runs both and writes bench/results/cached_pair.md.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "glake/allocators/caching_allocator.hpp"
#include "glake/allocators/segment_source.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/sim.hpp"
#include "glake/policies/locking.hpp"

namespace {

using glake::GiB;
using glake::KiB;
using glake::MiB;

using stitching = glake::stitching_allocator<glake::sim_provider, glake::sim_reserver>;
using stitching_mutex =
    glake::stitching_allocator<glake::sim_provider, glake::sim_reserver,
                               glake::best_fit_tail_stitching, glake::lru_eviction,
                               glake::mutex_lock>;
using caching =
    glake::caching_allocator<glake::vmm_segment_source<glake::sim_provider, glake::sim_reserver>>;

constexpr std::size_t device_capacity = 80 * GiB;

struct size_case {
  std::string_view name;
  std::size_t bytes;
};
constexpr size_case sizes[] = {{"512", 512},       {"4K", 4 * KiB},   {"64K", 64 * KiB},
                               {"1M", 1 * MiB},    {"2M", 2 * MiB},   {"16M", 16 * MiB},
                               {"256M", 256 * MiB}, {"1G", 1 * GiB}};
constexpr std::string_view allocator_names[] = {"stitching", "stitching_mutex", "caching"};
constexpr std::string_view scenario_names[] = {"exact", "split"};

enum class scenario { exact, split };

// Keeps the compiler from dropping a pair whose result nobody reads.
inline void escape(void* p) { asm volatile("" : : "g"(p) : "memory"); }

template <class Alloc>
inline void pair(Alloc& a, std::size_t bytes) {
  void* p = a.allocate(bytes);
  escape(p);
  a.deallocate(p, bytes);
}

template <class Alloc>
void warm_up(Alloc& a, std::size_t bytes, scenario sc, std::vector<void*>& kept) {
  void* prime = a.allocate(3 * bytes);
  a.deallocate(prime, 3 * bytes);
  kept.push_back(a.allocate(bytes));
  void* x = a.allocate(bytes);
  if (sc == scenario::exact) kept.push_back(a.allocate(bytes));
  a.deallocate(x, bytes);
  for (int i = 0; i < 100; ++i) pair(a, bytes);
}

template <class Alloc>
void release(Alloc& a, std::size_t bytes, std::vector<void*>& kept) {
  for (void* p : kept) a.deallocate(p, bytes);
  kept.clear();
}

// Allocators are neither copyable nor movable; these return prvalues, which C++17 elides.
template <class Alloc>
Alloc make(glake::sim_device& device) {
  if constexpr (std::is_same_v<Alloc, caching>) {
    return Alloc(glake::vmm_segment_source<glake::sim_provider, glake::sim_reserver>(
        glake::sim_provider(device), glake::sim_reserver(device)));
  } else {
    return Alloc(glake::sim_provider(device), glake::sim_reserver(device));
  }
}

struct result {
  double p10 = 0, median = 0, p90 = 0;
  double splits_per_pair = 0, merges_per_pair = 0;
};

[[noreturn]] void fail(const std::string& why) {
  std::fprintf(stderr, "cached_pair_bench: %s\n", why.c_str());
  std::exit(1);
}

template <class Alloc>
result measure(std::size_t bytes, scenario sc, int batch, int batches) {
  glake::sim_device device(device_capacity);
  Alloc a = make<Alloc>(device);
  std::vector<void*> kept;
  warm_up(a, bytes, sc, kept);

  const glake::statistics before = a.stats();
  std::vector<double> per_pair(static_cast<std::size_t>(batches));
  for (double& ns : per_pair) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < batch; ++i) pair(a, bytes);
    const auto stop = std::chrono::steady_clock::now();
    ns = std::chrono::duration<double, std::nano>(stop - start).count() / batch;
  }
  const glake::statistics after = a.stats();
  if (after.segments_created != before.segments_created ||
      after.driver_calls != before.driver_calls) {
    fail("a measured pair was not cached (it created a segment or called the driver)");
  }
  const double pairs = static_cast<double>(batch) * batches;
  result r;
  r.splits_per_pair = static_cast<double>(after.splits - before.splits) / pairs;
  r.merges_per_pair = static_cast<double>(after.merges - before.merges) / pairs;

  std::sort(per_pair.begin(), per_pair.end());
  const auto at = [&](double q) {
    return per_pair[static_cast<std::size_t>(q * static_cast<double>(per_pair.size() - 1) + 0.5)];
  };
  r.p10 = at(0.10);
  r.median = at(0.50);
  r.p90 = at(0.90);
  release(a, bytes, kept);
  return r;
}

template <class Alloc>
void run_pairs(std::size_t bytes, scenario sc, long pairs) {
  glake::sim_device device(device_capacity);
  Alloc a = make<Alloc>(device);
  std::vector<void*> kept;
  warm_up(a, bytes, sc, kept);
  for (long i = 0; i < pairs; ++i) pair(a, bytes);
  release(a, bytes, kept);
}

template <class F>
void with_allocator(std::string_view name, F&& f) {
  if (name == "stitching") {
    f.template operator()<stitching>();
  } else if (name == "stitching_mutex") {
    f.template operator()<stitching_mutex>();
  } else if (name == "caching") {
    f.template operator()<caching>();
  } else {
    fail("unknown allocator '" + std::string(name) +
         "' (use stitching, stitching_mutex or caching)");
  }
}

std::size_t parse_size(std::string_view text) {
  for (const auto& s : sizes) {
    if (s.name == text) return s.bytes;
  }
  fail("unknown size '" + std::string(text) + "' (use 512, 4K, 64K, 1M, 2M, 16M, 256M or 1G)");
}

scenario parse_scenario(std::string_view text) {
  if (text == "exact") return scenario::exact;
  if (text == "split") return scenario::split;
  fail("unknown scenario '" + std::string(text) + "' (use exact or split)");
}

long parse_count(const char* text, const char* what) {
  char* end = nullptr;
  const long n = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || n <= 0) fail(std::string(what) + " must be a positive integer");
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::string_view(argv[1]) == "--instructions") {
    if (argc != 5 && argc != 6) {
      fail("usage: --instructions SIZE ALLOCATOR PAIRS [exact|split]");
    }
    const std::size_t bytes = parse_size(argv[2]);
    const long pairs = parse_count(argv[4], "PAIRS");
    const scenario sc = argc == 6 ? parse_scenario(argv[5]) : scenario::exact;
    with_allocator(argv[3], [&]<class Alloc>() { run_pairs<Alloc>(bytes, sc, pairs); });
    return 0;
  }

  int batch = 1000, batches = 101;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--batch" && i + 1 < argc) {
      batch = static_cast<int>(parse_count(argv[++i], "--batch"));
    } else if (arg == "--batches" && i + 1 < argc) {
      batches = static_cast<int>(parse_count(argv[++i], "--batches"));
    } else {
      fail("usage: cached_pair_bench [--batch N] [--batches M] | --instructions SIZE ALLOCATOR "
           "PAIRS [exact|split]");
    }
  }

  // One discarded run first, so that the first row does not pay for a cold CPU and cold caches.
  (void)measure<stitching>(sizes[0].bytes, scenario::exact, batch, batches);

  std::printf("Median, p10 and p90 over %d batches of %d pairs, ns per allocate+deallocate pair.\n\n",
              batches, batch);
  std::printf("| size | allocator | scenario | median ns/pair | p10 | p90 | splits/pair | merges/pair |\n");
  std::printf("|---:|---|---|---:|---:|---:|---:|---:|\n");
  for (const auto& s : sizes) {
    for (const auto name : allocator_names) {
      for (const auto sc_name : scenario_names) {
        const scenario sc = parse_scenario(sc_name);
        result r;
        with_allocator(name, [&]<class Alloc>() { r = measure<Alloc>(s.bytes, sc, batch, batches); });
        std::printf("| %s | %s | %s | %.1f | %.1f | %.1f | %.2f | %.2f |\n",
                    std::string(s.name).c_str(), std::string(name).c_str(),
                    std::string(sc_name).c_str(), r.median, r.p10, r.p90, r.splits_per_pair,
                    r.merges_per_pair);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
