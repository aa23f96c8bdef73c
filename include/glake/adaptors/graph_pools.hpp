// The private memory pools of CUDA graphs on one device, as a state machine of their own: which
// pools exist, which captures send requests to which pool, which live blocks each pool holds, and
// when a pool's memory goes back (PyTorch's beginAllocateToPool / endAllocateToPool /
// releasePool). Design note: docs/pytorch.md, "Private pools (CUDA graphs)".
#pragma once

#include <algorithm>
#include <atomic>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "glake/allocators/concepts.hpp"
#include "glake/detail/accounting.hpp"
#include "glake/detail/archetypes.hpp"
#include "glake/errors.hpp"
#include "glake/statistics.hpp"
#include "glake/stream.hpp"

namespace glake {

/// A private pool's name (PyTorch's MempoolId_t). {0, 0} names no pool: a device's general
/// allocator, in visitors that show both.
using graph_pool_id = std::pair<std::uint64_t, std::uint64_t>;

namespace detail {
/// Only the counts of `s` (calls, events, driver calls and their time, which never go down): what
/// stays of a pool that is gone, which holds no bytes.
inline statistics counts_of(statistics s) noexcept {
  for_each_statistic(s, s, [](statistic_kind kind, auto& field, const auto&) {
    if (kind != statistic_kind::count) field = {};
  });
  return s;
}

inline std::string pool_text(graph_pool_id id) {
  return "graph pool (" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")";
}
}  // namespace detail

// ---------------------------------------------------------------------------------------------
// graph_pool_host
//
// What graph_pools asks of the adaptor that owns it: the narrow interface through which the
// pools call back. `p`, `n`, `s`: a block, its size and stream; `m`: a message.
//
// | expression              | returns            | throws          | meaning
// |-------------------------|--------------------|-----------------|------------------------------
// | h.make_pool_allocator() | std::unique_ptr<A> | what making one | a new pool's allocator, made as
// |                         |                    | throws          | the device's general one is
// |                         |                    |                 | (null: none can be made)
// | h.relieve()             | void               | driver errors   | a pool is short of memory: give
// |                         |                    |                 | back what is cached elsewhere
// |                         |                    |                 | (the general allocator's cache)
// |                         |                    |                 | before the pool tries once more
// | h.freeing(p, n, s)      | void               | no              | a pool's block is about to be
// |                         |                    |                 | freed (a history's free entry)
// | h.report(m)             | void               | no              | a failure that is swallowed: a
// |                         |                    |                 | released pool's memory could
// |                         |                    |                 | not go back
//
// Model: pluggable_allocator's pool_host (adaptors/pluggable_allocator.hpp).
// ---------------------------------------------------------------------------------------------
template <class H, class A>
concept graph_pool_host = requires(H& h, const void* p, std::size_t n, stream_ref s, const std::string& m) {
  { h.make_pool_allocator() } -> std::same_as<std::unique_ptr<A>>;
  { h.relieve() } -> std::same_as<void>;
  { h.freeing(p, n, s) } noexcept -> std::same_as<void>;
  { h.report(m) } noexcept -> std::same_as<void>;
};

// ---------------------------------------------------------------------------------------------
// graph_pooling
//
// What an adaptor asks of a device's private pools. A pool has a use count (captures begun into
// it, plus creations, minus releases) and live blocks; while a capture into it is under way,
// requests whose stream the capture's filter takes go to it. `id` names a pool, `f` is a
// P::stream_filter, `q` a pointer, `n` and `s` a size and a stream.
//
// | expression           | returns            | throws             | meaning
// |----------------------|--------------------|--------------------|-------------------------------
// | p.begin(id, f)       | void               | usage_error        | requires: no capture into id
// |                      |                    | (bad_state) when a | under way. ensures: requests
// |                      |                    | capture into id is | whose stream passes f go to id
// |                      |                    | under way; what    | until end(id); id exists (made
// |                      |                    | making its         | now, retaining its memory) and
// |                      |                    | allocator throws   | has one use more; a released
// |                      |                    |                    | pool with live blocks retains
// |                      |                    |                    | its memory again
// | p.end(id)            | void               | no                 | ensures: no request goes to id;
// |                      |                    |                    | its blocks still return to it
// |                      |                    |                    | (nothing for a pool not begun)
// | p.release(id)        | void               | usage_error        | requires: id has a use.
// |                      |                    | (bad_state) when   | ensures: one use less; at none,
// |                      |                    | id has no use      | its free memory goes back now,
// |                      |                    |                    | the rest with its last block,
// |                      |                    |                    | and then id is gone
// | p.routing()          | bool               | no                 | a capture is under way (one
// |                      |                    |                    | atomic load)
// | p.allocate(n, s)     | void*              | out_of_memory      | null when no capture takes s;
// |                      |                    |                    | else n bytes of the first such
// |                      |                    |                    | capture's pool, live there
// | p.deallocate(q, n, s)| bool               | what the pool's    | false when q is no live block
// |                      |                    | allocator throws   | of a pool; else q is freed into
// |                      |                    |                    | its pool (which may go)
// | p.holds(q)           | bool               | no                 | q is a live block of a pool
// | p.with_owner(q, h)   | bool               | what h throws      | h(allocator) with the allocator
// |                      |                    |                    | of q's pool, locked; false (h
// |                      |                    |                    | not called): no pool holds q
// | p.use_count(id)      | size_t             | no                 | id's uses; 0 for no such pool
// | p.capturing(id)      | bool               | no                 | a capture into id is under way
// | p.live(id)           | vector<void*>      | bad_alloc          | id's live blocks, ascending
// | p.size()             | size_t             | no                 | pools now (released ones with
// |                      |                    |                    | live blocks included)
// | p.stats(id)          | optional<stats...> | no                 | id's allocator's statistics
// | p.add_stats(st)      | void               | no                 | adds every pool's statistics
// |                      |                    |                    | (peaks summed) and the counts
// |                      |                    |                    | of pools gone to st
// | p.for_each(g)        | void               | what g throws      | g(id, allocator) for each pool
// |                      |                    |                    | in order of creation, locked
//
// Model: graph_pools.
// ---------------------------------------------------------------------------------------------
template <class P>
concept graph_pooling = requires(P& p, const P& cp, graph_pool_id id, typename P::stream_filter f, void* q,
                                 const void* cq, std::size_t n, stream_ref s, statistics& st,
                                 void (*g)(graph_pool_id, typename P::allocator_type&),
                                 void (*h)(typename P::allocator_type&)) {
  typename P::allocator_type;
  { p.begin(id, std::move(f)) } -> std::same_as<void>;
  { p.end(id) } -> std::same_as<void>;
  { p.release(id) } -> std::same_as<void>;
  { cp.routing() } noexcept -> std::same_as<bool>;
  { p.allocate(n, s) } -> std::same_as<void*>;
  { p.deallocate(q, n, s) } -> std::same_as<bool>;
  { cp.holds(cq) } -> std::same_as<bool>;
  { p.with_owner(cq, h) } -> std::same_as<bool>;
  { cp.use_count(id) } -> std::same_as<std::size_t>;
  { cp.capturing(id) } -> std::same_as<bool>;
  { cp.live(id) } -> std::same_as<std::vector<void*>>;
  { cp.size() } noexcept -> std::same_as<std::size_t>;
  { cp.stats(id) } -> std::same_as<std::optional<statistics>>;
  { cp.add_stats(st) } -> std::same_as<void>;
  { cp.for_each(g) } -> std::same_as<void>;
};

/// One device's private pools (CUDA graphs), each served by an Allocator of its own that the
/// Host makes and that retains its memory while the pool is used: every address it handed out
/// keeps its memory, which the graph's replays use.
///
/// begin(id, filter) makes pool `id` (or adds a use to it) and starts a capture: until end(id),
/// requests whose stream `filter` takes go to the pool (the first capture's that takes it, in
/// order of begin). A block of a pool goes back to that pool only, whenever it is freed, and the
/// pool's free memory serves only the pool's later requests. release(id) drops a use (PyTorch's
/// use_count); a pool left without uses gives its free memory back at once and the rest as its
/// blocks are freed (PyTorch waits for the next empty_cache); with its last block it is gone, its
/// counts kept for add_stats. A released pool with live blocks (graph trees' warm-up outputs)
/// that is begun again retains its memory again. A pool short of memory has the Host relieve it
/// (the general allocator's cache) and tries once more.
///
/// Complexity: a request tries the captures' filters in order (one or two in practice); a free,
/// holds and record_stream's lookup are one hash lookup in the map of the pools' live blocks;
/// live(id) is linear in the pools' live blocks. Without a capture, routing() is one atomic load;
/// without pools, deallocate and holds are one atomic load.
/// Thread safety: every member may be called from any thread (one mutex, held while the pools'
/// allocators and the filters are called, and while for_each's function runs: it must not call
/// back into this object). Streams: passed through to the pools' allocators.
template <class Allocator, graph_pool_host<Allocator> Host>
  requires cache_releasing_allocator<Allocator>
class graph_pools {
 public:
  using allocator_type = Allocator;
  using pool_id = graph_pool_id;
  /// Which streams' requests a capture sends to its pool.
  using stream_filter = std::function<bool(stream_ref)>;

