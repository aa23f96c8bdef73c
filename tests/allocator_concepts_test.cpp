// The allocator concept and its refinements (allocators/concepts.hpp): which model has which
// capability, that every capability a model has does what its table says, and that wrappers
// forward each one to the right part.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "glake/allocators/caching_allocator.hpp"
#include "glake/allocators/concepts.hpp"
#include "glake/allocators/segment_source.hpp"
#include "glake/allocators/segregator.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/sim.hpp"
#include "glake/errors.hpp"
#include "support/evented_reserver.hpp"

namespace {

using namespace glake;
using testing::event_log;
using testing::evented_reserver;

using sim_source = vmm_segment_source<sim_provider, sim_reserver>;
using sim_expandable = expandable_segment_source<sim_provider, sim_reserver>;
using sim_stitching = stitching_allocator<sim_provider, sim_reserver>;
using evented_stitching = stitching_allocator<sim_provider, evented_reserver>;

// The smallest model, as in the comment at the top of allocators/concepts.hpp.
class malloc_allocator {
 public:
  void* allocate(std::size_t n, stream_ref s) {
    if (void* p = try_allocate(n, s); p != nullptr || n == 0) return p;
    throw out_of_memory(n, 0, stats_.active_bytes, "malloc_allocator: out of memory");
  }
  void* try_allocate(std::size_t n, stream_ref) {
    void* p = n == 0 ? nullptr : std::malloc(n);
    if (p != nullptr) stats_.active_bytes += n;
    return p;
  }
  void deallocate(void* p, std::size_t n, stream_ref) {
    if (p != nullptr) stats_.active_bytes -= n;
    std::free(p);
  }
  statistics stats() const { return stats_; }
  std::size_t reserved_bytes() const { return 0; }
  std::size_t alignment() const noexcept { return alignof(std::max_align_t); }
  void verify() const {}

