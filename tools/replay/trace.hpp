// Reading allocation traces: the line format of traces/README.md, gzip-compressed or plain.
#pragma once

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <unordered_set>
#include <utility>
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

/// The largest size a trace may name, 2^48 bytes (256 TiB): more than any device holds, and small
/// enough that 65536 of them still sum within 64 bits.
inline constexpr std::uint64_t max_trace_bytes = std::uint64_t{1} << 48;
/// The longest line a trace may hold, comments included; event lines are under 64 bytes.
inline constexpr std::size_t max_trace_line = 4096;

/// What one trace may cost, so that a small compressed file cannot make the reader inflate or
/// keep without end. The bundled traces hold at most 1.6 M events in 20 MB.
struct trace_limits {
  std::uint64_t max_text_bytes = std::uint64_t{1} << 30;  ///< the trace's text (inflated), 1 GiB
  std::size_t max_events = std::size_t{1} << 25;          ///< 32 M events (768 MiB of them)
};

/// A whole trace, checked: every free names a live allocation, no id is allocated twice.
struct trace {
  std::string name;
  std::string source;  ///< the file it came from (escaped for messages), or parse_trace's `source`
  std::vector<trace_event> events;
  std::size_t allocations = 0;
  std::size_t frees = 0;
  std::size_t peak_active_bytes = 0;      ///< from the a/f lines
  std::size_t recorded_peak_reserved = 0; ///< PyTorch's own, from the S/U lines (0 if none)
  std::uint32_t streams = 0;              ///< distinct stream numbers seen
  /// (event index, its line) wherever the events stop being on consecutive lines (comments,
  /// blank lines); see line_of.
  std::vector<std::pair<std::size_t, std::size_t>> line_breaks;

  /// The line (from 1) that event `index` came from.
  std::size_t line_of(std::size_t index) const {
    const auto after = std::upper_bound(line_breaks.begin(), line_breaks.end(), index,
                                        [](std::size_t i, const auto& b) { return i < b.first; });
    if (after == line_breaks.begin()) return index + 1;
    const auto& [first, line] = *(after - 1);
    return line + (index - first);
  }
};

/// A trace file that cannot be read or is malformed; the message names the file and line, and
/// every fragment of the input it quotes is escaped (\xNN) and cut short.
class trace_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

/// `text` safe to print: bytes outside printable ASCII as \xNN, and past `limit` bytes cut with
/// "..." and the full length, so that a hostile trace can neither drive the terminal nor flood it.
inline std::string printable(std::string_view text, std::size_t limit = std::string_view::npos) {
  std::string out;
  const std::string_view shown = text.substr(0, limit);
  for (const char ch : shown) {
    const auto byte = static_cast<unsigned char>(ch);
    if (byte < 0x20 || byte >= 0x7f) {
      constexpr char hex[] = "0123456789abcdef";
      out += "\\x";
      out += hex[byte >> 4];
      out += hex[byte & 0xf];
    } else {
      out += ch;
    }
  }
  if (shown.size() < text.size()) out += "...";
  return out;
}

/// A fragment of the input quoted for a message: `'abc'`, or `'abc...' (1001 bytes)` when cut.
inline std::string quoted(std::string_view text) {
  constexpr std::size_t limit = 32;
  std::string out = "'" + printable(text, limit) + "'";
  if (text.size() > limit) out += " (" + std::to_string(text.size()) + " bytes)";
  return out;
}

inline std::string default_name(std::string_view path) {
  std::string_view name = path.substr(path.find_last_of('/') + 1);
  for (const std::string_view suffix : {".gz", ".trace", ".txt"}) {
    if (name.size() > suffix.size() && name.substr(name.size() - suffix.size()) == suffix) {
      name.remove_suffix(suffix.size());
    }
  }
  return printable(name);
}

