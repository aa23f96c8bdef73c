// What an allocator reports about itself: bytes in use and reserved, event counts, driver calls
// and the time spent in them.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <concepts>
#include <string_view>
#include <type_traits>

namespace glake {

/// The kinds of backend call an allocator makes; on CUDA they are the driver's VMM calls.
enum class driver_call : std::uint8_t {
  create,       ///< cuMemCreate / memfd_create: new physical memory
  release,      ///< cuMemRelease: physical memory returned
  reserve,      ///< cuMemAddressReserve: a virtual range reserved
  address_free, ///< cuMemAddressFree: a virtual range returned
  map,          ///< cuMemMap: one handle mapped
  unmap,        ///< cuMemUnmap: one mapped range unmapped
  set_access,   ///< cuMemSetAccess: access enabled on a mapped range
};
inline constexpr std::size_t driver_call_kinds = 7;

constexpr std::string_view to_string(driver_call call) noexcept {
  constexpr std::string_view names[] = {"create", "release", "reserve", "address_free",
                                        "map",    "unmap",   "set_access"};
  return names[static_cast<std::size_t>(call)];
}

/// Counts of backend calls by kind.
struct driver_call_counts {
  std::array<std::uint64_t, driver_call_kinds> counts{};

  std::uint64_t& operator[](driver_call call) noexcept { return counts[static_cast<std::size_t>(call)]; }
  std::uint64_t operator[](driver_call call) const noexcept {
    return counts[static_cast<std::size_t>(call)];
  }
  std::uint64_t total() const noexcept {
    std::uint64_t sum = 0;
    for (auto c : counts) sum += c;
    return sum;
  }
  friend bool operator==(const driver_call_counts&, const driver_call_counts&) = default;
};

/// Host time spent in backend calls by kind, in nanoseconds (steady clock, the call's own
/// duration: what the calling thread waited for the driver).
struct driver_call_times {
  std::array<std::uint64_t, driver_call_kinds> ns{};

  std::uint64_t& operator[](driver_call call) noexcept { return ns[static_cast<std::size_t>(call)]; }
  std::uint64_t operator[](driver_call call) const noexcept { return ns[static_cast<std::size_t>(call)]; }
  std::uint64_t total() const noexcept {
    std::uint64_t sum = 0;
    for (auto t : ns) sum += t;
    return sum;
  }
};

/// What the moves of one kind (offloads, or prefetches) cost the host, counted by the mover
/// around its own work: the backend calls it made for them, the device handles they created, the
/// device handles they took without creating one, and the host time in all of it. A free that
/// brings an offloaded allocation back is not a prefetch and is not counted.
struct move_costs {
  std::uint64_t moves = 0;          ///< moves that went through (a deferred one once completed)
  std::uint64_t driver_calls = 0;   ///< device backend calls made for them (driver_call kinds)
  std::uint64_t handles_made = 0;   ///< device handles created for them (driver_call::create)
  std::uint64_t handles_reused = 0; ///< device handles they took without a create: spares, or
                                    ///< handed over by a completing offload
  std::uint64_t handed_over = 0;    ///< of those, handed over (prefetches); offloads: the
                                    ///< device handles they handed to a prefetch, not released.
                                    ///< Both counted when that prefetch finished: handles a
                                    ///< failed or undone one took went back to the backend
  std::uint64_t host_ns = 0;        ///< steady-clock time of the mover's work for them

  friend bool operator==(const move_costs&, const move_costs&) = default;
};

/// A snapshot of an allocator's accounting. "Active" bytes are what callers asked for and still
/// hold; "reserved" bytes are the physical memory the allocator holds from its backend, whether
/// in use or cached. A stitched block's memory is counted once, through the physical memory it
/// maps.
struct statistics {
  std::size_t active_bytes = 0;          ///< requested bytes of live allocations
  std::size_t peak_active_bytes = 0;
  std::size_t allocated_bytes = 0;       ///< bytes of live blocks after rounding
  std::size_t peak_allocated_bytes = 0;
  std::size_t reserved_bytes = 0;        ///< physical bytes held from the backend
  std::size_t peak_reserved_bytes = 0;
  std::size_t cached_stitch_bytes = 0;   ///< virtual bytes of stitched mappings kept for reuse
  std::size_t offloaded_bytes = 0;       ///< bytes of allocations whose memory is in far memory
                                         ///< (offload), not counted in reserved_bytes
  std::size_t spare_bytes = 0;           ///< device handles kept for the next moves (part of
                                         ///< reserved_bytes; config::move_spares)

