// glake allocators behind a C allocation interface such as PyTorch's CUDAPluggableAllocator:
// one allocator per device, failures turned into null and one line of log, statistics as a flat
// array, and optional recording of every request in glake-replay's trace format.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "glake/allocators/concepts.hpp"
#include "glake/allocators/device_registry.hpp"
#include "glake/detail/accounting.hpp"
#include "glake/errors.hpp"
#include "glake/statistics.hpp"
#include "glake/stream.hpp"

#if defined(__GNUC__)
#define GLAKE_PRINTF_FORMAT(format_index, first_argument) \
  __attribute__((format(printf, format_index, first_argument)))
#else
#define GLAKE_PRINTF_FORMAT(format_index, first_argument)
#endif

namespace glake {

/// What pluggable_allocator needs of the allocator it serves each device with (see
/// allocators/concepts.hpp): owns (to find a pointer's device and, in unchecked builds, to
/// refuse foreign frees), release_cached (empty_cache) and reset_peaks (reset_peak). When it is
/// a stream_recording_allocator, record_stream is forwarded to it; otherwise record_stream only
/// checks that the pointer is live (such an allocator has no way to defer a free). Every call
/// may come from any thread, so the allocator must lock (e.g. `mutex_lock`).
template <class A>
concept pluggable_allocatable =
    owning_allocator<A> && cache_releasing_allocator<A> && peak_resetting_allocator<A>;

/// Brackets each per-device operation; a backend whose calls need per-thread state (a CUDA
/// context) supplies one that sets it up for `device` and restores it. This one does nothing.
struct no_device_scope {
  explicit no_device_scope(int) noexcept {}
};

/// The names of the values pluggable_allocator::stats writes, in order: the fields of
/// `statistics`, its driver calls by kind, the host nanoseconds spent in them by kind, then the
/// adaptor's own.
inline constexpr std::array<std::string_view, 41> pluggable_stat_names = {
    "active_bytes",        "peak_active_bytes",   "allocated_bytes",     "peak_allocated_bytes",
    "reserved_bytes",      "peak_reserved_bytes", "cached_stitch_bytes", "allocations",
    "deallocations",       "failed_allocations",  "splits",              "merges",
    "segments_created",    "segments_released",   "stitches",            "stitch_cache_hits",
    "stitch_repairs",      "stitch_grows",        "stitch_evictions",    "cross_stream_bytes",
    "device_waits",        "events_recorded",     "event_queries",       "event_ns",
    "driver_create",       "driver_release",      "driver_reserve",      "driver_address_free",
    "driver_map",          "driver_unmap",        "driver_set_access",
    "driver_create_ns",    "driver_release_ns",   "driver_reserve_ns",   "driver_address_free_ns",
    "driver_map_ns",       "driver_unmap_ns",     "driver_set_access_ns",
    "lifetime_peak_active_bytes", "lifetime_peak_reserved_bytes", "errors"};

namespace detail {
// The names after the 24 plain statistics are the driver calls in the order of `driver_call`,
// then the same with "_ns": the time spent in them.
constexpr bool driver_call_names_match() {
  constexpr std::size_t plain = 24;
  for (std::size_t k = 0; k < driver_call_kinds; ++k) {
    const std::string_view kind = to_string(static_cast<driver_call>(k));
    const std::string_view count = pluggable_stat_names[plain + k];
    const std::string_view time = pluggable_stat_names[plain + driver_call_kinds + k];
    if (count.substr(0, 7) != "driver_" || count.substr(7) != kind) return false;
    if (time.substr(0, 7) != "driver_" || time.substr(7, kind.size()) != kind) return false;
    if (time.substr(7 + kind.size()) != "_ns") return false;
  }
  return pluggable_stat_names.size() == plain + 2 * driver_call_kinds + 3;
}
static_assert(driver_call_names_match(), "pluggable_stat_names is out of step with statistics");
}  // namespace detail

/// Writes one device's requests in the line format glake-replay reads (traces/README.md):
/// `a,<id>,<bytes>,<stream>` for each allocation (the bytes asked for), `f,<id>` for each free,
/// and `S,<bytes>` / `U,<bytes>` whenever the allocator's reserved bytes rose or fell, so the
/// S/U lines sum to the allocator's own reserved bytes and their peak is its peak reserved.
/// Streams are numbered in order of first use, the null stream being 0; ids count from 0.
/// Failed requests and frees of unknown pointers become `#` comments, which readers skip.
///
/// Thread safety: every member may be called from any thread (one mutex). Write failures are
/// reported once through `log` and end the recording; nothing here throws.
class trace_recorder {
 public:
  /// Takes ownership of `out` (closed by the destructor). `header` lines are written as comments.
  trace_recorder(std::FILE* out, const std::vector<std::string>& header) : out_(out) {
    std::setvbuf(out_, nullptr, _IOFBF, std::size_t{1} << 20);
    for (const auto& line : header) {
      // Readers take lines of up to 255 characters.
      std::fprintf(out_, "# %.240s\n", line.c_str());
    }
  }
  trace_recorder(const trace_recorder&) = delete;
  trace_recorder& operator=(const trace_recorder&) = delete;
  ~trace_recorder() {
    if (out_ != nullptr) std::fclose(out_);
  }

