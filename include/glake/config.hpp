// Settings of glake's allocators, from code, GMLake's environment variables or GLAKE_ALLOC_CONF.
#pragma once

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <ios>
#include <limits>
#include <locale>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "errors.hpp"

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
  int event_interval_us = 1000;          ///< on backends with events, while a stream's last
                                         ///< event is pending, its newer frees get one no
                                         ///< sooner than this many microseconds after it: one
                                         ///< event covers many frees (0: one per call that
                                         ///< freed; each record and query is a driver call)

  /// Throws config_error naming the first setting that is out of range and why.
  void validate() const;

  /// Applies a PYTORCH_CUDA_ALLOC_CONF-style string, "key:value,key:value", over this object and
  /// validates the result. Keys are the member names above (case-sensitive); whitespace around
  /// tokens and empty entries are ignored, a repeated key's last value wins, and null or empty
  /// text changes nothing. Sizes are a number, fractional allowed and rounded down to whole
  /// bytes, with an optional case-insensitive suffix B, K/KB/KiB, M/MB/MiB, G/GB/GiB or
  /// T/TB/TiB (every spelling a power of 1024, as in PyTorch); booleans accept
  /// true/false/1/0/yes/no/on/off. Throws config_error naming the key and why; `*this` is
  /// unchanged then.
  config& apply(const char* text);

  /// Defaults, then GMLake's variables (vmmDefragment, fragLimit, reuseLimit, defragLevel,
  /// autoGC, reAlloc), then GLAKE_ALLOC_CONF, which wins. Throws config_error naming the
  /// variable and the setting when one is malformed, and naming the setting and the variable
  /// that set it when the result fails validate().
  static config from_env();

  /// As from_env(), reading variables through `getenv(name)`, a callable returning
  /// `const char*` (null when unset), so tests and embedders need not touch the process
  /// environment. An empty value counts as unset, as `VAR= cmd` in a shell means "don't set".
  template <class Getenv>
  static config from_env(Getenv getenv);

  /// As from_env(getenv), over `base` (an embedder's own defaults) instead of config{}.
  template <class Getenv>
  static config from_env(Getenv getenv, const config& base);

  /// Every setting as "key:value,...", which `apply` parses back to an equal config.
  /// Sizes use the largest binary suffix that divides them exactly, so the text stays exact.
  std::string to_string() const;

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
  visit(std::string_view{"event_interval_us"}, c.event_interval_us);
}

inline std::string_view trim(std::string_view text) {
  constexpr std::string_view space = " \t\n\r\v\f";
  const auto first = text.find_first_not_of(space);
  if (first == std::string_view::npos) return {};
  return text.substr(first, text.find_last_not_of(space) - first + 1);
}

// std::tolower depends on the C locale; setting names and suffixes are ASCII.
inline bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto lower = [](char c) {
      return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c;
    };
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

enum class parse_status { ok, malformed, overflow };

template <class Int>
parse_status parse_integer(std::string_view text, Int& out) {
  Int value{};
  const char* const last = text.data() + text.size();
  const auto [end, error] = std::from_chars(text.data(), last, value);
  if (text.empty() || end != last) return parse_status::malformed;
  if (error == std::errc::result_out_of_range) return parse_status::overflow;
  if (error != std::errc{}) return parse_status::malformed;
  out = value;
  return parse_status::ok;
}

// Classic-locale streams rather than strtod: under a German LC_NUMERIC strtod wants "1,5" and
// stops at the '.' of "1.5", which would break the to_string round trip. Rejects inf, nan and
// hex floats.
inline std::optional<double> parse_double(std::string_view text) {
  std::istringstream in{std::string(text)};
  in.imbue(std::locale::classic());
  double value = 0;
  in >> value;
  if (text.empty() || in.fail() || in.peek() != std::istringstream::traits_type::eof()) {
    return std::nullopt;
  }
  return value;
}

