// What the operation-stream fuzz targets share: a reader that turns input bytes into arguments
// (zeros past the end) and a check that aborts, naming the target, the condition and the step.
#pragma once

#include <cinttypes>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace glake::fuzzing {

/// Reads the input front to back; past its end every read gives 0 and `done()` is true.
class byte_reader {
 public:
  byte_reader(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  bool done() const noexcept { return at_ >= size_; }
  std::uint8_t byte() noexcept { return at_ < size_ ? data_[at_++] : 0; }
  std::uint16_t u16() noexcept { return static_cast<std::uint16_t>(byte() | byte() << 8); }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t at_ = 0;
};

[[noreturn]] inline void fail(const char* target, const char* what, std::uint64_t step) {
  std::fprintf(stderr, "%s: check failed at operation %" PRIu64 ": %s\n", target, step, what);
  std::abort();
}

}  // namespace glake::fuzzing

/// Aborts with the condition's text when it is false; GLAKE_FUZZ_TARGET names the target.
#define GLAKE_FUZZ_CHECK(cond, step)                                          \
  do {                                                                        \
    if (!(cond)) ::glake::fuzzing::fail(GLAKE_FUZZ_TARGET, #cond, step);      \
  } while (0)
