// async_reserver: mapping calls run on a helper thread in order, gates hold a stream (or the
// caller) until they are done, failures are reported, and the stitching allocator over it makes
// the same decisions as over the synchronous reserver.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/async_reserver.hpp"
#include "glake/backends/fault_injection.hpp"
#include "glake/backends/sim.hpp"

namespace {

using namespace glake;
constexpr std::size_t M = MiB;
const stream_ref S{1}, T{2};

// What the test's streams hold: host functions queued by gates, run when the test says.
struct host_queue {
  std::vector<std::pair<stream_ref, std::function<void()>>> queued;
  bool capturing = false;  // streams refuse host functions, as under graph capture
};

// A sim reserver whose maps wait while `hold` is set, so that a test can see what is and is not
// done yet.
class held_sim_reserver : public sim_reserver {
 public:
  held_sim_reserver(sim_device& device, std::atomic<bool>& hold) : sim_reserver(device), hold_(&hold) {}
  bool try_map(void* at, std::size_t bytes, handle_type handle) {
    while (hold_->load()) std::this_thread::sleep_for(std::chrono::microseconds(50));
    return sim_reserver::try_map(at, bytes, handle);
  }

 private:
  std::atomic<bool>* hold_;
};

// ... whose streams also take host functions (into a host_queue).
class gated_sim_reserver : public held_sim_reserver {
 public:
  gated_sim_reserver(sim_device& device, host_queue& queue, std::atomic<bool>& hold)
      : held_sim_reserver(device, hold), queue_(&queue) {}
  bool enqueue_host_function(stream_ref stream, host_function fn, void* arg) {
    if (queue_->capturing) return false;
    queue_->queued.emplace_back(stream, [fn, arg] { fn(arg); });
    return true;
  }
  void attach_thread() { ++attached; }
  void detach_thread() noexcept { ++detached; }
  inline static std::atomic<int> attached{0}, detached{0};

 private:
  host_queue* queue_;
};
static_assert(host_function_reserver<gated_sim_reserver>);
static_assert(address_reserver<async_reserver<sim_reserver>>);
static_assert(!stream_ordered_reserver<async_reserver<sim_reserver>>);

// Clears `hold` after a while, from another thread: what a gate waits for arrives later.
std::thread release_later(std::atomic<bool>& hold) {
  return std::thread([&hold] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    hold = false;
  });
}

bool mapped_and_accessible(const sim_device& device, const void* p) {
  const auto where = device.resolve(p);
  return where.has_value() && where->accessible;
}

}  // namespace

TEST_CASE("async_reserver: maps, access, unmaps and frees run in order on the helper; a gate without host functions waits for them") {
  sim_device device(1 * GiB);
  sim_provider provider{device};
  const auto h = provider.try_create(2 * M).value();
  std::atomic<bool> hold{true};
  {
    async_reserver<held_sim_reserver> r(held_sim_reserver{device, hold});
    void* base = r.try_reserve(4 * M);
    REQUIRE(base != nullptr);
    char* at = static_cast<char*>(base);
    // The same address mapped, unmapped and mapped again: only the order makes this legal.
    CHECK(r.try_map(at, 2 * M, h));
    CHECK(r.try_set_access(at, 2 * M));
    r.unmap(at, 2 * M);
    CHECK(r.try_map(at + 2 * M, 2 * M, h));
    CHECK(r.try_set_access(at + 2 * M, 2 * M));
    CHECK(r.deferred_calls() == 5);
    std::thread later = release_later(hold);
    r.gate(S);  // no host functions here: waits on this thread
    later.join();
    CHECK(r.host_waits() == 1);
    CHECK(r.gates() == 0);
    CHECK_FALSE(device.resolve(at).has_value());
    CHECK(mapped_and_accessible(device, at + 2 * M));
    r.gate(S);  // nothing pending: no wait
    CHECK(r.host_waits() == 1);
    r.unmap(at + 2 * M, 2 * M);
    r.free(base, 4 * M);
    r.drain();
    CHECK(device.live_mappings() == 0);
    CHECK(device.reserved_bytes() == 0);
    CHECK(r.failure().empty());
  }
  provider.release(h);
  CHECK(device.violations() == 0);
}

