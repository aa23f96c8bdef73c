// The kind of usage_error a call throws, so that a test can say which misuse it expects.
#pragma once

#include <doctest/doctest.h>

#include <optional>

#include "glake/errors.hpp"

namespace glake::testing {

/// The kind of the usage_error that f() throws; empty when it throws none (other exceptions
/// pass through).
template <class F>
std::optional<usage_error::kind> usage_kind(F&& f) {
  try {
    f();
  } catch (const usage_error& e) {
    return e.which();
  }
  return std::nullopt;
}

}  // namespace glake::testing

// A failed CHECK says which kind came ("bad_argument"), or that none did.
template <>
struct doctest::StringMaker<std::optional<glake::usage_error::kind>> {
  static doctest::String convert(const std::optional<glake::usage_error::kind>& k) {
    return k ? glake::usage_error::name(*k) : "no usage_error";
  }
};
namespace glake {
inline doctest::String toString(usage_error::kind k) { return usage_error::name(k); }  // found by ADL
}  // namespace glake
