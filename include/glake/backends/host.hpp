// A host backend on Linux memfd and mmap, so that stitched blocks are real contiguous bytes
// that tests can write through one mapping and read back through another.
#pragma once

#if !defined(__linux__)
#error "glake/backends/host.hpp needs Linux (memfd_create, mmap with MAP_FIXED)"
#endif

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <utility>

#include <boost/intrusive/set.hpp>

#include "glake/backends/concepts.hpp"
#include "glake/config.hpp"
#include "glake/detail/node_pool.hpp"
#include "glake/errors.hpp"
#include "glake/posix_errors.hpp"

namespace glake {

/// The system calls whose refusals the host backend records (see host_failure).
enum class host_call : std::uint32_t { none, memfd_create, ftruncate, fallocate, mmap, mprotect };

namespace detail {

// Throws usage_error unless granularity is a power of two and a multiple of the page size, the
// conditions under which every granularity-aligned range is also a page-aligned one for mmap.
inline void check_host_granularity(const char* who, std::size_t granularity) {
  const long page = ::sysconf(_SC_PAGESIZE);
  const bool power_of_two = granularity != 0 && (granularity & (granularity - 1)) == 0;
  if (!power_of_two || page <= 0 || granularity % static_cast<std::size_t>(page) != 0) {
    throw usage_error(usage_error::kind::bad_argument,
                      std::string(who) + ": granularity " + std::to_string(granularity) +
                          " is not a power of two multiple of the page size " +
                          std::to_string(page));
  }
}

inline void check_host_size(const char* who, std::size_t bytes, std::size_t granularity) {
  if (bytes == 0 || bytes % granularity != 0) {
    throw usage_error(usage_error::kind::bad_argument,
                      std::string(who) + ": size " + std::to_string(bytes) +
                          " is not a positive multiple of the granularity " +
                          std::to_string(granularity));
  }
}

inline void check_host_address(const char* who, const void* at, std::size_t granularity) {
  if (at == nullptr || reinterpret_cast<std::uintptr_t>(at) % granularity != 0) {
    throw usage_error(usage_error::kind::bad_argument,
                      std::string(who) + ": address " +
                          std::to_string(reinterpret_cast<std::uintptr_t>(at)) +
                          " is null or not aligned to the granularity " +
                          std::to_string(granularity));
  }
}

// The names of the host_call values, in their order.
inline constexpr const char* host_call_names[] = {"", "memfd_create", "ftruncate", "fallocate", "mmap",
                                                  "mprotect"};

// The errno values that mean "the system is out of something", which the backend reports as an
// ordinary failure (empty optional, null, false) rather than as a driver_error.
constexpr bool out_of_resources(int error) noexcept {
  return error == ENOMEM || error == ENOSPC || error == EMFILE || error == ENFILE ||
         error == EAGAIN || error == EFBIG;
}

// Lays a fresh inaccessible, uncommitted anonymous mapping over [at, at + bytes): the state of a
// reserved range that holds no handle.
inline bool restore_reservation(void* at, std::size_t bytes) noexcept {
  return ::mmap(at, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
                -1, 0) != MAP_FAILED;
}

// The number of lines of a /proc file: the process's mappings for /proc/self/maps.
inline std::size_t count_lines(const char* path) noexcept {
  std::FILE* file = std::fopen(path, "re");
  if (file == nullptr) return 0;
  std::size_t lines = 0;
  for (int c; (c = std::getc(file)) != EOF;) lines += c == '\n';
  std::fclose(file);
  return lines;
}

inline long read_long(const char* path) noexcept {
  std::FILE* file = std::fopen(path, "re");
  if (file == nullptr) return -1;
  long value = -1;
  if (std::fscanf(file, "%ld", &value) != 1) value = -1;
  std::fclose(file);
  return value;
}

}  // namespace detail

/// The last system call the host backend saw refused, and its errno: what an out-of-resources
/// failure (an empty optional, null or false) came from. Empty (false) when none was refused.
/// `count` numbers the refusals seen so far, so that a caller comparing two reports can tell a
/// new refusal from an old one with the same call and errno.
struct host_failure {
  host_call call = host_call::none;
  int error = 0;
  std::uint64_t count = 0;

  explicit operator bool() const noexcept { return call != host_call::none; }
  const char* call_name() const noexcept { return detail::host_call_names[static_cast<std::size_t>(call)]; }

