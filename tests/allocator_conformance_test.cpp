// One conformance suite run over every allocator composition: what any glake allocator promises.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <new>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "glake/allocators/caching_allocator.hpp"
#include "glake/allocators/segregator.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/sim.hpp"

namespace {

using namespace glake;
using sim_source = vmm_segment_source<sim_provider, sim_reserver>;

// Each fixture owns a 4 GiB simulated device and one allocator composition over it; the
// allocator sits in an optional so that a test can destroy it while the device lives on.
template <class T>
struct parenthesized;
template <class T>
struct parenthesized<void(T)> {
  using type = T;
};

// TYPE is parenthesized so that template argument lists may contain commas.
#define GLAKE_FIXTURE(NAME, TYPE, ...)                            \
  struct NAME {                                                   \
    using allocator_type = typename parenthesized<void TYPE>::type; \
    sim_device device{4 * GiB};                                   \
    std::optional<allocator_type> holder{std::in_place, __VA_ARGS__}; \
    allocator_type& allocator = *holder;                          \
  }

GLAKE_FIXTURE(caching_fixture, (caching_allocator<sim_source>),
              sim_source{sim_provider{device}, sim_reserver{device}});
GLAKE_FIXTURE(caching_mutex_largest_first_fixture,
              (caching_allocator<sim_source, mutex_lock, largest_first_eviction>),
              sim_source{sim_provider{device}, sim_reserver{device}});
GLAKE_FIXTURE(stitching_fixture, (stitching_allocator<sim_provider, sim_reserver>), sim_provider{device},
              sim_reserver{device});
GLAKE_FIXTURE(stitching_gmlake_fixture,
              (stitching_allocator<sim_provider, sim_reserver, largest_first_stitching,
                                   largest_first_eviction, mutex_lock>),
              sim_provider{device}, sim_reserver{device});
// PyTorch's layout: small requests in 2 MiB segments, large ones in 20 MiB or own-size segments.
caching_rules pytorch_large_rules() {
  caching_rules rules;
  rules.min_segment = 20 * MiB;
  rules.segment_threshold = 10 * MiB;
  rules.min_split_remainder = MiB + 512;
  return rules;
}
using pytorch_like = segregator<caching_allocator<sim_source>, caching_allocator<sim_source>>;
GLAKE_FIXTURE(segregator_fixture, (pytorch_like), MiB,
              std::tuple{sim_source{sim_provider{device}, sim_reserver{device}}},
              std::tuple{sim_source{sim_provider{device}, sim_reserver{device}}, pytorch_large_rules()});
// GMLake's layout: PyTorch's small pool beside a stitching pool with no small pool of its own.
config no_small_pool() {
  config cfg;
  cfg.small_limit = 0;
  return cfg;
}
using gmlake_like = segregator<caching_allocator<sim_source>,
                               stitching_allocator<sim_provider, sim_reserver, largest_first_stitching>, mutex_lock>;
GLAKE_FIXTURE(segregator_stitching_fixture, (gmlake_like), MiB,
              std::tuple{sim_source{sim_provider{device}, sim_reserver{device}}},
              std::tuple{sim_provider{device}, sim_reserver{device}, no_small_pool()});
// glake's plug-in composition: stitch any request, grow only the shortfall, segments that grow in place.
config growing_segments() {
  config cfg;
  cfg.frag_limit = 2 * MiB;
  cfg.grow_stitch = true;
  cfg.max_handle = 8 * MiB;
  cfg.segment_reserve = 256 * GiB;
  return cfg;
}
GLAKE_FIXTURE(stitching_growing_fixture, (stitching_allocator<sim_provider, sim_reserver>), sim_provider{device},
              sim_reserver{device}, growing_segments());
GLAKE_FIXTURE(stitching_never_fixture, (stitching_allocator<sim_provider, sim_reserver, no_stitching>),
              sim_provider{device}, sim_reserver{device});

bool same_accounting(const statistics& a, const statistics& b) {
  return a.active_bytes == b.active_bytes && a.allocated_bytes == b.allocated_bytes &&
         a.reserved_bytes == b.reserved_bytes && a.allocations == b.allocations &&
         a.deallocations == b.deallocations;
}

// What live_report was told, by every part of the allocator destroyed.
struct live_reports {
  static inline std::vector<std::string> allocators;
  static inline std::uint64_t allocations = 0, bytes = 0;
  static void record(const char* allocator, std::uint64_t n, std::uint64_t b) noexcept {
    allocators.emplace_back(allocator);
    allocations += n;
    bytes += b;
  }
  live_reports() { allocators.clear(), allocations = 0, bytes = 0; }
};

}  // namespace

