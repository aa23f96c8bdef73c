// The stitch cache (allocators/stitching/stitch_cache.hpp): stitched ranges by address, cached ones by
// (stream, size) and in eviction order, and the cached bytes, over ranges made by hand.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "glake/config.hpp"
#include "glake/allocators/stitching/stitch_cache.hpp"
#include "glake/policies/eviction.hpp"

namespace {

using namespace glake;
constexpr std::size_t M = MiB;
const stream_ref A{1}, B{2};

struct fake_segment {};
struct fake_block {};
using range = detail::stitched_range<fake_segment, fake_block, int>;

template <class Evict>
struct fixture {
  detail::stitch_cache<range, Evict> cache;

  range* add(std::uintptr_t base, std::size_t size, stream_ref stream) {
    range* r = cache.create();
    r->base = base;
    r->size = size;
    r->reserved = 2 * size;
    r->stream = stream;
    r->live = true;
    cache.add(*r);
    return r;
  }
  void cache_it(range* r) {
    r->live = false;
    cache.cache(*r);
  }
  void claim(range* r) {
    cache.uncache(*r);
    r->live = true;
  }
  // The sizes of `stream`'s cached ranges from the first of at least `size` on.
  std::vector<std::size_t> sizes_from(stream_ref stream, std::size_t size) {
    std::vector<std::size_t> out;
    for (auto it = cache.lower_bound(stream, size); it != cache.end_cached() && it->stream == stream; ++it) {
      out.push_back(it->size);
    }
    return out;
  }
};

}  // namespace

TEST_CASE("stitch cache: ranges are found by their base address, live or cached, until removed") {
  fixture<lru_eviction> f;
  CHECK(f.cache.empty());
  range* r1 = f.add(0x100000000, 8 * M, A);
  range* r2 = f.add(0x200000000, 4 * M, B);
  CHECK_FALSE(f.cache.empty());
  CHECK(f.cache.find(0x100000000) == r1);
  CHECK(f.cache.find(0x200000000) == r2);
  CHECK(f.cache.find(0x100000000 + 2 * M) == nullptr);  // inside a range is not its base
  CHECK(f.cache.find(0x300000000) == nullptr);
  const auto& constant = f.cache;
  CHECK(constant.find(0x200000000) == r2);

  // Live ranges are in no cached index.
  CHECK_FALSE(f.cache.any_cached());
  CHECK(f.cache.cached_bytes() == 0);
  CHECK(f.cache.victim() == nullptr);

  f.cache_it(r1);
  CHECK(f.cache.find(0x100000000) == r1);  // still found
  CHECK(f.cache.any_cached());
  CHECK(f.cache.cached_count() == 1);
  CHECK(f.cache.queued_count() == 1);
  CHECK(f.cache.cached_bytes() == 8 * M);
  CHECK(r1->eviction_bytes_ == 8 * M);

  f.claim(r1);
  CHECK_FALSE(f.cache.any_cached());
  CHECK(f.cache.cached_count() == 0);
  CHECK(f.cache.queued_count() == 0);
  CHECK(f.cache.cached_bytes() == 0);
  CHECK(f.cache.find(0x100000000) == r1);

  // Removing a cached range takes it out of every index; removing a live one too.
  f.cache_it(r1);
  f.cache.remove(*r1);
  CHECK(f.cache.find(0x100000000) == nullptr);
  CHECK(f.cache.cached_count() == 0);
  CHECK(f.cache.cached_bytes() == 0);
  f.cache.remove(*r2);
  CHECK(f.cache.find(0x200000000) == nullptr);
  CHECK(f.cache.empty());

  // Every range in address order.
  f.add(0x500000000, 2 * M, A);
  f.add(0x400000000, 2 * M, B);
  f.add(0x600000000, 2 * M, A);
  std::vector<std::uintptr_t> bases;
  for (const range& r : f.cache) bases.push_back(r.base);
  CHECK(bases == std::vector<std::uintptr_t>{0x400000000, 0x500000000, 0x600000000});
}

