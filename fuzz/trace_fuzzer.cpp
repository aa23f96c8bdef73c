// libFuzzer target: glake-replay's trace reader (tools/replay/trace.hpp) on arbitrary bytes,
// plain or gzip-compressed. A trace it accepts must be self-consistent; a trace it rejects must
// be rejected with trace_error. Anything else (another exception, a sanitizer report) is a crash.
//
// Plain text goes through parse_trace (from memory); gzip input through read_trace, which takes
// a path, so it is written to one memfd and read back through /proc/self/fd (no disk). Both
// name their source as that path, so a rejection is checked the same way.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <unordered_map>

#include "trace.hpp"

namespace {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "trace_fuzzer: check failed: %s\n", what);
  std::abort();
}
#define GLAKE_FUZZ_CHECK(cond) \
  do {                         \
    if (!(cond)) fail(#cond);  \
  } while (0)

glake::replay::trace parse(const std::uint8_t* data, std::size_t size) {
  static const int fd = ::memfd_create("trace_fuzzer", MFD_CLOEXEC);
  static const std::string path = "/proc/self/fd/" + std::to_string(fd);
  if (size < 2 || data[0] != 0x1f || data[1] != 0x8b) {
    return glake::replay::parse_trace(std::string_view(reinterpret_cast<const char*>(data), size), path, "fuzz");
  }
  if (fd < 0 || ::ftruncate(fd, 0) != 0 ||
      (size != 0 && ::pwrite(fd, data, size, 0) != static_cast<ssize_t>(size))) {
    std::perror("trace_fuzzer: memfd");
    std::abort();
  }
  return glake::replay::read_trace(path, "fuzz");
}

// What read_trace promises about a trace it accepts.
void check(const glake::replay::trace& t) {
  using kind = glake::replay::trace_event::kind;
  std::unordered_map<std::uint64_t, std::uint64_t> live;
  std::unordered_map<std::uint32_t, bool> streams;
  std::size_t allocations = 0, frees = 0, active = 0, peak = 0;
  for (const auto& e : t.events) {
    switch (e.what) {
      case kind::alloc:
        GLAKE_FUZZ_CHECK(live.emplace(e.id, e.bytes).second);
        streams[e.stream] = true;
        active += e.bytes;
        peak = std::max(peak, active);
        ++allocations;
        break;
      case kind::free: {
        const auto it = live.find(e.id);
        GLAKE_FUZZ_CHECK(it != live.end());
        GLAKE_FUZZ_CHECK(it->second == e.bytes);
        active -= e.bytes;
        live.erase(it);
        ++frees;
        break;
      }
      case kind::segment_alloc:
      case kind::segment_free:
        break;
      default:
        fail("unknown event kind");
    }
  }
  GLAKE_FUZZ_CHECK(allocations == t.allocations);
  GLAKE_FUZZ_CHECK(frees == t.frees);
  GLAKE_FUZZ_CHECK(peak == t.peak_active_bytes);
  GLAKE_FUZZ_CHECK(streams.size() == t.streams);
  GLAKE_FUZZ_CHECK(t.name == "fuzz");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    check(parse(data, size));
  } catch (const glake::replay::trace_error& e) {
    // Rejected: the message must name where.
    GLAKE_FUZZ_CHECK(std::string(e.what()).rfind("/proc/self/fd/", 0) == 0);
  }
  return 0;
}