#define GLAKE_ALLOCATOR_FIXTURES                                                                  \
  caching_fixture, caching_mutex_largest_first_fixture, stitching_fixture, stitching_gmlake_fixture, \
      stitching_growing_fixture, stitching_never_fixture, segregator_fixture, segregator_stitching_fixture

TEST_CASE_TEMPLATE("allocator conformance: live allocations are distinct, aligned and accounted", F,
                   GLAKE_ALLOCATOR_FIXTURES) {
  F f;
  const std::size_t sizes[] = {1, 511, 512, 513, 4000, 1 << 20, (1 << 20) + 1, 3 << 20, 100 << 20, 1 << 30};
  std::vector<std::pair<void*, std::size_t>> live;
  std::size_t active = 0;
  for (std::size_t bytes : sizes) {
    void* p = f.allocator.allocate(bytes);
    REQUIRE(p != nullptr);
    CHECK(reinterpret_cast<std::uintptr_t>(p) % f.allocator.alignment() == 0);
    for (auto [q, n] : live) {
      const auto a = reinterpret_cast<std::uintptr_t>(p), b = reinterpret_cast<std::uintptr_t>(q);
      CHECK((a + bytes <= b || b + n <= a));  // no overlap in address space
    }
    live.emplace_back(p, bytes);
    active += bytes;
    CHECK(f.allocator.stats().active_bytes == active);
    f.allocator.verify();
  }
  const statistics s = f.allocator.stats();
  CHECK(s.allocations == std::size(sizes));
  CHECK(s.peak_active_bytes == active);
  CHECK(s.allocated_bytes >= active);
  CHECK(s.reserved_bytes >= s.allocated_bytes);
  CHECK(s.reserved_bytes == f.device.physical_bytes());
  for (auto [p, n] : live) f.allocator.deallocate(p, n);
  f.allocator.verify();
  CHECK(f.allocator.stats().active_bytes == 0);
  CHECK(f.allocator.stats().peak_active_bytes == active);
  CHECK(f.allocator.stats().deallocations == std::size(sizes));
}

TEST_CASE_TEMPLATE("allocator conformance: a freed block is reused without new memory", F,
                   GLAKE_ALLOCATOR_FIXTURES) {
  F f;
  for (std::size_t bytes : {std::size_t{700}, std::size_t{5} << 20, std::size_t{300} << 20}) {
    void* p = f.allocator.allocate(bytes);
    f.allocator.deallocate(p, bytes);
    const statistics before = f.allocator.stats();
    void* q = f.allocator.allocate(bytes);
    CHECK(q == p);
    CHECK(f.allocator.stats().driver_calls == before.driver_calls);
    CHECK(f.allocator.stats().reserved_bytes == before.reserved_bytes);
    f.allocator.deallocate(q, bytes);
  }
}

