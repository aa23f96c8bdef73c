// What is specific to the simulated backend: every CUDA rule it enforces, capacity, resolve()
// and the call counts.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "glake/backends/sim.hpp"

namespace {

using namespace glake;

constexpr std::size_t g = 2 * MiB;

struct fixture {
  sim_device device{16 * g, g};
  sim_provider provider{device};
  sim_reserver reserver{device};

  sim_handle create(std::size_t bytes) {
    const auto handle = provider.try_create(bytes);
    REQUIRE(handle.has_value());
    return *handle;
  }
  std::byte* reserve(std::size_t bytes) {
    void* at = reserver.try_reserve(bytes);
    REQUIRE(at != nullptr);
    return static_cast<std::byte*>(at);
  }
};

// The message of the usage_error that `call` throws, after checking its kind; empty (and a
// failed check) when it throws nothing.
template <class Call>
std::string rejection(Call&& call) {
  try {
    call();
  } catch (const usage_error& error) {
    CHECK(error.which() == usage_error::kind::bad_argument);
    return error.what();
  }
  FAIL_CHECK("expected a usage_error");
  return {};
}

bool mentions(const std::string& text, const char* rule) {
  return text.find(rule) != std::string::npos;
}

}  // namespace

TEST_CASE("sim_device rejects a granularity that is not a power of two") {
  CHECK_THROWS_AS(sim_device(64 * MiB, 3 * MiB), usage_error);
  CHECK_THROWS_AS(sim_device(64 * MiB, 0), usage_error);
  const sim_device small(64 * MiB, 64 * KiB);
  CHECK(small.granularity() == 64 * KiB);
  CHECK(small.capacity() == 64 * MiB);
}

