// The stitch cache: the stitching allocator's stitched ranges, live and cached, indexed for
// lookup by address, for reuse by (stream, size), and for eviction. It makes no driver call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <boost/intrusive/set.hpp>

#include "glake/detail/node_pool.hpp"
#include "glake/policies/eviction.hpp"
#include "glake/stream.hpp"

namespace glake::detail {

struct stitch_address_tag;
struct stitch_size_tag;
using stitch_address_hook =
    boost::intrusive::set_base_hook<boost::intrusive::tag<stitch_address_tag>,
                                    boost::intrusive::link_mode<boost::intrusive::normal_link>>;
using stitch_size_hook =
    boost::intrusive::set_base_hook<boost::intrusive::tag<stitch_size_tag>,
                                    boost::intrusive::link_mode<boost::intrusive::normal_link>>;

/// A stitched range: pieces of home segments (whole handles) mapped side by side from `base`.
/// Its physical memory also stays mapped in the home segments. While live, a prefix of its
/// pieces is claimed (the blocks holding them belong to it); while cached, none is.
template <class Segment, class Block, class Event>
struct stitched_range : eviction_hook, stitch_address_hook, stitch_size_hook {
  struct piece {
    Segment* home;
    std::size_t offset;        ///< into the home segment, at a handle boundary
    std::size_t size;          ///< whole handles
    Block* claimed = nullptr;  ///< the live block holding (a prefix of) it while the range is live;
                               ///< the rest of its handles stays free in place
    std::size_t first_slot = 0;  ///< where its first handle was last found in home's slots: a
                                 ///< hint, checked on use (mapped_segment::index_of)
  };

  std::uintptr_t base = 0;
  std::size_t size = 0;           ///< mapped, from base
  std::size_t reserved = 0;       ///< address space reserved at base (>= size): room to grow
  stream_ref stream{};
  std::vector<piece> pieces;
  bool live = false;
  std::size_t requested = 0;
  std::size_t claimed_bytes = 0;  ///< the prefix of `size` claimed while live
  bool has_free_event = false;    ///< free_event marks the work queued before it was cached
  Event free_event{};
};

/// Every stitched range, by address; the cached ones also by (stream, size) and in Evict order.
/// Reuse looks up the smallest cached range of at least a size on a stream and walks up or down
/// from there. O(log n) per operation; no heap allocation once the node pool is warm.
/// Thread safety: none (the allocator serialises access).
template <class Range, eviction_policy Evict>
class stitch_cache {
  struct by_address {
    bool operator()(const Range& a, const Range& b) const noexcept { return a.base < b.base; }
    bool operator()(std::uintptr_t a, const Range& b) const noexcept { return a < b.base; }
    bool operator()(const Range& a, std::uintptr_t b) const noexcept { return a.base < b; }
  };
  struct key {
    stream_ref stream;
    std::size_t size;
  };
  struct by_size {
    template <class A, class B>
    bool operator()(const A& a, const B& b) const noexcept {
      return a.stream != b.stream ? a.stream < b.stream : a.size < b.size;
    }
  };
  using address_set = boost::intrusive::set<Range, boost::intrusive::base_hook<stitch_address_hook>,
                                            boost::intrusive::compare<by_address>,
                                            boost::intrusive::constant_time_size<true>>;
  using size_set = boost::intrusive::multiset<Range, boost::intrusive::base_hook<stitch_size_hook>,
                                              boost::intrusive::compare<by_size>,
                                              boost::intrusive::constant_time_size<true>>;

 public:
  using iterator = typename size_set::iterator;

  stitch_cache() = default;
  stitch_cache(const stitch_cache&) = delete;
  stitch_cache& operator=(const stitch_cache&) = delete;

  /// A new range, not yet in any index.
  Range* create() { return pool_.create(); }
  /// Frees a range that is in no index.
  void destroy(Range* r) noexcept { pool_.destroy(r); }

  /// A range just mapped, at its base address (live).
  void add(Range& r) noexcept { all_.insert(r); }
  /// Removes a range from every index and frees it.
  void remove(Range& r) noexcept {
    if (!r.live) uncache(r);
    all_.erase(all_.iterator_to(r));
    pool_.destroy(&r);
  }
  /// The range mapped at `address`, live or cached; null if none.
  Range* find(std::uintptr_t address) noexcept {
    auto it = all_.find(address, by_address{});
    return it == all_.end() ? nullptr : &*it;
  }
  const Range* find(std::uintptr_t address) const noexcept {
    return const_cast<stitch_cache&>(*this).find(address);
  }

  /// A range was freed: cache it for reuse (its eviction size is its mapped size).
  void cache(Range& r) noexcept {
    r.eviction_bytes_ = r.size;
    by_size_.insert(r);
    queue_.push(r);
    cached_bytes_ += r.size;
  }
  /// A cached range is to be claimed again (or dropped).
  void uncache(Range& r) noexcept {
    by_size_.erase(by_size_.iterator_to(r));
    queue_.erase(r);
    cached_bytes_ -= r.size;
  }

  /// Cached ranges of `stream` in size order: the first of at least `size`, and the end.
  iterator lower_bound(stream_ref stream, std::size_t size) noexcept {
    return by_size_.lower_bound(key{stream, size}, by_size{});
  }
  iterator begin_cached() noexcept { return by_size_.begin(); }
  iterator end_cached() noexcept { return by_size_.end(); }
  bool any_cached() const noexcept { return !by_size_.empty(); }

  /// The cached range to drop next, in Evict order; null if none.
  Range* victim() noexcept { return queue_.victim(); }

  std::size_t cached_count() const noexcept { return by_size_.size(); }
  std::size_t queued_count() const noexcept { return queue_.size(); }
  std::size_t cached_bytes() const noexcept { return cached_bytes_; }
  bool empty() const noexcept { return all_.empty(); }
  /// Every range, live and cached, by address.
  auto begin() noexcept { return all_.begin(); }
  auto end() noexcept { return all_.end(); }
  auto begin() const noexcept { return all_.begin(); }
  auto end() const noexcept { return all_.end(); }

 private:
  node_pool<Range> pool_;
  address_set all_;
  size_set by_size_;
  typename Evict::template queue<Range> queue_;
  std::size_t cached_bytes_ = 0;
};

}  // namespace glake::detail