TEST_CASE("stitch cache: lower_bound gives a stream's cached ranges from the smallest of at least a size, in size order") {
  fixture<lru_eviction> f;
  range* a16 = f.add(0x1000000000, 16 * M, A);
  range* a4 = f.add(0x2000000000, 4 * M, A);
  range* a8 = f.add(0x3000000000, 8 * M, A);
  range* a8b = f.add(0x4000000000, 8 * M, A);
  range* b2 = f.add(0x5000000000, 2 * M, B);
  range* b32 = f.add(0x6000000000, 32 * M, B);
  range* a64 = f.add(0x7000000000, 64 * M, A);  // live: never found by size
  for (range* r : {a16, a4, a8, a8b, b2, b32}) f.cache_it(r);
  CHECK(f.cache.cached_count() == 6);
  CHECK(f.cache.cached_bytes() == (16 + 4 + 8 + 8 + 2 + 32) * M);
  CHECK(f.cache.find(a64->base) == a64);  // found by address, never by size

  CHECK(f.sizes_from(A, 5 * M) == std::vector<std::size_t>{8 * M, 8 * M, 16 * M});
  CHECK(f.sizes_from(A, 8 * M) == std::vector<std::size_t>{8 * M, 8 * M, 16 * M});
  CHECK(f.sizes_from(A, 0) == std::vector<std::size_t>{4 * M, 8 * M, 8 * M, 16 * M});
  CHECK(f.sizes_from(A, 17 * M).empty());  // B's ranges follow, and are not A's
  CHECK(f.cache.lower_bound(A, 17 * M) != f.cache.end_cached());
  CHECK(f.cache.lower_bound(A, 17 * M)->stream == B);
  CHECK(f.sizes_from(B, 3 * M) == std::vector<std::size_t>{32 * M});
  CHECK(f.cache.lower_bound(B, 33 * M) == f.cache.end_cached());
  CHECK(&*f.cache.begin_cached() == a4);  // streams in order, then sizes

  // Claimed ranges leave the size index.
  f.claim(a8);
  CHECK(f.sizes_from(A, 5 * M) == std::vector<std::size_t>{8 * M, 16 * M});
  CHECK(&*f.cache.lower_bound(A, 5 * M) == a8b);
  CHECK(f.cache.cached_bytes() == (16 + 4 + 8 + 2 + 32) * M);
}

TEST_CASE("stitch cache: lru_eviction drops the range cached longest ago first") {
  fixture<lru_eviction> f;
  range* r16 = f.add(0x1000000000, 16 * M, A);
  range* r4 = f.add(0x2000000000, 4 * M, A);
  range* r8 = f.add(0x3000000000, 8 * M, B);
  f.cache_it(r16);
  f.cache_it(r4);
  f.cache_it(r8);
  CHECK(f.cache.victim() == r16);
  f.claim(r16);
  CHECK(f.cache.victim() == r4);
  f.cache_it(r16);  // cached again: now the newest
  CHECK(f.cache.victim() == r4);
  f.cache.remove(*r4);
  CHECK(f.cache.victim() == r8);
  f.claim(r8);
  CHECK(f.cache.victim() == r16);
  f.claim(r16);
  CHECK(f.cache.victim() == nullptr);
}

TEST_CASE("stitch cache: largest_first_eviction drops the largest cached range first") {
  fixture<largest_first_eviction> f;
  range* r16 = f.add(0x1000000000, 16 * M, A);
  range* r4 = f.add(0x2000000000, 4 * M, A);
  range* r32 = f.add(0x3000000000, 32 * M, B);
  f.cache_it(r4);
  f.cache_it(r16);
  CHECK(f.cache.victim() == r16);
  f.cache_it(r32);
  CHECK(f.cache.victim() == r32);
  f.claim(r32);
  CHECK(f.cache.victim() == r16);
  f.cache.remove(*r16);
  CHECK(f.cache.victim() == r4);
  CHECK(f.cache.cached_bytes() == 4 * M);

  // A range whose size changed while live is ranked by its new size once cached again.
  r32->size = 2 * M;
  f.cache_it(r32);
  CHECK(f.cache.victim() == r4);
  CHECK(f.cache.cached_bytes() == 6 * M);
  f.claim(r32);
  f.claim(r4);
  CHECK(f.cache.cached_bytes() == 0);
}