  std::uint64_t allocations = 0;         ///< successful allocate calls (zero-size ones excluded)
  std::uint64_t deallocations = 0;
  std::uint64_t failed_allocations = 0;  ///< requests that ended in out-of-memory
  std::uint64_t splits = 0;              ///< free blocks split to serve a smaller request
  std::uint64_t merges = 0;              ///< free neighbours coalesced
  std::uint64_t segments_created = 0;    ///< growths: new physical memory mapped as a segment
  std::uint64_t segments_released = 0;
  std::uint64_t stitches = 0;            ///< new stitched ranges built
  std::uint64_t stitch_cache_hits = 0;   ///< requests served by a cached stitched range
  std::uint64_t stitch_repairs = 0;      ///< of those, served after replacing some of its handles
  std::uint64_t stitch_grows = 0;        ///< of those, served after mapping more handles after
                                         ///< its end (a range smaller than the request)
  std::uint64_t stitch_evictions = 0;    ///< cached stitched ranges unmapped
  std::uint64_t cross_stream_bytes = 0;  ///< free bytes moved to another stream once the work
                                         ///< queued on theirs before the free had completed
  std::uint64_t device_waits = 0;        ///< times the host waited for the device (a device
                                         ///< synchronize or an event wait) before reusing or
                                         ///< releasing memory
  std::uint64_t stream_joins = 0;        ///< times a stream was made to wait on another's
                                         ///< event on the device to take its pending free
                                         ///< blocks (config::stream_join), the host not waiting
  std::uint64_t events_recorded = 0;     ///< events recorded on streams to learn when frees,
                                         ///< record_stream uses or cached ranges' work complete
  std::uint64_t event_queries = 0;       ///< those events asked whether they have completed
  std::uint64_t event_ns = 0;            ///< host time in those records and queries
  std::uint64_t recycled_handles = 0;    ///< handles moves took from the spares instead of
                                         ///< creating them (config::move_spares)
  driver_call_counts driver_calls{};
  driver_call_times driver_time{};
  move_costs offloads{};                 ///< moves to far memory (offload)
  move_costs prefetches{};               ///< moves back to the device (prefetch)
};

/// Adds the counts of `from` to `into` (several allocators' moves).
inline void accumulate_moves(move_costs& into, const move_costs& from) noexcept {
  into.moves += from.moves;
  into.driver_calls += from.driver_calls;
  into.handles_made += from.handles_made;
  into.handles_reused += from.handles_reused;
  into.handed_over += from.handed_over;
  into.host_ns += from.host_ns;
}
static_assert(sizeof(move_costs) == 6 * sizeof(std::uint64_t),
              "a field of move_costs is missing from accumulate_moves");

/// How a field of `statistics` combines when several allocators' statistics are summed.
enum class statistic_kind : std::uint8_t {
  count,  ///< events, bytes moved, time spent, since construction: they add
  held,   ///< bytes held now (active, allocated, reserved, ...): they add
  peak,   ///< the highest value a held field reached: not summable. The peak of a sum lies
          ///< between the highest of the peaks and their sum; only who saw the sum over time knows
          ///< it (segregator, pluggable_allocator)
};

/// Calls `f(kind, a.field, b.field)` for each field of the statistics `a` and `b` (either may be
/// const), in declaration order. This is the one list of the fields that code combining
/// statistics goes by: a new field joins it with its kind (the static_assert below fails until
/// it does). driver_calls, driver_time, offloads and prefetches come whole, as counts.
template <class A, class B, class F>
  requires std::same_as<std::remove_const_t<A>, statistics> && std::same_as<std::remove_const_t<B>, statistics>
constexpr void for_each_statistic(A& a, B& b, F&& f) {
  using k = statistic_kind;
  f(k::held, a.active_bytes, b.active_bytes);
  f(k::peak, a.peak_active_bytes, b.peak_active_bytes);
  f(k::held, a.allocated_bytes, b.allocated_bytes);
  f(k::peak, a.peak_allocated_bytes, b.peak_allocated_bytes);
  f(k::held, a.reserved_bytes, b.reserved_bytes);
  f(k::peak, a.peak_reserved_bytes, b.peak_reserved_bytes);
  f(k::held, a.cached_stitch_bytes, b.cached_stitch_bytes);
  f(k::held, a.offloaded_bytes, b.offloaded_bytes);
  f(k::held, a.spare_bytes, b.spare_bytes);
  f(k::count, a.allocations, b.allocations);
  f(k::count, a.deallocations, b.deallocations);
  f(k::count, a.failed_allocations, b.failed_allocations);
  f(k::count, a.splits, b.splits);
  f(k::count, a.merges, b.merges);
  f(k::count, a.segments_created, b.segments_created);
  f(k::count, a.segments_released, b.segments_released);
  f(k::count, a.stitches, b.stitches);
  f(k::count, a.stitch_cache_hits, b.stitch_cache_hits);
  f(k::count, a.stitch_repairs, b.stitch_repairs);
  f(k::count, a.stitch_grows, b.stitch_grows);
  f(k::count, a.stitch_evictions, b.stitch_evictions);
  f(k::count, a.cross_stream_bytes, b.cross_stream_bytes);
  f(k::count, a.device_waits, b.device_waits);
  f(k::count, a.stream_joins, b.stream_joins);
  f(k::count, a.events_recorded, b.events_recorded);
  f(k::count, a.event_queries, b.event_queries);
  f(k::count, a.event_ns, b.event_ns);
  f(k::count, a.recycled_handles, b.recycled_handles);
  f(k::count, a.driver_calls, b.driver_calls);
  f(k::count, a.driver_time, b.driver_time);
  f(k::count, a.offloads, b.offloads);
  f(k::count, a.prefetches, b.prefetches);
}

namespace detail {
// The bytes of the fields for_each_statistic lists: all of statistics' bytes when none is missing
// (every field is 8-byte words, so there is no padding to account for).
constexpr std::size_t listed_statistics_bytes() {
  statistics s{};
  std::size_t bytes = 0;
  for_each_statistic(s, s, [&](statistic_kind, const auto& field, const auto&) { bytes += sizeof field; });
  return bytes;
}
}  // namespace detail
static_assert(detail::listed_statistics_bytes() == sizeof(statistics),
              "a field of glake::statistics is missing from for_each_statistic's list");

/// What accumulate makes of the peaks.
enum class peak_rule : std::uint8_t {
  highest,  ///< the higher of the two: a lower bound of the peak of the sum
  summed,   ///< their sum: an upper bound of the peak of the sum (exact when the peaks coincided)
};

/// Adds `from` to `into`, as one more allocator's statistics beside those summed in `into`:
/// counts and held bytes add (driver calls and times by kind, move costs field by field); peaks
/// follow `peaks`. A caller that knows the peak of the sum, or keeps some fields its own, sets
/// them after.
inline void accumulate(statistics& into, const statistics& from, peak_rule peaks = peak_rule::highest) noexcept {
  for_each_statistic(into, from, [peaks](statistic_kind kind, auto& to, const auto& add) {
    using field = std::remove_cvref_t<decltype(to)>;
    if constexpr (std::is_same_v<field, move_costs>) {
      accumulate_moves(to, add);
    } else if constexpr (std::is_same_v<field, driver_call_counts>) {
      for (std::size_t k = 0; k < driver_call_kinds; ++k) to.counts[k] += add.counts[k];
    } else if constexpr (std::is_same_v<field, driver_call_times>) {
      for (std::size_t k = 0; k < driver_call_kinds; ++k) to.ns[k] += add.ns[k];
    } else {
      static_assert(std::is_arithmetic_v<field>, "a field accumulate does not know how to add");
      to = kind == statistic_kind::peak && peaks == peak_rule::highest ? std::max(to, add) : to + add;
    }
  });
}

}  // namespace glake
