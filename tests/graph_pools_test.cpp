// graph_pools: the state machine of CUDA graphs' private pools (adaptors/graph_pools.hpp), on the
// simulated and the host backend: captures routing requests to their pool, blocks returning to
// it, release with live blocks, a capture restarted into a released pool, the live blocks, and
// misuse refused with a message that says what was wrong.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "glake/adaptors/graph_pools.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/host.hpp"
#include "glake/backends/sim.hpp"

using namespace glake;

namespace {

// A stitching allocator that remembers whether it was last told to retain its memory.
template <class Base>
struct retain_noting : Base {
  using Base::Base;
  void retain_memory(bool retain) {
    retaining = retain;
    Base::retain_memory(retain);
  }
  bool retaining = false;
};

using sim_stitching = stitching_allocator<sim_provider, sim_reserver, best_fit_tail_stitching, lru_eviction, mutex_lock>;
using host_stitching = stitching_allocator<host_provider, host_reserver>;

// Where the pools' allocators get their memory: one simulated device, or the host's memory.
struct sim_memory {
  using allocator = retain_noting<sim_stitching>;
  explicit sim_memory(std::size_t capacity = 16 * GiB) : device(capacity) {}
  std::unique_ptr<allocator> make() { return std::make_unique<allocator>(sim_provider{device}, sim_reserver{device}); }
  sim_device device;
};
struct host_memory {
  using allocator = retain_noting<host_stitching>;
  std::unique_ptr<allocator> make() { return std::make_unique<allocator>(provider, host_reserver(2 * MiB)); }
  host_provider provider{2 * MiB, 1 * GiB};
};

// What the host saw: allocators made, reliefs, frees announced, failures reported.
template <class Memory>
struct host_log {
  explicit host_log(Memory* m) : memory(m) {}
  Memory* memory;
  typename Memory::allocator* general = nullptr;  // relieved when a pool is short
  bool refuse = false;                            // make_pool_allocator returns null
  std::vector<typename Memory::allocator*> made;
  int reliefs = 0;
  int frees = 0;
  std::vector<std::string> reports;
};

// A graph_pool_host that keeps a host_log.
template <class Memory>
struct logging_host {
  host_log<Memory>* log;
  std::unique_ptr<typename Memory::allocator> make_pool_allocator() {
    if (log->refuse) return nullptr;
    auto a = log->memory->make();
    log->made.push_back(a.get());
    return a;
  }
  void relieve() {
    ++log->reliefs;
    if (log->general != nullptr) log->general->release_cached();
  }
  void freeing(const void*, std::size_t, stream_ref) noexcept { ++log->frees; }
  void report(const std::string& message) noexcept {
    try {
      log->reports.push_back(message);
    } catch (...) {
    }
  }
};
static_assert(graph_pool_host<logging_host<sim_memory>, sim_memory::allocator>);

template <class Memory>
using pools_over = graph_pools<typename Memory::allocator, logging_host<Memory>>;
static_assert(graph_pooling<pools_over<sim_memory>>);
static_assert(graph_pooling<pools_over<host_memory>>);

const stream_ref capture_stream{42}, other_stream{43};
const graph_pool_id pool_a{0, 1}, pool_b{0, 2};

graph_pools<sim_memory::allocator, logging_host<sim_memory>>::stream_filter only(stream_ref s) {
  return [s](stream_ref t) { return t == s; };
}

// A model with its memory and its host's log.
template <class Memory>
struct fixture {
  Memory memory;
  host_log<Memory> log{&memory};
  pools_over<Memory> pools{logging_host<Memory>{&log}};
};

template <class P>
std::size_t reserved(const P& pools, graph_pool_id id) {
  const auto s = pools.stats(id);
  REQUIRE(s.has_value());
  return s->reserved_bytes;
}

}  // namespace

TEST_CASE_TEMPLATE("graph_pools: a capture sends its stream's requests to its pool until it ends", Memory, sim_memory,
                   host_memory) {
  fixture<Memory> f;
  auto& pools = f.pools;
  CHECK(!pools.routing());
  CHECK(pools.allocate(MiB, capture_stream) == nullptr);  // no capture: the caller's own allocator serves it
  pools.begin(pool_a, only(capture_stream));
  CHECK(pools.routing());
  CHECK(pools.capturing(pool_a));
  CHECK(pools.use_count(pool_a) == 1);
  CHECK(pools.size() == 1);
  REQUIRE(f.log.made.size() == 1);
  CHECK(f.log.made[0]->retaining);  // a graph's replays use every address it handed out
  CHECK(pools.allocate(MiB, other_stream) == nullptr);  // the filter says no
  void* p = pools.allocate(4 * MiB, capture_stream);
  REQUIRE(p != nullptr);
  CHECK(f.log.made[0]->owns(p));
  CHECK(pools.holds(p));
  CHECK(pools.live(pool_a) == std::vector<void*>{p});
  pools.end(pool_a);
  CHECK(!pools.routing());
  CHECK(!pools.capturing(pool_a));
  CHECK(pools.use_count(pool_a) == 1);  // ending a capture is not releasing the pool
  CHECK(pools.allocate(4 * MiB, capture_stream) == nullptr);
  // Its block still returns to it, after the capture.
  CHECK(pools.deallocate(p, 4 * MiB, capture_stream));
  CHECK(f.log.frees == 1);
  CHECK(!pools.holds(p));
  CHECK(pools.live(pool_a).empty());
  CHECK(pools.stats(pool_a)->deallocations == 1);
  CHECK(reserved(pools, pool_a) >= 4 * MiB);  // used and retained: the pool keeps its memory
  pools.release(pool_a);
  CHECK(pools.size() == 0);
  CHECK(!pools.stats(pool_a).has_value());
  CHECK(f.log.reports.empty());
}

