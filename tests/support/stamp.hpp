// Page stamps: one word per 4 KiB page and the last byte identify who wrote a range, cheap to
// write and check, so a remapping or a move that loses or swaps memory shows. Shared by the tests
// and fuzz targets that check bytes through moving mappings.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace glake::testing {

inline void stamp(void* p, std::size_t bytes, std::uint64_t tag) {
  auto* b = static_cast<unsigned char*>(p);
  for (std::size_t offset = 0; offset + sizeof tag <= bytes; offset += 4096) {
    const std::uint64_t value = tag ^ offset;
    std::memcpy(b + offset, &value, sizeof value);
  }
  b[bytes - 1] = static_cast<unsigned char>(tag);
}

inline bool stamped(const void* p, std::size_t bytes, std::uint64_t tag) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t offset = 0; offset + sizeof tag <= bytes; offset += 4096) {
    std::uint64_t value;
    std::memcpy(&value, b + offset, sizeof value);
    if (value != (tag ^ offset)) return false;
  }
  return b[bytes - 1] == static_cast<unsigned char>(tag);
}

}  // namespace glake::testing