 private:
  statistics stats_;
};

// Near misses of the required set: each lacks one thing, so none is an allocator.
struct no_try_allocate {
  void* allocate(std::size_t, stream_ref);
  void deallocate(void*, std::size_t, stream_ref);
  statistics stats() const;
  std::size_t reserved_bytes() const;
  std::size_t alignment() const noexcept;
  void verify() const;
};
struct alignment_may_throw {
  void* allocate(std::size_t, stream_ref);
  void* try_allocate(std::size_t, stream_ref);
  void deallocate(void*, std::size_t, stream_ref);
  statistics stats() const;
  std::size_t reserved_bytes() const;
  std::size_t alignment() const;
  void verify() const;
};
struct verify_not_const {
  void* allocate(std::size_t, stream_ref);
  void* try_allocate(std::size_t, stream_ref);
  void deallocate(void*, std::size_t, stream_ref);
  statistics stats() const;
  std::size_t reserved_bytes() const;
  std::size_t alignment() const noexcept;
  void verify();
};

// Records streams but cannot tell whether it owns a pointer: a segregator of two of these has
// no way to route record_stream, so it must not offer it.
struct records_without_owns : malloc_allocator {
  void record_stream(void*, stream_ref);
};

struct capabilities {
  bool owning = false;
  bool cache_releasing = false;
  bool peak_resetting = false;
  bool stream_recording = false;
};
constexpr capabilities none{};
constexpr capabilities caching_like{true, true, true, false};
constexpr capabilities every{true, true, true, true};

// --- the compositions: each owns its simulated device and is built in place -----------------

caching_rules large_pool_rules() {
  caching_rules rules;
  rules.min_segment = 20 * MiB;
  rules.segment_threshold = 10 * MiB;
  rules.min_split_remainder = MiB + 512;
  return rules;
}
config no_small_pool() {
  config cfg;
  cfg.small_limit = 0;
  return cfg;
}

struct caching_model {
  using type = caching_allocator<sim_source>;
  static constexpr capabilities expected = caching_like;
  sim_device device{4 * GiB};
  type allocator{sim_source{sim_provider{device}, sim_reserver{device}}};
};
struct caching_mutex_largest_first_model {
  using type = caching_allocator<sim_source, mutex_lock, largest_first_eviction>;
  static constexpr capabilities expected = caching_like;
  sim_device device{4 * GiB};
  type allocator{sim_source{sim_provider{device}, sim_reserver{device}}};
};
struct caching_expandable_model {
  using type = caching_allocator<sim_expandable>;
  static constexpr capabilities expected = caching_like;
  sim_device device{4 * GiB};
  type allocator{sim_expandable{sim_provider{device}, sim_reserver{device}, 2 * MiB, GiB}};
};
struct stitching_model {
  using type = sim_stitching;
  static constexpr capabilities expected = every;
  sim_device device{4 * GiB};
  type allocator{sim_provider{device}, sim_reserver{device}};
};
struct stitching_gmlake_model {
  using type = stitching_allocator<sim_provider, sim_reserver, largest_first_stitching, largest_first_eviction,
                                   mutex_lock>;
  static constexpr capabilities expected = every;
  sim_device device{4 * GiB};
  type allocator{sim_provider{device}, sim_reserver{device}};
};
struct stitching_evented_model {
  using type = evented_stitching;
  static constexpr capabilities expected = every;
  sim_device device{4 * GiB};
  event_log log;
  type allocator{sim_provider{device}, evented_reserver{device, log}};
};
struct segregator_pytorch_model {
  using type = segregator<caching_allocator<sim_source>, caching_allocator<sim_source>>;
  static constexpr capabilities expected = caching_like;
  sim_device device{4 * GiB};
  type allocator{MiB, std::tuple{sim_source{sim_provider{device}, sim_reserver{device}}},
                 std::tuple{sim_source{sim_provider{device}, sim_reserver{device}}, large_pool_rules()}};
};
// GMLake's layout. The caching small pool records no streams, so neither does the whole.
struct segregator_gmlake_model {
  using type = segregator<caching_allocator<sim_source>, sim_stitching, mutex_lock>;
  static constexpr capabilities expected = caching_like;
  sim_device device{4 * GiB};
  type allocator{MiB, std::tuple{sim_source{sim_provider{device}, sim_reserver{device}}},
                 std::tuple{sim_provider{device}, sim_reserver{device}, no_small_pool()}};
};
struct segregator_stitching_model {
  using type = segregator<evented_stitching, evented_stitching, mutex_lock>;
  static constexpr capabilities expected = every;
  sim_device device{4 * GiB};
  event_log log;
  type allocator{MiB, std::tuple{sim_provider{device}, evented_reserver{device, log}},
                 std::tuple{sim_provider{device}, evented_reserver{device, log}, no_small_pool()}};
};
// A segregator inside a segregator: PyTorch's two pools for up to 32 MiB, stitching above.
struct segregator_nested_model {
  using type = segregator<segregator_pytorch_model::type, sim_stitching>;
  static constexpr capabilities expected = caching_like;
  sim_device device{4 * GiB};
  type allocator{32 * MiB,
                 std::tuple{MiB, std::tuple{sim_source{sim_provider{device}, sim_reserver{device}}},
                            std::tuple{sim_source{sim_provider{device}, sim_reserver{device}}, large_pool_rules()}},
                 std::tuple{sim_provider{device}, sim_reserver{device}, no_small_pool()}};
};

// Types checked only at compile time.
struct malloc_model {
  using type = malloc_allocator;
  static constexpr capabilities expected = none;
};
struct records_without_owns_model {
  using type = records_without_owns;
  static constexpr capabilities expected{false, false, false, true};
};
struct segregator_records_without_owns_model {
  using type = segregator<records_without_owns, records_without_owns>;
  static constexpr capabilities expected = none;
};
struct segregator_one_part_minimal_model {
  using type = segregator<malloc_allocator, sim_stitching>;
  static constexpr capabilities expected = none;
};

}  // namespace

#define GLAKE_BUILT_MODELS                                                                         \
  caching_model, caching_mutex_largest_first_model, caching_expandable_model, stitching_model,    \
      stitching_gmlake_model, stitching_evented_model, segregator_pytorch_model,                  \
      segregator_gmlake_model, segregator_stitching_model, segregator_nested_model

