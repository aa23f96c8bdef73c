// What is specific to the stitching allocator: when it stitches, what it reuses and evicts, its
// knobs, its small pool, and rollback when any backend call fails.
#include <doctest/doctest.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <vector>

#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/fault_injection.hpp"
#include "glake/backends/sim.hpp"
#include "support/evented_reserver.hpp"

namespace {

using namespace glake;
using sim_stitching = stitching_allocator<sim_provider, sim_reserver>;
constexpr std::size_t M = MiB;

std::uint64_t handle_at(const sim_device& device, const void* p, std::size_t offset = 0) {
  auto where = device.resolve(static_cast<const char*>(p) + offset);
  REQUIRE(where.has_value());
  return where->handle;
}

config stitch_everything() {
  config cfg;
  cfg.frag_limit = 0;
  return cfg;
}

// Four 100 MiB blocks, the first and third freed: 200 MiB free in two separate pieces.
struct fragmented {
  void* blocks[4];
  std::uint64_t handles[4];
  template <class A>
  fragmented(A& allocator, const sim_device& device) {
    allocator.set_live_report(nullptr);  // blocks 1 and 3 stay live to the end, on purpose
    for (int i = 0; i < 4; ++i) {
      blocks[i] = allocator.allocate(100 * M);
      handles[i] = handle_at(device, blocks[i]);
    }
    allocator.deallocate(blocks[0], 100 * M);
    allocator.deallocate(blocks[2], 100 * M);
  }
};

}  // namespace

TEST_CASE("stitching: free blocks are mapped side by side and serve a larger request without new memory") {
  sim_device device(400 * M);  // full after four blocks: no growth possible
  sim_stitching allocator(sim_provider{device}, sim_reserver{device}, stitch_everything());
  fragmented f(allocator, device);
  void* p = allocator.allocate(200 * M);
  const statistics s = allocator.stats();
  CHECK(s.stitches == 1);
  CHECK(s.reserved_bytes == 400 * M);
  CHECK(s.active_bytes == 400 * M);
  // The stitched range is new address space over the freed blocks' physical chunks.
  CHECK(p != f.blocks[0]);
  CHECK(p != f.blocks[2]);
  const std::uint64_t first = handle_at(device, p), second = handle_at(device, p, 100 * M);
  CHECK(((first == f.handles[0] && second == f.handles[2]) || (first == f.handles[2] && second == f.handles[0])));
  allocator.verify();
  allocator.deallocate(p, 200 * M);
  allocator.verify();
  CHECK(allocator.stats().cached_stitch_bytes == 200 * M);
  CHECK(device.violations() == 0);
}

TEST_CASE("stitching: a cached stitched range is reused only while the chunks it needs are free") {
  sim_device device(1 * GiB);
  sim_stitching allocator(sim_provider{device}, sim_reserver{device}, stitch_everything());
  fragmented f(allocator, device);
  void* stitched = allocator.allocate(200 * M);
  allocator.deallocate(stitched, 200 * M);

  void* hole = allocator.allocate(100 * M);  // best fit: one of the stitch's chunks, in place
  void* other = allocator.allocate(200 * M);  // the cached range is not free: new memory instead
  CHECK(other != stitched);
  CHECK(allocator.stats().stitch_cache_hits == 0);
  CHECK(allocator.stats().reserved_bytes == 600 * M);
  allocator.verify();

  allocator.deallocate(hole, 100 * M);
  void* again = allocator.allocate(200 * M);
  CHECK(again == stitched);
  CHECK(allocator.stats().stitch_cache_hits == 1);
  CHECK(allocator.stats().stitches == 1);
  allocator.verify();
  allocator.deallocate(again, 200 * M);
  allocator.deallocate(other, 200 * M);
  for (int i : {1, 3}) allocator.deallocate(f.blocks[i], 100 * M);
  allocator.verify();
}

TEST_CASE("stitching: a cached range whose chunks were partly taken since is repaired, remapping only those") {
  sim_device device(500 * M);
  sim_stitching allocator(sim_provider{device}, sim_reserver{device}, stitch_everything());
  fragmented f(allocator, device);
  void* stitched = allocator.allocate(200 * M);
  allocator.deallocate(stitched, 200 * M);
  void* hole = allocator.allocate(40 * M);     // best fit: 20 of the range's 100 chunks, in place
  allocator.deallocate(f.blocks[1], 100 * M);  // free memory the range does not map
  const driver_call_counts before = allocator.stats().driver_calls;
  const std::uint64_t access_before = device.set_access_mappings();

  void* again = allocator.allocate(200 * M);
  CHECK(again == stitched);
  const statistics s = allocator.stats();
  CHECK(s.stitches == 1);
  CHECK(s.stitch_cache_hits == 1);
  CHECK(s.stitch_repairs == 1);
  CHECK(s.reserved_bytes == 400 * M);
  CHECK(s.active_bytes == 340 * M);  // with blocks[3]
  // Only the 20 taken chunks were replaced: unmapped, mapped anew, granted access in one call.
  const auto delta = [&](driver_call c) { return s.driver_calls[c] - before[c]; };
  CHECK(delta(driver_call::unmap) == 20);
  CHECK(delta(driver_call::map) == 20);
  CHECK(delta(driver_call::set_access) == 1);
  CHECK(device.set_access_mappings() - access_before == 20);
  CHECK(delta(driver_call::reserve) + delta(driver_call::create) + delta(driver_call::address_free) == 0);
  // The range no longer maps the hole's chunks; every chunk of it is distinct and accessible.
  std::set<std::uint64_t> hole_handles, range_handles;
  for (std::size_t off = 0; off < 40 * M; off += 2 * M) hole_handles.insert(handle_at(device, hole, off));
  for (std::size_t off = 0; off < 200 * M; off += 2 * M) {
    const auto where = device.resolve(static_cast<char*>(again) + off);
    REQUIRE(where.has_value());
    CHECK(where->accessible);
    CHECK(hole_handles.count(where->handle) == 0);
    range_handles.insert(where->handle);
  }
  CHECK(range_handles.size() == 100);
  allocator.verify();

  allocator.deallocate(again, 200 * M);
  allocator.deallocate(hole, 40 * M);
  allocator.deallocate(f.blocks[3], 100 * M);
  allocator.verify();
  allocator.release_cached();
  CHECK(allocator.stats().reserved_bytes == 0);
  CHECK(device.live_mappings() == 0);
  CHECK(device.violations() == 0);
}

TEST_CASE("stitching: a cached range with more than half its chunks taken is not repaired") {
  sim_device device(1 * GiB);
  sim_stitching allocator(sim_provider{device}, sim_reserver{device}, stitch_everything());
  fragmented f(allocator, device);
  void* stitched = allocator.allocate(200 * M);
  allocator.deallocate(stitched, 200 * M);
  void* hole = allocator.allocate(100 * M);   // one of the range's two blocks, whole
  void* more = allocator.allocate(20 * M);    // and part of the other: 120 of 200 MiB taken
  allocator.deallocate(f.blocks[1], 100 * M);
  allocator.deallocate(f.blocks[3], 100 * M);
  void* other = allocator.allocate(200 * M);
  CHECK(other != stitched);
  CHECK(allocator.stats().stitch_repairs == 0);
  CHECK(allocator.stats().stitch_cache_hits == 0);
  allocator.verify();
  for (auto [p, n] : {std::pair{other, 200 * M}, {hole, 100 * M}, {more, 20 * M}}) allocator.deallocate(p, n);
  allocator.verify();
  CHECK(device.violations() == 0);
}

