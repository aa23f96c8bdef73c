// Conformance suites for physical_provider and address_reserver, run over every backend model.
#include <doctest/doctest.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "glake/backends/fault_injection.hpp"
#include "glake/backends/host.hpp"
#include "glake/backends/sim.hpp"

namespace {

using namespace glake;

constexpr std::size_t granule = 2 * MiB;
constexpr std::size_t capacity = 32 * granule;

// Mappings of the host provider's memfds ("/memfd:glake (deleted)") in this process.
std::size_t glake_memfd_mappings() {
  std::ifstream maps("/proc/self/maps");
  std::size_t count = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/memfd:glake") != std::string::npos) ++count;
  }
  return count;
}

std::size_t open_fds() {
  std::size_t count = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    ++count;
  }
  return count;
}

// A footprint is whatever a backend can leave behind; a test compares one taken before with
// one taken after to prove that create/reserve/map were all undone.
using footprint = std::array<std::size_t, 5>;

footprint sim_footprint(const sim_device& device) {
  return {device.live_handles(), device.physical_bytes(), device.reserved_bytes(),
          device.live_mappings(), static_cast<std::size_t>(device.violations())};
}

// Open descriptors count too: the provider's one file is opened before the first snapshot (see
// opened), so a descriptor more afterwards is one leaked. Resident bytes show that released
// handles gave their memory back.
footprint host_footprint(const host_provider& provider) {
  return {provider.created_bytes(), glake_memfd_mappings(), open_fds(), provider.resident_bytes(), 0};
}

// A host provider whose file is already open: the first create opens it, once for all copies.
host_provider opened(host_provider provider) {
  const auto handle = provider.try_create(granule);
  REQUIRE(handle.has_value());
  provider.release(*handle);
  return provider;
}

struct sim_model {
  static constexpr bool real_memory = false;
  static constexpr memory_location location = memory_location::simulated;
  sim_device device{capacity, granule};
  sim_provider provider{device};
  sim_reserver reserver{device};

  sim_device* sim() { return &device; }
  std::size_t physical_bytes() const { return device.physical_bytes(); }
  footprint snapshot() const { return sim_footprint(device); }
  void check_consistent() const { CHECK(device.violations() == 0); }
};

struct host_model {
  static constexpr bool real_memory = true;
  static constexpr memory_location location = memory_location::host;
  host_provider provider = opened(host_provider{granule, capacity});
  host_reserver reserver{granule};

  sim_device* sim() { return nullptr; }
  std::size_t physical_bytes() const { return provider.created_bytes(); }
  footprint snapshot() const { return host_footprint(provider); }
  void check_consistent() const {}
};

// The wrappers with a plan that never fails must behave exactly like what they wrap and see
// exactly the calls the wrapped backend sees.
struct fault_sim_model {
  static constexpr bool real_memory = false;
  static constexpr memory_location location = memory_location::simulated;
  sim_device device{capacity, granule};
  fault_plan plan;
  fault_injecting_provider<sim_provider> provider{sim_provider{device}, plan};
  fault_injecting_reserver<sim_reserver> reserver{sim_reserver{device}, plan};

  sim_device* sim() { return &device; }
  std::size_t physical_bytes() const { return device.physical_bytes(); }
  footprint snapshot() const { return sim_footprint(device); }
  void check_consistent() const {
    CHECK(device.violations() == 0);
    CHECK(plan.faults_injected() == 0);
    CHECK(plan.calls() == device.calls());
  }
};

struct fault_host_model {
  static constexpr bool real_memory = true;
  static constexpr memory_location location = memory_location::host;
  fault_plan plan;
  fault_injecting_provider<host_provider> provider{opened(host_provider{granule, capacity}), plan};
  fault_injecting_reserver<host_reserver> reserver{host_reserver{granule}, plan};

  sim_device* sim() { return nullptr; }
  std::size_t physical_bytes() const { return provider.upstream().created_bytes(); }
  footprint snapshot() const { return host_footprint(provider.upstream()); }
  void check_consistent() const { CHECK(plan.faults_injected() == 0); }
};

#define GLAKE_BACKEND_MODELS sim_model, host_model, fault_sim_model, fault_host_model

template <class Model>
auto create(Model& model, std::size_t bytes) {
  auto handle = model.provider.try_create(bytes);
  REQUIRE(handle.has_value());
  return *handle;
}

template <class Model>
std::byte* reserve(Model& model, std::size_t bytes) {
  void* at = model.reserver.try_reserve(bytes);
  REQUIRE(at != nullptr);
  return static_cast<std::byte*>(at);
}