  /// An allocation of `bytes` at `p` on `stream` succeeded; the allocator now reserves `reserved`.
  void allocated(const void* p, std::size_t bytes, stream_ref stream, std::size_t reserved) noexcept {
    std::lock_guard guard(mutex_);
    if (out_ == nullptr) return;
    try {
      reserved_locked(reserved);
      const std::uint64_t id = next_id_++;
      ids_[reinterpret_cast<std::uintptr_t>(p)] = id;
      std::fprintf(out_, "a,%llu,%zu,%u\n", static_cast<unsigned long long>(id), bytes, number_of(stream));
    } catch (...) {
      fail_locked();
    }
  }

  /// `p` is about to be returned. Call before deallocating, so that no allocation that reuses the
  /// address can be written before this free.
  void freeing(const void* p) noexcept {
    std::lock_guard guard(mutex_);
    if (out_ == nullptr) return;
    const auto it = ids_.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == ids_.end()) {
      std::fprintf(out_, "# free of %p, which this trace did not see allocated\n", p);
      return;
    }
    std::fprintf(out_, "f,%llu\n", static_cast<unsigned long long>(it->second));
    ids_.erase(it);
  }

  /// The allocator now reserves `reserved` bytes (after a free or a release of cached memory).
  void reserved(std::size_t reserved) noexcept {
    std::lock_guard guard(mutex_);
    if (out_ != nullptr) reserved_locked(reserved);
  }

  void failed(std::size_t bytes, stream_ref stream) noexcept {
    std::lock_guard guard(mutex_);
    if (out_ == nullptr) return;
    try {
      std::fprintf(out_, "# failed: %zu bytes on stream %u\n", bytes, number_of(stream));
    } catch (...) {
      fail_locked();
    }
  }

  void flush() noexcept {
    std::lock_guard guard(mutex_);
    if (out_ != nullptr && std::fflush(out_) != 0) fail_locked();
  }

  /// False once recording stopped (a write failed).
  bool recording() const noexcept {
    std::lock_guard guard(mutex_);
    return out_ != nullptr;
  }

 private:
  void reserved_locked(std::size_t now) {
    if (now > reserved_) std::fprintf(out_, "S,%zu\n", now - reserved_);
    if (now < reserved_) std::fprintf(out_, "U,%zu\n", reserved_ - now);
    reserved_ = now;
  }
  std::uint32_t number_of(stream_ref stream) {
    if (stream == default_stream) return 0;
    for (const auto& [known, number] : streams_) {
      if (known == stream) return number;
    }
    const auto number = static_cast<std::uint32_t>(streams_.size() + 1);
    streams_.emplace_back(stream, number);
    return number;
  }
  void fail_locked() noexcept {
    std::fclose(out_);
    out_ = nullptr;
    ids_.clear();
  }

