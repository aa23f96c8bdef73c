// plan_copy's properties over many random inputs and its edge cases; multipath_copier over the
// host model with 1, 2, 4 and 8 simulated devices: bytes both ways, stream order, a driver
// failure at every call, and threads.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "glake/backends/host_dma.hpp"
#include "glake/movers/copy_plan.hpp"
#include "glake/movers/multipath_copy.hpp"
#include "support/faulty_copy_backend.hpp"

namespace {

using namespace glake;
using namespace std::chrono_literals;
using host_multipath = multipath_copier<host_dma_backend, range_classifier>;
using faulty_multipath = multipath_copier<testing::faulty_copy_backend, range_classifier>;
static_assert(byte_copier<host_multipath>);

// The invariants of every plan: in order, contiguous from 0 to n, none empty, aligned
// boundaries, only paths of positive weight.
void check_plan(const copy_plan& plan, std::size_t n, const std::vector<copy_path>& paths, std::size_t alignment) {
  REQUIRE(plan.bytes == n);
  std::size_t at = 0;
  std::size_t last_path = 0;
  for (std::size_t k = 0; k < plan.shares.size(); ++k) {
    const copy_share& s = plan.shares[k];
    CHECK(s.offset == at);
    CHECK(s.bytes > 0);
    CHECK(s.offset % alignment == 0);
    CHECK(((s.offset + s.bytes) % alignment == 0 || s.offset + s.bytes == n));
    REQUIRE(s.path < paths.size());
    CHECK(s.via == paths[s.path].via);
    CHECK(paths[s.path].weight > 0);
    if (k > 0) CHECK(s.path > last_path);
    last_path = s.path;
    at += s.bytes;
  }
  CHECK(at == n);
}

std::vector<unsigned char> pattern(std::size_t bytes, unsigned seed) {
  std::vector<unsigned char> v(bytes);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

// Small chunks and scratch buffers, so that a few KiB go through every stage of every path.
multipath_options small_options() {
  multipath_options o;
  o.staging.chunk_bytes = 1024;
  o.staging.chunks = 3;
  o.staging.threads = 2;
  o.staging.min_slice = 256;
  o.alignment = 256;
  o.scratch_bytes = 3000;  // not a multiple of the alignment: shares go in uneven pieces
  return o;
}

// "Device memory" of the target with guard bytes either side that no copy may touch, and host
// buffers, one of them registered as pinned.
struct rig {
  static constexpr std::size_t guard = 64;
  static constexpr std::size_t capacity = 64 * 1024;
  rig(int devices, std::chrono::microseconds delay, std::size_t min_bytes = 0)
      : backend(0, delay), device(capacity + 2 * guard, 0x5A), pinned(capacity) {
    classifier.add(dev(), capacity, memory_kind::device, 0);
    classifier.add(pinned.data(), pinned.size(), memory_kind::pinned);
    std::vector<peer_route<host_dma_backend>> peers;
    for (int d = 1; d < devices; ++d) {
      peers.push_back({backend.on_device(d), stream_ref{static_cast<std::uintptr_t>(1000 + d)}, 1.0, min_bytes});
    }
    copier = std::make_unique<host_multipath>(backend, peers, classifier, small_options());
  }
  unsigned char* dev() { return device.data() + guard; }
  bool guards_intact() const {
    for (std::size_t i = 0; i < guard; ++i) {
      if (device[i] != 0x5A || device[device.size() - 1 - i] != 0x5A) return false;
    }
    return true;
  }
  host_dma_backend backend;
  range_classifier classifier;
  std::vector<unsigned char> device;
  std::vector<unsigned char> pinned;
  std::unique_ptr<host_multipath> copier;
};

const std::size_t sizes[] = {1, 255, 256, 257, 1000, 4096, 3 * 4096 + 7, 9999, 40 * 1024 + 77};

}  // namespace

TEST_CASE("plan_copy covers every byte once, aligned, proportional within one alignment unit") {
  std::mt19937_64 rng(42);
  for (int round = 0; round < 4000; ++round) {
    const std::size_t alignment = std::size_t{1} << (rng() % 13);
    const std::size_t paths_count = 1 + rng() % 8;
    std::vector<copy_path> paths;
    for (std::size_t i = 0; i < paths_count; ++i) {
      const double w = rng() % 5 == 0 ? 0.0 : static_cast<double>(1 + rng() % 1000) / 10.0;
      paths.push_back({static_cast<int>(i), w, 0});
    }
    if (paths[0].weight == 0 && paths.size() == 1) paths[0].weight = 1;
    bool any = false;
    for (const copy_path& p : paths) any = any || p.weight > 0;
    if (!any) paths.back().weight = 3;
    const std::size_t n = round % 3 == 0 ? rng() % (4 * alignment) : rng() % (std::size_t{1} << (rng() % 40));
    CAPTURE(round);
    CAPTURE(n);
    CAPTURE(alignment);
    const copy_plan plan = plan_copy(n, 0, paths, alignment);
    check_plan(plan, n, paths, alignment);
    long double total = 0;
    for (const copy_path& p : paths) total += p.weight;
    for (std::size_t i = 0; i < paths.size(); ++i) {
      std::size_t got = 0;
      for (const copy_share& s : plan.shares) {
        if (s.path == i) got = s.bytes;
      }
      const long double ideal = static_cast<long double>(n) * paths[i].weight / total;
      CHECK(std::fabs(static_cast<long double>(got) - ideal) <= static_cast<long double>(alignment) * (1 + 1e-9L));
    }
  }
}

TEST_CASE("plan_copy drops a path whose share would be under its minimum") {
  constexpr std::size_t MiB_ = std::size_t{1} << 20;
  const std::vector<copy_path> paths = {{0, 1.0, 0}, {1, 1.0, 64 * MiB_}, {2, 2.0, 64 * MiB_}};
  SUBCASE("large enough: every path, in proportion") {
    const copy_plan plan = plan_copy(400 * MiB_, 0, paths, 2 * MiB_);
    check_plan(plan, 400 * MiB_, paths, 2 * MiB_);
    REQUIRE(plan.shares.size() == 3);
    CHECK(plan.shares[0] == copy_share{0, 0, 0, 100 * MiB_});
    CHECK(plan.shares[1] == copy_share{1, 1, 100 * MiB_, 100 * MiB_});
    CHECK(plan.shares[2] == copy_share{2, 2, 200 * MiB_, 200 * MiB_});
  }
  SUBCASE("the lighter peer is dropped first, the heavier keeps its place") {
    // 200 MiB: 50 / 50 / 100; peer 1 is under 64 MiB and goes; then 200/3 and 400/3 both fit.
    const copy_plan plan = plan_copy(200 * MiB_, 0, paths, 2 * MiB_);
    check_plan(plan, 200 * MiB_, paths, 2 * MiB_);
    REQUIRE(plan.shares.size() == 2);
    CHECK(plan.shares[0].path == 0);
    CHECK(plan.shares[1].path == 2);
    CHECK(plan.shares[1].bytes >= 64 * MiB_);
  }
  SUBCASE("small: the peers go one after the other, the direct path takes everything") {
    // 90 MiB: 22.5 / 22.5 / 45, peer 1 goes; 30 / 60, peer 2 goes too.
    const copy_plan plan = plan_copy(90 * MiB_, 0, paths, 2 * MiB_);
    REQUIRE(plan.shares.size() == 1);
    CHECK(plan.shares[0] == copy_share{0, 0, 0, 90 * MiB_});
  }
  SUBCASE("every path under its minimum: the heaviest takes everything") {
    const std::vector<copy_path> peers_only = {{1, 1.0, 64 * MiB_}, {2, 3.0, 64 * MiB_}};
    const copy_plan plan = plan_copy(10 * MiB_, 0, peers_only, 2 * MiB_);
    REQUIRE(plan.shares.size() == 1);
    CHECK(plan.shares[0] == copy_share{1, 2, 0, 10 * MiB_});
  }
}

TEST_CASE("plan_copy edge cases") {
  const std::vector<copy_path> two = {{0, 1.0, 0}, {3, 1.0, 0}};
  CHECK(plan_copy(0, 0, two, 64).shares.empty());
  SUBCASE("fewer bytes than one alignment unit: one path takes them") {
    const copy_plan plan = plan_copy(100, 0, two, 4096);
    REQUIRE(plan.shares.size() == 1);
    CHECK(plan.shares[0].bytes == 100);
  }
  SUBCASE("one path takes everything") {
    const std::vector<copy_path> one = {{0, 0.5, 0}};
    const copy_plan plan = plan_copy(12345, 0, one, 64);
    REQUIRE(plan.shares.size() == 1);
    CHECK(plan.shares[0] == copy_share{0, 0, 0, 12345});
  }
  SUBCASE("a path of weight 0 is never used") {
    const std::vector<copy_path> paths = {{0, 0.0, 0}, {3, 2.0, 0}};
    const copy_plan plan = plan_copy(1 << 20, 0, paths, 64);
    REQUIRE(plan.shares.size() == 1);
    CHECK(plan.shares[0].via == 3);
  }
  SUBCASE("n not a multiple of the alignment: the last share ends at n") {
    const copy_plan plan = plan_copy(10000, 0, two, 1024);
    check_plan(plan, 10000, two, 1024);
    REQUIRE(plan.shares.size() == 2);
    CHECK(plan.shares[0].bytes == 5120);
    CHECK(plan.shares[1].bytes == 4880);
  }
  SUBCASE("misconfigurations are config_error") {
    const std::vector<copy_path> none;
    CHECK_THROWS_AS(plan_copy(10, 0, none, 64), config_error);
    const std::vector<copy_path> zero = {{0, 0.0, 0}, {1, 0.0, 0}};
    CHECK_THROWS_AS(plan_copy(10, 0, zero, 64), config_error);
    CHECK_THROWS_AS(plan_copy(0, 0, zero, 64), config_error);
    const std::vector<copy_path> negative = {{0, 1.0, 0}, {1, -1.0, 0}};
    CHECK_THROWS_AS(plan_copy(10, 0, negative, 64), config_error);
    const std::vector<copy_path> nan = {{0, std::numeric_limits<double>::quiet_NaN(), 0}};
    CHECK_THROWS_AS(plan_copy(10, 0, nan, 64), config_error);
    const std::vector<copy_path> inf = {{0, std::numeric_limits<double>::infinity(), 0}};
    CHECK_THROWS_AS(plan_copy(10, 0, inf, 64), config_error);
    CHECK_THROWS_AS(plan_copy(10, 0, two, 0), config_error);
    CHECK_THROWS_AS(plan_copy(10, 0, two, 48), config_error);
    const std::vector<copy_path> twice = {{0, 1.0, 0}, {2, 1.0, 0}, {2, 1.0, 0}};
    CHECK_THROWS_AS(plan_copy(10, 0, twice, 64), config_error);
    const std::vector<copy_path> target_later = {{1, 1.0, 0}, {0, 1.0, 0}};
    CHECK_THROWS_AS(plan_copy(10, 0, target_later, 64), config_error);
  }
}

TEST_CASE("multipath_copier copies both ways through 1, 2, 4 and 8 devices, for every size") {
  for (const int devices : {1, 2, 4, 8}) {
    CAPTURE(devices);
    rig r(devices, 20us);
    const stream_ref stream{std::uintptr_t{7}};
    for (const std::size_t n : sizes) {
      CAPTURE(n);
      for (const bool pinned : {false, true}) {
        CAPTURE(pinned);
        const std::vector<unsigned char> expected = pattern(n, static_cast<unsigned>(n * 3 + (pinned ? 1 : 0)));
        std::vector<unsigned char> pageable = expected;
        unsigned char* const host = pinned ? r.pinned.data() : pageable.data();
        if (pinned) std::memcpy(host, expected.data(), n);
        r.copier->copy(r.dev(), host, n, stream);
        if (!pinned) std::memset(pageable.data(), 0xEE, n);  // read whole when copy returned
        r.backend.wait_stream(stream);
        CHECK(std::memcmp(r.dev(), expected.data(), n) == 0);

        std::memset(host, 0xEE, n);
        r.copier->copy(host, r.dev(), n, stream);
        r.backend.wait_stream(stream);
        CHECK(std::memcmp(host, expected.data(), n) == 0);
        CHECK(r.guards_intact());
      }
    }
    const multipath_statistics s = r.copier->stats();
    CHECK(s.copies == 4 * std::size(sizes));
    REQUIRE(s.path_bytes.size() == static_cast<std::size_t>(devices));
    if (devices == 1) {
      CHECK(s.split_copies == 0);
      CHECK(r.backend.peer_copies() == 0);
    } else {
      CHECK(s.split_copies > 0);
      CHECK(r.backend.peer_copies() > 0);
      for (int d = 0; d < devices; ++d) CHECK(s.path_bytes[static_cast<std::size_t>(d)] > 0);
    }
    CHECK(r.backend.source_changes() == 0);
    CHECK(r.backend.live_device() <= static_cast<std::size_t>(devices - 1));
    r.copier.reset();
    CHECK(r.backend.live_device() == 0);
    CHECK(r.backend.live_staging() == 0);
    CHECK(r.backend.live_events() == 0);
  }
}

TEST_CASE("multipath_copier leaves a peer out when its share is under its minimum") {
  rig r(4, 0us, 8 * 1024);  // each peer wants 8 KiB at least
  const stream_ref stream{std::uintptr_t{8}};
  // 3 KiB a path; without one peer 4 KiB, without two 6 KiB: the direct path alone.
  const std::vector<unsigned char> small = pattern(12 * 1024, 1);
  r.copier->copy(r.dev(), small.data(), small.size(), stream);
  r.backend.wait_stream(stream);
  CHECK(std::memcmp(r.dev(), small.data(), small.size()) == 0);
  CHECK(r.copier->stats().split_copies == 0);
  CHECK(r.backend.peer_copies() == 0);
  const std::vector<unsigned char> large = pattern(40 * 1024, 2);  // 10 KiB a path: all four
  r.copier->copy(r.dev(), large.data(), large.size(), stream);
  r.backend.wait_stream(stream);
  CHECK(std::memcmp(r.dev(), large.data(), large.size()) == 0);
  const multipath_statistics s = r.copier->stats();
  CHECK(s.split_copies == 1);
  for (std::size_t d = 1; d < 4; ++d) CHECK(s.path_bytes[d] == 10 * 1024);
}

TEST_CASE("multipath_copier is ordered on the caller's stream") {
  for (const int devices : {2, 8}) {
    CAPTURE(devices);
    rig r(devices, 200us);
    const stream_ref stream{std::uintptr_t{9}};
    const std::size_t n = 30 * 1024 + 5;
    unsigned char* const dev = r.dev();
    SUBCASE("host to device: earlier work runs first, later work sees the data") {
      r.backend.launch(stream, [dev, n] {
        std::this_thread::sleep_for(30ms);
        std::memset(dev, 0xAB, n);
      });
      const std::vector<unsigned char> a = pattern(n, 6);
      r.copier->copy(dev, a.data(), n, stream);
      std::vector<unsigned char> seen(n);
      r.backend.launch(stream, [&seen, dev, n] { std::memcpy(seen.data(), dev, n); });
      r.backend.wait_stream(stream);
      CHECK(seen == a);
      CHECK(std::memcmp(dev, a.data(), n) == 0);
    }
    SUBCASE("device to host: the copy reads what earlier work wrote, later work may overwrite it") {
      std::memset(dev, 0x11, n);
      r.backend.launch(stream, [dev, n] {
        std::this_thread::sleep_for(30ms);
        std::memset(dev, 0xCD, n);
      });
      unsigned char* const host = r.pinned.data();  // a pinned target: copy returns before the data
      r.copier->copy(host, dev, n, stream);
      r.backend.launch(stream, [dev, n] { std::memset(dev, 0x22, n); });
      r.backend.wait_stream(stream);
      CHECK(std::vector<unsigned char>(host, host + n) == std::vector<unsigned char>(n, 0xCD));
    }
  }
}

TEST_CASE("multipath_copier refuses misuse") {
  rig r(2, 0us);
  std::vector<unsigned char> host(100);
  CHECK_THROWS_AS(r.copier->copy(nullptr, host.data(), 100), usage_error);
  CHECK_THROWS_AS(r.copier->copy(r.dev(), nullptr, 100), usage_error);
  r.copier->copy(nullptr, nullptr, 0);  // nothing to copy: nothing checked
  // A target range running past the device memory is refused before anything is copied.
  std::vector<unsigned char> big(rig::capacity);
  const std::vector<unsigned char> before = r.device;
  CHECK_THROWS_AS(r.copier->copy(r.dev() + 100, big.data(), rig::capacity), usage_error);
  CHECK_THROWS_AS(r.copier->copy(big.data(), r.dev() + 100, rig::capacity), usage_error);
  CHECK(r.device == before);
  CHECK(r.copier->stats().split_copies == 0);
  host_dma_backend b(0);
  range_classifier c;
  multipath_options zero_scratch = small_options();
  zero_scratch.scratch_bytes = 0;
  CHECK_THROWS_AS(host_multipath(b, {}, c, zero_scratch), config_error);
  const std::vector<peer_route<host_dma_backend>> onto_target = {{b.on_device(0), stream_ref{1u}, 1.0, 0}};
  CHECK_THROWS_AS(host_multipath(b, onto_target, c, small_options()), config_error);
  multipath_options no_direct = small_options();
  no_direct.direct_weight = 0;
  CHECK_THROWS_AS(host_multipath(b, {}, c, no_direct), config_error);
  CHECK(b.live_device() == 0);
}

TEST_CASE("multipath_copier survives a driver failure at every call, leaking no staging or scratch") {
  host_dma_backend backend(0, 20us);
  range_classifier classifier;
  std::vector<unsigned char> device(64 * 1024);
  classifier.add(device.data(), device.size(), memory_kind::device, 0);
  auto faults = std::make_shared<testing::copy_faults>();
  constexpr int devices = 4;
  const std::size_t n = 24 * 1024 + 9;  // 6 KiB a path, 3 pieces a peer, 6 chunks each
  const std::vector<unsigned char> a = pattern(n, 8);
  const std::vector<unsigned char> b = pattern(n, 9);
  const stream_ref stream{std::uintptr_t{12}};
  std::uint64_t failures = 0;
  bool peer_copy_failed = false, stream_wait_failed = false, scratch_failed = false;
  for (std::uint64_t k = 1;; ++k) {
    CAPTURE(k);
    bool faulted = false;
    {
      std::vector<peer_route<testing::faulty_copy_backend>> peers;
      for (int d = 1; d < devices; ++d) {
        peers.push_back({testing::faulty_copy_backend(backend.on_device(d), faults),
                         stream_ref{static_cast<std::uintptr_t>(2000 + d)}, 1.0, 0});
      }
      faulty_multipath copier(testing::faulty_copy_backend(backend, faults), peers, classifier, small_options());
      faults->fail_nth_call(k);
      try {
        copier.copy(device.data(), a.data(), n, stream);
        std::vector<unsigned char> back(n);
        copier.copy(back.data(), device.data(), n, stream);
        backend.wait_stream(stream);
        CHECK(back == a);
      } catch (const driver_error& e) {
        faulted = true;
        const std::string what = e.what();
        CHECK(what.find("injected") != std::string::npos);
        peer_copy_failed = peer_copy_failed || what.find("enqueue_peer_copy") != std::string::npos;
        stream_wait_failed = stream_wait_failed || what.find("stream_wait_event") != std::string::npos;
      } catch (const out_of_memory& e) {
        faulted = true;
        const std::string what = e.what();
        scratch_failed = scratch_failed || what.find("scratch buffer") != std::string::npos;
        CHECK((what.find("pinned staging buffer") != std::string::npos ||
               what.find("scratch buffer") != std::string::npos));
      }
      faults->never_fail();
      // At most one scratch buffer a peer; at most a ring of staging buffers a path.
      CHECK(backend.live_device() <= devices - 1);
      CHECK(backend.live_staging() <= devices * 3);
      // Still usable: both directions, the bytes right.
      copier.copy(device.data(), b.data(), n, stream);
      std::vector<unsigned char> back(n);
      copier.copy(back.data(), device.data(), n, stream);
      backend.wait_stream(stream);
      CHECK(back == b);
      CHECK(copier.stats().split_copies >= 2);
    }
    CHECK(backend.live_device() == 0);
    CHECK(backend.live_staging() == 0);
    CHECK(backend.live_events() == 0);
    CHECK(backend.source_changes() == 0);
    if (!faulted) break;
    ++failures;
    REQUIRE(k < 3000);
  }
  CHECK(failures == faults->faults());
  CHECK(failures >= 50);  // four paths, each with chunks, pieces and events: many calls to fail
  CHECK(peer_copy_failed);
  CHECK(stream_wait_failed);
  // The call numbers shift with how often events were polled (timing), so the loop may step
  // over the scratch buffer's allocation: fail it by name as well.
  {
    std::vector<peer_route<testing::faulty_copy_backend>> peers;
    for (int d = 1; d < devices; ++d) {
      peers.push_back({testing::faulty_copy_backend(backend.on_device(d), faults),
                       stream_ref{static_cast<std::uintptr_t>(2000 + d)}, 1.0, 0});
    }
    faulty_multipath copier(testing::faulty_copy_backend(backend, faults), peers, classifier, small_options());
    faults->fail_next_device_allocation();
    try {
      copier.copy(device.data(), a.data(), n, stream);
      backend.wait_stream(stream);
    } catch (const out_of_memory& e) {
      scratch_failed = scratch_failed || std::string(e.what()).find("scratch buffer") != std::string::npos;
    }
    faults->never_fail();
    copier.copy(device.data(), b.data(), n, stream);
    std::vector<unsigned char> back(n);
    copier.copy(back.data(), device.data(), n, stream);
    backend.wait_stream(stream);
    CHECK(back == b);
  }
  CHECK(scratch_failed);
  CHECK(backend.live_device() == 0);
  CHECK(backend.live_staging() == 0);
}

TEST_CASE("threads: several threads copy through one multipath_copier at once") {
  rig r(4, 10us);
  constexpr int threads = 4;
  constexpr std::size_t region = rig::capacity / threads;
  std::vector<int> bad(threads, 0);
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      const stream_ref stream{static_cast<std::uintptr_t>(100 + t)};
      unsigned char* const dev = r.dev() + static_cast<std::size_t>(t) * region;
      std::mt19937 rng(static_cast<unsigned>(t));
      for (int round = 0; round < 8; ++round) {
        const std::size_t n = 1 + rng() % region;
        const std::vector<unsigned char> a = pattern(n, static_cast<unsigned>(100 * t + round));
        r.copier->copy(dev, a.data(), n, stream);
        std::vector<unsigned char> back(n);
        r.copier->copy(back.data(), dev, n, stream);
        if (back != a) ++bad[t];
      }
    });
  }
  for (std::thread& w : workers) w.join();
  for (int t = 0; t < threads; ++t) CHECK(bad[t] == 0);
  CHECK(r.copier->stats().copies == 2 * threads * 8);
  CHECK(r.copier->stats().split_copies > 0);
  CHECK(r.backend.source_changes() == 0);
  CHECK(r.guards_intact());
}