void fill(std::byte* at, std::size_t bytes, unsigned seed) {
  for (std::size_t i = 0; i < bytes; i += 4096) at[i] = static_cast<std::byte>(seed + i / 4096);
  at[bytes - 1] = static_cast<std::byte>(seed ^ 0x5a);
}

bool holds(const std::byte* at, std::size_t bytes, unsigned seed) {
  for (std::size_t i = 0; i < bytes; i += 4096) {
    if (at[i] != static_cast<std::byte>(seed + i / 4096)) return false;
  }
  return at[bytes - 1] == static_cast<std::byte>(seed ^ 0x5a);
}

}  // namespace

TEST_CASE_TEMPLATE("physical_provider conformance", Model, GLAKE_BACKEND_MODELS) {
  using provider_type = decltype(Model::provider);
  static_assert(physical_provider<provider_type>);
  Model model;
  auto& provider = model.provider;
  const footprint before = model.snapshot();
  bool misuse = false;

  SUBCASE("granularity is a power of two and location is the backend's") {
    const std::size_t g = std::as_const(provider).granularity();
    CHECK(g == granule);
    CHECK((g & (g - 1)) == 0);
    CHECK(std::as_const(provider).location() == Model::location);
  }

  SUBCASE("handles are distinct and every create is balanced by its release") {
    const auto a = create(model, granule);
    const auto b = create(model, 2 * granule);
    const auto c = create(model, 4 * granule);
    CHECK_FALSE(a == b);
    CHECK_FALSE(b == c);
    CHECK_FALSE(a == c);
    CHECK(model.physical_bytes() == 7 * granule);
    provider.release(b);
    CHECK(model.physical_bytes() == 5 * granule);
    provider.release(a);
    provider.release(c);
    CHECK(model.physical_bytes() == 0);
    CHECK(model.snapshot() == before);
  }

  SUBCASE("creating past capacity gives an empty optional and leaves the provider usable") {
    std::vector<typename provider_type::handle_type> handles;
    for (std::size_t i = 0; i < capacity / (4 * granule); ++i) {
      handles.push_back(create(model, 4 * granule));
    }
    CHECK_FALSE(provider.try_create(granule).has_value());
    CHECK(model.physical_bytes() == capacity);
    provider.release(handles.back());
    handles.pop_back();
    CHECK_FALSE(provider.try_create(8 * granule).has_value());
    handles.push_back(create(model, 4 * granule));
    for (const auto& handle : handles) provider.release(handle);
    CHECK(model.snapshot() == before);
  }

  SUBCASE("a size that is not a positive multiple of the granularity is misuse") {
    CHECK_THROWS_AS((void)provider.try_create(0), usage_error);
    CHECK_THROWS_AS((void)provider.try_create(granule + 4096), usage_error);
    CHECK(model.physical_bytes() == 0);
    if (sim_device* device = model.sim()) CHECK(device->violations() == 2);
    misuse = true;
  }

  SUBCASE("copies share one provider") {
    provider_type copy = provider;
    const auto handle = copy.try_create(granule);
    REQUIRE(handle.has_value());
    CHECK(model.physical_bytes() == granule);
    provider.release(*handle);
    CHECK(model.snapshot() == before);
  }

  if (!misuse) model.check_consistent();  // the misuse subcase's violations are intended
}