TEST_CASE("sim_device rejects each broken rule in the calls that may throw") {
  fixture f;
  const sim_handle handle = f.create(2 * g);
  std::byte* range = f.reserve(4 * g);

  SUBCASE("create: size not a positive multiple of the granularity") {
    CHECK(mentions(rejection([&] { (void)f.provider.try_create(0); }), "granularity-aligned"));
    CHECK(mentions(rejection([&] { (void)f.provider.try_create(g + 1); }), "granularity-aligned"));
    CHECK(f.device.live_handles() == 1);
    CHECK(f.device.violations() == 2);
  }
  SUBCASE("reserve: size not a positive multiple of the granularity") {
    CHECK(mentions(rejection([&] { (void)f.reserver.try_reserve(0); }), "granularity-aligned"));
    CHECK(mentions(rejection([&] { (void)f.reserver.try_reserve(g / 2); }), "granularity-aligned"));
    CHECK(f.device.reserved_bytes() == 4 * g);
  }
  SUBCASE("map: unaligned address") {
    CHECK(mentions(rejection([&] { f.reserver.try_map(range + 4096, 2 * g, handle); }),
                   "addresses are granularity-aligned"));
  }
  SUBCASE("map: a size other than the handle's") {
    CHECK(mentions(rejection([&] { f.reserver.try_map(range, g, handle); }), "mapped whole"));
    CHECK(mentions(rejection([&] { f.reserver.try_map(range, 4 * g, handle); }), "mapped whole"));
  }
  SUBCASE("map: unknown and released handles") {
    CHECK(mentions(rejection([&] { f.reserver.try_map(range, 2 * g, sim_handle{999}); }),
                   "unknown"));
    const sim_handle gone = f.create(g);
    f.provider.release(gone);
    CHECK(mentions(rejection([&] { f.reserver.try_map(range, g, gone); }), "unknown"));
  }
  SUBCASE("map: the default handle, and a released one's id") {
    CHECK(mentions(rejection([&] { f.reserver.try_map(range, 2 * g, sim_handle{}); }), "unknown"));
    const sim_handle gone = f.create(g);
    f.provider.release(gone);
    CHECK_FALSE(f.device.is_host(gone).has_value());
    CHECK(f.device.is_host(handle) == false);
    CHECK(f.device.live_handles() == 1);
  }
  SUBCASE("map: outside any reservation, or past the end of one") {
    std::byte* nowhere = range + 64 * g;
    CHECK(mentions(rejection([&] { f.reserver.try_map(nowhere, 2 * g, handle); }),
                   "inside one reservation"));
    CHECK(mentions(rejection([&] { f.reserver.try_map(range + 3 * g, 2 * g, handle); }),
                   "inside one reservation"));
    CHECK(mentions(rejection([&] { f.reserver.try_map(range - g, 2 * g, handle); }),
                   "inside one reservation"));
  }
  SUBCASE("map: over an existing mapping, wholly or partly") {
    CHECK(f.reserver.try_map(range, 2 * g, handle));
    const sim_handle other = f.create(2 * g);
    CHECK(mentions(rejection([&] { f.reserver.try_map(range, 2 * g, other); }), "must not overlap"));
    CHECK(mentions(rejection([&] { f.reserver.try_map(range + g, 2 * g, other); }),
                   "must not overlap"));
    CHECK(f.reserver.try_map(range + 2 * g, 2 * g, other));  // adjacent is fine
    CHECK(f.device.live_mappings() == 2);
  }
  SUBCASE("set_access: over an unmapped range") {
    CHECK(mentions(rejection([&] { f.reserver.try_set_access(range, 2 * g); }),
                   "does not start a mapping"));
  }
  SUBCASE("set_access: starting or ending inside a mapping") {
    CHECK(f.reserver.try_map(range, 2 * g, handle));
    CHECK(mentions(rejection([&] { f.reserver.try_set_access(range + g, g); }),
                   "does not start a mapping"));
    CHECK(mentions(rejection([&] { f.reserver.try_set_access(range, g); }), "ends inside"));
    CHECK_FALSE(f.device.resolve(range)->accessible);
  }
  SUBCASE("set_access: a gap between mappings, and nothing changes when rejected") {
    CHECK(f.reserver.try_map(range, 2 * g, handle));
    const sim_handle other = f.create(g);
    CHECK(f.reserver.try_map(range + 3 * g, g, other));
    CHECK(mentions(rejection([&] { f.reserver.try_set_access(range, 4 * g); }), "no gaps"));
    CHECK_FALSE(f.device.resolve(range)->accessible);
    CHECK(f.reserver.try_set_access(range, 2 * g));
    CHECK(f.device.resolve(range)->accessible);
  }
  SUBCASE("set_access: unaligned address or size") {
    CHECK(f.reserver.try_map(range, 2 * g, handle));
    CHECK(mentions(rejection([&] { f.reserver.try_set_access(range + 4096, g); }),
                   "granularity-aligned"));
    CHECK(mentions(rejection([&] { f.reserver.try_set_access(range, g + 4096); }),
                   "granularity-aligned"));
  }
  CHECK(f.device.violations() >= 1);
  CHECK(mentions(f.device.last_violation(), "glake::sim_device::"));
}

