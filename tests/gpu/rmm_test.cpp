// glake under RMM on a real GPU: a CUDA-backend stitching allocator as RMM's current device
// resource, rmm::device_buffer copies through its memory, a device_uvector workload under RMM's
// statistics and limiting adaptors, out-of-memory (glake's limit and the device's own) reaching
// RMM's failure callback, and threads on their own streams. Its own executable
// (glake_gpu_rmm_tests, built with GLAKE_WITH_RMM), run by tests/gpu/run_or_skip.sh, which skips
// where there is no GPU. The same without a GPU, on the host backend: tests/rmm_resource_test.cpp.
#include <doctest/doctest.h>

#include <rmm/cuda_stream.hpp>
#include <rmm/device_buffer.hpp>
#include <rmm/device_uvector.hpp>
#include <rmm/error.hpp>
#include <rmm/mr/failure_callback_resource_adaptor.hpp>
#include <rmm/mr/limiting_resource_adaptor.hpp>
#include <rmm/mr/per_device_resource.hpp>
#include <rmm/mr/statistics_resource_adaptor.hpp>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "glake/adaptors/rmm_resource.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/cuda.hpp"
#include "glake/policies/locking.hpp"
#include "../support/rmm_scope.hpp"

namespace {

using namespace glake;
// mutex_lock: RMM's current device resource is used from every thread.
using cuda_stitching =
    stitching_allocator<cuda_provider, cuda_reserver, best_fit_tail_stitching, lru_eviction, mutex_lock>;
using resource = rmm_resource<cuda_stitching>;  // device_accessible from the CUDA provider's type
using device_resource = cuda::mr::any_resource<cuda::mr::device_accessible>;

static_assert(cuda::mr::resource_with<resource, cuda::mr::device_accessible>);
static_assert(!cuda::has_property<resource, cuda::mr::host_accessible>);
static_assert(std::is_constructible_v<rmm::device_async_resource_ref, resource&>);
static_assert(std::is_constructible_v<device_resource, resource>);

resource make_resource(std::size_t memory_limit = 0, std::size_t max_handle = 0) {
  config cfg;
  cfg.memory_limit = memory_limit;
  if (max_handle != 0) cfg.max_handle = max_handle;
  return make_rmm_resource<cuda_stitching>(cuda_provider(0), cuda_reserver(0), cfg);
}

using testing::current_device_resource;
using testing::spiller;

cuda::stream_ref ref(const rmm::cuda_stream& stream) { return stream; }

std::vector<std::uint8_t> pattern(std::size_t bytes, unsigned seed) {
  std::vector<std::uint8_t> v(bytes);
  std::mt19937 random(seed);
  for (auto& b : v) b = static_cast<std::uint8_t>(random());
  return v;
}

std::vector<std::uint8_t> to_host(const void* p, std::size_t bytes) {
  std::vector<std::uint8_t> v(bytes);
  REQUIRE(cudaMemcpy(v.data(), p, bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
  return v;
}

}  // namespace

TEST_CASE("gpu: rmm_resource as RMM's current device resource: device_buffer copies round-trip through glake's memory") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  resource r = make_resource();
  cuda_stitching& allocator = r.allocator();
  rmm::cuda_stream stream;
  {
    current_device_resource scope(r);
    const std::size_t bytes = 3 * MiB + 17;
    const auto data = pattern(bytes, 1);
    rmm::device_buffer original(data.data(), bytes, ref(stream));  // host-to-device copy
    CHECK(allocator.owns(original.data()));
    rmm::device_buffer copy(original, ref(stream));  // device-to-device copy, a second glake block
    CHECK(allocator.owns(copy.data()));
    CHECK(copy.data() != original.data());
    stream.synchronize();
    CHECK(to_host(copy.data(), bytes) == data);

    copy.resize(9 * MiB, ref(stream));  // a new block, the old contents copied into it
    stream.synchronize();
    CHECK(allocator.owns(copy.data()));
    const auto grown = to_host(copy.data(), bytes);
    CHECK(grown == data);

    rmm::device_uvector<int> numbers(1 << 20, ref(stream));
    REQUIRE(cudaMemsetAsync(numbers.data(), 0, numbers.size() * sizeof(int), stream.value()) == cudaSuccess);
    numbers.set_element(12345, 678, ref(stream));
    CHECK(numbers.element(12345, ref(stream)) == 678);
    CHECK(numbers.element(12346, ref(stream)) == 0);
    CHECK(allocator.owns(numbers.data()));

    const statistics s = allocator.stats();
    CHECK(s.active_bytes == bytes + 9 * MiB + (std::size_t{1} << 20) * sizeof(int));
    allocator.verify();
  }
  stream.synchronize();
  CHECK(allocator.stats().active_bytes == 0);
  allocator.verify();
}

TEST_CASE("gpu: a device_uvector workload through RMM's statistics and limiting adaptors over glake") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  resource r = make_resource();
  cuda_stitching& allocator = r.allocator();
  rmm::mr::statistics_resource_adaptor counted(r);
  rmm::mr::limiting_resource_adaptor limited(counted, 2 * GiB);
  rmm::cuda_stream stream;

