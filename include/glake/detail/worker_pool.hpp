// A fixed set of host threads that run tasks in groups, each group awaited as one.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace glake::detail {

/// Tasks awaited together: worker_pool::wait(g) returns once every task submitted to g ran.
/// Owned by the submitter; it must outlive its tasks (wait on it before it goes).
class task_group {
 public:
  task_group() = default;
  task_group(const task_group&) = delete;
  task_group& operator=(const task_group&) = delete;

 private:
  friend class worker_pool;
  std::size_t pending_ = 0;
  std::exception_ptr error_;
};

// ---------------------------------------------------------------------------------------------
// worker_pool
//
// `threads` workers take tasks from one FIFO queue. A task's exception is kept in its group and
// handed to whoever waits on the group (the first one; later ones are dropped). With no
// workers, submit runs the task on the calling thread. O(1) per task besides the task itself.
// Thread safety: every member may be called concurrently (one mutex); a group is waited on by
// one thread at a time. The destructor runs what is queued, then joins the workers.
// ---------------------------------------------------------------------------------------------
class worker_pool {
 public:
  explicit worker_pool(unsigned threads) {
    try {
      workers_.reserve(threads);
      for (unsigned i = 0; i < threads; ++i) workers_.emplace_back([this] { run(); });
    } catch (...) {
      stop();
      throw;
    }
  }
  worker_pool(const worker_pool&) = delete;
  worker_pool& operator=(const worker_pool&) = delete;
  ~worker_pool() { stop(); }

  unsigned size() const noexcept { return static_cast<unsigned>(workers_.size()); }

  /// Queues `task` (or runs it now, without workers), counted in `group`. Throws only
  /// std::bad_alloc, having queued nothing.
  void submit(task_group& group, std::function<void()> task) {
    if (workers_.empty()) {
      try {
        task();
      } catch (...) {
        if (!group.error_) group.error_ = std::current_exception();
      }
      return;
    }
    std::lock_guard lock(mutex_);
    queue_.emplace_back(&group, std::move(task));
    ++group.pending_;
    work_.notify_one();
  }

  /// Whether every task submitted to `group` ran.
  bool idle(const task_group& group) const {
    std::lock_guard lock(mutex_);
    return group.pending_ == 0;
  }

  /// Returns once every task submitted to `group` ran, with the first exception one of them
  /// threw (null if none), which the group then forgets.
  std::exception_ptr wait(task_group& group) noexcept {
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return group.pending_ == 0; });
    return std::exchange(group.error_, nullptr);
  }

 private:
  void run() {
    std::unique_lock lock(mutex_);
    for (;;) {
      work_.wait(lock, [&] { return !queue_.empty() || stopping_; });
      if (queue_.empty()) return;
      auto [group, task] = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      std::exception_ptr error;
      try {
        task();
      } catch (...) {
        error = std::current_exception();
      }
      task = nullptr;  // whatever it captured goes before the group is told
      lock.lock();
      if (error && !group->error_) group->error_ = std::move(error);
      if (--group->pending_ == 0) done_.notify_all();
    }
  }

  void stop() noexcept {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
      work_.notify_all();
    }
    for (std::thread& t : workers_) t.join();
  }

  mutable std::mutex mutex_;
  std::condition_variable work_;
  std::condition_variable done_;
  std::deque<std::pair<task_group*, std::function<void()>>> queue_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace glake::detail
