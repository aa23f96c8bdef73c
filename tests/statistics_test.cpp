// statistics: the one list of its fields (for_each_statistic) and accumulate, which sums several
// allocators' statistics by it. Checked word by word over the whole struct, so that a field
// missing from the list, or one accumulate does not add, fails here whatever its name.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "glake/statistics.hpp"

using namespace glake;

namespace {

// statistics is 8-byte words and nothing else, so it can be read and written as such.
static_assert(std::is_trivially_copyable_v<statistics> && std::has_unique_object_representations_v<statistics>);
constexpr std::size_t words = sizeof(statistics) / sizeof(std::uint64_t);
static_assert(words * sizeof(std::uint64_t) == sizeof(statistics));
using word_array = std::array<std::uint64_t, words>;

word_array words_of(const statistics& s) { return std::bit_cast<word_array>(s); }
statistics from_words(const word_array& w) { return std::bit_cast<statistics>(w); }

// The peaks, named here and not through the list under test.
bool is_peak(std::size_t word) {
  for (std::size_t offset : {offsetof(statistics, peak_active_bytes), offsetof(statistics, peak_allocated_bytes),
                             offsetof(statistics, peak_reserved_bytes)}) {
    if (word == offset / sizeof(std::uint64_t)) return true;
  }
  return false;
}

}  // namespace

TEST_CASE("statistics: for_each_statistic lists every field once, the peaks as peaks") {
  statistics s{};
  std::size_t fields = 0, peaks = 0;
  for_each_statistic(s, s, [&](statistic_kind kind, auto& field, const auto&) {
    const word_array before = words_of(s);
    std::memset(static_cast<void*>(&field), 0xff, sizeof field);
    CHECK(words_of(s) != before);  // not listed before
    ++fields;
    if (kind == statistic_kind::peak) ++peaks;
  });
  for (std::size_t i = 0; i < words; ++i) {
    CAPTURE(i);
    CHECK(words_of(s)[i] == ~std::uint64_t{0});  // each word belongs to a listed field
  }
  CHECK(peaks == 3);
  CHECK(fields >= 31);
}

TEST_CASE("statistics: accumulate adds every count and held byte, and the peaks as the rule says") {
  word_array a{}, b{};
  for (std::size_t i = 0; i < words; ++i) {
    a[i] = 1000 + i;
    b[i] = i % 2 == 0 ? 5000 + 3 * i : 10 + i;  // each side the higher for some peaks
  }
  for (const peak_rule rule : {peak_rule::highest, peak_rule::summed}) {
    CAPTURE(static_cast<int>(rule));
    statistics into = from_words(a);
    accumulate(into, from_words(b), rule);
    const word_array got = words_of(into);
    for (std::size_t i = 0; i < words; ++i) {
      CAPTURE(i);
      if (is_peak(i) && rule == peak_rule::highest) {
        CHECK(got[i] == std::max(a[i], b[i]));
      } else {
        CHECK(got[i] == a[i] + b[i]);
      }
    }
  }
  // The default is the lower bound.
  statistics x{}, y{};
  x.peak_reserved_bytes = 7;
  y.peak_reserved_bytes = 5;
  y.reserved_bytes = 3;
  accumulate(x, y);
  CHECK(x.peak_reserved_bytes == 7);
  CHECK(x.reserved_bytes == 3);
}
