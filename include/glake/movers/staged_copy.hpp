// A copy engine for host<->device copies that moves pageable host memory at pinned speed: host
// threads fill (or drain) a ring of pinned staging buffers while the device copies the last one.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "glake/backends/concepts.hpp"
#include "glake/config.hpp"
#include "glake/detail/archetypes.hpp"
#include "glake/detail/worker_pool.hpp"
#include "glake/errors.hpp"
#include "glake/movers/staging_ring.hpp"
#include "glake/stream.hpp"

namespace glake {

/// The shape of a staged_copier's pipeline.
struct staged_copy_options {
  /// Bytes of one staging buffer: the unit of one device copy.
  std::size_t chunk_bytes = 8 * MiB;
  /// Staging buffers in the ring: how many chunks may be in flight at once.
  std::size_t chunks = 8;
  /// Host threads that fill and drain the buffers; 0: the calling thread does it alone.
  unsigned threads = default_threads();
  /// A chunk is cut into at most `threads` slices of at least this many bytes, one a task; a copy
  /// of at most this many bytes is done by the calling thread alone.
  std::size_t min_slice = 1 * MiB;

  /// min(8, the hardware's threads).
  static unsigned default_threads() noexcept {
    const unsigned hw = std::thread::hardware_concurrency();
    return std::clamp(hw, 1u, 8u);
  }
};

/// What a staged_copier did, since it was made.
struct staged_copy_statistics {
  std::uint64_t direct_copies = 0;  ///< copies queued as they are (no pageable memory involved)
  std::uint64_t direct_bytes = 0;
  std::uint64_t staged_copies = 0;  ///< copies through the staging ring (copy and copy_from_file)
  std::uint64_t staged_bytes = 0;
  std::uint64_t file_reads = 0;      ///< copy_from_file calls, counted in staged_* too
  std::uint64_t chunk_copies = 0;    ///< device copies of one staging buffer
  std::size_t staging_bytes = 0;     ///< pinned memory the ring holds now
};

// ---------------------------------------------------------------------------------------------
// staged_copier
//
// copy(dst, src, n, stream) copies n bytes between host and device memory, ordered on `stream`.
// It asks the Classifier what both ranges are. When neither is pageable host memory (pinned or
// registered host memory, device memory, managed memory; any direction), the copy is queued as
// it is: one Backend::enqueue_copy (cuMemcpyAsync), so it is never slower than that. When the
// source is pageable and the target device memory (host to device), chunk k of the source is
// copied by the host threads into staging buffer k of a ring of pinned buffers (each chunk cut
// into slices, one a thread), then the buffer's device copy is queued on the stream and an event
// recorded after it; the threads meanwhile fill the next buffers, so the device copies chunk k
// while the host copies chunk k+1. A buffer is refilled only once its event has completed.
// Device to pageable host is the mirror: the device copies are queued first, into as many
// buffers as the ring has, and the threads drain each buffer once its event completed.
// copy_from_file is the host-to-device pipeline with pread from a file in place of memcpy: it
// loads a checkpoint's bytes into device memory without a pageable copy in between.
//
// | call                      | when it returns                       | the copy is ordered
// |---------------------------|---------------------------------------|---------------------------
// | copy, no pageable side    | once the copy is queued               | after the work queued on
// |                           | (cudaMemcpyAsync's semantics)         | the stream before it; work
// | copy, pageable to device  | once the source has been read whole;  | queued there afterwards
// |                           | the source may then be reused; the    | sees the data
// |                           | last device copies may still run      |
// | copy, device to pageable  | once the destination holds the data   |
// | copy_from_file            | once the file range has been read     |
// | n == 0                    | at once, having done nothing          |
//
// Errors, thrown before anything is copied: a null pointer, a range that wraps around the
// address space, overlapping ranges, a device range of another device than the Backend's, a
// range that begins in device memory and ends outside it: usage_error. A failure midway (the
// Backend's driver_error, out_of_memory for the pinned staging memory, a read error) propagates
// once every host thread has stopped touching the caller's memory; the target's bytes are then
// unspecified, no staging buffer is lost (a buffer whose device copy may still run keeps its
// event and waits for it before its next use), and the copier can be used again.
//
// Cost: a staged copy does chunks * slices tasks and one device copy and event per chunk;
// locate is called 4 times a copy. Pinned memory: chunks * chunk_bytes, made on first need,
// kept until release_staging or destruction.
// Thread safety: copy and copy_from_file may be called from several threads at once; staged
// copies take turns (one staged copy already uses every thread and the bus), direct ones do not
// wait; the Backend's and the Classifier's calls may therefore come from several threads at once
// (both CUDA models and both host models allow it).
// Streams: only the given stream is used; nothing waits for the device or other streams (a
// staging buffer last used on another stream is waited for on the host, through its event).
// The Backend's device must be current where copies are issued (for CUDA, the caller's context;
// cuda_copy_backend makes the primary context current where a thread has none).
// ---------------------------------------------------------------------------------------------
template <copy_backend Backend, pointer_classifier Classifier>
class staged_copier {
 public:
  using backend_type = Backend;
  using classifier_type = Classifier;
  /// For byte_copier: a copy may still run on its stream when copy returns.
  static constexpr bool synchronous = false;