  /// "memfd_create: Too many open files (EMFILE)"; empty when none. An ENOMEM from mmap or
  /// mprotect also says how many mappings the process has now against vm.max_map_count, since
  /// the kernel gives the same errno for both limits.
  std::string message() const {
    if (!*this) return {};
    std::string text = std::string(call_name()) + ": " + detail::errno_text(error);
    if (error == ENOMEM && (call == host_call::mmap || call == host_call::mprotect)) {
      const long limit = detail::read_long("/proc/sys/vm/max_map_count");
      if (limit > 0) {
        text += "; the process has " + std::to_string(detail::count_lines("/proc/self/maps")) +
                " mappings, vm.max_map_count is " + std::to_string(limit);
      }
    }
    return text;
  }
};

namespace detail {

// The most recent failure seen by a provider or reserver and its copies, in one atomic word
// (call: 8 bits, errno: 16 bits, which Linux's values fit, count: 40 bits) so that recording
// one is lock-free and noexcept.
class failure_record {
 public:
  void record(host_call call, int error) noexcept {
    std::uint64_t word = word_.load(std::memory_order_relaxed);
    std::uint64_t next;
    do {
      next = std::uint64_t{static_cast<std::uint8_t>(call)} << 56 |
             std::uint64_t{static_cast<std::uint16_t>(error)} << 40 | (((word & count_mask) + 1) & count_mask);
    } while (!word_.compare_exchange_weak(word, next, std::memory_order_relaxed));
  }
  host_failure last() const noexcept {
    const std::uint64_t word = word_.load(std::memory_order_relaxed);
    return {static_cast<host_call>(word >> 56), static_cast<int>(word >> 40 & 0xffffu), word & count_mask};
  }

 private:
  static constexpr std::uint64_t count_mask = (std::uint64_t{1} << 40) - 1;
  std::atomic<std::uint64_t> word_{0};
};

// A free range of the provider's memory file, indexed by offset (neighbours for coalescing) and
// by (size, offset) (best fit, lowest offset among equals).
struct file_offset_tag;
struct file_size_tag;
using file_offset_hook =
    boost::intrusive::set_base_hook<boost::intrusive::tag<file_offset_tag>,
                                    boost::intrusive::link_mode<boost::intrusive::normal_link>>;
using file_size_hook =
    boost::intrusive::set_base_hook<boost::intrusive::tag<file_size_tag>,
                                    boost::intrusive::link_mode<boost::intrusive::normal_link>>;
struct file_range : file_offset_hook, file_size_hook {
  std::size_t offset = 0;
  std::size_t size = 0;
  std::size_t end() const noexcept { return offset + size; }
};

// Offsets of one memory file handed out as [offset, offset + size) slices: best fit among the
// free ranges below the high-water mark `end`, else the bump at `end`; a freed slice merges with
// its free neighbours, and a free range that reaches `end` lowers it instead of being kept.
// O(log n) per take and give, n the free ranges. Free ranges never outnumber live slices (each
// one is followed by a live slice, else it would have lowered `end`), so a give never needs a
// node that take did not reserve: give allocates nothing and cannot fail. Not thread-safe.
class file_offsets {
  struct offset_order {
    bool operator()(const file_range& a, const file_range& b) const noexcept { return a.offset < b.offset; }
    bool operator()(std::size_t a, const file_range& b) const noexcept { return a < b.offset; }
    bool operator()(const file_range& a, std::size_t b) const noexcept { return a.offset < b; }
  };
  struct size_order {
    using key = std::pair<std::size_t, std::size_t>;  // (size, offset)
    static key of(const file_range& r) noexcept { return {r.size, r.offset}; }
    bool operator()(const file_range& a, const file_range& b) const noexcept { return of(a) < of(b); }
    bool operator()(const key& a, const file_range& b) const noexcept { return a < of(b); }
    bool operator()(const file_range& a, const key& b) const noexcept { return of(a) < b; }
  };
  using offset_set = boost::intrusive::set<file_range, boost::intrusive::base_hook<file_offset_hook>,
                                           boost::intrusive::compare<offset_order>>;
  using size_set = boost::intrusive::set<file_range, boost::intrusive::base_hook<file_size_hook>,
                                         boost::intrusive::compare<size_order>>;

 public:
  file_offsets() = default;
  file_offsets(const file_offsets&) = delete;
  file_offsets& operator=(const file_offsets&) = delete;
  ~file_offsets() {
    by_size_.clear();
    by_offset_.clear_and_dispose([this](file_range* r) { nodes_.destroy(r); });
  }

