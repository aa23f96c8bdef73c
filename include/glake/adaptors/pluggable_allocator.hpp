// glake allocators behind a C allocation interface such as PyTorch's CUDAPluggableAllocator:
// one allocator per device, failures turned into null and one line of log, statistics as a flat
// array, private pools for CUDA graphs, and optional recordings: every request in glake-replay's
// trace format, and a bounded memory history for snapshots.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "glake/adaptors/combined_peaks.hpp"
#include "glake/adaptors/graph_pools.hpp"
#include "glake/adaptors/history_switch.hpp"
#include "glake/adaptors/pluggable_stats.hpp"
#include "glake/adaptors/trace_recorder.hpp"
#include "glake/allocators/concepts.hpp"
#include "glake/allocators/device_registry.hpp"
#include "glake/detail/accounting.hpp"
#include "glake/detail/line_log.hpp"
#include "glake/errors.hpp"
#include "glake/memory_history.hpp"
#include "glake/memory_state.hpp"
#include "glake/statistics.hpp"
#include "glake/stream.hpp"

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
/// device, pid, rank) by a trace_recorder (requests served by private pools are left out); for an
/// observable_allocator a free is written when its memory is reusable (free_completed), which
/// for a record_stream'd free is a later call.
///
/// Private pools (CUDA graphs; for a memory_retaining_allocator): each device's graph_pools
/// (adaptors/graph_pools.hpp has the state machine), whose allocators the same factory makes.
/// Between begin_allocate_to_pool(device, pool, filter) and end_allocate_to_pool(device, pool),
/// requests on `device` whose stream passes `filter` go to the pool; its blocks go back to it
/// only; release_pool drops a use, and a pool without uses gives its memory back as its blocks
/// are freed. A pool out of memory has the general allocator's cached memory released and tries
/// once more. While a device has pools, each free and record_stream there takes one mutex and
/// one hash lookup more; without pools, one atomic load. Statistics: sums over the general
/// allocator and the pools (those given back too), but the peak reserved is the highest sum seen
/// (combined_peaks.hpp): sampled after each pool allocation, each move back asked for here, each
/// general allocation that added memory while the pools held some, and at each read. An
/// observable_allocator says when it adds memory (segment_alloc, to an observer installed with
/// the first pool), so its other allocations cost nothing more; another is sampled after every
/// allocation while the pools hold memory (one more call to it, under its lock). A deferred move
/// back that the general allocator completes inside another of its calls is seen at the next
/// sample. The memory limit applies to the general allocator only.
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
  struct slot;
  // What a device's pools ask of it: a new allocator (observed while the history records), the
  // general allocator's cache when a pool is short, a history entry for each pool block's free,
  // and the log for failures swallowed.
  struct pool_host {
    pluggable_allocator* self;
    slot* s;
    std::unique_ptr<Allocator> make_pool_allocator() {
      auto made = self->make_(s->device);
      if (made != nullptr && self->history_.on()) observe(*made, *s, true);
      return made;
    }
    void relieve() { s->allocator->release_cached(); }
    void freeing(const void* p, std::size_t bytes, stream_ref stream) noexcept {
      if (self->history_.on()) self->note_free_requested(*s, p, bytes, stream);
    }
    void report(const std::string& message) noexcept {
      self->log_.error("glake: %s (device %d)", message.c_str(), s->device);
    }
  };

 public:
  using factory = std::function<std::unique_ptr<Allocator>(int device)>;
  /// A private pool's name (PyTorch's MempoolId_t).
  using pool_id = graph_pool_id;
  /// Which streams' requests a capture sends to its pool.
  using stream_filter = std::function<bool(stream_ref)>;
  /// A device's private pools: the state machine of CUDA graphs' pools (graph_pools.hpp).
  using pools_type = graph_pools<Allocator, pool_host>;

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
      if (void* p = s->pools.allocate(bytes, stream)) {
        note(*s, memory_action::alloc, p, bytes, stream);
        sample_combined(*s);  // the pools may have grown
        return p;
      }
      void* p = s->allocator->allocate(bytes, stream);
      after_allocate(*s, p, bytes, stream);
      return p;
    } catch (const std::exception& e) {
      log_.log("glake: allocating %zu bytes on device %d, stream %#llx failed: %s", bytes, device,
          static_cast<unsigned long long>(stream.id()), e.what());
      if (s != nullptr && s->trace) s->trace->failed(bytes, stream);
      if (s != nullptr && dynamic_cast<const std::bad_alloc*>(&e) != nullptr) {
        note(*s, memory_action::oom, nullptr, bytes, stream);
      }
      throw;
    } catch (...) {
      log_.log("glake: allocating %zu bytes on device %d failed: unknown exception", bytes, device);
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
        log_.error("glake: free of %p (%zu bytes) on device %d, which has no glake allocator", p, bytes, device);
        return;
      }
      if (s->pools.deallocate(p, bytes, stream)) return;
      const bool history = history_.on();
      // Unchecked builds do not catch foreign pointers themselves; ask first. So does the
      // history, which must not show a free that did not happen.
      if ((!GLAKE_CHECKED || history) && !s->allocator->owns(p)) {
        log_.error("glake: free of %p (%zu bytes) on device %d, which is not a live allocation there", p, bytes, device);
        return;
      }
      // An observable allocator says when the memory is reusable (trace_free); else it is now.
      if (s->trace && !observable_allocator<Allocator>) s->trace->freeing(p);
      if (history) note_free_requested(*s, p, bytes, stream);
      s->allocator->deallocate(p, bytes, stream);
      if (s->trace) {
        if constexpr (observable_allocator<Allocator>) s->trace->deferred(p);  // still live: deferred
        s->trace->reserved(s->allocator->reserved_bytes());
      }
    } catch (const std::exception& e) {
      log_.error("glake: free of %p (%zu bytes) on device %d failed: %s", p, bytes, device, e.what());
    } catch (...) {
      log_.error("glake: free of %p on device %d failed: unknown exception", p, device);
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
        const auto record = [&](Allocator& owner) {
          found = true;
          if constexpr (stream_recording_allocator<Allocator>) {
            DeviceScope scope(device);
            owner.record_stream(p, stream);
          } else {
            (void)owner;
          }
        };
        if (!s.pools.with_owner(p, record) && s.allocator->owns(p)) {
          record(*s.allocator);
          if (s.trace) s.trace->recorded_stream(p, stream);
        }
      });
      if (!found) log_.error("glake: record_stream of %p, which is not a live allocation of any device", p);
    } catch (const std::exception& e) {
      log_.error("glake: record_stream of %p failed: %s", p, e.what());
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
      sample_combined(s);  // a move back holds more memory once complete
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
      sample_combined(s);
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
      log_.error("glake: releasing %zu cached bytes on device %d failed: %s", bytes, device, e.what());
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
      log_.error("glake: releasing %zu completed cached bytes on device %d failed: %s", bytes, device, e.what());
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
      log_.error("glake: setting the memory limit of device %d to %zu bytes failed: %s", device, bytes, e.what());
      return false;
    }
  }

  /// From now on, peaks are measured from the current values (on `device`, or all when negative).
  void reset_peak(int device) noexcept {
    each_device(device, "resetting peaks", [](slot& s) {
      statistics before = s.allocator->reset_peaks();
      const std::size_t general_peak = before.peak_reserved_bytes;
      s.pools.for_each([&](pool_id, Allocator& pool) { accumulate(before, pool.reset_peaks(), peak_rule::summed); });
      s.peaks.reset(before.peak_active_bytes,
                    s.peaks.peak(general_peak, before.peak_reserved_bytes, before.reserved_bytes),
                    s.allocator->reserved_bytes() + s.pools.reserved_bytes());
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
        std::size_t i = detail::write_statistics(st, v.data());
        v[i++] = s->peaks.lifetime_active(st.peak_active_bytes);
        v[i++] = s->peaks.lifetime_reserved(st.peak_reserved_bytes);
      }
    } catch (const usage_error&) {
      return 0;  // device id out of range
    } catch (const std::exception& e) {
      log_.error("glake: reading statistics of device %d failed: %s", device, e.what());
    }
    v[pluggable_stat_names.size() - 1] = log_.errors();
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
      watch_growth(s);  // before the pools' lock: the history switch's is taken before it elsewhere
      s.pools.begin(pool, std::move(filter));
      return true;
    } catch (const std::exception& e) {
      log_.error("glake: beginning to allocate to pool (%llu, %llu) on device %d failed: %s",
            static_cast<unsigned long long>(pool.first), static_cast<unsigned long long>(pool.second), device,
            e.what());
      return false;
    }
  }

  /// Requests stop going to `pool` (PyTorch's endAllocateToPool); its blocks still return to it.
  void end_allocate_to_pool(int device, pool_id pool) noexcept {
    with_pools(device, "ending allocation to a pool", [&](pools_type& p) { p.end(pool); });
  }

  /// One use of `pool` ends (PyTorch's releasePool, when a graph is reset or destroyed). Once
  /// no use is left, its memory goes back to the backend as soon as it has no live block.
  /// A pool not in use is logged and counted as an error.
  void release_pool(int device, pool_id pool) noexcept {
    with_pools(device, "releasing a pool", [&](pools_type& p) { p.release(pool); });
  }

  /// How many private pools `device` has now (released ones with live blocks included).
  std::size_t pool_count(int device) const noexcept {
    slot* s = registry_.find(device);
    return s == nullptr ? 0 : s->pools.size();
  }

  /// `device`'s private pools (the state machine itself: use counts, captures under way, live
  /// blocks), or null when the device has no allocator yet; usage_error for a device id out of
  /// range.
  const pools_type* pools(int device) const {
    slot* s = registry_.find(device);
    return s == nullptr ? nullptr : &s->pools;
  }

  /// The statistics of `device`'s private pool `pool`, if it exists.
  std::optional<statistics> pool_stats(int device, pool_id pool) const {
    slot* s = registry_.find(device);
    return s == nullptr ? std::nullopt : s->pools.stats(pool);
  }

  // ------------------------------------------------------------------ memory history, state

  /// Starts (every device's history emptied, at most `max_entries` kept each) or stops recording
  /// the memory history (entries kept until it starts again). False, logged, when the rings
  /// cannot be allocated (recording is then off).
  bool record_history(bool enabled, std::size_t max_entries) noexcept {
    try {
      history_.set(
          enabled, max_entries,
          [&](std::size_t capacity) { registry_.for_each([&](int, slot& s) { s.history.reset(capacity); }); },
          [&](bool on) {
            registry_.for_each([&](int device, slot& s) {
              DeviceScope scope(device);
              observe_all(s, on);
            });
          });
      return true;
    } catch (const std::exception& e) {
      log_.error("glake: starting the memory history failed: %s", e.what());
      return false;
    }
  }
  bool recording_history() const noexcept { return history_.on(); }

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
    s->pools.for_each([&](pool_id id, const Allocator& pool) {
      v.allocator(id);
      pool.visit_state(v);
    });
    return true;
  }

  /// Writes out whatever the traces hold in their buffers.
  void flush_traces() noexcept {
    registry_.for_each([](int, slot& s) {
      if (s.trace) s.trace->flush();
    });
  }

  /// Failures that were logged and swallowed: bad frees, record_streams, releases, statistics.
  std::uint64_t errors() const noexcept { return log_.errors(); }

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
      if (s.pools.holds(p)) {
        throw usage_error(usage_error::kind::bad_state,
                          "glake: " + std::string(to_far ? "offload" : "prefetch") + " of " + detail::pointer_text(p) +
                              ": it is in a CUDA graph's private pool, whose mappings must not change");
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
      if (!to_far) sample_combined(s);  // memory back on the device
      if (s.trace) s.trace->reserved(s.allocator->reserved_bytes());
    });
    if (!found) {
      throw usage_error(usage_error::kind::foreign_pointer,
                        "glake: " + std::string(to_far ? "offload" : "prefetch") + " of " + detail::pointer_text(p) +
                            ": not a live allocation of glake's allocator");
    }
  }

  struct slot {
    slot(pluggable_allocator& owner, int id) : owner(&owner), device(id), pools(pool_host{&owner, this}) {}
    pluggable_allocator* owner;
    int device = 0;
    std::unique_ptr<Allocator> allocator;
    std::unique_ptr<trace_recorder> trace;
    memory_history history;
    // The general + pools peak reserved, and the peaks before the last reset_peak (the
    // allocator's own restart there).
    combined_peaks peaks;
    bool watched = false;  // the general allocator's observer watches for growth (under history_)
    pools_type pools;  // CUDA graphs' private pools
    static_assert(!memory_retaining_allocator<Allocator> || graph_pooling<pools_type>);  // begin needs it
  };

  std::unique_ptr<slot> make_slot(int device) {
    auto s = std::make_unique<slot>(*this, device);
    s->allocator = make_(device);
    if (s->allocator == nullptr) return nullptr;  // the registry reports it
    if (!options_.trace_pattern.empty()) {
      const std::string path = trace_file_name(options_.trace_pattern, device, options_.pid, options_.rank);
      std::vector<std::string> header = options_.header;
      header.insert(header.begin(), "glake trace of device " + std::to_string(device) + ", process " +
                                        std::to_string(options_.pid));
      s->trace = trace_recorder::open(path, header);
      if (!s->trace) log_.error("glake: cannot open trace file %s for device %d; not recording it", path.c_str(), device);
    }
    history_.locked([&](bool on, std::size_t capacity) {
      if (on) s->history.reset(capacity);
      if (on || s->trace) observe_general(*s);
    });
    return s;
  }

  // ------------------------------------------------------------------ pools, statistics
  template <class F>
  void with_pools(int device, const char* what, F&& f) noexcept {
    try {
      DeviceScope scope(device);
      slot* s = registry_.find(device);
      if (s == nullptr) return;
      f(s->pools);
    } catch (const std::exception& e) {
      log_.error("glake: %s on device %d failed: %s", what, device, e.what());
    }
  }

  statistics combined_stats(const slot& s) const {
    statistics st = s.allocator->stats();
    const std::size_t general_peak = st.peak_reserved_bytes;
    s.pools.add_stats(st);
    st.peak_reserved_bytes = s.peaks.peak(general_peak, st.peak_reserved_bytes, st.reserved_bytes);
    return st;
  }

  // While the pools hold memory: raises the combined peak to general + pools now (one call to
  // the general allocator, under its lock).
  static void sample_combined(slot& s) noexcept {
    s.peaks.sample(s.pools.reserved_bytes(), [&] { return s.allocator->reserved_bytes(); });
  }

  // ------------------------------------------------------------------ history
  static std::uint64_t now_us() noexcept {
    using namespace std::chrono;
    return static_cast<std::uint64_t>(duration_cast<microseconds>(system_clock::now().time_since_epoch()).count());
  }

  void note(slot& s, memory_action action, const void* p, std::size_t bytes, stream_ref stream) noexcept {
    if (!history_.on()) return;
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
  // The general allocator's observer: the history's entries while it records, the trace's frees
  // when their memory is reusable, and, once watched, growth while the pools hold memory (called
  // under the allocator's lock: a flag, not a sample; the trace's own lock is taken inside it
  // and never held while calling the allocator).
  static void on_general_event(void* context, const memory_event& e) noexcept {
    auto* s = static_cast<slot*>(context);
    if (e.action == memory_action::segment_alloc) s->peaks.note_growth(s->pools.reserved_bytes());
    if (e.action == memory_action::free_completed && s->trace) s->trace->freeing(reinterpret_cast<const void*>(e.address));
    if (s->owner->history_.on()) on_event(context, e);
  }

  static void observe([[maybe_unused]] Allocator& a, [[maybe_unused]] slot& s, [[maybe_unused]] bool on) {
    if constexpr (observable_allocator<Allocator>) a.set_memory_observer(on ? &on_event : nullptr, &s);
  }
  // Under history_'s lock: the general allocator observed while the history records or the
  // device has had pools.
  void observe_general([[maybe_unused]] slot& s) {
    if constexpr (observable_allocator<Allocator>) {
      const bool on = s.watched || s.trace != nullptr || history_.on();
      s.allocator->set_memory_observer(on ? &on_general_event : nullptr, &s);
    }
  }
  void observe_all(slot& s, bool on) {
    observe_general(s);
    s.pools.for_each([&](pool_id, Allocator& pool) { observe(pool, s, on); });
  }
  // From the first pool on, the general allocator's growth is watched (observable allocators).
  void watch_growth([[maybe_unused]] slot& s) {
    if constexpr (observable_allocator<Allocator>) {
      history_.locked([&](bool, std::size_t) {
        if (s.watched) return;
        s.watched = true;
        try {
          observe_general(s);
        } catch (...) {
          s.watched = false;
          throw;
        }
      });
    }
  }
  // After a general allocation: whether the combined peak needs a sample. An observable
  // allocator said whether it added memory while the pools held some (one atomic load when it
  // did not); another may have, whenever the pools hold memory.
  static bool general_grew([[maybe_unused]] slot& s) noexcept {
    if constexpr (observable_allocator<Allocator>) {
      return s.peaks.take_growth();
    } else {
      return true;
    }
  }

  // ------------------------------------------------------------------ plumbing
  // The trace, once memory was handed out: failures here must not lose it.
  void after_allocate(slot& s, void* p, std::size_t bytes, stream_ref stream) noexcept {
    note(s, memory_action::alloc, p, bytes, stream);
    if (general_grew(s)) sample_combined(s);
    try {
      if (s.trace) s.trace->allocated(p, bytes, stream, s.allocator->reserved_bytes());
    } catch (const std::exception& e) {
      log_.error("glake: bookkeeping after allocating %p failed: %s", p, e.what());
    }
  }

  template <class F>
  void each_device(int device, const char* what, F&& f) noexcept {
    const auto one = [&](int d, slot& s) {
      try {
        DeviceScope scope(d);
        f(s);
      } catch (const std::exception& e) {
        log_.error("glake: %s on device %d failed: %s", what, d, e.what());
      }
    };
    try {
      if (device < 0) {
        registry_.for_each(one);
      } else if (slot* s = registry_.find(device)) {
        one(device, *s);
      }
    } catch (const std::exception& e) {
      log_.error("glake: %s on device %d failed: %s", what, device, e.what());
    }
  }

  options options_;
  factory make_;
  detail::line_log log_{options_.log};
  history_switch history_;  // whether the memory history records, for every device
  device_registry<slot, MaxDevices> registry_;
};

}  // namespace glake
