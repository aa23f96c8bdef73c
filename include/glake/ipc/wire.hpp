// The framing the socket protocols share: a 16-byte header (magic, version, type, request id,
// body length) in host byte order, a writer that appends fields, and a bounds-checked reader.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace glake::detail {

/// The header every message of a glake socket protocol opens with. Both ends are on one
/// machine, so fields are in host byte order.
struct wire_header {
  std::uint32_t magic = 0;
  std::uint16_t version = 0;
  std::uint16_t type = 0;
  std::uint32_t request = 0;  ///< chosen by the asker, echoed by the answer
  std::uint32_t body = 0;     ///< bytes after the header; must be exactly the rest of the message
};
inline constexpr std::size_t wire_header_bytes = 16;

/// Appends a header and then fields; finish() fills in the body length.
class wire_writer {
 public:
  wire_writer(std::uint32_t magic, std::uint16_t version, std::uint16_t type, std::uint32_t request) {
    put(magic).put(version).put(type).put(request).put(std::uint32_t{0});
  }
  template <class T>
  wire_writer& put(const T& value) {
    const auto* p = reinterpret_cast<const std::byte*>(&value);
    bytes_.insert(bytes_.end(), p, p + sizeof value);
    return *this;
  }
  wire_writer& put_bytes(const void* data, std::size_t n) {
    const auto* p = static_cast<const std::byte*>(data);
    bytes_.insert(bytes_.end(), p, p + n);
    return *this;
  }
  std::vector<std::byte> finish() && {
    const auto body = static_cast<std::uint32_t>(bytes_.size() - wire_header_bytes);
    std::memcpy(bytes_.data() + 12, &body, sizeof body);
    return std::move(bytes_);
  }

 private:
  std::vector<std::byte> bytes_;
};

/// Reads fields in order; get() is false (and reads nothing) past the end.
class wire_reader {
 public:
  explicit wire_reader(std::span<const std::byte> bytes) : bytes_(bytes) {}
  template <class T>
  bool get(T& value) noexcept {
    if (bytes_.size() - at_ < sizeof value) return false;
    std::memcpy(&value, bytes_.data() + at_, sizeof value);
    at_ += sizeof value;
    return true;
  }
  std::size_t left() const noexcept { return bytes_.size() - at_; }
  const std::byte* here() const noexcept { return bytes_.data() + at_; }
  void skip(std::size_t n) noexcept { at_ += n; }

 private:
  std::span<const std::byte> bytes_;
  std::size_t at_ = 0;
};

/// Why a header is not acceptable, or nothing: too short, longer than `max_bytes`, another
/// magic, another version (then `*wrong_version` is set), or a body length that differs from
/// what follows the header. `protocol` names the protocol in the text ("glake dedup").
inline std::string check_wire_header(std::span<const std::byte> bytes, std::uint32_t magic, std::uint16_t version,
                                     std::size_t max_bytes, const char* protocol, wire_header& h,
                                     bool* wrong_version = nullptr) {
  if (bytes.size() < wire_header_bytes) {
    return "message of " + std::to_string(bytes.size()) + " bytes, shorter than the 16-byte header";
  }
  if (bytes.size() > max_bytes) return "message longer than " + std::to_string(max_bytes) + " bytes";
  wire_reader r(bytes);
  r.get(h.magic);
  r.get(h.version);
  r.get(h.type);
  r.get(h.request);
  r.get(h.body);
  if (h.magic != magic) return std::string("bad magic number (not a ") + protocol + " message)";
  if (h.version != version) {
    if (wrong_version != nullptr) *wrong_version = true;
    return "protocol version " + std::to_string(h.version) + ", this end speaks " + std::to_string(version);
  }
  if (h.body != bytes.size() - wire_header_bytes) {
    return "the header's body length " + std::to_string(h.body) + " differs from the " +
           std::to_string(bytes.size() - wire_header_bytes) + " bytes received";
  }
  return {};
}

}  // namespace glake::detail