TEST_CASE_TEMPLATE("allocator conformance: driver time is reported for exactly the kinds of call made", F,
                   GLAKE_ALLOCATOR_FIXTURES) {
  F f;
  const auto check_kinds = [](const statistics& s) {
    for (std::size_t k = 0; k < driver_call_kinds; ++k) {
      CAPTURE(to_string(static_cast<driver_call>(k)));
      CHECK((s.driver_time.ns[k] > 0) == (s.driver_calls.counts[k] > 0));
    }
  };
  CHECK(f.allocator.stats().driver_time.total() == 0);
  void* p = f.allocator.allocate(300 * MiB);  // new memory: create, reserve, map, set access
  const statistics grown = f.allocator.stats();
  CHECK(grown.driver_calls[driver_call::create] > 0);
  check_kinds(grown);
  f.allocator.deallocate(p, 300 * MiB);
  void* q = f.allocator.allocate(300 * MiB);  // reused: no call, no time
  CHECK(f.allocator.stats().driver_time.ns == grown.driver_time.ns);
  f.allocator.deallocate(q, 300 * MiB);
  f.allocator.release_cached();  // unmap, free the range, release
  const statistics released = f.allocator.stats();
  CHECK(released.driver_calls[driver_call::release] > 0);
  check_kinds(released);
}

TEST_CASE_TEMPLATE("allocator conformance: zero-size requests give null, and null frees nothing", F,
                   GLAKE_ALLOCATOR_FIXTURES) {
  F f;
  CHECK(f.allocator.allocate(0) == nullptr);
  CHECK(f.allocator.try_allocate(0) == nullptr);
  f.allocator.deallocate(nullptr, 0);
  f.allocator.deallocate(nullptr, 64);
  const statistics s = f.allocator.stats();
  CHECK(s.allocations == 0);
  CHECK(s.reserved_bytes == 0);
  CHECK(s.driver_calls.total() == 0);
}

TEST_CASE_TEMPLATE("allocator conformance: out of memory throws a bad_alloc that says what, and the allocator stays usable",
                   F, GLAKE_ALLOCATOR_FIXTURES) {
  F f;
  void* held = f.allocator.allocate(1 << 30);
  const statistics before = f.allocator.stats();
  try {
    (void)f.allocator.allocate(std::size_t{8} << 30);
    FAIL("allocate of 8 GiB on a 4 GiB device returned");
  } catch (const std::bad_alloc& e) {
    const auto* oom = dynamic_cast<const out_of_memory*>(&e);
    REQUIRE(oom != nullptr);
    CHECK(oom->requested_bytes() == std::size_t{8} << 30);
    CHECK(oom->active_bytes() == std::size_t{1} << 30);
    const std::string message = e.what();
    CHECK(message.find("8.00 GiB") != std::string::npos);
    CHECK(message.find("reserved") != std::string::npos);
  }
  CHECK(f.allocator.try_allocate(std::size_t{8} << 30) == nullptr);
  CHECK(f.allocator.try_allocate(~std::size_t{0}) == nullptr);  // rounding would overflow
  f.allocator.verify();
  const statistics after = f.allocator.stats();
  CHECK(same_accounting(before, after));
  CHECK(after.failed_allocations == before.failed_allocations + 3);
  CHECK(f.device.violations() == 0);
  // Usable afterwards: what fits still fits.
  void* p = f.allocator.allocate(2 * GiB);
  CHECK(p != nullptr);
  f.allocator.deallocate(p, 2 * GiB);
  f.allocator.deallocate(held, 1 << 30);
  f.allocator.verify();
}

// Sizes no backend can hold, up to SIZE_MAX (where rounding would wrap to a small size). Each is
// refused before any work proportional to it: the timeout only keeps a regression from hanging
// the suite (one such request used to plan a handle per chunk: seconds and gigabytes).
inline constexpr std::size_t hopeless_sizes[] = {
    std::size_t{1} << 40, std::size_t{1} << 50, std::size_t{1} << 62, (std::size_t{1} << 63) + 1,
    ~std::size_t{0} - (std::size_t{1} << 20), ~std::size_t{0} - 1, ~std::size_t{0}};

