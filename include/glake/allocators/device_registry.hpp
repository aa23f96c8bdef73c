// One allocator per device, made on first use and owned by a registry the user owns.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "glake/errors.hpp"

namespace glake {

/// Holds at most one Allocator per device id in [0, MaxDevices), each made by `make(device)` the
/// first time it is asked for and destroyed with the registry. There is no global registry: the
/// application (or the PyTorch plug-in) owns one, so tests and several independent users never
/// share state by accident.
///
/// Complexity: lookup of an existing allocator is one atomic load; the first lookup of a device
/// takes a mutex and runs the factory. Thread safety: every member may be called from any thread;
/// the allocators themselves are as thread-safe as their Lock policy. Errors: a device id out of
/// range throws usage_error; a throwing factory leaves that device empty, so a later call retries.
template <class Allocator, std::size_t MaxDevices = 64>
class device_registry {
 public:
  using factory = std::function<std::unique_ptr<Allocator>(int device)>;

  explicit device_registry(factory make) : make_(std::move(make)) {}
  device_registry(const device_registry&) = delete;
  device_registry& operator=(const device_registry&) = delete;
  ~device_registry() {
    for (auto& slot : slots_) delete slot.load(std::memory_order_acquire);
  }

  /// The allocator of `device`, made now if it does not exist yet.
  Allocator& for_device(int device) {
    auto& slot = slot_of(device);
    if (Allocator* existing = slot.load(std::memory_order_acquire)) return *existing;
    std::lock_guard guard(mutex_);
    if (Allocator* existing = slot.load(std::memory_order_relaxed)) return *existing;
    std::unique_ptr<Allocator> made = make_(device);
    if (made == nullptr) {
      throw usage_error(usage_error::kind::bad_argument,
                        "glake::device_registry: the factory returned no allocator for device " +
                            std::to_string(device));
    }
    Allocator* raw = made.release();
    slot.store(raw, std::memory_order_release);
    return *raw;
  }

  /// The allocator of `device` if it was made, else null; never makes one.
  Allocator* find(int device) const {
    return const_cast<device_registry*>(this)->slot_of(device).load(std::memory_order_acquire);
  }

  /// Calls f(device, allocator) for every device that has one, in device order.
  template <class F>
  void for_each(F&& f) const {
    for (std::size_t d = 0; d < MaxDevices; ++d) {
      if (Allocator* a = slots_[d].load(std::memory_order_acquire)) f(static_cast<int>(d), *a);
    }
  }

 private:
  std::atomic<Allocator*>& slot_of(int device) {
    if (device < 0 || static_cast<std::size_t>(device) >= MaxDevices) {
      throw usage_error(usage_error::kind::bad_argument, "glake::device_registry: device " + std::to_string(device) +
                                                              " is out of range [0, " +
                                                              std::to_string(MaxDevices) + ")");
    }
    return slots_[static_cast<std::size_t>(device)];
  }

  factory make_;
  std::mutex mutex_;
  std::array<std::atomic<Allocator*>, MaxDevices> slots_{};
};

}  // namespace glake