TEST_CASE("allocator concepts: the smallest model is an allocator with no refinement, and it works") {
  CHECK(allocator<malloc_allocator>);
  CHECK_FALSE(owning_allocator<malloc_allocator>);
  CHECK_FALSE(cache_releasing_allocator<malloc_allocator>);
  CHECK_FALSE(peak_resetting_allocator<malloc_allocator>);
  CHECK_FALSE(stream_recording_allocator<malloc_allocator>);

  malloc_allocator a;
  void* p = a.allocate(100, default_stream);
  REQUIRE(p != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(p) % a.alignment() == 0);
  CHECK(a.stats().active_bytes == 100);
  CHECK(a.allocate(0, default_stream) == nullptr);
  a.deallocate(p, 100, default_stream);
  CHECK(a.stats().active_bytes == 0);
  a.verify();
}

TEST_CASE("allocator concepts: a type lacking any required member is not an allocator") {
  CHECK_FALSE(allocator<no_try_allocate>);
  CHECK_FALSE(allocator<alignment_may_throw>);
  CHECK_FALSE(allocator<verify_not_const>);
  CHECK_FALSE(allocator<int>);
  // A refinement implies the base concept: record_stream alone makes no allocator.
  struct only_record_stream {
    void record_stream(void*, stream_ref) {}
  };
  CHECK_FALSE(stream_recording_allocator<only_record_stream>);
}

TEST_CASE_TEMPLATE("allocator concepts: each model has exactly the capabilities it should", M, GLAKE_BUILT_MODELS,
                   malloc_model, records_without_owns_model, segregator_records_without_owns_model,
                   segregator_one_part_minimal_model) {
  using A = typename M::type;
  CHECK(allocator<A>);
  CHECK(owning_allocator<A> == M::expected.owning);
  CHECK(cache_releasing_allocator<A> == M::expected.cache_releasing);
  CHECK(peak_resetting_allocator<A> == M::expected.peak_resetting);
  CHECK(stream_recording_allocator<A> == M::expected.stream_recording);
}

TEST_CASE_TEMPLATE("allocator concepts: every capability a model has does what its table says", M,
                   GLAKE_BUILT_MODELS) {
  using A = typename M::type;
  M m;
  A& a = m.allocator;
  const stream_ref s{1}, other{2};
  int local = 0;

  void* small = a.allocate(1000, s);
  void* large = a.allocate(64 * MiB, s);
  REQUIRE(small != nullptr);
  REQUIRE(large != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(small) % a.alignment() == 0);
  CHECK(reinterpret_cast<std::uintptr_t>(large) % a.alignment() == 0);
  CHECK(a.try_allocate(64 * GiB, s) == nullptr);
  CHECK_THROWS_AS((void)a.allocate(64 * GiB, s), out_of_memory);
  CHECK(a.reserved_bytes() == a.stats().reserved_bytes);
  CHECK(a.reserved_bytes() == m.device.physical_bytes());
  a.verify();

  if constexpr (owning_allocator<A>) {
    CHECK(a.owns(small));
    CHECK(a.owns(large));
    CHECK_FALSE(a.owns(&local));
    CHECK_FALSE(a.owns(static_cast<char*>(large) + 4096));  // inside, but not an allocation's start
  }
  a.deallocate(large, 64 * MiB, s);
  if constexpr (owning_allocator<A>) CHECK_FALSE(a.owns(large));

  if constexpr (peak_resetting_allocator<A>) {
    const statistics before = a.stats();
    REQUIRE(before.peak_active_bytes == 64 * MiB + 1000);
    REQUIRE(before.active_bytes == 1000);
    const statistics returned = a.reset_peaks();
    CHECK(returned.peak_active_bytes == before.peak_active_bytes);
    CHECK(returned.peak_reserved_bytes == before.peak_reserved_bytes);
    CHECK(returned.reserved_bytes == before.reserved_bytes);
    const statistics after = a.stats();
    CHECK(after.peak_active_bytes == 1000);
    CHECK(after.peak_allocated_bytes == after.allocated_bytes);
    CHECK(after.peak_reserved_bytes == after.reserved_bytes);
    CHECK(after.allocations == before.allocations);  // only peaks change
  }

  if constexpr (stream_recording_allocator<A>) {
    void* used = a.allocate(8 * MiB, s);
    a.record_stream(used, other);
    try {
      a.record_stream(&local, other);
      FAIL("record_stream of a pointer not live here was accepted");
    } catch (const usage_error& e) {
      CHECK(e.which() == usage_error::kind::foreign_pointer);
      const std::string message = e.what();
      CAPTURE(message);
      CHECK(message.find("record_stream of") != std::string::npos);  // the call made, not another
      CHECK(message.find("deallocate") == std::string::npos);
    }
    a.deallocate(used, 8 * MiB, s);
  }

  a.deallocate(small, 1000, s);
  if constexpr (cache_releasing_allocator<A>) {
    CHECK(a.reserved_bytes() > 0);
    a.release_cached();
    CHECK(a.reserved_bytes() == 0);
    CHECK(m.device.physical_bytes() == 0);
  }
  a.verify();
  CHECK(m.device.violations() == 0);
}