TEST_CASE("sim_device records each broken rule in the noexcept calls and changes nothing") {
  fixture f;
  const sim_handle handle = f.create(2 * g);
  std::byte* range = f.reserve(4 * g);
  REQUIRE(f.reserver.try_map(range + 2 * g, 2 * g, handle));
  REQUIRE(f.device.violations() == 0);

  SUBCASE("unmap: an address that starts no mapping") {
    f.reserver.unmap(range, 2 * g);
    CHECK(mentions(f.device.last_violation(), "exactly one mapping"));
    f.reserver.unmap(range + 3 * g, g);  // inside the mapping
    CHECK(f.device.violations() == 2);
  }
  SUBCASE("unmap: a size other than the mapping's") {
    f.reserver.unmap(range + 2 * g, g);
    CHECK(mentions(f.device.last_violation(), "exactly one mapping"));
    CHECK(f.device.violations() == 1);
  }
  SUBCASE("free: not the base of a reservation, or not its whole size") {
    f.reserver.free(range + g, 3 * g);
    CHECK(mentions(f.device.last_violation(), "whole reservation"));
    f.reserver.free(range, 2 * g);
    CHECK(mentions(f.device.last_violation(), "whole reservation"));
    CHECK(f.device.violations() == 2);
  }
  SUBCASE("free: a range that still holds a mapping") {
    f.reserver.free(range, 4 * g);
    CHECK(mentions(f.device.last_violation(), "nothing in it is mapped"));
    CHECK(f.device.violations() == 1);
  }
  SUBCASE("release: a handle that still has a mapping") {
    f.provider.release(handle);
    CHECK(mentions(f.device.last_violation(), "no mappings"));
    CHECK(f.device.violations() == 1);
    CHECK(f.device.live_handles() == 1);
  }
  SUBCASE("release: unknown, and released twice") {
    f.provider.release(sim_handle{12345});
    CHECK(mentions(f.device.last_violation(), "unknown"));
    const sim_handle other = f.create(g);
    f.provider.release(other);
    f.provider.release(other);
    CHECK(mentions(f.device.last_violation(), "unknown"));
    CHECK(f.device.violations() == 2);
  }

  // Whatever was rejected, the state is as before and can still be torn down cleanly.
  CHECK(f.device.live_mappings() == 1);
  CHECK(f.device.reserved_bytes() == 4 * g);
  CHECK(f.device.resolve(range + 2 * g).has_value());
  const std::uint64_t violations = f.device.violations();
  f.reserver.unmap(range + 2 * g, 2 * g);
  f.reserver.free(range, 4 * g);
  f.provider.release(handle);
  CHECK(f.device.violations() == violations);
  CHECK(f.device.live_handles() == 0);
  CHECK(f.device.reserved_bytes() == 0);
}

TEST_CASE("sim_device capacity: creating past it gives an empty optional, the device stays usable") {
  fixture f;  // capacity 16 granules
  CHECK_FALSE(f.provider.try_create(18 * g).has_value());
  std::vector<sim_handle> handles;
  for (int i = 0; i < 8; ++i) handles.push_back(f.create(2 * g));
  CHECK(f.device.physical_bytes() == 16 * g);
  CHECK_FALSE(f.provider.try_create(g).has_value());
  f.provider.release(handles.back());
  handles.pop_back();
  handles.push_back(f.create(g));
  CHECK_FALSE(f.provider.try_create(2 * g).has_value());
  handles.push_back(f.create(g));
  CHECK(f.device.physical_bytes() == f.device.capacity());

  std::byte* range = f.reserve(2 * g);  // address space is not physical memory
  CHECK(f.reserver.try_map(range, 2 * g, handles.front()));
  CHECK(f.reserver.try_set_access(range, 2 * g));
  f.reserver.unmap(range, 2 * g);
  f.reserver.free(range, 2 * g);
  for (const sim_handle handle : handles) f.provider.release(handle);
  CHECK(f.device.physical_bytes() == 0);
  CHECK(f.device.live_handles() == 0);
  CHECK(f.device.violations() == 0);
  CHECK(f.device.calls()[driver_call::create] == 13);  // the four refused ones count too
}

TEST_CASE("sim_device::resolve names the handle and offset behind an address") {
  fixture f;
  const sim_handle a = f.create(2 * g);
  const sim_handle b = f.create(g);
  CHECK(a.id != b.id);
  std::byte* range = f.reserve(4 * g);
  REQUIRE(f.reserver.try_map(range + g, 2 * g, a));
  REQUIRE(f.reserver.try_map(range + 3 * g, g, b));

  CHECK_FALSE(f.device.resolve(nullptr).has_value());
  CHECK_FALSE(f.device.resolve(range).has_value());  // reserved but not mapped
  CHECK_FALSE(f.device.resolve(range + 4 * g).has_value());
  CHECK(f.device.resolve(range + g) == sim_location{a.id, 0, false});
  CHECK(f.device.resolve(range + 2 * g + 7) == sim_location{a.id, g + 7, false});
  CHECK(f.device.resolve(range + 4 * g - 1) == sim_location{b.id, g - 1, false});

  REQUIRE(f.reserver.try_set_access(range + g, 3 * g));
  CHECK(f.device.resolve(range + g + 1) == sim_location{a.id, 1, true});
  CHECK(f.device.resolve(range + 3 * g) == sim_location{b.id, 0, true});

  f.reserver.unmap(range + g, 2 * g);
  CHECK_FALSE(f.device.resolve(range + g).has_value());
  // A fresh mapping of the same handle starts inaccessible again, as on CUDA.
  REQUIRE(f.reserver.try_map(range, 2 * g, a));
  CHECK(f.device.resolve(range + g) == sim_location{a.id, g, false});

  f.reserver.unmap(range, 2 * g);
  f.reserver.unmap(range + 3 * g, g);
  f.reserver.free(range, 4 * g);
  f.provider.release(a);
  f.provider.release(b);
  CHECK(f.device.violations() == 0);
}