TEST_CASE_TEMPLATE("allocator conformance: any size up to SIZE_MAX fails at once, counted, keeping the cache" *
                       doctest::timeout(30),
                   F, GLAKE_ALLOCATOR_FIXTURES) {
  F f;
  void* held = f.allocator.allocate(64 << 20);
  void* cached = f.allocator.allocate(256 << 20);
  f.allocator.deallocate(cached, 256 << 20);  // free, cached: a hopeless request must not drop it
  const statistics before = f.allocator.stats();
  std::uint64_t failed = before.failed_allocations;
  for (std::size_t bytes : hopeless_sizes) {
    CAPTURE(bytes);
    CHECK(f.allocator.try_allocate(bytes) == nullptr);
    CHECK(f.allocator.stats().failed_allocations == ++failed);
    CHECK_THROWS_AS((void)f.allocator.allocate(bytes), out_of_memory);
    CHECK(f.allocator.stats().failed_allocations == ++failed);
  }
  const statistics after = f.allocator.stats();
  CHECK(same_accounting(before, after));
  CHECK(after.driver_calls == before.driver_calls);  // not one handle created for them
  CHECK(f.device.violations() == 0);
  f.allocator.verify();
  void* again = f.allocator.allocate(256 << 20);
  CHECK(again == cached);
  f.allocator.deallocate(again, 256 << 20);
  f.allocator.deallocate(held, 64 << 20);
}

TEST_CASE_TEMPLATE("allocator conformance: misuse is caught with a message naming which, and changes nothing",
                   F, GLAKE_ALLOCATOR_FIXTURES) {
  F f;
  void* small = f.allocator.allocate(1000);
  void* large = f.allocator.allocate(64 << 20);
  int local = 0;
  const statistics before = f.allocator.stats();
  const auto expect = [&](auto&& call, usage_error::kind kind, const char* word) {
    try {
      call();
      FAIL("misuse was not caught");
    } catch (const usage_error& e) {
      CHECK(e.which() == kind);
      CHECK(std::string(e.what()).find(word) != std::string::npos);
    }
    f.allocator.verify();
    CHECK(same_accounting(f.allocator.stats(), before));
  };
  SUBCASE("foreign pointers") {
    expect([&] { f.allocator.deallocate(&local, sizeof local); }, usage_error::kind::foreign_pointer,
           "did not return");
    expect([&] { f.allocator.deallocate(static_cast<char*>(large) + 4096, 1000); },
           usage_error::kind::foreign_pointer, "did not return");
  }
  SUBCASE("size mismatches") {
    expect([&] { f.allocator.deallocate(small, 999); }, usage_error::kind::size_mismatch, "size");
    expect([&] { f.allocator.deallocate(large, 63 << 20); }, usage_error::kind::size_mismatch, "size");
    expect([&] { f.allocator.deallocate(small, 64 << 20); }, usage_error::kind::size_mismatch, "size");
    expect([&] { f.allocator.deallocate(large, 1000); }, usage_error::kind::size_mismatch, "size");
    // Zero is a size like any other: the pointer is live, so the size is the mistake.
    expect([&] { f.allocator.deallocate(small, 0); }, usage_error::kind::size_mismatch, "with size 0");
    expect([&] { f.allocator.deallocate(large, 0); }, usage_error::kind::size_mismatch, "with size 0");
  }
  SUBCASE("double frees") {
    void* extra = f.allocator.allocate(2000);
    f.allocator.deallocate(extra, 2000);
    const statistics after_free = f.allocator.stats();
    try {
      f.allocator.deallocate(extra, 2000);
      FAIL("double free was not caught");
    } catch (const usage_error& e) {
      CHECK(e.which() == usage_error::kind::double_free);
      CHECK(std::string(e.what()).find("double free") != std::string::npos);
    }
    CHECK(same_accounting(f.allocator.stats(), after_free));
    f.allocator.verify();
  }
  f.allocator.deallocate(small, 1000);
  f.allocator.deallocate(large, 64 << 20);
  f.allocator.verify();
}