  /// The high-water mark: every offset at or past it is free.
  std::size_t end() const noexcept { return end_; }
  std::size_t free_ranges() const noexcept { return by_offset_.size(); }

  /// Makes sure the next take and every give of the slices live after it allocate nothing.
  /// Throws bad_alloc, leaving everything as it was.
  void reserve_for(std::size_t live_after_take) {
    nodes_.reserve(live_after_take > by_offset_.size() ? live_after_take - by_offset_.size() : 0);
  }

  /// A free range below `end` of at least `bytes`, taken from its low end; nullopt when none.
  std::optional<std::size_t> take_fitting(std::size_t bytes) noexcept {
    auto it = by_size_.lower_bound(size_order::key{bytes, 0}, by_size_.key_comp());
    if (it == by_size_.end()) return std::nullopt;
    file_range& r = *it;
    const std::size_t offset = r.offset;
    by_size_.erase(it);
    if (r.size == bytes) {
      by_offset_.erase(by_offset_.iterator_to(r));
      nodes_.destroy(&r);
    } else {
      r.offset += bytes;  // stays between the same neighbours in by_offset_
      r.size -= bytes;
      by_size_.insert(r);
    }
    return offset;
  }

  /// [end, end + bytes), moving `end` past it.
  std::size_t take_at_end(std::size_t bytes) noexcept {
    const std::size_t offset = end_;
    end_ += bytes;
    return offset;
  }

  /// Returns [offset, offset + bytes), which a take handed out.
  void give(std::size_t offset, std::size_t bytes) noexcept {
    std::size_t start = offset, stop = offset + bytes;
    auto next = by_offset_.lower_bound(offset, by_offset_.key_comp());
    if (next != by_offset_.begin()) {
      auto prev = std::prev(next);
      if (prev->end() == start) {
        start = prev->offset;
        drop(prev);
      }
    }
    if (next != by_offset_.end() && next->offset == stop) {
      stop = next->end();
      drop(next);
    }
    if (stop == end_) {
      end_ = start;
      return;
    }
    file_range* r = nodes_.create();  // reserved by reserve_for: cannot throw
    r->offset = start;
    r->size = stop - start;
    by_offset_.insert(*r);
    by_size_.insert(*r);
  }

 private:
  void drop(offset_set::iterator it) noexcept {
    file_range& r = *it;
    by_size_.erase(by_size_.iterator_to(r));
    by_offset_.erase(it);
    nodes_.destroy(&r);
  }

  node_pool<file_range> nodes_;
  offset_set by_offset_;
  size_set by_size_;
  std::size_t end_ = 0;
};

}  // namespace detail

/// Names one host handle: a slice [offset, offset + bytes) of its provider's memory file `fd`.
/// The size travels with it so that release can return it to the capacity count and try_map can
/// check that the handle is mapped whole.
struct host_handle {
  int fd = -1;
  std::size_t offset = 0;
  std::size_t bytes = 0;
  friend constexpr bool operator==(host_handle, host_handle) noexcept = default;
};

// ---------------------------------------------------------------------------------------------
// host_provider
//
// Handles are slices of one anonymous memory file per provider (memfd_create on the first
// create, shared by copies), so a provider holds one file descriptor however many handles it
// has. The file is sparse: it grows by ftruncate in doubling steps (64 GiB first) that cost
// nothing until pages are touched, and its pages are committed by the kernel on first touch, so
// the optional capacity is what stands in for the GPU's fixed memory size: try_create returns
// empty once the live handle bytes would exceed it. Slice offsets come from a best-fit free list
// with coalescing (detail::file_offsets), O(log n) in the free ranges; release punches the slice
// out of the file (fallocate PUNCH_HOLE), which gives its pages back to the system at once, and
// a later create may reuse the offsets. A new handle therefore reads as zeros.
//
// A create is at most one system call once the file exists (ftruncate, when the file must grow);
// a release is one fallocate. Out-of-resources errno values (ENOMEM, ENOSPC, EMFILE, ENFILE,
// EFBIG, ...) give an empty optional and are kept for last_failure(), which names the call and
// the errno; any other failure throws driver_error naming them. The file never grows past
// RLIMIT_FSIZE (ftruncate past it would raise SIGXFSZ): that gives EFBIG instead.
//
// Unlike CUDA, a handle must be unmapped before its release (the concept's rule, which
// sim_device enforces): release empties the slice under any mapping left, which then reads
// zeros and may alias the next handle given those offsets.
//
// The file is closed when the last copy of the provider goes, unless handles are still live
// (they name it, and may still be mapped). Copies share the file, the free list and the capacity
// count, so a provider copied into several allocators still enforces one limit. Thread safety:
// all members may be called concurrently (the free list is under one mutex, held for O(log n)
// bookkeeping and the rare ftruncate; the capacity count is atomic; release's fallocate runs
// outside the lock).
// ---------------------------------------------------------------------------------------------
class host_provider {
 public:
  using handle_type = host_handle;

