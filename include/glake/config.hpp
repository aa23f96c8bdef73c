// Knobs of the caching and stitching allocators as a plain value, and its validation. The parser
// (config::apply, config::from_env, config::to_string) is in glake/config_io.hpp.
#pragma once

#include <bit>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

#include "glake/errors.hpp"

namespace glake {

inline constexpr std::size_t KiB = std::size_t{1} << 10;
inline constexpr std::size_t MiB = std::size_t{1} << 20;
inline constexpr std::size_t GiB = std::size_t{1} << 30;

/// Knobs of the caching and stitching allocators. Defaults follow GMLake's master branch where it
/// has the knob and PyTorch's caching allocator elsewhere.
/// A plain value: copies are cheap, and no member touches shared state except from_env(), which
/// reads the process environment (racing with a concurrent setenv, as std::getenv does).
struct config {
  // --- GMLake's knobs (environment names in brackets) ---
  bool stitching = true;                 ///< [vmmDefragment] stitch free blocks at all
  std::size_t frag_limit = 512 * MiB;    ///< [fragLimit] stitch only requests at least this large
  double reuse_limit = 10.0;             ///< [reuseLimit] reuse a cached stitched range of size S
                                         ///< for a request R only if S <= R * reuse_limit
  int defrag_level = 0;                  ///< [defragLevel] first rung of the ladder (0..2) that stitches
  std::size_t auto_gc = 1000 * GiB;      ///< [autoGC, in GiB] cap on cached stitched bytes
  bool grow_stitch = false;              ///< [reAlloc] when free blocks fall short, create only
                                         ///< the missing bytes and stitch them with the free ones

  // --- glake's own ---
  std::size_t small_limit = 1 * MiB;     ///< requests up to this go to the small pool; 0: none
  std::size_t small_segment = 2 * MiB;   ///< the unit the small pool takes from the large pool:
                                         ///< a power of two, at least chunk_size (whole chunks)
  std::size_t round_to = 512;            ///< every request is rounded up to a multiple of this,
                                         ///< and every pointer is aligned to it: a power of two
                                         ///< from 256 (CUDA code assumes 256-byte aligned
                                         ///< pointers; PyTorch rounds to 512) to 2 MiB
  std::size_t large_round_to = 512;      ///< requests above small_limit are rounded up to a multiple
                                         ///< of this and blocks split there (as PyTorch's large
                                         ///< pool), at least round_to, at most chunk_size;
                                         ///< stitches still map whole handles. 0 means
                                         ///< chunk_size (GMLake's rounding: up to a chunk lost
                                         ///< per block)
  std::size_t chunk_size = 0;            ///< unit of blocks and of the smallest physical handle:
                                         ///< 0 means the provider's granularity, else a power
                                         ///< of two from 4 KiB (so that any power-of-two
                                         ///< granularity up to it divides it)
  std::size_t max_handle = 0;            ///< new memory comes in handles of chunk_size x 2^k up
                                         ///< to this (fewer driver calls); 0 means chunk_size only
  int min_handles = 8;                   ///< ... and none above 1/min_handles of its segment:
                                         ///< a handle partly in use cannot be stitched, so more
                                         ///< handles strand less memory, fewer cost fewer calls
  bool far_unmapped = false;             ///< memory offloaded to far memory is not mapped at
                                         ///< its addresses while there (far_residence::unmapped:
                                         ///< cheaper moves, and a use before prefetch faults),
                                         ///< for callers that bring it back before every use
  std::size_t move_spares = 0;           ///< device handles that offloads give back are kept,
                                         ///< up to this many bytes, for the next prefetches
                                         ///< of their size (no release and create per move);
                                         ///< counted as reserved, released before any request
                                         ///< is refused and by release_cached; 0 means none
  std::size_t memory_limit = 0;          ///< most physical bytes held; 0 means no limit
  double stitch_reserve = 2.0;           ///< address space reserved for a new stitched range, as
                                         ///< a multiple of its size: the excess lets the range,
                                         ///< once cached, grow in place for a larger request;
                                         ///< 1 means none
  std::size_t segment_reserve = 0;       ///< address space a new segment reserves, so that new
                                         ///< memory is mapped after its end and a block's tail
                                         ///< in its last handle serves the next request (as
                                         ///< expandable_segments); 0 means segments never grow
  int event_interval_us = 1000;          ///< on backends with events, while a stream's last
                                         ///< event is pending, its newer frees get one no
                                         ///< sooner than this many microseconds after it: one
                                         ///< event covers many frees (0: one per call that
                                         ///< freed; each record and query is a driver call)
  bool stream_join = false;              ///< on backends whose streams wait for events
                                         ///< (stream_joining_reserver), a request that other
                                         ///< streams' pending frees would serve makes its
                                         ///< stream wait on their events on the device and
                                         ///< takes those blocks now, instead of the host
                                         ///< waiting (docs/streams.md); as cudaMallocAsync's
                                         ///< internal dependencies