/// Builds a trace one line at a time, checking each; every error names source:line.
class trace_builder {
 public:
  trace_builder(std::string source, std::string name, trace_limits limits = {}) : limits_(limits) {
    t_.source = std::move(source);
    t_.name = std::move(name);
  }
  const trace_limits& limits() const noexcept { return limits_; }

  /// One line without its '\n' (a '\r' before it is dropped: CRLF files are accepted).
  void add_line(std::string_view line) {
    ++line_;
    if (const std::size_t nul = line.find('\0'); nul != std::string_view::npos) {
      fail("NUL byte at column " + std::to_string(nul + 1) + " (a binary file, or not a trace?)");
    }
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || line.front() == '#') return;
    split(line);
    if (fields_[0] == "a") {
      expect_fields(4);
      add_alloc(number<std::uint64_t>(fields_[1], "id"), size(fields_[2], "size"),
                number<std::uint32_t>(fields_[3], "stream"));
    } else if (fields_[0] == "f") {
      expect_fields(2);
      add_free(number<std::uint64_t>(fields_[1], "id"));
    } else if (fields_[0] == "S" || fields_[0] == "U") {
      expect_fields(2);
      add_segment(fields_[0] == "S", size(fields_[1], "segment size"));
    } else {
      fail("unknown record " + quoted(fields_[0]) + " (expected a, f, S or U)");
    }
  }

  /// Throws trace_error for the line last added.
  [[noreturn]] void fail(const std::string& message) const {
    throw trace_error(t_.source + ":" + std::to_string(line_) + ": " + message);
  }
  /// Throws trace_error for the line being read, not yet added.
  [[noreturn]] void fail_next(const std::string& message) const {
    throw trace_error(t_.source + ":" + std::to_string(line_ + 1) + ": " + message);
  }

  /// The checked trace; a trace without allocations is refused (there is nothing to replay).
  trace finish() && {
    if (t_.events.empty()) throw trace_error(t_.source + ": no events (an empty file, or only comments)");
    if (t_.allocations == 0) throw trace_error(t_.source + ": no allocations to replay (only S/U lines)");
    t_.streams = static_cast<std::uint32_t>(streams_.size());
    return std::move(t_);
  }

 private:
  void split(std::string_view line) {
    fields_.clear();
    for (std::size_t start = 0;;) {
      const std::size_t comma = line.find(',', start);
      fields_.push_back(line.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start));
      if (comma == std::string_view::npos || fields_.size() > 4) return;
      start = comma + 1;
    }
  }

  void expect_fields(std::size_t n) const {
    if (fields_.size() != n) {
      fail("'" + std::string(fields_[0]) + "' takes " + std::to_string(n - 1) + " fields, found " +
           (fields_.size() > 4 ? "more than 3" : std::to_string(fields_.size() - 1)));
    }
  }

  template <class T>
  T number(std::string_view text, const char* what) const {
    if (text.empty()) fail(std::string(what) + " is empty");
    T value{};
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (error == std::errc::result_out_of_range && end == text.data() + text.size()) {
      fail(std::string(what) + " " + quoted(text) + " is out of range (at most " +
           std::to_string(std::numeric_limits<T>::max()) + ")");
    }
    if (error != std::errc{} || end != text.data() + text.size()) {
      fail(std::string(what) + " " + quoted(text) + " is not a non-negative integer");
    }
    return value;
  }

  std::uint64_t size(std::string_view text, const char* what) const {
    const auto bytes = number<std::uint64_t>(text, what);
    if (bytes > max_trace_bytes) {
      fail(std::string(what) + " " + std::to_string(bytes) + " is more than 2^48 bytes (256 TiB), beyond any device");
    }
    return bytes;
  }

  void record(const trace_event& e) {
    if (t_.events.size() >= limits_.max_events) {
      fail("more than " + std::to_string(limits_.max_events) + " events, the limit (--max-events)");
    }
    // Keep line_of exact: note where this event's line is not the one after the previous event's.
    if (line_ - t_.events.size() != line_offset_) {
      line_offset_ = line_ - t_.events.size();
      t_.line_breaks.emplace_back(t_.events.size(), line_);
    }
    t_.events.push_back(e);
  }

  void add_alloc(std::uint64_t id, std::uint64_t bytes, std::uint32_t stream) {
    if (active_ > std::numeric_limits<std::uint64_t>::max() - bytes) fail("live allocations exceed 2^64 bytes");
    if (!live_.emplace(id, bytes).second) fail("allocation id " + std::to_string(id) + " is already live");
    streams_.insert(stream);
    active_ += bytes;
    t_.peak_active_bytes = std::max<std::size_t>(t_.peak_active_bytes, active_);
    ++t_.allocations;
    record({trace_event::kind::alloc, stream, id, bytes});
  }

  void add_free(std::uint64_t id) {
    const auto it = live_.find(id);
    if (it == live_.end()) fail("free of allocation id " + std::to_string(id) + ", which is not live");
    const std::uint64_t bytes = it->second;
    active_ -= bytes;
    live_.erase(it);
    ++t_.frees;
    record({trace_event::kind::free, 0, id, bytes});
  }

  void add_segment(bool reserve, std::uint64_t bytes) {
    if (reserve) {
      if (reserved_ > std::numeric_limits<std::uint64_t>::max() - bytes) fail("reserved segments exceed 2^64 bytes");
      reserved_ += bytes;
      t_.recorded_peak_reserved = std::max<std::size_t>(t_.recorded_peak_reserved, reserved_);
    } else {
      if (bytes > reserved_) fail("releases more segment bytes than were reserved");
      reserved_ -= bytes;
    }
    record({reserve ? trace_event::kind::segment_alloc : trace_event::kind::segment_free, 0, 0, bytes});
  }

  trace_limits limits_;
  trace t_;
  std::unordered_map<std::uint64_t, std::uint64_t> live_;  // id -> bytes
  std::unordered_set<std::uint32_t> streams_;
  std::uint64_t active_ = 0, reserved_ = 0;
  std::size_t line_ = 0;
  std::size_t line_offset_ = 1;  // line - event index while events sit on consecutive lines
  std::vector<std::string_view> fields_;
};

