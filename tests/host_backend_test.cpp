// What is specific to the host backend: real bytes shared between mappings, stitching handles
// into one contiguous range, argument checks and resource accounting.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include "glake/backends/host.hpp"

namespace {

using namespace glake;

constexpr std::size_t g = 2 * MiB;

std::size_t open_fds() {
  std::size_t count = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    ++count;
  }
  return count;
}

// The permissions and path of the /proc/self/maps entry covering `p`, or empty when no mapping
// covers it.
std::optional<std::string> mapping_at(const void* p) {
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    unsigned long long begin = 0;
    unsigned long long end = 0;
    char perms[8] = {};
    if (std::sscanf(line.c_str(), "%llx-%llx %7s", &begin, &end, perms) != 3) continue;
    if (address >= begin && address < end) {
      // Appended piece by piece, not `" " + line.substr(path)`: GCC 12 at -O2 and above sees a
      // possibly overlapping memcpy in that insert at the front of a temporary (a false -Wrestrict).
      std::string entry(perms);
      if (const auto path = line.find('/'); path != std::string::npos) entry.append(" ").append(line, path);
      return entry;
    }
  }
  return std::nullopt;
}

struct fixture {
  host_provider provider{g};
  host_reserver reserver{g};

  host_handle create(std::size_t bytes) {
    const auto handle = provider.try_create(bytes);
    REQUIRE(handle.has_value());
    return *handle;
  }
  std::byte* reserve(std::size_t bytes) {
    void* at = reserver.try_reserve(bytes);
    REQUIRE(at != nullptr);
    return static_cast<std::byte*>(at);
  }
  // A handle mapped alone into a range of its own, accessible.
  std::byte* map_alone(host_handle handle) {
    std::byte* at = reserve(handle.bytes);
    REQUIRE(reserver.try_map(at, handle.bytes, handle));
    REQUIRE(reserver.try_set_access(at, handle.bytes));
    return at;
  }
  void unmap_and_free(std::byte* at, std::size_t bytes) {
    reserver.unmap(at, bytes);
    reserver.free(at, bytes);
  }
};

void fill(std::byte* at, std::size_t bytes, unsigned char seed) {
  for (std::size_t i = 0; i < bytes; i += 512) at[i] = static_cast<std::byte>(seed + i / 512);
}