  explicit graph_pools(Host host) : host_(std::move(host)) {}
  graph_pools(const graph_pools&) = delete;
  graph_pools& operator=(const graph_pools&) = delete;

  /// Starts a capture into `id` (see the class comment). Throws usage_error (bad_state) when one
  /// is under way already, runtime_error when the Host made no allocator; nothing changed then.
  void begin(pool_id id, stream_filter filter)
    requires memory_retaining_allocator<Allocator>
  {
    std::lock_guard guard(mutex_);
    if (capture_of(id) != nullptr) {
      throw usage_error(usage_error::kind::bad_state,
                        detail::pool_text(id) + ": a capture into it is already under way (end it first)");
    }
    captures_.reserve(captures_.size() + 1);  // so that nothing below fails once the pool changed
    pool* p = find(id);
    if (p == nullptr) {
      auto made = std::make_unique<pool>();
      made->id = id;
      made->allocator = host_.make_pool_allocator();
      if (made->allocator == nullptr) throw std::runtime_error("the allocator factory returned null");
      made->allocator->retain_memory(true);
      pools_.reserve(pools_.size() + 1);
      p = pools_.emplace_back(std::move(made)).get();
      pool_count_.store(pools_.size(), std::memory_order_release);
      had_pools_.store(true, std::memory_order_release);
    } else if (p->uses == 0) {
      // Released with live blocks, it stopped retaining its memory (release_unused); a new
      // capture into it needs every address kept again.
      p->allocator->retain_memory(true);
    }
    ++p->uses;
    captures_.push_back(capture{id, std::move(filter)});
    capture_count_.store(captures_.size(), std::memory_order_release);
  }