  std::mt19937_64 random(7);
  std::uniform_int_distribution<std::size_t> size(1, 32 * MiB);
  std::vector<std::optional<std::pair<rmm::device_uvector<std::uint8_t>, std::uint8_t>>> slots(48);
  std::size_t checked = 0;
  for (int step = 0; step < 3000; ++step) {
    auto& slot = slots[random() % slots.size()];
    if (slot) {
      auto& [v, value] = *slot;
      if (step % 16 == 0) {  // the first and the last byte still hold what was written
        CHECK(v.element(0, ref(stream)) == value);
        CHECK(v.element(v.size() - 1, ref(stream)) == value);
        ++checked;
      }
      slot.reset();
    } else {
      const auto value = static_cast<std::uint8_t>(step);
      rmm::device_uvector<std::uint8_t> v(size(random), ref(stream), limited);
      REQUIRE(cudaMemsetAsync(v.data(), value, v.size(), stream.value()) == cudaSuccess);
      slot.emplace(std::move(v), value);
    }
    const statistics s = allocator.stats();
    REQUIRE(counted.get_bytes_counter().value == static_cast<std::int64_t>(s.active_bytes));
    REQUIRE(counted.get_allocations_counter().value == static_cast<std::int64_t>(s.allocations - s.deallocations));
  }
  CHECK(checked > 10);
  slots.clear();
  stream.synchronize();
  const statistics s = allocator.stats();
  CHECK(counted.get_bytes_counter().peak == static_cast<std::int64_t>(s.peak_active_bytes));
  CHECK(counted.get_allocations_counter().total == static_cast<std::int64_t>(s.allocations));
  CHECK(s.active_bytes == 0);
  CHECK(limited.get_allocated_bytes() == 0);
  allocator.verify();
  MESSAGE("peak active " << format_bytes(s.peak_active_bytes) << ", peak reserved "
                         << format_bytes(s.peak_reserved_bytes) << ", stitches " << s.stitches);
}

TEST_CASE("gpu: glake's memory limit and the device's own out-of-memory reach RMM's failure callback") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  rmm::cuda_stream stream;
  {
    resource r = make_resource(256 * MiB);
    spiller spill;
    rmm::mr::failure_callback_resource_adaptor<> guarded(r, &spiller::callback, &spill);
    for (int i = 0; i < 4; ++i) spill.spill.emplace_back(60 * MiB, ref(stream), guarded);
    // 240 + 100 MiB and 180 + 100 exceed glake's 256; 120 + 100 fit: two buffers spilled.
    rmm::device_buffer wanted(100 * MiB, ref(stream), guarded);
    CHECK(spill.requested == std::vector<std::size_t>{100 * MiB, 100 * MiB});
    CHECK(spill.spill.size() == 2);
    CHECK(r.allocator().stats().failed_allocations == 2);
    REQUIRE(cudaMemsetAsync(wanted.data(), 1, wanted.size(), stream.value()) == cudaSuccess);
    stream.synchronize();
  }
  {
    // No limit: a request larger than the device fails in the driver (cuMemCreate), and that too
    // arrives as rmm::out_of_memory with glake's exception nested.
    std::size_t free = 0, total = 0;
    REQUIRE(cudaMemGetInfo(&free, &total) == cudaSuccess);
    resource r = make_resource(0, 1 * GiB);  // few driver calls before the device is full
    spiller spill;
    rmm::mr::failure_callback_resource_adaptor<> guarded(r, &spiller::callback, &spill);
    const std::size_t too_big = total + 1 * GiB;
    try {
      rmm::device_buffer buffer(too_big, ref(stream), guarded);
      FAIL("more than the device's memory was allocated");
    } catch (const rmm::out_of_memory& e) {
      try {
        std::rethrow_if_nested(e);
        FAIL("no nested exception");
      } catch (const glake::out_of_memory& nested) {
        CHECK(nested.requested_bytes() == too_big);
      }
    }
    CHECK(spill.requested == std::vector<std::size_t>{too_big});
    r.allocator().verify();
    // Usable afterwards.
    rmm::device_buffer small(1 * MiB, ref(stream), guarded);
    CHECK(r.allocator().owns(small.data()));
  }
}

TEST_CASE("gpu: four threads, each on its own stream, fill device_uvectors from the current device resource") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  resource r = make_resource();
  current_device_resource scope(r);
  constexpr int threads = 4;
  constexpr int rounds = 200;
  std::vector<int> wrong(threads, 0);
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([t, &wrong] {
      try {  // an exception (a CUDA error, out of memory) counts as wrong: doctest's REQUIRE is for the main thread
        if (cudaSetDevice(0) != cudaSuccess) throw std::runtime_error("cudaSetDevice");
        rmm::cuda_stream stream;
        std::mt19937 random(static_cast<unsigned>(t));
        std::uniform_int_distribution<std::size_t> count(1, 4 * 1024 * 1024);
        for (int round = 0; round < rounds; ++round) {
          const auto value = static_cast<std::uint8_t>(t * 50 + round % 50);
          rmm::device_uvector<std::uint8_t> v(count(random), ref(stream));
          if (cudaMemsetAsync(v.data(), value, v.size(), stream.value()) != cudaSuccess) ++wrong[t];
          if (v.element(v.size() / 2, ref(stream)) != value) ++wrong[t];
        }
        stream.synchronize();
      } catch (const std::exception&) {
        ++wrong[t];
      }
    });
  }
  for (auto& w : workers) w.join();
  CHECK(wrong == std::vector<int>(threads, 0));
  const statistics s = r.allocator().stats();
  CHECK(s.allocations == threads * rounds);
  CHECK(s.active_bytes == 0);
  r.allocator().verify();
}