// --- segregator: each capability reaches the part it belongs to ------------------------------

namespace {

// A working allocator (over malloc) with every capability, that records what reached it.
class spy_allocator {
 public:
  explicit spy_allocator(std::uint64_t tag) : tag_(tag) {}
  spy_allocator(const spy_allocator&) = delete;
  spy_allocator& operator=(const spy_allocator&) = delete;
  ~spy_allocator() {
    for (const void* p : live_) std::free(const_cast<void*>(p));
  }

  void* allocate(std::size_t n, stream_ref s) {
    if (void* p = try_allocate(n, s)) return p;
    throw out_of_memory(n, 0, stats_.active_bytes, "spy_allocator: out of memory");
  }
  void* try_allocate(std::size_t n, stream_ref) {
    void* p = std::malloc(n);
    if (p == nullptr) return nullptr;
    live_.insert(p);
    stats_.active_bytes += n;
    stats_.peak_active_bytes = std::max(stats_.peak_active_bytes, stats_.active_bytes);
    stats_.reserved_bytes += n;
    stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
    ++stats_.allocations;
    return p;
  }
  void deallocate(void* p, std::size_t n, stream_ref) {
    if (live_.erase(p) == 0) {
      throw usage_error(usage_error::kind::foreign_pointer, "spy_allocator: not live here");
    }
    std::free(p);
    stats_.active_bytes -= n;
    cached_ += n;
    ++stats_.deallocations;
  }
  statistics stats() const {
    statistics s = stats_;
    s.events_recorded = tag_;  // tells the parts apart in a combined snapshot
    return s;
  }
  std::size_t reserved_bytes() const { return stats_.reserved_bytes; }
  std::size_t alignment() const noexcept { return alignof(std::max_align_t); }
  void verify() const {}

  bool owns(const void* p) const { return live_.count(p) != 0; }
  void release_cached() {
    ++releases;
    stats_.reserved_bytes -= cached_;
    cached_ = 0;
  }
  statistics reset_peaks() {
    ++peak_resets;
    const statistics before = stats();
    stats_.peak_active_bytes = stats_.active_bytes;
    stats_.peak_reserved_bytes = stats_.reserved_bytes;
    return before;
  }
  void record_stream(void* p, stream_ref s) {
    if (!owns(p)) throw usage_error(usage_error::kind::foreign_pointer, "spy_allocator: record_stream of a stranger");
    recorded.emplace_back(p, s);
  }

  std::vector<std::pair<void*, stream_ref>> recorded;
  int releases = 0;
  int peak_resets = 0;

 private:
  std::uint64_t tag_;
  std::set<const void*> live_;
  statistics stats_;
  std::size_t cached_ = 0;
};
static_assert(owning_allocator<spy_allocator> && cache_releasing_allocator<spy_allocator> &&
              peak_resetting_allocator<spy_allocator> && stream_recording_allocator<spy_allocator>);

using spy_segregator = segregator<spy_allocator, spy_allocator>;

}  // namespace

