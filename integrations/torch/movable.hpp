// The plug-in's movable buffers: virtual_buffers made on request, one per buffer, found by any
// address inside them, so that a tensor over one can be offloaded and prefetched by its pointer.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "glake/errors.hpp"
#include "glake/movers/concepts.hpp"
#include "glake/stream.hpp"

namespace glake::torch_plugin {

/// What a movable_registry holds, summed over its buffers.
struct movable_totals {
  std::size_t buffers = 0;
  std::size_t device_bytes = 0;
  std::size_t host_bytes = 0;
  std::size_t cached_host_bytes = 0;
  std::uint64_t offloaded_bytes = 0;
  std::uint64_t prefetched_bytes = 0;
  std::size_t cached_buffer_bytes = 0;  ///< freed allocations kept for reuse (counted in device_bytes)
  std::uint64_t cache_reuses = 0;
};

/// Buffers of type Buffer (a tiered_memory with stats(), commit(), decommit() and granularity(),
/// e.g. virtual_buffer) made by a factory for (bytes, device), fully committed, kept by their
/// first address. Every call looks a pointer up in O(log n) and runs under one mutex, moves
/// included, so moves of different buffers are serialised (they share the bus anyway).
///
/// Buffers serving allocations (acquire / recycle: the plug-in's movable scope) are cached when
/// freed, all on the device, for the next request of the same rounded size on the same device and
/// stream, as a caching allocator reuses blocks on their stream without waiting; a buffer freed
/// while offloaded, or used on other streams (record_stream), is destroyed instead, after the
/// work queued on its streams. release_cached destroys the cached ones.
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
    live_.fetch_add(1, std::memory_order_acq_rel);
    return p;
  }

  /// A buffer for an allocation of `bytes` on `device` used on `stream`: a cached one of that
  /// rounded size freed on the same device and stream, else a new one (create).
  void* acquire(std::size_t bytes, int device, stream_ref stream) {
    {
      std::lock_guard lock(mutex_);
      for (auto it = cache_.begin(); it != cache_.end(); ++it) {
        entry& e = buffers_.at(*it);
        if (e.device != device || e.freed_on != stream) continue;
        const std::size_t g = e.buffer->granularity();
        if (bytes > e.buffer->size() || e.buffer->size() - bytes >= g) continue;
        const std::uintptr_t base = *it;
        cache_.erase(it);
        cached_bytes_ -= e.buffer->size();
        e.cached = false;
        ++reuses_;
        return reinterpret_cast<void*>(base);
      }
    }
    void* p = create(bytes, device);
    return p;
  }

  /// Whether `p` is the first address of a buffer that is not cached (a live allocation).
  bool holds(const void* p) const {
    if (live_.load(std::memory_order_acquire) == 0) return false;
    std::lock_guard lock(mutex_);
    const auto it = buffers_.find(address(p));
    return it != buffers_.end() && !it->second.cached;
  }

  /// Work on `stream` also uses the buffer holding `p` (PyTorch's record_stream); false when no
  /// buffer holds it.
  bool record_stream(const void* p, stream_ref stream) {
    if (live_.load(std::memory_order_acquire) == 0) return false;
    std::lock_guard lock(mutex_);
    auto it = buffers_.upper_bound(address(p));
    if (it == buffers_.begin()) return false;
    --it;
    if (address(p) - it->first >= it->second.buffer->size()) return false;
    it->second.buffer->record_stream(stream);
    it->second.shared = true;
    return true;
  }

  /// The allocation at `p` (its first address), freed on `stream`: cached when it is all on the
  /// device and used on `stream` only, else destroyed once the work on its streams completed.
  /// False when `p` is no buffer's first address.
  bool recycle(void* p, stream_ref stream) {
    std::unique_ptr<Buffer> gone;
    {
      std::lock_guard lock(mutex_);
      const auto it = buffers_.find(address(p));
      if (it == buffers_.end() || it->second.cached) return false;
      entry& e = it->second;
      const auto s = e.buffer->stats();
      if (!e.shared && s.host_bytes == 0 && s.device_bytes == e.buffer->size()) {
        cache_.push_back(it->first);
        cached_bytes_ += e.buffer->size();
        e.cached = true;
        e.freed_on = stream;
        return true;
      }
      gone = std::move(e.buffer);
      buffers_.erase(it);
      live_.fetch_sub(1, std::memory_order_acq_rel);
    }
    gone->decommit(0, gone->size(), stream);  // waits for the work on its streams
    return true;
  }

  /// Destroys the cached buffers of `device` (every device when negative), after the work queued
  /// on the streams they were freed on; returns their bytes.
  std::size_t release_cached(int device) {
    std::vector<std::pair<std::unique_ptr<Buffer>, stream_ref>> gone;
    std::size_t bytes = 0;
    {
      std::lock_guard lock(mutex_);
      for (std::size_t k = 0; k < cache_.size();) {
        const auto it = buffers_.find(cache_[k]);
        if (device >= 0 && it->second.device != device) {
          ++k;
          continue;
        }
        bytes += it->second.buffer->size();
        gone.emplace_back(std::move(it->second.buffer), it->second.freed_on);
        buffers_.erase(it);
        live_.fetch_sub(1, std::memory_order_acq_rel);
        cache_[k] = cache_.back();
        cache_.pop_back();
      }
      cached_bytes_ -= bytes;
    }
    for (auto& [b, stream] : gone) b->decommit(0, b->size(), stream);
    return bytes;
  }

  /// Destroys the buffer whose first address is `p`; false when there is none.
  bool destroy(void* p) {
    std::unique_ptr<Buffer> gone;
    {
      std::lock_guard lock(mutex_);
      const auto it = buffers_.find(address(p));
      if (it == buffers_.end() || it->second.cached) return false;
      gone = std::move(it->second.buffer);
      buffers_.erase(it);
      live_.fetch_sub(1, std::memory_order_acq_rel);
    }
    return true;  // destroyed here, outside the lock
  }

  /// Whether a live (not cached) buffer holds address `p`.
  bool contains(const void* p) const {
    if (live_.load(std::memory_order_acquire) == 0) return false;
    std::lock_guard lock(mutex_);
    const std::uintptr_t a = address(p);
    auto it = buffers_.upper_bound(a);
    if (it == buffers_.begin()) return false;
    --it;
    return a - it->first < it->second.buffer->size() && !it->second.cached;
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
      if (a - it->first < b.size() && !it->second.cached) return std::forward<F>(f)(b, it->second.device);
    }
    throw usage_error(usage_error::kind::foreign_pointer,
                      "glake: " + hex(a) + " is not inside a movable buffer (make it with glake_torch.movable_empty)");
  }

  movable_totals totals() const {
    std::lock_guard lock(mutex_);
    movable_totals t;
    t.cached_buffer_bytes = cached_bytes_;
    t.cache_reuses = reuses_;
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
    bool cached = false;          ///< freed, kept for reuse on freed_on
    bool shared = false;          ///< record_stream'd: never cached
    stream_ref freed_on{};
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
  std::vector<std::uintptr_t> cache_;  ///< first addresses of cached buffers
  std::size_t cached_bytes_ = 0;
  std::uint64_t reuses_ = 0;
  std::atomic<std::size_t> live_{0};  ///< buffers, cached or not: lets holds() skip the lock
};

}  // namespace glake::torch_plugin
