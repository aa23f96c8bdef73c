// virtual_buffer: the tiered_memory contract on every backend without a GPU (host memory for the
// bytes, the simulated device for the driver's rules and for events), its failures at every
// driver call, and random rounds of moves with the data checked.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "glake/backends/fault_injection.hpp"
#include "glake/backends/host.hpp"
#include "glake/backends/sim.hpp"
#include "glake/movers/virtual_buffer.hpp"
#include "support/evented_reserver.hpp"
#include "support/stamp.hpp"
#include "support/usage_kind.hpp"

namespace {

using namespace glake;
using testing::stamp;
using testing::stamped;
constexpr std::size_t K = 1024;
constexpr std::size_t G = 64 * K;  // the tests' granularity: small, so real memory stays small

using host_buffer = virtual_buffer<host_provider, host_provider, host_reserver, host_copier>;
using sim_buffer = virtual_buffer<sim_provider, sim_host_provider, sim_reserver, sim_copier>;
using evented_buffer = virtual_buffer<sim_provider, sim_host_provider, testing::evented_reserver, sim_copier>;
static_assert(tiered_memory<host_buffer>);
static_assert(tiered_memory<sim_buffer>);
static_assert(tiered_memory<evented_buffer>);

// Each fixture owns a backend and makes buffers over it; `device_bytes` / `host_bytes` read the
// backend's own count (not the buffer's), `sound` says the backend saw no broken rule.
struct host_fixture {
  host_provider device{G, 64 * G};
  host_provider host{G, 64 * G};
  std::unique_ptr<host_buffer> make(std::size_t capacity, std::size_t piece) {
    return std::make_unique<host_buffer>(device, host, host_reserver(G), host_copier{}, capacity, piece);
  }
  std::size_t device_bytes() const { return device.created_bytes(); }
  std::size_t host_bytes() const { return host.created_bytes(); }
  bool sound() const { return true; }
  void settle() {}
  static constexpr bool has_bytes = true;
};

struct sim_fixture {
  sim_device gpu{64 * G, G, 64 * G};
  std::unique_ptr<sim_buffer> make(std::size_t capacity, std::size_t piece) {
    return std::make_unique<sim_buffer>(sim_provider(gpu), sim_host_provider(gpu), sim_reserver(gpu), sim_copier(gpu),
                                        capacity, piece);
  }
  std::size_t device_bytes() const { return gpu.physical_bytes(); }
  std::size_t host_bytes() const { return gpu.host_bytes(); }
  bool sound() const { return gpu.violations() == 0; }
  void settle() {}
  static constexpr bool has_bytes = false;
};

struct evented_fixture {
  sim_device gpu{64 * G, G, 64 * G};
  testing::event_log log;
  std::unique_ptr<evented_buffer> make(std::size_t capacity, std::size_t piece) {
    return std::make_unique<evented_buffer>(sim_provider(gpu), sim_host_provider(gpu), testing::evented_reserver(gpu, log),
                                            sim_copier(gpu), capacity, piece);
  }
  std::size_t device_bytes() const { return gpu.physical_bytes(); }
  std::size_t host_bytes() const { return gpu.host_bytes(); }
  bool sound() const { return gpu.violations() == 0; }
  void settle() { log.complete(default_stream); }  // the queued copies completed
  static constexpr bool has_bytes = false;
};


}  // namespace