  /// capacity 0 means unlimited. Throws usage_error when granularity is not a power of two
  /// multiple of the page size.
  explicit host_provider(std::size_t granularity = 2 * MiB, std::size_t capacity = 0)
      : state_((detail::check_host_granularity("glake::host_provider", granularity),
                std::make_shared<state>(granularity, capacity))) {}

  std::size_t granularity() const noexcept { return state_->granularity; }
  static constexpr memory_location location() noexcept { return memory_location::host; }
  /// 0 when unlimited.
  std::size_t capacity() const noexcept { return state_->capacity; }
  /// Bytes of handles created and not yet released, by this provider and its copies.
  std::size_t created_bytes() const noexcept { return state_->created.load(); }
  /// The last system call refused to this provider or its copies, with its errno: why a
  /// try_create came back empty other than by the capacity. Kept until the next refusal.
  host_failure last_failure() const noexcept { return state_->failures.last(); }
  /// Bytes of memory the provider's file holds now (its allocated blocks, by fstat): what
  /// touching handles committed and release has not yet given back to the system. One fstat.
  std::size_t resident_bytes() const noexcept {
    std::lock_guard lock(state_->mutex);
    struct stat info {};
    if (state_->fd < 0 || ::fstat(state_->fd, &info) != 0) return 0;
    return static_cast<std::size_t>(info.st_blocks) * 512;
  }

  std::optional<handle_type> try_create(std::size_t bytes) {
    detail::check_host_size("glake::host_provider::try_create", bytes, state_->granularity);
    if (!claim(bytes)) return std::nullopt;
    std::optional<std::size_t> offset;
    int fd = -1;
    host_failure failure;
    try {
      std::lock_guard lock(state_->mutex);
      offset = state_->take(bytes, failure);
      fd = state_->fd;
    } catch (...) {
      state_->created -= bytes;
      throw;
    }
    if (!offset) {
      state_->created -= bytes;
      state_->failures.record(failure.call, failure.error);
      if (detail::out_of_resources(failure.error)) return std::nullopt;
      detail::throw_errno(failure.call_name(), failure.error);
    }
    return host_handle{fd, *offset, bytes};
  }

  void release(handle_type handle) noexcept {
    if (handle.fd < 0 || handle.bytes == 0) return;
    // Before the offsets go back: once they are free, a concurrent create may take them.
    if (::fallocate(handle.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(handle.offset),
                    static_cast<off_t>(handle.bytes)) != 0) {
      // The pages stay committed until the offsets are reused; nothing else is wrong.
      state_->failures.record(host_call::fallocate, errno);
    }
    {
      std::lock_guard lock(state_->mutex);
      state_->offsets.give(handle.offset, handle.bytes);
      --state_->live;
    }
    state_->created -= handle.bytes;
  }

  friend bool operator==(const host_provider&, const host_provider&) noexcept = default;

 private:
  struct state {
    state(std::size_t g, std::size_t c) noexcept : granularity(g), capacity(c) {}
    state(const state&) = delete;
    state& operator=(const state&) = delete;
    ~state() {
      if (fd >= 0 && live == 0) ::close(fd);
    }

    // The offset of a new slice of `bytes`, under the mutex; nullopt, with what the system
    // refused in `failure`, when the file cannot be opened or grown. Throws bad_alloc with
    // nothing changed.
    std::optional<std::size_t> take(std::size_t bytes, host_failure& failure) {
      if (fd < 0 && (fd = ::memfd_create("glake", MFD_CLOEXEC)) < 0) {
        failure = {host_call::memfd_create, errno};
        return std::nullopt;
      }
      offsets.reserve_for(live + 1);
      std::optional<std::size_t> offset = offsets.take_fitting(bytes);
      if (!offset) {
        if (bytes > file_size - offsets.end() && !grow(offsets.end() + bytes, failure)) return std::nullopt;
        offset = offsets.take_at_end(bytes);
      }
      ++live;
      return offset;
    }

