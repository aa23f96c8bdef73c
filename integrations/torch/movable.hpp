// The plug-in's movable buffers: virtual_buffers made on request, one per buffer, found by any
// address inside them, so that a tensor over one can be offloaded and prefetched by its pointer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "glake/errors.hpp"
#include "glake/movers/concepts.hpp"

namespace glake::torch_plugin {

/// What a movable_registry holds, summed over its buffers.
struct movable_totals {
  std::size_t buffers = 0;
  std::size_t device_bytes = 0;
  std::size_t host_bytes = 0;
  std::size_t cached_host_bytes = 0;
  std::uint64_t offloaded_bytes = 0;
  std::uint64_t prefetched_bytes = 0;
};

/// Buffers of type Buffer (a tiered_memory with stats(), commit() and release_cached(), e.g.
/// virtual_buffer) made by a factory for (bytes, device), fully committed, kept by their first
/// address. Every call looks a pointer up in O(log n) and runs under one mutex, moves included,
/// so moves of different buffers are serialised (they share the bus anyway).
/// Thread safety: every member may be called from any thread.
template <tiered_memory Buffer>
class movable_registry {
 public:
  using factory = std::function<std::unique_ptr<Buffer>(std::size_t bytes, int device)>;

  explicit movable_registry(factory make) : make_(std::move(make)) {}

  /// A new buffer of at least `bytes` on `device`, all on the device; its first address. Throws
  /// what the factory or commit throws (out_of_memory when the device is full).
  void* create(std::size_t bytes, int device) {
    if (bytes == 0) throw usage_error(usage_error::kind::bad_argument, "glake: a movable buffer of 0 bytes");
    std::unique_ptr<Buffer> b = make_(bytes, device);
    b->commit(0, b->size());
    void* p = b->data();
    std::lock_guard lock(mutex_);
    buffers_.emplace(address(p), entry{std::move(b), device});
    return p;
  }

  /// Destroys the buffer whose first address is `p`; false when there is none.
  bool destroy(void* p) {
    std::unique_ptr<Buffer> gone;
    {
      std::lock_guard lock(mutex_);
      const auto it = buffers_.find(address(p));
      if (it == buffers_.end()) return false;
      gone = std::move(it->second.buffer);
      buffers_.erase(it);
    }
    return true;  // destroyed here, outside the lock
  }

  /// Calls f(buffer, device) for the buffer holding address `p`, under the lock; throws
  /// usage_error when no buffer holds it.
  template <class F>
  decltype(auto) with(const void* p, F&& f) {
    std::lock_guard lock(mutex_);
    const std::uintptr_t a = address(p);
    auto it = buffers_.upper_bound(a);
    if (it != buffers_.begin()) {
      --it;
      Buffer& b = *it->second.buffer;
      if (a - it->first < b.size()) return std::forward<F>(f)(b, it->second.device);
    }
    throw usage_error(usage_error::kind::foreign_pointer,
                      "glake: " + hex(a) + " is not inside a movable buffer (make it with glake_torch.movable_empty)");
  }

  movable_totals totals() const {
    std::lock_guard lock(mutex_);
    movable_totals t;
    for (const auto& [base, e] : buffers_) {
      const auto s = e.buffer->stats();
      ++t.buffers;
      t.device_bytes += s.device_bytes;
      t.host_bytes += s.host_bytes;
      t.cached_host_bytes += s.cached_host_bytes;
      t.offloaded_bytes += s.offloaded_bytes;
      t.prefetched_bytes += s.prefetched_bytes;
    }
    return t;
  }

 private:
  struct entry {
    std::unique_ptr<Buffer> buffer;
    int device;
  };
  static std::uintptr_t address(const void* p) noexcept { return reinterpret_cast<std::uintptr_t>(p); }
  static std::string hex(std::uintptr_t a) {
    char text[24];
    std::snprintf(text, sizeof text, "%#llx", static_cast<unsigned long long>(a));
    return text;
  }

  factory make_;
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, entry> buffers_;
};

}  // namespace glake::torch_plugin
