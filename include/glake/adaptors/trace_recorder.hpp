// Recording an allocator's requests in glake-replay's trace format (traces/README.md): the
// recorder of one device's requests, and the file name each device's trace goes to.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "glake/stream.hpp"

namespace glake {

/// Writes one device's requests in the line format glake-replay reads (traces/README.md):
/// `a,<id>,<bytes>,<stream>` for each allocation (the bytes asked for), `f,<id>` for each free,
/// and `S,<bytes>` / `U,<bytes>` whenever the allocator's reserved bytes rose or fell, so the
/// S/U lines sum to the allocator's own reserved bytes and their peak is its peak reserved.
/// Streams are numbered in order of first use, the null stream being 0; ids count from 0.
/// Failed requests and frees of unknown pointers become `#` comments, which readers skip.
///
/// The `f` line goes where the memory became reusable: the adaptor calls `freeing` when the
/// allocator says so (for a free that waits for other streams' work, PyTorch's record_stream,
/// that is a later call), so a replay, whose frees all complete at once, meets the same free
/// memory. Such a free's request is written as `# deferred free <id>` (`deferred`), and each
/// record_stream as `# record_stream <id> <stream>` (`recorded_stream`), for readers that count
/// them.
///
/// Thread safety: every member may be called from any thread (one mutex). Write failures are
/// reported once through `log` and end the recording; nothing here throws.
class trace_recorder {
 public:
  /// Takes ownership of `out` (closed by the destructor). `header` lines are written as comments.
  trace_recorder(std::FILE* out, const std::vector<std::string>& header) : out_(out) {
    std::setvbuf(out_, nullptr, _IOFBF, std::size_t{1} << 20);
    for (const auto& line : header) {
      // Readers take lines of up to 255 characters.
      std::fprintf(out_, "# %.240s\n", line.c_str());
    }
  }
  trace_recorder(const trace_recorder&) = delete;
  trace_recorder& operator=(const trace_recorder&) = delete;
  /// A recorder writing to a new file at `path`, or null when it cannot be opened.
  static std::unique_ptr<trace_recorder> open(const std::string& path, const std::vector<std::string>& header) {
    std::FILE* f = std::fopen(path.c_str(), "w");
    return f == nullptr ? nullptr : std::make_unique<trace_recorder>(f, header);
  }
  ~trace_recorder() {
    if (out_ != nullptr) std::fclose(out_);
  }

  /// An allocation of `bytes` at `p` on `stream` succeeded; the allocator now reserves `reserved`.
  void allocated(const void* p, std::size_t bytes, stream_ref stream, std::size_t reserved) noexcept {
    std::lock_guard guard(mutex_);
    if (out_ == nullptr) return;
    try {
      reserved_locked(reserved);
      const std::uint64_t id = next_id_++;
      ids_[reinterpret_cast<std::uintptr_t>(p)] = id;
      std::fprintf(out_, "a,%llu,%zu,%u\n", static_cast<unsigned long long>(id), bytes, number_of(stream));
    } catch (...) {
      fail_locked();
    }
  }

  /// `p`'s memory is reusable: call before the allocator can hand it out again (before
  /// deallocating, or from its free_completed event), so that no allocation that reuses the
  /// address can be written before this free.
  void freeing(const void* p) noexcept {
    std::lock_guard guard(mutex_);
    if (out_ == nullptr) return;
    const auto it = ids_.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == ids_.end()) {
      std::fprintf(out_, "# free of %p, which this trace did not see allocated\n", p);
      return;
    }
    std::fprintf(out_, "f,%llu\n", static_cast<unsigned long long>(it->second));
    ids_.erase(it);
  }

  /// `p`'s free was asked for but its memory is not reusable yet (freeing comes later): a comment,
  /// when `p` is still live in this trace.
  void deferred(const void* p) noexcept {
    std::lock_guard guard(mutex_);
    if (out_ == nullptr) return;
    const auto it = ids_.find(reinterpret_cast<std::uintptr_t>(p));
    if (it != ids_.end()) std::fprintf(out_, "# deferred free %llu\n", static_cast<unsigned long long>(it->second));
  }

