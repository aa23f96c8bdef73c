// A copy_backend and a pointer_classifier made of host memory and host threads, so that copy
// engines are tested without a GPU: "device memory" is ordinary memory, a stream is a thread
// that runs its copies in order, an event is a count of that thread's completed work.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "glake/backends/concepts.hpp"
#include "glake/errors.hpp"
#include "glake/stream.hpp"

namespace glake {

// ---------------------------------------------------------------------------------------------
// host_dma_backend
//
// Each stream_ref names a stream, made on first use: a thread that runs the work queued on it,
// one item after another, as a GPU's stream runs copies and kernels. enqueue_copy queues a
// memcpy; launch queues any function (a test's stand-in for a kernel). record_event(s) is the
// number of items queued on s so far; the event is done once s has completed that many.
// Unlike CUDA's legacy default stream, stream 0 is a stream like the others.
//
// It checks the rule copy engines must keep: a staging buffer that a copy reads is not written
// between the call that queues the copy and the moment the stream runs it. enqueue_copy hashes
// a source that lies in staging memory when queued and again when run; source_changes() counts
// the copies whose source changed meanwhile. (Other sources may change meanwhile, legitimately:
// work queued before the copy on its stream may write them.)
// `dma_delay` makes every copy wait that long before it runs, so that a caller who reads a
// target or rewrites a source too early is caught in the act.
//
// Staging memory is operator new memory; live_staging() and live_events() count what was
// allocated or recorded and not yet freed or recycled, for leak checks.
//
// Several simulated devices: on_device(k) is a backend of device k that shares this one's
// streams, events and counters, as the backends of one process's GPUs share the driver. Its
// peer_copy_backend members: device memory is operator new memory (live_device() counts it), a
// peer copy is a memmove queued like enqueue_copy (peer_copies() counts them), and
// stream_wait_event queues an item that blocks its stream until the event's stream got there.
//
// Copies of the object share its state (a handle). Thread safety: every member may be called
// concurrently (one mutex). The destructor of the last copy waits for all queued work, then
// joins the streams' threads.
// ---------------------------------------------------------------------------------------------
class host_dma_backend {
 public:
  struct event_type {
    std::uintptr_t stream = 0;
    std::uint64_t ticket = 0;  ///< done once the stream has completed this many items
  };

  explicit host_dma_backend(int device = 0, std::chrono::microseconds dma_delay = std::chrono::microseconds{0})
      : state_(std::make_shared<state>(dma_delay)), device_(device) {}

  int device() const noexcept { return device_; }

  /// The backend of simulated device `device`, sharing this one's streams and counters.
  host_dma_backend on_device(int device) const {
    host_dma_backend b = *this;
    b.device_ = device;
    return b;
  }

  void* try_allocate_device(std::size_t bytes) {
    void* p = ::operator new(bytes == 0 ? 1 : bytes, std::align_val_t{64}, std::nothrow);
    if (p == nullptr) return nullptr;
    std::lock_guard lock(state_->mutex);
    ++state_->live_device;
    return p;
  }

  void free_device(void* p, std::size_t) noexcept {
    if (p == nullptr) return;
    {
      std::lock_guard lock(state_->mutex);
      --state_->live_device;
    }
    ::operator delete(p, std::align_val_t{64});
  }

  void enqueue_peer_copy(void* to, int, const void* from, int, std::size_t bytes, stream_ref stream) {
    state* const s = state_.get();
    {
      std::lock_guard lock(s->mutex);
      ++s->peer_copies;
    }
    launch(stream, [s, to, from, bytes] {
      if (s->dma_delay.count() > 0) std::this_thread::sleep_for(s->dma_delay);
      if (bytes != 0) std::memmove(to, from, bytes);
    });
  }

  void stream_wait_event(stream_ref stream, event_type event) {
    state* const s = state_.get();
    launch(stream, [s, event] {
      std::unique_lock lock(s->mutex);
      stream_state* other = s->find(event.stream);
      if (other == nullptr) return;
      s->progress.wait(lock, [&] { return other->completed >= event.ticket; });
    });
  }