TEST_CASE("stitching: a cached range smaller than the request grows in place, mapping only what it lacks") {
  sim_device device(1 * GiB);
  sim_stitching allocator(sim_provider{device}, sim_reserver{device}, stitch_everything());
  fragmented f(allocator, device);
  void* stitched = allocator.allocate(200 * M);
  // Address space for twice the range (stitch_reserve 2), beside the four 100 MiB segments.
  CHECK(device.reserved_bytes() == 400 * M + 400 * M);
  allocator.deallocate(stitched, 200 * M);
  allocator.deallocate(f.blocks[1], 100 * M);  // free memory the range does not map
  const driver_call_counts before = allocator.stats().driver_calls;
  const std::uint64_t access_before = device.set_access_mappings();

  void* grown = allocator.allocate(260 * M);
  CHECK(grown == stitched);
  const statistics s = allocator.stats();
  CHECK(s.stitches == 1);
  CHECK(s.stitch_cache_hits == 1);
  CHECK(s.stitch_grows == 1);
  CHECK(s.stitch_repairs == 0);
  CHECK(s.reserved_bytes == 400 * M);
  CHECK(s.active_bytes == 360 * M);  // with blocks[3]
  // The 30 chunks after the range's end were mapped and granted access in one call; nothing
  // else was unmapped, reserved or created.
  const auto delta = [&](driver_call c) { return s.driver_calls[c] - before[c]; };
  CHECK(delta(driver_call::map) == 30);
  CHECK(delta(driver_call::set_access) == 1);
  CHECK(device.set_access_mappings() - access_before == 30);
  CHECK(delta(driver_call::unmap) + delta(driver_call::reserve) + delta(driver_call::create) == 0);
  // The first 200 MiB still map blocks 0 and 2; the new 60 MiB map part of block 1.
  std::set<std::uint64_t> handles, block1;
  for (std::size_t off = 0; off < 100 * M; off += 2 * M) block1.insert(handle_at(device, f.blocks[1], off));
  for (std::size_t off = 0; off < 260 * M; off += 2 * M) {
    const auto where = device.resolve(static_cast<char*>(grown) + off);
    REQUIRE(where.has_value());
    CHECK(where->accessible);
    CHECK((block1.count(where->handle) == 1) == (off >= 200 * M));
    handles.insert(where->handle);
  }
  CHECK(handles.size() == 130);
  allocator.verify();

  allocator.deallocate(grown, 260 * M);
  CHECK(allocator.stats().cached_stitch_bytes == 260 * M);
  CHECK(allocator.allocate(200 * M) == stitched);  // the grown range serves smaller requests too
  CHECK(allocator.stats().stitch_cache_hits == 2);
  allocator.deallocate(stitched, 200 * M);
  allocator.deallocate(f.blocks[3], 100 * M);
  allocator.verify();
  allocator.release_cached();
  CHECK(allocator.stats().reserved_bytes == 0);
  CHECK(device.live_mappings() == 0);
  CHECK(device.reserved_bytes() == 0);  // the whole reservation was freed, not just what was mapped
  CHECK(device.violations() == 0);
}

TEST_CASE("stitching: stitch_reserve 1 reserves no room to grow, so a larger request stitches anew") {
  sim_device device(1 * GiB);
  config cfg = stitch_everything();
  cfg.stitch_reserve = 1.0;
  sim_stitching allocator(sim_provider{device}, sim_reserver{device}, cfg);
  fragmented f(allocator, device);
  void* stitched = allocator.allocate(200 * M);
  CHECK(device.reserved_bytes() == 400 * M + 200 * M);
  allocator.deallocate(stitched, 200 * M);
  allocator.deallocate(f.blocks[1], 100 * M);
  void* other = allocator.allocate(260 * M);
  CHECK(allocator.stats().stitches == 2);
  CHECK(allocator.stats().stitch_grows == 0);
  allocator.verify();
  allocator.deallocate(other, 260 * M);
  allocator.deallocate(f.blocks[3], 100 * M);
  allocator.release_cached();
  CHECK(device.reserved_bytes() == 0);
  CHECK(device.violations() == 0);
}

TEST_CASE("stitching: with grow_stitch a cached range grows in place over new memory when free chunks fall short") {
  sim_device device(500 * M);
  config cfg = stitch_everything();
  cfg.grow_stitch = true;
  sim_stitching allocator(sim_provider{device}, sim_reserver{device}, cfg);
  fragmented f(allocator, device);
  void* stitched = allocator.allocate(200 * M);
  allocator.deallocate(stitched, 200 * M);
  const driver_call_counts before = allocator.stats().driver_calls;
  void* grown = allocator.allocate(260 * M);  // 200 MiB free, all of it in the range
  CHECK(grown == stitched);
  const statistics s = allocator.stats();
  CHECK(s.stitch_grows == 1);
  CHECK(s.stitches == 1);
  CHECK(s.segments_created == 5);
  CHECK(s.reserved_bytes == 460 * M);  // only the 60 MiB shortfall is new
  const auto delta = [&](driver_call c) { return s.driver_calls[c] - before[c]; };
  CHECK(delta(driver_call::create) == 30);
  CHECK(delta(driver_call::map) == 30 + 30);  // in the new segment, then after the range's end
  CHECK(delta(driver_call::unmap) == 0);
  allocator.verify();
  allocator.deallocate(grown, 260 * M);
  for (int i : {1, 3}) allocator.deallocate(f.blocks[i], 100 * M);
  allocator.verify();
  CHECK(device.violations() == 0);
}

TEST_CASE("stitching: under memory pressure cached stitched mappings are dropped (StitchFree)") {
  sim_device device(400 * M);
  sim_stitching allocator(sim_provider{device}, sim_reserver{device}, stitch_everything());
  fragmented f(allocator, device);
  void* stitched = allocator.allocate(200 * M);
  allocator.deallocate(stitched, 200 * M);
  const std::size_t mappings = device.live_mappings();
  void* hole = allocator.allocate(100 * M);
  CHECK(allocator.try_allocate(200 * M) == nullptr);  // cannot fit: the ladder ends in StitchFree
  CHECK(allocator.stats().stitch_evictions == 1);
  CHECK(allocator.stats().cached_stitch_bytes == 0);
  // The stitch's 100 chunk mappings are gone, and so is the fully free segment (50 chunks) that
  // the ladder released before giving up.
  CHECK(device.live_mappings() == mappings - 100 - 50);
  CHECK(allocator.stats().reserved_bytes == 300 * M);
  allocator.verify();
  allocator.deallocate(hole, 100 * M);
  for (int i : {1, 3}) allocator.deallocate(f.blocks[i], 100 * M);
  allocator.verify();
}

TEST_CASE("stitching: reuse_limit bounds how much larger a reused stitched range may be") {
  for (double limit : {10.0, 2.0}) {
    CAPTURE(limit);
    sim_device device(800 * M);
    config cfg = stitch_everything();
    cfg.reuse_limit = limit;
    sim_stitching allocator(sim_provider{device}, sim_reserver{device}, cfg);
    std::vector<void*> blocks;
    for (int i = 0; i < 8; ++i) blocks.push_back(allocator.allocate(100 * M));
    for (int i = 0; i < 8; i += 2) allocator.deallocate(blocks[i], 100 * M);
    void* wide = allocator.allocate(400 * M);  // stitches all four free blocks
    allocator.deallocate(wide, 400 * M);
    void* narrow = allocator.allocate(150 * M);  // no single free block fits
    const statistics s = allocator.stats();
    if (limit == 10.0) {
      CHECK(narrow == wide);  // 400 <= 150 * 10: the cached range serves it, claiming 150 MiB
      CHECK(s.stitch_cache_hits == 1);
      CHECK(s.stitches == 1);
      // The unclaimed chunks stay free for others: 250 MiB more still fits on the full device.
      void* rest = allocator.allocate(250 * M);
      allocator.deallocate(rest, 250 * M);
    } else {
      CHECK(narrow != wide);  // 400 > 150 * 2: a new, exact stitch instead
      CHECK(s.stitch_cache_hits == 0);
      CHECK(s.stitches == 2);
    }
    allocator.verify();
    allocator.deallocate(narrow, 150 * M);
    for (int i = 1; i < 8; i += 2) allocator.deallocate(blocks[i], 100 * M);
    allocator.verify();
  }
}

