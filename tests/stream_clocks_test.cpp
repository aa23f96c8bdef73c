// Stream clocks (allocators/stitching/stream_clocks.hpp): marks, event recording at most once per interval,
// polling, and the two ways to wait, over a reserver whose events the test completes by hand;
// and the event-free clocks of the host and sim backends.
#include <doctest/doctest.h>

#include <climits>
#include <cstdint>

#include "glake/backends/sim.hpp"
#include "glake/allocators/stitching/stream_clocks.hpp"
#include "glake/statistics.hpp"
#include "support/evented_reserver.hpp"

namespace {

using namespace glake;
using testing::event_log;
using testing::evented_reserver;
using events = detail::counted_events<evented_reserver>;
using clocks_type = detail::stream_clocks<events>;

const stream_ref A{1}, B{2}, C{3};

static_assert(std::is_same_v<detail::events_of<evented_reserver>::type, events>);
static_assert(std::is_same_v<detail::events_of<sim_reserver>::type, detail::no_events>);
static_assert(clocks_type::has_events);
static_assert(!detail::stream_clocks<detail::no_events>::has_events);

// A device, its evented reserver and the statistics its events count into, around clocks with a
// given interval.
struct fixture {
  sim_device device{1 * GiB};
  event_log log;
  evented_reserver reserver{device, log};
  statistics stats;
  clocks_type clocks;

  explicit fixture(int interval_us) : clocks(events{reserver, stats}, interval_us) {}

  clocks_type::clock& at(stream_ref s) {
    clocks_type::clock* c = clocks.find(s);
    REQUIRE(c != nullptr);
    return *c;
  }
  // A free on `s` now, and an event for it.
  std::uint64_t free_and_tick(stream_ref s) {
    const std::uint64_t mark = clocks.mark_free(s);
    clocks.tick(s);
    return mark;
  }
  void complete_event(std::uint64_t id) { log.events.at(id).second = true; }
};

}  // namespace

TEST_CASE("stream clocks: each stream's marks advance with its events, a stream without a clock never completes") {
  fixture f(0);
  CHECK(f.clocks.mark_free(A) == ~std::uint64_t{0});  // not entered: only a device synchronize completes it
  CHECK_FALSE(f.clocks.completed(A, 0));
  f.clocks.enter(A);
  f.clocks.enter(B);
  f.clocks.enter(A);
  CHECK(f.clocks.size() == 2);

  CHECK(f.clocks.mark_free(A) == 1);
  CHECK(f.clocks.mark_free(A) == 1);  // no event yet: the same mark covers every free
  CHECK(f.at(A).dirty);
  CHECK_FALSE(f.clocks.completed(A, 1));
  f.clocks.tick(A);
  CHECK(f.log.events.size() == 1);
  CHECK(f.log.events.at(1).first == A);
  CHECK(f.stats.events_recorded == 1);
  CHECK_FALSE(f.at(A).dirty);
  CHECK(f.clocks.mark_free(A) == 2);  // later frees get a later mark
  CHECK(f.clocks.mark_free(B) == 1);  // B's clock is its own

  f.complete_event(1);
  CHECK_FALSE(f.clocks.completed(A, 1));  // not polled yet
  f.clocks.poll(f.at(A));
  CHECK(f.stats.event_queries >= 1);
  CHECK(f.log.recycled == 1);
  CHECK(f.clocks.completed(A, 1));
  CHECK_FALSE(f.clocks.completed(A, 2));
  CHECK_FALSE(f.clocks.completed(B, 1));
  CHECK(f.clocks.completed(B, 0));  // mark 0: nothing to wait for on a clocked stream
  CHECK_FALSE(f.clocks.completed(C, 0));
}