TEST_CASE_TEMPLATE("tiered_memory: commit, offload and prefetch keep the addresses and move the memory", F,
                   host_fixture, sim_fixture, evented_fixture) {
  F f;
  // 5 pieces: four of 2 granules and a last one of 1.
  auto buffer = f.make(9 * G, 2 * G);
  REQUIRE(buffer->size() == 9 * G);
  REQUIRE(buffer->piece_count() == 5);
  void* const base = buffer->data();
  CHECK(buffer->residence_of(0) == residence::none);
  CHECK(f.device_bytes() == 0);

  buffer->commit(0, 9 * G);
  CHECK(f.device_bytes() == 9 * G);
  CHECK(buffer->stats().device_bytes == 9 * G);
  if constexpr (F::has_bytes) stamp(base, 9 * G, 0xabc);

  // Offloading bytes [3G, 5G) moves the pieces holding them: piece 1 (2G-4G) and piece 2 (4G-6G).
  buffer->offload(3 * G, 2 * G);
  CHECK(buffer->data() == base);
  CHECK(buffer->residence_of(0) == residence::device);
  CHECK(buffer->residence_of(2 * G) == residence::host);
  CHECK(buffer->residence_of(5 * G) == residence::host);
  CHECK(buffer->residence_of(6 * G) == residence::device);
  CHECK(f.device_bytes() == 5 * G);  // device memory went back at once
  CHECK(f.host_bytes() == 4 * G);
  CHECK(buffer->stats().host_bytes == 4 * G);
  CHECK(buffer->stats().offloaded_bytes == 4 * G);
  if constexpr (F::has_bytes) CHECK(stamped(base, 9 * G, 0xabc));  // readable in place while offloaded

  buffer->prefetch(2 * G, 4 * G);
  f.settle();
  CHECK(buffer->residence_of(2 * G) == residence::device);
  CHECK(f.device_bytes() == 9 * G);
  CHECK(buffer->stats().host_bytes == 0);
  CHECK(buffer->stats().cached_host_bytes == 4 * G);  // kept for the next offload
  CHECK(f.host_bytes() == 4 * G);
  if constexpr (F::has_bytes) CHECK(stamped(base, 9 * G, 0xabc));

  // The next offload of the same pieces reuses the cached host memory.
  const auto created = buffer->stats().host_handles_created;
  buffer->offload(2 * G, 4 * G);
  CHECK(buffer->stats().host_handles_created == created);
  buffer->prefetch(2 * G, 4 * G);
  f.settle();
  buffer->release_cached();
  CHECK(f.host_bytes() == 0);
  CHECK(buffer->stats().cached_host_bytes == 0);

  // The last, shorter piece moves too.
  buffer->offload(8 * G, 1);
  CHECK(buffer->residence_of(8 * G) == residence::host);
  CHECK(f.host_bytes() == G);
  if constexpr (F::has_bytes) CHECK(stamped(base, 9 * G, 0xabc));

  buffer->decommit(0, 9 * G);
  CHECK(buffer->residence_of(8 * G) == residence::none);
  CHECK(f.device_bytes() == 0);
  CHECK(buffer->stats().device_bytes == 0);
  CHECK(buffer->stats().host_bytes == 0);
  buffer.reset();
  CHECK(f.host_bytes() == 0);
  CHECK(f.sound());
}

TEST_CASE_TEMPLATE("tiered_memory: misuse is refused and moves nothing", F, host_fixture, sim_fixture,
                   evented_fixture) {
  F f;
  auto buffer = f.make(8 * G, 2 * G);
  buffer->commit(0, 4 * G);  // pieces 0 and 1
  const auto before = buffer->stats();

  CHECK_THROWS_AS(buffer->offload(0, 8 * G), usage_error);  // pieces 2 and 3 hold nothing
  CHECK(testing::usage_kind([&] { buffer->prefetch(0, 2 * G); }) == usage_error::kind::bad_state);  // on the device
  CHECK(testing::usage_kind([&] { buffer->offload(7 * G, 2 * G); }) == usage_error::kind::bad_argument);  // past the end
  CHECK_THROWS_AS(buffer->commit(9 * G, 0), usage_error);
  CHECK_THROWS_AS((void)buffer->residence_of(8 * G), usage_error);
  buffer->offload(0, 2 * G);
  CHECK(testing::usage_kind([&] { buffer->offload(0, 2 * G); }) == usage_error::kind::bad_state);  // already offloaded
  try {
    buffer->offload(0, 4 * G);
    FAIL("offloading a range with an offloaded piece must throw");
  } catch (const usage_error& e) {
    CHECK(std::string(e.what()).find("piece 0") != std::string::npos);
    CHECK(std::string(e.what()).find("nothing was moved") != std::string::npos);
  }
  CHECK(buffer->residence_of(2 * G) == residence::device);
  CHECK(buffer->stats().device_bytes == before.device_bytes - 2 * G);
  CHECK(f.sound());
  // Empty ranges are allowed and do nothing.
  buffer->offload(3 * G, 0);
  CHECK(buffer->residence_of(2 * G) == residence::device);

  CHECK_THROWS_AS(f.make(0, G), usage_error);
}

