// Deferred frees (allocators/stitching/deferred_frees.hpp): a free is deferred only when other streams used
// the allocation, and finished once their events completed, over a reserver whose events the
// test completes by hand.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <set>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "glake/backends/sim.hpp"
#include "glake/allocators/stitching/deferred_frees.hpp"
#include "glake/allocators/stitching/stream_clocks.hpp"
#include "glake/statistics.hpp"
#include "support/evented_reserver.hpp"

namespace {

using namespace glake;
using testing::event_log;
using testing::evented_reserver;
using events_type = detail::counted_events<evented_reserver>;
using frees_type = detail::deferred_frees<events_type>;

const stream_ref A{1}, B{2}, C{3};
void* const p = reinterpret_cast<void*>(std::uintptr_t{0x10000});
void* const q = reinterpret_cast<void*>(std::uintptr_t{0x20000});

struct fixture {
  sim_device device{1 * GiB};
  event_log log;
  evented_reserver reserver{device, log};
  statistics stats;
  events_type events{reserver, stats};
  frees_type frees;
  std::vector<std::tuple<void*, std::size_t, stream_ref>> freed;
  std::vector<std::pair<void*, std::size_t>> checked;
  std::vector<void*> double_frees;

  bool defer(void* ptr, std::size_t bytes, stream_ref stream) {
    return frees.defer(
        ptr, bytes, stream, events, [&](void* x, std::size_t n) { checked.emplace_back(x, n); },
        [&](void* x) { double_frees.push_back(x); });
  }
  void finish(bool wait) {
    frees.finish(wait, events, [&](void* x, std::size_t n, stream_ref s) { freed.emplace_back(x, n, s); });
  }
  void complete(stream_ref s) { log.complete(s); }
};

}  // namespace

TEST_CASE("deferred frees: a free is deferred only when another stream used the allocation") {
  fixture f;
  CHECK_FALSE(f.frees.active());
  CHECK_FALSE(f.defer(p, 64, A));  // no use recorded: freed at once by the caller
  CHECK(f.checked.empty());         // and not checked here either
  CHECK(f.log.events.empty());

  f.frees.record_use(p, B);
  f.frees.record_use(p, B);  // recorded once
  CHECK(f.frees.active());
  CHECK_FALSE(f.frees.pending());
  CHECK_FALSE(f.defer(q, 64, A));  // a use of p says nothing about q
  CHECK(f.defer(p, 64, A));
  CHECK(f.frees.pending());
  REQUIRE(f.log.events.size() == 1);  // one event, on B
  CHECK(f.log.events.begin()->second.first == B);
  CHECK(f.stats.events_recorded == 1);
  REQUIRE(f.checked.size() == 1);
  CHECK(f.checked[0] == std::pair<void*, std::size_t>{p, 64});
  CHECK(f.freed.empty());
}

TEST_CASE("deferred frees: uses on several streams get an event each, the free's own stream gets none") {
  fixture f;
  f.frees.record_use(p, B);
  f.frees.record_use(p, A);
  f.frees.record_use(p, C);
  CHECK(f.defer(p, 64, A));
  REQUIRE(f.log.events.size() == 2);
  std::set<stream_ref> streams;
  for (const auto& [id, e] : f.log.events) streams.insert(e.first);
  CHECK(streams == std::set<stream_ref>{B, C});

  f.complete(B);
  f.finish(false);
  CHECK(f.freed.empty());  // C's work may still use p
  f.complete(C);
  f.finish(false);
  REQUIRE(f.freed.size() == 1);
  CHECK(f.freed[0] == std::tuple<void*, std::size_t, stream_ref>{p, 64, A});
  CHECK(f.log.recycled == 2);
  CHECK_FALSE(f.frees.active());  // the uses went with the free
}

// The contract: "Defers the free of `p` on `stream` when other streams used it". A use recorded on
// the free's own stream only (record_stream with the allocation's stream, a no-op in PyTorch)
// leaves nothing to wait for: the free happens at once, and the use is forgotten.
TEST_CASE("deferred frees: a use recorded only on the free's own stream does not defer it") {
  fixture f;
  f.frees.record_use(p, A);
  CHECK_FALSE(f.defer(p, 64, A));
  CHECK_FALSE(f.frees.pending());
  CHECK(f.log.events.empty());
  CHECK_FALSE(f.frees.active());  // the use went with the free
}