TEST_CASE("stream clocks: tick records only for marked frees, and at most once per interval while one is in flight") {
  SUBCASE("interval 0: every tick after a free records") {
    fixture f(0);
    f.clocks.enter(A);
    f.clocks.tick(A);
    CHECK(f.log.events.empty());  // nothing freed: nothing to record
    CHECK(f.free_and_tick(A) == 1);
    CHECK(f.free_and_tick(A) == 2);
    CHECK(f.free_and_tick(A) == 3);
    CHECK(f.log.events.size() == 3);
    CHECK(f.at(A).in_flight.size() == 3);
    f.clocks.tick(A);
    CHECK(f.log.events.size() == 3);  // no free since the last event
    f.clocks.tick(C);                 // a stream without a clock: nothing
    CHECK(f.log.events.size() == 3);
    CHECK(f.stats.events_recorded == 3);
  }
  SUBCASE("a huge interval: one event in flight covers every later free until it is retired") {
    fixture f(INT_MAX);
    f.clocks.enter(A);
    CHECK(f.free_and_tick(A) == 1);
    CHECK(f.log.events.size() == 1);
    CHECK(f.free_and_tick(A) == 2);
    CHECK(f.free_and_tick(A) == 2);
    CHECK(f.log.events.size() == 1);
    CHECK(f.at(A).dirty);
    f.complete_event(1);
    f.clocks.tick(A);  // within the interval, the in-flight event is not even asked
    CHECK(f.log.events.size() == 1);
    CHECK(f.log.queried == 0);
    f.clocks.poll(f.at(A));  // a poll retires it ...
    CHECK(f.clocks.completed(A, 1));
    f.clocks.tick(A);  // ... and with none in flight the next tick records at once
    CHECK(f.log.events.size() == 2);
    CHECK(f.at(A).in_flight.front().first == 2);
    CHECK_FALSE(f.clocks.completed(A, 2));
  }
}

TEST_CASE("stream clocks: poll retires completed events oldest first and stops at the first pending one") {
  fixture f(0);
  f.clocks.enter(A);
  f.clocks.enter(B);
  for (int i = 0; i < 3; ++i) f.free_and_tick(A);  // events 1, 2, 3 for marks 1, 2, 3
  f.free_and_tick(B);                              // event 4 for B's mark 1
  REQUIRE(f.log.events.size() == 4);

  f.complete_event(2);
  f.complete_event(4);
  const std::size_t before = f.log.queried;  // ticks poll too
  f.clocks.poll(f.at(A));
  CHECK(f.at(A).done == 0);  // event 1 pending: event 2 waits behind it
  CHECK(f.at(A).in_flight.size() == 3);
  CHECK(f.log.recycled == 0);
  CHECK(f.log.queried - before == 1);  // event 2 was not asked

  f.complete_event(1);
  f.clocks.poll(f.at(A));
  CHECK(f.at(A).done == 2);
  CHECK(f.at(A).in_flight.size() == 1);
  CHECK(f.log.recycled == 2);
  CHECK(f.clocks.completed(A, 2));
  CHECK_FALSE(f.clocks.completed(A, 3));
  CHECK_FALSE(f.clocks.completed(B, 1));  // B's event completed, but B was not polled

  f.log.fail_queries = true;  // a failed query counts as "not yet", and does not throw
  f.complete_event(3);
  f.clocks.poll(f.at(A));
  CHECK(f.at(A).done == 2);
  f.log.fail_queries = false;
  f.clocks.poll(f.at(A));
  f.clocks.poll(f.at(B));
  CHECK(f.clocks.completed(A, 3));
  CHECK(f.clocks.completed(B, 1));
  CHECK(f.log.recycled == 4);
}

TEST_CASE("stream clocks: synchronize_all completes every free so far, recorded or not, in one device wait") {
  fixture f(0);
  f.clocks.enter(A);
  f.clocks.enter(B);
  const std::uint64_t a1 = f.free_and_tick(A);
  const std::uint64_t a2 = f.clocks.mark_free(A);  // no event yet
  const std::uint64_t b1 = f.free_and_tick(B);
  f.clocks.synchronize_all();
  CHECK(f.log.device_synchronized == 1);
  CHECK(f.stats.device_waits == 1);
  CHECK(f.log.waited == 0);
  CHECK(f.log.recycled == 2);
  CHECK(f.at(A).in_flight.empty());
  CHECK(f.at(B).in_flight.empty());
  CHECK(f.clocks.completed(A, a1));
  CHECK(f.clocks.completed(A, a2));
  CHECK(f.clocks.completed(B, b1));
  CHECK_FALSE(f.at(A).dirty);
  // Later frees are not covered.
  const std::uint64_t a3 = f.clocks.mark_free(A);
  CHECK(a3 > a2);
  CHECK_FALSE(f.clocks.completed(A, a3));
}