TEST_CASE_TEMPLATE("address_reserver conformance", Model, GLAKE_BACKEND_MODELS) {
  using reserver_type = decltype(Model::reserver);
  static_assert(address_reserver_for<reserver_type, decltype(Model::provider)>);
  Model model;
  auto& reserver = model.reserver;
  auto& provider = model.provider;
  const footprint before = model.snapshot();
  bool misuse = false;

  SUBCASE("reserved ranges are aligned and do not overlap") {
    CHECK(std::as_const(reserver).granularity() == granule);
    const std::size_t sizes[] = {granule, 3 * granule, 16 * granule, 2 * granule, granule};
    std::vector<std::pair<std::uintptr_t, std::size_t>> ranges;
    for (const std::size_t bytes : sizes) {
      const auto base = reinterpret_cast<std::uintptr_t>(reserve(model, bytes));
      CHECK(base % granule == 0);
      for (const auto& [other, other_bytes] : ranges) {
        CHECK((base + bytes <= other || other + other_bytes <= base));
      }
      ranges.emplace_back(base, bytes);
    }
    for (const auto& [base, bytes] : ranges) reserver.free(reinterpret_cast<void*>(base), bytes);
    CHECK(model.snapshot() == before);
  }

  SUBCASE("one handle mapped in two places at once shows the same bytes in both") {
    const auto handle = create(model, 2 * granule);
    std::byte* a = reserve(model, 2 * granule);
    std::byte* b = reserve(model, 4 * granule) + 2 * granule;  // at an offset of a larger range
    CHECK(reserver.try_map(a, 2 * granule, handle));
    CHECK(reserver.try_map(b, 2 * granule, handle));
    CHECK(reserver.try_set_access(a, 2 * granule));
    CHECK(reserver.try_set_access(b, 2 * granule));
    if constexpr (Model::real_memory) {
      fill(a, 2 * granule, 17);
      CHECK(holds(b, 2 * granule, 17));
      fill(b + granule, granule, 99);
      CHECK(holds(a + granule, granule, 99));
    } else {
      const auto at_a = model.sim()->resolve(a + granule + 123);
      const auto at_b = model.sim()->resolve(b + granule + 123);
      REQUIRE(at_a.has_value());
      CHECK(at_a == at_b);
      CHECK(at_a->offset == granule + 123);
      CHECK(at_a->accessible);
    }
    reserver.unmap(a, 2 * granule);
    reserver.unmap(b, 2 * granule);
    reserver.free(a, 2 * granule);
    reserver.free(b - 2 * granule, 4 * granule);
    provider.release(handle);
    CHECK(model.snapshot() == before);
  }

  SUBCASE("handles mapped side by side form one range with access set at once") {
    const auto first = create(model, granule);
    const auto second = create(model, 2 * granule);
    std::byte* range = reserve(model, 3 * granule);
    CHECK(reserver.try_map(range, granule, first));
    CHECK(reserver.try_map(range + granule, 2 * granule, second));
    CHECK(reserver.try_set_access(range, 3 * granule));
    if constexpr (Model::real_memory) {
      fill(range, 3 * granule, 3);
      CHECK(holds(range, 3 * granule, 3));
    } else {
      const auto inside_second = model.sim()->resolve(range + 2 * granule + 8);
      REQUIRE(inside_second.has_value());
      CHECK(inside_second->offset == granule + 8);
      CHECK(inside_second->accessible);
      CHECK(inside_second->handle != model.sim()->resolve(range)->handle);
    }
    reserver.unmap(range + granule, 2 * granule);
    reserver.unmap(range, granule);
    reserver.free(range, 3 * granule);
    provider.release(second);
    provider.release(first);
    CHECK(model.snapshot() == before);
  }

  SUBCASE("reserve, map, access, unmap, free and release leave nothing behind") {
    for (int round = 0; round < 3; ++round) {
      const auto handle = create(model, 4 * granule);
      std::byte* range = reserve(model, 8 * granule);
      CHECK(reserver.try_map(range + 4 * granule, 4 * granule, handle));
      CHECK(reserver.try_set_access(range + 4 * granule, 4 * granule));
      if constexpr (Model::real_memory) {
        fill(range + 4 * granule, 4 * granule, static_cast<unsigned>(round));
        CHECK(holds(range + 4 * granule, 4 * granule, static_cast<unsigned>(round)));
      }
      if (sim_device* device = model.sim()) {
        CHECK(device->live_mappings() == 1);
        CHECK(device->reserved_bytes() == 8 * granule);
      }
      reserver.unmap(range + 4 * granule, 4 * granule);
      reserver.free(range, 8 * granule);
      provider.release(handle);
      CHECK(model.snapshot() == before);
    }
  }

  SUBCASE("sizes and addresses off the granularity are misuse") {
    CHECK_THROWS_AS((void)reserver.try_reserve(0), usage_error);
    CHECK_THROWS_AS((void)reserver.try_reserve(granule / 2), usage_error);
    const auto handle = create(model, granule);
    std::byte* range = reserve(model, 2 * granule);
    CHECK_THROWS_AS((void)reserver.try_map(range + 4096, granule, handle), usage_error);
    CHECK_THROWS_AS((void)reserver.try_map(range, 2 * granule, handle), usage_error);
    CHECK_THROWS_AS((void)reserver.try_set_access(range + 4096, granule), usage_error);
    CHECK(reserver.try_map(range, granule, handle));  // the rejected calls changed nothing
    reserver.unmap(range, granule);
    reserver.free(range, 2 * granule);
    provider.release(handle);
    if (sim_device* device = model.sim()) {
      CHECK(device->violations() == 5);
      CHECK(device->live_mappings() == 0);
      CHECK(device->reserved_bytes() == 0);
    }
    misuse = true;
  }

  if (!misuse) model.check_consistent();  // the misuse subcase's violations are intended
}
