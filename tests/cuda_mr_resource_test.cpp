// The cuda::mr adaptor on the host and simulated backends: CCCL's concepts and properties for the
// CCCL it is compiled with, alignment for every size class, streams, sharing, errors. Its own
// executable (glake_cuda_mr_tests), built where CMake finds the CUDA toolkit's headers; the GPU
// side is in tests/gpu.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "glake/adaptors/cuda_mr_resource.hpp"
#include "glake/allocators/caching_allocator.hpp"
#include "glake/allocators/segment_source.hpp"
#include "glake/allocators/segregator.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/fault_injection.hpp"
#include "glake/backends/host.hpp"
#include "glake/backends/sim.hpp"

using namespace glake;

namespace {

using host_stitching = stitching_allocator<host_provider, host_reserver>;
using sim_stitching = stitching_allocator<sim_provider, sim_reserver>;
using host_caching = caching_allocator<vmm_segment_source<host_provider, host_reserver>>;
using host_segregated = segregator<host_caching, host_stitching>;
using fi_host_stitching =
    stitching_allocator<fault_injecting_provider<host_provider>, fault_injecting_reserver<host_reserver>>;

using host_resource = cuda_mr_resource<host_stitching>;
using sim_resource = cuda_mr_resource<sim_stitching>;
using pretend_device_resource = cuda_mr_resource<host_stitching, cuda::mr::device_accessible>;

// Where each composition's memory lives, read from its type.
static_assert(allocator_location_v<host_stitching> == memory_location::host);
static_assert(allocator_location_v<sim_stitching> == memory_location::simulated);
static_assert(allocator_location_v<host_caching> == memory_location::host);
static_assert(allocator_location_v<host_segregated> == memory_location::host);
static_assert(allocator_location_v<fi_host_stitching> == memory_location::host);
static_assert(!allocator_location_v<segregator<host_caching, sim_stitching>>.has_value());

// The concepts of the CCCL in use, with the properties of the memory's kind and no others.
static_assert(models_cuda_mr_v<host_resource, cuda::mr::host_accessible>);
static_assert(!cuda::has_property<host_resource, cuda::mr::device_accessible>);
static_assert(models_cuda_mr_v<cuda_mr_resource<host_segregated>, cuda::mr::host_accessible>);
static_assert(models_cuda_mr_v<sim_resource>);
static_assert(!cuda::has_property<sim_resource, cuda::mr::host_accessible>);
static_assert(!cuda::has_property<sim_resource, cuda::mr::device_accessible>);
static_assert(models_cuda_mr_v<pretend_device_resource, cuda::mr::device_accessible>);
static_assert(!cuda::has_property<pretend_device_resource, cuda::mr::host_accessible>);
static_assert(std::is_copy_constructible_v<host_resource> && std::is_copy_assignable_v<host_resource>);
#if GLAKE_CCCL_STREAM_ORDERED_RESOURCE
static_assert(noexcept(std::declval<host_resource&>().deallocate(cuda::stream_ref{cudaStream_t{}}, nullptr, 0, 256)));
#else
static_assert(noexcept(std::declval<host_resource&>().deallocate(nullptr, 0, 256)));
static_assert(noexcept(std::declval<host_resource&>().deallocate_async(nullptr, 0, 256, cuda::stream_ref{})));
#endif
static_assert(noexcept(std::declval<host_resource&>().deallocate_sync(nullptr, 0, 256)));

std::shared_ptr<host_stitching> make_host(std::size_t capacity = 512 * MiB, std::size_t memory_limit = 0) {
  config cfg;
  cfg.memory_limit = memory_limit;
  return std::make_shared<host_stitching>(host_provider(2 * MiB, capacity), host_reserver(2 * MiB), cfg);
}

cudaStream_t fake_stream(std::uintptr_t id) { return reinterpret_cast<cudaStream_t>(id); }

std::vector<std::string> misuse_lines;
void record_misuse(const char* message) noexcept { misuse_lines.emplace_back(message); }

}  // namespace