/// Splits text arriving in chunks into lines for a trace_builder, holding at most one line.
class line_splitter {
 public:
  explicit line_splitter(trace_builder& builder) : builder_(builder) {}

  void feed(std::string_view chunk) {
    if (chunk.size() > builder_.limits().max_text_bytes - std::min(fed_, builder_.limits().max_text_bytes)) {
      builder_.fail_next("the trace is longer than " + std::to_string(builder_.limits().max_text_bytes) +
                         " bytes (inflated), the limit (--max-trace-bytes)");
    }
    fed_ += chunk.size();
    for (;;) {
      const std::size_t newline = chunk.find('\n');
      const std::string_view part = chunk.substr(0, newline);
      if (pending_.size() + part.size() > max_trace_line) {
        builder_.fail_next("line longer than " + std::to_string(max_trace_line) + " bytes (not a trace?)");
      }
      if (newline == std::string_view::npos) {
        pending_.append(part);
        return;
      }
      if (pending_.empty()) {
        builder_.add_line(part);
      } else {
        pending_.append(part);
        builder_.add_line(pending_);
        pending_.clear();
      }
      chunk.remove_prefix(newline + 1);
    }
  }

  /// The last line may lack its newline.
  void finish() {
    if (!pending_.empty()) builder_.add_line(pending_);
    pending_.clear();
  }

 private:
  trace_builder& builder_;
  std::string pending_;
  std::uint64_t fed_ = 0;
};

}  // namespace detail

