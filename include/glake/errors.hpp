// The exceptions glake throws: out-of-memory, driver failures, misuse and bad configuration.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

namespace glake {

/// How an allocator destroyed while allocations are still live says so (their memory goes back
/// with it, so any pointer still held dangles): called once, from the destructor, with the
/// allocator's name, the number of live allocations and their bytes. Each allocator has one
/// (`set_live_report`); the default is print_live_report in checked builds (GLAKE_CHECKED) and
/// null, silence, otherwise. A tool that tears allocators down with live blocks on purpose sets
/// null. Must not throw.
using live_report = void (*)(const char* allocator, std::uint64_t allocations, std::uint64_t bytes) noexcept;

/// One line on stderr: "<allocator>: destroyed with N allocations still live (B bytes); ...".
inline void print_live_report(const char* allocator, std::uint64_t allocations, std::uint64_t bytes) noexcept {
  std::fprintf(stderr, "%s: destroyed with %llu allocation%s still live (%llu bytes); their memory goes with it\n",
               allocator, static_cast<unsigned long long>(allocations), allocations == 1 ? "" : "s",
               static_cast<unsigned long long>(bytes));
}

/// Thrown by `allocate` when a request cannot be met even after the allocator released what it
/// caches. It is a `std::bad_alloc`, so code written for standard allocators handles it.
/// `what()` says what was asked and what the allocator held at the time.
class out_of_memory : public std::bad_alloc {
 public:
  out_of_memory(std::size_t requested, std::size_t reserved, std::size_t active, std::string detail)
      : requested_(requested), reserved_(reserved), active_(active), message_(std::move(detail)) {}

  const char* what() const noexcept override { return message_.c_str(); }
  std::size_t requested_bytes() const noexcept { return requested_; }
  std::size_t reserved_bytes() const noexcept { return reserved_; }
  std::size_t active_bytes() const noexcept { return active_; }

 private:
  std::size_t requested_;
  std::size_t reserved_;
  std::size_t active_;
  std::string message_;
};

/// A backend call failed for a reason other than running out of memory. The message names the
/// call and its result code (for CUDA, the `CUresult` name; for the host backend, `errno`).
class driver_error : public std::runtime_error {
 public:
  driver_error(std::string call, int code, const std::string& detail)
      : std::runtime_error(call + " failed (" + std::to_string(code) + "): " + detail),
        call_(std::move(call)),
        code_(code) {}
  const std::string& call() const noexcept { return call_; }
  int code() const noexcept { return code_; }

 private:
  std::string call_;
  int code_;
};

/// Misuse, and what the message says happened, by kind:
///   foreign_pointer, double_free, size_mismatch: a pointer the allocator never returned, a
///     double free, or a size at deallocation that differs from the size at allocation (checked
///     builds catch these);
///   bad_argument: an argument out of range or malformed, whatever the state (a size of 0 where
///     one is needed, an alignment that is not a power of two);
///   bad_state: the arguments are fine, but the component's state does not allow the operation
///     now and may later (a capture begun twice into one pool, no far memory attached yet, an
///     allocation already offloaded, a stream capturing a graph);
///   unsupported: the backend or the composition cannot do this at all, whatever the state (a
///     noexcept call asked to fail, copies on a stream of their own without stream joins, an
///     alignment above what the allocator guarantees).
/// The allocator's state is unchanged when this is thrown.
class usage_error : public std::logic_error {
 public:
  enum class kind { foreign_pointer, double_free, size_mismatch, bad_argument, bad_state, unsupported };
  usage_error(kind k, const std::string& message) : std::logic_error(message), kind_(k) {}
  kind which() const noexcept { return kind_; }
  /// The kind's name ("bad_state"), for logs and for messages that cross a C boundary.
  static constexpr const char* name(kind k) noexcept {
    switch (k) {
      case kind::foreign_pointer: return "foreign_pointer";
      case kind::double_free: return "double_free";
      case kind::size_mismatch: return "size_mismatch";
      case kind::bad_argument: return "bad_argument";
      case kind::bad_state: return "bad_state";
      case kind::unsupported: return "unsupported";
    }
    return "unknown";
  }

 private:
  kind kind_;
};

/// A configuration setting is unknown, malformed or out of range; the message names the setting
/// and says why.
class config_error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// Turns a byte count into a short human-readable string ("1.50 GiB") for error messages.
inline std::string format_bytes(std::size_t bytes) {
  static constexpr const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char buffer[48];
  if (unit == 0) {
    std::snprintf(buffer, sizeof buffer, "%zu B", bytes);
  } else {
    std::snprintf(buffer, sizeof buffer, "%.2f %s", value, units[unit]);
  }
  return buffer;
}

}  // namespace glake
