// Text from another process (a workload's name) made safe to print: no control characters, no
// terminal escapes, so it cannot forge lines in a report or another process's error message.
#pragma once

#include <string>
#include <string_view>

namespace glake::detail {

/// `text` with every byte outside printable ASCII (0x20-0x7e) written as \n, \r, \t or \xNN, and
/// each backslash doubled, so that what is printed reads back unambiguously.
inline std::string printable(std::string_view text) {
  static constexpr char hex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c > 0x7e) {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += ch;
    }
  }
  return out;
}

}  // namespace glake::detail