TEST_CASE("cuda_mr_resource: every size class meets every alignment up to the guarantee, through both interfaces") {
  host_resource resource(make_host());
  CHECK(resource.allocator().alignment() >= 256);  // CUDA's guarantee, at least
  const std::size_t sizes[] = {1, 255, 256, 257, 4000, 64 * KiB + 3, 1 * MiB, 1 * MiB + 1, 3 * MiB + 17, 9 * MiB};
  std::vector<std::pair<void*, std::size_t>> live;
  for (std::size_t bytes : sizes) {
    for (std::size_t alignment = 1; alignment <= resource.allocator().alignment(); alignment *= 2) {
      void* a = resource.allocate_sync(bytes, alignment);
      void* b = resource.allocate(cuda::stream_ref{fake_stream(5)}, bytes, alignment);
      REQUIRE(a != nullptr);
      REQUIRE(b != nullptr);
      CHECK(reinterpret_cast<std::uintptr_t>(a) % alignment == 0);
      CHECK(reinterpret_cast<std::uintptr_t>(b) % alignment == 0);
      std::memset(a, 0x5a, bytes);  // host memory: really usable
      std::memset(b, 0xa5, bytes);
      live.emplace_back(a, bytes);
      live.emplace_back(b, bytes);
    }
  }
  CHECK(resource.allocator().stats().allocations == live.size());
  resource.allocator().verify();
  for (std::size_t i = 0; i < live.size(); ++i) {
    if (i % 2 == 0) {
      resource.deallocate_sync(live[i].first, live[i].second);
    } else {
      resource.deallocate(cuda::stream_ref{fake_stream(5)}, live[i].first, live[i].second);
    }
  }
  CHECK(resource.allocator().stats().active_bytes == 0);
  resource.allocator().verify();
}

TEST_CASE("cuda_mr_resource: alignments it cannot guarantee are refused with a clear error, nothing lost") {
  host_resource resource(make_host());
  const std::size_t guaranteed = resource.allocator().alignment();
  REQUIRE(guaranteed >= 256);
  const std::string expected = "alignment " + std::to_string(2 * guaranteed) + " exceeds the allocator's guaranteed " +
                               std::to_string(guaranteed);
  for (std::size_t bytes : {std::size_t{100}, 2 * MiB, 6 * MiB}) {
    try {
      (void)resource.allocate_sync(bytes, 2 * guaranteed);
      FAIL("an alignment above the guarantee was accepted");
    } catch (const usage_error& e) {
      CHECK(e.which() == usage_error::kind::unsupported);  // what this allocator cannot do
      CHECK(std::string(e.what()).find(expected) != std::string::npos);
    }
    CHECK_THROWS_AS((void)resource.allocate(cuda::stream_ref{fake_stream(1)}, bytes, 3), usage_error);
    CHECK_THROWS_AS((void)resource.allocate_sync(bytes, 0), usage_error);
  }
  CHECK(resource.allocator().stats().allocations == 0);
  CHECK(resource.allocator().stats().reserved_bytes == 0);

  // An allocator with a larger guarantee meets larger alignments.
  config cfg;
  cfg.round_to = 4096;
  cuda_mr_resource<host_stitching> coarse(
      std::make_shared<host_stitching>(host_provider(2 * MiB, 64 * MiB), host_reserver(2 * MiB), cfg));
  void* p = coarse.allocate_sync(100, 4096);
  CHECK(reinterpret_cast<std::uintptr_t>(p) % 4096 == 0);
  coarse.deallocate_sync(p, 100, 4096);
}

TEST_CASE("cuda_mr_resource: copies share one allocator, equality is sharing") {
  auto allocator = make_host();
  host_resource a(allocator);
  host_resource b = a;
  host_resource other(make_host());
  CHECK(a == b);
  CHECK_FALSE(a != b);
  CHECK(a != other);
  CHECK(&a.allocator() == allocator.get());

  void* p = a.allocate_sync(3 * MiB);
  allocator.reset();  // the handles keep the allocator alive
  b.deallocate_sync(p, 3 * MiB);  // memory from one copy freed through another
  CHECK(a.allocator().stats().active_bytes == 0);
  CHECK(a.shared_allocator().use_count() == 2);

  CHECK_THROWS_AS(host_resource(std::shared_ptr<host_stitching>{}), usage_error);
  auto made = make_cuda_mr_resource<host_stitching>(host_provider(2 * MiB, 64 * MiB), host_reserver(2 * MiB));
  void* q = made.allocate_sync(10);
  CHECK(made.allocator().owns(q));
  made.deallocate_sync(q, 10);
}