TEST_CASE("segregator: record_stream, owns, release_cached and reset_peaks reach the right part") {
  spy_segregator seg(1024, std::tuple{std::uint64_t{1}}, std::tuple{std::uint64_t{100}});
  const stream_ref s{1}, other{2};
  int local = 0;
  void* small = seg.allocate(100, s);
  void* large = seg.allocate(4096, s);

  SUBCASE("record_stream goes to the part that owns the pointer") {
    seg.record_stream(small, other);
    REQUIRE(seg.small().recorded.size() == 1);
    CHECK(seg.small().recorded[0].first == small);
    CHECK(seg.small().recorded[0].second == other);
    CHECK(seg.large().recorded.empty());
    seg.record_stream(large, stream_ref{3});
    CHECK(seg.small().recorded.size() == 1);
    REQUIRE(seg.large().recorded.size() == 1);
    CHECK(seg.large().recorded[0].first == large);
    CHECK(seg.large().recorded[0].second == stream_ref{3});
    CHECK_THROWS_AS(seg.record_stream(&local, other), usage_error);  // neither owns it
    CHECK(seg.small().recorded.size() + seg.large().recorded.size() == 2);
  }
  SUBCASE("owns asks both parts") {
    CHECK(seg.owns(small));
    CHECK(seg.owns(large));
    CHECK_FALSE(seg.owns(&local));
    seg.deallocate(small, 100, s);
    CHECK_FALSE(seg.owns(small));
    CHECK(seg.owns(large));
    small = seg.allocate(100, s);
  }
  SUBCASE("release_cached goes to both parts") {
    seg.deallocate(large, 4096, s);
    CHECK(seg.stats().reserved_bytes == 100 + 4096);
    seg.release_cached();
    CHECK(seg.small().releases == 1);
    CHECK(seg.large().releases == 1);
    CHECK(seg.stats().reserved_bytes == 100);
    large = seg.allocate(4096, s);
  }
  SUBCASE("reset_peaks resets both parts and its own, returning the combined statistics before") {
    seg.deallocate(large, 4096, s);
    const statistics before = seg.stats();
    CHECK(before.events_recorded == 101);  // both parts' counts, added
    CHECK(before.peak_active_bytes == 100 + 4096);
    const statistics returned = seg.reset_peaks();
    CHECK(seg.small().peak_resets == 1);
    CHECK(seg.large().peak_resets == 1);
    CHECK(returned.events_recorded == before.events_recorded);
    CHECK(returned.peak_active_bytes == before.peak_active_bytes);
    CHECK(returned.reserved_bytes == before.reserved_bytes);
    CHECK(returned.allocations == before.allocations);
    const statistics after = seg.stats();
    CHECK(after.peak_active_bytes == 100);
    CHECK(seg.large().stats().peak_active_bytes == 0);
    large = seg.allocate(4096, s);
  }
  seg.deallocate(small, 100, s);
  seg.deallocate(large, 4096, s);
  CHECK(seg.stats().active_bytes == 0);
}

TEST_CASE("segregator: record_stream on stitching parts with events defers the free in the part that owns it") {
  segregator_stitching_model m;
  auto& seg = m.allocator;
  const stream_ref a{1}, b{2};
  void* small = seg.allocate(1000, a);
  void* large = seg.allocate(8 * MiB, a);
  seg.record_stream(small, b);
  seg.record_stream(large, b);
  seg.deallocate(small, 1000, a);
  seg.deallocate(large, 8 * MiB, a);
  // Both frees wait for b's work: an event on b each, and the memory still counted in use.
  CHECK(m.log.events.size() == 2);
  CHECK(seg.small().stats().active_bytes == 1000);
  CHECK(seg.large().stats().active_bytes == 8 * MiB);
  void* other_large = seg.allocate(8 * MiB, a);
  CHECK(other_large != large);  // not reused while b may still use it

  m.log.complete(b);
  // The deferred frees run at each part's next call, without waiting for anything.
  void* large_again = seg.allocate(8 * MiB, a);
  void* small_again = seg.allocate(1000, a);
  CHECK(large_again == large);
  CHECK(small_again == small);
  CHECK(m.log.waited == 0);
  seg.deallocate(small_again, 1000, a);
  seg.deallocate(large_again, 8 * MiB, a);
  seg.deallocate(other_large, 8 * MiB, a);
  CHECK(seg.small().stats().active_bytes == 0);
  CHECK(seg.large().stats().active_bytes == 0);
  seg.verify();
}
