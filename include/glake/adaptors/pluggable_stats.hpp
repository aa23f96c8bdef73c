// The flat array of statistics that pluggable_allocator::stats writes for a C interface: the
// names of its values, in order, and the writer of the values `statistics` holds.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "glake/statistics.hpp"

namespace glake {

/// The names of the values pluggable_allocator::stats writes, in order: the fields of
/// `statistics`, its driver calls by kind, the host nanoseconds spent in them by kind, what
/// offloads and prefetches cost (move_costs, in its order), then the adaptor's own.
inline constexpr std::array<std::string_view, 57> pluggable_stat_names = {
    "active_bytes",        "peak_active_bytes",   "allocated_bytes",     "peak_allocated_bytes",
    "reserved_bytes",      "peak_reserved_bytes", "cached_stitch_bytes", "offloaded_bytes",     "allocations",
    "deallocations",       "failed_allocations",  "splits",              "merges",
    "segments_created",    "segments_released",   "stitches",            "stitch_cache_hits",
    "stitch_repairs",      "stitch_grows",        "stitch_evictions",    "cross_stream_bytes",
    "device_waits",        "stream_joins",        "events_recorded",     "event_queries",       "event_ns",
    "spare_bytes",         "recycled_handles",
    "driver_create",       "driver_release",      "driver_reserve",      "driver_address_free",
    "driver_map",          "driver_unmap",        "driver_set_access",
    "driver_create_ns",    "driver_release_ns",   "driver_reserve_ns",   "driver_address_free_ns",
    "driver_map_ns",       "driver_unmap_ns",     "driver_set_access_ns",
    "offload_moves",       "offload_driver_calls", "offload_handles_made", "offload_handles_reused",
    "offload_handed_over", "offload_host_ns",
    "prefetch_moves",      "prefetch_driver_calls", "prefetch_handles_made", "prefetch_handles_reused",
    "prefetch_handed_over", "prefetch_host_ns",
    "lifetime_peak_active_bytes", "lifetime_peak_reserved_bytes", "errors"};

namespace detail {
inline constexpr std::size_t move_cost_values = 6;  // the fields of move_costs
inline constexpr std::size_t write_move_costs(const move_costs& m, std::uint64_t* out) noexcept {
  const std::uint64_t values[move_cost_values] = {m.moves,          m.driver_calls, m.handles_made,
                                                  m.handles_reused, m.handed_over,  m.host_ns};
  for (std::size_t k = 0; k < move_cost_values; ++k) out[k] = values[k];
  return move_cost_values;
}
inline constexpr void read_move_costs(move_costs& m, const std::uint64_t* in) noexcept {
  std::uint64_t* fields[move_cost_values] = {&m.moves,          &m.driver_calls, &m.handles_made,
                                             &m.handles_reused, &m.handed_over,  &m.host_ns};
  for (std::size_t k = 0; k < move_cost_values; ++k) *fields[k] = in[k];
}
// The names after the 28 plain statistics are the driver calls in the order of `driver_call`,
// then the same with "_ns": the time spent in them.
constexpr bool driver_call_names_match() {
  constexpr std::size_t plain = 28;
  for (std::size_t k = 0; k < driver_call_kinds; ++k) {
    const std::string_view kind = to_string(static_cast<driver_call>(k));
    const std::string_view count = pluggable_stat_names[plain + k];
    const std::string_view time = pluggable_stat_names[plain + driver_call_kinds + k];
    if (count.substr(0, 7) != "driver_" || count.substr(7) != kind) return false;
    if (time.substr(0, 7) != "driver_" || time.substr(7, kind.size()) != kind) return false;
    if (time.substr(7 + kind.size()) != "_ns") return false;
  }
  return pluggable_stat_names.size() == plain + 2 * driver_call_kinds + 2 * move_cost_values + 3;
}
static_assert(driver_call_names_match(), "pluggable_stat_names is out of step with statistics");

/// Writes `st`'s values in the order of pluggable_stat_names (the fields, then the driver calls
/// and their time) to `out`, and returns how many: the adaptor's own values follow.
inline std::size_t write_statistics(const statistics& st, std::uint64_t* out) noexcept {
  std::size_t i = 0;
  for (const std::uint64_t value :
       {std::uint64_t{st.active_bytes}, std::uint64_t{st.peak_active_bytes}, std::uint64_t{st.allocated_bytes},
        std::uint64_t{st.peak_allocated_bytes}, std::uint64_t{st.reserved_bytes},
        std::uint64_t{st.peak_reserved_bytes}, std::uint64_t{st.cached_stitch_bytes},
        std::uint64_t{st.offloaded_bytes}, st.allocations, st.deallocations, st.failed_allocations, st.splits,
        st.merges, st.segments_created, st.segments_released, st.stitches, st.stitch_cache_hits,
        st.stitch_repairs, st.stitch_grows, st.stitch_evictions, st.cross_stream_bytes, st.device_waits,
        st.stream_joins, st.events_recorded, st.event_queries, st.event_ns, std::uint64_t{st.spare_bytes},
        st.recycled_handles}) {
    out[i++] = value;
  }
  for (const std::uint64_t calls : st.driver_calls.counts) out[i++] = calls;
  for (const std::uint64_t ns : st.driver_time.ns) out[i++] = ns;
  i += write_move_costs(st.offloads, out + i);
  i += write_move_costs(st.prefetches, out + i);
  return i;
}
}  // namespace detail

}  // namespace glake