TEST_CASE_TEMPLATE("virtual_buffer: a move on a stream capturing a graph is refused and changes nothing", F,
                   sim_fixture, evented_fixture) {
  static_assert(capture_aware_reserver<sim_reserver> && capture_aware_reserver<testing::evented_reserver>);
  F f;
  auto buffer = f.make(8 * G, 2 * G);
  buffer->commit(0, 6 * G);
  buffer->offload(4 * G, 2 * G);  // piece 2 on the host
  f.settle();
  const stream_ref capture{std::uintptr_t{0x77}};
  const stream_ref other{std::uintptr_t{0x78}};
  f.gpu.begin_capture(capture);
  const auto before = buffer->stats();
  const std::size_t device_before = f.device_bytes(), host_before = f.host_bytes();
  const auto refused = [&](auto&& move, const char* what) {
    try {
      move();
      FAIL(what << " on a capturing stream must throw");
    } catch (const usage_error& e) {
      CHECK(std::string(e.what()).find("capturing a graph") != std::string::npos);
      CHECK(std::string(e.what()).find("0x77") != std::string::npos);
      CHECK(std::string(e.what()).find(what) != std::string::npos);
    }
  };
  refused([&] { buffer->offload(0, 2 * G, capture); }, "offload");
  refused([&] { buffer->prefetch(4 * G, 2 * G, capture); }, "prefetch");
  refused([&] { buffer->decommit(0, 2 * G, capture); }, "decommit");
  // A stream given to record_stream that captures blocks moves on any stream.
  buffer->record_stream(capture);
  refused([&] { buffer->offload(0, 2 * G, other); }, "offload");
  CHECK(buffer->residence_of(0) == residence::device);
  CHECK(buffer->residence_of(4 * G) == residence::host);
  CHECK(buffer->stats().offloads == before.offloads);
  CHECK(buffer->stats().device_bytes == before.device_bytes);
  CHECK(f.device_bytes() == device_before);
  CHECK(f.host_bytes() == host_before);
  // Once the capture ended, the same moves run.
  f.gpu.end_capture(capture);
  buffer->offload(0, 2 * G, other);
  buffer->prefetch(4 * G, 2 * G, other);
  f.settle();
  CHECK(buffer->residence_of(0) == residence::host);
  CHECK(buffer->residence_of(4 * G) == residence::device);
  CHECK(f.sound());
}

TEST_CASE_TEMPLATE("tiered_memory: running out of memory leaves everything where it was", F, host_fixture,
                   sim_fixture) {
  F f;
  // The device holds 64 granules, the host 64: a buffer of 48 fills most of both.
  auto buffer = f.make(48 * G, 8 * G);
  buffer->commit(0, 48 * G);
  if constexpr (F::has_bytes) stamp(buffer->data(), 48 * G, 7);
  auto other = f.make(40 * G, 8 * G);

  // The host takes 48 more granules only once: offloading the other buffer's too is refused.
  buffer->offload(0, 48 * G);
  CHECK(f.device_bytes() == 0);
  other->commit(0, 40 * G);
  CHECK_THROWS_AS(other->offload(0, 40 * G), out_of_memory);
  CHECK(other->residence_of(0) == residence::device);
  CHECK(other->stats().device_bytes == 40 * G);
  CHECK(f.device_bytes() == 40 * G);
  CHECK(f.host_bytes() == 48 * G + other->stats().cached_host_bytes);

  // The device has 24 granules left: prefetching 48 fails whole, and the data stays readable.
  CHECK_THROWS_AS(buffer->prefetch(0, 48 * G), out_of_memory);
  CHECK(buffer->residence_of(47 * G) == residence::host);
  CHECK(f.device_bytes() == 40 * G);
  if constexpr (F::has_bytes) CHECK(stamped(buffer->data(), 48 * G, 7));
  try {
    buffer->prefetch(0, 48 * G);
  } catch (const out_of_memory& e) {
    CHECK(std::string(e.what()).find("nothing was moved") != std::string::npos);
  }

  // Freed device memory makes the same prefetch work.
  other->decommit(0, 40 * G);
  buffer->prefetch(0, 48 * G);
  CHECK(buffer->residence_of(0) == residence::device);
  if constexpr (F::has_bytes) CHECK(stamped(buffer->data(), 48 * G, 7));
  CHECK(f.sound());
}

