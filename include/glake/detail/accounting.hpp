// Counters with high-water marks and the error messages that the allocators share.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "glake/errors.hpp"
#include "glake/statistics.hpp"
#include "glake/stream.hpp"

#ifndef GLAKE_CHECKED
#define GLAKE_CHECKED 1
#endif

namespace glake::detail {

/// Active, allocated and reserved bytes with their peaks, kept as the allocator goes.
struct usage_counters {
  statistics s;

  void on_allocate(std::size_t requested, std::size_t allocated) noexcept {
    s.active_bytes += requested;
    s.allocated_bytes += allocated;
    s.peak_active_bytes = std::max(s.peak_active_bytes, s.active_bytes);
    s.peak_allocated_bytes = std::max(s.peak_allocated_bytes, s.allocated_bytes);
    ++s.allocations;
  }
  void on_deallocate(std::size_t requested, std::size_t allocated) noexcept {
    s.active_bytes -= requested;
    s.allocated_bytes -= allocated;
    ++s.deallocations;
  }
  void on_reserve(std::size_t bytes) noexcept {
    s.reserved_bytes += bytes;
    s.peak_reserved_bytes = std::max(s.peak_reserved_bytes, s.reserved_bytes);
    ++s.segments_created;
  }
  void on_extend(std::size_t bytes) noexcept {
    s.reserved_bytes += bytes;
    s.peak_reserved_bytes = std::max(s.peak_reserved_bytes, s.reserved_bytes);
  }
  void on_unreserve(std::size_t bytes) noexcept {
    s.reserved_bytes -= bytes;
    ++s.segments_released;
  }
  /// Memory of live allocations left for far memory (offload), or came back (prefetch).
  void on_move_out(std::size_t bytes) noexcept {
    s.reserved_bytes -= bytes;
    s.offloaded_bytes += bytes;
  }
  void on_move_in(std::size_t bytes) noexcept {
    s.reserved_bytes += bytes;
    s.offloaded_bytes -= bytes;
    s.peak_reserved_bytes = std::max(s.peak_reserved_bytes, s.reserved_bytes);
  }
  /// A freed allocation whose memory stays in far memory for now: no longer active.
  void on_park(std::size_t requested) noexcept {
    s.active_bytes -= requested;
    ++s.deallocations;
  }
  /// Peaks start again from the current values.
  void reset_peaks() noexcept {
    s.peak_active_bytes = s.active_bytes;
    s.peak_allocated_bytes = s.allocated_bytes;
    s.peak_reserved_bytes = s.reserved_bytes;
  }
};

/// What an allocator's live_report starts as: stderr in checked builds, silence otherwise.
inline constexpr live_report default_live_report = GLAKE_CHECKED ? &print_live_report : nullptr;

/// From a destructor: tells `report` of the allocations `s` counts as still live, if any.
inline void report_live(live_report report, const char* allocator, const statistics& s) noexcept {
  const std::uint64_t live = s.allocations - s.deallocations;
  if (report != nullptr && live != 0) report(allocator, live, s.active_bytes);
}

inline std::string pointer_text(const void* p) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%p", p);
  return buffer;
}

[[noreturn]] inline void throw_not_live(const char* allocator, const void* p, bool inside_free_memory) {
  if (inside_free_memory) {
    throw usage_error(usage_error::kind::double_free,
                      std::string(allocator) + ": double free of " + pointer_text(p) +
                          " (the memory it points to is already free)");
  }
  throw usage_error(usage_error::kind::foreign_pointer,
                    std::string(allocator) + ": deallocate of " + pointer_text(p) +
                        ", a pointer this allocator did not return");
}

[[noreturn]] inline void throw_record_stream_not_live(const char* allocator, const void* p) {
  throw usage_error(usage_error::kind::foreign_pointer,
                    std::string(allocator) + ": record_stream of " + pointer_text(p) +
                        ", which is not a live allocation of this allocator");
}

[[noreturn]] inline void throw_size_mismatch(const char* allocator, const void* p, std::size_t given,
                                             std::size_t allocated) {
  throw usage_error(usage_error::kind::size_mismatch,
                    std::string(allocator) + ": deallocate of " + pointer_text(p) + " with size " +
                        std::to_string(given) + " but it was allocated with size " +
                        std::to_string(allocated));
}

[[noreturn]] inline void throw_out_of_memory(const char* allocator, std::size_t requested,
                                             stream_ref stream, const statistics& s,
                                             std::size_t largest_free, std::size_t limit) {
  std::string message = std::string(allocator) + ": out of memory allocating " +
                        format_bytes(requested) + " on stream " + std::to_string(stream.id()) +
                        "; holding " + format_bytes(s.reserved_bytes) + " reserved, " +
                        format_bytes(s.active_bytes) + " active, largest free block " +
                        format_bytes(largest_free);
  if (limit != 0) message += ", memory limit " + format_bytes(limit);
  throw out_of_memory(requested, s.reserved_bytes, s.active_bytes, std::move(message));
}

constexpr std::size_t round_up(std::size_t n, std::size_t multiple) noexcept {
  return (n + multiple - 1) / multiple * multiple;
}

/// True when rounding `n` up to `multiple` would overflow.
constexpr bool round_up_overflows(std::size_t n, std::size_t multiple) noexcept {
  return n > ~std::size_t{0} - (multiple - 1);
}

}  // namespace glake::detail
