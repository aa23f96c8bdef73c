// What is specific to the host backend: real bytes shared between mappings, stitching handles
// into one contiguous range, argument checks and resource accounting.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "glake/allocators/stitching_allocator.hpp"
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

// The number of /proc/self/maps entries that overlap [begin, end).
std::size_t mappings_in(const void* begin, const void* end) {
  const auto lo = reinterpret_cast<std::uintptr_t>(begin);
  const auto hi = reinterpret_cast<std::uintptr_t>(end);
  std::ifstream maps("/proc/self/maps");
  std::size_t count = 0;
  for (std::string line; std::getline(maps, line);) {
    unsigned long long first = 0;
    unsigned long long last = 0;
    if (std::sscanf(line.c_str(), "%llx-%llx", &first, &last) == 2 && first < hi && last > lo) ++count;
  }
  return count;
}

// The lowest free descriptor number: with RLIMIT_NOFILE at it, the next open fails.
int lowest_free_fd() {
  const int probe = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  REQUIRE(probe >= 0);
  ::close(probe);
  return probe;
}

bool can_open_a_file() {
  const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

// Lowers a resource's soft limit for the life of the object.
class soft_limit {
 public:
  soft_limit(int resource, rlim_t value) : resource_(resource) {
    REQUIRE(::getrlimit(resource_, &saved_) == 0);
    rlimit lowered = saved_;
    lowered.rlim_cur = value;
    REQUIRE(::setrlimit(resource_, &lowered) == 0);
  }
  soft_limit(const soft_limit&) = delete;
  soft_limit& operator=(const soft_limit&) = delete;
  ~soft_limit() { ::setrlimit(resource_, &saved_); }

 private:
  int resource_;
  rlimit saved_{};
};

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
  const host_handle before = f.create(g);  // neighbours in the provider's file
  const host_handle handle = f.create(2 * g);
  const host_handle after = f.create(g);
  std::byte* a = f.map_alone(handle);
  std::byte* b = f.map_alone(handle);
  CHECK(a != b);
  fill(a, 2 * g, 7);
  CHECK(holds(b, 2 * g, 7));
  f.unmap_and_free(a, 2 * g);
  CHECK(holds(b, 2 * g, 7));

  // Mapped again at a third address, with its neighbours untouched by the writes.
  std::byte* c = f.map_alone(handle);
  CHECK(holds(c, 2 * g, 7));
  std::byte* left = f.map_alone(before);
  std::byte* right = f.map_alone(after);
  CHECK(left[g - 1] == std::byte{0});
  CHECK(right[0] == std::byte{0});
  f.unmap_and_free(b, 2 * g);
  f.unmap_and_free(c, 2 * g);
  f.unmap_and_free(left, g);
  f.unmap_and_free(right, g);
  f.provider.release(before);
  f.provider.release(handle);
  f.provider.release(after);
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
  CHECK(open_fds() == fds + 1);  // the provider's file, opened by its first create
  CHECK_FALSE(copy.try_create(2 * g).has_value());
  const auto b = copy.try_create(g);
  REQUIRE(b.has_value());
  CHECK(a->fd == b->fd);  // one file, two slices
  CHECK(a->offset + a->bytes <= b->offset);
  CHECK(open_fds() == fds + 1);
  CHECK_FALSE(copy.try_create(g).has_value());
  CHECK_FALSE(copy.last_failure());  // refused by the capacity, not by the system

  copy.release(*a);
  copy.release(*b);
  CHECK(provider.created_bytes() == 0);
  CHECK(open_fds() == fds + 1);  // the file stays open for the next create
  const auto again = copy.try_create(4 * g);
  REQUIRE(again.has_value());
  copy.release(*again);

  host_provider unlimited(g);
  CHECK(unlimited.capacity() == 0);
  const auto big = unlimited.try_create(512 * g);  // pages are committed only when touched
  REQUIRE(big.has_value());
  unlimited.release(*big);
}