TEST_CASE("async_reserver: a gate queued on the stream opens only once the mappings are done, once per stream and batch") {
  sim_device device(1 * GiB);
  sim_provider provider{device};
  const auto h = provider.try_create(2 * M).value();
  host_queue streams;
  std::atomic<bool> hold{true};
  const int attached_before = gated_sim_reserver::attached.load();
  {
    async_reserver<gated_sim_reserver> r(gated_sim_reserver{device, streams, hold});
    void* base = r.try_reserve(2 * M);
    CHECK(r.try_map(base, 2 * M, h));  // the helper now waits in this map
    CHECK(r.try_set_access(base, 2 * M));
    r.gate(S);
    r.gate(S);  // S already waits for every job queued
    r.gate(T);
    CHECK(r.gates() == 2);
    CHECK(r.host_waits() == 0);
    REQUIRE(streams.queued.size() == 2);
    CHECK(streams.queued[0].first == S);
    CHECK(streams.queued[1].first == T);

    // S's host function runs (as the device would reach it) and must not return before the map.
    std::atomic<bool> opened{false};
    std::thread device_side([&] {
      streams.queued[0].second();
      opened = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK_FALSE(opened.load());
    CHECK_FALSE(mapped_and_accessible(device, base));
    hold = false;
    device_side.join();
    CHECK(mapped_and_accessible(device, base));  // the gate opened after access was granted
    streams.queued[1].second();

    r.gate(S);  // everything done: nothing queued
    CHECK(r.gates() == 2);
    CHECK(gated_sim_reserver::attached.load() == attached_before + 1);  // the helper attached itself
    r.unmap(base, 2 * M);
    r.free(base, 2 * M);
  }
  CHECK(gated_sim_reserver::detached.load() == gated_sim_reserver::attached.load());
  provider.release(h);
  CHECK(device.live_mappings() == 0);
  CHECK(device.violations() == 0);
}

TEST_CASE("async_reserver: a stream that refuses host functions (graph capture) is gated by waiting on the host") {
  sim_device device(1 * GiB);
  sim_provider provider{device};
  const auto h = provider.try_create(2 * M).value();
  host_queue streams;
  streams.capturing = true;
  std::atomic<bool> hold{true};
  async_reserver<gated_sim_reserver> r(gated_sim_reserver{device, streams, hold});
  void* base = r.try_reserve(2 * M);
  CHECK(r.try_map(base, 2 * M, h));
  CHECK(r.try_set_access(base, 2 * M));
  std::thread later = release_later(hold);
  r.gate(S);
  later.join();
  CHECK(streams.queued.empty());
  CHECK(r.host_waits() == 1);
  CHECK(mapped_and_accessible(device, base));
  r.unmap(base, 2 * M);
  r.free(base, 2 * M);
  r.drain();
  provider.release(h);
  CHECK(device.violations() == 0);
}

TEST_CASE("async_reserver: a failed deferred map is kept and makes the next new mapping throw; unthreaded it answers false") {
  sim_device device(1 * GiB);
  sim_provider provider{device};
  const auto h = provider.try_create(2 * M).value();
  fault_plan plan;
  using faulty = fault_injecting_reserver<sim_reserver>;

  SUBCASE("threaded") {
    async_reserver<faulty> r(faulty{sim_reserver{device}, plan});
    void* base = r.try_reserve(2 * M);
    plan.fail_nth_call_of(driver_call::map, 1);
    CHECK(r.try_map(base, 2 * M, h));  // queued: it cannot know yet
    r.drain();
    CHECK(r.failure().find("try_map") != std::string::npos);
    CHECK_THROWS_AS((void)r.try_reserve(2 * M), driver_error);
    CHECK_THROWS_AS((void)r.try_map(base, 2 * M, h), driver_error);
    r.free(base, 2 * M);  // releases still run
    r.drain();
    CHECK(device.reserved_bytes() == 0);
  }
  SUBCASE("unthreaded: the synchronous answers") {
    async_reserver<faulty> r(faulty{sim_reserver{device}, plan}, false);
    CHECK_FALSE(r.threaded());
    void* base = r.try_reserve(2 * M);
    plan.fail_nth_call_of(driver_call::map, 1);
    CHECK_FALSE(r.try_map(base, 2 * M, h));
    CHECK(r.deferred_calls() == 0);
    CHECK(r.try_map(base, 2 * M, h));
    CHECK(r.try_set_access(base, 2 * M));
    CHECK(mapped_and_accessible(device, base));  // inline: done on return
    r.gate(S);
    CHECK(r.host_waits() == 0);
    r.unmap(base, 2 * M);
    r.free(base, 2 * M);
    CHECK(r.failure().empty());
  }
  provider.release(h);
  CHECK(device.violations() == 0);
}

TEST_CASE("async_reserver: the stitching allocator over it makes the same decisions as over the synchronous reserver") {
  config cfg;
  cfg.frag_limit = 0;
  cfg.grow_stitch = true;
  cfg.max_handle = 64 * M;
  cfg.auto_gc = 2 * GiB;

  // The same random sequence through both; every allocation is checked to be mapped and
  // accessible when handed out, and the device to have seen no broken rule.
  auto run = [&](auto& allocator, sim_device& device) {
    std::mt19937_64 rng(2026);
    std::vector<std::pair<void*, std::size_t>> live;
    for (int step = 0; step < 20'000; ++step) {
      if (live.empty() || (live.size() < 40 && rng() % 100 < 52)) {
        const std::size_t bytes = std::size_t{1} << (10 + rng() % 20);
        const std::size_t asked = bytes + rng() % bytes;
        void* p = allocator.try_allocate(asked, S);
        if (p == nullptr) continue;
        REQUIRE(mapped_and_accessible(device, p));
        live.emplace_back(p, asked);
      } else {
        const std::size_t i = rng() % live.size();
        allocator.deallocate(live[i].first, live[i].second, S);
        live[i] = live.back();
        live.pop_back();
      }
      if (step % 5'000 == 4'999) allocator.release_cached();
    }
    for (auto [p, bytes] : live) allocator.deallocate(p, bytes, S);
    allocator.verify();
    return allocator.stats();
  };

  sim_device sync_device(3 * GiB), async_device(3 * GiB);
  statistics sync_stats, async_stats;
  {
    stitching_allocator<sim_provider, sim_reserver> allocator(sim_provider{sync_device}, sim_reserver{sync_device}, cfg);
    sync_stats = run(allocator, sync_device);
  }
  std::uint64_t deferred = 0, waits = 0;
  {
    stitching_allocator<sim_provider, async_reserver<sim_reserver>> allocator(
        sim_provider{async_device}, async_reserver<sim_reserver>(sim_reserver{async_device}), cfg);
    async_stats = run(allocator, async_device);
    deferred = allocator.reserver().deferred_calls();
    waits = allocator.reserver().host_waits();
  }
  CHECK(sync_stats.stitches > 50);
  CHECK(async_stats.stitches == sync_stats.stitches);
  CHECK(async_stats.stitch_repairs == sync_stats.stitch_repairs);
  CHECK(async_stats.stitch_grows == sync_stats.stitch_grows);
  CHECK(async_stats.peak_reserved_bytes == sync_stats.peak_reserved_bytes);
  CHECK(async_stats.failed_allocations == sync_stats.failed_allocations);
  CHECK(deferred > 1000);
  CHECK(waits < deferred);  // at most one wait per allocation, many jobs per stitch
  // Destruction released everything, after the helper's last unmaps.
  CHECK(async_device.physical_bytes() == 0);
  CHECK(async_device.live_mappings() == 0);
  CHECK(async_device.reserved_bytes() == 0);
  CHECK(async_device.violations() == 0);
  CHECK(sync_device.violations() == 0);
}
