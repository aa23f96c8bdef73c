// The segment pool under the stitching allocator: physical memory made of handles mapped into
// segments, carved into blocks, and the queue of fully free segments.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "glake/backends/concepts.hpp"
#include "glake/config.hpp"
#include "glake/detail/accounting.hpp"
#include "glake/detail/block_arena.hpp"
#include "glake/detail/node_pool.hpp"
#include "glake/detail/vmm_backend.hpp"
#include "glake/errors.hpp"
#include "glake/memory_state.hpp"
#include "glake/policies/eviction.hpp"
#include "glake/policies/growth.hpp"
#include "glake/stream.hpp"

namespace glake::detail {

/// Segments (a reservation with handles mapped back to back; Growth picks the handle sizes) over
/// one backend, their blocks in a block_arena, and the fully free segments in Evict order
/// (queued exactly while a segment is one free block). Everything is counted in `counters`; an
/// observer, when set, is told of each segment added (segment_alloc) and given back (segment_free);
/// a segment grown in place or split is told of as given back and added again as it is now, so
/// that the history's segments are always those shown.
/// Complexity: a new segment costs O(handles) driver calls; queue operations O(1) or O(log n).
/// Thread safety: none (the allocator serialises access).
template <physical_provider Provider, address_reserver_for<Provider> Reserver, growth_policy Growth,
          eviction_policy Evict>
class segment_pool {
 public:
  using handle_type = typename Provider::handle_type;
  using backend_type = vmm_backend<Provider, Reserver>;
  using slot_type = handle_slot<handle_type>;
  /// An address range that several segments share since split cut it (see split).
  struct shared_range {
    std::uintptr_t base = 0;
    std::size_t bytes = 0;
    std::size_t segments = 0;  ///< segments inside it; the range is freed with the last
  };
  struct segment : eviction_hook {
    mapped_segment<handle_type> mapping;
    std::size_t stitch_refs = 0;  ///< pieces of stitched ranges (live or cached) inside it
    stream_ref stream{};          ///< the stream it was made for
    shared_range* shared = nullptr;  ///< the range it shares with segments split off it, or null
    bool growable = false;           ///< made with room to grow, or split off such a segment
  };
  using arena_type = block_arena<segment>;
  using block_type = typename arena_type::block_type;
  /// A free block's whole handles: what a stitch may map of it.
  struct whole_run {
    block_type* block;
    std::size_t offset;  ///< of the first whole handle, into the segment
    std::size_t size;    ///< of the whole handles
  };

  segment_pool(Provider provider, Reserver reserver, const config& cfg, usage_counters& counters)
      : backend_(std::move(provider), std::move(reserver), cfg.memory_limit),
        chunk_(chosen_chunk(cfg, backend_.granularity())), growth_(cfg, chunk_), counters_(&counters) {
    handle_sizes_.reserve(64);
  }
  segment_pool(const segment_pool&) = delete;
  segment_pool& operator=(const segment_pool&) = delete;
  /// Every segment goes back to the backend, live blocks or not (a live one is the owner's leak).
  ~segment_pool() { destroy_all(); }

  /// Who is told of segments added and given back (null: nobody).
  void set_observer(memory_observer observer, void* context) noexcept {
    observer_ = observer;
    observer_context_ = context;
  }
  /// Who releases far memory's handles in segments given back (see vmm_backend::destroy_segment).
  void set_far_releaser(typename backend_type::far_releaser release, void* context) noexcept {
    far_release_ = release;
    far_context_ = context;
  }
  /// Tells the observer, if any, of `action` on `size` bytes at `address`.
  void tell(memory_action action, std::uintptr_t address, std::size_t size, stream_ref stream) const noexcept {
    if (observer_ != nullptr) observer_(observer_context_, memory_event{action, address, size, stream});
  }

  backend_type& backend() noexcept { return backend_; }
  const backend_type& backend() const noexcept { return backend_; }
  arena_type& arena() noexcept { return arena_; }
  const arena_type& arena() const noexcept { return arena_; }
  const Growth& growth() const noexcept { return growth_; }
  std::size_t chunk() const noexcept { return chunk_; }

