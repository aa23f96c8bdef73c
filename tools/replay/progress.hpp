// When glake-replay says how far it got: at most a few progress lines a second, whatever the
// size of the trace.
#pragma once

#include <chrono>

namespace glake::replay {

/// Says a progress line is due at most once per `interval`, and the first only one `interval`
/// after the start: a step that ends sooner says nothing. Not thread-safe.
class progress_throttle {
 public:
  using clock = std::chrono::steady_clock;

  explicit progress_throttle(clock::duration interval, clock::time_point start = clock::now())
      : interval_(interval), last_(start) {}

  /// True when `interval` passed since the start or the last time this said true.
  bool due(clock::time_point now = clock::now()) {
    if (now - last_ < interval_) return false;
    last_ = now;
    return true;
  }

 private:
  clock::duration interval_;
  clock::time_point last_;
};

}  // namespace glake::replay
