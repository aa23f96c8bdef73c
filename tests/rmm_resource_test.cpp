// glake under RMM without a GPU: a host-backend allocator declared device_accessible (its memory
// is host memory, which these tests read and write directly), wrapped as rmm_resource, set as RMM's
// current device resource, filling rmm::device_buffer and device_uvector, and stacked under RMM's
// statistics, tracking, limiting, aligned and failure-callback adaptors. Its own executable
// (glake_rmm_tests, built with GLAKE_WITH_RMM); the GPU side is tests/gpu/rmm_test.cpp.
//
// What runs without a GPU, found by trying: RMM's per-device map (rmm::get_current_cuda_device()
// checks cudaGetDevice only by an assertion, compiled out of the wheel's librmm, and answers -1,
// so the "current device" is id -1 here),
// device_buffer and device_uvector construction and destruction (the stream-ordered allocate and
// deallocate, nothing else), and the adaptors' stream-ordered members. What does not, and is not
// tested here: anything that copies or fills (device_uvector::element/set_element, resize, a
// device_buffer copy: cudaMemcpyAsync), the adaptors' `_sync` members (cudaStreamSynchronize),
// rmm::exec_policy and thrust.
#include <doctest/doctest.h>

#include <rmm/device_buffer.hpp>
#include <rmm/device_uvector.hpp>
#include <rmm/error.hpp>
#include <rmm/mr/aligned_resource_adaptor.hpp>
#include <rmm/mr/failure_callback_resource_adaptor.hpp>
#include <rmm/mr/limiting_resource_adaptor.hpp>
#include <rmm/mr/per_device_resource.hpp>
#include <rmm/mr/statistics_resource_adaptor.hpp>
#include <rmm/mr/tracking_resource_adaptor.hpp>
#include <rmm/resource_ref.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "glake/adaptors/rmm_resource.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/host.hpp"
#include "glake/policies/locking.hpp"
#include "support/rmm_scope.hpp"

using namespace glake;

namespace {

// mutex_lock: RMM's current device resource is shared by every thread (the threads test uses it).
using host_stitching =
    stitching_allocator<host_provider, host_reserver, best_fit_tail_stitching, lru_eviction, mutex_lock>;
using resource = rmm_resource<host_stitching, cuda::mr::device_accessible>;
using device_resource = cuda::mr::any_resource<cuda::mr::device_accessible>;

static_assert(cuda::mr::resource_with<resource, cuda::mr::device_accessible>);
static_assert(cuda::mr::synchronous_resource_with<resource, cuda::mr::device_accessible>);
static_assert(!cuda::has_property<resource, cuda::mr::host_accessible>);
static_assert(std::is_constructible_v<rmm::device_async_resource_ref, resource&>);
static_assert(std::is_constructible_v<device_resource, resource>);
static_assert(std::is_copy_constructible_v<resource> && std::is_copy_assignable_v<resource>);
static_assert(noexcept(std::declval<resource&>().deallocate(cuda::stream_ref{cudaStream_t{}}, nullptr, 0, 256)));
static_assert(std::is_base_of_v<cuda_mr_resource<host_stitching, cuda::mr::device_accessible>, resource>);

const cuda::stream_ref stream{cudaStream_t{}};

resource make_resource(std::size_t memory_limit = 0, std::size_t capacity = 1024 * MiB) {
  config cfg;
  cfg.memory_limit = memory_limit;
  return make_rmm_resource<host_stitching, cuda::mr::device_accessible>(host_provider(2 * MiB, capacity),
                                                                         host_reserver(2 * MiB), cfg);
}

using testing::current_device_resource;
using testing::spiller;

}  // namespace