TEST_CASE("host: hundreds of handles hold one file descriptor, and release gives the memory back") {
  // Under a descriptor limit of 64 above what is open, 500 handles of 2 MiB (1000 MiB) must still
  // be created, mapped and written, through the provider and through a stitching allocator, and
  // the process must still be able to open files.
  const soft_limit limit(RLIMIT_NOFILE, static_cast<rlim_t>(lowest_free_fd() + 64));
  constexpr std::size_t count = 500;

  SUBCASE("through the provider and reserver") {
    fixture f;
    std::vector<host_handle> handles;
    for (std::size_t i = 0; i < count; ++i) handles.push_back(f.create(g));
    CHECK(can_open_a_file());

    // Mapped side by side in creation order: consecutive slices of one file, which the kernel
    // keeps as one mapping.
    std::byte* range = f.reserve(count * g);
    for (std::size_t i = 0; i < count; ++i) REQUIRE(f.reserver.try_map(range + i * g, g, handles[i]));
    REQUIRE(f.reserver.try_set_access(range, count * g));
    CHECK(mappings_in(range, range + count * g) == 1);
    for (std::size_t i = 0; i < count; ++i) std::memset(range + i * g, static_cast<int>(i & 0xff), 3 * 4096);
    CHECK(f.provider.resident_bytes() >= count * 3 * 4096);

    // One handle seen again elsewhere holds what was written through the big range.
    std::byte* alone = f.map_alone(handles[321]);
    CHECK(alone[0] == std::byte{321 & 0xff});
    CHECK(alone[3 * 4096 - 1] == std::byte{321 & 0xff});
    CHECK(alone[3 * 4096] == std::byte{0});
    f.unmap_and_free(alone, g);

    for (std::size_t i = 0; i < count; ++i) f.reserver.unmap(range + i * g, g);
    f.reserver.free(range, count * g);
    for (const host_handle& handle : handles) f.provider.release(handle);
    CHECK(f.provider.created_bytes() == 0);
    CHECK(f.provider.resident_bytes() == 0);  // every slice was punched out of the file
    CHECK_FALSE(f.provider.last_failure());
    CHECK(can_open_a_file());
  }

  SUBCASE("through a stitching allocator") {
    const host_provider provider(g);  // a copy shares the allocator's file
    std::vector<void*> blocks;
    {
      stitching_allocator<host_provider, host_reserver> allocator(provider, host_reserver(g));
      for (std::size_t i = 0; i < count; ++i) {
        blocks.push_back(allocator.allocate(g));
        std::memset(blocks.back(), static_cast<int>(i & 0xff), 4096);
      }
      CHECK(allocator.stats().driver_calls[driver_call::create] >= count);
      CHECK(can_open_a_file());
      CHECK(provider.resident_bytes() >= count * 4096);
      for (std::size_t i = 0; i < count; ++i) {
        CHECK(*static_cast<unsigned char*>(blocks[i]) == (i & 0xff));
        allocator.deallocate(blocks[i], g);
      }
      allocator.release_cached();
      CHECK(allocator.stats().reserved_bytes == 0);
    }
    CHECK(provider.created_bytes() == 0);
    CHECK(provider.resident_bytes() == 0);
    CHECK(can_open_a_file());
  }
}

TEST_CASE("host: released slices are reused best fit and coalesced, and come back as zeros") {
  fixture f;
  const host_handle a = f.create(g);
  const host_handle b = f.create(g);
  const host_handle c = f.create(2 * g);
  const host_handle d = f.create(g);
  CHECK((a.fd == b.fd && b.fd == c.fd && c.fd == d.fd));
  CHECK(a.offset == 0);
  CHECK(b.offset == g);
  CHECK(c.offset == 2 * g);
  CHECK(d.offset == 4 * g);

  std::byte* at = f.map_alone(b);
  std::memset(at, 0x5a, g);
  f.unmap_and_free(at, g);
  f.provider.release(b);
  f.provider.release(c);  // merges with b's slice: [g, 4g) free

  const host_handle e = f.create(g);  // best fit: the low end of [g, 4g)
  CHECK(e.offset == g);
  at = f.map_alone(e);
  CHECK(at[0] == std::byte{0});
  CHECK(at[g - 1] == std::byte{0});
  f.unmap_and_free(at, g);

  const host_handle big = f.create(4 * g);  // fits no hole: past the end
  CHECK(big.offset == 5 * g);
  f.provider.release(a);
  f.provider.release(e);  // [0, 4g) free again, in one piece
  const host_handle two = f.create(3 * g);
  CHECK(two.offset == 0);

  f.provider.release(big);  // the last slice: the end comes down instead
  f.provider.release(two);
  f.provider.release(d);
  const host_handle first = f.create(g);
  CHECK(first.offset == 0);
  f.provider.release(first);
  CHECK(f.provider.created_bytes() == 0);
  CHECK(f.provider.resident_bytes() == 0);
}

TEST_CASE("host: concurrent creates and releases hand out disjoint slices") {
  host_provider provider(g);
  std::mutex mutex;
  std::vector<host_handle> kept;
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 random(t);
      std::vector<host_handle> mine;
      for (int i = 0; i < 2000; ++i) {
        if (!mine.empty() && random() % 2 == 0) {
          const std::size_t victim = random() % mine.size();
          provider.release(mine[victim]);
          mine[victim] = mine.back();
          mine.pop_back();
        } else if (auto handle = provider.try_create((1 + random() % 4) * g)) {
          mine.push_back(*handle);
        }
      }
      std::lock_guard lock(mutex);
      kept.insert(kept.end(), mine.begin(), mine.end());
    });
  }
  for (std::thread& thread : threads) thread.join();

  std::sort(kept.begin(), kept.end(), [](const host_handle& x, const host_handle& y) { return x.offset < y.offset; });
  std::size_t bytes = 0;
  for (std::size_t i = 0; i < kept.size(); ++i) {
    bytes += kept[i].bytes;
    if (i + 1 < kept.size()) CHECK(kept[i].offset + kept[i].bytes <= kept[i + 1].offset);
  }
  CHECK(provider.created_bytes() == bytes);
  for (const host_handle& handle : kept) provider.release(handle);
  CHECK(provider.created_bytes() == 0);
  const auto handle = provider.try_create(g);  // everything merged back down to the start
  REQUIRE(handle.has_value());
  CHECK(handle->offset == 0);
  provider.release(*handle);
}