TEST_CASE("deferred frees: finish without waiting frees only the completed ones, oldest first") {
  fixture f;
  f.frees.record_use(p, B);
  f.frees.record_use(q, C);
  REQUIRE(f.defer(p, 64, A));
  REQUIRE(f.defer(q, 128, A));

  f.finish(false);
  CHECK(f.freed.empty());
  CHECK(f.log.waited == 0);

  f.complete(C);
  f.finish(false);
  REQUIRE(f.freed.size() == 1);
  CHECK(std::get<0>(f.freed[0]) == q);
  CHECK(std::get<1>(f.freed[0]) == 128);
  CHECK(f.frees.pending());
  CHECK(f.log.waited == 0);
  CHECK(f.stats.device_waits == 0);

  f.complete(B);
  f.finish(false);
  REQUIRE(f.freed.size() == 2);
  CHECK(std::get<0>(f.freed[1]) == p);
  CHECK_FALSE(f.frees.pending());
  CHECK(f.log.recycled == 2);
}

TEST_CASE("deferred frees: once a stream's event is pending, its later events are not asked in that finish") {
  fixture f;
  f.frees.record_use(p, B);
  REQUIRE(f.defer(p, 64, A));
  f.frees.record_use(q, B);
  REQUIRE(f.defer(q, 64, A));
  REQUIRE(f.log.events.size() == 2);
  const std::size_t before = f.log.queried;
  f.finish(false);
  CHECK(f.log.queried - before == 1);
  CHECK(f.freed.empty());
}

TEST_CASE("deferred frees: finish with wait frees everything, waiting on each event") {
  fixture f;
  f.frees.record_use(p, B);
  f.frees.record_use(p, C);
  f.frees.record_use(q, C);
  REQUIRE(f.defer(p, 64, A));
  REQUIRE(f.defer(q, 128, B));
  f.finish(true);
  CHECK(f.freed.size() == 2);
  CHECK(std::get<0>(f.freed[0]) == p);
  CHECK(std::get<0>(f.freed[1]) == q);
  CHECK(std::get<2>(f.freed[1]) == B);
  CHECK(f.log.waited == 3);
  CHECK(f.stats.device_waits == 3);
  CHECK(f.log.recycled == 3);
  CHECK(f.log.device_synchronized == 0);
  CHECK_FALSE(f.frees.pending());
  CHECK_FALSE(f.frees.active());
}

TEST_CASE("deferred frees: freeing a pending pointer again reaches the `already` callback") {
  fixture f;
  f.frees.record_use(p, B);
  REQUIRE(f.defer(p, 64, A));
  CHECK(f.double_frees.empty());
  f.defer(p, 64, A);
  REQUIRE(f.double_frees.size() == 1);
  CHECK(f.double_frees[0] == p);

  // A throwing `already`, as the allocator's: nothing changes.
  const std::size_t events = f.log.events.size();
  const auto check = [](void*, std::size_t) {};
  const auto already = [](void*) { throw std::logic_error("double free"); };
  CHECK_THROWS_AS(f.frees.defer(p, 64, A, f.events, check, already), std::logic_error);
  CHECK(f.log.events.size() == events);
  f.complete(B);
  f.finish(false);
  CHECK(f.freed.size() == 1);  // freed once
}

TEST_CASE("deferred frees: a throwing check defers nothing and leaves the uses recorded") {
  fixture f;
  f.frees.record_use(p, B);
  f.frees.record_use(q, C);
  const auto already = [](void*) {};
  const auto bad_size = [](void*, std::size_t) { throw std::invalid_argument("size mismatch"); };
  CHECK_THROWS_AS(f.frees.defer(p, 63, A, f.events, bad_size, already), std::invalid_argument);
  CHECK_FALSE(f.frees.pending());
  CHECK(f.log.events.empty());  // checked before any event is recorded
  CHECK(f.frees.active());

  CHECK(f.defer(p, 64, A));  // p's use on B is still known
  REQUIRE(f.log.events.size() == 1);
  CHECK(f.log.events.at(1).first == B);
  CHECK(f.defer(q, 64, A));  // and q's on C
  CHECK(f.log.events.size() == 2);
}

TEST_CASE("deferred frees: a free_now that throws is dropped, not rethrown") {
  fixture f;
  f.frees.record_use(p, B);
  REQUIRE(f.defer(p, 64, A));
  f.complete(B);
  int calls = 0;
  f.frees.finish(false, f.events, [&](void*, std::size_t, stream_ref) {
    ++calls;
    throw std::runtime_error("checked when deferred");
  });
  CHECK(calls == 1);
  CHECK_FALSE(f.frees.pending());
  CHECK(f.log.recycled == 1);
}