  /// Requests stop going to `id`; its blocks still return to it. Nothing for a pool not begun.
  void end(pool_id id) {
    std::lock_guard guard(mutex_);
    std::erase_if(captures_, [&](const capture& c) { return c.pool == id; });
    capture_count_.store(captures_.size(), std::memory_order_release);
  }

  /// One use of `id` ends (a graph reset or destroyed). Throws usage_error (bad_state) when `id`
  /// has no use (never begun, or released as often as begun).
  void release(pool_id id) {
    std::lock_guard guard(mutex_);
    pool* p = find(id);
    if (p == nullptr || p->uses == 0) {
      throw usage_error(usage_error::kind::bad_state,
                        detail::pool_text(id) + ": released, but it is not in use (" +
                            (p == nullptr ? "no such pool" : "released as often as begun") + ")");
    }
    if (--p->uses != 0) return;
    if (p->live == 0) return retire(p);
    // Blocks still live (a library's workspace allocated during the capture, a tensor the user
    // kept): what is free goes back now, the rest as it is freed.
    release_unused(p);
  }

  /// A capture is under way.
  bool routing() const noexcept { return capture_count_.load(std::memory_order_acquire) != 0; }

  /// `bytes` from the pool of the first capture whose filter takes `stream`; null when none
  /// does. Throws out_of_memory when that pool cannot serve it even after the Host relieved it.
  void* allocate(std::size_t bytes, stream_ref stream) {
    if (!routing()) return nullptr;
    std::lock_guard guard(mutex_);
    pool* p = nullptr;
    for (const capture& c : captures_) {
      if (c.filter && c.filter(stream)) {
        p = find(c.pool);
        break;
      }
    }
    if (p == nullptr) return nullptr;
    owner_.reserve(owner_.size() + 1);  // so that recording the block cannot fail
    void* block = p->allocator->try_allocate(bytes, stream);
    if (block == nullptr) {
      host_.relieve();
      block = p->allocator->allocate(bytes, stream);
    }
    try {
      owner_.emplace(reinterpret_cast<std::uintptr_t>(block), p);
    } catch (...) {
      p->allocator->deallocate(block, bytes, stream);
      recount(p);
      throw;
    }
    ++p->live;
    recount(p);
    return block;
  }

