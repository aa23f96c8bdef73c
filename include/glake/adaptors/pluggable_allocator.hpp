// glake allocators behind a C allocation interface such as PyTorch's CUDAPluggableAllocator:
// one allocator per device, failures turned into null and one line of log, statistics as a flat
// array, private pools for CUDA graphs, and optional recordings: every request in glake-replay's
// trace format, and a bounded memory history for snapshots.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "glake/allocators/concepts.hpp"
#include "glake/allocators/device_registry.hpp"
#include "glake/detail/accounting.hpp"
#include "glake/errors.hpp"
#include "glake/memory_history.hpp"
#include "glake/memory_state.hpp"
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
inline constexpr std::array<std::string_view, 44> pluggable_stat_names = {
    "active_bytes",        "peak_active_bytes",   "allocated_bytes",     "peak_allocated_bytes",
    "reserved_bytes",      "peak_reserved_bytes", "cached_stitch_bytes", "offloaded_bytes",     "allocations",
    "deallocations",       "failed_allocations",  "splits",              "merges",
    "segments_created",    "segments_released",   "stitches",            "stitch_cache_hits",
    "stitch_repairs",      "stitch_grows",        "stitch_evictions",    "cross_stream_bytes",
    "device_waits",        "events_recorded",     "event_queries",       "event_ns",
    "spare_bytes",         "recycled_handles",
    "driver_create",       "driver_release",      "driver_reserve",      "driver_address_free",
    "driver_map",          "driver_unmap",        "driver_set_access",
    "driver_create_ns",    "driver_release_ns",   "driver_reserve_ns",   "driver_address_free_ns",
    "driver_map_ns",       "driver_unmap_ns",     "driver_set_access_ns",
    "lifetime_peak_active_bytes", "lifetime_peak_reserved_bytes", "errors"};