TEST_CASE("stitching: frag_limit keeps small requests from stitching, they grow instead") {
  sim_device device(4 * GiB);
  config cfg;
  cfg.frag_limit = 512 * M;  // GMLake's default
  sim_stitching allocator(sim_provider{device}, sim_reserver{device}, cfg);
  fragmented f(allocator, device);
  void* p = allocator.allocate(200 * M);
  CHECK(allocator.stats().stitches == 0);
  CHECK(allocator.stats().reserved_bytes == 600 * M);
  void* q = allocator.allocate(600 * M);  // above the limit: stitches 200 MiB free... not enough,
  CHECK(allocator.stats().reserved_bytes == 1200 * M);  // and without grow_stitch it grows
  allocator.deallocate(p, 200 * M);
  allocator.deallocate(q, 600 * M);
  allocator.verify();
}

TEST_CASE("stitching: grow_stitch creates only the shortfall and stitches it with the free blocks") {
  sim_device device(4 * GiB);
  config cfg = stitch_everything();
  cfg.grow_stitch = true;
  sim_stitching allocator(sim_provider{device}, sim_reserver{device}, cfg);
  fragmented f(allocator, device);
  void* p = allocator.allocate(300 * M);
  const statistics s = allocator.stats();
  CHECK(s.stitches == 1);
  CHECK(s.reserved_bytes == 500 * M);  // 400 + the missing 100, not 400 + 300
  CHECK(s.active_bytes == 500 * M);
  allocator.verify();
  allocator.deallocate(p, 300 * M);
  allocator.verify();
}

TEST_CASE("stitching: defrag_level 1 grows while it can and stitches only when growth fails") {
  sim_device device(500 * M);
  config cfg = stitch_everything();
  cfg.defrag_level = 1;
  sim_stitching allocator(sim_provider{device}, sim_reserver{device}, cfg);
  fragmented f(allocator, device);
  void* grown = allocator.allocate(100 * M);  // fits as a primitive block: no stitch
  allocator.deallocate(grown, 100 * M);
  void* p = allocator.allocate(200 * M);  // 100 MiB of device left: growth fails, then it stitches
  CHECK(allocator.stats().stitches == 1);
  CHECK(allocator.stats().reserved_bytes <= 500 * M);
  allocator.deallocate(p, 200 * M);
  allocator.verify();
}

TEST_CASE("stitching: auto_gc caps cached stitched bytes by unmapping the least recently used") {
  sim_device device(2 * GiB);
  config cfg = stitch_everything();
  cfg.auto_gc = 250 * M;
  sim_stitching allocator(sim_provider{device}, sim_reserver{device}, cfg);
  std::vector<void*> blocks;
  for (int i = 0; i < 12; ++i) blocks.push_back(allocator.allocate(50 * M));
  for (int i = 0; i < 12; i += 2) allocator.deallocate(blocks[i], 50 * M);
  // Three different stitches of 100 MiB over the six free 50 MiB blocks, each cached in turn.
  void* a = allocator.allocate(100 * M);
  void* b = allocator.allocate(100 * M);
  void* c = allocator.allocate(100 * M);
  CHECK(allocator.stats().stitches == 3);
  const std::size_t mappings_live = device.live_mappings();
  allocator.deallocate(a, 100 * M);
  allocator.deallocate(b, 100 * M);
  CHECK(allocator.stats().stitch_evictions == 0);
  allocator.deallocate(c, 100 * M);  // 300 MiB cached > 250 MiB: the oldest (a) goes
  const statistics s = allocator.stats();
  CHECK(s.stitch_evictions == 1);
  CHECK(s.cached_stitch_bytes == 200 * M);
  CHECK(device.live_mappings() == mappings_live - 50);  // a's 50 chunk mappings are gone
  allocator.verify();
  for (int i = 1; i < 12; i += 2) allocator.deallocate(blocks[i], 50 * M);
  allocator.release_cached();
  CHECK(device.live_mappings() == 0);
  CHECK(device.violations() == 0);
}

TEST_CASE("stitching: the small pool never stitches and gives its empty blocks back before the pool grows") {
  sim_device device(10 * M);
  sim_stitching allocator(sim_provider{device}, sim_reserver{device}, stitch_everything());
  std::vector<void*> small;
  for (int i = 0; i < 2000; ++i) small.push_back(allocator.allocate(4096));  // ~8 MiB: 4 blocks
  CHECK(allocator.stats().reserved_bytes == 8 * M);
  CHECK(allocator.stats().stitches == 0);
  for (void* p : small) allocator.deallocate(p, 4096);
  void* large = allocator.allocate(10 * M);  // needs the small pool's memory back
  REQUIRE(large != nullptr);
  CHECK(allocator.stats().reserved_bytes <= 10 * M);
  allocator.verify();
  allocator.deallocate(large, 10 * M);
  allocator.verify();
}

TEST_CASE("stitching: invalid configurations are refused at construction") {
  sim_device device(1 * GiB);
  config cfg;
  cfg.chunk_size = 3 * M;  // not a multiple of the 2 MiB granularity
  CHECK_THROWS_AS(sim_stitching(sim_provider{device}, sim_reserver{device}, cfg), config_error);
  cfg = config{};
  cfg.reuse_limit = 0.5;
  CHECK_THROWS_AS(sim_stitching(sim_provider{device}, sim_reserver{device}, cfg), config_error);
  cfg = config{};
  cfg.chunk_size = 4 * M;  // small_segment (2 MiB) is not a multiple of it
  CHECK_THROWS_AS(sim_stitching(sim_provider{device}, sim_reserver{device}, cfg), config_error);
  cfg.small_segment = 4 * M;
  CHECK_NOTHROW(sim_stitching(sim_provider{device}, sim_reserver{device}, cfg));
}

TEST_CASE("stitching: larger chunks mean fewer driver calls for the same request") {
  for (std::size_t chunk : {2 * M, 32 * M}) {
    CAPTURE(chunk);
    sim_device device(4 * GiB);
    config cfg;
    cfg.chunk_size = chunk;
    cfg.small_segment = chunk;
    sim_stitching allocator(sim_provider{device}, sim_reserver{device}, cfg);
    void* p = allocator.allocate(1 * GiB);
    CHECK(allocator.stats().driver_calls[driver_call::create] == GiB / chunk);
    CHECK(allocator.stats().driver_calls[driver_call::map] == GiB / chunk);
    CHECK(allocator.stats().driver_calls[driver_call::set_access] == 1);
    allocator.deallocate(p, 1 * GiB);
  }
}

TEST_CASE("stitching: max_handle builds new memory from few large handles, none above an eighth of it") {
  sim_device device(8 * GiB);
  config cfg;
  cfg.max_handle = 1 * GiB;
  sim_stitching allocator(sim_provider{device}, sim_reserver{device}, cfg);
  void* p = allocator.allocate(2 * GiB);  // 256 MiB handles: 8 of them, not 1024 of 2 MiB
  CHECK(allocator.stats().driver_calls[driver_call::create] == 8);
  void* q = allocator.allocate(6 * M);  // 6 MiB: no handle over 6/8 MiB, so 2 MiB handles
  CHECK(allocator.stats().driver_calls[driver_call::create] == 8 + 3);
  allocator.deallocate(p, 2 * GiB);
  allocator.deallocate(q, 6 * M);
  allocator.verify();
}