  /// Checks the options (config_error when a size or count is 0, or chunks * chunk_bytes
  /// overflows) and starts `options.threads` threads. Pins no memory yet.
  explicit staged_copier(Backend backend, Classifier classifier = {}, staged_copy_options options = {})
      : options_(checked(options)),
        classifier_(std::move(classifier)),
        ring_(std::move(backend), options_.chunks, options_.chunk_bytes),
        groups_(std::make_unique<detail::task_group[]>(options_.chunks)),
        pool_(options_.threads) {}
  staged_copier(const staged_copier&) = delete;
  staged_copier& operator=(const staged_copier&) = delete;
  /// Waits for the device copies that still read staging buffers, then frees them.
  ~staged_copier() = default;

  const staged_copy_options& options() const noexcept { return options_; }

  /// Copies `bytes` from `src` to `dst`, ordered on `stream` (see the class comment).
  void copy(void* dst, const void* src, std::size_t bytes, stream_ref stream = {}) {
    if (bytes == 0) return;
    check_range("destination", dst, bytes);
    check_range("source", src, bytes);
    const auto d = reinterpret_cast<std::uintptr_t>(dst);
    const auto s = reinterpret_cast<std::uintptr_t>(src);
    if (d < s + bytes && s < d + bytes) {
      throw usage_error(usage_error::kind::bad_argument,
                        "glake::staged_copier::copy: the source and destination ranges of " + std::to_string(bytes) +
                            " bytes overlap");
    }
    const pointer_info to = locate("destination", dst, bytes);
    const pointer_info from = locate("source", src, bytes);
    if (from.kind == memory_kind::pageable && to.kind == memory_kind::device) {
      std::lock_guard lock(mutex_);
      stage_in(static_cast<char*>(dst), bytes, stream, [src](void* staging, std::size_t at, std::size_t n) {
        std::memcpy(staging, static_cast<const char*>(src) + at, n);
      });
      count_staged(bytes);
    } else if (from.kind == memory_kind::device && to.kind == memory_kind::pageable) {
      std::lock_guard lock(mutex_);
      stage_out(static_cast<char*>(dst), static_cast<const char*>(src), bytes, stream);
      count_staged(bytes);
    } else {
      ring_.backend().enqueue_copy(dst, src, bytes, stream);
      direct_copies_.fetch_add(1, std::memory_order_relaxed);
      direct_bytes_.fetch_add(bytes, std::memory_order_relaxed);
    }
  }