bool holds(const std::byte* at, std::size_t bytes, unsigned char seed) {
  for (std::size_t i = 0; i < bytes; i += 512) {
    if (at[i] != static_cast<std::byte>(seed + i / 512)) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("host: data written through one mapping survives unmapping it, seen through another") {
  fixture f;
  const host_handle handle = f.create(2 * g);
  std::byte* a = f.map_alone(handle);
  std::byte* b = f.map_alone(handle);
  fill(a, 2 * g, 7);
  f.unmap_and_free(a, 2 * g);
  CHECK(holds(b, 2 * g, 7));

  // And it survives the handle's release too: the mapping keeps the memory alive, as on CUDA.
  f.provider.release(handle);
  CHECK(holds(b, 2 * g, 7));
  f.unmap_and_free(b, 2 * g);
  CHECK(f.provider.created_bytes() == 0);
}

TEST_CASE("host: handles mapped side by side form one contiguous range of their bytes") {
  // The essence of stitching: two blocks with their own mappings become one range without a copy.
  fixture f;
  const host_handle first = f.create(g);
  const host_handle second = f.create(2 * g);
  std::byte* first_alone = f.map_alone(first);
  std::byte* second_alone = f.map_alone(second);
  fill(first_alone, g, 11);
  fill(second_alone, 2 * g, 200);

  std::byte* stitched = f.reserve(3 * g);
  REQUIRE(f.reserver.try_map(stitched, g, first));
  REQUIRE(f.reserver.try_map(stitched + g, 2 * g, second));
  REQUIRE(f.reserver.try_set_access(stitched, 3 * g));
  CHECK(holds(stitched, g, 11));
  CHECK(holds(stitched + g, 2 * g, 200));
  CHECK(std::memcmp(stitched, first_alone, g) == 0);
  CHECK(std::memcmp(stitched + g, second_alone, 2 * g) == 0);

  // One write across the seam lands in both handles.
  std::memset(stitched + g - 100, 0x42, 200);
  CHECK(first_alone[g - 1] == std::byte{0x42});
  CHECK(second_alone[99] == std::byte{0x42});
  CHECK(second_alone[100] != std::byte{0x42});

  f.reserver.unmap(stitched + g, 2 * g);
  f.reserver.unmap(stitched, g);
  f.reserver.free(stitched, 3 * g);
  f.unmap_and_free(first_alone, g);
  f.unmap_and_free(second_alone, 2 * g);
  f.provider.release(first);
  f.provider.release(second);
  CHECK(f.provider.created_bytes() == 0);
}

TEST_CASE("host: unmap puts the reservation back, free gives the range up") {
  fixture f;
  const host_handle handle = f.create(g);
  std::byte* range = f.reserve(2 * g);
  CHECK(mapping_at(range) == std::optional<std::string>("---p"));
  REQUIRE(f.reserver.try_map(range + g, g, handle));
  const auto mapped = mapping_at(range + g);
  REQUIRE(mapped.has_value());
  CHECK(mapped->rfind("---s /memfd:glake", 0) == 0);  // mapped but not yet accessible
  REQUIRE(f.reserver.try_set_access(range + g, g));
  CHECK(mapping_at(range + g)->rfind("rw-s /memfd:glake", 0) == 0);

  f.reserver.unmap(range + g, g);
  CHECK(mapping_at(range + g) == std::optional<std::string>("---p"));
  REQUIRE(f.reserver.try_map(range, g, handle));  // the range is still usable
  f.reserver.unmap(range, g);
  f.reserver.free(range, 2 * g);
  CHECK_FALSE(mapping_at(range).has_value());
  CHECK_FALSE(mapping_at(range + g).has_value());
  f.provider.release(handle);
}

TEST_CASE("host: reservations are aligned to a granularity larger than mmap's") {
  host_reserver reserver(64 * MiB);
  void* a = reserver.try_reserve(64 * MiB);
  void* b = reserver.try_reserve(128 * MiB);
  REQUIRE(a != nullptr);
  REQUIRE(b != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(a) % (64 * MiB) == 0);
  CHECK(reinterpret_cast<std::uintptr_t>(b) % (64 * MiB) == 0);
  CHECK(mapping_at(a) == std::optional<std::string>("---p"));
  CHECK(mapping_at(static_cast<std::byte*>(b) + 128 * MiB - 1) == std::optional<std::string>("---p"));
  reserver.free(a, 64 * MiB);
  reserver.free(b, 128 * MiB);
  CHECK_FALSE(mapping_at(a).has_value());
  CHECK_FALSE(mapping_at(b).has_value());
}

TEST_CASE("host: the granularity must be a power of two multiple of the page size") {
  CHECK_THROWS_AS(host_provider(3 * MiB), usage_error);
  CHECK_THROWS_AS(host_provider(1024), usage_error);
  CHECK_THROWS_AS(host_provider(0), usage_error);
  CHECK_THROWS_AS(host_reserver(3 * MiB), usage_error);
  CHECK_THROWS_AS(host_reserver(512), usage_error);
  CHECK(host_provider(64 * KiB).granularity() == 64 * KiB);
  CHECK(host_reserver(64 * KiB).granularity() == 64 * KiB);
}

TEST_CASE("host: misuse is caught before any system call") {
  fixture f;
  const host_handle handle = f.create(g);
  std::byte* range = f.reserve(2 * g);
  CHECK_THROWS_AS((void)f.provider.try_create(g / 2), usage_error);
  CHECK_THROWS_AS((void)f.reserver.try_reserve(g + 4096), usage_error);
  CHECK_THROWS_AS(f.reserver.try_map(nullptr, g, handle), usage_error);
  CHECK_THROWS_AS(f.reserver.try_map(range + 4096, g, handle), usage_error);
  CHECK_THROWS_AS(f.reserver.try_map(range, 2 * g, handle), usage_error);  // not mapped whole
  CHECK_THROWS_AS(f.reserver.try_map(range, g, host_handle{}), usage_error);
  CHECK_THROWS_AS(f.reserver.try_set_access(nullptr, g), usage_error);
  CHECK(mapping_at(range) == std::optional<std::string>("---p"));  // nothing was mapped
  f.reserver.free(range, 2 * g);
  f.provider.release(handle);
  CHECK(f.provider.created_bytes() == 0);
}

TEST_CASE("host: capacity is shared by copies, refused past, and returned by release") {
  const host_provider provider(g, 4 * g);
  host_provider copy = provider;
  CHECK(copy == provider);
  CHECK(provider.capacity() == 4 * g);
  CHECK(provider.location() == memory_location::host);
  const std::size_t fds = open_fds();

  const auto a = copy.try_create(3 * g);
  REQUIRE(a.has_value());
  CHECK(provider.created_bytes() == 3 * g);
  CHECK(open_fds() == fds + 1);
  CHECK_FALSE(copy.try_create(2 * g).has_value());
  CHECK(open_fds() == fds + 1);  // a refused create opens nothing
  const auto b = copy.try_create(g);
  REQUIRE(b.has_value());
  CHECK(a->fd != b->fd);
  CHECK_FALSE(copy.try_create(g).has_value());

  copy.release(*a);
  copy.release(*b);
  CHECK(provider.created_bytes() == 0);
  CHECK(open_fds() == fds);  // release closes the fd
  const auto again = copy.try_create(4 * g);
  REQUIRE(again.has_value());
  copy.release(*again);

  host_provider unlimited(g);
  CHECK(unlimited.capacity() == 0);
  const auto big = unlimited.try_create(512 * g);  // pages are committed only when touched
  REQUIRE(big.has_value());
  unlimited.release(*big);
}