TEST_CASE("stitching: min_handles sets the largest share of its segment one handle may take") {
  sim_device device(8 * GiB);
  // Not a structured binding: CAPTURE takes min_handles in a lambda, which clang < 16 refuses.
  for (const auto& row : {std::pair{8, 8}, std::pair{2, 2}, std::pair{1, 2}, std::pair{16, 16}}) {
    const int min_handles = row.first;
    const int creates = row.second;
    CAPTURE(min_handles);
    config cfg;
    cfg.max_handle = 1 * GiB;
    cfg.min_handles = min_handles;
    sim_stitching allocator(sim_provider{device}, sim_reserver{device}, cfg);
    // 2 GiB: handles of 2 GiB / min_handles (1 GiB at most: max_handle still caps them).
    void* p = allocator.allocate(2 * GiB);
    CHECK(allocator.stats().driver_calls[driver_call::create] == static_cast<std::uint64_t>(creates));
    void* q = allocator.allocate(24 * M);
    const std::uint64_t small = allocator.stats().driver_calls[driver_call::create] - static_cast<std::uint64_t>(creates);
    // 24 MiB: twelve 2 MiB handles with 8 or 16 (no handle above 3 or 1.5 MiB, 2 MiB the least);
    // 8 + 8 + 8 with 2 (none above 12 MiB); 16 + 8 with 1.
    CHECK(small == (min_handles >= 8 ? 12u : min_handles == 2 ? 3u : 2u));
    allocator.deallocate(p, 2 * GiB);
    allocator.deallocate(q, 24 * M);
    allocator.verify();
  }
}

TEST_CASE("stitching: with large handles only whole free handles are stitched, and the rest stays usable in place") {
  sim_device device(2 * GiB);
  config cfg = stitch_everything();
  cfg.max_handle = 64 * M;
  sim_stitching allocator(sim_provider{device}, sim_reserver{device}, cfg);
  // Two 512 MiB segments of eight 64 MiB handles; a live 32 MiB block then covers half of the
  // first handle of one of them.
  void* a = allocator.allocate(512 * M);
  void* b = allocator.allocate(512 * M);
  allocator.deallocate(a, 512 * M);
  allocator.deallocate(b, 512 * M);
  void* pin = allocator.allocate(32 * M);
  const auto before = allocator.free_memory();
  CHECK(before.whole_handles == (7 + 8) * 64 * M);
  CHECK(before.partial_handles == 32 * M);  // the other half of the pinned handle
  // 960 MiB of whole handles: a 950 MiB stitch fits without new memory.
  void* big = allocator.allocate(950 * M);
  CHECK(allocator.stats().stitches == 1);
  CHECK(allocator.stats().reserved_bytes == 1024 * M);
  // The half handle next to the pinned block is not stitchable, but serves in place.
  void* in_place = allocator.allocate(30 * M);
  CHECK(allocator.stats().reserved_bytes == 1024 * M);
  allocator.verify();
  for (auto [p, n] : {std::pair{big, 950 * M}, {in_place, 30 * M}, {pin, 32 * M}}) allocator.deallocate(p, n);
  allocator.verify();
  const auto after = allocator.free_memory();
  CHECK(after.whole_handles == 1024 * M);
  CHECK(after.partial_handles == 0);
  CHECK(device.violations() == 0);
}

namespace {

// Three 512 MiB segments of eight 64 MiB handles; the first and third stitched into a 1 GiB
// range, which is then cached; the second still live.
struct large_handles_cached {
  sim_device device{2 * GiB};
  sim_stitching allocator{sim_provider{device}, sim_reserver{device}, [] {
                            config cfg = stitch_everything();
                            cfg.max_handle = 64 * M;
                            return cfg;
                          }()};
  void* middle = nullptr;
  void* stitched = nullptr;
  large_handles_cached() {
    void* a = allocator.allocate(512 * M);
    middle = allocator.allocate(512 * M);
    void* c = allocator.allocate(512 * M);
    allocator.deallocate(a, 512 * M);
    allocator.deallocate(c, 512 * M);
    stitched = allocator.allocate(1024 * M);
    CHECK(allocator.stats().stitches == 1);
    allocator.deallocate(stitched, 1024 * M);
  }
};

}  // namespace

TEST_CASE("stitching: with large handles a cached range is repaired by a free handle of the same size") {
  large_handles_cached f;
  auto& [device, allocator, middle, stitched] = f;
  void* hole = allocator.allocate(32 * M);  // in place: half of one of the range's handles
  const std::uint64_t hole_handle = handle_at(device, hole);
  allocator.deallocate(middle, 512 * M);    // eight whole handles the range does not map
  const driver_call_counts before = allocator.stats().driver_calls;

  void* again = allocator.allocate(1024 * M);
  CHECK(again == stitched);
  const statistics s = allocator.stats();
  CHECK(s.stitches == 1);
  CHECK(s.stitch_repairs == 1);
  CHECK(s.reserved_bytes == 1536 * M);
  // The one handle the hole lies in was replaced whole, by a 64 MiB handle from b.
  const auto delta = [&](driver_call k) { return s.driver_calls[k] - before[k]; };
  CHECK(delta(driver_call::unmap) == 1);
  CHECK(delta(driver_call::map) == 1);
  CHECK(delta(driver_call::set_access) == 1);
  CHECK(delta(driver_call::reserve) + delta(driver_call::create) == 0);
  std::set<std::uint64_t> handles;
  for (std::size_t off = 0; off < 1024 * M; off += 64 * M) {
    const auto where = device.resolve(static_cast<char*>(again) + off);
    REQUIRE(where.has_value());
    CHECK(where->accessible);
    CHECK(where->handle != hole_handle);
    handles.insert(where->handle);
  }
  CHECK(handles.size() == 16);
  allocator.verify();
  allocator.deallocate(again, 1024 * M);
  allocator.deallocate(hole, 32 * M);
  allocator.verify();
  allocator.release_cached();
  CHECK(allocator.stats().reserved_bytes == 0);
  CHECK(device.live_mappings() == 0);
  CHECK(device.violations() == 0);
}

TEST_CASE("stitching: with large handles a cached range grows in place by whole free handles") {
  large_handles_cached f;
  auto& [device, allocator, middle, stitched] = f;
  allocator.deallocate(middle, 512 * M);
  const driver_call_counts before = allocator.stats().driver_calls;

  void* grown = allocator.allocate(1100 * M);  // 76 MiB more: two 64 MiB handles appended
  CHECK(grown == stitched);
  const statistics s = allocator.stats();
  CHECK(s.stitches == 1);
  CHECK(s.stitch_grows == 1);
  CHECK(s.stitch_repairs == 0);
  CHECK(s.reserved_bytes == 1536 * M);
  const auto delta = [&](driver_call k) { return s.driver_calls[k] - before[k]; };
  CHECK(delta(driver_call::map) == 2);
  CHECK(delta(driver_call::set_access) == 1);
  CHECK(delta(driver_call::unmap) + delta(driver_call::reserve) + delta(driver_call::create) == 0);
  for (std::size_t off = 0; off < 1152 * M; off += 64 * M) {
    const auto where = device.resolve(static_cast<char*>(grown) + off);
    REQUIRE(where.has_value());
    CHECK(where->accessible);
  }
  allocator.verify();
  allocator.deallocate(grown, 1100 * M);
  CHECK(allocator.stats().cached_stitch_bytes == 1152 * M);  // whole handles: more than asked
  allocator.verify();
  allocator.release_cached();
  CHECK(allocator.stats().reserved_bytes == 0);
  CHECK(device.live_mappings() == 0);
  CHECK(device.violations() == 0);
}

// ------------------------------------------------------------------------- rollback