  /// Frees `q` into its pool (true), or false when no pool holds it live. A released pool gives
  /// its memory back with its last block.
  bool deallocate(void* q, std::size_t bytes, stream_ref stream) {
    if (size() == 0) return false;
    std::lock_guard guard(mutex_);
    const auto it = owner_.find(reinterpret_cast<std::uintptr_t>(q));
    if (it == owner_.end()) return false;
    pool* p = it->second;
    host_.freeing(q, bytes, stream);
    p->allocator->deallocate(q, bytes, stream);
    owner_.erase(it);
    --p->live;
    if (p->uses != 0) {
      recount(p);
    } else if (p->live == 0) {
      retire(p);  // p is gone
    } else {
      release_unused(p);
    }
    return true;
  }

  /// `q` is a live block of a pool.
  bool holds(const void* q) const {
    if (size() == 0) return false;
    std::lock_guard guard(mutex_);
    return owner_.contains(reinterpret_cast<std::uintptr_t>(q));
  }

  /// Calls `f(allocator)` with the allocator of the pool that holds `q` live, under the lock, and
  /// returns true; false (f not called) when no pool holds it.
  template <class F>
  bool with_owner(const void* q, F&& f) {
    if (size() == 0) return false;
    std::lock_guard guard(mutex_);
    const auto it = owner_.find(reinterpret_cast<std::uintptr_t>(q));
    if (it == owner_.end()) return false;
    f(*it->second->allocator);
    return true;
  }

  /// `id`'s uses: captures begun into it minus releases; 0 for a pool that does not exist.
  std::size_t use_count(pool_id id) const {
    std::lock_guard guard(mutex_);
    const pool* p = find(id);
    return p == nullptr ? 0 : p->uses;
  }

  /// A capture into `id` is under way (begun, not yet ended).
  bool capturing(pool_id id) const {
    std::lock_guard guard(mutex_);
    return capture_of(id) != nullptr;
  }

  /// `id`'s live blocks, in ascending address order (empty for a pool that does not exist).
  std::vector<void*> live(pool_id id) const {
    std::vector<void*> out;
    std::lock_guard guard(mutex_);
    for (const auto& [address, p] : owner_) {
      if (p->id == id) out.push_back(reinterpret_cast<void*>(address));
    }
    std::sort(out.begin(), out.end(), std::less<>());
    return out;
  }

  /// Pools now, released ones with live blocks included (one atomic load).
  std::size_t size() const noexcept { return pool_count_.load(std::memory_order_acquire); }

  /// The statistics of `id`'s allocator, if the pool exists.
  std::optional<statistics> stats(pool_id id) const {
    std::lock_guard guard(mutex_);
    const pool* p = find(id);
    if (p == nullptr) return std::nullopt;
    return p->allocator->stats();
  }

  /// The bytes the pools hold now, as of their last allocation, free or release: one atomic load.
  std::size_t reserved_bytes() const noexcept { return reserved_.load(std::memory_order_relaxed); }

  /// Adds every pool's statistics to `into` (peaks summed: an upper bound of the combined peak)
  /// and the counts of the pools gone. One atomic load while there never were pools.
  void add_stats(statistics& into) const {
    if (!had_pools_.load(std::memory_order_acquire)) return;
    std::lock_guard guard(mutex_);
    for (const auto& p : pools_) accumulate(into, p->allocator->stats(), peak_rule::summed);
    accumulate(into, retired_, peak_rule::summed);  // counts only
  }

