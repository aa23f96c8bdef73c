// Reading allocation traces: the line format of traces/README.md, gzip-compressed or plain.
#pragma once

#include <zlib.h>

#include <charconv>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace glake::replay {

/// One line of a trace. `a,<id>,<bytes>,<stream>` allocates, `f,<id>` frees, `S,<bytes>` and
/// `U,<bytes>` record the segments PyTorch's own allocator reserved and released.
struct trace_event {
  enum class kind : std::uint8_t { alloc, free, segment_alloc, segment_free };
  kind what;
  std::uint32_t stream = 0;
  std::uint64_t id = 0;     ///< allocation id (alloc and free)
  std::uint64_t bytes = 0;  ///< request size (alloc), segment size (S/U); frees carry the
                            ///< size of what they free, filled in by the reader
};

/// A whole trace, checked: every free names a live allocation, no id is allocated twice.
struct trace {
  std::string name;
  std::vector<trace_event> events;
  std::size_t allocations = 0;
  std::size_t frees = 0;
  std::size_t peak_active_bytes = 0;      ///< from the a/f lines
  std::size_t recorded_peak_reserved = 0; ///< PyTorch's own, from the S/U lines (0 if none)
  std::uint32_t streams = 0;              ///< distinct stream numbers seen
};

/// A trace file that cannot be read or is malformed; the message names the file and line.
class trace_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

template <class T>
T parse_number(std::string_view text, const std::string& where, const char* what) {
  T value{};
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc{} || end != text.data() + text.size() || text.empty()) {
    throw trace_error(where + ": " + what + " '" + std::string(text) + "' is not a non-negative integer");
  }
  return value;
}

inline std::vector<std::string_view> split_commas(std::string_view line) {
  std::vector<std::string_view> fields;
  std::size_t start = 0;
  for (;;) {
    const std::size_t comma = line.find(',', start);
    fields.push_back(line.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start));
    if (comma == std::string_view::npos) return fields;
    start = comma + 1;
  }
}

}  // namespace detail

/// Reads and checks a trace. `name` defaults to the file name without directories and suffixes.
/// zlib reads gzip and plain files alike. Throws trace_error naming the file and line on bad input
/// (unknown record, wrong field count, bad number, free of an unknown id, id reused, a truncated
/// gzip stream), so nothing is ever replayed from a damaged file.
inline trace read_trace(const std::string& path, std::string name = {}) {
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) throw trace_error(path + ": cannot open");
  struct closer {
    gzFile f;
    ~closer() { gzclose(f); }
  } guard{file};
  gzbuffer(file, 1 << 20);

  trace t;
  if (name.empty()) {
    name = path.substr(path.find_last_of('/') + 1);
    for (const char* suffix : {".gz", ".trace", ".txt"}) {
      const std::string_view s(suffix);
      if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0) {
        name.resize(name.size() - s.size());
      }
    }
  }
  t.name = std::move(name);

  std::unordered_map<std::uint64_t, std::uint64_t> live;  // id -> bytes
  std::unordered_map<std::uint32_t, bool> streams;
  std::size_t active = 0, reserved = 0;
  char buffer[256];
  std::size_t line_number = 0;
  while (gzgets(file, buffer, sizeof buffer) != nullptr) {
    ++line_number;
    std::string_view line(buffer);
    const std::string where = path + ":" + std::to_string(line_number);
    if (line.empty() || line.back() != '\n') {
      // Only the last line may lack its newline; in a cut-short gzip stream it is a fragment.
      int error = Z_OK;
      const char* message = gzerror(file, &error);
      if (error != Z_OK && error != Z_STREAM_END) {
        throw trace_error(where + ": cannot read: " + message + " (truncated or corrupt file?)");
      }
      if (!gzeof(file)) throw trace_error(where + ": line too long");
    }
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.remove_suffix(1);
    if (line.empty() || line.front() == '#') continue;
    const auto fields = detail::split_commas(line);
    trace_event e{};
    const auto expect_fields = [&](std::size_t n) {
      if (fields.size() != n) {
        throw trace_error(where + ": '" + std::string(fields[0]) + "' takes " + std::to_string(n - 1) +
                          " fields, found " + std::to_string(fields.size() - 1));
      }
    };
    if (fields[0] == "a") {
      expect_fields(4);
      e.what = trace_event::kind::alloc;
      e.id = detail::parse_number<std::uint64_t>(fields[1], where, "id");
      e.bytes = detail::parse_number<std::uint64_t>(fields[2], where, "size");
      e.stream = detail::parse_number<std::uint32_t>(fields[3], where, "stream");
      if (!live.emplace(e.id, e.bytes).second) {
        throw trace_error(where + ": allocation id " + std::to_string(e.id) + " is already live");
      }
      streams[e.stream] = true;
      active += e.bytes;
      t.peak_active_bytes = std::max(t.peak_active_bytes, active);
      ++t.allocations;
    } else if (fields[0] == "f") {
      expect_fields(2);
      e.what = trace_event::kind::free;
      e.id = detail::parse_number<std::uint64_t>(fields[1], where, "id");
      const auto it = live.find(e.id);
      if (it == live.end()) {
        throw trace_error(where + ": free of allocation id " + std::to_string(e.id) + ", which is not live");
      }
      e.bytes = it->second;
      active -= it->second;
      live.erase(it);
      ++t.frees;
    } else if (fields[0] == "S" || fields[0] == "U") {
      expect_fields(2);
      e.bytes = detail::parse_number<std::uint64_t>(fields[1], where, "segment size");
      if (fields[0] == "S") {
        e.what = trace_event::kind::segment_alloc;
        reserved += e.bytes;
        t.recorded_peak_reserved = std::max(t.recorded_peak_reserved, reserved);
      } else {
        e.what = trace_event::kind::segment_free;
        if (e.bytes > reserved) throw trace_error(where + ": releases more segment bytes than were reserved");
        reserved -= e.bytes;
      }
    } else {
      throw trace_error(where + ": unknown record '" + std::string(fields[0]) + "' (expected a, f, S or U)");
    }
    t.events.push_back(e);
  }
  int error = Z_OK;
  const char* message = gzerror(file, &error);
  if (error != Z_OK && error != Z_STREAM_END) {
    throw trace_error(path + ":" + std::to_string(line_number + 1) + ": cannot read: " + message +
                      " (truncated or corrupt file?)");
  }
  t.streams = static_cast<std::uint32_t>(streams.size());
  return t;
}

}  // namespace glake::replay
