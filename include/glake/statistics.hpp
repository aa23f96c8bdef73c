// What an allocator reports about itself: bytes in use and reserved, event counts, driver calls
// and the time spent in them.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

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
                                    ///< device handles they handed to a prefetch, not released
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

}  // namespace glake