TEST_CASE_TEMPLATE("graph_pools: a pool released with live blocks gives its free memory back, the rest with its last "
                   "block",
                   Memory, sim_memory, host_memory) {
  fixture<Memory> f;
  auto& pools = f.pools;
  pools.begin(pool_a, only(capture_stream));
  void* kept = pools.allocate(8 * MiB, capture_stream);
  void* dropped = pools.allocate(64 * MiB, capture_stream);
  REQUIRE((kept != nullptr && dropped != nullptr));
  CHECK(pools.deallocate(dropped, 64 * MiB, capture_stream));
  pools.end(pool_a);
  const std::size_t before = reserved(pools, pool_a);
  CHECK(before >= 72 * MiB);
  pools.release(pool_a);
  CHECK(pools.use_count(pool_a) == 0);
  CHECK(pools.size() == 1);  // the live block keeps it
  CHECK(!f.log.made[0]->retaining);
  CHECK(reserved(pools, pool_a) <= before - 64 * MiB);
  CHECK(reserved(pools, pool_a) >= 8 * MiB);
  CHECK(pools.live(pool_a) == std::vector<void*>{kept});
  CHECK(pools.deallocate(kept, 8 * MiB, capture_stream));
  CHECK(pools.size() == 0);
  CHECK(!pools.stats(pool_a).has_value());
  // Its counts stay in add_stats once it is gone.
  statistics st;
  pools.add_stats(st);
  CHECK(st.allocations == 2);
  CHECK(st.deallocations == 2);
  CHECK(st.reserved_bytes == 0);
  CHECK(f.log.reports.empty());
}

TEST_CASE_TEMPLATE("graph_pools: a capture restarted into a released pool with live blocks retains its memory again",
                   Memory, sim_memory, host_memory) {
  // PyTorch's graph trees warm up in a pool (begin, end, release: no use left, outputs live),
  // then capture into it: the capture's frees must keep their memory.
  fixture<Memory> f;
  auto& pools = f.pools;
  pools.begin(pool_a, only(capture_stream));
  void* output = pools.allocate(8 * MiB, capture_stream);
  pools.end(pool_a);
  pools.release(pool_a);
  REQUIRE(pools.size() == 1);
  CHECK(!f.log.made[0]->retaining);
  pools.begin(pool_a, only(capture_stream));
  CHECK(f.log.made.size() == 1);  // the same pool, not a new one
  CHECK(f.log.made[0]->retaining);
  CHECK(pools.use_count(pool_a) == 1);
  void* during = pools.allocate(32 * MiB, capture_stream);
  REQUIRE(during != nullptr);
  CHECK(pools.deallocate(during, 32 * MiB, capture_stream));
  CHECK(reserved(pools, pool_a) >= 40 * MiB);  // the freed block's memory stays
  CHECK(pools.live(pool_a) == std::vector<void*>{output});
  pools.end(pool_a);
  pools.release(pool_a);
  CHECK(pools.size() == 1);
  CHECK(pools.deallocate(output, 8 * MiB, capture_stream));
  CHECK(pools.size() == 0);
}