namespace detail {
// The names after the 27 plain statistics are the driver calls in the order of `driver_call`,
// then the same with "_ns": the time spent in them.
constexpr bool driver_call_names_match() {
  constexpr std::size_t plain = 27;
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

namespace detail {
/// Adds only the counts (calls, events, driver calls and their time), which never go down.
inline void accumulate_counts(statistics& into, const statistics& s) noexcept {
  for (auto [to, from] : {std::pair{&into.allocations, s.allocations}, {&into.deallocations, s.deallocations},
                          {&into.failed_allocations, s.failed_allocations}, {&into.splits, s.splits},
                          {&into.merges, s.merges}, {&into.segments_created, s.segments_created},
                          {&into.segments_released, s.segments_released}, {&into.stitches, s.stitches},
                          {&into.stitch_cache_hits, s.stitch_cache_hits}, {&into.stitch_repairs, s.stitch_repairs},
                          {&into.stitch_grows, s.stitch_grows}, {&into.stitch_evictions, s.stitch_evictions},
                          {&into.cross_stream_bytes, s.cross_stream_bytes}, {&into.device_waits, s.device_waits},
                          {&into.events_recorded, s.events_recorded}, {&into.event_queries, s.event_queries},
                          {&into.event_ns, s.event_ns}, {&into.recycled_handles, s.recycled_handles}}) {
    *to += from;
  }
  for (std::size_t k = 0; k < driver_call_kinds; ++k) {
    into.driver_calls.counts[k] += s.driver_calls.counts[k];
    into.driver_time.ns[k] += s.driver_time.ns[k];
  }
}
/// Adds `s`'s values to `into`, peaks included: the sum of several allocators' peaks bounds
/// their combined peak from above (it is exact when the peaks coincide).
inline void accumulate(statistics& into, const statistics& s) noexcept {
  into.active_bytes += s.active_bytes;
  into.peak_active_bytes += s.peak_active_bytes;
  into.allocated_bytes += s.allocated_bytes;
  into.peak_allocated_bytes += s.peak_allocated_bytes;
  into.reserved_bytes += s.reserved_bytes;
  into.peak_reserved_bytes += s.peak_reserved_bytes;
  into.cached_stitch_bytes += s.cached_stitch_bytes;
  into.offloaded_bytes += s.offloaded_bytes;
  into.spare_bytes += s.spare_bytes;
  accumulate_counts(into, s);
}
}  // namespace detail

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
/// readable (the highest of the peaks before each reset and the current one). When
/// `trace_pattern` is set, each device's requests are written to trace_file_name(pattern,
/// device, pid, rank) by a trace_recorder (requests served by private pools are left out).
///
/// Private pools (CUDA graphs; for a memory_retaining_allocator): between
/// begin_allocate_to_pool(device, pool, filter) and end_allocate_to_pool(device, pool), requests
/// on `device` whose stream passes `filter` are served by the pool's own Allocator, made by the
/// same factory and told to retain its memory (every address it handed out keeps its memory,
/// which the graph's replays use). A block of a pool goes back to that pool only, whenever it is
/// freed: the pool's free memory serves the pool's later requests (a later capture into it) and
/// nothing else. release_pool drops one use of the pool (begin adds one, as PyTorch's
/// use_count); a pool without uses gives its free memory back to the backend at once and the
/// rest as its blocks are freed (PyTorch waits for the next empty_cache). A pool out of memory has the
/// general allocator's cached memory released and tries once more. Pools are found by a map
/// from pointer to pool: while a device has pools, each free and record_stream there takes one
/// mutex and one hash lookup more; without pools, one atomic load. Statistics are the sums over
/// the general allocator and the pools (peaks summed: an upper bound of the combined peak);
/// the counts of pools given back stay in them. The memory limit applies to the general
/// allocator only.
///
/// Memory history (record_history; off by default, then one atomic load per call): per device,
/// the newest `max_entries` of alloc, free_requested and oom (seen here), and, for an
/// observable_allocator, its segment_alloc / segment_free / segment_map / segment_unmap and
/// free_completed (when the memory is reusable, which for a record_stream'd free is later than
/// the call). For an allocator that is not observable, free_completed follows free_requested at
/// once and there are no segment entries. visit_state shows a device's allocators (general and
/// pools) to a visitor, for snapshots.
///
/// Complexity: one registry lookup (an atomic load) around each allocator call; with a trace
/// recording, one more locked call to the allocator per allocation and per free; with the
/// history recording, one more per free (owns) and a locked ring write per entry.
/// Thread safety: every member may be called from any thread; allocators must lock themselves.
/// Streams: passed through; record_stream goes to the allocator that owns the pointer.
/// DeviceScope: constructed around each allocator call with the device id (see no_device_scope).
template <pluggable_allocatable Allocator, class DeviceScope = no_device_scope, std::size_t MaxDevices = 64>
class pluggable_allocator {
 public:
  using factory = std::function<std::unique_ptr<Allocator>(int device)>;
  /// A private pool's name (PyTorch's MempoolId_t).
  using pool_id = std::pair<std::uint64_t, std::uint64_t>;
  /// Which streams' requests a capture sends to its pool.
  using stream_filter = std::function<bool(stream_ref)>;

  struct options {
    std::string trace_pattern;         ///< empty: no trace
    long pid = 0;                      ///< for %p in trace_pattern
    std::string rank;                  ///< for %r in trace_pattern
    std::vector<std::string> header;   ///< comment lines at the top of each trace (settings, ...)
    std::FILE* log = stderr;           ///< where failures are reported, one line each
  };

  explicit pluggable_allocator(factory make, options opts = {})
      : options_(std::move(opts)),
        make_(std::move(make)),
        registry_([this](int device) { return make_slot(device); }) {}
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
      if (s->captures.load(std::memory_order_acquire) != 0) {
        if (void* p = allocate_in_pool(*s, bytes, stream)) {
          note(*s, memory_action::alloc, p, bytes, stream);
          return p;
        }
      }
      void* p = s->allocator->allocate(bytes, stream);
      after_allocate(*s, p, bytes, stream);
      return p;
    } catch (const std::exception& e) {
      log("glake: allocating %zu bytes on device %d, stream %#llx failed: %s", bytes, device,
          static_cast<unsigned long long>(stream.id()), e.what());
      if (s != nullptr && s->trace) s->trace->failed(bytes, stream);
      if (s != nullptr && dynamic_cast<const std::bad_alloc*>(&e) != nullptr) {
        note(*s, memory_action::oom, nullptr, bytes, stream);
      }
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
      if (s->pools.load(std::memory_order_acquire) != 0 && free_in_pool(*s, p, bytes, stream)) return;
      const bool history = history_on_.load(std::memory_order_relaxed);
      // Unchecked builds do not catch foreign pointers themselves; ask first. So does the
      // history, which must not show a free that did not happen.
      if ((!GLAKE_CHECKED || history) && !s->allocator->owns(p)) {
        error("glake: free of %p (%zu bytes) on device %d, which is not a live allocation there", p, bytes, device);
        return;
      }
      if (s->trace) s->trace->freeing(p);
      if (history) note_free_requested(*s, p, bytes, stream);
      s->allocator->deallocate(p, bytes, stream);
      if (s->trace) s->trace->reserved(s->allocator->reserved_bytes());
    } catch (const std::exception& e) {
      error("glake: free of %p (%zu bytes) on device %d failed: %s", p, bytes, device, e.what());
    } catch (...) {
      error("glake: free of %p on device %d failed: unknown exception", p, device);
    }
  }