  mutable std::mutex mutex_;
  std::FILE* out_;
  std::uint64_t next_id_ = 0;
  std::size_t reserved_ = 0;
  std::unordered_map<std::uintptr_t, std::uint64_t> ids_;
  std::vector<std::pair<stream_ref, std::uint32_t>> streams_;
};

/// The file a device's trace goes to, from a pattern: `%d` becomes the device, `%p` the process
/// id, `%r` the `rank` given (e.g. torchrun's RANK; "0" when empty) and `%%` a percent sign. A
/// pattern without `%d` names device 0's file; other devices insert `.dev<N>` before a final
/// `.trace` (or append it), so that several devices never share a file.
inline std::string trace_file_name(std::string_view pattern, int device, long pid, std::string_view rank) {
  std::string out;
  bool has_device = false;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] != '%' || i + 1 == pattern.size()) {
      out += pattern[i];
      continue;
    }
    switch (pattern[++i]) {
      case 'd':
        out += std::to_string(device);
        has_device = true;
        break;
      case 'p':
        out += std::to_string(pid);
        break;
      case 'r':
        out += rank.empty() ? std::string_view("0") : rank;
        break;
      case '%':
        out += '%';
        break;
      default:
        out += '%';
        out += pattern[i];
    }
  }
  if (!has_device && device != 0) {
    const std::string tag = ".dev" + std::to_string(device);
    constexpr std::string_view suffix = ".trace";
    if (out.size() > suffix.size() && out.compare(out.size() - suffix.size(), suffix.size(), suffix) == 0) {
      out.insert(out.size() - suffix.size(), tag);
    } else {
      out += tag;
    }
  }
  return out;
}

/// The C face of glake for a framework that loads an allocator as plain functions (PyTorch's
/// CUDAPluggableAllocator): allocate(bytes, device, stream), deallocate(p, bytes, device, stream),
/// record_stream, release_cached, statistics and peak resets, for any device id below
/// MaxDevices. Each device gets its own Allocator from `make(device)` on its first request
/// (device_registry); a device never asked for costs nothing.
///
/// Nothing escapes: `allocate` returns null and writes one line to the log on any failure (out of
/// memory, a driver error, a bad device id, a factory that throws); `allocate_or_throw` writes the
/// same line and rethrows, for callers whose own error path is an exception. `deallocate` of a
/// pointer that is not live on that device logs and counts an error (stat "errors") and changes
/// nothing. Peaks can be reset (reset_peak, the allocator's reset_peaks); the lifetime peaks stay
/// readable (the highest of the peaks before each reset and the current one). When `trace_pattern` is set, each device's requests are written to
/// trace_file_name(pattern, device, pid, rank) by a trace_recorder.
///
/// Complexity: one registry lookup (an atomic load) around each allocator call; with a trace
/// recording, one more locked call to the allocator per allocation and per free.
/// Thread safety: every member may be called from any thread; allocators must lock themselves.
/// Streams: passed through; record_stream goes to the device whose allocator owns the pointer.
/// DeviceScope: constructed around each allocator call with the device id (see no_device_scope).
template <pluggable_allocatable Allocator, class DeviceScope = no_device_scope, std::size_t MaxDevices = 64>
class pluggable_allocator {
 public:
  using factory = std::function<std::unique_ptr<Allocator>(int device)>;

  struct options {
    std::string trace_pattern;         ///< empty: no trace
    long pid = 0;                      ///< for %p in trace_pattern
    std::string rank;                  ///< for %r in trace_pattern
    std::vector<std::string> header;   ///< comment lines at the top of each trace (settings, ...)
    std::FILE* log = stderr;           ///< where failures are reported, one line each
  };