  /// Reads `bytes` of the file `fd` from `offset` (pread, so the file position is untouched)
  /// into device memory at `dst`, ordered on `stream`; returns once the file range has been read.
  /// usage_error for memory that is not device memory, a negative fd, a range that overflows,
  /// or a file that ends before offset + bytes; driver_error("pread", errno) for a read error.
  void copy_from_file(void* dst, int fd, std::uint64_t offset, std::size_t bytes, stream_ref stream = {}) {
    if (bytes == 0) return;
    check_range("destination", dst, bytes);
    if (fd < 0) {
      throw usage_error(usage_error::kind::bad_argument,
                        "glake::staged_copier::copy_from_file: " + std::to_string(fd) + " is not a file descriptor");
    }
    constexpr std::uint64_t max_offset = static_cast<std::uint64_t>(~std::uint64_t{0} >> 1);  // off_t's range
    if (offset > max_offset || bytes > max_offset - offset) {
      throw usage_error(usage_error::kind::bad_argument, "glake::staged_copier::copy_from_file: offset " +
                                                             std::to_string(offset) + " + " + std::to_string(bytes) +
                                                             " bytes is beyond any file");
    }
    const pointer_info to = locate("destination", dst, bytes);
    if (to.kind != memory_kind::device) {
      throw usage_error(usage_error::kind::bad_argument,
                        std::string("glake::staged_copier::copy_from_file: the destination is ") + to_string(to.kind) +
                            ", not device memory (read host memory with pread)");
    }
    std::lock_guard lock(mutex_);
    stage_in(static_cast<char*>(dst), bytes, stream, [fd, offset](void* staging, std::size_t at, std::size_t n) {
      read_exactly(fd, static_cast<char*>(staging), offset + at, n);
    });
    count_staged(bytes);
    file_reads_.fetch_add(1, std::memory_order_relaxed);
  }

  /// Waits for the device copies still reading or writing staging buffers and frees the pinned
  /// memory; the next staged copy pins it again.
  void release_staging() {
    std::lock_guard lock(mutex_);
    ring_.trim();
    note_staging();
  }

  staged_copy_statistics stats() const {
    staged_copy_statistics s;
    s.direct_copies = direct_copies_.load(std::memory_order_relaxed);
    s.direct_bytes = direct_bytes_.load(std::memory_order_relaxed);
    s.staged_copies = staged_copies_.load(std::memory_order_relaxed);
    s.staged_bytes = staged_bytes_.load(std::memory_order_relaxed);
    s.file_reads = file_reads_.load(std::memory_order_relaxed);
    s.chunk_copies = chunk_copies_.load(std::memory_order_relaxed);
    s.staging_bytes = staging_bytes_.load(std::memory_order_relaxed);
    return s;
  }

  Backend& backend() noexcept { return ring_.backend(); }
  Classifier& classifier() noexcept { return classifier_; }

 private:
  static staged_copy_options checked(const staged_copy_options& o) {
    auto fail = [](const std::string& what) { throw config_error("glake::staged_copier: " + what); };
    if (o.chunk_bytes == 0) fail("chunk_bytes is 0");
    if (o.chunks == 0) fail("chunks is 0");
    if (o.min_slice == 0) fail("min_slice is 0");
    if (o.chunks > ~std::size_t{0} / o.chunk_bytes) fail("chunks * chunk_bytes overflows");
    return o;
  }

  static void check_range(const char* which, const void* p, std::size_t bytes) {
    if (p == nullptr) {
      throw usage_error(usage_error::kind::bad_argument,
                        std::string("glake::staged_copier: the ") + which + " is a null pointer");
    }
    if (bytes - 1 > ~std::uintptr_t{0} - reinterpret_cast<std::uintptr_t>(p)) {
      throw usage_error(usage_error::kind::bad_argument, std::string("glake::staged_copier: the ") + which +
                                                             " range of " + std::to_string(bytes) +
                                                             " bytes runs past the end of the address space");
    }
  }

