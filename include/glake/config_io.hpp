// The parser of glake::config: PYTORCH_CUDA_ALLOC_CONF-style text (config::apply), the
// environment (config::from_env) and back (config::to_string).
#pragma once

#include <algorithm>
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

#include "glake/config.hpp"
#include "glake/errors.hpp"

namespace glake {

namespace detail {

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

}  // namespace detail

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