namespace {

using faulty_stitching = stitching_allocator<fault_injecting_provider<sim_provider>,
                                             fault_injecting_reserver<sim_reserver>>;

struct snapshot {
  std::size_t active, allocated, reserved, cached_stitches, physical, handles, mappings, address_space;
  std::uint64_t allocations, stitches;
  template <class A>
  snapshot(const A& allocator, const sim_device& device)
      : active(allocator.stats().active_bytes),
        allocated(allocator.stats().allocated_bytes),
        reserved(allocator.stats().reserved_bytes),
        cached_stitches(allocator.stats().cached_stitch_bytes),
        physical(device.physical_bytes()),
        handles(device.live_handles()),
        mappings(device.live_mappings()),
        address_space(device.reserved_bytes()),
        allocations(allocator.stats().allocations),
        stitches(allocator.stats().stitches) {}
  friend bool operator==(const snapshot&, const snapshot&) = default;
};

// Builds a scenario fresh for every n, fails its nth backend call inside `request`, and checks
// that a failed request left allocator and device exactly as they were, and that a request that
// succeeded by another path left them consistent. Returns how many call sites were exercised.
int fail_every_call_site(std::size_t capacity, config cfg,
                         const std::function<void(faulty_stitching&, const sim_device&)>& prepare,
                         std::size_t request) {
  int sites = 0;
  for (std::uint64_t n = 1;; ++n) {
    CAPTURE(n);
    sim_device device(capacity);
    fault_plan plan;
    faulty_stitching allocator(fault_injecting_provider<sim_provider>(sim_provider{device}, plan),
                               fault_injecting_reserver<sim_reserver>(sim_reserver{device}, plan), cfg);
    prepare(allocator, device);
    const snapshot before(allocator, device);
    plan.fail_nth_call(n);
    void* p = allocator.try_allocate(request);
    const bool injected = plan.faults_injected() > 0;
    plan.never_fail();
    allocator.verify();
    REQUIRE(device.violations() == 0);
    if (!injected) {
      REQUIRE(p != nullptr);  // past the last call site: the request runs clean
      allocator.deallocate(p, request);
      break;
    }
    ++sites;
    if (p == nullptr) {
      CHECK(snapshot(allocator, device) == before);
      p = allocator.try_allocate(request);  // and the allocator is usable afterwards
      REQUIRE(p != nullptr);
    }
    allocator.deallocate(p, request);
    allocator.verify();
    allocator.release_cached();
    REQUIRE(device.violations() == 0);
  }
  return sites;
}

}  // namespace

TEST_CASE("rollback: a failure at any call of a growth leaves everything as it was") {
  const int sites = fail_every_call_site(
      4 * GiB, config{}, [](faulty_stitching&, const sim_device&) {}, 64 * M);
  CHECK(sites >= 32 + 1 + 32 + 1);  // 32 creates, a reserve, 32 maps, a set-access
}

TEST_CASE("rollback: a failure at any call of growing a segment in place leaves everything as it was") {
  config cfg;
  cfg.segment_reserve = 1 * GiB;
  const int sites = fail_every_call_site(
      4 * GiB, cfg,
      [](faulty_stitching& a, const sim_device&) {
        a.set_live_report(nullptr);  // stays live to the end, on purpose
        a.allocate(3 * M);           // a segment with room, its last 1 MiB free
      },
      64 * M);
  CHECK(sites >= 32 + 32 + 1);  // 32 creates, 32 maps, a set-access; no reserve
}

TEST_CASE("rollback: a failure at any call of a stitch leaves everything as it was") {
  const int sites = fail_every_call_site(
      400 * M, stitch_everything(),
      [](faulty_stitching& a, const sim_device& d) { fragmented f(a, d); }, 200 * M);
  CHECK(sites >= 1 + 100 + 1);  // a reserve, 100 maps, a set-access
}

TEST_CASE("rollback: a failure at any call of a grow-and-stitch leaves everything as it was") {
  config cfg = stitch_everything();
  cfg.grow_stitch = true;
  const int sites = fail_every_call_site(
      500 * M, cfg, [](faulty_stitching& a, const sim_device& d) { fragmented f(a, d); }, 300 * M);
  CHECK(sites >= (50 + 1 + 50 + 1) + (1 + 150 + 1));  // the new segment, then the stitch
}

TEST_CASE("rollback: a failure at any call of a repair forgets the cached range and serves the request anew") {
  const int sites = fail_every_call_site(
      500 * M, stitch_everything(),
      [](faulty_stitching& a, const sim_device& d) {
        fragmented f(a, d);
        a.deallocate(a.allocate(200 * M), 200 * M);  // cached over blocks 0 and 2
        (void)a.allocate(40 * M);                     // 20 of its chunks taken in place
        a.deallocate(f.blocks[1], 100 * M);           // spare chunks elsewhere
      },
      200 * M);
  CHECK(sites >= 20 + 1);  // 20 maps, a set-access (unmaps cannot fail)
}

TEST_CASE("rollback: a failure at any call of growing a cached range forgets it and serves the request anew") {
  const int sites = fail_every_call_site(
      1 * GiB, stitch_everything(),
      [](faulty_stitching& a, const sim_device& d) {
        fragmented f(a, d);
        a.deallocate(a.allocate(200 * M), 200 * M);  // cached over blocks 0 and 2, room for 400 MiB
        a.deallocate(f.blocks[1], 100 * M);           // free chunks to grow it by
      },
      260 * M);
  CHECK(sites >= 30 + 1);  // 30 maps, a set-access
}

TEST_CASE("rollback: a failure at any call of growing a cached range over new memory leaves no segment behind") {
  config cfg = stitch_everything();
  cfg.grow_stitch = true;
  const int sites = fail_every_call_site(
      500 * M, cfg,
      [](faulty_stitching& a, const sim_device& d) {
        fragmented f(a, d);
        a.deallocate(a.allocate(200 * M), 200 * M);
      },
      260 * M);
  CHECK(sites >= (30 + 1 + 30 + 1) + (30 + 1));  // the new segment, then the growth
}

TEST_CASE("rollback: a failure while the small pool grows leaves everything as it was") {
  const int sites = fail_every_call_site(
      4 * GiB, config{}, [](faulty_stitching&, const sim_device&) {}, 1000);
  CHECK(sites >= 4);  // a create, a reserve, a map, a set-access
}

TEST_CASE("stitching: reset_peaks restarts the peaks from now and returns the statistics before") {
  sim_device device(GiB, 2 * M);
  stitching_allocator<sim_provider, sim_reserver> a(sim_provider{device}, sim_reserver{device});
  void* big = a.allocate(64 * M);
  void* small = a.allocate(8 * M);
  a.deallocate(big, 64 * M);
  const statistics before = a.reset_peaks();
  CHECK(before.peak_active_bytes == 72 * M);
  CHECK(before.peak_reserved_bytes == 72 * M);
  const statistics now = a.stats();
  CHECK(now.peak_active_bytes == 8 * M);
  CHECK(now.peak_allocated_bytes == 8 * M);
  CHECK(now.peak_reserved_bytes == now.reserved_bytes);
  void* again = a.allocate(16 * M);
  CHECK(a.stats().peak_active_bytes == 24 * M);
  a.deallocate(again, 16 * M);
  a.deallocate(small, 8 * M);
  a.verify();
}

TEST_CASE("stitching: large requests are split at large_round_to, so a block's rounding tail serves the next one") {
  const auto run = [](std::size_t large_round_to) {
    sim_device device(64 * M);
    config cfg = stitch_everything();
    cfg.small_limit = 256 * KiB;
    cfg.large_round_to = large_round_to;
    sim_stitching allocator(sim_provider{device}, sim_reserver{device}, cfg);
    void* a = allocator.allocate(5 * M + 1000);  // a 6 MiB segment
    void* b = allocator.allocate(512 * KiB);     // a large request, in a's tail or not
    allocator.verify();
    const statistics s = allocator.stats();
    const bool tail = static_cast<char*>(b) == static_cast<char*>(a) + 5 * M + 1024;
    allocator.deallocate(b, 512 * KiB);
    allocator.deallocate(a, 5 * M + 1000);
    allocator.verify();
    return std::pair{s.reserved_bytes, tail};
  };
  CHECK(run(512) == std::pair{6 * M, true});     // the default: 1,024 bytes of rounding, the rest serves b
  CHECK(run(0) == std::pair{8 * M, false});      // whole chunks: a holds all 6 MiB, b takes a new one
  CHECK(run(64 * KiB).first == 6 * M);
}