TEST_CASE("rmm_resource: RMM's current device resource hands glake's memory to device_buffer and device_uvector") {
  resource r = make_resource();
  host_stitching& allocator = r.allocator();
  {
    current_device_resource scope(r);
    CHECK(rmm::mr::get_current_device_resource_ref() == rmm::device_async_resource_ref{r});

    rmm::device_buffer buffer(1000, stream);  // the current device resource by default
    REQUIRE(buffer.data() != nullptr);
    CHECK(buffer.size() == 1000);
    CHECK(allocator.owns(buffer.data()));
    std::memset(buffer.data(), 0x5a, buffer.size());  // host memory: really usable

    rmm::device_uvector<int> numbers(100'000, stream);
    REQUIRE(numbers.data() != nullptr);
    CHECK(allocator.owns(numbers.data()));
    CHECK(reinterpret_cast<std::uintptr_t>(numbers.data()) % 256 == 0);
    std::iota(numbers.data(), numbers.data() + numbers.size(), 0);
    CHECK(std::accumulate(numbers.data(), numbers.data() + numbers.size(), std::int64_t{0}) ==
          std::int64_t{100'000} * 99'999 / 2);

    statistics s = allocator.stats();
    CHECK(s.allocations == 2);
    CHECK(s.active_bytes == 1000 + 100'000 * sizeof(int));
    CHECK(s.reserved_bytes >= s.active_bytes);
    allocator.verify();
  }
  // The previous resource is back, and the containers gave everything back to glake.
  CHECK(rmm::mr::get_current_device_resource_ref() != rmm::device_async_resource_ref{r});
  statistics s = allocator.stats();
  CHECK(s.deallocations == 2);
  CHECK(s.active_bytes == 0);
  allocator.verify();

  // set_current_device_resource returns the resource it replaces: the same handle (shared allocator).
  device_resource previous = rmm::mr::set_current_device_resource(r);
  device_resource ours = rmm::mr::set_current_device_resource(std::move(previous));
  CHECK(ours == device_resource{r});
}

TEST_CASE("rmm_resource: RMM's statistics and tracking adaptors over glake count what glake counts") {
  resource r = make_resource();
  host_stitching& allocator = r.allocator();
  rmm::mr::statistics_resource_adaptor counted(r);
  rmm::mr::tracking_resource_adaptor tracked(counted);

  std::mt19937_64 random(42);
  std::uniform_int_distribution<std::size_t> size(1, 8 * MiB);
  std::vector<std::optional<rmm::device_buffer>> slots(64);
  std::size_t live = 0;
  for (int step = 0; step < 2000; ++step) {
    auto& slot = slots[random() % slots.size()];
    if (slot) {
      slot.reset();
      --live;
    } else {
      slot.emplace(size(random), stream, tracked);
      ++live;
      std::memset(slot->data(), step & 0xff, std::min<std::size_t>(slot->size(), 4096));
    }
    const statistics s = allocator.stats();
    REQUIRE(counted.get_bytes_counter().value == static_cast<std::int64_t>(s.active_bytes));
    REQUIRE(counted.get_allocations_counter().value == static_cast<std::int64_t>(s.allocations - s.deallocations));
    REQUIRE(tracked.get_allocated_bytes() == s.active_bytes);
    REQUIRE(tracked.get_outstanding_allocations().size() == live);
  }
  const statistics s = allocator.stats();
  CHECK(counted.get_bytes_counter().peak == static_cast<std::int64_t>(s.peak_active_bytes));
  CHECK(counted.get_allocations_counter().total == static_cast<std::int64_t>(s.allocations));
  CHECK(s.peak_reserved_bytes >= s.peak_active_bytes);
  allocator.verify();
  slots.clear();
  CHECK(allocator.stats().active_bytes == 0);
  CHECK(tracked.get_outstanding_allocations().empty());
}

TEST_CASE("rmm_resource: the limiting adaptor's out-of-memory reaches the failure callback, which frees and retries") {
  resource r = make_resource();
  rmm::mr::statistics_resource_adaptor counted(r);
  rmm::mr::limiting_resource_adaptor limited(counted, 64 * MiB);
  spiller spill;
  rmm::mr::failure_callback_resource_adaptor<> guarded(limited, &spiller::callback, &spill);

  for (int i = 0; i < 6; ++i) spill.spill.emplace_back(10 * MiB, stream, guarded);
  CHECK(limited.get_allocated_bytes() == 60 * MiB);

  // 60 + 16 MiB and 50 + 16 MiB exceed the limit; 40 + 16 fit: two calls, two buffers freed.
  rmm::device_buffer wanted(16 * MiB, stream, guarded);
  CHECK(spill.requested == std::vector<std::size_t>{16 * MiB, 16 * MiB});
  CHECK(spill.spill.size() == 4);
  CHECK(limited.get_allocated_bytes() == 56 * MiB);
  CHECK(counted.get_bytes_counter().value == static_cast<std::int64_t>(56 * MiB));
  CHECK(r.allocator().stats().active_bytes == 56 * MiB);
  CHECK(r.allocator().stats().failed_allocations == 0);  // glake itself was never asked for too much
}

TEST_CASE("rmm_resource: glake's own out-of-memory reaches the failure callback as rmm::out_of_memory") {
  resource r = make_resource(32 * MiB);  // glake's memory_limit, under the limiting adaptor's
  rmm::mr::statistics_resource_adaptor counted(r);
  rmm::mr::limiting_resource_adaptor limited(counted, 1024 * MiB);
  spiller spill;
  rmm::mr::failure_callback_resource_adaptor<> guarded(limited, &spiller::callback, &spill);

  for (int i = 0; i < 3; ++i) spill.spill.emplace_back(10 * MiB, stream, guarded);
  // 30 + 8 MiB exceed glake's 32 MiB: one call frees 10 MiB and the retry fits.
  rmm::device_buffer wanted(8 * MiB, stream, guarded);
  CHECK(spill.requested == std::vector<std::size_t>{8 * MiB});
  CHECK(spill.spill.size() == 2);
  CHECK(r.allocator().stats().failed_allocations == 1);
  CHECK(r.allocator().stats().active_bytes == 28 * MiB);
  CHECK(counted.get_bytes_counter().value == static_cast<std::int64_t>(28 * MiB));

  // Nothing left to free: the callback says so, and the caller gets rmm::out_of_memory with
  // glake's message, glake's own exception nested in it.
  spill.spill.clear();
  spill.requested.clear();
  try {
    rmm::device_buffer too_big(40 * MiB, stream, guarded);
    FAIL("40 MiB fit under a 32 MiB limit");
  } catch (const rmm::out_of_memory& e) {
    CHECK(std::string(e.what()).find("glake::stitching_allocator: out of memory allocating 40.00 MiB") !=
          std::string::npos);
    try {
      std::rethrow_if_nested(e);
      FAIL("no nested exception");
    } catch (const glake::out_of_memory& nested) {
      CHECK(nested.requested_bytes() == 40 * MiB);
      CHECK(nested.active_bytes() == 8 * MiB);
    }
  }
  CHECK(spill.requested == std::vector<std::size_t>{40 * MiB});
  CHECK(counted.get_bytes_counter().value == static_cast<std::int64_t>(8 * MiB));
  CHECK(limited.get_allocated_bytes() == 8 * MiB);  // the failed request was given back to the limit

  // Why rmm_resource exists: a plain cuda_mr_resource's glake::out_of_memory is no
  // rmm::out_of_memory, so the adaptor lets it through without calling back.
  cuda_mr_resource<host_stitching, cuda::mr::device_accessible> plain = r;
  spiller never;
  rmm::mr::failure_callback_resource_adaptor<> unguarded(plain, &spiller::callback, &never);
  CHECK_THROWS_AS(rmm::device_buffer(40 * MiB, stream, unguarded), glake::out_of_memory);
  CHECK(never.requested.empty());
}

TEST_CASE("rmm_resource: errors other than out-of-memory pass unchanged, and RMM's aligned adaptor serves larger alignments") {
  resource r = make_resource(16 * MiB);
  const std::size_t guaranteed = r.allocator().alignment();
  CHECK_THROWS_AS((void)r.allocate(stream, 1000, 2 * guaranteed), usage_error);
  CHECK_THROWS_AS((void)r.allocate_sync(1000, 3), usage_error);
  // The synchronous member converts out-of-memory too (the host backend has no stream to wait for).
  CHECK_THROWS_AS((void)r.allocate_sync(64 * MiB), rmm::out_of_memory);
  CHECK(r.allocator().stats().allocations == 0);

  rmm::mr::aligned_resource_adaptor aligned(r, 64 * KiB, 0);  // every size aligned to 64 KiB
  std::vector<std::pair<void*, std::size_t>> blocks;
  for (std::size_t bytes : {std::size_t{1}, std::size_t{1000}, 100 * KiB, 3 * MiB + 5}) {
    void* p = aligned.allocate(stream, bytes, 64 * KiB);
    REQUIRE(p != nullptr);
    CHECK(reinterpret_cast<std::uintptr_t>(p) % (64 * KiB) == 0);
    CHECK(r.allocator().owns(p));
    blocks.emplace_back(p, bytes);
  }
  for (auto [p, bytes] : blocks) aligned.deallocate(stream, p, bytes, 64 * KiB);
  CHECK(r.allocator().stats().active_bytes == 0);
  r.allocator().verify();
}

TEST_CASE("rmm_resource: four threads fill device_uvectors from the current device resource (mutex_lock allocator)") {
  resource r = make_resource();
  current_device_resource scope(r);
  constexpr int threads = 4;
  constexpr int rounds = 300;
  std::vector<int> corrupted(threads, 0);
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([t, &corrupted] {
      std::mt19937 random(static_cast<unsigned>(t));
      std::uniform_int_distribution<std::size_t> count(1, 256 * 1024);
      std::vector<std::pair<rmm::device_uvector<int>, int>> held;  // each vector with its fill value
      for (int round = 0; round < rounds; ++round) {
        const int value = t * rounds + round;
        rmm::device_uvector<int> v(count(random), stream);
        std::fill(v.data(), v.data() + v.size(), value);
        held.emplace_back(std::move(v), value);
        if (held.size() > 4) {
          const auto& [oldest, written] = held.front();
          if (std::any_of(oldest.data(), oldest.data() + oldest.size(), [w = written](int x) { return x != w; })) {
            ++corrupted[t];
          }
          held.erase(held.begin());
        }
      }
    });
  }
  for (auto& w : workers) w.join();
  CHECK(corrupted == std::vector<int>(threads, 0));
  const statistics s = r.allocator().stats();
  CHECK(s.allocations == threads * rounds);
  CHECK(s.deallocations == threads * rounds);
  CHECK(s.active_bytes == 0);
  r.allocator().verify();
}