  /// A new segment of `bytes` (whole chunks) on `stream`, as one free block; null when out of
  /// memory. A backend failure propagates with nothing changed. The limits are checked before
  /// the handles are planned, so a hopeless request costs O(1) whatever its size.
  /// With `reserve` above `bytes`, the segment reserves that much address space and can grow in
  /// place (extend).
  block_type* add_segment(std::size_t bytes, stream_ref stream, std::size_t reserve = 0) {
    if (round_up_overflows(bytes, chunk_) || !backend_.may_add(bytes)) return nullptr;
    segment* s = segments_.create();
    try {
      growth_.plan_handles(bytes, handle_sizes_);
      if (!backend_.try_create_segment(handle_sizes_, s->mapping, reserve)) {
        segments_.destroy(s);
        return nullptr;
      }
    } catch (...) {
      segments_.destroy(s);
      throw;
    }
    block_type* b = nullptr;
    try {
      b = arena_.add_segment(s, s->mapping.base, s->mapping.size, stream);
    } catch (...) {
      backend_.destroy_segment(s->mapping);
      segments_.destroy(s);
      throw;
    }
    counters_->on_reserve(bytes);
    s->eviction_bytes_ = bytes;
    s->stream = stream;
    free_.push(*s);
    if (s->mapping.room() > 0) {
      set_growing(stream, s);
      s->growable = true;
      ++growable_;
    }
    tell(memory_action::segment_alloc, s->mapping.base, s->mapping.size, stream);
    return b;
  }

  /// Maps `bytes` (whole chunks) of new memory after the end of `s`, inside its reservation;
  /// returns the free block that now ends the segment (its free last block grown, or a new one),
  /// or null when out of memory or room, with nothing changed. Pointers to s's slots are
  /// invalidated. A backend failure propagates with nothing changed.
  block_type* extend(segment* s, std::size_t bytes, stream_ref stream) {
    if (bytes == 0 || bytes > s->mapping.room() || !backend_.may_add(bytes)) return nullptr;
    arena_.reserve_nodes(1);
    growth_.plan_handles(bytes, handle_sizes_);
    const std::uintptr_t old_end = s->mapping.base + s->mapping.size;
    const bool queued = is_free_segment(s);
    if (!backend_.try_extend_segment(s->mapping, handle_sizes_)) return nullptr;
    if (queued) free_.erase(*s);
    block_type* b = arena_.extend_segment(s, old_end, bytes, stream);
    counters_->on_extend(bytes);
    s->eviction_bytes_ = s->mapping.size;
    if (queued) enter_free_queue(b);
    // The history names the segments as they are shown (visit_state): the old one goes, the
    // grown one comes.
    tell(memory_action::segment_free, s->mapping.base, old_end - s->mapping.base, s->stream);
    tell(memory_action::segment_alloc, s->mapping.base, s->mapping.size, s->stream);
    return b;
  }

  /// The segment of `stream` that grows in place (the newest with room reserved), or null.
  segment* growing(stream_ref stream) const noexcept {
    for (const auto& [st, s] : growing_) {
      if (st == stream) return s;
    }
    return nullptr;
  }

  /// Gives a fully free segment back to the backend.
  void drop_segment(segment* s) noexcept {
    std::erase_if(growing_, [s](const auto& g) { return g.second == s; });
    tell(memory_action::segment_free, s->mapping.base, s->mapping.size, s->stream);
    block_type* b = arena_.find(s->mapping.base);
    free_.erase(*s);
    arena_.remove_segment(b);
    counters_->on_unreserve(s->mapping.size);
    destroy(s);
  }

  /// Whether `s` was made with room to grow in place, or split off such a segment: the segments
  /// whose free handles are released by splitting them off (others are released whole).
  static bool grows(const segment& s) noexcept { return s.growable; }
  /// How many segments grow (grows); O(1).
  std::size_t growable_segments() const noexcept { return growable_; }