  void* try_allocate_staging(std::size_t bytes) {
    void* p = ::operator new(bytes == 0 ? 1 : bytes, std::align_val_t{64}, std::nothrow);
    if (p == nullptr) return nullptr;
    std::lock_guard lock(state_->mutex);
    try {
      state_->staging.emplace(reinterpret_cast<std::uintptr_t>(p), bytes);
    } catch (...) {
      ::operator delete(p, std::align_val_t{64});
      throw;
    }
    ++state_->live_staging;
    state_->live_staging_bytes += bytes;
    return p;
  }

  void free_staging(void* p, std::size_t bytes) noexcept {
    if (p == nullptr) return;
    {
      std::lock_guard lock(state_->mutex);
      state_->staging.erase(reinterpret_cast<std::uintptr_t>(p));
      --state_->live_staging;
      state_->live_staging_bytes -= bytes;
    }
    ::operator delete(p, std::align_val_t{64});
  }

  void enqueue_copy(void* to, const void* from, std::size_t bytes, stream_ref stream) {
    bool staged = false;
    {
      std::lock_guard lock(state_->mutex);
      staged = state_->in_staging(from, bytes);
    }
    const std::uint64_t before = staged ? hash(from, bytes) : 0;
    state* const s = state_.get();  // the state outlives its streams' work: ~state drains them
    launch(stream, [s, to, from, bytes, before, staged] {
      if (s->dma_delay.count() > 0) std::this_thread::sleep_for(s->dma_delay);
      if (staged && hash(from, bytes) != before) {
        std::lock_guard lock(s->mutex);
        ++s->source_changes;
      }
      if (bytes != 0) std::memmove(to, from, bytes);
    });
  }

  event_type record_event(stream_ref stream) {
    std::lock_guard lock(state_->mutex);
    stream_state& s = state_->stream_of(stream.id());
    ++state_->live_events;
    return {stream.id(), s.queued};
  }

  bool event_done(event_type event) {
    std::lock_guard lock(state_->mutex);
    return state_->stream_of(event.stream).completed >= event.ticket;
  }

  void wait_event(event_type event) noexcept {
    std::unique_lock lock(state_->mutex);
    stream_state* s = state_->find(event.stream);
    if (s == nullptr) return;
    state_->progress.wait(lock, [&] { return s->completed >= event.ticket; });
  }

  void recycle_event(event_type) noexcept {
    std::lock_guard lock(state_->mutex);
    --state_->live_events;
  }

  void wait_stream(stream_ref stream) noexcept {
    std::unique_lock lock(state_->mutex);
    stream_state* s = state_->find(stream.id());
    if (s == nullptr) return;
    state_->progress.wait(lock, [&] { return s->completed >= s->queued; });
  }

  /// Queues `work` on the stream, after what is queued there; it must not throw.
  void launch(stream_ref stream, std::function<void()> work) {
    std::lock_guard lock(state_->mutex);
    stream_state& s = state_->stream_of(stream.id());
    s.work.push_back(std::move(work));
    ++s.queued;
    state_->wake.notify_all();
  }

  std::size_t live_staging() const {
    std::lock_guard lock(state_->mutex);
    return state_->live_staging;
  }
  std::size_t live_staging_bytes() const {
    std::lock_guard lock(state_->mutex);
    return state_->live_staging_bytes;
  }
  /// Device memory from try_allocate_device not yet freed, on every device.
  std::size_t live_device() const {
    std::lock_guard lock(state_->mutex);
    return state_->live_device;
  }
  /// enqueue_peer_copy calls so far, on every device.
  std::uint64_t peer_copies() const {
    std::lock_guard lock(state_->mutex);
    return state_->peer_copies;
  }
  std::size_t live_events() const {
    std::lock_guard lock(state_->mutex);
    return state_->live_events;
  }
  /// Copies whose source changed between enqueue_copy and the moment the stream ran them.
  std::uint64_t source_changes() const {
    std::lock_guard lock(state_->mutex);
    return state_->source_changes;
  }
  /// Copies and launches queued on every stream so far.
  std::uint64_t queued_items() const {
    std::lock_guard lock(state_->mutex);
    std::uint64_t n = 0;
    for (const auto& [id, s] : state_->streams) n += s->queued;
    return n;
  }

 private:
  static std::uint64_t hash(const void* p, std::size_t bytes) noexcept {
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < bytes; ++i) h = (h ^ b[i]) * 1099511628211ull;
    return h;
  }

  struct stream_state {
    std::deque<std::function<void()>> work;
    std::uint64_t queued = 0;
    std::uint64_t completed = 0;
    std::thread thread;
  };

