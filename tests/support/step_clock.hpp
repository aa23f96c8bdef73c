// A scheduler clock the test moves by hand (schedule_clock): `now()` reads `ns`, shared between
// copies, so a test that keeps one copy advances every scheduler holding another.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>

namespace glake::testing {

struct step_clock {
  using time_point = std::chrono::time_point<std::chrono::steady_clock, std::chrono::nanoseconds>;
  std::shared_ptr<std::atomic<std::int64_t>> ns = std::make_shared<std::atomic<std::int64_t>>(0);
  time_point now() const { return time_point(std::chrono::nanoseconds(ns->load())); }
};

}  // namespace glake::testing