  // The kind of [p, p + bytes), from its first and last bytes: a device range must be one
  // device's memory from end to end; a host range with a pageable end is pageable (the staged
  // path copies any host memory correctly, a direct copy assumes pinned memory throughout).
  pointer_info locate(const char* which, const void* p, std::size_t bytes) {
    const pointer_info first = classifier_.locate(p);
    const pointer_info last = classifier_.locate(static_cast<const char*>(p) + (bytes - 1));
    const bool first_device = first.kind == memory_kind::device;
    const bool last_device = last.kind == memory_kind::device;
    if (first_device != last_device || (first_device && first.device != last.device)) {
      throw usage_error(usage_error::kind::bad_argument,
                        std::string("glake::staged_copier: the ") + which + " range of " + std::to_string(bytes) +
                            " bytes begins in " + describe(first) + " and ends in " + describe(last));
    }
    if (first_device && first.device != ring_.backend().device()) {
      throw usage_error(usage_error::kind::bad_argument,
                        std::string("glake::staged_copier: the ") + which + " is " + describe(first) +
                            "; this copier copies for device " + std::to_string(ring_.backend().device()));
    }
    if (first.kind == memory_kind::pageable || last.kind == memory_kind::pageable) return {memory_kind::pageable, -1};
    return first;
  }

  static std::string describe(pointer_info info) {
    std::string s = to_string(info.kind);
    if (info.kind == memory_kind::device) s += " of device " + std::to_string(info.device);
    return s;
  }

  static void read_exactly(int fd, char* to, std::uint64_t offset, std::size_t bytes) {
    std::size_t done = 0;
    while (done < bytes) {
      const ssize_t got = ::pread(fd, to + done, bytes - done, static_cast<off_t>(offset + done));
      if (got < 0) {
        if (errno == EINTR) continue;
        const int code = errno;
        throw driver_error("pread", code, std::strerror(code));
      }
      if (got == 0) {
        throw usage_error(usage_error::kind::bad_argument,
                          "glake::staged_copier::copy_from_file: the file ends at byte " +
                              std::to_string(offset + done) + ", before the " + std::to_string(bytes - done) +
                              " bytes still to read");
      }
      done += static_cast<std::size_t>(got);
    }
  }

  std::size_t chunk_count(std::size_t bytes) const noexcept {
    return bytes / options_.chunk_bytes + (bytes % options_.chunk_bytes != 0 ? 1 : 0);
  }
  std::size_t chunk_length(std::size_t k, std::size_t bytes) const noexcept {
    return std::min(options_.chunk_bytes, bytes - k * options_.chunk_bytes);
  }

  // Runs work(staging + at, offset + at, n) over the slices of one chunk of `bytes` bytes at
  // `staging`, on the pool (counted in `group`) or, when `here`, on this thread.
  template <class Work>
  void run_slices(detail::task_group& group, char* staging, std::size_t offset, std::size_t bytes, const Work& work,
                  bool here) {
    std::size_t parts = here ? 1 : std::clamp<std::size_t>(bytes / options_.min_slice, 1, pool_.size());
    std::size_t slice = (bytes + parts - 1) / parts;
    slice = std::min(bytes, (slice + 63) / 64 * 64);  // whole cache lines, so slices share none
    for (std::size_t at = 0; at < bytes; at += slice) {
      const std::size_t n = std::min(slice, bytes - at);
      if (here) {
        work(staging + at, offset + at, n);
      } else {
        pool_.submit(group, [&work, staging, offset, at, n] { work(staging + at, offset + at, n); });
      }
    }
  }

  void wait_all() noexcept {
    for (std::size_t i = 0; i < ring_.count(); ++i) (void)pool_.wait(groups_[i]);
  }
  void rethrow_if(std::exception_ptr e) {
    if (e) std::rethrow_exception(e);
  }