  /// Cuts `s` at `offset`, a boundary of both its handles and its blocks strictly inside it: the
  /// handles and blocks from `offset` on become a new segment (returned) that shares s's address
  /// range and keeps its room to grow; s keeps the rest. Nothing is mapped or unmapped. The
  /// caller moves the stitched pieces at or past `offset` to the new segment (stitch_refs).
  /// Pointers to s's slots are invalidated. Throws bad_alloc with nothing changed.
  segment* split(segment* s, std::size_t offset) {
    auto& m = s->mapping;
    const std::size_t i = m.first_at_or_after(offset);
    segment* t = segments_.create();
    shared_range* shared = s->shared;
    try {
      if (shared == nullptr) shared = ranges_.create();
      auto head = std::make_unique<slot_type[]>(i);
      auto tail = std::make_unique<slot_type[]>(m.count - i);
      std::copy(m.slots.get(), m.slots.get() + i, head.get());
      for (std::size_t k = i; k < m.count; ++k) {
        tail[k - i] = m.slots[k];
        tail[k - i].offset -= offset;
      }
      if (s->shared == nullptr) {
        shared->base = m.base;
        shared->bytes = std::max(m.size, m.reserved);
        shared->segments = 1;
        s->shared = shared;
      }
      const bool queued = is_free_segment(s);
      if (queued) free_.erase(*s);
      t->mapping.base = m.base + offset;
      t->mapping.size = m.size - offset;
      t->mapping.count = m.count - i;
      t->mapping.slots = std::move(tail);
      t->mapping.capacity = m.count - i;
      t->mapping.reserved = std::max(m.size, m.reserved) - offset;
      m.size = offset;
      m.count = i;
      m.slots = std::move(head);
      m.capacity = i;
      m.reserved = offset;
      t->stream = s->stream;
      t->shared = shared;
      ++shared->segments;
      t->growable = true;
      ++growable_;
      if (!s->growable) {
        s->growable = true;
        ++growable_;
      }
      s->eviction_bytes_ = m.size;
      t->eviction_bytes_ = t->mapping.size;
      for (block_type* b = arena_.find(t->mapping.base); b != nullptr && b->segment == s; b = arena_.next(b)) {
        b->segment = t;
      }
      if (queued || is_free_segment(s)) free_.push(*s);
      if (is_free_segment(t)) free_.push(*t);
      for (auto& g : growing_) {
        if (g.second == s) g.second = t;
      }
    } catch (...) {
      if (shared != s->shared) ranges_.destroy(shared);
      segments_.destroy(t);
      throw;
    }
    // The history names the segments as they are shown: the whole one goes, its two parts come.
    tell(memory_action::segment_free, s->mapping.base, s->mapping.size + t->mapping.size, s->stream);
    tell(memory_action::segment_alloc, s->mapping.base, s->mapping.size, s->stream);
    tell(memory_action::segment_alloc, t->mapping.base, t->mapping.size, t->stream);
    return t;
  }

  /// Block `b` is about to be taken (leaves the free queue if it is a whole segment) or was just
  /// freed or merged (enters it if it now is one).
  void leave_free_queue(block_type* b) noexcept {
    if (b->size == b->segment->mapping.size) free_.erase(*b->segment);
  }
  void enter_free_queue(block_type* b) noexcept {
    if (b->size == b->segment->mapping.size) free_.push(*b->segment);
  }
  /// The fully free segment to release next, in Evict order; null if none.
  segment* free_victim() noexcept { return free_.victim(); }
  void unqueue(segment* s) noexcept { free_.erase(*s); }
  void requeue(segment* s) noexcept { free_.push(*s); }
  std::size_t free_segments() const noexcept { return free_.size(); }