  /// Calls `f(id, allocator)` for each pool, in order of creation, under the lock.
  template <class F>
  void for_each(F&& f) const {
    if (size() == 0) return;
    std::lock_guard guard(mutex_);
    for (const auto& p : pools_) f(p->id, *p->allocator);
  }

 private:
  struct pool {
    pool_id id{};
    std::unique_ptr<Allocator> allocator;
    std::size_t live = 0;      ///< its blocks not yet freed
    std::size_t uses = 0;      ///< captures begun into it minus releases
    std::size_t reserved = 0;  ///< its reserved bytes as last counted into reserved_
  };

  // Brings reserved_ up to date with what `p` holds now (reserved_bytes: a counter, not a whole
  // statistics; a read that throws leaves the last count). Under the lock.
  void recount(pool* p) noexcept {
    std::size_t now = 0;
    try {
      now = p->allocator->reserved_bytes();
    } catch (...) {
      return;
    }
    reserved_.fetch_add(now - p->reserved, std::memory_order_relaxed);  // modular: a decrease too
    p->reserved = now;
  }
  struct capture {
    pool_id pool;
    stream_filter filter;
  };

  pool* find(pool_id id) const noexcept {
    for (const auto& p : pools_) {
      if (p->id == id) return p.get();
    }
    return nullptr;
  }
  const capture* capture_of(pool_id id) const noexcept {
    for (const capture& c : captures_) {
      if (c.pool == id) return &c;
    }
    return nullptr;
  }

  // A released pool with live blocks keeps only what they need: it stops retaining memory and
  // gives back its free segments (PyTorch's empty_cache does the same for a released pool).
  void release_unused(pool* p) noexcept {
    give_back(p, "releasing free memory of ");
    recount(p);
  }

  // A pool without uses or live blocks: its memory goes back through its own release (so that an
  // observer hears of each segment), its counts stay for add_stats.
  void retire(pool* p) noexcept {
    give_back(p, "releasing ");
    recount(p);
    // What the release left goes with the allocator below: no longer counted as held.
    reserved_.fetch_sub(p->reserved, std::memory_order_relaxed);
    try {
      accumulate(retired_, detail::counts_of(p->allocator->stats()));
    } catch (...) {
      // its counts are lost to add_stats; the pool goes all the same
    }
    std::erase_if(pools_, [p](const auto& q) { return q.get() == p; });
    pool_count_.store(pools_.size(), std::memory_order_release);
  }

  void give_back(pool* p, const char* what) noexcept {
    try {
      if constexpr (memory_retaining_allocator<Allocator>) p->allocator->retain_memory(false);
      p->allocator->release_cached();
    } catch (const std::exception& e) {
      try {
        host_.report(what + detail::pool_text(p->id) + " failed: " + e.what());
      } catch (...) {  // a message that could not be made: nothing to report it with
      }
    }
  }

  [[no_unique_address]] Host host_;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<pool>> pools_;
  std::vector<capture> captures_;
  std::unordered_map<std::uintptr_t, pool*> owner_;  // the pools' live blocks
  statistics retired_;                               // the counts of pools gone (no bytes)
  std::atomic<std::size_t> pool_count_{0};
  std::atomic<std::size_t> capture_count_{0};
  std::atomic<bool> had_pools_{false};  // pools, or counts of pools gone, for add_stats
  std::atomic<std::size_t> reserved_{0};  // the pools' reserved bytes (pool::reserved summed)
};

namespace detail {
/// An allocator that retains memory and can give its cache back, and nothing more.
struct retaining_allocator_archetype : allocator_archetype {
  void release_cached();
  void retain_memory(bool retain);
};
/// A graph_pool_host and nothing more.
struct graph_pool_host_archetype {
  std::unique_ptr<retaining_allocator_archetype> make_pool_allocator();
  void relieve();
  void freeing(const void* p, std::size_t bytes, stream_ref stream) noexcept;
  void report(const std::string& message) noexcept;
};
}  // namespace detail
static_assert(graph_pooling<graph_pools<detail::retaining_allocator_archetype, detail::graph_pool_host_archetype>>);

}  // namespace glake