  /// Throws config_error naming the first setting that is out of range and why.
  void validate() const;

  // apply, from_env and to_string are defined in glake/config_io.hpp (the parser), which
  // glake.hpp includes; code that only passes a config to an allocator does not parse it.

  /// Applies a PYTORCH_CUDA_ALLOC_CONF-style string, "key:value,key:value", over this object and
  /// validates the result. Keys are the member names above (case-sensitive); whitespace around
  /// tokens and empty entries are ignored, a repeated key's last value wins, and null or empty
  /// text changes nothing. Sizes are a number, fractional allowed and rounded down to whole
  /// bytes, with an optional case-insensitive suffix B, K/KB/KiB, M/MB/MiB, G/GB/GiB or
  /// T/TB/TiB (every spelling a power of 1024, as in PyTorch); booleans accept
  /// true/false/1/0/yes/no/on/off. Throws config_error naming the key and why; `*this` is
  /// unchanged then.
  inline config& apply(const char* text);

  /// Defaults, then GMLake's variables (vmmDefragment, fragLimit, reuseLimit, defragLevel,
  /// autoGC, reAlloc), then GLAKE_ALLOC_CONF, which wins. Throws config_error naming the
  /// variable and the setting when one is malformed, and naming the setting and the variable
  /// that set it when the result fails validate().
  static inline config from_env();

  /// As from_env(), reading variables through `getenv(name)`, a callable returning
  /// `const char*` (null when unset), so tests and embedders need not touch the process
  /// environment. An empty value counts as unset, as `VAR= cmd` in a shell means "don't set".
  template <class Getenv>
  static inline config from_env(Getenv getenv);

  /// As from_env(getenv), over `base` (an embedder's own defaults) instead of config{}.
  template <class Getenv>
  static inline config from_env(Getenv getenv, const config& base);

  /// Every setting as "key:value,...", which `apply` parses back to an equal config.
  /// Sizes use the largest binary suffix that divides them exactly, so the text stays exact.
  inline std::string to_string() const;