  explicit pluggable_allocator(factory make, options opts = {})
      : options_(std::move(opts)),
        registry_([this, make = std::move(make)](int device) { return make_slot(device, make); }) {}
  pluggable_allocator(const pluggable_allocator&) = delete;
  pluggable_allocator& operator=(const pluggable_allocator&) = delete;

  /// `bytes` on `device` and `stream`, or null (and one line of log) when that fails. Zero bytes
  /// give null without a word.
  void* allocate(std::size_t bytes, int device, stream_ref stream) noexcept {
    try {
      return allocate_or_throw(bytes, device, stream);
    } catch (...) {
      return nullptr;
    }
  }

  /// As allocate, but a failure is rethrown after it is logged: out_of_memory (a std::bad_alloc)
  /// when memory ran out, else the error that stopped it.
  void* allocate_or_throw(std::size_t bytes, int device, stream_ref stream) {
    if (bytes == 0) return nullptr;
    slot* s = nullptr;
    try {
      DeviceScope scope(device);
      s = &registry_.for_device(device);
      void* p = s->allocator->allocate(bytes, stream);
      after_allocate(*s, p, bytes, stream);
      return p;
    } catch (const std::exception& e) {
      log("glake: allocating %zu bytes on device %d, stream %#llx failed: %s", bytes, device,
          static_cast<unsigned long long>(stream.id()), e.what());
      if (s != nullptr && s->trace) s->trace->failed(bytes, stream);
      throw;
    } catch (...) {
      log("glake: allocating %zu bytes on device %d failed: unknown exception", bytes, device);
      throw;
    }
  }

  /// Returns `p` (allocated with `bytes` on `device` and `stream`). Null is ignored. A pointer
  /// that is not live there, or a size that does not match, is logged and counted, not thrown.
  void deallocate(void* p, std::size_t bytes, int device, stream_ref stream) noexcept {
    if (p == nullptr) return;
    try {
      DeviceScope scope(device);
      slot* s = registry_.find(device);
      if (s == nullptr) {
        error("glake: free of %p (%zu bytes) on device %d, which has no glake allocator", p, bytes, device);
        return;
      }
      // Unchecked builds do not catch foreign pointers themselves; ask first.
      if (!GLAKE_CHECKED && !s->allocator->owns(p)) {
        error("glake: free of %p (%zu bytes) on device %d, which is not a live allocation there", p, bytes, device);
        return;
      }
      if (s->trace) s->trace->freeing(p);
      s->allocator->deallocate(p, bytes, stream);
      if (s->trace) s->trace->reserved(s->allocator->reserved_bytes());
    } catch (const std::exception& e) {
      error("glake: free of %p (%zu bytes) on device %d failed: %s", p, bytes, device, e.what());
    } catch (...) {
      error("glake: free of %p on device %d failed: unknown exception", p, device);
    }
  }

  /// The allocation at `p` is also used by work queued on `stream` (PyTorch's record_stream):
  /// forwarded to the owning device's allocator when it is a stream_recording_allocator; for
  /// any other allocator only the pointer is checked.
  void record_stream(void* p, stream_ref stream) noexcept {
    try {
      bool found = false;
      registry_.for_each([&](int device, slot& s) {
        if (found || !s.allocator->owns(p)) return;
        found = true;
        if constexpr (stream_recording_allocator<Allocator>) {
          DeviceScope scope(device);
          s.allocator->record_stream(p, stream);
        }
      });
      if (!found) error("glake: record_stream of %p, which is not a live allocation of any device", p);
    } catch (const std::exception& e) {
      error("glake: record_stream of %p failed: %s", p, e.what());
    }
  }

  /// Gives cached memory back (the allocator's release_cached) on `device`, or on every device
  /// when `device` is negative. Devices without an allocator are left alone.
  void release_cached(int device) noexcept {
    each_device(device, "releasing cached memory", [](slot& s) {
      s.allocator->release_cached();
      if (s.trace) s.trace->reserved(s.allocator->reserved_bytes());
    });
  }