TEST_CASE("sim_device counts every call by kind, failed and rejected ones included") {
  fixture f;
  const sim_handle handle = f.create(2 * g);
  CHECK_FALSE(f.provider.try_create(16 * g).has_value());
  std::byte* range = f.reserve(2 * g);
  CHECK(f.reserver.try_map(range, 2 * g, handle));
  CHECK_THROWS_AS(f.reserver.try_set_access(range, g), usage_error);
  CHECK(f.reserver.try_set_access(range, 2 * g));
  f.reserver.unmap(range, 2 * g);
  f.reserver.unmap(range, 2 * g);  // rejected: nothing is mapped there any more
  f.reserver.free(range, 2 * g);
  f.provider.release(handle);

  const driver_call_counts calls = f.device.calls();
  CHECK(calls[driver_call::create] == 2);
  CHECK(calls[driver_call::release] == 1);
  CHECK(calls[driver_call::reserve] == 1);
  CHECK(calls[driver_call::address_free] == 1);
  CHECK(calls[driver_call::map] == 1);
  CHECK(calls[driver_call::set_access] == 2);
  CHECK(calls[driver_call::unmap] == 2);
  CHECK(calls.total() == 10);
  CHECK(f.device.violations() == 2);
}

TEST_CASE("sim_device addresses are aligned, high, and never handed out twice while reserved") {
  sim_device device(GiB, 64 * KiB);
  sim_reserver reserver(device);
  const auto a = reinterpret_cast<std::uintptr_t>(reserver.try_reserve(64 * KiB));
  const auto b = reinterpret_cast<std::uintptr_t>(reserver.try_reserve(128 * KiB));
  CHECK(a >= sim_device::address_base);
  CHECK(a % (64 * KiB) == 0);
  CHECK(b % (64 * KiB) == 0);
  CHECK((a + 64 * KiB <= b || b + 128 * KiB <= a));
  reserver.free(reinterpret_cast<void*>(a), 64 * KiB);
  const auto c = reinterpret_cast<std::uintptr_t>(reserver.try_reserve(64 * KiB));
  CHECK((c + 64 * KiB <= b || b + 128 * KiB <= c));
  CHECK(device.reserved_bytes() == 192 * KiB);

  SUBCASE("running out of address space gives null, and the space is reused once freed") {
    // No per-byte work, so terabytes cost nothing; 64 TiB twice exceeds the 112 TiB window.
    constexpr std::size_t huge = std::size_t{64} << 40;
    void* first = reserver.try_reserve(huge);
    REQUIRE(first != nullptr);
    CHECK(reserver.try_reserve(huge) == nullptr);
    reserver.free(first, huge);
    void* again = reserver.try_reserve(huge);  // found by wrapping round to the window's start
    REQUIRE(again != nullptr);
    const auto at = reinterpret_cast<std::uintptr_t>(again);
    CHECK((at + huge <= b || b + 128 * KiB <= at));
    CHECK((at + huge <= c || c + 64 * KiB <= at));
    reserver.free(again, huge);
  }
  reserver.free(reinterpret_cast<void*>(b), 128 * KiB);
  reserver.free(reinterpret_cast<void*>(c), 64 * KiB);
  CHECK(device.reserved_bytes() == 0);
  CHECK(device.violations() == 0);
}