  friend bool operator==(const config&, const config&) = default;
};

namespace detail {

inline constexpr std::string_view config_prefix = "glake config: ";

[[noreturn]] inline void config_fail(std::string_view why) {
  throw config_error(std::string(config_prefix).append(why));
}

/// Calls `visit(name, member)` for every setting in declaration order. The one list keeps
/// apply, to_string and the "valid keys" message from drifting apart.
template <class Config, class Visitor>
void for_each_config_field(Config& c, Visitor&& visit) {
  visit(std::string_view{"stitching"}, c.stitching);
  visit(std::string_view{"frag_limit"}, c.frag_limit);
  visit(std::string_view{"reuse_limit"}, c.reuse_limit);
  visit(std::string_view{"defrag_level"}, c.defrag_level);
  visit(std::string_view{"auto_gc"}, c.auto_gc);
  visit(std::string_view{"grow_stitch"}, c.grow_stitch);
  visit(std::string_view{"small_limit"}, c.small_limit);
  visit(std::string_view{"small_segment"}, c.small_segment);
  visit(std::string_view{"round_to"}, c.round_to);
  visit(std::string_view{"large_round_to"}, c.large_round_to);
  visit(std::string_view{"chunk_size"}, c.chunk_size);
  visit(std::string_view{"max_handle"}, c.max_handle);
  visit(std::string_view{"min_handles"}, c.min_handles);
  visit(std::string_view{"far_unmapped"}, c.far_unmapped);
  visit(std::string_view{"move_spares"}, c.move_spares);
  visit(std::string_view{"memory_limit"}, c.memory_limit);
  visit(std::string_view{"stitch_reserve"}, c.stitch_reserve);
  visit(std::string_view{"segment_reserve"}, c.segment_reserve);
  visit(std::string_view{"event_interval_us"}, c.event_interval_us);
  visit(std::string_view{"stream_join"}, c.stream_join);
}

/// The fewest significant digits that read back as the same value (17 always do), without an
/// exponent when one is not shorter: "10", not "1e+01". std::to_chars is locale-independent and
/// formats as printf's %.*g in the C locale, so the text is the same under any LC_NUMERIC.
inline std::string format_double(double value) {
  constexpr int most_digits = std::numeric_limits<double>::max_digits10;
  const auto format = [value](int digits) {
    char text[64];
    const auto written = std::to_chars(text, text + sizeof text, value, std::chars_format::general, digits);
    return std::string(text, written.ptr);
  };
  const auto reads_back = [value](const std::string& text) {
    double back = 0;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), back);
    return error == std::errc{} && end == text.data() + text.size() && back == value;
  };
  int digits = 1;
  for (; digits < most_digits; ++digits) {
    if (reads_back(format(digits))) break;
  }
  // %g-style output switches to an exponent once the exponent reaches the precision.
  const int exponent = std::isfinite(value) && value != 0
                           ? static_cast<int>(std::floor(std::log10(std::fabs(value))))
                           : 0;
  if (exponent >= digits && exponent < most_digits) digits = exponent + 1;
  return format(digits);
}

inline std::string format_setting(bool value) { return value ? "true" : "false"; }
inline std::string format_setting(int value) { return std::to_string(value); }
inline std::string format_setting(double value) { return format_double(value); }
inline std::string format_setting(std::size_t value) {
  static constexpr std::string_view names[] = {"TiB", "GiB", "MiB", "KiB"};
  for (std::size_t i = 0; i < 4; ++i) {
    const std::uint64_t scale = std::uint64_t{1} << (40 - 10 * i);
    if (value != 0 && value % scale == 0) {
      return std::to_string(value / scale).append(names[i]);
    }
  }
  return std::to_string(value);
}

struct config_issue {
  std::string_view setting;
  std::string message;
  std::string_view related = {};  ///< a second setting the rule ties `setting` to, if any
};