  /// O(log h) for h handles in b's segment: handles lie back to back, so the whole ones are the
  /// run from the first starting in `b` to the last ending in it, found by two binary searches
  /// (one when the first does not end in `b`).
  whole_run whole_handles_of(block_type& b) const noexcept {
    const auto& m = b.segment->mapping;
    const std::size_t begin = b.address - m.base, end = begin + b.size;
    const std::size_t first = m.first_at_or_after(begin);
    if (first == m.count) return whole_run{&b, end, 0};
    // Most free blocks a stitch plan looks at hold no whole handle: one search tells.
    if (m.slots[first].offset + m.slots[first].size > end) return whole_run{&b, m.slots[first].offset, 0};
    // The handle before the first starting at or after `end` ends at or after `end`.
    std::size_t last = m.first_at_or_after(end);
    if (last > first && m.slots[last - 1].offset + m.slots[last - 1].size > end) --last;
    const std::size_t size = last > first ? m.slots[last - 1].offset + m.slots[last - 1].size - m.slots[first].offset : 0;
    return whole_run{&b, m.slots[first].offset, size};
  }

  std::size_t largest_free_block() const {
    std::size_t largest = 0;
    arena_.for_each_block([&](const block_type& b) {
      if (b.free) largest = std::max(largest, b.size);
    });
    return largest;
  }

 private:
  // At destruction: every segment back to the backend, whatever its blocks.
  void destroy_all() noexcept {
    std::vector<segment*> all;
    try {
      arena_.for_each_block([&](const block_type& b) {
        if (b.address == b.segment->mapping.base) all.push_back(b.segment);
      });
    } catch (...) {
      return;  // out of host memory while tearing down: leak rather than crash
    }
    for (segment* s : all) give_back_memory(s);
  }

  bool is_free_segment(segment* s) noexcept {
    const block_type* b = arena_.find(s->mapping.base);
    return b != nullptr && b->free && b->size == s->mapping.size;
  }

  // A segment's handles back to the backend; its address range too, unless a segment split off
  // it still lies there.
  void give_back_memory(segment* s) noexcept {
    shared_range* shared = s->shared;
    backend_.destroy_segment(s->mapping, far_release_, far_context_, shared == nullptr);
    if (shared != nullptr && --shared->segments == 0) {
      backend_.free_reserved_range(reinterpret_cast<void*>(shared->base), shared->bytes);
      ranges_.destroy(shared);
    }
    s->shared = nullptr;
  }
  void destroy(segment* s) noexcept {
    if (grows(*s)) --growable_;
    give_back_memory(s);
    segments_.destroy(s);
  }

  static std::size_t chosen_chunk(const config& cfg, std::size_t granularity) {
    const std::size_t chunk = cfg.chunk_size == 0 ? granularity : cfg.chunk_size;
    if (chunk % granularity != 0) {
      throw config_error("glake config: chunk_size must be a multiple of the backend's granularity (" +
                         format_bytes(granularity) + "), got " + format_bytes(chunk));
    }
    if (cfg.small_segment % chunk != 0) {
      // Name the setting to change: the one the user set, or the granularity that stands in
      // for chunk_size 0.
      if (cfg.chunk_size == 0) {
        throw config_error("glake config: small_segment (" + format_bytes(cfg.small_segment) +
                           ") must be a multiple of the backend's granularity (" + format_bytes(chunk) +
                           "), the chunk size while chunk_size is 0");
      }
      throw config_error("glake config: chunk_size (" + format_bytes(chunk) + ") must divide small_segment (" +
                         format_bytes(cfg.small_segment) + ")");
    }
    return chunk;
  }

  void set_growing(stream_ref stream, segment* s) {
    for (auto& g : growing_) {
      if (g.first == stream) {
        g.second = s;
        return;
      }
    }
    growing_.emplace_back(stream, s);
  }

  backend_type backend_;
  std::size_t chunk_;
  std::vector<std::pair<stream_ref, segment*>> growing_;
  std::size_t growable_ = 0;
  Growth growth_;
  usage_counters* counters_;
  arena_type arena_;
  node_pool<segment> segments_;
  node_pool<shared_range> ranges_;
  typename Evict::template queue<segment> free_;
  std::vector<std::size_t> handle_sizes_;
  memory_observer observer_ = nullptr;
  void* observer_context_ = nullptr;
  typename backend_type::far_releaser far_release_ = nullptr;
  void* far_context_ = nullptr;
};

}  // namespace glake::detail
