// The stitching allocator's invariant check (stitching_allocator::verify): every block, segment,
// stitched range and counter agrees with every other. Included at the end of its header.
#pragma once

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "glake/allocators/stitching_allocator.hpp"

namespace glake {

template <physical_provider Provider, address_reserver_for<Provider> Reserver, stitching_strategy Stitch,
          eviction_policy Evict, lock_policy Lock, stitch_admission Admission, growth_policy Growth>
void stitching_allocator<Provider, Reserver, Stitch, Evict, Lock, Admission, Growth>::verify_locked() const {
  const auto fail = [](const std::string& what) {
    throw std::logic_error("glake::stitching_allocator invariant broken: " + what);
  };
  small_.verify_unlocked();
  const std::size_t unit = ladder_.large_round();
  std::size_t active = small_.stats_unlocked().active_bytes, free_bytes = 0, reserved = 0, free_segments = 0,
              small_blocks = 0, claimed_blocks = 0;
  const auto extent = [](const segment& s) { return std::pair{s.mapping.base, s.mapping.size}; };
  pool_.arena().check_tiling(extent, fail, [&](const block_type& b) {
    const auto& m = b.segment->mapping;
    if (b.size == 0 || b.size % unit != 0 || (b.address - m.base) % unit != 0) {
      fail("block not a whole multiple of large_round_to");
    }
    if (b.address == m.base) {
      reserved += m.size;
      for (std::size_t i = 0; i < m.count; ++i) {
        if (m.slots[i].far) reserved -= m.slots[i].size;  // offloaded: far memory's, not reserved
      }
    }
    if (b.free) {
      free_bytes += b.size;
      if (b.size == m.size) ++free_segments;
    } else if (b.owner == nullptr) {
      active += b.requested;
    } else if (b.owner == static_cast<const void*>(&small_)) {
      ++small_blocks;
    } else {
      const auto* s = static_cast<const stitched*>(b.owner);
      bool found = false;
      for (const auto& pc : s->pieces) found |= pc.claimed == &b;
      if (!s->live || !found) fail("a block claimed by a stitch that does not hold it");
      ++claimed_blocks;
    }
  });
  std::size_t claimed_pieces = 0;
  if constexpr (stitches) {
    const auto& cache = stitcher_.cache();
    std::size_t cached_bytes = 0, cached = 0;
    std::vector<std::pair<const segment*, std::size_t>> refs;
    for (const stitched& s : cache) {
      std::size_t mapped = 0;
      for (const auto& pc : s.pieces) {
        mapped += pc.size;
        auto r = std::find_if(refs.begin(), refs.end(), [&](const auto& e) { return e.first == pc.home; });
        if (r == refs.end()) {
          refs.emplace_back(pc.home, 1);
        } else {
          ++r->second;
        }
        if (pc.claimed != nullptr) {
          ++claimed_pieces;
          if (!s.live) fail("a cached stitch still claims a block");
          const std::uintptr_t at = pc.home->mapping.base + pc.offset;
          if (pc.claimed->address != at || pc.claimed->owner != &s || pc.claimed->free) {
            fail("a stitch's claimed block does not match its piece");
          }
        }
      }
      if (mapped != s.size) fail("a stitch's pieces do not add up to its size");
      if (s.reserved < s.size) fail("a stitch maps more than it reserved");
      if (s.live) {
        active += s.requested;
      } else {
        ++cached;
        cached_bytes += s.size;
      }
    }
    for (const auto& [home, count] : refs) {
      if (home->stitch_refs != count) fail("a segment's stitch reference count is wrong");
    }
    if (cached != cache.cached_count() || cached != cache.queued_count()) fail("cached stitch indexes disagree");
    if (cached_bytes != cache.cached_bytes()) fail("cached stitch bytes disagree");
  }
  if (claimed_pieces != claimed_blocks) fail("claimed blocks and claimed pieces disagree");
  if (active != counters_.s.active_bytes) fail("active bytes disagree with live allocations");
  if (free_bytes != pool_.arena().free_bytes()) fail("free bytes disagree with free blocks");
  // A pending prefetch holds device handles it has made and not mapped home yet.
  const std::size_t coming_in = mover_.verify_pending(fail);
  // Spare handles (vmm_backend::keep_spares) are held and counted as reserved.
  const std::size_t spares = pool_.backend().spare_bytes();
  if (spares > pool_.backend().spare_limit()) fail("spare handles exceed their bound");
  if (reserved + spares != counters_.s.reserved_bytes ||
      reserved + coming_in + spares != pool_.backend().physical_bytes()) {
    fail("reserved bytes disagree with segments");
  }
  if (free_segments != pool_.free_segments()) fail("free segment queue disagrees with free segments");
  mover_.verify_moved(fail, counters_.s.offloaded_bytes);
  if (small_blocks * config_.small_segment != small_.stats_unlocked().reserved_bytes) {
    fail("small pool's segments disagree with blocks lent to it");
  }
}

}  // namespace glake