TEST_CASE("cuda_mr_resource: the stream reaches the allocator, zero bytes give null") {
  sim_device device(1 * GiB);
  auto allocator = std::make_shared<sim_stitching>(sim_provider{device}, sim_reserver{device});
  sim_resource resource(allocator);
  const cuda::stream_ref s7{fake_stream(7)};
  void* p = resource.allocate(s7, 5 * MiB);
  resource.deallocate(s7, p, 5 * MiB);
  CHECK(resource.allocate(s7, 5 * MiB) == p);  // same stream: reused at once
  resource.deallocate(s7, p, 5 * MiB);

  CHECK(resource.allocate(s7, 0) == nullptr);
  CHECK(resource.allocate_sync(0) == nullptr);
  resource.deallocate(s7, nullptr, 0);
  resource.deallocate_sync(nullptr, 0);
  CHECK(allocator->stats().allocations == 2);
}

TEST_CASE("cuda_mr_resource: out of memory throws glake::out_of_memory and leaves the allocator usable") {
  host_resource resource(make_host(512 * MiB, 64 * MiB));
  void* held = resource.allocate_sync(48 * MiB);
  try {
    (void)resource.allocate_sync(32 * MiB);
    FAIL("a request over the limit was granted");
  } catch (const out_of_memory& e) {
    CHECK(e.requested_bytes() == 32 * MiB);
    CHECK(std::string(e.what()).find("out of memory") != std::string::npos);
  }
  CHECK(resource.allocator().stats().failed_allocations == 1);
  CHECK_THROWS_AS((void)resource.allocate(cuda::stream_ref{fake_stream(2)}, SIZE_MAX), std::bad_alloc);
  resource.deallocate_sync(held, 48 * MiB);
  void* again = resource.allocate_sync(32 * MiB);
  CHECK(again != nullptr);
  resource.deallocate_sync(again, 32 * MiB);
  resource.allocator().verify();
}

TEST_CASE("cuda_mr_resource: misuse on deallocate is reported, never thrown, and frees nothing") {
  misuse_lines.clear();
  host_resource resource(make_host(), &record_misuse);
  void* p = resource.allocate_sync(1000);
  int not_ours = 0;
  resource.deallocate_sync(&not_ours, 4);
  resource.deallocate_sync(p, 999);  // wrong size
  if (GLAKE_CHECKED) {
    REQUIRE(misuse_lines.size() == 2);
    CHECK(misuse_lines[0].find("did not return") != std::string::npos);
    CHECK(misuse_lines[1].find("size") != std::string::npos);
    CHECK(resource.allocator().stats().active_bytes == 1000);  // the block is still live
  }
  resource.deallocate_sync(p, 1000);
  CHECK(resource.allocator().stats().active_bytes == 0);
}

TEST_CASE("cuda_mr_resource: usable through CCCL's type-erased references") {
  host_resource resource(make_host());
#if GLAKE_CCCL_STREAM_ORDERED_RESOURCE
  cuda::mr::resource_ref<cuda::mr::host_accessible> ref{resource};
  void* p = ref.allocate(cuda::stream_ref{fake_stream(4)}, 3 * MiB, 256);
  CHECK(reinterpret_cast<std::uintptr_t>(p) % 256 == 0);
  ref.deallocate(cuda::stream_ref{fake_stream(4)}, p, 3 * MiB, 256);
  cuda::mr::synchronous_resource_ref<cuda::mr::host_accessible> sync_ref{resource};
  void* q = sync_ref.allocate_sync(100, 64);
  sync_ref.deallocate_sync(q, 100, 64);
#else
  cuda::mr::async_resource_ref<cuda::mr::host_accessible> ref{resource};
  void* p = ref.allocate_async(3 * MiB, 256, cuda::stream_ref{fake_stream(4)});
  CHECK(reinterpret_cast<std::uintptr_t>(p) % 256 == 0);
  ref.deallocate_async(p, 3 * MiB, 256, cuda::stream_ref{fake_stream(4)});
  cuda::mr::resource_ref<cuda::mr::host_accessible> sync_ref{resource};
  void* q = sync_ref.allocate(100, 64);
  sync_ref.deallocate(q, 100, 64);
#endif
  CHECK(resource.allocator().stats().allocations == 2);
  CHECK(resource.allocator().stats().active_bytes == 0);
}