/// The first broken rule. round_to is checked before the sizes that refer to it, so the
/// message names the root cause rather than a setting that is only wrong relative to it.
inline std::optional<config_issue> find_config_issue(const config& c) {
  const auto issue = [](std::string_view setting, const std::string& why) {
    return config_issue{setting,
                        std::string(config_prefix).append(setting).append(" ").append(why)};
  };
  const auto got = [](auto value) { return " (got " + format_setting(value) + ")"; };
  const auto bytes = [](std::size_t value) { return std::to_string(value); };

  // Written as !(x >= 1) so that NaN fails too.
  if (!(c.reuse_limit >= 1.0)) return issue("reuse_limit", "must be >= 1" + got(c.reuse_limit));
  if (!std::isfinite(c.reuse_limit)) {
    return issue("reuse_limit", "must be finite" + got(c.reuse_limit));
  }
  if (!(c.stitch_reserve >= 1.0) || !(c.stitch_reserve <= 64.0)) {
    return issue("stitch_reserve", "must be from 1 to 64" + got(c.stitch_reserve));
  }
  if (c.defrag_level < 0 || c.defrag_level > 2) {
    return issue("defrag_level", "must be 0, 1 or 2" + got(c.defrag_level));
  }
  if (c.auto_gc == 0) return issue("auto_gc", "must be > 0 (got 0)");
  if (!std::has_single_bit(c.round_to) || c.round_to < 256 || c.round_to > 2 * MiB) {
    return issue("round_to", "must be a power of two from 256 to 2097152 (2 MiB), so that every "
                             "pointer is 256-byte aligned as CUDA code assumes (got " +
                                 bytes(c.round_to) + ")");
  }
  if (c.large_round_to != 0 && !std::has_single_bit(c.large_round_to)) {
    return issue("large_round_to", "must be 0 (the chunk size) or a power of two (got " + bytes(c.large_round_to) + ")");
  }
  if (c.small_segment == 0) return issue("small_segment", "must be > 0 (got 0)");
  // Powers of two, so that whole chunks of any power-of-two granularity up to them tile them:
  // then the allocator's constructor, which knows the granularity, rarely has to refuse them.
  if (!std::has_single_bit(c.small_segment)) {
    return issue("small_segment", "must be a power of two, a whole number of chunks (got " +
                                      bytes(c.small_segment) + ")");
  }
  if (c.small_segment % c.round_to != 0) {
    return issue("small_segment", "must be a multiple of round_to = " + bytes(c.round_to) +
                                      " (got " + bytes(c.small_segment) + ")");
  }
  if (c.small_limit != 0 && c.small_limit < c.round_to) {
    return issue("small_limit", "must be 0 (no small pool) or >= round_to = " + bytes(c.round_to) + " (got " +
                                    bytes(c.small_limit) + ")");
  }
  if (c.small_limit > c.small_segment) {
    return issue("small_limit", "must be <= small_segment = " + bytes(c.small_segment) + " (got " +
                                    bytes(c.small_limit) + ")");
  }
  // Only the page-size floor is checked here: the allocator compares chunk_size with the
  // provider's real granularity, which a config cannot know.
  if (c.chunk_size != 0 && (!std::has_single_bit(c.chunk_size) || c.chunk_size < 4 * KiB)) {
    return issue("chunk_size", "must be 0 (the backend's granularity) or a power of two from 4096 (got " +
                                   bytes(c.chunk_size) + ")");
  }
  if (c.chunk_size > c.small_segment) {
    auto found = issue("chunk_size", "must be at most small_segment = " + bytes(c.small_segment) +
                                         ", since the small pool borrows whole chunks (got " +
                                         bytes(c.chunk_size) + "); raise small_segment with it");
    found.related = "small_segment";
    return found;
  }
  if (c.max_handle % (4 * KiB) != 0) {
    return issue("max_handle", "must be 0 or a multiple of 4096 (got " + bytes(c.max_handle) + ")");
  }
  if (c.min_handles < 1) return issue("min_handles", "must be >= 1" + got(c.min_handles));
  if (c.event_interval_us < 0 || c.event_interval_us > 1'000'000) {
    return issue("event_interval_us", "must be from 0 to 1000000" + got(c.event_interval_us));
  }
  if (c.memory_limit != 0 && c.memory_limit < c.small_segment) {
    return issue("memory_limit",
                 "must be 0 (no limit) or >= small_segment = " + bytes(c.small_segment) + " (got " +
                     bytes(c.memory_limit) + ")");
  }
  return std::nullopt;
}

}  // namespace detail

inline void config::validate() const {
  if (auto issue = detail::find_config_issue(*this)) throw config_error(issue->message);
}

}  // namespace glake