TEST_CASE_TEMPLATE("graph_pools: live blocks are each pool's own, in address order, and the first capture's filter wins",
                   Memory, sim_memory, host_memory) {
  fixture<Memory> f;
  auto& pools = f.pools;
  pools.begin(pool_a, only(capture_stream));
  pools.begin(pool_b, [](stream_ref) { return true; });  // takes every stream, but a's capture came first
  std::vector<void*> in_a, in_b;
  std::map<void*, std::size_t> sizes;
  for (std::size_t i = 0; i < 3; ++i) in_a.push_back(pools.allocate((i + 1) * MiB, capture_stream));
  for (std::size_t i = 0; i < 2; ++i) in_b.push_back(pools.allocate((i + 1) * MiB, other_stream));
  for (std::size_t i = 0; i < 3; ++i) sizes[in_a[i]] = (i + 1) * MiB;
  for (std::size_t i = 0; i < 2; ++i) sizes[in_b[i]] = (i + 1) * MiB;
  std::sort(in_a.begin(), in_a.end(), std::less<>());
  std::sort(in_b.begin(), in_b.end(), std::less<>());
  CHECK(pools.live(pool_a) == in_a);
  CHECK(pools.live(pool_b) == in_b);
  for (void* p : in_a) CHECK(f.log.made[0]->owns(p));
  for (void* p : in_b) CHECK(f.log.made[1]->owns(p));
  CHECK(pools.live(graph_pool_id{9, 9}).empty());
  CHECK(pools.stats(pool_a)->allocations == 3);
  CHECK(pools.stats(pool_b)->allocations == 2);
  std::vector<graph_pool_id> order;
  pools.for_each([&](graph_pool_id id, typename Memory::allocator&) { order.push_back(id); });
  CHECK(order == std::vector<graph_pool_id>{pool_a, pool_b});
  // a's capture ends: its stream's requests now reach b.
  pools.end(pool_a);
  void* moved = pools.allocate(MiB, capture_stream);
  sizes[moved] = MiB;
  CHECK(f.log.made[1]->owns(moved));
  CHECK(pools.live(pool_b).size() == 3);
  statistics st;
  pools.add_stats(st);
  CHECK(st.allocations == 6);
  CHECK(st.active_bytes == (1 + 2 + 3 + 1 + 2 + 1) * MiB);
  pools.end(pool_b);
  pools.release(pool_a);
  pools.release(pool_b);
  CHECK(pools.size() == 2);
  for (const auto& [p, bytes] : sizes) CHECK(pools.deallocate(p, bytes, capture_stream));
  CHECK(pools.size() == 0);
  CHECK(f.log.frees == 6);
}

TEST_CASE_TEMPLATE("graph_pools: misuse is refused with a message, and changes nothing", Memory, sim_memory,
                   host_memory) {
  fixture<Memory> f;
  auto& pools = f.pools;
  const auto refused = [](auto&& call, const std::string& says) {
    try {
      call();
      FAIL("not refused");
    } catch (const usage_error& e) {
      CHECK(e.which() == usage_error::kind::bad_state);
      CHECK(std::string(e.what()).find("graph pool (0, 1)") != std::string::npos);
      CHECK(std::string(e.what()).find(says) != std::string::npos);
    }
  };
  refused([&] { pools.release(pool_a); }, "no such pool");
  pools.begin(pool_a, only(capture_stream));
  refused([&] { pools.begin(pool_a, only(other_stream)); }, "already under way");
  CHECK(pools.use_count(pool_a) == 1);  // the refused begin added no use
  CHECK(pools.allocate(MiB, other_stream) == nullptr);  // nor its filter
  pools.end(pool_b);  // a pool never begun: nothing to end
  CHECK(pools.capturing(pool_a));
  int local = 0;
  CHECK(!pools.deallocate(&local, sizeof local, capture_stream));  // not a pool's block
  CHECK(!pools.holds(&local));
  CHECK(!pools.with_owner(&local, [](auto&) { FAIL("called for a foreign pointer"); }));
  pools.end(pool_a);
  pools.release(pool_a);
  CHECK(pools.size() == 0);
  refused([&] { pools.release(pool_a); }, "no such pool");
  // A host that cannot make an allocator: no pool, no capture.
  f.log.refuse = true;
  CHECK_THROWS_WITH_AS(pools.begin(pool_b, only(capture_stream)), "the allocator factory returned null",
                       std::runtime_error);
  CHECK(pools.size() == 0);
  CHECK(!pools.routing());
  CHECK(f.log.frees == 0);
}

TEST_CASE("graph_pools: a pool short of memory has the host relieve it once, then tries again") {
  sim_memory memory(16 * GiB);
  host_log<sim_memory> log{&memory};
  auto general = memory.make();
  log.general = general.get();
  pools_over<sim_memory> pools{logging_host<sim_memory>{&log}};
  general->deallocate(general->allocate(8 * GiB, other_stream), 8 * GiB, other_stream);
  REQUIRE(general->stats().reserved_bytes == 8 * GiB);  // cached by the general allocator
  pools.begin(pool_a, only(capture_stream));
  void* p = pools.allocate(12 * GiB, capture_stream);
  CHECK(p != nullptr);
  CHECK(log.reliefs == 1);
  CHECK(general->stats().reserved_bytes == 0);
  CHECK_THROWS_AS(pools.allocate(12 * GiB, capture_stream), out_of_memory);  // nothing left to give back
  CHECK(log.reliefs == 2);
  CHECK(pools.live(pool_a) == std::vector<void*>{p});  // the failure recorded no block
  CHECK(pools.deallocate(p, 12 * GiB, capture_stream));
  pools.end(pool_a);
  pools.release(pool_a);
  CHECK(memory.device.physical_bytes() == 0);
}