  /// Holds `device`'s physical memory to `bytes` from now on (0: no limit; the allocator's
  /// set_memory_limit), making its allocator if it has none yet, so a limit set before the first
  /// allocation holds from the start. False, logged, when the device id is out of range or the
  /// allocator could not be made.
  bool set_memory_limit(int device, std::size_t bytes) noexcept
    requires memory_limiting_allocator<Allocator>
  {
    try {
      DeviceScope scope(device);
      slot& s = registry_.for_device(device);
      s.allocator->set_memory_limit(bytes);
      if (s.trace) s.trace->reserved(s.allocator->reserved_bytes());
      return true;
    } catch (const std::exception& e) {
      error("glake: setting the memory limit of device %d to %zu bytes failed: %s", device, bytes, e.what());
      return false;
    }
  }

  /// From now on, peaks are measured from the current values (on `device`, or all when negative).
  void reset_peak(int device) noexcept {
    each_device(device, "resetting peaks", [](slot& s) {
      const statistics before = s.allocator->reset_peaks();
      slot::raise(s.lifetime_active, before.peak_active_bytes);
      slot::raise(s.lifetime_reserved, before.peak_reserved_bytes);
    });
  }

  /// Writes up to `capacity` values for `device` in the order of pluggable_stat_names (zeros
  /// when the device has no allocator yet) and returns how many names there are; 0 for a device
  /// id out of range.
  std::size_t stats(int device, std::uint64_t* out, std::size_t capacity) noexcept {
    std::array<std::uint64_t, pluggable_stat_names.size()> v{};
    try {
      slot* s = registry_.find(device);
      if (s != nullptr) {
        DeviceScope scope(device);
        const statistics st = s->allocator->stats();
        std::size_t i = 0;
        for (const std::uint64_t value :
             {std::uint64_t{st.active_bytes}, std::uint64_t{st.peak_active_bytes},
              std::uint64_t{st.allocated_bytes}, std::uint64_t{st.peak_allocated_bytes},
              std::uint64_t{st.reserved_bytes}, std::uint64_t{st.peak_reserved_bytes},
              std::uint64_t{st.cached_stitch_bytes}, st.allocations, st.deallocations, st.failed_allocations,
              st.splits, st.merges, st.segments_created, st.segments_released, st.stitches,
              st.stitch_cache_hits, st.stitch_repairs, st.stitch_grows, st.stitch_evictions, st.cross_stream_bytes,
              st.device_waits, st.events_recorded, st.event_queries, st.event_ns}) {
          v[i++] = value;
        }
        for (const std::uint64_t calls : st.driver_calls.counts) v[i++] = calls;
        for (const std::uint64_t ns : st.driver_time.ns) v[i++] = ns;
        v[i++] = std::max<std::uint64_t>(s->lifetime_active.load(std::memory_order_relaxed), st.peak_active_bytes);
        v[i++] = std::max<std::uint64_t>(s->lifetime_reserved.load(std::memory_order_relaxed), st.peak_reserved_bytes);
      }
    } catch (const usage_error&) {
      return 0;  // device id out of range
    } catch (const std::exception& e) {
      error("glake: reading statistics of device %d failed: %s", device, e.what());
    }
    v[pluggable_stat_names.size() - 1] = errors_.load(std::memory_order_relaxed);
    std::copy_n(v.begin(), std::min(capacity, v.size()), out);
    return v.size();
  }

  /// Writes out whatever the traces hold in their buffers.
  void flush_traces() noexcept {
    registry_.for_each([](int, slot& s) {
      if (s.trace) s.trace->flush();
    });
  }

  /// Failures that were logged and swallowed: bad frees, record_streams, releases, statistics.
  std::uint64_t errors() const noexcept { return errors_.load(std::memory_order_relaxed); }