  /// The allocation at `p` is also used by work queued on `stream` (PyTorch's record_stream):
  /// forwarded to the owning allocator (a pool's or a device's) when it is a
  /// stream_recording_allocator; for any other allocator only the pointer is checked.
  void record_stream(void* p, stream_ref stream) noexcept {
    try {
      bool found = false;
      registry_.for_each([&](int device, slot& s) {
        if (found) return;
        Allocator* owner = nullptr;
        std::unique_lock<std::mutex> pools_lock;
        if (s.pools.load(std::memory_order_acquire) != 0) {
          pools_lock = std::unique_lock(s.pools_mutex);
          if (const auto it = s.pool_of.find(reinterpret_cast<std::uintptr_t>(p)); it != s.pool_of.end()) {
            owner = it->second->allocator.get();
          }
        }
        if (owner == nullptr && s.allocator->owns(p)) owner = s.allocator.get();
        if (owner == nullptr) return;
        found = true;
        if constexpr (stream_recording_allocator<Allocator>) {
          DeviceScope scope(device);
          owner->record_stream(p, stream);
        }
      });
      if (!found) error("glake: record_stream of %p, which is not a live allocation of any device", p);
    } catch (const std::exception& e) {
      error("glake: record_stream of %p failed: %s", p, e.what());
    }
  }

  /// Moves the live allocation at `p` (of any device's allocator) to far memory, or back, ordered
  /// on `stream` (the allocator's offload / prefetch), in the device's context. Throws what they
  /// throw, and usage_error for a pointer no device's allocator holds live, or one in a private
  /// pool (a CUDA graph's memory, whose mappings must not change).
  /// With move_completion::deferred (a deferring_offloading_allocator), as the allocator's: the
  /// remap comes once the copies are done; complete_move(p) finishes it before p is used. With
  /// `copies`, the copies run on that stream after the work queued on `stream` (the allocator's
  /// four-argument moves).
  void offload(void* p, stream_ref stream, move_completion when = move_completion::on_return)
    requires offloading_allocator<Allocator>
  {
    move_allocation(p, stream, true, when, stream);
  }
  void prefetch(void* p, stream_ref stream, move_completion when = move_completion::on_return)
    requires offloading_allocator<Allocator>
  {
    move_allocation(p, stream, false, when, stream);
  }
  void offload(void* p, stream_ref stream, move_completion when, stream_ref copies)
    requires deferring_offloading_allocator<Allocator>
  {
    move_allocation(p, stream, true, when, copies);
  }
  void prefetch(void* p, stream_ref stream, move_completion when, stream_ref copies)
    requires deferring_offloading_allocator<Allocator>
  {
    move_allocation(p, stream, false, when, copies);
  }
  /// Marks the live allocation at `p` as not written while on the device, or unmarks it (the
  /// allocator's keep_far_copy), in its device's context. usage_error for a pointer no device's
  /// allocator holds live.
  void keep_far_copy(const void* p, bool keep)
    requires far_copy_keeping_allocator<Allocator>
  {
    bool found = false;
    registry_.for_each([&](int device, slot& s) {
      if (found || !s.allocator->owns(p)) return;
      found = true;
      DeviceScope scope(device);
      s.allocator->keep_far_copy(p, keep);
    });
    if (!found) {
      throw usage_error(usage_error::kind::foreign_pointer,
                        "glake: keep_far_copy of " + detail::pointer_text(p) + ": not a live allocation of any device");
    }
  }
  /// Far memory the clean copies of marked allocations hold, over every device (the
  /// allocators' far_copy_bytes).
  std::size_t far_copy_bytes()
    requires far_copy_keeping_allocator<Allocator>
  {
    std::size_t bytes = 0;
    registry_.for_each([&](int, slot& s) { bytes += s.allocator->far_copy_bytes(); });
    return bytes;
  }
  /// Completes the deferred move of the allocation at `p` (the allocator's complete_move),
  /// waiting for its copies; nothing for a pointer no device's allocator holds live.
  void complete_move(const void* p)
    requires deferring_offloading_allocator<Allocator>
  {
    registry_.for_each([&](int device, slot& s) {
      if (!s.allocator->owns(p)) return;
      DeviceScope scope(device);
      s.allocator->complete_move(p);
    });
  }
  /// Work queued on `stream` from now on may use the allocation at `p` (the allocator's
  /// ready_on; complete_move where it has none); nothing for a pointer no device's allocator
  /// holds live.
  void ready_on(const void* p, stream_ref stream)
    requires deferring_offloading_allocator<Allocator>
  {
    registry_.for_each([&](int device, slot& s) {
      if (!s.allocator->owns(p)) return;
      DeviceScope scope(device);
      if constexpr (requires(Allocator& a) { a.ready_on(p, stream); }) {
        s.allocator->ready_on(p, stream);
      } else {
        s.allocator->complete_move(p);
      }
    });
  }
  /// The bytes offload(p) would move now (the allocator's movable_bytes; 0 for a pointer no
  /// device's allocator holds live, or one in a private pool).
  std::size_t movable_bytes(const void* p)
    requires offloading_allocator<Allocator> && requires(Allocator& a, const void* q) { a.movable_bytes(q); }
  {
    std::size_t bytes = 0;
    registry_.for_each([&](int device, slot& s) {
      if (bytes != 0 || !s.allocator->owns(p)) return;
      DeviceScope scope(device);
      bytes = s.allocator->movable_bytes(p);
    });
    return bytes;
  }

