// Eviction policies: which cached entry (a stitched mapping, a free segment) to drop first
// under a limit or memory pressure.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>

#include <boost/intrusive/list.hpp>
#include <boost/intrusive/set.hpp>

namespace glake {

struct eviction_tag;
using eviction_list_hook =
    boost::intrusive::list_base_hook<boost::intrusive::tag<eviction_tag>,
                                     boost::intrusive::link_mode<boost::intrusive::normal_link>>;
using eviction_set_hook =
    boost::intrusive::set_base_hook<boost::intrusive::tag<eviction_tag>,
                                    boost::intrusive::link_mode<boost::intrusive::normal_link>>;

/// The hooks an evictable entry carries. Allocators derive their cached-entry types from it; each
/// policy uses the hook it needs, so entries pay a few links and no allocation.
struct eviction_hook : eviction_list_hook, eviction_set_hook {
  std::size_t eviction_bytes_ = 0;  ///< what dropping this entry gives back
};

// ---------------------------------------------------------------------------------------------
// eviction_policy
//
// A policy E provides `E::queue<Entry>` for any Entry derived from eviction_hook:
//
// | expression     | returns | throws | meaning
// |----------------|---------|--------|------------------------------------------------
// | q.push(e)      | void    | no     | e became evictable (it was just cached)
// | q.erase(e)     | void    | no     | e is no longer evictable (reused, or dropped)
// | q.victim()     | Entry*  | no     | the entry to drop next; null when empty
// | cq.empty()     | bool    | no     |
// | cq.size()      | size_t  | no     |
//
// All operations are O(1) or O(log n) and never allocate. Not thread-safe: the owning
// allocator's lock covers them.
// ---------------------------------------------------------------------------------------------
template <class Q, class Entry>
concept eviction_queue = std::default_initializable<Q> && requires(Q& q, const Q& cq, Entry& e) {
  { q.push(e) } noexcept;
  { q.erase(e) } noexcept;
  { q.victim() } noexcept -> std::same_as<Entry*>;
  { cq.empty() } noexcept -> std::same_as<bool>;
  { cq.size() } noexcept -> std::same_as<std::size_t>;
};

namespace detail {
struct eviction_probe : eviction_hook {};
}  // namespace detail

template <class E>
concept eviction_policy = eviction_queue<typename E::template queue<detail::eviction_probe>,
                                         detail::eviction_probe>;

/// Least recently cached first: the entry idle longest is dropped first, GMLake's StitchFree
/// order. O(1) for every operation.
struct lru_eviction {
  template <class Entry>
  class queue {
    using list = boost::intrusive::list<Entry, boost::intrusive::base_hook<eviction_list_hook>,
                                        boost::intrusive::constant_time_size<true>>;

   public:
    void push(Entry& e) noexcept { list_.push_back(e); }
    void erase(Entry& e) noexcept { list_.erase(list_.iterator_to(e)); }
    Entry* victim() noexcept { return list_.empty() ? nullptr : &list_.front(); }
    bool empty() const noexcept { return list_.empty(); }
    std::size_t size() const noexcept { return list_.size(); }

   private:
    list list_;
  };
};
static_assert(eviction_policy<lru_eviction>);

/// Largest first: frees the most memory (or mapping) with the fewest drops, which matters when
/// each drop costs driver calls per entry rather than per byte. O(log n).
struct largest_first_eviction {
  template <class Entry>
  class queue {
    struct by_bytes {
      bool operator()(const eviction_hook& a, const eviction_hook& b) const noexcept {
        return a.eviction_bytes_ > b.eviction_bytes_;
      }
    };
    using set = boost::intrusive::multiset<Entry, boost::intrusive::base_hook<eviction_set_hook>,
                                           boost::intrusive::compare<by_bytes>,
                                           boost::intrusive::constant_time_size<true>>;

   public:
    void push(Entry& e) noexcept { set_.insert(e); }
    void erase(Entry& e) noexcept { set_.erase(set_.iterator_to(e)); }
    Entry* victim() noexcept { return set_.empty() ? nullptr : &*set_.begin(); }
    bool empty() const noexcept { return set_.empty(); }
    std::size_t size() const noexcept { return set_.size(); }

   private:
    set set_;
  };
};
static_assert(eviction_policy<largest_first_eviction>);

}  // namespace glake
