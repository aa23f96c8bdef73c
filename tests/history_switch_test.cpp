// history_switch: the memory history's on/off state, its capacity, and the lock that keeps a
// device joining from passing a start or a stop.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "glake/adaptors/history_switch.hpp"

using glake::history_switch;

TEST_CASE("history_switch: a start resets the rings before recording, a stop keeps the capacity") {
  history_switch h;
  CHECK_FALSE(h.on());
  std::vector<std::size_t> resets;
  std::vector<std::pair<bool, bool>> applied;  // (asked, on() at that point)
  const auto reset = [&](std::size_t n) {
    CHECK_FALSE(h.on());  // emptied before anything records into them
    resets.push_back(n);
  };
  const auto apply = [&](bool on) { applied.emplace_back(on, h.on()); };

  h.set(true, 5, reset, apply);
  CHECK(h.on());
  CHECK(resets == std::vector<std::size_t>{5});
  CHECK(applied == std::vector<std::pair<bool, bool>>{{true, true}});
  CHECK(h.locked([](bool on, std::size_t capacity) { return on && capacity == 5; }));

  h.set(false, 9, reset, apply);  // a stop: no reset, the capacity stays for the next start
  CHECK_FALSE(h.on());
  CHECK(resets.size() == 1);
  CHECK(applied.back() == std::pair{false, false});
  CHECK(h.locked([](bool on, std::size_t capacity) { return !on && capacity == 5; }));
}

TEST_CASE("history_switch: a throwing start leaves recording off and says why") {
  history_switch h;
  const auto fine = [](std::size_t) {};
  CHECK_THROWS_AS(h.set(true, 3, fine, [](bool) { throw std::runtime_error("observer"); }), std::runtime_error);
  CHECK_FALSE(h.on());
  CHECK_THROWS_AS(h.set(true, 3, [](std::size_t) { throw std::bad_alloc(); }, [](bool) {}), std::bad_alloc);
  CHECK_FALSE(h.on());
  h.set(true, 4, fine, [](bool) {});  // and it can start again
  CHECK(h.on());
}

TEST_CASE("threads: history_switch: a device joining waits for a start in progress") {
  history_switch h;
  std::atomic<bool> applying{false}, release{false};
  std::thread starter([&] {
    h.set(
        true, 7, [](std::size_t) {},
        [&](bool) {
          applying = true;
          while (!release) std::this_thread::yield();
        });
  });
  while (!applying) std::this_thread::yield();
  std::atomic<bool> joined{false}, seen{false};
  std::thread joiner([&] {
    // The joiner sees the finished start, never the state halfway through it.
    seen = h.locked([](bool on, std::size_t capacity) { return on && capacity == 7; });
    joined = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK_FALSE(joined);  // held off while the start applies
  release = true;
  starter.join();
  joiner.join();
  CHECK(joined);
  CHECK(seen);
}