namespace {

// A host buffer whose providers and reserver fail the calls a fault_plan picks, for data checks.
struct faulty_host {
  fault_plan plan;
  host_provider device{G, 0};
  host_provider host{G, 0};
  using buffer = virtual_buffer<fault_injecting_provider<host_provider>, fault_injecting_provider<host_provider>,
                                fault_injecting_reserver<host_reserver>, host_copier>;
  std::unique_ptr<buffer> make(std::size_t capacity, std::size_t piece) {
    return std::make_unique<buffer>(fault_injecting_provider<host_provider>(device, plan),
                                    fault_injecting_provider<host_provider>(host, plan),
                                    fault_injecting_reserver<host_reserver>(host_reserver(G), plan), host_copier{},
                                    capacity, piece);
  }
};

// Its simulated twin, for the driver's rules.
struct faulty_sim {
  fault_plan plan;
  sim_device gpu{256 * G, G, 256 * G};
  using buffer = virtual_buffer<fault_injecting_provider<sim_provider>, fault_injecting_provider<sim_host_provider>,
                                fault_injecting_reserver<sim_reserver>, sim_copier>;
  std::unique_ptr<buffer> make(std::size_t capacity, std::size_t piece) {
    return std::make_unique<buffer>(fault_injecting_provider<sim_provider>(sim_provider(gpu), plan),
                                    fault_injecting_provider<sim_host_provider>(sim_host_provider(gpu), plan),
                                    fault_injecting_reserver<sim_reserver>(sim_reserver(gpu), plan), sim_copier(gpu),
                                    capacity, piece);
  }
};

// Fails the 1st, 2nd, ... fallible driver call of `step` until it runs without a fault; after
// each failure `unchanged` must hold. Returns how many calls were failed.
template <class Plan, class Step, class Check>
int sweep(Plan& plan, Step step, Check unchanged) {
  for (std::uint64_t n = 1;; ++n) {
    plan.fail_nth_call(n);
    const auto faults = plan.faults_injected();
    try {
      step();
    } catch (const out_of_memory&) {
      REQUIRE(plan.faults_injected() == faults + 1);
      unchanged();
      continue;
    }
    plan.never_fail();
    REQUIRE(plan.faults_injected() == faults);  // ran to the end with no fault: every call was tried
    return static_cast<int>(n) - 1;
  }
}

}  // namespace