  // Host to device: fill(staging, offset, n) puts bytes [offset, offset + n) of the source at
  // `staging`. Chunk k goes through ring slot ring_.slot(k).
  template <class Fill>
  void stage_in(char* dst, std::size_t bytes, stream_ref stream, const Fill& fill) {
    const std::size_t chunks = chunk_count(bytes);
    const std::size_t ring = ring_.count();
    const bool here = bytes <= options_.min_slice || pool_.size() == 0;
    std::size_t filled = 0;  // chunks whose fill was started
    std::size_t sent = 0;    // chunks whose device copy was queued
    try {
      while (sent < chunks) {
        // Start filling every free buffer; block for one only when nothing else is in flight.
        while (filled < chunks && filled - sent < ring) {
          const std::size_t i = ring_.slot(filled);
          if (filled != sent && !ring_.ready(i)) break;
          char* staging = static_cast<char*>(ring_.acquire(i));
          run_slices(groups_[i], staging, filled * options_.chunk_bytes, chunk_length(filled, bytes), fill, here);
          ++filled;
        }
        const std::size_t i = ring_.slot(sent);
        rethrow_if(pool_.wait(groups_[i]));
        ring_.backend().enqueue_copy(dst + sent * options_.chunk_bytes, ring_.data(i), chunk_length(sent, bytes),
                                     stream);
        ring_.release_after(i, stream);
        ++sent;
        chunk_copies_.fetch_add(1, std::memory_order_relaxed);
      }
    } catch (...) {
      wait_all();  // no thread touches the source or a buffer any more
      ring_.advance(filled);
      note_staging();
      throw;
    }
    ring_.advance(chunks);
    note_staging();
  }

  // Device to host: the device copies run ahead into the free buffers; chunk k is drained once
  // the event after its copy completed.
  void stage_out(char* dst, const char* src, std::size_t bytes, stream_ref stream) {
    const std::size_t chunks = chunk_count(bytes);
    const std::size_t ring = ring_.count();
    const bool here = bytes <= options_.min_slice || pool_.size() == 0;
    const auto drain = [dst](void* staging, std::size_t at, std::size_t n) { std::memcpy(dst + at, staging, n); };
    std::size_t sent = 0;     // chunks whose device copy was queued
    std::size_t drained = 0;  // chunks whose drain was started
    try {
      while (drained < chunks) {
        while (sent < chunks && sent - drained < ring) {
          const std::size_t i = ring_.slot(sent);
          if (!pool_.idle(groups_[i])) {  // the chunk before in this buffer is still draining
            if (sent != drained) break;   // drain the next chunk meanwhile
            rethrow_if(pool_.wait(groups_[i]));
          }
          void* staging = ring_.acquire(i);
          ring_.backend().enqueue_copy(staging, src + sent * options_.chunk_bytes, chunk_length(sent, bytes), stream);
          ring_.release_after(i, stream);
          ++sent;
          chunk_copies_.fetch_add(1, std::memory_order_relaxed);
        }
        const std::size_t i = ring_.slot(drained);
        char* staging = static_cast<char*>(ring_.acquire(i));  // waits for its device copy
        run_slices(groups_[i], staging, drained * options_.chunk_bytes, chunk_length(drained, bytes), drain, here);
        ++drained;
      }
      std::exception_ptr first;
      for (std::size_t i = 0; i < ring; ++i) {
        if (std::exception_ptr e = pool_.wait(groups_[i]); e && !first) first = e;
      }
      rethrow_if(first);
    } catch (...) {
      wait_all();
      ring_.advance(sent);
      note_staging();
      throw;
    }
    ring_.advance(chunks);
    note_staging();
  }

  void count_staged(std::size_t bytes) noexcept {
    staged_copies_.fetch_add(1, std::memory_order_relaxed);
    staged_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  }
  void note_staging() noexcept { staging_bytes_.store(ring_.allocated_bytes(), std::memory_order_relaxed); }

  staged_copy_options options_;
  [[no_unique_address]] Classifier classifier_;
  std::mutex mutex_;  ///< one staged copy at a time: the ring and the groups are its
  staging_ring<Backend> ring_;
  std::unique_ptr<detail::task_group[]> groups_;  ///< one per ring slot: the tasks on its buffer
  detail::worker_pool pool_;  ///< last member: its threads stop before the ring goes
  std::atomic<std::uint64_t> direct_copies_{0}, direct_bytes_{0}, staged_copies_{0}, staged_bytes_{0},
      file_reads_{0}, chunk_copies_{0};
  std::atomic<std::size_t> staging_bytes_{0};
};
static_assert(byte_copier<staged_copier<detail::copy_backend_archetype, detail::pointer_classifier_archetype>>);

}  // namespace glake