TEST_CASE("sim_device is safe to use from several threads") {
  sim_device device(64 * g, g);
  constexpr int threads = 4;
  constexpr int rounds = 200;
  std::vector<std::thread> workers;
  std::vector<int> aliased(threads, 0);
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&device, &aliased, t] {
      sim_provider provider(device);
      sim_reserver reserver(device);
      for (int i = 0; i < rounds; ++i) {
        const auto handle = provider.try_create(2 * g);
        void* range = reserver.try_reserve(2 * g);
        if (!handle || range == nullptr) {
          ++aliased[t];
          continue;
        }
        reserver.try_map(range, 2 * g, *handle);
        reserver.try_set_access(range, 2 * g);
        const auto where = device.resolve(static_cast<std::byte*>(range) + g);
        if (!where || where->handle != handle->id || where->offset != g) ++aliased[t];
        reserver.unmap(range, 2 * g);
        reserver.free(range, 2 * g);
        provider.release(*handle);
      }
    });
  }
  for (auto& worker : workers) worker.join();
  for (const int errors : aliased) CHECK(errors == 0);
  CHECK(device.violations() == 0);
  CHECK(device.live_handles() == 0);
  CHECK(device.live_mappings() == 0);
  CHECK(device.reserved_bytes() == 0);
  CHECK(device.calls()[driver_call::map] == threads * rounds);
  CHECK(device.calls().total() == 7u * threads * rounds);
}

TEST_CASE("sim_provider and sim_reserver are thin views of one device") {
  sim_device device(8 * g, g);
  sim_provider provider(device);
  const sim_provider copy = provider;
  CHECK(copy == provider);
  CHECK(&copy.device() == &device);
  CHECK(provider.location() == memory_location::simulated);
  CHECK(sim_reserver(device).granularity() == g);
  const auto handle = copy.device().try_create(g);
  REQUIRE(handle.has_value());
  CHECK(device.physical_bytes() == g);
  provider.release(*handle);
  CHECK(device.physical_bytes() == 0);
}

TEST_CASE("sim_device: the host tier is mapped like device memory and counted apart") {
  glake::sim_device gpu(8 * glake::MiB, 2 * glake::MiB, 4 * glake::MiB);
  glake::sim_provider device(gpu);
  glake::sim_host_provider host(gpu);
  glake::sim_reserver reserver(gpu);
  CHECK(host.capacity() == 4 * glake::MiB);
  const auto h = host.try_create(4 * glake::MiB);
  REQUIRE(h);
  CHECK(gpu.host_bytes() == 4 * glake::MiB);
  CHECK(gpu.physical_bytes() == 0);
  CHECK(gpu.is_host(*h) == true);
  CHECK_FALSE(host.try_create(2 * glake::MiB));  // the host capacity is spent
  const auto d = device.try_create(2 * glake::MiB);
  REQUIRE(d);
  CHECK(gpu.is_host(*d) == false);
  void* at = reserver.try_reserve(6 * glake::MiB);
  REQUIRE(reserver.try_map(at, 4 * glake::MiB, *h));
  void* tail = static_cast<char*>(at) + 4 * glake::MiB;
  REQUIRE(reserver.try_map(tail, 2 * glake::MiB, *d));

  // A copy needs access set on both sides, and disjoint ranges.
  glake::sim_copier copier(gpu);
  CHECK_THROWS_AS(copier.copy(tail, at, 2 * glake::MiB, glake::default_stream), glake::usage_error);
  REQUIRE(reserver.try_set_access(at, 6 * glake::MiB));
  copier.copy(tail, at, 2 * glake::MiB, glake::default_stream);
  CHECK(gpu.copies() == 1);
  CHECK(gpu.copied_bytes() == 2 * glake::MiB);
  CHECK_THROWS_AS(copier.copy(at, static_cast<char*>(at) + glake::MiB, 2 * glake::MiB, glake::default_stream),
                  glake::usage_error);
  CHECK_THROWS_AS(copier.copy(tail, at, 4 * glake::MiB, glake::default_stream), glake::usage_error);  // runs off the end
  const auto violations = gpu.violations();
  CHECK(violations == 3);
  reserver.unmap(at, 4 * glake::MiB);
  reserver.unmap(tail, 2 * glake::MiB);
  reserver.free(at, 6 * glake::MiB);
  host.release(*h);
  device.release(*d);
  CHECK(gpu.host_bytes() == 0);
  CHECK(gpu.physical_bytes() == 0);
  CHECK(gpu.violations() == violations);
}