  /// Where the live allocation at `p` is; empty for a pointer no device's allocator holds live.
  std::optional<residence> residence_of(const void* p)
    requires offloading_allocator<Allocator>
  {
    std::optional<residence> where;
    registry_.for_each([&](int device, slot& s) {
      if (where || !s.allocator->owns(p)) return;
      DeviceScope scope(device);
      where = s.allocator->residence_of(p);
    });
    return where;
  }

  /// Gives cached memory back (the allocator's release_cached) on `device`, or on every device
  /// when `device` is negative. Devices without an allocator are left alone, and so are private
  /// pools: they retain their memory while used, and give it all back once released and empty.
  void release_cached(int device) noexcept {
    each_device(device, "releasing cached memory", [](slot& s) {
      s.allocator->release_cached();
      if (s.trace) s.trace->reserved(s.allocator->reserved_bytes());
    });
  }

  /// Gives back at least `bytes` of `device`'s cached memory where it has that much (the
  /// allocator's release_cached(bytes)); returns how much went back, 0 for a device without an
  /// allocator or on failure (logged).
  std::size_t release_cached(int device, std::size_t bytes) noexcept
    requires partly_cache_releasing_allocator<Allocator>
  {
    try {
      DeviceScope scope(device);
      slot* s = registry_.find(device);
      if (s == nullptr) return 0;
      const std::size_t released = s->allocator->release_cached(bytes);
      if (s->trace) s->trace->reserved(s->allocator->reserved_bytes());
      return released;
    } catch (const std::exception& e) {
      error("glake: releasing %zu cached bytes on device %d failed: %s", bytes, device, e.what());
      return 0;
    }
  }

  /// As release_cached(device, bytes) without waiting for the device (the allocator's
  /// release_completed): what queued work may still use stays.
  std::size_t release_completed(int device, std::size_t bytes) noexcept
    requires completion_releasing_allocator<Allocator>
  {
    try {
      DeviceScope scope(device);
      slot* s = registry_.find(device);
      if (s == nullptr) return 0;
      const std::size_t released = s->allocator->release_completed(bytes);
      if (s->trace) s->trace->reserved(s->allocator->reserved_bytes());
      return released;
    } catch (const std::exception& e) {
      error("glake: releasing %zu completed cached bytes on device %d failed: %s", bytes, device, e.what());
      return 0;
    }
  }