TEST_CASE("stream clocks: wait_for_wanted waits for the events of just the wanted streams, up to the wanted mark") {
  fixture f(0);
  f.clocks.enter(A);
  f.clocks.enter(B);
  f.clocks.enter(C);
  for (int i = 0; i < 3; ++i) f.free_and_tick(A);  // events 1..3
  for (int i = 0; i < 2; ++i) f.free_and_tick(B);  // events 4, 5
  f.free_and_tick(C);                              // event 6

  SUBCASE("one stream") {
    f.clocks.clear_wanted();
    f.at(A).wanted = 2;
    f.clocks.wait_for_wanted();
    CHECK(f.log.waited == 1);  // on event 2 only: the stream runs in order
    CHECK(f.log.device_synchronized == 0);
    CHECK(f.stats.device_waits == 1);
    CHECK(f.at(A).done == 2);
    CHECK(f.at(A).in_flight.size() == 1);
    CHECK(f.log.recycled == 2);
    CHECK_FALSE(f.clocks.completed(A, 3));
    CHECK(f.at(B).done == 0);
    CHECK(f.at(C).done == 0);
    CHECK_FALSE(f.log.events.at(4).second);
    CHECK_FALSE(f.log.events.at(6).second);
  }
  SUBCASE("two streams, the third left alone") {
    f.clocks.clear_wanted();
    f.at(A).wanted = 3;
    f.at(C).wanted = 1;
    f.clocks.wait_for_wanted();
    CHECK(f.log.waited == 2);
    CHECK(f.log.device_synchronized == 0);
    CHECK(f.clocks.completed(A, 3));
    CHECK(f.clocks.completed(C, 1));
    CHECK_FALSE(f.clocks.completed(B, 1));
  }
  SUBCASE("a wanted mark without an event: the device is synchronized instead") {
    const std::uint64_t pending = f.clocks.mark_free(B);  // B's mark 3, not recorded
    f.clocks.clear_wanted();
    f.at(A).wanted = 1;
    f.at(B).wanted = pending;
    f.clocks.wait_for_wanted();
    CHECK(f.log.waited == 0);
    CHECK(f.log.device_synchronized == 1);
    CHECK(f.clocks.completed(A, 3));
    CHECK(f.clocks.completed(B, pending));
  }
  SUBCASE("nothing wanted: no wait") {
    f.clocks.clear_wanted();
    f.clocks.wait_for_wanted();
    CHECK(f.log.waited == 0);
    CHECK(f.log.device_synchronized == 0);
    CHECK(f.stats.device_waits == 0);
  }
}

TEST_CASE("stream clocks without events: every mark is 0 and every free has completed") {
  detail::stream_clocks<detail::no_events> clocks(detail::no_events{}, 0);
  CHECK(clocks.mark_free(A) == 0);  // even for a stream without a clock
  clocks.enter(A);
  clocks.enter(B);
  CHECK(clocks.size() == 2);
  CHECK(clocks.mark_free(A) == 0);
  CHECK(clocks.completed(A, 0));
  CHECK(clocks.completed(C, 12345));
  clocks.tick(A);
  clocks.poll(*clocks.find(A));
  clocks.synchronize_all();
  clocks.find(B)->wanted = 7;
  clocks.wait_for_wanted();
  CHECK(clocks.find(A)->in_flight.empty());
  CHECK(clocks.find(A)->done == 0);  // nothing to track
  CHECK(clocks.mark_free(A) == 0);
}
