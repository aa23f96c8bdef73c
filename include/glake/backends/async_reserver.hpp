// A reserver adaptor that takes the mapping calls off the allocating thread: maps, access grants,
// unmaps and frees run on a helper thread, and a stream that is handed memory waits for them.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "glake/backends/concepts.hpp"
#include "glake/errors.hpp"
#include "glake/stream.hpp"

namespace glake {

namespace detail {
// The events of a stream_ordered_reserver, forwarded unchanged; nothing for one without events.
template <class Derived, class Inner, bool = stream_ordered_reserver<Inner>>
class forwarded_events {};

template <class Derived, class Inner>
class forwarded_events<Derived, Inner, true> {
 public:
  using event_type = typename Inner::event_type;
  event_type record_event(stream_ref stream) { return inner().record_event(stream); }
  bool event_done(event_type event) { return inner().event_done(event); }
  void recycle_event(event_type event) noexcept { inner().recycle_event(event); }
  void wait_event(event_type event) noexcept { inner().wait_event(event); }
  void synchronize_device() noexcept { inner().synchronize_device(); }

 private:
  Inner& inner() noexcept { return static_cast<Derived&>(*this).inner(); }
};
}  // namespace detail

// ---------------------------------------------------------------------------------------------
// async_reserver<Inner>
//
// An address_reserver over `Inner` whose try_map, try_set_access, unmap and free return at once:
// each becomes a job for one helper thread, which makes the calls on Inner in the order they
// were asked for. try_reserve, and the events, stay on the caller's thread. A new stitch of k
// handles then costs its allocating thread one reservation and k queue pushes (microseconds)
// instead of k maps and access grants (~25 us per handle on an H100; the driver's cost is the
// same, paid on the helper).
//
// The memory is usable only when its jobs are done, so whoever hands it out must call
// gate(stream) before the stream can use it (stitching_allocator does, after every allocation):
//   - when every job queued so far is done (the usual case), gate does nothing: one atomic load;
//   - else, with a host_function_reserver Inner (CUDA), it queues a host function on the stream
//     that returns once the jobs queued so far are done, so work queued on the stream after the
//     allocation waits for its mappings and the thread goes on at once. One such gate per stream
//     and batch of jobs: a stream already gated for every job queued gets no second one;
//   - else (a stream being captured into a graph, or an Inner without host functions) it waits on
//     the calling thread for those jobs.
// Memory handed out is thus mapped before any work ordered after the allocation on its stream
// runs, whichever stream it was mapped for. Work that is not ordered after the allocation (a
// stream that never synchronizes with the allocating one) is as unsafe as it is with any
// stream-ordered allocator.
//
// drain() waits for every queued job; vmm_backend calls it before releasing handles, so no
// handle is released while a job may still map or unmap it.
//
// Failures. A job can fail only where the driver refuses a map or an access grant of a range
// already handed out (out of mapping resources, or an error), which the synchronous path would
// have rolled back. The first failure is kept (failure()); gates still open, so the work behind
// them meets an unmapped range and the device reports an illegal address; and every later
// try_reserve, try_map or try_set_access throws driver_error naming the failed call, so the
// allocator's next new mapping fails loudly. With `threaded = false` every call runs inline on
// the caller's thread, exactly as Inner's: the synchronous behaviour, rollbacks included.
//
// Thread safety: as a reserver, one owning thread at a time (the allocator's lock); Inner's calls
// must be safe from two threads at once (the helper's jobs against the owner's reservations and
// events), as the CUDA and simulated reservers' are. Move-only: one helper thread per object.
// Complexity: O(1) per call (one mutex push; the helper is woken only when it sleeps).
// ---------------------------------------------------------------------------------------------
template <address_reserver Inner>
class async_reserver : public detail::forwarded_events<async_reserver<Inner>, Inner> {
 public:
  using handle_type = typename Inner::handle_type;