  /// The live allocation at `p` is also used by work on `stream` (a comment).
  void recorded_stream(const void* p, stream_ref stream) noexcept {
    std::lock_guard guard(mutex_);
    if (out_ == nullptr) return;
    try {
      const auto it = ids_.find(reinterpret_cast<std::uintptr_t>(p));
      if (it != ids_.end()) {
        std::fprintf(out_, "# record_stream %llu %u\n", static_cast<unsigned long long>(it->second), number_of(stream));
      }
    } catch (...) {
      fail_locked();
    }
  }

  /// The allocator now reserves `reserved` bytes (after a free or a release of cached memory).
  void reserved(std::size_t reserved) noexcept {
    std::lock_guard guard(mutex_);
    if (out_ != nullptr) reserved_locked(reserved);
  }

  void failed(std::size_t bytes, stream_ref stream) noexcept {
    std::lock_guard guard(mutex_);
    if (out_ == nullptr) return;
    try {
      std::fprintf(out_, "# failed: %zu bytes on stream %u\n", bytes, number_of(stream));
    } catch (...) {
      fail_locked();
    }
  }

  void flush() noexcept {
    std::lock_guard guard(mutex_);
    if (out_ != nullptr && std::fflush(out_) != 0) fail_locked();
  }

  /// False once recording stopped (a write failed).
  bool recording() const noexcept {
    std::lock_guard guard(mutex_);
    return out_ != nullptr;
  }

 private:
  void reserved_locked(std::size_t now) {
    if (now > reserved_) std::fprintf(out_, "S,%zu\n", now - reserved_);
    if (now < reserved_) std::fprintf(out_, "U,%zu\n", reserved_ - now);
    reserved_ = now;
  }
  std::uint32_t number_of(stream_ref stream) {
    if (stream == default_stream) return 0;
    for (const auto& [known, number] : streams_) {
      if (known == stream) return number;
    }
    const auto number = static_cast<std::uint32_t>(streams_.size() + 1);
    streams_.emplace_back(stream, number);
    return number;
  }
  void fail_locked() noexcept {
    std::fclose(out_);
    out_ = nullptr;
    ids_.clear();
  }

  mutable std::mutex mutex_;
  std::FILE* out_;
  std::uint64_t next_id_ = 0;
  std::size_t reserved_ = 0;
  std::unordered_map<std::uintptr_t, std::uint64_t> ids_;
  std::vector<std::pair<stream_ref, std::uint32_t>> streams_;
};

/// The file a device's trace goes to, from a pattern: `%d` becomes the device, `%p` the process
/// id, `%r` the `rank` given (e.g. torchrun's RANK; "0" when empty) and `%%` a percent sign. A
/// pattern without `%d` names device 0's file; other devices insert `.dev<N>` before a final
/// `.trace` (or append it), so that several devices never share a file.
inline std::string trace_file_name(std::string_view pattern, int device, long pid, std::string_view rank) {
  std::string out;
  bool has_device = false;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] != '%' || i + 1 == pattern.size()) {
      out += pattern[i];
      continue;
    }
    switch (pattern[++i]) {
      case 'd':
        out += std::to_string(device);
        has_device = true;
        break;
      case 'p':
        out += std::to_string(pid);
        break;
      case 'r':
        out += rank.empty() ? std::string_view("0") : rank;
        break;
      case '%':
        out += '%';
        break;
      default:
        out += '%';
        out += pattern[i];
    }
  }
  if (!has_device && device != 0) {
    const std::string tag = ".dev" + std::to_string(device);
    constexpr std::string_view suffix = ".trace";
    if (out.size() > suffix.size() && out.compare(out.size() - suffix.size(), suffix.size(), suffix) == 0) {
      out.insert(out.size() - suffix.size(), tag);
    } else {
      out += tag;
    }
  }
  return out;
}

}  // namespace glake