    // Sets the file's size to at least `needed`: double it, 64 GiB at first, but no further
    // than RLIMIT_FSIZE.
    bool grow(std::size_t needed, host_failure& failure) noexcept {
      constexpr std::size_t first_size = std::size_t{64} << 30;
      std::size_t target = std::max({needed, file_size * 2, first_size});
      std::size_t most = static_cast<std::size_t>(std::numeric_limits<off_t>::max());
      if (rlimit limit{}; ::getrlimit(RLIMIT_FSIZE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
        most = std::min<std::size_t>(most, limit.rlim_cur);
      }
      if (needed < file_size || needed > most) {  // (needed < file_size: offsets wrapped around)
        failure = {host_call::ftruncate, EFBIG};
        return false;
      }
      target = std::min(target, most);
      if (::ftruncate(fd, static_cast<off_t>(target)) != 0) {
        failure = {host_call::ftruncate, errno};
        return false;
      }
      file_size = target;
      return true;
    }

    const std::size_t granularity;
    const std::size_t capacity;
    std::atomic<std::size_t> created{0};
    detail::failure_record failures;
    std::mutex mutex;
    // Under the mutex:
    int fd = -1;                // the memory file, opened by the first create
    std::size_t file_size = 0;  // what it was last ftruncate'd to
    std::size_t live = 0;       // handles created and not released
    detail::file_offsets offsets;
  };

  // Counts the bytes before creating them, so that concurrent creators cannot together pass
  // the capacity.
  bool claim(std::size_t bytes) noexcept {
    std::size_t current = state_->created.load();
    do {
      if (state_->capacity != 0 && bytes > state_->capacity - current) return false;
    } while (!state_->created.compare_exchange_weak(current, current + bytes));
    return true;
  }

  std::shared_ptr<state> state_;
};
static_assert(physical_provider<host_provider>);

// ---------------------------------------------------------------------------------------------
// host_reserver
//
// Reserves with an inaccessible, uncommitted anonymous mapping (over-reserved by one granule and
// trimmed, since mmap aligns only to pages), maps a handle with MAP_FIXED over part of that
// range (MAP_SHARED, at the handle's offset in its provider's file), grants access with
// mprotect, and unmaps by laying a fresh reservation back over the range, so the range stays
// reserved. Each call is O(1) system calls.
//
// Mappings count against vm.max_map_count (65530 by default), for which mmap and mprotect fail
// with ENOMEM (try_map, try_set_access then give false; last_failure() says which limit it
// likely was). The kernel merges a mapping with its neighbour when both map the same file at
// consecutive offsets with the same protection: handles created one after another by one
// provider and mapped side by side in that order (a new segment) cost one mapping in all, while
// a stitched range of scattered handles costs one per handle, plus up to two for the split
// reservation around it. (Measured: 1000 consecutive 2 MiB handles mapped in order add one
// mapping; in reverse order, 1000.)
//
// It checks its arguments (alignment, sizes, null, a handle mapped whole) but keeps no record
// of what is mapped where, so it cannot catch what the simulated backend catches: mapping over
// an existing mapping silently replaces it, and set_access over an unmapped part of a
// reservation makes anonymous memory accessible. Test allocators on sim_device for the rules
// and here for the bytes. Its only state besides the granularity is the last failure, shared by
// copies; thread safety: all members may be called concurrently (the kernel serialises
// address-space changes).
// ---------------------------------------------------------------------------------------------
class host_reserver {
 public:
  using handle_type = host_handle;

  /// Throws usage_error when granularity is not a power of two multiple of the page size.
  explicit host_reserver(std::size_t granularity = 2 * MiB)
      : granularity_(granularity), failures_(std::make_shared<detail::failure_record>()) {
    detail::check_host_granularity("glake::host_reserver", granularity);
  }

  std::size_t granularity() const noexcept { return granularity_; }
  /// The last system call refused to this reserver or its copies, with its errno: why a
  /// try_reserve, try_map or try_set_access failed. Kept until the next refusal.
  host_failure last_failure() const noexcept { return failures_->last(); }