/// The fewest significant digits that parse_double reads back as the same value (17 always
/// do), without an exponent when one is not shorter: "10", not "1e+01".
inline std::string format_double(double value) {
  constexpr int most_digits = std::numeric_limits<double>::max_digits10;
  const auto format = [value](int digits) {
    std::ostringstream out;
    out.imbue(std::locale::classic());
    out.precision(digits);
    out << value;
    return out.str();
  };
  int digits = 1;
  for (; digits < most_digits; ++digits) {
    if (const auto back = parse_double(format(digits)); back && *back == value) break;
  }
  // %g-style output switches to an exponent once the exponent reaches the precision.
  const int exponent = std::isfinite(value) && value != 0
                           ? static_cast<int>(std::floor(std::log10(std::fabs(value))))
                           : 0;
  if (exponent >= digits && exponent < most_digits) digits = exponent + 1;
  return format(digits);
}

struct size_suffix {
  std::string_view names[3];
  unsigned shift;
};

// All powers of 1024 whatever the spelling, as PyTorch reads them.
inline constexpr size_suffix size_suffixes[] = {
    {{"t", "tb", "tib"}, 40}, {{"g", "gb", "gib"}, 30}, {{"m", "mb", "mib"}, 20},
    {{"k", "kb", "kib"}, 10}, {{"", "b", "b"}, 0},
};

/// Reads "<digits>[.<digits>][suffix]"; a fraction is rounded down to whole bytes.
inline parse_status parse_size(std::string_view text, std::size_t& out) {
  const auto digits_end = [&](std::size_t from) {
    while (from < text.size() && text[from] >= '0' && text[from] <= '9') ++from;
    return from;
  };
  std::size_t end = digits_end(0);
  const std::string_view whole = text.substr(0, end);
  std::string_view fraction;
  if (end < text.size() && text[end] == '.') {
    const std::size_t start = end + 1;
    end = digits_end(start);
    fraction = text.substr(start, end - start);
  }
  if (whole.empty() && fraction.empty()) return parse_status::malformed;

  const std::string_view suffix = trim(text.substr(end));
  const size_suffix* unit = nullptr;
  for (const auto& candidate : size_suffixes) {
    for (const auto name : candidate.names) {
      if (iequals(suffix, name)) unit = &candidate;
    }
  }
  if (unit == nullptr) return parse_status::malformed;
  // 64-bit arithmetic even where size_t is 32 bits, so "1T" reports overflow instead of
  // shifting past the width.
  const std::uint64_t scale = std::uint64_t{1} << unit->shift;

  std::uint64_t count = 0;
  if (!whole.empty()) {
    if (const auto status = parse_integer(whole, count); status != parse_status::ok) return status;
  }
  // Long multiplication of 0.<fraction> by scale, right to left: the final carry is
  // floor(0.<fraction> * scale), exact for any number of digits, and stays below scale, so
  // digit * scale + carry < 10 * 2^40 cannot overflow.
  std::uint64_t fraction_bytes = 0;
  for (auto digit = fraction.rbegin(); digit != fraction.rend(); ++digit) {
    fraction_bytes = (static_cast<std::uint64_t>(*digit - '0') * scale + fraction_bytes) / 10;
  }
  constexpr std::uint64_t most = std::numeric_limits<std::size_t>::max();
  if (count > (most - fraction_bytes) / scale) return parse_status::overflow;
  out = static_cast<std::size_t>(count * scale + fraction_bytes);
  return parse_status::ok;
}

/// Text from the environment as an error message shows it: control characters escaped (\n,
/// \t, \r, else \xNN) and at most the first 64 characters, then "...", so that a garbage
/// value cannot flood a log or forge lines in it.
inline std::string echoed(std::string_view text) {
  constexpr std::size_t most = 64;
  std::string out;
  for (std::size_t i = 0; i < text.size() && i < most; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c < 0x20 || c == 0x7f) {
      constexpr char hex[] = "0123456789abcdef";
      out.append("\\x").append(1, hex[c >> 4]).append(1, hex[c & 15]);
    } else {
      out += static_cast<char>(c);
    }
  }
  if (text.size() > most) out += "...";
  return out;
}

inline std::string quoted_setting(std::string_view key, std::string_view value) {
  return std::string(key).append("='").append(echoed(value)).append("'");
}

