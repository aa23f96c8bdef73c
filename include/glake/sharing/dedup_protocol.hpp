// The dedup broker's wire protocol: fixed-layout framed messages over a SOCK_SEQPACKET Unix
// socket, their encoding, and a parser that validates every field (docs/dedup.md has the table).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "glake/ipc/wire.hpp"
#include "glake/sharing/concepts.hpp"

namespace glake::dedup {

/// "GLKD" read as a little-endian u32; every message starts with it.
inline constexpr std::uint32_t protocol_magic = 0x444B4C47u;
/// Bumped on any change to a message's layout; the broker answers another version with
/// errc::unsupported_version and closes the connection.
inline constexpr std::uint16_t protocol_version = 1;
/// No message is longer: a longer one is a framing error.
inline constexpr std::size_t max_message_bytes = 512;
/// Longest error text a reply carries (longer text is cut).
inline constexpr std::size_t max_error_text = 256;
/// The largest object one publish may describe (1 TiB): a sanity bound, not a policy.
inline constexpr std::uint64_t max_object_bytes = std::uint64_t{1} << 40;

enum class message_type : std::uint16_t {
  hello = 1,      ///< client → broker: first message; no body
  publish = 2,    ///< client → broker: u64 bytes, 32-byte digest; exactly one descriptor
  release = 3,    ///< client → broker: u64 object id
  stats = 4,      ///< client → broker: no body
  hello_ok = 0x81,   ///< u32 version, u32 reserved, u64 broker pid
  published = 0x82,  ///< u64 object id, u32 outcome; the shared descriptor when outcome is shared
  released = 0x83,   ///< u64 object id, u64 references this connection still holds to it
  stats_reply = 0x84,///< broker_stats: seven u64
  error = 0xFF,      ///< u32 errc, u32 text length, text
};

/// What a publish came to.
enum class outcome : std::uint32_t {
  stored = 1,  ///< no equal object was known: the client's own object is now the shared copy
  shared = 2,  ///< an equal object was known: its descriptor comes with the reply
};

/// Error codes of error replies.
enum class errc : std::uint32_t {
  bad_message = 1,          ///< framing or field validation failed (connection closed after)
  unsupported_version = 2,  ///< closed after
  permission_denied = 3,    ///< the peer's credentials are not accepted (closed after)
  bad_descriptor = 4,       ///< missing, extra, or not an immutable object of the claimed size
  bad_size = 5,             ///< zero, above max_object_bytes
  unknown_object = 6,       ///< release of an object this connection does not hold
  out_of_descriptors = 7,   ///< the broker could not receive or keep a descriptor (EMFILE)
  too_many_objects = 8,     ///< the broker's object limit is reached
  unreadable = 9,           ///< the broker could not read an object to compare it
  over_quota = 10,          ///< the connection's objects would exceed max_client_bytes
};

inline const char* to_string(errc code) noexcept {
  switch (code) {
    case errc::bad_message: return "bad message";
    case errc::unsupported_version: return "unsupported protocol version";
    case errc::permission_denied: return "permission denied";
    case errc::bad_descriptor: return "bad descriptor";
    case errc::bad_size: return "bad size";
    case errc::unknown_object: return "unknown object";
    case errc::out_of_descriptors: return "broker out of file descriptors";
    case errc::too_many_objects: return "broker object limit reached";
    case errc::unreadable: return "object unreadable";
    case errc::over_quota: return "connection's quota reached";
  }
  return "unknown error";
}

/// The counters a stats request returns.
struct broker_stats {
  std::uint64_t clients = 0;       ///< connections open now
  std::uint64_t objects = 0;       ///< distinct shared objects indexed now
  std::uint64_t object_bytes = 0;  ///< their bytes (each counted once, however many map it)
  std::uint64_t references = 0;    ///< references held now, over all connections
  std::uint64_t publishes = 0;     ///< publish requests answered with an object, ever
  std::uint64_t shared = 0;        ///< of them, answered with an existing object
  std::uint64_t refused = 0;       ///< error replies sent, ever
};

/// The 16-byte header of every message (host byte order: both ends are on one machine).
using header = glake::detail::wire_header;
inline constexpr std::size_t header_bytes = 16;

// --- requests ---------------------------------------------------------------------------------
struct hello_request {};
struct publish_request {
  std::uint64_t bytes = 0;
  content_digest digest;
};
struct release_request {
  std::uint64_t object = 0;
};
struct stats_request {};

// --- replies -------------------------------------------------------------------------------------
struct hello_reply {
  std::uint32_t version = protocol_version;
  std::uint64_t pid = 0;
};
struct published_reply {
  std::uint64_t object = 0;
  outcome result = outcome::stored;
};
struct released_reply {
  std::uint64_t object = 0;
  std::uint64_t still_held = 0;
};
struct error_reply {
  errc code = errc::bad_message;
  std::string text;
};

using request = std::variant<hello_request, publish_request, release_request, stats_request>;
using reply = std::variant<hello_reply, published_reply, released_reply, broker_stats, error_reply>;

/// A message that failed validation: the error to answer with, and whether the stream can
/// still be trusted (false: framing is broken; answer, then close).
struct parse_error {
  errc code = errc::bad_message;
  std::string text;
  bool fatal = true;
};

namespace detail {

class writer : public glake::detail::wire_writer {
 public:
  writer(message_type type, std::uint32_t request)
      : wire_writer(protocol_magic, protocol_version, static_cast<std::uint16_t>(type), request) {}
  writer& put(const auto& value) {
    wire_writer::put(value);
    return *this;
  }
  writer& put_bytes(const void* data, std::size_t n) {
    wire_writer::put_bytes(data, n);
    return *this;
  }
};
using reader = glake::detail::wire_reader;

}  // namespace detail

// --- encoding --------------------------------------------------------------------------------------

inline std::vector<std::byte> encode(const hello_request&, std::uint32_t id) {
  return detail::writer(message_type::hello, id).finish();
}
inline std::vector<std::byte> encode(const publish_request& r, std::uint32_t id) {
  detail::writer w(message_type::publish, id);
  w.put(r.bytes).put_bytes(r.digest.bytes.data(), r.digest.bytes.size());
  return std::move(w).finish();
}
inline std::vector<std::byte> encode(const release_request& r, std::uint32_t id) {
  detail::writer w(message_type::release, id);
  w.put(r.object);
  return std::move(w).finish();
}
inline std::vector<std::byte> encode(const stats_request&, std::uint32_t id) {
  return detail::writer(message_type::stats, id).finish();
}
inline std::vector<std::byte> encode(const hello_reply& r, std::uint32_t id) {
  detail::writer w(message_type::hello_ok, id);
  w.put(r.version).put(std::uint32_t{0}).put(r.pid);
  return std::move(w).finish();
}
inline std::vector<std::byte> encode(const published_reply& r, std::uint32_t id) {
  detail::writer w(message_type::published, id);
  w.put(r.object).put(static_cast<std::uint32_t>(r.result)).put(std::uint32_t{0});
  return std::move(w).finish();
}
inline std::vector<std::byte> encode(const released_reply& r, std::uint32_t id) {
  detail::writer w(message_type::released, id);
  w.put(r.object).put(r.still_held);
  return std::move(w).finish();
}
inline std::vector<std::byte> encode(const broker_stats& s, std::uint32_t id) {
  detail::writer w(message_type::stats_reply, id);
  w.put(s.clients).put(s.objects).put(s.object_bytes).put(s.references).put(s.publishes).put(s.shared).put(s.refused);
  return std::move(w).finish();
}
inline std::vector<std::byte> encode(const error_reply& r, std::uint32_t id) {
  detail::writer w(message_type::error, id);
  const std::size_t n = r.text.size() < max_error_text ? r.text.size() : max_error_text;
  w.put(static_cast<std::uint32_t>(r.code)).put(static_cast<std::uint32_t>(n)).put_bytes(r.text.data(), n);
  return std::move(w).finish();
}

// --- parsing -----------------------------------------------------------------------------------------

/// The header of a message, validated: magic, version, type known, body length equal to what
/// follows the header. On failure a fatal parse_error (the broker answers and closes).
inline std::variant<header, parse_error> parse_header(std::span<const std::byte> bytes) {
  header h;
  bool wrong_version = false;
  std::string why = glake::detail::check_wire_header(bytes, protocol_magic, protocol_version, max_message_bytes,
                                                     "glake dedup", h, &wrong_version);
  if (!why.empty()) return parse_error{wrong_version ? errc::unsupported_version : errc::bad_message, std::move(why), true};
  return h;
}

/// A request from its bytes and the number of descriptors that came with it. Every field is
/// checked: the body's exact length for its type, sizes within bounds, exactly one descriptor
/// with a publish and none with anything else.
inline std::variant<request, parse_error> parse_request(std::span<const std::byte> bytes, std::size_t fds,
                                                       header* out_header = nullptr) {
  auto parsed = parse_header(bytes);
  if (auto* e = std::get_if<parse_error>(&parsed)) return std::move(*e);
  const header h = std::get<header>(parsed);
  if (out_header != nullptr) *out_header = h;
  detail::reader r(bytes.subspan(header_bytes));
  auto body_is = [&](std::size_t n) { return h.body == n; };
  auto no_fds = [&]() -> std::optional<parse_error> {
    if (fds != 0) return parse_error{errc::bad_descriptor, "descriptors sent with a message that takes none", true};
    return std::nullopt;
  };
  switch (static_cast<message_type>(h.type)) {
    case message_type::hello:
      if (!body_is(0)) return parse_error{errc::bad_message, "hello takes no body", true};
      if (auto e = no_fds()) return *e;
      return request{hello_request{}};
    case message_type::stats:
      if (!body_is(0)) return parse_error{errc::bad_message, "stats takes no body", true};
      if (auto e = no_fds()) return *e;
      return request{stats_request{}};
    case message_type::release: {
      if (!body_is(8)) return parse_error{errc::bad_message, "release takes an 8-byte body", true};
      if (auto e = no_fds()) return *e;
      release_request q;
      r.get(q.object);
      return request{q};
    }
    case message_type::publish: {
      if (!body_is(8 + 32)) return parse_error{errc::bad_message, "publish takes a 40-byte body", true};
      if (fds != 1) {
        return parse_error{errc::bad_descriptor, "publish takes exactly one descriptor, not " + std::to_string(fds), false};
      }
      publish_request q;
      r.get(q.bytes);
      for (auto& b : q.digest.bytes) r.get(b);
      if (q.bytes == 0 || q.bytes > max_object_bytes) {
        return parse_error{errc::bad_size, "publish of " + std::to_string(q.bytes) + " bytes (1 to 2^40 allowed)", false};
      }
      return request{q};
    }
    default:
      return parse_error{errc::bad_message, "unknown request type " + std::to_string(h.type), true};
  }
}

/// A reply from its bytes and the number of descriptors that came with it: exactly one with a
/// shared publish, none otherwise.
inline std::variant<reply, parse_error> parse_reply(std::span<const std::byte> bytes, std::size_t fds,
                                                   header* out_header = nullptr) {
  auto parsed = parse_header(bytes);
  if (auto* e = std::get_if<parse_error>(&parsed)) return std::move(*e);
  const header h = std::get<header>(parsed);
  if (out_header != nullptr) *out_header = h;
  detail::reader r(bytes.subspan(header_bytes));
  const auto type = static_cast<message_type>(h.type);
  const bool wants_fd = type == message_type::published;
  if (!wants_fd && fds != 0) return parse_error{errc::bad_descriptor, "descriptors with a reply that takes none", true};
  switch (type) {
    case message_type::hello_ok: {
      if (h.body != 16) return parse_error{errc::bad_message, "hello_ok takes a 16-byte body", true};
      hello_reply q;
      std::uint32_t reserved = 0;
      r.get(q.version);
      r.get(reserved);
      r.get(q.pid);
      return reply{q};
    }
    case message_type::published: {
      if (h.body != 16) return parse_error{errc::bad_message, "published takes a 16-byte body", true};
      published_reply q;
      std::uint32_t result = 0, reserved = 0;
      r.get(q.object);
      r.get(result);
      r.get(reserved);
      if (result != static_cast<std::uint32_t>(outcome::stored) && result != static_cast<std::uint32_t>(outcome::shared)) {
        return parse_error{errc::bad_message, "published with unknown outcome " + std::to_string(result), true};
      }
      q.result = static_cast<outcome>(result);
      if (fds != (q.result == outcome::shared ? 1u : 0u)) {
        return parse_error{errc::bad_descriptor, "published reply with " + std::to_string(fds) + " descriptors", true};
      }
      return reply{q};
    }
    case message_type::released: {
      if (h.body != 16) return parse_error{errc::bad_message, "released takes a 16-byte body", true};
      released_reply q;
      r.get(q.object);
      r.get(q.still_held);
      return reply{q};
    }
    case message_type::stats_reply: {
      if (h.body != 56) return parse_error{errc::bad_message, "stats_reply takes a 56-byte body", true};
      broker_stats s;
      r.get(s.clients);
      r.get(s.objects);
      r.get(s.object_bytes);
      r.get(s.references);
      r.get(s.publishes);
      r.get(s.shared);
      r.get(s.refused);
      return reply{s};
    }
    case message_type::error: {
      error_reply q;
      std::uint32_t code = 0, length = 0;
      if (!r.get(code) || !r.get(length) || length > max_error_text || length != r.left()) {
        return parse_error{errc::bad_message, "malformed error reply", true};
      }
      q.code = static_cast<errc>(code);
      q.text.assign(reinterpret_cast<const char*>(r.here()), length);
      return reply{std::move(q)};
    }
    default:
      return parse_error{errc::bad_message, "unknown reply type " + std::to_string(h.type), true};
  }
}

}  // namespace glake::dedup