  /// Starts the helper thread when `threaded` (which, with a host_function_reserver Inner, calls
  /// attach_thread there first).
  explicit async_reserver(Inner inner, bool threaded = true)
      : state_(std::make_shared<state>(std::move(inner))), threaded_(threaded) {
    if (threaded_) worker_ = std::thread([s = state_] { run(*s); });
  }
  /// The helper keeps running (it holds the shared state, never the object).
  async_reserver(async_reserver&& other) noexcept
      : state_(std::move(other.state_)),
        threaded_(other.threaded_),
        worker_(std::move(other.worker_)),
        queued_(other.queued_.load(std::memory_order_relaxed)),
        gates_(other.gates_.load(std::memory_order_relaxed)),
        host_waits_(other.host_waits_.load(std::memory_order_relaxed)),
        gated_(std::move(other.gated_)) {}
  async_reserver& operator=(async_reserver&&) = delete;
  async_reserver(const async_reserver&) = delete;
  async_reserver& operator=(const async_reserver&) = delete;
  /// Runs every queued job, then stops the helper.
  ~async_reserver() {
    if (!worker_.joinable()) return;
    {
      std::lock_guard lock(state_->mutex);
      state_->stopping = true;
    }
    state_->wake.notify_one();
    worker_.join();
  }

  std::size_t granularity() const noexcept { return state_->inner.granularity(); }
  Inner& inner() noexcept { return state_->inner; }
  bool threaded() const noexcept { return threaded_; }

  void* try_reserve(std::size_t bytes) {
    throw_if_failed();
    return state_->inner.try_reserve(bytes);
  }
  bool try_map(void* at, std::size_t bytes, handle_type handle) {
    if (!threaded_) return state_->inner.try_map(at, bytes, handle);
    throw_if_failed();
    push({job::kind::map, at, bytes, handle});
    return true;
  }
  bool try_set_access(void* at, std::size_t bytes) {
    if (!threaded_) return state_->inner.try_set_access(at, bytes);
    throw_if_failed();
    push({job::kind::access, at, bytes, handle_type{}});
    return true;
  }
  void unmap(void* at, std::size_t bytes) noexcept { push_or_run({job::kind::unmap, at, bytes, handle_type{}}); }
  void free(void* at, std::size_t bytes) noexcept { push_or_run({job::kind::free, at, bytes, handle_type{}}); }

  /// Makes work queued on `stream` from now on wait until every job queued so far is done (see
  /// the class comment).
  void gate(stream_ref stream) noexcept {
    if (!threaded_) return;
    const std::uint64_t target = queued_.load(std::memory_order_relaxed);
    if (state_->done.load(std::memory_order_acquire) >= target) {
      gated_.clear();
      return;
    }
    bool known = false;
    for (auto& [s, upto] : gated_) {
      if (s != stream) continue;
      if (upto >= target) return;
      upto = target;
      known = true;
      break;
    }
    if (!known) {
      try {
        gated_.emplace_back(stream, target);
      } catch (...) {  // without the note, only a later gate on this stream is repeated
      }
    }
    if constexpr (host_function_reserver<Inner>) {
      try {
        auto arg = std::make_unique<gate_arg>(gate_arg{state_, target});
        if (state_->inner.enqueue_host_function(stream, &open_gate, arg.get())) {
          arg.release();
          bump(gates_);
          return;
        }
      } catch (...) {  // no host function queued: wait here instead
      }
    }
    wait_until(*state_, target);
    bump(host_waits_);
  }

  /// Returns when every job queued so far is done.
  void drain() noexcept {
    if (threaded_) wait_until(*state_, queued_.load(std::memory_order_relaxed));
  }

  /// Jobs queued so far, host functions queued by gate, and gates that waited on the calling
  /// thread instead. Any thread may read them.
  std::uint64_t deferred_calls() const noexcept { return queued_.load(std::memory_order_relaxed); }
  std::uint64_t gates() const noexcept { return gates_.load(std::memory_order_relaxed); }
  std::uint64_t host_waits() const noexcept { return host_waits_.load(std::memory_order_relaxed); }
  /// Nanoseconds that gates' host functions spent waiting for jobs, all streams together: how
  /// long streams were held, at most (a stream's work may have been behind other work anyway).
  std::uint64_t gate_wait_ns() const noexcept { return state_->gate_wait_ns.load(std::memory_order_relaxed); }
  /// The first job that failed, described; empty while none has.
  std::string failure() const {
    std::lock_guard lock(state_->mutex);
    return state_->failure;
  }

 private:
  struct job {
    enum class kind : unsigned char { map, access, unmap, free };
    kind what;
    void* at;
    std::size_t bytes;
    handle_type handle;
  };

  // What the helper thread and queued gates share with the owner; gates keep it alive.
  struct state {
    explicit state(Inner r) : inner(std::move(r)) {}
    Inner inner;
    mutable std::mutex mutex;
    std::condition_variable wake;
    std::vector<job> jobs;  // queued, not yet taken by the helper
    bool sleeping = false;  // the helper waits on `wake`
    bool stopping = false;
    std::string failure;
    std::atomic<bool> failed{false};
    std::atomic<std::uint64_t> done{0};  // jobs finished, in queue order
    std::atomic<std::uint64_t> gate_wait_ns{0};
  };