  /// The allocator of `device` if it was made, else null.
  Allocator* find(int device) const {
    slot* s = registry_.find(device);
    return s != nullptr ? s->allocator.get() : nullptr;
  }

 private:
  struct slot {
    std::unique_ptr<Allocator> allocator;
    std::unique_ptr<trace_recorder> trace;
    // The highest peaks seen before the last reset_peak (the allocator's own restart there).
    std::atomic<std::size_t> lifetime_active{0};
    std::atomic<std::size_t> lifetime_reserved{0};

    static void raise(std::atomic<std::size_t>& peak, std::size_t value) noexcept {
      std::size_t seen = peak.load(std::memory_order_relaxed);
      while (seen < value && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
      }
    }
  };

  std::unique_ptr<slot> make_slot(int device, const factory& make) {
    auto s = std::make_unique<slot>();
    s->allocator = make(device);
    if (s->allocator == nullptr) return nullptr;  // the registry reports it
    if (!options_.trace_pattern.empty()) {
      const std::string path = trace_file_name(options_.trace_pattern, device, options_.pid, options_.rank);
      if (std::FILE* f = std::fopen(path.c_str(), "w")) {
        std::vector<std::string> header = options_.header;
        header.insert(header.begin(), "glake trace of device " + std::to_string(device) + ", process " +
                                          std::to_string(options_.pid));
        s->trace = std::make_unique<trace_recorder>(f, header);
      } else {
        error("glake: cannot open trace file %s for device %d; not recording it", path.c_str(), device);
      }
    }
    return s;
  }

  // The trace, once memory was handed out: failures here must not lose it.
  void after_allocate(slot& s, void* p, std::size_t bytes, stream_ref stream) noexcept {
    try {
      if (s.trace) s.trace->allocated(p, bytes, stream, s.allocator->reserved_bytes());
    } catch (const std::exception& e) {
      error("glake: bookkeeping after allocating %p failed: %s", p, e.what());
    }
  }

  template <class F>
  void each_device(int device, const char* what, F&& f) noexcept {
    const auto one = [&](int d, slot& s) {
      try {
        DeviceScope scope(d);
        f(s);
      } catch (const std::exception& e) {
        error("glake: %s on device %d failed: %s", what, d, e.what());
      }
    };
    try {
      if (device < 0) {
        registry_.for_each(one);
      } else if (slot* s = registry_.find(device)) {
        one(device, *s);
      }
    } catch (const std::exception& e) {
      error("glake: %s on device %d failed: %s", what, device, e.what());
    }
  }

  void vlog(const char* format, std::va_list args) const noexcept {
    if (options_.log == nullptr) return;
    // One line, written with one call, so lines from several threads do not interleave.
    char line[1024];
    const int n = std::vsnprintf(line, sizeof line - 1, format, args);
    if (n < 0) return;
    std::size_t length = std::min(static_cast<std::size_t>(n), sizeof line - 2);
    for (std::size_t i = 0; i < length; ++i) {
      if (line[i] == '\n') line[i] = ' ';
    }
    line[length++] = '\n';
    std::fwrite(line, 1, length, options_.log);
    std::fflush(options_.log);
  }

  GLAKE_PRINTF_FORMAT(2, 3) void log(const char* format, ...) const noexcept {
    std::va_list args;
    va_start(args, format);
    vlog(format, args);
    va_end(args);
  }

  /// Logs and counts a failure that is swallowed.
  GLAKE_PRINTF_FORMAT(2, 3) void error(const char* format, ...) noexcept {
    errors_.fetch_add(1, std::memory_order_relaxed);
    std::va_list args;
    va_start(args, format);
    vlog(format, args);
    va_end(args);
  }

  options options_;
  std::atomic<std::uint64_t> errors_{0};
  device_registry<slot, MaxDevices> registry_;
};

}  // namespace glake