TEST_CASE("stitching: with segment_reserve a segment grows in place, so a block's tail in its last handle starts the next") {
  const auto run = [](std::size_t segment_reserve) {
    sim_device device(1 * GiB);
    config cfg;
    cfg.segment_reserve = segment_reserve;
    sim_stitching allocator(sim_provider{device}, sim_reserver{device}, cfg);
    void* a = allocator.allocate(3 * M);  // a 4 MiB segment, 1 MiB of it free
    void* b = allocator.allocate(3 * M);  // no free block fits
    allocator.verify();
    const bool adjacent = static_cast<char*>(b) == static_cast<char*>(a) + 3 * M;
    const std::size_t reserved = allocator.stats().reserved_bytes;
    allocator.deallocate(b, 3 * M);
    allocator.deallocate(a, 3 * M);
    allocator.release_cached();
    CHECK(device.physical_bytes() == 0);
    CHECK(device.reserved_bytes() == 0);
    CHECK(device.violations() == 0);
    return std::pair{reserved, adjacent};
  };
  CHECK(run(0) == std::pair{8 * M, false});         // a segment each: 1 MiB stranded in each
  CHECK(run(256 * M) == std::pair{6 * M, true});    // b starts in a's tail: 2 MiB more, not 4
  CHECK(run(256 * GiB) == std::pair{6 * M, true});  // reserved up to the device's memory only
}

TEST_CASE("stitching: release_cached gives back free handles inside a segment that grows, live blocks kept") {
  sim_device device(1 * GiB);
  config cfg = stitch_everything();
  cfg.segment_reserve = 1 * GiB;
  sim_stitching allocator(sim_provider{device}, sim_reserver{device}, cfg);
  void* a = allocator.allocate(3 * M);
  void* b = allocator.allocate(40 * M);
  void* c = allocator.allocate(5 * M);
  void* d = allocator.allocate(7 * M);
  CHECK(static_cast<char*>(d) == static_cast<char*>(a) + 48 * M);  // one segment, end to end
  const std::uint64_t a_handle = handle_at(device, a), c_handle = handle_at(device, c, 4 * M);
  allocator.deallocate(b, 40 * M);
  allocator.deallocate(d, 7 * M);
  CHECK(allocator.stats().reserved_bytes == 56 * M);
  allocator.release_cached();
  allocator.verify();
  // Kept: the handles a and c touch, [0, 4) and [42, 48) MiB; b's [4, 42) and d's [48, 56) went.
  CHECK(allocator.stats().reserved_bytes == 10 * M);
  CHECK(device.physical_bytes() == 10 * M);
  CHECK(handle_at(device, a) == a_handle);
  CHECK(handle_at(device, c, 4 * M) == c_handle);
  void* e = allocator.allocate(30 * M);  // served by new memory: nothing of the freed range is mapped
  allocator.verify();
  allocator.deallocate(e, 30 * M);
  allocator.deallocate(c, 5 * M);
  allocator.deallocate(a, 3 * M);
  allocator.release_cached();
  allocator.verify();
  CHECK(allocator.stats().reserved_bytes == 0);
  CHECK(device.physical_bytes() == 0);
  CHECK(device.live_mappings() == 0);
  CHECK(device.reserved_bytes() == 0);  // the shared range went with its last segment
  CHECK(device.violations() == 0);
}

TEST_CASE("stitching: blocks split below the chunk give stitches only their whole handles") {
  sim_device device(12 * M);
  config cfg = stitch_everything();
  cfg.small_limit = 0;
  sim_stitching allocator(sim_provider{device}, sim_reserver{device}, cfg);
  // Two 4 MiB segments of 2 MiB handles, each carved into 3 MiB and 1 MiB blocks.
  void* a = allocator.allocate(3 * M);
  void* b = allocator.allocate(1 * M);
  void* c = allocator.allocate(3 * M);
  void* d = allocator.allocate(1 * M);
  CHECK(static_cast<char*>(b) == static_cast<char*>(a) + 3 * M);
  CHECK(allocator.stats().reserved_bytes == 8 * M);
  allocator.deallocate(a, 3 * M);
  allocator.deallocate(c, 3 * M);
  // 6 MiB free, of which 4 MiB are whole handles (the last MiB of each block shares its handle
  // with b or d): a 4 MiB request is stitched from them without new memory.
  void* p = allocator.allocate(4 * M);
  allocator.verify();
  CHECK(allocator.stats().stitches == 1);
  CHECK(allocator.stats().reserved_bytes == 8 * M);
  CHECK(std::set{handle_at(device, p), handle_at(device, p, 2 * M)} == std::set{handle_at(device, a), handle_at(device, c)});
  // The two 1 MiB halves left over are no whole handle: a 2 MiB request takes new memory.
  void* q = allocator.allocate(2 * M);
  CHECK(allocator.stats().reserved_bytes == 10 * M);
  for (auto [ptr, size] : {std::pair{p, 4 * M}, {q, 2 * M}, {b, 1 * M}, {d, 1 * M}}) allocator.deallocate(ptr, size);
  allocator.verify();
  CHECK(allocator.stats().active_bytes == 0);
}

TEST_CASE("stitching: a request above the memory limit fails before any work proportional to it" *
          doctest::timeout(30)) {
  // A device far larger than the limit, so that only the limit stands in the way; GMLake's
  // growth (one handle per chunk) and glake's grow_stitch are the paths that plan the most.
  sim_device device(std::size_t{1} << 52);
  config cfg = stitch_everything();
  cfg.memory_limit = 1 * GiB;
  cfg.grow_stitch = true;
  using gmlake_stitching = stitching_allocator<sim_provider, sim_reserver, best_fit_tail_stitching, lru_eviction,
                                               no_lock, gmlake_admission, chunk_growth>;
  sim_stitching ours(sim_provider{device}, sim_reserver{device}, cfg);
  gmlake_stitching theirs(sim_provider{device}, sim_reserver{device}, cfg);
  const auto check_refuses = [&](auto& allocator) {
    void* held = allocator.allocate(300 * M);
    void* cached = allocator.allocate(500 * M);
    allocator.deallocate(cached, 500 * M);
    const statistics before = allocator.stats();
    std::uint64_t failed = before.failed_allocations;
    for (std::size_t bytes : {GiB + 1, GiB + 2 * M, 2 * GiB, std::size_t{1} << 40, std::size_t{1} << 50,
                              std::size_t{1} << 62, ~std::size_t{0} - 1, ~std::size_t{0}}) {
      CAPTURE(bytes);
      CHECK(allocator.try_allocate(bytes) == nullptr);
      CHECK(allocator.stats().failed_allocations == ++failed);
      try {
        (void)allocator.allocate(bytes);
        FAIL("allocate above the memory limit returned");
      } catch (const out_of_memory& e) {
        CHECK(e.requested_bytes() == bytes);
        CHECK(std::string(e.what()).find("memory limit 1.00 GiB") != std::string::npos);
      }
      CHECK(allocator.stats().failed_allocations == ++failed);
    }
    const statistics after = allocator.stats();
    CHECK(after.driver_calls == before.driver_calls);
    CHECK(after.reserved_bytes == before.reserved_bytes);  // the cache was not emptied for them
    allocator.verify();
    // What fits under the limit still fits: the 500 MiB block cached and 200 MiB more.
    void* fits = allocator.allocate(700 * M);
    CHECK(fits != nullptr);
    allocator.deallocate(fits, 700 * M);
    allocator.deallocate(held, 300 * M);
  };
  check_refuses(ours);
  check_refuses(theirs);
  CHECK(device.violations() == 0);
}

