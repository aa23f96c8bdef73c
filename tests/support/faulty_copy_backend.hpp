// A copy_backend that fails a chosen call of the host model's, so that copy engines are shown to
// survive a driver failure at every step: no staging buffer lost, the engine usable afterwards.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>

#include "glake/backends/concepts.hpp"
#include "glake/backends/host_dma.hpp"
#include "glake/errors.hpp"
#include "glake/stream.hpp"

namespace glake::testing {

/// Counts the fallible calls (try_allocate_staging, enqueue_copy, record_event, event_done, and
/// the peer calls try_allocate_device, enqueue_peer_copy, stream_wait_event) and
/// fails the nth one from when it was armed, once. Shared by the wrapper's copies.
class copy_faults {
 public:
  void fail_nth_call(std::uint64_t n) {
    std::lock_guard lock(mutex_);
    target_ = calls_ + n;
  }
  void never_fail() {
    std::lock_guard lock(mutex_);
    target_ = 0;
    fail_device_allocation_ = false;
  }
  /// The next try_allocate_device fails, whatever else is counted (fail_nth_call's numbering
  /// depends on how often events were polled, which depends on timing).
  void fail_next_device_allocation() {
    std::lock_guard lock(mutex_);
    fail_device_allocation_ = true;
  }
  bool should_fail_device_allocation() {
    std::lock_guard lock(mutex_);
    if (fail_device_allocation_) {
      fail_device_allocation_ = false;
      ++calls_;
      ++faults_;
      return true;
    }
    return false;
  }
  bool should_fail() {
    std::lock_guard lock(mutex_);
    ++calls_;
    if (target_ == 0 || calls_ != target_) return false;
    target_ = 0;
    ++faults_;
    return true;
  }
  std::uint64_t faults() const {
    std::lock_guard lock(mutex_);
    return faults_;
  }
  std::uint64_t calls() const {
    std::lock_guard lock(mutex_);
    return calls_;
  }

 private:
  mutable std::mutex mutex_;
  std::uint64_t calls_ = 0;
  std::uint64_t target_ = 0;  // 0: fail nothing
  std::uint64_t faults_ = 0;
  bool fail_device_allocation_ = false;
};

/// host_dma_backend whose fallible calls fail when `faults` says so: allocation returns null
/// (out of pinned memory), the others throw driver_error("injected ...").
class faulty_copy_backend {
 public:
  using event_type = host_dma_backend::event_type;

  faulty_copy_backend(host_dma_backend inner, std::shared_ptr<copy_faults> faults)
      : inner_(std::move(inner)), faults_(std::move(faults)) {}

  int device() const noexcept { return inner_.device(); }
  void* try_allocate_staging(std::size_t bytes) {
    if (faults_->should_fail()) return nullptr;
    return inner_.try_allocate_staging(bytes);
  }
  void free_staging(void* p, std::size_t bytes) noexcept { inner_.free_staging(p, bytes); }
  void enqueue_copy(void* to, const void* from, std::size_t bytes, stream_ref stream) {
    if (faults_->should_fail()) throw driver_error("injected enqueue_copy", 1, "fault injected by the test");
    inner_.enqueue_copy(to, from, bytes, stream);
  }
  event_type record_event(stream_ref stream) {
    if (faults_->should_fail()) throw driver_error("injected record_event", 2, "fault injected by the test");
    return inner_.record_event(stream);
  }
  bool event_done(event_type event) {
    if (faults_->should_fail()) throw driver_error("injected event_done", 3, "fault injected by the test");
    return inner_.event_done(event);
  }
  void wait_event(event_type event) noexcept { inner_.wait_event(event); }
  void recycle_event(event_type event) noexcept { inner_.recycle_event(event); }
  void wait_stream(stream_ref stream) noexcept { inner_.wait_stream(stream); }

  void* try_allocate_device(std::size_t bytes) {
    if (faults_->should_fail_device_allocation() || faults_->should_fail()) return nullptr;
    return inner_.try_allocate_device(bytes);
  }
  void free_device(void* p, std::size_t bytes) noexcept { inner_.free_device(p, bytes); }
  void enqueue_peer_copy(void* to, int to_device, const void* from, int from_device, std::size_t bytes,
                         stream_ref stream) {
    if (faults_->should_fail()) throw driver_error("injected enqueue_peer_copy", 4, "fault injected by the test");
    inner_.enqueue_peer_copy(to, to_device, from, from_device, bytes, stream);
  }
  void stream_wait_event(stream_ref stream, event_type event) {
    if (faults_->should_fail()) throw driver_error("injected stream_wait_event", 5, "fault injected by the test");
    inner_.stream_wait_event(stream, event);
  }

 private:
  host_dma_backend inner_;
  std::shared_ptr<copy_faults> faults_;
};
static_assert(peer_copy_backend<faulty_copy_backend>);

}  // namespace glake::testing