TEST_CASE_TEMPLATE("allocator conformance: destroying an allocator with nothing live reports nothing", F,
                   GLAKE_ALLOCATOR_FIXTURES) {
  F f;
  live_reports reports;
  f.allocator.set_live_report(&live_reports::record);
  for (std::size_t bytes : {std::size_t{1000}, std::size_t{20} << 20, std::size_t{600} << 20}) {
    f.allocator.deallocate(f.allocator.allocate(bytes), bytes);  // freed, but still cached
  }
  f.holder.reset();
  CHECK(reports.allocators.empty());
  CHECK(f.device.physical_bytes() == 0);
}

TEST_CASE_TEMPLATE("allocator conformance: a stream reuses its own free blocks first", F, GLAKE_ALLOCATOR_FIXTURES) {
  F f;
  const stream_ref a{1}, b{2};
  void* p = f.allocator.allocate(8 << 20, a);
  void* p2 = f.allocator.allocate(8 << 20, b);
  f.allocator.deallocate(p, 8 << 20, a);
  f.allocator.deallocate(p2, 8 << 20, b);
  void* q = f.allocator.allocate(8 << 20, b);
  CHECK(q == p2);  // its own, though a's is free too
  void* r = f.allocator.allocate(8 << 20, a);
  CHECK(r == p);  // reused on its own stream at once
  f.allocator.deallocate(q, 8 << 20, b);
  f.allocator.deallocate(r, 8 << 20, a);
  f.allocator.verify();
}

TEST_CASE_TEMPLATE("allocator conformance: release_cached gives every free byte back", F,
                   GLAKE_ALLOCATOR_FIXTURES) {
  F f;
  std::vector<std::pair<void*, std::size_t>> live;
  for (std::size_t bytes : {std::size_t{100}, std::size_t{3} << 20, std::size_t{40} << 20, std::size_t{600} << 20}) {
    live.emplace_back(f.allocator.allocate(bytes), bytes);
  }
  void* kept = f.allocator.allocate(50 << 20);
  for (auto [p, n] : live) f.allocator.deallocate(p, n);
  f.allocator.release_cached();
  f.allocator.verify();
  const statistics s = f.allocator.stats();
  CHECK(s.reserved_bytes >= std::size_t{50} << 20);
  CHECK(s.reserved_bytes < std::size_t{60} << 20);  // only what the live block needs remains
  CHECK(s.reserved_bytes == f.device.physical_bytes());
  f.allocator.deallocate(kept, 50 << 20);
  f.allocator.release_cached();
  CHECK(f.allocator.stats().reserved_bytes == 0);
  CHECK(f.device.physical_bytes() == 0);
  CHECK(f.device.live_mappings() == 0);
  CHECK(f.device.reserved_bytes() == 0);
  CHECK(f.device.violations() == 0);
}

TEST_CASE_TEMPLATE("allocator conformance: destruction returns everything to the backend", F,
                   GLAKE_ALLOCATOR_FIXTURES) {
  F f;
  live_reports reports;
  CHECK(GLAKE_CHECKED == (detail::default_live_report == &print_live_report));  // stderr when checked
  f.allocator.set_live_report(&live_reports::record);
  void* p = f.allocator.allocate(10 << 20);
  (void)f.allocator.allocate(1000);      // leaked on purpose: destruction must still clean up
  (void)f.allocator.allocate(20 << 20);  // likewise
  f.allocator.deallocate(p, 10 << 20);
  CHECK(f.device.physical_bytes() > 0);
  f.holder.reset();
  // ... and say so: two allocations of 1000 B and 20 MiB, told once (a segregator's parts each
  // tell their own; the stitching allocator's small pool is counted by the allocator).
  CHECK(reports.allocations == 2);
  CHECK(reports.bytes == 1000 + (20 << 20));
  CHECK(reports.allocators.size() == (std::is_same_v<F, segregator_fixture> || std::is_same_v<F, segregator_stitching_fixture> ? 2 : 1));
  CHECK(f.device.physical_bytes() == 0);
  CHECK(f.device.live_handles() == 0);
  CHECK(f.device.live_mappings() == 0);
  CHECK(f.device.reserved_bytes() == 0);
  CHECK(f.device.violations() == 0);
}
