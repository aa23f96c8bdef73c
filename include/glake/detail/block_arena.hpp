// The bookkeeping every glake allocator shares: blocks over segments, a best-fit index of free
// blocks and an address index of all blocks, with split and coalesce.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <utility>

#include <boost/intrusive/set.hpp>

#include "glake/detail/node_pool.hpp"
#include "glake/stream.hpp"

namespace glake::detail {

struct by_size_tag;
struct by_address_tag;
using by_size_hook =
    boost::intrusive::set_base_hook<boost::intrusive::tag<by_size_tag>,
                                    boost::intrusive::link_mode<boost::intrusive::normal_link>>;
using by_address_hook =
    boost::intrusive::set_base_hook<boost::intrusive::tag<by_address_tag>,
                                    boost::intrusive::link_mode<boost::intrusive::normal_link>>;

/// A contiguous piece of a segment: free, or handed out. Descriptors live on the host in a node
/// pool, never inside the memory they describe.
template <class Segment>
struct block : by_size_hook, by_address_hook {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  Segment* segment = nullptr;
  stream_ref stream{};
  std::size_t requested = 0;  ///< what the caller asked for, while the block is live
  void* owner = nullptr;      ///< who holds a live block when it is not the caller directly
  std::uint64_t free_mark = 0;  ///< while free: the owner's mark for the work queued on `stream`
                                ///< before the free (0: none); merged blocks keep the latest
  bool free = true;

  std::uintptr_t end() const noexcept { return address + size; }
};

/// Blocks over segments (contiguous address ranges the owner obtained elsewhere). Free blocks sit
/// in a multiset ordered by (stream, size, address), so best fit is one lower_bound and a
/// stream's blocks are a contiguous run; every block sits in a set ordered by address, which
/// gives neighbours for coalescing and the block containing an address. Splits happen at
/// positions the caller chooses; freed blocks merge with free neighbours of the same segment and
/// stream. A free block may move to another stream (`restream`), so one segment can hold free
/// blocks of several streams side by side.
///
/// Complexity: O(log n) per operation, no heap allocation once the node pool is warm (callers
/// that need a no-throw sequence call `reserve_nodes` first).
/// Thread safety: none; the owning allocator serialises access.
template <class Segment>
class block_arena {
 public:
  using block_type = block<Segment>;

 private:
  struct size_key {
    stream_ref stream;
    std::size_t size;
    std::uintptr_t address;
  };
  struct size_order {
    static bool less(stream_ref as, std::size_t az, std::uintptr_t aa, stream_ref bs, std::size_t bz,
                     std::uintptr_t ba) noexcept {
      if (as != bs) return as < bs;
      if (az != bz) return az < bz;
      return aa < ba;
    }
    bool operator()(const block_type& a, const block_type& b) const noexcept {
      return less(a.stream, a.size, a.address, b.stream, b.size, b.address);
    }
    bool operator()(const size_key& a, const block_type& b) const noexcept {
      return less(a.stream, a.size, a.address, b.stream, b.size, b.address);
    }
    bool operator()(const block_type& a, const size_key& b) const noexcept {
      return less(a.stream, a.size, a.address, b.stream, b.size, b.address);
    }
  };
  struct address_order {
    bool operator()(const block_type& a, const block_type& b) const noexcept {
      return a.address < b.address;
    }
    bool operator()(std::uintptr_t a, const block_type& b) const noexcept { return a < b.address; }
    bool operator()(const block_type& a, std::uintptr_t b) const noexcept { return a.address < b; }
  };
  using free_set =
      boost::intrusive::multiset<block_type, boost::intrusive::base_hook<by_size_hook>,
                                 boost::intrusive::compare<size_order>,
                                 boost::intrusive::constant_time_size<true>>;
  using address_set =
      boost::intrusive::set<block_type, boost::intrusive::base_hook<by_address_hook>,
                            boost::intrusive::compare<address_order>,
                            boost::intrusive::constant_time_size<true>>;

 public:
  block_arena() = default;
  block_arena(const block_arena&) = delete;
  block_arena& operator=(const block_arena&) = delete;
  ~block_arena() { clear(); }

  /// Makes the next `count` splits (or segments added) unable to throw.
  void reserve_nodes(std::size_t count) { nodes_.reserve(count); }

  /// Adds a segment as one free block; returns it.
  block_type* add_segment(Segment* segment, std::uintptr_t base, std::size_t size, stream_ref stream) {
    return new_free_block(segment, base, size, stream);
  }