  /// Holds `device`'s physical memory to `bytes` from now on (0: no limit; the allocator's
  /// set_memory_limit), making its allocator if it has none yet, so a limit set before the first
  /// allocation holds from the start. False, logged, when the device id is out of range or the
  /// allocator could not be made. Private pools are not limited.
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
      statistics before = s.allocator->reset_peaks();
      if (s.pools.load(std::memory_order_acquire) != 0) {
        std::lock_guard guard(s.pools_mutex);
        for (const auto& pool : s.pool_list) detail::accumulate(before, pool->allocator->reset_peaks());
      }
      slot::raise(s.lifetime_active, before.peak_active_bytes);
      slot::raise(s.lifetime_reserved, before.peak_reserved_bytes);
    });
  }

  /// Writes up to `capacity` values for `device` in the order of pluggable_stat_names (zeros
  /// when the device has no allocator yet) and returns how many names there are; 0 for a device
  /// id out of range. The values are the sums over the general allocator and the device's
  /// private pools (see the class comment).
  std::size_t stats(int device, std::uint64_t* out, std::size_t capacity) noexcept {
    std::array<std::uint64_t, pluggable_stat_names.size()> v{};
    try {
      slot* s = registry_.find(device);
      if (s != nullptr) {
        DeviceScope scope(device);
        const statistics st = combined_stats(*s);
        std::size_t i = 0;
        for (const std::uint64_t value :
             {std::uint64_t{st.active_bytes}, std::uint64_t{st.peak_active_bytes},
              std::uint64_t{st.allocated_bytes}, std::uint64_t{st.peak_allocated_bytes},
              std::uint64_t{st.reserved_bytes}, std::uint64_t{st.peak_reserved_bytes},
              std::uint64_t{st.cached_stitch_bytes}, std::uint64_t{st.offloaded_bytes}, st.allocations,
              st.deallocations, st.failed_allocations,
              st.splits, st.merges, st.segments_created, st.segments_released, st.stitches,
              st.stitch_cache_hits, st.stitch_repairs, st.stitch_grows, st.stitch_evictions, st.cross_stream_bytes,
              st.device_waits, st.events_recorded, st.event_queries, st.event_ns,
              std::uint64_t{st.spare_bytes}, st.recycled_handles}) {
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

  // ------------------------------------------------------------------ private pools

  /// From now on, until end_allocate_to_pool(device, pool), requests on `device` whose stream
  /// passes `filter` are served by private pool `pool` (made now if it does not exist; one more
  /// use otherwise). PyTorch's beginAllocateToPool. False, logged, when the device id is out of
  /// range, the pool's allocator cannot be made, or a capture into `pool` is already under way.
  bool begin_allocate_to_pool(int device, pool_id pool, stream_filter filter) noexcept
    requires memory_retaining_allocator<Allocator>
  {
    try {
      DeviceScope scope(device);
      slot& s = registry_.for_device(device);
      std::lock_guard guard(s.pools_mutex);
      for (const capture& c : s.capture_list) {
        if (c.pool == pool) {
          error("glake: device %d is already allocating to pool (%llu, %llu)", device,
                static_cast<unsigned long long>(pool.first), static_cast<unsigned long long>(pool.second));
          return false;
        }
      }
      private_pool* p = find_pool(s, pool);
      if (p == nullptr) {
        auto made = std::make_unique<private_pool>();
        made->id = pool;
        made->allocator = make_(device);
        if (made->allocator == nullptr) throw std::runtime_error("the allocator factory returned null");
        made->allocator->retain_memory(true);
        if (history_on_.load(std::memory_order_relaxed)) observe(*made->allocator, s, true);
        s.pool_list.reserve(s.pool_list.size() + 1);
        p = s.pool_list.emplace_back(std::move(made)).get();
        s.pools.store(s.pool_list.size(), std::memory_order_release);
        s.had_pools.store(true, std::memory_order_release);
      } else if (p->uses == 0) {
        // Released with live blocks, it stopped retaining its memory (release_unused); a new
        // capture into it needs every address kept again.
        p->allocator->retain_memory(true);
      }
      s.capture_list.reserve(s.capture_list.size() + 1);
      ++p->uses;
      s.capture_list.push_back(capture{pool, std::move(filter)});
      s.captures.store(s.capture_list.size(), std::memory_order_release);
      return true;
    } catch (const std::exception& e) {
      error("glake: beginning to allocate to pool (%llu, %llu) on device %d failed: %s",
            static_cast<unsigned long long>(pool.first), static_cast<unsigned long long>(pool.second), device,
            e.what());
      return false;
    }
  }

  /// Requests stop going to `pool` (PyTorch's endAllocateToPool); its blocks still return to it.
  void end_allocate_to_pool(int device, pool_id pool) noexcept {
    with_pools(device, "ending allocation to a pool", [&](slot& s) {
      std::erase_if(s.capture_list, [&](const capture& c) { return c.pool == pool; });
      s.captures.store(s.capture_list.size(), std::memory_order_release);
    });
  }

  /// One use of `pool` ends (PyTorch's releasePool, when a graph is reset or destroyed). Once
  /// no use is left, its memory goes back to the backend as soon as it has no live block.
  void release_pool(int device, pool_id pool) noexcept {
    with_pools(device, "releasing a pool", [&](slot& s) {
      private_pool* p = find_pool(s, pool);
      if (p == nullptr || p->uses == 0) {
        error("glake: release of pool (%llu, %llu) on device %d, which is not in use",
              static_cast<unsigned long long>(pool.first), static_cast<unsigned long long>(pool.second), device);
        return;
      }
      if (--p->uses != 0) return;
      if (p->live == 0) return retire(s, p);
      // Blocks still live (a library's workspace allocated during the capture, a tensor the user
      // kept): what is free goes back now, the rest as it is freed.
      release_unused(s, p);
    });
  }

  /// How many private pools `device` has now (released ones with live blocks included).
  std::size_t pool_count(int device) const noexcept {
    slot* s = registry_.find(device);
    return s == nullptr ? 0 : s->pools.load(std::memory_order_acquire);
  }

  /// The statistics of `device`'s private pool `pool`, if it exists.
  std::optional<statistics> pool_stats(int device, pool_id pool) const {
    slot* s = registry_.find(device);
    if (s == nullptr) return std::nullopt;
    std::lock_guard guard(s->pools_mutex);
    const private_pool* p = find_pool(*s, pool);
    if (p == nullptr) return std::nullopt;
    return p->allocator->stats();
  }

  // ------------------------------------------------------------------ memory history, state

  /// Starts (every device's history emptied, at most `max_entries` kept each) or stops recording
  /// the memory history (entries kept until it starts again). False, logged, when the rings
  /// cannot be allocated (recording is then off).
  bool record_history(bool enabled, std::size_t max_entries) noexcept {
    std::lock_guard guard(history_mutex_);
    try {
      if (enabled) {
        history_capacity_ = max_entries;
        registry_.for_each([&](int, slot& s) { s.history.reset(max_entries); });
      }
      history_on_.store(enabled, std::memory_order_relaxed);
      registry_.for_each([&](int device, slot& s) {
        DeviceScope scope(device);
        observe_all(s, enabled);
      });
      return true;
    } catch (const std::exception& e) {
      history_on_.store(false, std::memory_order_relaxed);
      error("glake: starting the memory history failed: %s", e.what());
      return false;
    }
  }
  bool recording_history() const noexcept { return history_on_.load(std::memory_order_relaxed); }

  /// `device`'s history, oldest first (empty when it has no allocator).
  std::vector<history_entry> history(int device) const {
    slot* s = registry_.find(device);
    return s == nullptr ? std::vector<history_entry>{} : s->history.entries();
  }

  /// Shows `device`'s allocators to `v`: v.allocator(pool) (pool_id{0, 0} for the general
  /// allocator), then that allocator's visit_state(v); pools follow the general allocator. False
  /// when the device has no allocator. The pools' list is locked throughout.
  template <class Visitor>
  bool visit_state(int device, Visitor& v) const
    requires snapshotting_allocator<Allocator>
  {
    slot* s = registry_.find(device);
    if (s == nullptr) return false;
    DeviceScope scope(device);
    v.allocator(pool_id{0, 0});
    s->allocator->visit_state(v);
    if (s->pools.load(std::memory_order_acquire) != 0) {
      std::lock_guard guard(s->pools_mutex);
      for (const auto& pool : s->pool_list) {
        v.allocator(pool->id);
        pool->allocator->visit_state(v);
      }
    }
    return true;
  }

  /// Writes out whatever the traces hold in their buffers.
  void flush_traces() noexcept {
    registry_.for_each([](int, slot& s) {
      if (s.trace) s.trace->flush();
    });
  }

  /// Failures that were logged and swallowed: bad frees, record_streams, releases, statistics.
  std::uint64_t errors() const noexcept { return errors_.load(std::memory_order_relaxed); }

  /// The general allocator of `device` if it was made, else null.
  Allocator* find(int device) const {
    slot* s = registry_.find(device);
    return s != nullptr ? s->allocator.get() : nullptr;
  }

 private:
  void move_allocation(void* p, stream_ref stream, bool to_far, move_completion when, stream_ref copies) {
    bool found = false;
    registry_.for_each([&](int device, slot& s) {
      if (found) return;
      if (s.pools.load(std::memory_order_acquire) != 0) {
        std::lock_guard pools_lock(s.pools_mutex);
        if (s.pool_of.contains(reinterpret_cast<std::uintptr_t>(p))) {
          throw usage_error(usage_error::kind::bad_argument,
                            "glake: " + std::string(to_far ? "offload" : "prefetch") + " of " +
                                detail::pointer_text(p) +
                                ": it is in a CUDA graph's private pool, whose mappings must not change");
        }
      }
      if (!s.allocator->owns(p)) return;
      found = true;
      DeviceScope scope(device);
      if constexpr (deferring_offloading_allocator<Allocator>) {
        if (to_far) {
          s.allocator->offload(p, stream, when, copies);
        } else {
          s.allocator->prefetch(p, stream, when, copies);
        }
      } else {
        (void)when;  // completes on return
        (void)copies;
        if (to_far) {
          s.allocator->offload(p, stream);
        } else {
          s.allocator->prefetch(p, stream);
        }
      }
      if (s.trace) s.trace->reserved(s.allocator->reserved_bytes());
    });
    if (!found) {
      throw usage_error(usage_error::kind::foreign_pointer,
                        "glake: " + std::string(to_far ? "offload" : "prefetch") + " of " + detail::pointer_text(p) +
                            ": not a live allocation of glake's allocator");
    }
  }

  struct private_pool {
    pool_id id{};
    std::unique_ptr<Allocator> allocator;
    std::size_t live = 0;  ///< its blocks not yet freed
    std::size_t uses = 0;  ///< captures begun into it minus releases
  };
  struct capture {
    pool_id pool;
    stream_filter filter;
  };

  struct slot {
    int device = 0;
    std::unique_ptr<Allocator> allocator;
    std::unique_ptr<trace_recorder> trace;
    memory_history history;
    // The highest peaks seen before the last reset_peak (the allocator's own restart there).
    std::atomic<std::size_t> lifetime_active{0};
    std::atomic<std::size_t> lifetime_reserved{0};
    // Private pools: the lists under the mutex; their sizes readable without it.
    mutable std::mutex pools_mutex;
    std::vector<std::unique_ptr<private_pool>> pool_list;
    std::vector<capture> capture_list;
    std::unordered_map<std::uintptr_t, private_pool*> pool_of;  // live blocks of pools
    statistics retired;  // the counts of pools given back
    std::atomic<std::size_t> pools{0};
    std::atomic<std::size_t> captures{0};
    std::atomic<bool> had_pools{false};  // pools or their retired counts to add to statistics

    static void raise(std::atomic<std::size_t>& peak, std::size_t value) noexcept {
      std::size_t seen = peak.load(std::memory_order_relaxed);
      while (seen < value && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
      }
    }
  };

  std::unique_ptr<slot> make_slot(int device) {
    auto s = std::make_unique<slot>();
    s->device = device;
    s->allocator = make_(device);
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
    std::lock_guard guard(history_mutex_);
    if (history_on_.load(std::memory_order_relaxed)) {
      s->history.reset(history_capacity_);
      observe(*s->allocator, *s, true);
    }
    return s;
  }

  // ------------------------------------------------------------------ pools
  static private_pool* find_pool(const slot& s, pool_id id) noexcept {
    for (const auto& p : s.pool_list) {
      if (p->id == id) return p.get();
    }
    return nullptr;
  }

  // Serves the request from the pool of the first capture whose filter takes its stream; null
  // when none does. Throws out_of_memory when that pool cannot serve it even after the general
  // allocator released its cached memory.
  void* allocate_in_pool(slot& s, std::size_t bytes, stream_ref stream) {
    std::lock_guard guard(s.pools_mutex);
    private_pool* pool = nullptr;
    for (const capture& c : s.capture_list) {
      if (c.filter && c.filter(stream)) {
        pool = find_pool(s, c.pool);
        break;
      }
    }
    if (pool == nullptr) return nullptr;
    s.pool_of.reserve(s.pool_of.size() + 1);  // so that recording it cannot fail
    void* p = pool->allocator->try_allocate(bytes, stream);
    if (p == nullptr) {
      s.allocator->release_cached();  // the general allocator's cache may be what is missing
      p = pool->allocator->allocate(bytes, stream);
    }
    try {
      s.pool_of.emplace(reinterpret_cast<std::uintptr_t>(p), pool);
    } catch (...) {
      pool->allocator->deallocate(p, bytes, stream);
      throw;
    }
    ++pool->live;
    return p;
  }

  // Frees `p` into its pool if a pool holds it (true), and gives a released pool's memory back
  // with its last block.
  bool free_in_pool(slot& s, void* p, std::size_t bytes, stream_ref stream) {
    std::lock_guard guard(s.pools_mutex);
    const auto it = s.pool_of.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == s.pool_of.end()) return false;
    private_pool* pool = it->second;
    if (history_on_.load(std::memory_order_relaxed)) note_free_requested(s, p, bytes, stream);
    pool->allocator->deallocate(p, bytes, stream);
    s.pool_of.erase(it);
    --pool->live;
    if (pool->uses == 0) {
      if (pool->live == 0) {
        retire(s, pool);
      } else {
        release_unused(s, pool);
      }
    }
    return true;
  }

  // A released pool with live blocks keeps only what they need: it stops retaining memory and
  // gives back its free segments (PyTorch's empty_cache does the same for a released pool).
  void release_unused(slot& s, private_pool* pool) noexcept {
    try {
      if constexpr (memory_retaining_allocator<Allocator>) pool->allocator->retain_memory(false);
      pool->allocator->release_cached();
    } catch (const std::exception& e) {
      error("glake: releasing free memory of pool (%llu, %llu) of device %d failed: %s",
            static_cast<unsigned long long>(pool->id.first), static_cast<unsigned long long>(pool->id.second),
            s.device, e.what());
    }
  }

  // A pool without uses or live blocks: its memory goes back through its own release (so that
  // an observer hears of each segment), its counts stay in the device's statistics.
  void retire(slot& s, private_pool* pool) noexcept {
    try {
      if constexpr (memory_retaining_allocator<Allocator>) pool->allocator->retain_memory(false);
      pool->allocator->release_cached();
    } catch (const std::exception& e) {
      error("glake: releasing pool (%llu, %llu) of device %d failed: %s",
            static_cast<unsigned long long>(pool->id.first), static_cast<unsigned long long>(pool->id.second),
            s.device, e.what());
    }
    detail::accumulate_counts(s.retired, pool->allocator->stats());
    std::erase_if(s.pool_list, [pool](const auto& p) { return p.get() == pool; });
    s.pools.store(s.pool_list.size(), std::memory_order_release);
  }

  template <class F>
  void with_pools(int device, const char* what, F&& f) noexcept {
    try {
      DeviceScope scope(device);
      slot* s = registry_.find(device);
      if (s == nullptr) return;
      std::lock_guard guard(s->pools_mutex);
      f(*s);
    } catch (const std::exception& e) {
      error("glake: %s on device %d failed: %s", what, device, e.what());
    }
  }

  statistics combined_stats(const slot& s) const {
    statistics st = s.allocator->stats();
    if (s.had_pools.load(std::memory_order_acquire)) {
      std::lock_guard guard(s.pools_mutex);
      for (const auto& pool : s.pool_list) detail::accumulate(st, pool->allocator->stats());
      detail::accumulate_counts(st, s.retired);
    }
    return st;
  }

  // ------------------------------------------------------------------ history
  static std::uint64_t now_us() noexcept {
    using namespace std::chrono;
    return static_cast<std::uint64_t>(duration_cast<microseconds>(system_clock::now().time_since_epoch()).count());
  }

  void note(slot& s, memory_action action, const void* p, std::size_t bytes, stream_ref stream) noexcept {
    if (!history_on_.load(std::memory_order_relaxed)) return;
    s.history.record(history_entry{action, reinterpret_cast<std::uintptr_t>(p), bytes, stream, now_us(), s.device});
  }

  // Before the free: an allocation that reuses the memory is recorded after it. Without an
  // observer to say when the memory is reusable, that is taken to be now.
  void note_free_requested(slot& s, const void* p, std::size_t bytes, stream_ref stream) noexcept {
    note(s, memory_action::free_requested, p, bytes, stream);
    if constexpr (!observable_allocator<Allocator>) note(s, memory_action::free_completed, p, bytes, stream);
  }

  static void on_event(void* context, const memory_event& e) noexcept {
    auto* s = static_cast<slot*>(context);
    s->history.record(history_entry{e.action, e.address, e.size, e.stream, now_us(), s->device});
  }

  static void observe([[maybe_unused]] Allocator& a, [[maybe_unused]] slot& s, [[maybe_unused]] bool on) {
    if constexpr (observable_allocator<Allocator>) a.set_memory_observer(on ? &on_event : nullptr, &s);
  }
  void observe_all(slot& s, bool on) {
    observe(*s.allocator, s, on);
    std::lock_guard guard(s.pools_mutex);
    for (const auto& pool : s.pool_list) observe(*pool->allocator, s, on);
  }

  // ------------------------------------------------------------------ plumbing
  // The trace, once memory was handed out: failures here must not lose it.
  void after_allocate(slot& s, void* p, std::size_t bytes, stream_ref stream) noexcept {
    note(s, memory_action::alloc, p, bytes, stream);
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
  factory make_;
  std::atomic<std::uint64_t> errors_{0};
  std::atomic<bool> history_on_{false};
  std::mutex history_mutex_;            // serialises starting and stopping the history
  std::size_t history_capacity_ = 0;    // under history_mutex_
  device_registry<slot, MaxDevices> registry_;
};

}  // namespace glake
