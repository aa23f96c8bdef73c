// A log of one line per report, for components that must not throw where they fail (the PyTorch
// plug-in's entry points): written with one call, so several threads' lines do not interleave.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>

#if defined(__GNUC__)
#define GLAKE_PRINTF_FORMAT(format_index, first_argument) \
  __attribute__((format(printf, format_index, first_argument)))
#else
#define GLAKE_PRINTF_FORMAT(format_index, first_argument)
#endif

namespace glake::detail {

/// printf-style reports to `out` (none when null), newlines in a message turned into spaces and
/// lines cut at 1 KiB; `error` also counts the failure (errors()).
/// Thread safety: every member may be called concurrently.
class line_log {
 public:
  explicit line_log(std::FILE* out) noexcept : out_(out) {}

  GLAKE_PRINTF_FORMAT(2, 3) void log(const char* format, ...) const noexcept {
    std::va_list args;
    va_start(args, format);
    write(format, args);
    va_end(args);
  }

  /// Logs and counts a failure that is swallowed.
  GLAKE_PRINTF_FORMAT(2, 3) void error(const char* format, ...) noexcept {
    errors_.fetch_add(1, std::memory_order_relaxed);
    std::va_list args;
    va_start(args, format);
    write(format, args);
    va_end(args);
  }

  std::uint64_t errors() const noexcept { return errors_.load(std::memory_order_relaxed); }

 private:
  void write(const char* format, std::va_list args) const noexcept {
    if (out_ == nullptr) return;
    char line[1024];
    const int n = std::vsnprintf(line, sizeof line - 1, format, args);
    if (n < 0) return;
    std::size_t length = std::min(static_cast<std::size_t>(n), sizeof line - 2);
    for (std::size_t i = 0; i < length; ++i) {
      if (line[i] == '\n') line[i] = ' ';
    }
    line[length++] = '\n';
    std::fwrite(line, 1, length, out_);
    std::fflush(out_);
  }

  std::FILE* out_;
  std::atomic<std::uint64_t> errors_{0};
};

}  // namespace glake::detail
