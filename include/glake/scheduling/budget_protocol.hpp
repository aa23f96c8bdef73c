// The budget coordinator's wire protocol: framed messages over a SOCK_SEQPACKET Unix socket
// between workloads and the coordinator, their encoding, and parsers that refuse every
// malformed message (docs/scheduling.md has the table).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "glake/ipc/wire.hpp"
#include "glake/scheduling/budget_ledger.hpp"

namespace glake::budget_wire {

/// "GLKB" read as a little-endian u32; every message starts with it.
inline constexpr std::uint32_t protocol_magic = 0x424B4C47u;
/// Bumped on any change to a message's layout; the coordinator answers another version with
/// errc::unsupported_version and closes the connection.
inline constexpr std::uint16_t protocol_version = 1;
/// No message is longer: a longer one is a framing error (a stats reply lists fewer workloads).
inline constexpr std::size_t max_message_bytes = 8192;
/// Longest workload name (bytes; 1 at least).
inline constexpr std::size_t max_name_bytes = 128;
/// Longest error text an error carries (longer text is cut).
inline constexpr std::size_t max_error_text = 2048;

enum class message_type : std::uint16_t {
  // workload → coordinator; join, acquire and stats are answered, the others only when refused
  join = 1,           ///< u64 pinned, u32 name length, u32 reserved, name
  leave = 2,          ///< u32 workload, u32 reserved
  acquire = 3,        ///< u32 workload, u32 flags (1: no wait), u32 timeout ms, u32 reserved, u64 bytes
  release = 4,        ///< u32 workload, u32 reserved, u64 bytes
  set_pinned = 5,     ///< u32 workload, u32 reserved, u64 bytes
  set_predicted = 6,  ///< u32 workload, u32 reserved, u64 bytes
  stats = 7,          ///< no body
  reclaimed = 8,      ///< the answer to a reclaim (same request id): u64 bytes given back
  // coordinator → workload
  joined = 0x81,       ///< u32 workload, u32 reserved, u64 budget
  granted = 0x82,      ///< u32 workload, u32 reserved, u64 bytes
  stats_reply = 0x83,  ///< u64 budget, u64 used, u32 workloads, u32 listed, then per listed one:
                       ///< u32 id, u32 name length, u64 held, u64 pinned, u64 predicted, name
  reclaim = 0x90,      ///< the coordinator asks (its own request id): u64 bytes wanted, u32 flags
                       ///< (1: memory pinned by workloads that wait too), u32 reserved
  error = 0xFF,        ///< u32 errc, u32 text length, text
};

/// Error codes of error replies.
enum class errc : std::uint32_t {
  bad_message = 1,          ///< framing or field validation failed (connection closed after)
  unsupported_version = 2,  ///< closed after
  permission_denied = 3,    ///< the peer's credentials are not accepted (closed after)
  out_of_memory = 4,        ///< more than the whole budget, or no room within the timeout
  no_room = 5,              ///< a no-wait acquire that does not fit now
  unknown_workload = 6,     ///< a workload this connection did not join (or that left)
  bad_size = 7,             ///< releasing more than held
  too_many = 8,             ///< the coordinator's connection or workload limit is reached
};

inline const char* to_string(errc code) noexcept {
  switch (code) {
    case errc::bad_message: return "bad message";
    case errc::unsupported_version: return "unsupported protocol version";
    case errc::permission_denied: return "permission denied";
    case errc::out_of_memory: return "out of memory";
    case errc::no_room: return "no room now";
    case errc::unknown_workload: return "unknown workload";
    case errc::bad_size: return "bad size";
    case errc::too_many: return "coordinator limit reached";
  }
  return "unknown error";
}

using header = glake::detail::wire_header;
inline constexpr std::size_t header_bytes = glake::detail::wire_header_bytes;

// --- workload → coordinator -------------------------------------------------------------------
struct join_request {
  std::string name;
  std::uint64_t pinned = 0;
};
struct leave_request {
  workload_id workload = 0;
};
struct acquire_request {
  workload_id workload = 0;
  std::uint64_t bytes = 0;
  std::uint32_t timeout_ms = 0;
  bool wait = true;  ///< false: granted now or refused with no_room, nothing moved out
};
struct release_request {
  workload_id workload = 0;
  std::uint64_t bytes = 0;
};
struct set_pinned_request {
  workload_id workload = 0;
  std::uint64_t bytes = 0;
};
struct set_predicted_request {
  workload_id workload = 0;
  std::uint64_t bytes = 0;
};
struct stats_request {};
struct reclaimed_reply {
  std::uint64_t bytes = 0;
};

// --- coordinator → workload ---------------------------------------------------------------------
struct joined_reply {
  workload_id workload = 0;
  std::uint64_t budget = 0;
};
struct granted_reply {
  workload_id workload = 0;
  std::uint64_t bytes = 0;
};
/// The ledger as the coordinator holds it: the first `lines.size()` of `workloads` workloads.
struct stats_reply {
  std::uint64_t budget = 0;
  std::uint64_t used = 0;
  std::uint32_t workloads = 0;
  std::vector<workload_usage> lines;
};
struct reclaim_request {
  std::uint64_t bytes = 0;
  /// Also memory that the workloads of this process pin while they wait for the budget
  /// themselves: asked for an older waiter of another process (see budget_member).
  bool from_waiters = false;
};
struct error_reply {
  errc code = errc::bad_message;
  std::string text;
};

using to_coordinator = std::variant<join_request, leave_request, acquire_request, release_request, set_pinned_request,
                                    set_predicted_request, stats_request, reclaimed_reply>;
using to_workload = std::variant<joined_reply, granted_reply, stats_reply, reclaim_request, error_reply>;

/// A message that failed validation: the error to answer with, and whether the stream can
/// still be trusted (false: answer, then close).
struct parse_error {
  errc code = errc::bad_message;
  std::string text;
  bool fatal = true;
};

namespace detail {

inline glake::detail::wire_writer writer(message_type type, std::uint32_t request) {
  return glake::detail::wire_writer(protocol_magic, protocol_version, static_cast<std::uint16_t>(type), request);
}
inline std::vector<std::byte> workload_and_bytes(message_type type, std::uint32_t request, workload_id w,
                                                 std::uint64_t bytes) {
  auto out = writer(type, request);
  out.put(w).put(std::uint32_t{0}).put(bytes);
  return std::move(out).finish();
}

}  // namespace detail

// --- encoding ------------------------------------------------------------------------------------

inline std::vector<std::byte> encode(const join_request& r, std::uint32_t id) {
  auto w = detail::writer(message_type::join, id);
  w.put(r.pinned).put(static_cast<std::uint32_t>(r.name.size())).put(std::uint32_t{0}).put_bytes(r.name.data(), r.name.size());
  return std::move(w).finish();
}
inline std::vector<std::byte> encode(const leave_request& r, std::uint32_t id) {
  auto w = detail::writer(message_type::leave, id);
  w.put(r.workload).put(std::uint32_t{0});
  return std::move(w).finish();
}
inline std::vector<std::byte> encode(const acquire_request& r, std::uint32_t id) {
  auto w = detail::writer(message_type::acquire, id);
  w.put(r.workload).put(std::uint32_t{r.wait ? 0u : 1u}).put(r.timeout_ms).put(std::uint32_t{0}).put(r.bytes);
  return std::move(w).finish();
}
inline std::vector<std::byte> encode(const release_request& r, std::uint32_t id) {
  return detail::workload_and_bytes(message_type::release, id, r.workload, r.bytes);
}
inline std::vector<std::byte> encode(const set_pinned_request& r, std::uint32_t id) {
  return detail::workload_and_bytes(message_type::set_pinned, id, r.workload, r.bytes);
}
inline std::vector<std::byte> encode(const set_predicted_request& r, std::uint32_t id) {
  return detail::workload_and_bytes(message_type::set_predicted, id, r.workload, r.bytes);
}
inline std::vector<std::byte> encode(const stats_request&, std::uint32_t id) {
  return detail::writer(message_type::stats, id).finish();
}
inline std::vector<std::byte> encode(const reclaimed_reply& r, std::uint32_t id) {
  auto w = detail::writer(message_type::reclaimed, id);
  w.put(r.bytes);
  return std::move(w).finish();
}
inline std::vector<std::byte> encode(const joined_reply& r, std::uint32_t id) {
  return detail::workload_and_bytes(message_type::joined, id, r.workload, r.budget);
}
inline std::vector<std::byte> encode(const granted_reply& r, std::uint32_t id) {
  return detail::workload_and_bytes(message_type::granted, id, r.workload, r.bytes);
}
/// Lists as many of r.lines as fit in max_message_bytes (names cut to max_name_bytes).
inline std::vector<std::byte> encode(const stats_reply& r, std::uint32_t id) {
  constexpr std::size_t fixed = 8 + 8 + 4 + 4;
  constexpr std::size_t line_fixed = 4 + 4 + 8 + 8 + 8;
  std::size_t room = max_message_bytes - header_bytes - fixed;
  std::uint32_t listed = 0;
  for (const workload_usage& u : r.lines) {
    const std::size_t need = line_fixed + std::min(u.name.size(), max_name_bytes);
    if (need > room) break;
    room -= need;
    ++listed;
  }
  auto w = detail::writer(message_type::stats_reply, id);
  w.put(r.budget).put(r.used).put(r.workloads).put(listed);
  for (std::uint32_t i = 0; i < listed; ++i) {
    const workload_usage& u = r.lines[i];
    const auto n = static_cast<std::uint32_t>(std::min(u.name.size(), max_name_bytes));
    w.put(u.id).put(n).put(std::uint64_t{u.held}).put(std::uint64_t{u.pinned}).put(std::uint64_t{u.predicted});
    w.put_bytes(u.name.data(), n);
  }
  return std::move(w).finish();
}
inline std::vector<std::byte> encode(const reclaim_request& r, std::uint32_t id) {
  auto w = detail::writer(message_type::reclaim, id);
  w.put(r.bytes).put(std::uint32_t{r.from_waiters ? 1u : 0u}).put(std::uint32_t{0});
  return std::move(w).finish();
}
inline std::vector<std::byte> encode(const error_reply& r, std::uint32_t id) {
  auto w = detail::writer(message_type::error, id);
  const std::size_t n = std::min(r.text.size(), max_error_text);
  w.put(static_cast<std::uint32_t>(r.code)).put(static_cast<std::uint32_t>(n)).put_bytes(r.text.data(), n);
  return std::move(w).finish();
}

// --- parsing -----------------------------------------------------------------------------------

/// The header of a message, validated: magic, version, length, body length equal to what
/// follows the header. On failure a fatal parse_error.
inline std::variant<header, parse_error> parse_header(std::span<const std::byte> bytes) {
  header h;
  bool wrong_version = false;
  std::string why = glake::detail::check_wire_header(bytes, protocol_magic, protocol_version, max_message_bytes,
                                                     "glake budget", h, &wrong_version);
  if (!why.empty()) return parse_error{wrong_version ? errc::unsupported_version : errc::bad_message, std::move(why), true};
  return h;
}

namespace detail {

inline parse_error bad(std::string text) { return parse_error{errc::bad_message, std::move(text), true}; }

// u32 workload, u32 reserved (zero), u64 bytes.
inline bool workload_and_bytes(glake::detail::wire_reader& r, workload_id& w, std::uint64_t& bytes) {
  std::uint32_t reserved = 1;
  return r.left() == 16 && r.get(w) && r.get(reserved) && reserved == 0 && r.get(bytes);
}

}  // namespace detail

/// A message a workload sends. Every field is checked: the body's exact length for its type,
/// reserved fields zero, flags known, names of 1 to max_name_bytes bytes, no descriptors.
/// Never throws but bad_alloc.
inline std::variant<to_coordinator, parse_error> parse_to_coordinator(std::span<const std::byte> bytes,
                                                                      std::size_t fds = 0,
                                                                      header* out_header = nullptr) {
  auto parsed = parse_header(bytes);
  if (auto* e = std::get_if<parse_error>(&parsed)) return std::move(*e);
  const header h = std::get<header>(parsed);
  if (out_header != nullptr) *out_header = h;
  if (fds != 0) return detail::bad("descriptors sent with a budget message");
  glake::detail::wire_reader r(bytes.subspan(header_bytes));
  switch (static_cast<message_type>(h.type)) {
    case message_type::join: {
      join_request q;
      std::uint32_t length = 0, reserved = 1;
      if (!r.get(q.pinned) || !r.get(length) || !r.get(reserved) || reserved != 0 || length != r.left()) {
        return detail::bad("malformed join");
      }
      if (length == 0 || length > max_name_bytes) {
        return detail::bad("a workload name of " + std::to_string(length) + " bytes (1 to " +
                           std::to_string(max_name_bytes) + " allowed)");
      }
      q.name.assign(reinterpret_cast<const char*>(r.here()), length);
      if (q.name.find('\0') != std::string::npos) return detail::bad("a workload name with a zero byte");
      return to_coordinator{std::move(q)};
    }
    case message_type::leave: {
      leave_request q;
      std::uint32_t reserved = 1;
      if (r.left() != 8 || !r.get(q.workload) || !r.get(reserved) || reserved != 0) return detail::bad("malformed leave");
      return to_coordinator{q};
    }
    case message_type::acquire: {
      acquire_request q;
      std::uint32_t flags = 0, reserved = 1;
      if (r.left() != 24 || !r.get(q.workload) || !r.get(flags) || !r.get(q.timeout_ms) || !r.get(reserved) ||
          reserved != 0 || !r.get(q.bytes) || (flags & ~1u) != 0) {
        return detail::bad("malformed acquire");
      }
      q.wait = (flags & 1u) == 0;
      return to_coordinator{q};
    }
    case message_type::release: {
      release_request q;
      if (!detail::workload_and_bytes(r, q.workload, q.bytes)) return detail::bad("malformed release");
      return to_coordinator{q};
    }
    case message_type::set_pinned: {
      set_pinned_request q;
      if (!detail::workload_and_bytes(r, q.workload, q.bytes)) return detail::bad("malformed set_pinned");
      return to_coordinator{q};
    }
    case message_type::set_predicted: {
      set_predicted_request q;
      if (!detail::workload_and_bytes(r, q.workload, q.bytes)) return detail::bad("malformed set_predicted");
      return to_coordinator{q};
    }
    case message_type::stats:
      if (h.body != 0) return detail::bad("stats takes no body");
      return to_coordinator{stats_request{}};
    case message_type::reclaimed: {
      reclaimed_reply q;
      if (r.left() != 8 || !r.get(q.bytes)) return detail::bad("malformed reclaimed");
      return to_coordinator{q};
    }
    default:
      return detail::bad("unknown message type " + std::to_string(h.type) + " for the coordinator");
  }
}

/// A message the coordinator sends; checked like parse_to_coordinator. Never throws but bad_alloc.
inline std::variant<to_workload, parse_error> parse_to_workload(std::span<const std::byte> bytes,
                                                                std::size_t fds = 0,
                                                                header* out_header = nullptr) {
  auto parsed = parse_header(bytes);
  if (auto* e = std::get_if<parse_error>(&parsed)) return std::move(*e);
  const header h = std::get<header>(parsed);
  if (out_header != nullptr) *out_header = h;
  if (fds != 0) return detail::bad("descriptors sent with a budget message");
  glake::detail::wire_reader r(bytes.subspan(header_bytes));
  switch (static_cast<message_type>(h.type)) {
    case message_type::joined: {
      joined_reply q;
      if (!detail::workload_and_bytes(r, q.workload, q.budget)) return detail::bad("malformed joined");
      return to_workload{q};
    }
    case message_type::granted: {
      granted_reply q;
      if (!detail::workload_and_bytes(r, q.workload, q.bytes)) return detail::bad("malformed granted");
      return to_workload{q};
    }
    case message_type::stats_reply: {
      stats_reply q;
      std::uint32_t listed = 0;
      if (!r.get(q.budget) || !r.get(q.used) || !r.get(q.workloads) || !r.get(listed) || listed > q.workloads) {
        return detail::bad("malformed stats reply");
      }
      for (std::uint32_t i = 0; i < listed; ++i) {
        workload_usage u;
        std::uint32_t length = 0;
        std::uint64_t held = 0, pinned = 0, predicted = 0;
        if (!r.get(u.id) || !r.get(length) || !r.get(held) || !r.get(pinned) || !r.get(predicted) ||
            length == 0 || length > max_name_bytes || length > r.left()) {
          return detail::bad("malformed stats reply line " + std::to_string(i));
        }
        u.held = held;
        u.pinned = pinned;
        u.predicted = predicted;
        u.name.assign(reinterpret_cast<const char*>(r.here()), length);
        r.skip(length);
        q.lines.push_back(std::move(u));
      }
      if (r.left() != 0) return detail::bad("stats reply with bytes after its last line");
      return to_workload{std::move(q)};
    }
    case message_type::reclaim: {
      reclaim_request q;
      std::uint32_t flags = 0, reserved = 1;
      if (r.left() != 16 || !r.get(q.bytes) || q.bytes == 0 || !r.get(flags) || (flags & ~1u) != 0 ||
          !r.get(reserved) || reserved != 0) {
        return detail::bad("malformed reclaim");
      }
      q.from_waiters = (flags & 1u) != 0;
      return to_workload{q};
    }
    case message_type::error: {
      error_reply q;
      std::uint32_t code = 0, length = 0;
      if (!r.get(code) || !r.get(length) || length > max_error_text || length != r.left() || code == 0 ||
          code > static_cast<std::uint32_t>(errc::too_many)) {
        return detail::bad("malformed error reply");
      }
      q.code = static_cast<errc>(code);
      q.text.assign(reinterpret_cast<const char*>(r.here()), length);
      return to_workload{std::move(q)};
    }
    default:
      return detail::bad("unknown message type " + std::to_string(h.type) + " for a workload");
  }
}

}  // namespace glake::budget_wire