  struct state {
    explicit state(std::chrono::microseconds delay) : dma_delay(delay) {}
    state(const state&) = delete;
    state& operator=(const state&) = delete;
    ~state() {
      {
        std::lock_guard lock(mutex);
        stopping = true;
        wake.notify_all();
      }
      for (auto& [id, s] : streams) s->thread.join();
    }

    // Called with the mutex held.
    bool in_staging(const void* p, std::size_t bytes) const {
      const auto a = reinterpret_cast<std::uintptr_t>(p);
      auto it = staging.upper_bound(a);
      if (it == staging.begin()) return false;
      --it;
      return a - it->first < it->second && bytes <= it->second - (a - it->first);
    }
    stream_state* find(std::uintptr_t id) {
      const auto it = streams.find(id);
      return it == streams.end() ? nullptr : it->second.get();
    }
    // Called with the mutex held.
    stream_state& stream_of(std::uintptr_t id) {
      if (stream_state* s = find(id)) return *s;
      auto made = std::make_unique<stream_state>();
      stream_state* s = made.get();
      streams.emplace(id, std::move(made));
      s->thread = std::thread([this, s] { run(*s); });
      return *s;
    }
    void run(stream_state& s) {
      std::unique_lock lock(mutex);
      for (;;) {
        wake.wait(lock, [&] { return !s.work.empty() || stopping; });
        if (s.work.empty()) return;  // stopping, and everything queued ran
        std::function<void()> item = std::move(s.work.front());
        s.work.pop_front();
        lock.unlock();
        item();
        lock.lock();
        ++s.completed;
        progress.notify_all();
      }
    }

    const std::chrono::microseconds dma_delay;
    mutable std::mutex mutex;
    std::condition_variable wake;      ///< work queued, or stopping
    std::condition_variable progress;  ///< a stream completed an item
    bool stopping = false;
    std::map<std::uintptr_t, std::unique_ptr<stream_state>> streams;
    std::map<std::uintptr_t, std::size_t> staging;  ///< staging memory: address -> bytes
    std::size_t live_staging = 0;
    std::size_t live_staging_bytes = 0;
    std::size_t live_events = 0;
    std::uint64_t source_changes = 0;
    std::size_t live_device = 0;
    std::uint64_t peer_copies = 0;
  };

  std::shared_ptr<state> state_;
  int device_;
};
static_assert(copy_backend<host_dma_backend>);
static_assert(peer_copy_backend<host_dma_backend>);

// ---------------------------------------------------------------------------------------------
// range_classifier
//
// A pointer_classifier over ranges named by the caller: add(p, n, kind, device) says that
// [p, p + n) is memory of that kind; any other address is pageable. Tests use it to call
// ordinary buffers "device memory" or "pinned memory". Lookup is O(log ranges).
// Copies share the ranges (a handle). Thread safety: every member may be called concurrently.
// ---------------------------------------------------------------------------------------------
class range_classifier {
 public:
  range_classifier() = default;

  void add(const void* p, std::size_t bytes, memory_kind kind, int device = 0) {
    std::lock_guard lock(state_->mutex);
    state_->ranges[address(p)] = range{bytes, {kind, kind == memory_kind::device ? device : -1}};
  }
  void remove(const void* p) {
    std::lock_guard lock(state_->mutex);
    state_->ranges.erase(address(p));
  }

  pointer_info locate(const void* p) {
    std::lock_guard lock(state_->mutex);
    ++state_->lookups;
    const std::uintptr_t a = address(p);
    auto it = state_->ranges.upper_bound(a);
    if (it == state_->ranges.begin()) return {};
    --it;
    if (a - it->first < it->second.bytes) return it->second.info;
    return {};
  }

  /// locate calls so far.
  std::uint64_t lookups() const {
    std::lock_guard lock(state_->mutex);
    return state_->lookups;
  }

 private:
  static std::uintptr_t address(const void* p) noexcept { return reinterpret_cast<std::uintptr_t>(p); }
  struct range {
    std::size_t bytes;
    pointer_info info;
  };
  struct state {
    mutable std::mutex mutex;
    std::map<std::uintptr_t, range> ranges;
    std::uint64_t lookups = 0;
  };
  std::shared_ptr<state> state_ = std::make_shared<state>();
};
static_assert(pointer_classifier<range_classifier>);

}  // namespace glake
