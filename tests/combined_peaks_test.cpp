// combined_peaks: the general + pools peak reserved counted once, growth noted from an
// allocator's observer, and the peaks that outlive a reset.
#include <doctest/doctest.h>

#include <cstddef>
#include <stdexcept>

#include "glake/adaptors/combined_peaks.hpp"

using namespace glake;

TEST_CASE("combined_peaks: without pools the peak is the general one, with pools the highest sum seen") {
  combined_peaks m;
  // No pool ever held memory: the summed peak equals the general peak, whatever was sampled.
  CHECK(m.peak(100, 100, 40) == 100);
  // A model's load peaked at 100 before any pool; a pool of 30 came later with 50 in general.
  int calls = 0;
  m.sample(30, [&] {
    ++calls;
    return std::size_t{50};
  });
  CHECK(calls == 1);
  // The sum of the peaks (130) would count 30 bytes twice: the highest of 100, 80 and now is kept.
  CHECK(m.peak(100, 130, 80) == 100);
  m.sample(30, [] { return std::size_t{90}; });
  CHECK(m.peak(100, 130, 80) == 120);
  CHECK(m.peak(100, 110, 80) == 110);  // never above the sum of the peaks
}

TEST_CASE("combined_peaks: no pools, no sample and no call to the general allocator") {
  combined_peaks m;
  int calls = 0;
  m.sample(0, [&] {
    ++calls;
    return std::size_t{1000};
  });
  CHECK(calls == 0);
  CHECK(m.peak(10, 20, 5) == 10);  // nothing sampled: the general peak and the sum now
}

TEST_CASE("combined_peaks: a general allocator that throws loses the sample, nothing else") {
  combined_peaks m;
  m.sample(10, []() -> std::size_t { throw std::runtime_error("lock"); });
  CHECK(m.peak(50, 60, 20) == 50);
}

TEST_CASE("combined_peaks: growth is noted only while pools hold memory, and taken once") {
  combined_peaks m;
  m.note_growth(0);
  CHECK_FALSE(m.take_growth());
  m.note_growth(4096);
  CHECK(m.take_growth());
  CHECK_FALSE(m.take_growth());
}

TEST_CASE("combined_peaks: a reset restarts the samples and keeps the lifetime peaks") {
  combined_peaks m;
  m.sample(30, [] { return std::size_t{90}; });
  CHECK(m.peak(100, 130, 80) == 120);
  m.reset(70, m.peak(100, 130, 80), 40);
  CHECK(m.peak(60, 70, 40) == 60);  // the 120 sampled before the reset is gone
  CHECK(m.lifetime_active(50) == 70);
  CHECK(m.lifetime_active(75) == 75);
  CHECK(m.lifetime_reserved(60) == 120);
  CHECK(m.lifetime_reserved(130) == 130);
}
