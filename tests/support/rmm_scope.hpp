// Test helpers for glake under RMM, shared by the host tests (tests/rmm_resource_test.cpp) and the
// GPU tests (tests/gpu/rmm_test.cpp): RMM's current device resource set for one scope, and a
// failure callback that frees what it can, as a spilling framework would.
#pragma once

#include <rmm/device_buffer.hpp>
#include <rmm/mr/per_device_resource.hpp>

#include <cstddef>
#include <utility>
#include <vector>

namespace glake::testing {

/// Sets `r` as RMM's current device resource for one scope, and puts the previous one back.
class current_device_resource {
 public:
  using device_resource = cuda::mr::any_resource<cuda::mr::device_accessible>;
  explicit current_device_resource(device_resource r) : previous_(rmm::mr::set_current_device_resource(std::move(r))) {}
  ~current_device_resource() { rmm::mr::set_current_device_resource(std::move(previous_)); }
  current_device_resource(const current_device_resource&) = delete;
  current_device_resource& operator=(const current_device_resource&) = delete;

 private:
  device_resource previous_;
};

/// What a failure callback sees and does: records each call's request and frees one of `spill`
/// per call, saying "retry" while it freed something.
struct spiller {
  std::vector<rmm::device_buffer> spill;
  std::vector<std::size_t> requested;
  static bool callback(std::size_t bytes, void* arg) {
    auto* self = static_cast<spiller*>(arg);
    self->requested.push_back(bytes);
    if (self->spill.empty()) return false;
    self->spill.pop_back();
    return true;
  }
};

}  // namespace glake::testing