/// Parses and checks a trace held in memory; touches no file. This is the reader's whole logic:
/// read_trace only adds the file and gzip around it.
///
/// Contract (what a fuzz target may rely on): for any `text` whatsoever it returns a checked trace
/// or throws glake::replay::trace_error, whose message begins "<source>:<line>: " (or "<source>: "
/// for a trace with no events or no allocations) and quotes input only escaped and cut short. It
/// throws nothing else, never aborts, and uses memory linear in text.size(); only std::bad_alloc
/// can escape, when the host itself runs out of memory. `source` names the input in messages
/// (escaped here); `name` defaults to the last path component of `source` without .gz/.trace/.txt.
inline trace parse_trace(std::string_view text, std::string_view source = "<memory>", std::string name = {},
                         trace_limits limits = {}) {
  detail::trace_builder builder(detail::printable(source), name.empty() ? detail::default_name(source) : std::move(name),
                                limits);
  detail::line_splitter lines(builder);
  lines.feed(text);
  lines.finish();
  return std::move(builder).finish();
}

/// Told, after each chunk read_trace reads, the bytes of the file read so far (compressed, for a
/// gzip file) and the file's size (0 when unknown).
using read_progress = std::function<void(std::uint64_t read, std::uint64_t file_bytes)>;

namespace detail {
// The body of read_trace: every chunk of the file through `lines`, then the stream's status.
inline void read_chunks(gzFile file, const std::string& path, trace_builder& builder, line_splitter& lines,
                        std::vector<char>& buffer, const read_progress& progress, std::uint64_t file_bytes) {
  int read_errno = 0;
  for (;;) {
    errno = 0;
    const int n = gzread(file, buffer.data(), static_cast<unsigned>(buffer.size()));
    if (n <= 0) {  // the end, or an error reported below
      read_errno = errno;
      break;
    }
    lines.feed(std::string_view(buffer.data(), static_cast<std::size_t>(n)));
    if (progress) {
      const z_off_t offset = gzoffset(file);
      progress(offset > 0 ? static_cast<std::uint64_t>(offset) : 0, file_bytes);
    }
  }
  int error = Z_OK;
  std::string_view message = gzerror(file, &error);
  if (error == Z_ERRNO) builder.fail_next(std::string("cannot read: ") + std::strerror(read_errno != 0 ? read_errno : EIO));
  if (error != Z_OK && error != Z_STREAM_END) {
    // zlib's message repeats the path; the reason follows it.
    if (message.size() > path.size() + 2 && message.substr(0, path.size()) == path) message.remove_prefix(path.size() + 2);
    builder.fail_next("cannot read: " + printable(message) + " (truncated or corrupt file?)");
  }
  lines.finish();
}
}  // namespace detail

/// Reads and checks a trace file. `name` defaults to the file name without directories and
/// suffixes. zlib reads gzip and plain files alike. Throws trace_error naming the file and line on
/// bad input (see parse_trace, plus a file that cannot be opened or read and a truncated or corrupt
/// gzip stream), so nothing is ever replayed from a damaged file. `progress`, when given, is told
/// how far the reading got after each chunk (1 MiB of text).
inline trace read_trace(const std::string& path, std::string name = {}, trace_limits limits = {},
                        const read_progress& progress = {}) {
  const std::string source = detail::printable(path);
  errno = 0;
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) {
    throw trace_error(source + ": cannot open" + (errno != 0 ? std::string(": ") + std::strerror(errno) : std::string()));
  }
  struct closer {
    gzFile f;
    ~closer() { gzclose(f); }
  } guard{file};
  gzbuffer(file, 1 << 20);

  detail::trace_builder builder(source, name.empty() ? detail::default_name(path) : std::move(name), limits);
  detail::line_splitter lines(builder);
  std::vector<char> buffer(1 << 20);
  try {
    std::error_code size_error;
    const std::uintmax_t file_bytes = progress ? std::filesystem::file_size(path, size_error) : 0;
    detail::read_chunks(file, path, builder, lines, buffer, progress, size_error ? 0 : file_bytes);
  } catch (const std::bad_alloc&) {
    builder.fail_next("out of host memory reading the trace (lower --max-events or --max-trace-bytes)");
  }
  return std::move(builder).finish();
}


}  // namespace glake::replay