TEST_CASE("virtual_buffer: a failure at any driver call of a move leaves the data and the mappings as they were") {
  SUBCASE("host memory: the bytes") {
    faulty_host f;
    auto buffer = f.make(10 * G, 2 * G);
    buffer->commit(0, 10 * G);
    stamp(buffer->data(), 10 * G, 99);
    // Each try starts with no cached host memory, so every try makes the same driver calls.
    const int offload_faults = sweep(f.plan, [&] {
      buffer->release_cached();
      buffer->offload(0, 10 * G);
    }, [&] {
      CHECK(buffer->residence_of(0) == residence::device);
      CHECK(buffer->residence_of(9 * G) == residence::device);
      CHECK(f.device.created_bytes() == 10 * G);
      CHECK(stamped(buffer->data(), 10 * G, 99));
    });
    CHECK(offload_faults == 5 * 6);  // per piece: host create, reserve, map, access; remap: map, access
    CHECK(buffer->residence_of(0) == residence::host);
    CHECK(f.device.created_bytes() == 0);
    CHECK(stamped(buffer->data(), 10 * G, 99));
    const int prefetch_faults = sweep(f.plan, [&] { buffer->prefetch(0, 10 * G); }, [&] {
      CHECK(buffer->residence_of(0) == residence::host);
      CHECK(buffer->residence_of(9 * G) == residence::host);
      CHECK(f.device.created_bytes() == 0);
      CHECK(stamped(buffer->data(), 10 * G, 99));
    });
    CHECK(prefetch_faults == 5 * 5);  // per piece: create, map, access, and again at the shadow
    CHECK(buffer->residence_of(0) == residence::device);
    CHECK(stamped(buffer->data(), 10 * G, 99));
    buffer->decommit(0, 10 * G);
    const int commit_faults = sweep(f.plan, [&] { buffer->commit(0, 10 * G); }, [&] {
      CHECK(f.device.created_bytes() == 0);
      CHECK(buffer->residence_of(0) == residence::none);
    });
    CHECK(commit_faults == 5 * 5);
  }
  SUBCASE("simulated device: the driver's rules, and nothing leaked") {
    faulty_sim f;
    auto buffer = f.make(10 * G, 2 * G);
    buffer->commit(0, 10 * G);
    const auto mappings = f.gpu.live_mappings();
    sweep(f.plan, [&] {
      buffer->release_cached();
      buffer->offload(0, 10 * G);
    }, [&] {
      CHECK(f.gpu.physical_bytes() == 10 * G);
      CHECK(f.gpu.host_bytes() == buffer->stats().cached_host_bytes);
      CHECK(f.gpu.live_mappings() == mappings + buffer->stats().cached_host_bytes / (2 * G));
      CHECK(f.gpu.violations() == 0);
    });
    sweep(f.plan, [&] { buffer->prefetch(0, 10 * G); }, [&] {
      CHECK(f.gpu.physical_bytes() == 0);
      CHECK(f.gpu.host_bytes() == 10 * G);
      CHECK(f.gpu.violations() == 0);
    });
    buffer.reset();
    CHECK(f.gpu.physical_bytes() == 0);
    CHECK(f.gpu.host_bytes() == 0);
    CHECK(f.gpu.live_mappings() == 0);
    CHECK(f.gpu.reserved_bytes() == 0);
    CHECK(f.gpu.violations() == 0);
  }
}

TEST_CASE("virtual_buffer: moves wait for the work queued on their stream and on recorded streams") {
  evented_fixture f;
  auto buffer = f.make(6 * G, 2 * G);
  buffer->commit(0, 6 * G);
  const stream_ref compute{std::uintptr_t{1}}, side{std::uintptr_t{2}};
  buffer->record_stream(side);
  buffer->record_stream(side);  // once is enough

  const auto waited = f.log.waited;
  buffer->offload(0, 6 * G, compute);
  // Waited: the work queued before the call on its stream and on the recorded stream, then each
  // piece's copy before its device memory goes back.
  CHECK(f.log.waited == waited + 1 + 1 + 3);
  bool side_event = false;
  for (const auto& [id, e] : f.log.events) side_event = side_event || e.first == side;
  CHECK(side_event);

  // Prefetch waits for the stream before unmapping host memory, then leaves its copies pending:
  // the host memory goes back to the cache only once their event has completed.
  buffer->prefetch(0, 6 * G, compute);
  CHECK(buffer->residence_of(0) == residence::device);
  CHECK(buffer->stats().cached_host_bytes == 6 * G);  // pending counts as cached
  std::uint64_t pending_event = 0;
  for (const auto& [id, e] : f.log.events) {
    if (e.first == compute && !e.second) pending_event = id;
  }
  CHECK(pending_event != 0);  // the copies' event, not yet complete
  // An offload before that event completes cannot take that host memory: it makes new.
  const auto created = buffer->stats().host_handles_created;
  buffer->offload(0, 2 * G, compute);
  CHECK(buffer->stats().host_handles_created == created + 1);
  f.log.complete(compute);
  buffer->prefetch(0, 2 * G, compute);
  f.log.complete(compute);
  buffer->offload(0, 6 * G, compute);  // now every piece finds cached memory
  CHECK(buffer->stats().host_handles_created == created + 1);
  CHECK(f.gpu.violations() == 0);
}

