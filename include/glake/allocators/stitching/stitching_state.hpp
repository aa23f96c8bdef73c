// What the stitching allocator shows of its memory (stitching_allocator::visit_state and
// free_memory): segments, blocks, the small pool's blocks in place of those it borrowed, stitched
// ranges and their pieces. Included at the end of its header.
#pragma once

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

#include "glake/allocators/stitching_allocator.hpp"

namespace glake {

template <physical_provider Provider, address_reserver_for<Provider> Reserver, stitching_strategy Stitch,
          eviction_policy Evict, lock_policy Lock, stitch_admission Admission, growth_policy Growth>
template <state_visitor V>
void stitching_allocator<Provider, Reserver, Stitch, Evict, Lock, Admission, Growth>::visit_state(V& v) const {
  std::lock_guard guard(lock_);
  std::vector<const void*> pending;
  if constexpr (has_events) {
    deferred_.for_each_pending([&](const void* p) { pending.push_back(p); });
    std::sort(pending.begin(), pending.end());
  }
  // Freed but not reusable yet: a free waiting for recorded streams, or an allocation parked
  // in far memory (freed while offloaded, its memory waiting for room on the device).
  const auto live_state = [&](std::uintptr_t address) {
    if (std::binary_search(pending.begin(), pending.end(), reinterpret_cast<const void*>(address))) {
      return block_state::pending_free;
    }
    if (mover_.parked_count() > 0 && mover_.parked(address)) return block_state::pending_free;
    return block_state::allocated;
  };
  pool_.arena().for_each_block([&](const block_type& b) {
    if (b.address == b.segment->mapping.base) {
      v.segment(segment_view{b.segment->mapping.base, b.segment->mapping.size, b.segment->stream});
    }
    if (b.free) {
      v.block(block_view{b.address, b.size, 0, block_state::free, b.stream, 0, 0});
    } else if (b.owner == nullptr) {
      v.block(block_view{b.address, b.size, b.requested, live_state(b.address), b.stream, 0, 0});
    } else if (b.owner == &small_) {
      small_.for_each_block_of_segment_unlocked(b.address, [&](const auto& sb) {
        v.block(block_view{sb.address, sb.size, sb.free ? 0 : sb.requested,
                           sb.free ? block_state::free : live_state(sb.address), sb.stream, b.address, 0});
      });
    } else if constexpr (stitches) {
      const auto* range = static_cast<const stitched*>(b.owner);
      v.block(block_view{b.address, b.size, 0, live_state(range->base), b.stream, 0, range->base});
    }
  });
  if constexpr (stitches) {
    for (const stitched& r : stitcher_.cache()) {
      v.stitched(stitched_view{r.base, r.size, r.live ? r.claimed_bytes : 0, r.requested, r.stream, r.live,
                               r.live ? live_state(r.base) : block_state::free});
      for (const auto& pc : r.pieces) v.piece(stitched_piece_view{pc.home->mapping.base + pc.offset, pc.size});
    }
  }
}

template <physical_provider Provider, address_reserver_for<Provider> Reserver, stitching_strategy Stitch,
          eviction_policy Evict, lock_policy Lock, stitch_admission Admission, growth_policy Growth>
auto stitching_allocator<Provider, Reserver, Stitch, Evict, Lock, Admission, Growth>::free_memory() const -> free_memory_report {
  std::lock_guard guard(lock_);
  free_memory_report r;
  pool_.arena().for_each_block([&](const block_type& b) {
    if (!b.free) {
      if (b.owner == nullptr) r.block_rounding += b.size - b.requested;  // rounded to large_round_to
      return;
    }
    const std::size_t whole = pool_.whole_handles_of(const_cast<block_type&>(b)).size;
    r.whole_handles += whole;
    r.partial_handles += b.size - whole;
    // Of the partly used handles' bytes, those in a free block that ends its segment.
    if (b.end() == b.segment->mapping.base + b.segment->mapping.size) r.partial_at_segment_end += b.size - whole;
  });
  if constexpr (stitches) {
    // Stitched ranges claim whole chunks: the bytes beyond their requests.
    for (const stitched& s : stitcher_.cache()) {
      if (s.live) r.stitched_tails += s.claimed_bytes - s.requested;
    }
  }
  r.small_pool = small_.stats_unlocked().reserved_bytes - small_.stats_unlocked().allocated_bytes;
  return r;
}

}  // namespace glake
