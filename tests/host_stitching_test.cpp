// The stitching allocator on real memory: a stitched block is one contiguous range of real
// bytes, and data written through live allocations survives every split, stitch and release.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/host.hpp"
#include "support/stamp.hpp"

namespace {

using namespace glake;
using testing::stamp;
using testing::stamped;
using host_stitching = stitching_allocator<host_provider, host_reserver>;
constexpr std::size_t M = MiB;


}  // namespace

TEST_CASE("host stitching: a stitched block is one contiguous range that reads back what was written") {
  host_provider provider(2 * M, 64 * M);  // 64 MiB of real memory at most
  config cfg;
  cfg.frag_limit = 0;
  host_stitching allocator(provider, host_reserver(2 * M), cfg);

  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(allocator.allocate(8 * M));
  for (int i = 0; i < 8; ++i) std::memset(blocks[i], 'a' + i, 8 * M);
  for (int i = 0; i < 8; i += 2) allocator.deallocate(blocks[i], 8 * M);

  // 32 MiB from four separate free 8 MiB blocks, with the device full: only a stitch can do it.
  auto* stitched = static_cast<unsigned char*>(allocator.allocate(32 * M));
  REQUIRE(allocator.stats().stitches == 1);
  CHECK(allocator.stats().reserved_bytes == 64 * M);

  // The old contents of the freed blocks show through the stitched range, in some order of whole
  // blocks: the same physical pages, now contiguous.
  for (std::size_t piece = 0; piece < 4; ++piece) {
    const unsigned char c = stitched[piece * 8 * M];
    CHECK((c == 'a' || c == 'c' || c == 'e' || c == 'g'));
    bool uniform = true;
    for (std::size_t k = 0; k < 8 * M; k += 4096) uniform &= stitched[piece * 8 * M + k] == c;
    CHECK(uniform);
  }
  // Write one pattern across the whole range, crossing every seam, and read it back.
  for (std::size_t i = 0; i < 32 * M; ++i) stitched[i] = static_cast<unsigned char>(i * 131 + 7);
  bool intact = true;
  for (std::size_t i = 0; i < 32 * M; ++i) intact &= stitched[i] == static_cast<unsigned char>(i * 131 + 7);
  CHECK(intact);
  // The live neighbours were never touched.
  for (int i = 1; i < 8; i += 2) {
    const auto* b = static_cast<const unsigned char*>(blocks[i]);
    bool same = true;
    for (std::size_t k = 0; k < 8 * M; k += 4096) same &= b[k] == 'a' + i;
    CHECK(same);
  }
  allocator.deallocate(stitched, 32 * M);
  for (int i = 1; i < 8; i += 2) allocator.deallocate(blocks[i], 8 * M);
  allocator.verify();
  allocator.release_cached();
  CHECK(provider.created_bytes() == 0);
}

TEST_CASE("host stitching: data in live allocations survives random splits, stitches and releases") {
  host_provider provider(2 * M, 96 * M);
  config cfg;
  cfg.frag_limit = 0;
  cfg.grow_stitch = true;
  cfg.auto_gc = 32 * M;
  host_stitching allocator(provider, host_reserver(2 * M), cfg);

  struct live {
    void* p;
    std::size_t bytes;
    std::uint64_t tag;
  };
  std::vector<live> alive;
  std::mt19937_64 rng(5);
  std::size_t stitches_seen = 0;
  for (int step = 0; step < 3000; ++step) {
    if (alive.empty() || (alive.size() < 24 && rng() % 2 == 0)) {
      // Mostly large (stitchable) sizes, some small ones for the small pool.
      const std::size_t bytes = rng() % 4 == 0 ? 1 + rng() % (64 * 1024) : 1 + rng() % (12 * M);
      void* p = allocator.try_allocate(bytes);
      if (p == nullptr) continue;
      const std::uint64_t tag = rng();
      stamp(p, bytes, tag);
      alive.push_back({p, bytes, tag});
    } else {
      const std::size_t i = rng() % alive.size();
      allocator.deallocate(alive[i].p, alive[i].bytes);
      alive[i] = alive.back();
      alive.pop_back();
    }
    if (step % 500 == 499) allocator.release_cached();
    for (const live& a : alive) REQUIRE(stamped(a.p, a.bytes, a.tag));
    stitches_seen = allocator.stats().stitches;
  }
  allocator.verify();
  CHECK(stitches_seen > 10);
  for (const live& a : alive) allocator.deallocate(a.p, a.bytes);
  allocator.release_cached();
  CHECK(provider.created_bytes() == 0);
}

TEST_CASE("host stitching: any size up to SIZE_MAX fails at once, under a capacity, a limit or neither" *
          doctest::timeout(30)) {
  const std::size_t hopeless[] = {std::size_t{1} << 40, std::size_t{1} << 50, std::size_t{1} << 62,
                                  ~std::size_t{0} - 1, ~std::size_t{0}};
  const auto refuses = [](host_stitching& allocator, std::size_t bytes) {
    CAPTURE(bytes);
    const std::uint64_t failed = allocator.stats().failed_allocations;
    CHECK(allocator.try_allocate(bytes) == nullptr);
    CHECK_THROWS_AS((void)allocator.allocate(bytes), out_of_memory);
    CHECK(allocator.stats().failed_allocations == failed + 2);
    CHECK(allocator.stats().driver_calls.total() == 0);
  };
  SUBCASE("the provider's capacity") {
    host_stitching allocator(host_provider(2 * M, 64 * M), host_reserver(2 * M));
    for (std::size_t bytes : hopeless) refuses(allocator, bytes);
    refuses(allocator, 64 * M + 1);
  }
  SUBCASE("the memory limit") {
    config cfg;
    cfg.memory_limit = 64 * M;
    host_stitching allocator(host_provider(2 * M), host_reserver(2 * M), cfg);
    for (std::size_t bytes : hopeless) refuses(allocator, bytes);
    refuses(allocator, 64 * M + 1);
  }
  SUBCASE("neither: the address space bounds any request") {
    host_stitching allocator(host_provider(2 * M), host_reserver(2 * M));
    for (std::size_t bytes : {std::size_t{1} << 62, ~std::size_t{0} - 1, ~std::size_t{0}}) refuses(allocator, bytes);
  }
}