TEST_CASE("stitching: set_memory_limit gives cached memory back at once and holds growth, live blocks untouched") {
  sim_device device(4 * GiB);
  sim_stitching allocator(sim_provider{device}, sim_reserver{device});
  CHECK(allocator.memory_limit() == 0);
  std::vector<void*> blocks;
  for (int i = 0; i < 6; ++i) blocks.push_back(allocator.allocate(64 * M));
  for (int i = 0; i < 6; i += 2) allocator.deallocate(blocks[i], 64 * M);  // 192 MiB live, 192 cached
  REQUIRE(allocator.stats().reserved_bytes == 384 * M);

  allocator.set_memory_limit(256 * M);
  CHECK(allocator.memory_limit() == 256 * M);
  CHECK(allocator.settings().memory_limit == 256 * M);
  CHECK(allocator.stats().reserved_bytes == 192 * M);  // the cached part went back at once
  CHECK(device.physical_bytes() == 192 * M);
  for (int i = 1; i < 6; i += 2) CHECK(device.resolve(blocks[i]).has_value());
  CHECK(allocator.try_allocate(128 * M) == nullptr);  // 192 + 128 > 256
  CHECK(allocator.stats().failed_allocations == 1);
  void* fits = allocator.allocate(64 * M);  // 256: exactly the limit
  allocator.verify();

  // A limit below what is live: nothing live is touched, growth waits until enough is freed.
  allocator.set_memory_limit(100 * M);
  CHECK(allocator.stats().reserved_bytes == 256 * M);
  CHECK(allocator.try_allocate(2 * M) == nullptr);
  allocator.deallocate(fits, 64 * M);
  allocator.deallocate(blocks[1], 64 * M);
  allocator.deallocate(blocks[3], 64 * M);  // 64 MiB live
  void* small = allocator.allocate(30 * M);  // served from the cache, which may stay above the limit
  CHECK(allocator.stats().reserved_bytes == 256 * M);
  CHECK(allocator.try_allocate(200 * M) == nullptr);  // more than the limit: refused at once
  CHECK(allocator.try_allocate(100 * M) == nullptr);  // growth past the limit: refused, after the
  CHECK(allocator.stats().reserved_bytes == 128 * M);  // cache went back to make room
  allocator.release_cached();
  CHECK(allocator.stats().reserved_bytes == 128 * M);  // the two handles holding blocks[5] and small
  allocator.verify();

  allocator.set_memory_limit(0);  // no limit again
  void* big = allocator.allocate(1 * GiB);
  CHECK(big != nullptr);
  allocator.deallocate(big, 1 * GiB);
  allocator.deallocate(small, 30 * M);
  allocator.deallocate(blocks[5], 64 * M);
  allocator.verify();
}

// ------------------------------------------------------------------ visit_state, observer, retain

namespace {

// What visit_state showed, kept for checks.
struct state_record {
  struct seg {
    segment_view view;
    std::vector<block_view> blocks;
  };
  struct range {
    stitched_view view;
    std::vector<stitched_piece_view> pieces;
  };
  std::vector<seg> segments;
  std::vector<range> ranges;
  void segment(const segment_view& s) { segments.push_back({s, {}}); }
  void block(const block_view& b) {
    REQUIRE(!segments.empty());
    segments.back().blocks.push_back(b);
  }
  void stitched(const stitched_view& r) { ranges.push_back({r, {}}); }
  void piece(const stitched_piece_view& p) {
    REQUIRE(!ranges.empty());
    ranges.back().pieces.push_back(p);
  }

  // Every segment is tiled by its blocks; returns the sum of the segments' sizes.
  std::size_t check_tiling() const {
    std::size_t total = 0;
    for (const seg& s : segments) {
      std::uintptr_t at = s.view.address;
      for (const block_view& b : s.blocks) {
        CHECK(b.address == at);
        at += b.size;
      }
      CHECK(at == s.view.address + s.view.size);
      total += s.view.size;
    }
    return total;
  }
  const block_view* block_at(const void* p) const {
    for (const seg& s : segments) {
      for (const block_view& b : s.blocks) {
        if (b.address == reinterpret_cast<std::uintptr_t>(p)) return &b;
      }
    }
    return nullptr;
  }
};
static_assert(state_visitor<state_record>);

struct event_record {
  std::vector<memory_event> events;
  static void observe(void* context, const memory_event& e) noexcept {
    static_cast<event_record*>(context)->events.push_back(e);
  }
  std::vector<memory_action> actions() const {
    std::vector<memory_action> out;
    for (const auto& e : events) out.push_back(e.action);
    return out;
  }
};

}  // namespace

TEST_CASE("memory observer: a segment grown in place or split is told of as it is shown afterwards") {
  sim_device device(1 * GiB);
  config cfg = stitch_everything();
  cfg.segment_reserve = 1 * GiB;
  sim_stitching allocator(sim_provider{device}, sim_reserver{device}, cfg);
  event_record seen;
  allocator.set_memory_observer(&event_record::observe, &seen);
  // The segments the history leaves (segment_alloc adds one at its address, segment_free removes
  // exactly that one) and those visit_state shows.
  const auto agree = [&] {
    std::map<std::uintptr_t, std::size_t> told;
    for (const memory_event& e : seen.events) {
      if (e.action == memory_action::segment_alloc) {
        CHECK(told.emplace(e.address, e.size).second);
      } else if (e.action == memory_action::segment_free) {
        const auto it = told.find(e.address);
        REQUIRE(it != told.end());
        CHECK(it->second == e.size);
        told.erase(it);
      }
    }
    state_record r;
    allocator.visit_state(r);
    std::map<std::uintptr_t, std::size_t> shown;
    for (const auto& sg : r.segments) shown.emplace(sg.view.address, sg.view.size);
    return told == shown;
  };
  void* a = allocator.allocate(3 * M);
  void* b = allocator.allocate(40 * M);  // grows the segment in place
  void* c = allocator.allocate(5 * M);
  CHECK(static_cast<char*>(c) == static_cast<char*>(a) + 43 * M);
  CHECK(agree());
  allocator.deallocate(b, 40 * M);
  allocator.release_cached();  // b's whole handles split off and given back
  CHECK(allocator.stats().reserved_bytes < 48 * M);
  CHECK(agree());
  allocator.deallocate(a, 3 * M);
  allocator.deallocate(c, 5 * M);
  allocator.release_cached();
  CHECK(agree());
  CHECK(allocator.stats().reserved_bytes == 0);
  allocator.set_memory_observer(nullptr, nullptr);
}

TEST_CASE("visit_state: segments tiled by their blocks, covering the reserved bytes, small blocks in place") {
  sim_device device(1 * GiB);
  sim_stitching allocator(sim_provider{device}, sim_reserver{device});
  void* large = allocator.allocate(5 * M + 100);
  void* small = allocator.allocate(1000);
  void* freed = allocator.allocate(20 * M);
  allocator.deallocate(freed, 20 * M);
  state_record r;
  allocator.visit_state(r);
  CHECK(r.check_tiling() == allocator.stats().reserved_bytes);
  CHECK(r.ranges.empty());
  const block_view* l = r.block_at(large);
  REQUIRE(l != nullptr);
  CHECK(l->state == block_state::allocated);
  CHECK(l->requested == 5 * M + 100);
  CHECK(l->small_segment == 0);
  const block_view* s = r.block_at(small);
  REQUIRE(s != nullptr);
  CHECK(s->state == block_state::allocated);
  CHECK(s->requested == 1000);
  CHECK(s->small_segment != 0);  // the small pool's segment, a borrowed block of a large segment
  std::size_t allocated = 0, requested = 0;
  for (const auto& seg : r.segments) {
    for (const auto& b : seg.blocks) {
      if (b.state == block_state::free) {
        CHECK(b.requested == 0);
      } else {
        allocated += b.size;
        requested += b.requested;
      }
    }
  }
  CHECK(allocated == allocator.stats().allocated_bytes);
  CHECK(requested == allocator.stats().active_bytes);
  allocator.deallocate(large, 5 * M + 100);
  allocator.deallocate(small, 1000);
}