  struct gate_arg {
    std::shared_ptr<state> s;
    std::uint64_t target;
  };

  static void open_gate(void* p) noexcept {
    const std::unique_ptr<gate_arg> arg(static_cast<gate_arg*>(p));
    state& s = *arg->s;
    if (s.done.load(std::memory_order_acquire) >= arg->target) return;
    const auto start = std::chrono::steady_clock::now();
    wait_until(s, arg->target);
    const auto waited = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start);
    s.gate_wait_ns.fetch_add(static_cast<std::uint64_t>(waited.count()), std::memory_order_relaxed);
  }

  // The counters have one writer (the owning thread); readers may be any thread.
  static void bump(std::atomic<std::uint64_t>& counter) noexcept {
    counter.store(counter.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  }

  static void wait_until(state& s, std::uint64_t target) noexcept {
    for (std::uint64_t d = s.done.load(std::memory_order_acquire); d < target;
         d = s.done.load(std::memory_order_acquire)) {
      s.done.wait(d, std::memory_order_acquire);
    }
  }

  void push(const job& j) {
    bool wake = false;
    {
      std::lock_guard lock(state_->mutex);
      state_->jobs.push_back(j);
      wake = state_->sleeping;
    }
    bump(queued_);
    if (wake) state_->wake.notify_one();
  }

  // For the calls that cannot fail: when the job cannot be queued (no memory for the queue),
  // the call runs here once every earlier job is done, so the order holds.
  void push_or_run(const job& j) noexcept {
    if (threaded_) {
      try {
        push(j);
        return;
      } catch (...) {
        drain();
      }
    }
    execute(*state_, j);
  }

  void throw_if_failed() const {
    if (state_->failed.load(std::memory_order_acquire)) {
      throw driver_error("async_reserver: a deferred mapping call", -1, failure());
    }
  }

  static void run(state& s) noexcept {
    bool attached = false;
    if constexpr (host_function_reserver<Inner>) {
      try {
        s.inner.attach_thread();
        attached = true;
      } catch (const std::exception& e) {
        fail(s, std::string("attach_thread: ") + e.what());
      }
    }
    std::vector<job> batch;
    for (;;) {
      {
        std::unique_lock lock(s.mutex);
        s.sleeping = true;
        s.wake.wait(lock, [&] { return !s.jobs.empty() || s.stopping; });
        s.sleeping = false;
        if (s.jobs.empty()) break;  // stopping, and every job done
        batch.swap(s.jobs);
      }
      for (const job& j : batch) {
        execute(s, j);
        s.done.fetch_add(1, std::memory_order_acq_rel);
        s.done.notify_all();
      }
      batch.clear();
    }
    if constexpr (host_function_reserver<Inner>) {
      if (attached) s.inner.detach_thread();
    }
  }

  static void execute(state& s, const job& j) noexcept {
    try {
      switch (j.what) {
        case job::kind::map:
          if (!s.inner.try_map(j.at, j.bytes, j.handle)) fail(s, "try_map: out of mapping resources");
          break;
        case job::kind::access:
          if (!s.inner.try_set_access(j.at, j.bytes)) fail(s, "try_set_access: out of mapping resources");
          break;
        case job::kind::unmap:
          s.inner.unmap(j.at, j.bytes);
          break;
        case job::kind::free:
          s.inner.free(j.at, j.bytes);
          break;
      }
    } catch (const std::exception& e) {
      fail(s, e.what());
    } catch (...) {
      fail(s, "unknown exception");
    }
  }

  static void fail(state& s, const std::string& what) noexcept {
    std::lock_guard lock(s.mutex);
    if (s.failed.load(std::memory_order_relaxed)) return;
    try {
      s.failure = what;
    } catch (...) {  // the flag still says it failed
    }
    s.failed.store(true, std::memory_order_release);
  }

  std::shared_ptr<state> state_;
  bool threaded_;
  std::thread worker_;
  std::atomic<std::uint64_t> queued_{0};
  std::atomic<std::uint64_t> gates_{0};
  std::atomic<std::uint64_t> host_waits_{0};
  std::vector<std::pair<stream_ref, std::uint64_t>> gated_;  // streams gated, and up to which job
};

}  // namespace glake