inline void parse_setting(std::string_view key, std::string_view value, bool& out) {
  for (const auto yes : {"true", "1", "yes", "on"}) {
    if (iequals(value, yes)) {
      out = true;
      return;
    }
  }
  for (const auto no : {"false", "0", "no", "off"}) {
    if (iequals(value, no)) {
      out = false;
      return;
    }
  }
  config_fail(quoted_setting(key, value) +
              " is not a boolean (use true/false, 1/0, yes/no, on/off)");
}

inline void parse_setting(std::string_view key, std::string_view value, std::size_t& out) {
  switch (parse_size(value, out)) {
    case parse_status::ok:
      return;
    case parse_status::overflow:
      config_fail(quoted_setting(key, value) + " overflows a byte count");
    case parse_status::malformed:
      break;
  }
  config_fail(
      quoted_setting(key, value) +
      " is not a byte count (use a number with an optional B, KiB, MiB, GiB or TiB suffix)");
}

inline void parse_setting(std::string_view key, std::string_view value, int& out) {
  switch (parse_integer(value, out)) {
    case parse_status::ok:
      return;
    case parse_status::overflow:
      config_fail(quoted_setting(key, value) + " is out of range for int");
    case parse_status::malformed:
      break;
  }
  config_fail(quoted_setting(key, value) + " is not an integer");
}