TEST_CASE("visit_state: a live stitched range, its pieces and the blocks it claims") {
  sim_device device(400 * M);
  sim_stitching allocator(sim_provider{device}, sim_reserver{device}, stitch_everything());
  fragmented f(allocator, device);
  void* p = allocator.allocate(200 * M);
  REQUIRE(allocator.stats().stitches == 1);
  state_record r;
  allocator.visit_state(r);
  CHECK(r.check_tiling() == 400 * M);
  REQUIRE(r.ranges.size() == 1);
  const auto& range = r.ranges.front();
  CHECK(range.view.address == reinterpret_cast<std::uintptr_t>(p));
  CHECK(range.view.live);
  CHECK(range.view.claimed == 200 * M);
  CHECK(range.view.requested == 200 * M);
  CHECK(range.view.state == block_state::allocated);
  std::size_t pieces = 0, claimed = 0;
  for (const auto& pc : range.pieces) {
    pieces += pc.size;
    const block_view* home = r.block_at(reinterpret_cast<void*>(pc.address));
    REQUIRE(home != nullptr);
    CHECK(home->stitched_into == range.view.address);
    CHECK(home->requested == 0);
    claimed += home->size;
  }
  CHECK(range.pieces.size() == 2);
  CHECK(pieces == range.view.size);
  CHECK(claimed == 200 * M);
  allocator.deallocate(p, 200 * M);
  state_record after;
  allocator.visit_state(after);
  REQUIRE(after.ranges.size() == 1);
  CHECK(!after.ranges.front().view.live);  // cached, claiming nothing
  for (const auto& pc : after.ranges.front().pieces) {
    CHECK(after.block_at(reinterpret_cast<void*>(pc.address))->stitched_into == 0);
  }
  for (int i : {1, 3}) allocator.deallocate(f.blocks[i], 100 * M);
}

TEST_CASE("visit_state: a record_stream'd free waiting for its stream shows as pending_free") {
  using evented_stitching = stitching_allocator<sim_provider, testing::evented_reserver>;
  sim_device device(1 * GiB);
  testing::event_log log;
  evented_stitching allocator(sim_provider{device}, testing::evented_reserver{device, log});
  const stream_ref A{1}, B{2};
  void* p = allocator.allocate(8 * M, A);
  allocator.record_stream(p, B);
  allocator.deallocate(p, 8 * M, A);
  state_record r;
  allocator.visit_state(r);
  REQUIRE(r.block_at(p) != nullptr);
  CHECK(r.block_at(p)->state == block_state::pending_free);
  CHECK(r.block_at(p)->requested == 8 * M);
  log.complete(B);
  allocator.deallocate(allocator.allocate(1 * M, A), 1 * M, A);  // runs the deferred free
  state_record done;
  allocator.visit_state(done);
  const block_view* b = done.block_at(p);
  CHECK((b == nullptr || b->state == block_state::free));
}

TEST_CASE("memory observer: segments added and given back, frees completed, stitched ranges mapped") {
  sim_device device(400 * M);
  sim_stitching allocator(sim_provider{device}, sim_reserver{device}, stitch_everything());
  event_record seen;
  allocator.set_memory_observer(&event_record::observe, &seen);
  fragmented f(allocator, device);  // four segments of 100 MiB, two freed
  using enum memory_action;
  CHECK(seen.actions() == std::vector{segment_alloc, segment_alloc, segment_alloc, segment_alloc, free_completed,
                                      free_completed});
  CHECK(seen.events[4].address == reinterpret_cast<std::uintptr_t>(f.blocks[0]));
  CHECK(seen.events[4].size == 100 * M);
  seen.events.clear();
  void* p = allocator.allocate(200 * M);
  REQUIRE(seen.events.size() == 1);
  CHECK(seen.events[0].action == segment_map);
  CHECK(seen.events[0].address == reinterpret_cast<std::uintptr_t>(p));
  CHECK(seen.events[0].size == 200 * M);
  allocator.deallocate(p, 200 * M);
  CHECK(seen.actions() == std::vector{segment_map, free_completed, segment_unmap});
  seen.events.clear();
  allocator.release_cached();
  CHECK(seen.actions() == std::vector{segment_free, segment_free});
  allocator.set_memory_observer(nullptr, nullptr);
  for (int i : {1, 3}) allocator.deallocate(f.blocks[i], 100 * M);
  CHECK(seen.events.size() == 2);  // nobody is told any more
}

TEST_CASE("retain_memory: nothing is released, unmapped or remapped until it is lifted") {
  sim_device device(400 * M);
  sim_stitching allocator(sim_provider{device}, sim_reserver{device}, stitch_everything());
  fragmented f(allocator, device);
  void* stitched = allocator.allocate(200 * M);
  allocator.deallocate(stitched, 200 * M);
  allocator.retain_memory(true);
  const std::size_t mappings = device.live_mappings();
  allocator.release_cached();
  CHECK(allocator.stats().reserved_bytes == 400 * M);
  CHECK(allocator.stats().cached_stitch_bytes == 200 * M);
  CHECK(device.live_mappings() == mappings);
  // The request that StitchFree and releasing would serve (see above) fails instead.
  void* hole = allocator.allocate(100 * M);
  CHECK(allocator.try_allocate(200 * M) == nullptr);
  CHECK(allocator.stats().stitch_evictions == 0);
  CHECK(device.live_mappings() == mappings);
  CHECK(allocator.stats().reserved_bytes == 400 * M);
  // Its own free memory still serves it: the cached range, reused as it is.
  allocator.deallocate(hole, 100 * M);
  void* again = allocator.allocate(200 * M);
  CHECK(again == stitched);
  allocator.deallocate(again, 200 * M);
  allocator.verify();
  allocator.retain_memory(false);
  allocator.release_cached();
  CHECK(allocator.stats().reserved_bytes == 200 * M);  // the two live blocks' segments
  for (int i : {1, 3}) allocator.deallocate(f.blocks[i], 100 * M);
  allocator.verify();
}

TEST_CASE("stitching: release_cached(bytes) gives back free segments until that many went back") {
  sim_device device(4 * GiB);
  sim_stitching allocator(sim_provider{device}, sim_reserver{device});
  constexpr std::size_t M = MiB;
  // Four segments of 64 MiB (each request is one segment of its own), all freed.
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(allocator.allocate(64 * M));
  void* live = allocator.allocate(64 * M);
  for (void* p : blocks) allocator.deallocate(p, 64 * M);
  const std::size_t held = allocator.stats().reserved_bytes;
  REQUIRE(held >= 5 * 64 * M);

  const std::size_t released = allocator.release_cached(100 * M);
  CHECK(released >= 100 * M);
  CHECK(released < held - 64 * M);  // not everything free went back
  CHECK(allocator.stats().reserved_bytes == held - released);
  CHECK(device.physical_bytes() == held - released);
  // Asking for more than is free gives back what is free; the live block's segment stays.
  const std::size_t rest = allocator.release_cached(10 * GiB);
  CHECK(allocator.stats().reserved_bytes == held - released - rest);
  CHECK(allocator.stats().reserved_bytes >= 64 * M);
  CHECK(allocator.release_cached(M) == 0);
  allocator.verify();
  allocator.deallocate(live, 64 * M);
  CHECK(device.violations() == 0);
}