  /// The segment ending at `old_end` grew by `bytes` in place: the new range joins its last block
  /// if that block is free, else becomes a new free block. Returns the free block that ends at
  /// the new end. Needs one node when the last block is live.
  block_type* extend_segment(Segment* segment, std::uintptr_t old_end, std::size_t bytes, stream_ref stream) {
    block_type* last = containing(old_end - 1);
    if (last != nullptr && last->free && last->segment == segment && last->stream == stream) {
      free_.erase(free_.iterator_to(*last));
      last->size += bytes;
      free_.insert(*last);
      free_bytes_ += bytes;
      return last;
    }
    return new_free_block(segment, old_end, bytes, stream);
  }

  /// Removes a free block that spans its whole segment (the segment is going away).
  void remove_segment(block_type* b) noexcept {
    free_.erase(free_.iterator_to(*b));
    by_address_.erase(by_address_.iterator_to(*b));
    free_bytes_ -= b->size;
    nodes_.destroy(b);
  }

  /// The smallest free block on `stream` of at least `size` bytes, or null.
  block_type* best_fit(stream_ref stream, std::size_t size) noexcept {
    auto it = free_.lower_bound(size_key{stream, size, 0}, size_order{});
    if (it == free_.end() || it->stream != stream) return nullptr;
    return &*it;
  }

  /// The smallest free block on `stream` of at least `size` bytes for which `pred(block)` holds,
  /// looking at no more than `probes` blocks; or null.
  template <class Pred>
  block_type* best_fit_if(stream_ref stream, std::size_t size, std::size_t probes, Pred&& pred) {
    for (auto it = free_.lower_bound(size_key{stream, size, 0}, size_order{});
         it != free_.end() && it->stream == stream && probes > 0; ++it, --probes) {
      if (pred(*it)) return &*it;
    }
    return nullptr;
  }

  /// Calls f(block&) for the free blocks of `stream` from the largest down, while f returns true.
  template <class F>
  void for_each_free_largest_first(stream_ref stream, F&& f) {
    auto it = free_.lower_bound(size_key{stream, ~std::size_t{0}, ~std::uintptr_t{0}}, size_order{});
    while (it != free_.begin()) {
      --it;
      if (it->stream != stream) return;
      if (!f(*it)) return;
    }
  }

  /// Takes free block `b` for a caller. If `keep` is less than its size, the tail from `keep` on
  /// is split off as a new free block. Needs one node when it splits.
  block_type* take(block_type* b, std::size_t keep) {
    const bool split = keep < b->size;
    if (split) nodes_.reserve(1);  // the only step that can throw, before anything changes
    erase_free(b);                 // first, so that the split does not re-index `b` for nothing
    if (split) split_off_tail(b, keep);
    return b;
  }

  /// Takes the sub-range [address, address + size) out of free block `b`, leaving what lies
  /// before and after it free. Needs up to two nodes.
  block_type* carve(block_type* b, std::uintptr_t address, std::size_t size) {
    if (address > b->address) {
      split_off_tail(b, address - b->address);
      b = next(b);
    }
    return take(b, size);
  }

  /// Returns a live block to the free index, merged with free neighbours of the same segment and
  /// stream, marked `mark` (see `free_mark`). Returns the resulting free block (which may start
  /// before `b`).
  block_type* give_back(block_type* b, std::uint64_t mark = 0) noexcept {
    b->free = true;
    b->requested = 0;
    b->owner = nullptr;
    b->free_mark = mark;
    return merge_and_index(b);
  }

  /// Moves free block `b` to `stream`'s index, merged with that stream's free neighbours; its own
  /// mark is dropped (the caller has established that its work is done). Returns the resulting
  /// free block.
  block_type* restream(block_type* b, stream_ref stream) noexcept {
    erase_free(b);
    b->stream = stream;
    b->free_mark = 0;
    return merge_and_index(b);
  }

  /// The block that starts exactly at `address`, or null.
  block_type* find(std::uintptr_t address) noexcept {
    auto it = by_address_.find(address, address_order{});
    return it == by_address_.end() ? nullptr : &*it;
  }

  /// The block whose range holds `address`, or null.
  block_type* containing(std::uintptr_t address) noexcept {
    auto it = by_address_.upper_bound(address, address_order{});
    if (it == by_address_.begin()) return nullptr;
    --it;
    return address < it->end() ? &*it : nullptr;
  }

  block_type* next(block_type* b) noexcept {
    auto it = ++by_address_.iterator_to(*b);
    return it == by_address_.end() ? nullptr : &*it;
  }
  block_type* prev(block_type* b) noexcept {
    auto it = by_address_.iterator_to(*b);
    return it == by_address_.begin() ? nullptr : &*--it;
  }

  std::size_t free_bytes() const noexcept { return free_bytes_; }
  std::size_t free_blocks() const noexcept { return free_.size(); }
  std::size_t blocks() const noexcept { return by_address_.size(); }
  std::uint64_t splits() const noexcept { return splits_; }
  std::uint64_t merges() const noexcept { return merges_; }

