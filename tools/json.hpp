// Text as a JSON string's contents, for the tools' JSON output.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>

namespace glake::tools {

/// `s` with '"' and '\\' escaped and control characters as \u00XX; other bytes as they are.
inline std::string json_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (const char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\';
    if (static_cast<unsigned char>(ch) < 0x20) {
      char buffer[8];
      std::snprintf(buffer, sizeof buffer, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(ch)));
      out += buffer;
    } else {
      out += ch;
    }
  }
  return out;
}

}  // namespace glake::tools