TEST_CASE("host: a system call's refusal is reported with the call and its errno") {
  SUBCASE("memfd_create past RLIMIT_NOFILE") {
    host_provider provider(g);
    stitching_allocator<host_provider, host_reserver> allocator(provider, host_reserver(g));
    // UBSan's vptr check opens /proc/self/maps the first time it meets a polymorphic type: let it
    // meet out_of_memory before no descriptor is left, or it reports a false "invalid vptr".
    CHECK_THROWS_AS(throw out_of_memory(1, 0, 0, "warm-up"), out_of_memory);
    {
      const soft_limit limit(RLIMIT_NOFILE, static_cast<rlim_t>(lowest_free_fd()));
      CHECK_FALSE(provider.try_create(g).has_value());
      CHECK(allocator.try_allocate(8 * MiB) == nullptr);
      CHECK_THROWS_AS((void)allocator.allocate(8 * MiB), out_of_memory);
    }
    const host_failure failure = allocator.provider().last_failure();
    REQUIRE(failure);
    CHECK(failure.error == EMFILE);
    CHECK(failure.count >= 3);  // one per refused create: the provider's, try_allocate's, allocate's
    CHECK(failure.message() == "memfd_create: Too many open files (EMFILE)");
    CHECK(provider.created_bytes() == 0);

    void* p = allocator.allocate(8 * MiB);  // the limit is back: the next create opens the file
    CHECK(p != nullptr);
    allocator.deallocate(p, 8 * MiB);
  }

  SUBCASE("ftruncate past RLIMIT_FSIZE: EFBIG, not SIGXFSZ") {
    host_provider provider(g);
    std::vector<host_handle> handles;
    {
      const soft_limit limit(RLIMIT_FSIZE, 16 * g);
      for (int i = 0; i < 16; ++i) {
        const auto handle = provider.try_create(g);
        REQUIRE(handle.has_value());
        handles.push_back(*handle);
      }
      CHECK_FALSE(provider.try_create(g).has_value());
    }
    CHECK(provider.last_failure().message() == "ftruncate: File too large (EFBIG)");
    CHECK(provider.last_failure().count == 1);
    for (const host_handle& handle : handles) provider.release(handle);
  }

  SUBCASE("other failures throw driver_error naming the call and the errno") {
    host_reserver reserver(g);
    std::byte* range = static_cast<std::byte*>(reserver.try_reserve(g));
    REQUIRE(range != nullptr);
    const host_handle closed{::open("/dev/null", O_RDONLY | O_CLOEXEC), 0, g};
    REQUIRE(closed.fd >= 0);
    ::close(closed.fd);
    try {
      (void)reserver.try_map(range, g, closed);
      FAIL("mapping a closed descriptor succeeded");
    } catch (const driver_error& error) {
      CHECK(error.call() == "mmap");
      CHECK(error.code() == EBADF);
      CHECK(std::string(error.what()) == "mmap failed (9): Bad file descriptor (EBADF)");
    }
    CHECK(reserver.last_failure().message() == "mmap: Bad file descriptor (EBADF)");
    reserver.free(range, g);
  }
}

TEST_CASE("host: mapping past vm.max_map_count fails with a message naming that limit") {
  const long limit = [] {
    std::ifstream file("/proc/sys/vm/max_map_count");
    long value = -1;
    file >> value;
    return value;
  }();
  if (limit <= 0 || limit > 300000) {
    MESSAGE("vm.max_map_count is " << limit << ": too high to reach in a test, skipped");
    return;
  }
  // One page mapped at every other page of a range: no two neighbouring mappings are
  // consecutive in the file, so each one is a mapping of its own, and the reservation is split
  // around each.
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  host_provider provider(page);
  host_reserver reserver(page);
  const auto handle = provider.try_create(page);
  REQUIRE(handle.has_value());
  const std::size_t slots = static_cast<std::size_t>(limit) + 1000;
  auto* range = static_cast<std::byte*>(reserver.try_reserve(2 * slots * page));
  REQUIRE(range != nullptr);

  // Nothing in here may allocate: the process has no mapping to spare until it is undone.
  std::size_t mapped = 0;
  bool refused = false;
  while (mapped < slots) {
    if (!reserver.try_map(range + 2 * mapped * page, page, *handle)) {
      refused = true;
      break;
    }
    ++mapped;
  }
  for (std::size_t i = mapped; i-- > 0;) reserver.unmap(range + 2 * i * page, page);
  reserver.free(range, 2 * slots * page);
  provider.release(*handle);

  CHECK(refused);
  CHECK(mapped < static_cast<std::size_t>(limit));
  const host_failure failure = reserver.last_failure();
  CHECK(failure.call_name() == std::string("mmap"));
  CHECK(failure.error == ENOMEM);
  const std::string message = failure.message();
  CHECK(message.rfind("mmap: Cannot allocate memory (ENOMEM); the process has ", 0) == 0);
  CHECK(message.find("mappings, vm.max_map_count is " + std::to_string(limit)) != std::string::npos);
}
