// The kind of usage_error a call throws, so that a test can say which misuse it expects.
#pragma once

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