  void* try_reserve(std::size_t bytes) {
    detail::check_host_size("glake::host_reserver::try_reserve", bytes, granularity_);
    if (bytes > SIZE_MAX - granularity_) return nullptr;
    const std::size_t padded = bytes + granularity_;
    void* raw = ::mmap(nullptr, padded, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
    if (raw == MAP_FAILED) {
      const int error = errno;
      failures_->record(host_call::mmap, error);
      if (detail::out_of_resources(error)) return nullptr;
      detail::throw_errno("mmap", error);
    }
    const auto start = reinterpret_cast<std::uintptr_t>(raw);
    const std::uintptr_t aligned = (start + granularity_ - 1) & ~(std::uintptr_t{granularity_} - 1);
    const std::size_t head = aligned - start;
    const std::size_t tail = padded - head - bytes;
    // Trimming only shrinks a mapping we own; should it fail, the slop stays reserved and
    // inaccessible, which wastes address space but breaks nothing.
    if (head != 0) ::munmap(raw, head);
    if (tail != 0) ::munmap(reinterpret_cast<void*>(aligned + bytes), tail);
    return reinterpret_cast<void*>(aligned);
  }

  void free(void* at, std::size_t bytes) noexcept {
    if (at != nullptr && bytes != 0) ::munmap(at, bytes);
  }

  bool try_map(void* at, std::size_t bytes, handle_type handle) {
    check_range("glake::host_reserver::try_map", at, bytes);
    if (handle.fd < 0 || handle.bytes != bytes) {
      throw usage_error(usage_error::kind::bad_argument,
                        "glake::host_reserver::try_map: the handle (fd " +
                            std::to_string(handle.fd) + ", " + std::to_string(handle.bytes) +
                            " bytes) is invalid or not " + std::to_string(bytes) +
                            " bytes (a handle is mapped whole)");
    }
    // PROT_NONE: as with CUDA, a fresh mapping is inaccessible until set_access.
    if (::mmap(at, bytes, PROT_NONE, MAP_SHARED | MAP_FIXED, handle.fd,
               static_cast<off_t>(handle.offset)) == MAP_FAILED) {
      const int error = errno;
      failures_->record(host_call::mmap, error);
      // A failed MAP_FIXED may already have unmapped part of the range; put the reservation
      // back so the caller's rollback finds the range as it left it.
      detail::restore_reservation(at, bytes);
      if (detail::out_of_resources(error)) return false;
      detail::throw_errno("mmap", error);
    }
    return true;
  }

  bool try_set_access(void* at, std::size_t bytes) {
    check_range("glake::host_reserver::try_set_access", at, bytes);
    if (::mprotect(at, bytes, PROT_READ | PROT_WRITE) != 0) {
      // ENOMEM also covers an unmapped range; reporting it as a failure lets the caller roll
      // back either way.
      const int error = errno;
      failures_->record(host_call::mprotect, error);
      if (detail::out_of_resources(error)) return false;
      detail::throw_errno("mprotect", error);
    }
    return true;
  }

  void unmap(void* at, std::size_t bytes) noexcept {
    if (at == nullptr || bytes == 0) return;
    // Should the kernel refuse the replacement, drop the mapping anyway: a hole in the
    // reservation is harmless, a live alias of a handle the caller thinks unmapped is not.
    if (!detail::restore_reservation(at, bytes)) ::munmap(at, bytes);
  }

  /// Reservers of one granularity are interchangeable (the failure record is only a report).
  friend bool operator==(const host_reserver& a, const host_reserver& b) noexcept {
    return a.granularity_ == b.granularity_;
  }

 private:
  void check_range(const char* who, void* at, std::size_t bytes) const {
    detail::check_host_address(who, at, granularity_);
    detail::check_host_size(who, bytes, granularity_);
  }

  std::size_t granularity_;
  std::shared_ptr<detail::failure_record> failures_;
};
static_assert(address_reserver_for<host_reserver, host_provider>);

/// The byte_copier of the host backend: memcpy, at once (host memory has no queued work, so the
/// stream is only a name). A far tier on the host backend is a second host_provider (its own
/// memory file and capacity) whose handles the same host_reserver maps.
struct host_copier {
  static constexpr bool synchronous = true;
  void copy(void* to, const void* from, std::size_t bytes, stream_ref) const noexcept {
    if (bytes != 0) std::memcpy(to, from, bytes);
  }
};
static_assert(byte_copier<host_copier>);

}  // namespace glake