inline void parse_setting(std::string_view key, std::string_view value, double& out) {
  const auto parsed = parse_double(value);
  if (!parsed) config_fail(quoted_setting(key, value) + " is not a number");
  out = *parsed;
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

/// Applies "key:value,..." to `c` without validating it. Returns how many entries the text had;
/// `seen`, when given, receives their keys (views of static names, not of `text`).
inline std::size_t apply_config_text(config& c, std::string_view text,
                                     std::vector<std::string_view>* seen) {
  std::size_t applied = 0;
  for (;;) {
    const auto comma = text.find(',');
    // Empty entries are skipped so that a trailing comma, common in scripts, is harmless.
    if (const auto entry = trim(text.substr(0, comma)); !entry.empty()) {
      const auto colon = entry.find(':');
      if (colon == std::string_view::npos) {
        config_fail("'" + echoed(entry) + "' has no ':' (expected key:value)");
      }
      const auto key = trim(entry.substr(0, colon));
      const auto value = trim(entry.substr(colon + 1));
      std::string_view field_name;
      for_each_config_field(c, [&](std::string_view name, auto& field) {
        if (name != key) return;
        field_name = name;
        if (value.empty()) config_fail(echoed(key) + " has an empty value");
        parse_setting(key, value, field);
      });
      if (field_name.empty()) {
        std::string valid;
        for_each_config_field(c, [&](std::string_view name, const auto&) {
          valid.append(valid.empty() ? "" : ", ").append(name);
        });
        config_fail("unknown key '" + echoed(key) + "' (valid keys: " + valid + ")");
      }
      if (seen != nullptr) seen->push_back(field_name);
      ++applied;
    }
    if (comma == std::string_view::npos) return applied;
    text.remove_prefix(comma + 1);
  }
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

inline config& config::apply(const char* text) {
  if (text == nullptr) return *this;
  // Parsing a copy and assigning only after validation gives the strong guarantee.
  config updated = *this;
  if (detail::apply_config_text(updated, text, nullptr) == 0) return *this;
  updated.validate();
  *this = updated;
  return *this;
}

inline std::string config::to_string() const {
  std::string text;
  detail::for_each_config_field(*this, [&](std::string_view name, const auto& value) {
    text.append(text.empty() ? "" : ",")
        .append(name)
        .append(":")
        .append(detail::format_setting(value));
  });
  return text;
}

template <class Getenv>
config config::from_env(Getenv getenv, const config& base) {
  config c = base;
  // Who set each setting, latest last, so a range error can name the variable to fix.
  std::vector<std::pair<std::string_view, std::string>> sources;

  const auto read = [&](const char* name) -> std::optional<std::string> {
    const char* value = getenv(name);
    if (value == nullptr) return std::nullopt;
    const auto text = detail::trim(value);
    if (text.empty()) return std::nullopt;
    return std::string(text);
  };
  const auto describe = [](const char* name, const std::string& value) {
    return std::string("environment variable ") + name + "='" + detail::echoed(value) + "'";
  };
  const auto fail = [&](const char* name, const std::string& value, std::string_view why) {
    detail::config_fail(describe(name, value).append(" ").append(why));
  };
  // GMLake reads these with atoi/atof; glake is stricter, since a typo silently becoming 0
  // would switch stitching off.
  const auto read_int = [&](const char* name, std::string_view setting, auto assign) {
    const auto text = read(name);
    if (!text) return;
    int value = 0;
    if (const auto status = detail::parse_integer(*text, value);
        status != detail::parse_status::ok) {
      fail(name, *text,
           status == detail::parse_status::overflow ? "is out of range for int"
                                                    : "is not an integer");
    }
    assign(value);
    sources.emplace_back(setting, describe(name, *text));
  };
  const auto read_count = [&](const char* name, std::string_view setting, std::size_t unit,
                              const char* unit_name, std::size_t& out) {
    const auto text = read(name);
    if (!text) return;
    std::size_t value = 0;
    if (detail::parse_integer(*text, value) != detail::parse_status::ok ||
        value > std::numeric_limits<std::size_t>::max() / unit) {
      fail(name, *text, std::string("is not a ") + unit_name);
    }
    out = value * unit;
    sources.emplace_back(setting, describe(name, *text));
  };

  read_int("vmmDefragment", "stitching", [&](int value) { c.stitching = value > 0; });
  read_count("fragLimit", "frag_limit", 1, "byte count", c.frag_limit);
  if (const auto text = read("reuseLimit")) {
    const auto value = detail::parse_double(*text);
    if (!value) fail("reuseLimit", *text, "is not a number");
    c.reuse_limit = *value;
    sources.emplace_back("reuse_limit", describe("reuseLimit", *text));
  }
  read_int("defragLevel", "defrag_level", [&](int value) { c.defrag_level = value; });
  read_count("autoGC", "auto_gc", GiB, "whole number of GiB that fits in a byte count", c.auto_gc);
  read_int("reAlloc", "grow_stitch", [&](int value) { c.grow_stitch = value > 0; });

  if (const auto text = read("GLAKE_ALLOC_CONF")) {
    std::vector<std::string_view> keys;
    try {
      detail::apply_config_text(c, *text, &keys);
    } catch (const config_error& error) {
      const std::string_view why =
          std::string_view(error.what()).substr(detail::config_prefix.size());
      detail::config_fail(std::string("environment variable GLAKE_ALLOC_CONF: ").append(why));
    }
    for (const auto key : keys) sources.emplace_back(key, "GLAKE_ALLOC_CONF");
  }

  // Validated once at the end, so GLAKE_ALLOC_CONF can correct a GMLake variable.
  if (auto issue = detail::find_config_issue(c)) {
    // The variable that set the setting blamed; failing that, the one that set the setting it
    // is tied to (chunk_size:4MiB breaks only against small_segment's default, and the reverse).
    for (const std::string_view setting : {issue->setting, issue->related}) {
      if (setting.empty()) continue;
      const auto source = std::find_if(sources.rbegin(), sources.rend(),
                                       [&](const auto& entry) { return entry.first == setting; });
      if (source == sources.rend()) continue;
      issue->message.append(" (")
          .append(setting == issue->setting ? "" : std::string(setting).append(" "))
          .append("set by ")
          .append(source->second)
          .append(")");
      break;
    }
    throw config_error(issue->message);
  }
  return c;
}

template <class Getenv>
config config::from_env(Getenv getenv) {
  return from_env(std::move(getenv), config{});
}

inline config config::from_env() {
  // A lambda, not &std::getenv: the standard does not let programs take the address of most
  // library functions.
  return from_env([](const char* name) -> const char* { return std::getenv(name); });
}

}  // namespace glake