  /// The block at the lowest address, or null.
  block_type* first() noexcept { return by_address_.empty() ? nullptr : &*by_address_.begin(); }

  /// Visits every block in address order (for invariant checks and reports).
  template <class F>
  void for_each_block(F&& f) const {
    for (const block_type& b : by_address_) f(b);
  }
  /// Checks what every owner relies on: each segment's blocks tile [base, base + size) with no
  /// gap (`extent(segment)` gives {base, size}), every free block is indexed where its key says,
  /// and no two free neighbours of a segment and stream are left unmerged. Calls `fail(what)`, which must
  /// throw, on the first breach, and `visit(block)` on every block for the owner's own checks.
  template <class Extent, class Fail, class Visit>
  void check_tiling(Extent&& extent, Fail&& fail, Visit&& visit) const {
    const block_type* previous = nullptr;
    const auto reaches_end = [&](const block_type* b) {
      const auto [base, size] = extent(*b->segment);
      return b->end() == base + size;
    };
    for (const block_type& b : by_address_) {
      if (b.address == extent(*b.segment).first) {
        if (previous != nullptr && !reaches_end(previous)) fail("a segment's blocks do not reach its end");
      } else if (previous == nullptr || previous->segment != b.segment || previous->end() != b.address) {
        fail("a segment's blocks are not contiguous");
      }
      if (b.free) {
        if (!indexed_as_free(b)) fail("free block not in the best-fit index");
        if (previous != nullptr && previous->free && previous->segment == b.segment &&
            previous->stream == b.stream) {
          fail("two free neighbours not coalesced");
        }
      }
      visit(b);
      previous = &b;
    }
    if (previous != nullptr && !reaches_end(previous)) fail("the last segment's blocks do not reach its end");
  }

  /// True when `b` is indexed as free exactly where its key says.
  bool indexed_as_free(const block_type& b) const noexcept {
    auto it = free_.find(size_key{b.stream, b.size, b.address}, size_order{});
    return it != free_.end() && &*it == &b;
  }

 private:
  // A new free block, indexed by address and by size. Needs one node.
  block_type* new_free_block(Segment* segment, std::uintptr_t address, std::size_t size, stream_ref stream) {
    block_type* b = nodes_.create();
    b->address = address;
    b->size = size;
    b->segment = segment;
    b->stream = stream;
    by_address_.insert(*b);
    free_.insert(*b);
    free_bytes_ += size;
    return b;
  }

  // Grows `left` over its right neighbour `right` (out of the free index already) and drops it.
  void absorb(block_type* left, block_type* right) noexcept {
    left->size += right->size;
    left->free_mark = std::max(left->free_mark, right->free_mark);
    by_address_.erase(by_address_.iterator_to(*right));
    nodes_.destroy(right);
    ++merges_;
  }

  // Merges free, unindexed block `b` with its free neighbours of the same segment and stream and
  // indexes the result.
  block_type* merge_and_index(block_type* b) noexcept {
    const auto mergeable = [b](const block_type* n) {
      return n != nullptr && n->free && n->segment == b->segment && n->stream == b->stream;
    };
    if (block_type* n = next(b); mergeable(n)) {
      erase_free(n);
      absorb(b, n);
    }
    if (block_type* p = prev(b); mergeable(p)) {
      erase_free(p);
      absorb(p, b);
      b = p;
    }
    b->free = true;  // erase_free cleared it on a merged predecessor
    free_.insert(*b);
    free_bytes_ += b->size;
    return b;
  }

  void erase_free(block_type* b) noexcept {
    free_.erase(free_.iterator_to(*b));
    free_bytes_ -= b->size;
    b->free = false;
  }

  // Splits free-or-live block `b` at `keep`; the tail becomes a new free block.
  void split_off_tail(block_type* b, std::size_t keep) {
    block_type* tail = nodes_.create();
    const bool was_free = b->free;
    if (was_free) {
      free_.erase(free_.iterator_to(*b));
      free_bytes_ -= b->size;
    }
    tail->address = b->address + keep;
    tail->size = b->size - keep;
    tail->segment = b->segment;
    tail->stream = b->stream;
    tail->free_mark = b->free_mark;
    b->size = keep;
    by_address_.insert_before(std::next(by_address_.iterator_to(*b)), *tail);
    free_.insert(*tail);
    free_bytes_ += tail->size;
    if (was_free) {
      free_.insert(*b);
      free_bytes_ += b->size;
    }
    ++splits_;
  }

  void clear() noexcept {
    free_.clear();
    by_address_.clear_and_dispose([this](block_type* b) { nodes_.destroy(b); });
  }

  node_pool<block_type> nodes_;
  free_set free_;
  address_set by_address_;
  std::size_t free_bytes_ = 0;
  std::uint64_t splits_ = 0;
  std::uint64_t merges_ = 0;
};

}  // namespace glake::detail