TEST_CASE("virtual_buffer: random rounds of commit, offload, prefetch and decommit keep every byte") {
  host_fixture f;
  constexpr std::size_t pieces = 12;
  auto buffer = f.make(pieces * 2 * G, 2 * G);
  std::vector<std::uint64_t> tags(pieces, 0);  // 0: no memory
  std::mt19937_64 random(20261125);
  std::uint64_t next_tag = 1;
  for (int round = 0; round < 2000; ++round) {
    const std::size_t first = random() % pieces;
    const std::size_t count = 1 + random() % std::min<std::size_t>(4, pieces - first);
    const std::size_t offset = first * 2 * G, bytes = count * 2 * G;
    auto all = [&](residence r) {
      for (std::size_t i = first; i < first + count; ++i) {
        if (buffer->residence_of(i * 2 * G) != r) return false;
      }
      return true;
    };
    switch (random() % 4) {
      case 0:
        buffer->commit(offset, bytes);
        for (std::size_t i = first; i < first + count; ++i) {
          if (tags[i] == 0) {
            tags[i] = next_tag++;
            stamp(static_cast<char*>(buffer->data()) + i * 2 * G, 2 * G, tags[i]);
          }
        }
        break;
      case 1:
        if (all(residence::device)) {
          buffer->offload(offset, bytes);
        } else {
          CHECK_THROWS_AS(buffer->offload(offset, bytes), usage_error);
        }
        break;
      case 2:
        if (all(residence::host)) {
          buffer->prefetch(offset, bytes);
        } else {
          CHECK_THROWS_AS(buffer->prefetch(offset, bytes), usage_error);
        }
        break;
      default:
        buffer->decommit(offset, bytes);
        for (std::size_t i = first; i < first + count; ++i) tags[i] = 0;
    }
    std::size_t committed = 0;
    for (std::size_t i = 0; i < pieces; ++i) {
      if (tags[i] == 0) continue;
      committed += 2 * G;
      REQUIRE(stamped(static_cast<char*>(buffer->data()) + i * 2 * G, 2 * G, tags[i]));
    }
    const auto s = buffer->stats();
    REQUIRE(s.device_bytes + s.host_bytes == committed);
    REQUIRE(f.device.created_bytes() == s.device_bytes);
    REQUIRE(f.host.created_bytes() == s.host_bytes + s.cached_host_bytes);
  }
  CHECK(buffer->stats().offloads > 100);
  CHECK(buffer->stats().prefetches > 10);
}

TEST_CASE("virtual_buffer: a capacity beyond the address space or the piece table is refused at once") {
  host_fixture f;
  const auto start = std::chrono::steady_clock::now();
  constexpr std::size_t huge = std::size_t{1} << 56;
  // Few pieces, but no address space holds it: out_of_memory from the reservation.
  CHECK_THROWS_AS(f.make(huge, std::size_t{1} << 40), out_of_memory);
  // 2^26 pieces: refused before anything is reserved or sized, naming the capacity.
  try {
    f.make(huge, G);
    FAIL("a buffer of 2^26 pieces was made");
  } catch (const usage_error& e) {
    CHECK(std::string(e.what()).find(std::to_string(huge)) != std::string::npos);
    CHECK(std::string(e.what()).find("pieces") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(1));
  CHECK(f.device_bytes() == 0);
  // The largest table allowed is still made.
  auto most = f.make(4 * G, G);
  CHECK(most->piece_count() == 4);
  CHECK(host_buffer::max_pieces >= std::size_t{1} << 20);
}
