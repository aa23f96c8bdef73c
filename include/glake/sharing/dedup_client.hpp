// The client side of cross-process deduplication: publish a filled range so that every process
// holding the same bytes maps one read-only copy, under the same pointers.
#pragma once

#include <algorithm>
#include <spawn.h>
#include <sys/wait.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "glake/config.hpp"
#include "glake/errors.hpp"
#include "glake/ipc/unix_socket.hpp"
#include "glake/posix_errors.hpp"
#include "glake/sharing/concepts.hpp"
#include "glake/sharing/dedup_protocol.hpp"
#include "glake/sharing/host_sharing.hpp"

namespace glake {

struct dedup_client_options {
  /// The unit that is hashed, compared and shared, like a handle: a range is cut into pieces of
  /// this size (the last one shorter). A multiple of the backend's granularity. Each piece the
  /// broker keeps costs it one file descriptor.
  std::size_t chunk_bytes = 2 * MiB;
  /// A broker that does not take a connection or answer within this long counts as gone (a
  /// stopped broker costs each publish call up to this long).
  int timeout_ms = 30000;
  /// The user the broker must run as (checked with SO_PEERCRED on connect); root is accepted
  /// too. Default: this process's effective user.
  uid_t broker_uid = ::geteuid();
  /// Whether a broker running as root is accepted too (a system-wide service).
  bool accept_root_broker = true;
  /// Where the one message about an unavailable broker goes; default: a line on stderr.
  std::function<void(std::string_view)> report;
  /// When set, the path of glake-dedup: a client that finds no broker listening at the socket
  /// (ENOENT, ECONNREFUSED) starts one (`glake-dedup --socket PATH --quiet`, in a session of
  /// its own, not this process's child) and connects within timeout_ms. Clients racing to start
  /// one end with one: the others see the path taken and exit.
  std::string start_broker;
  /// Arguments added to that command line (e.g. {"--device", "0"} for glake-dedup-cuda).
  std::vector<std::string> start_arguments;
};

/// What one publish did to its range, piece by piece.
struct publish_result {
  std::size_t pieces = 0;        ///< pieces of the range
  std::size_t shared = 0;        ///< now mapped on a copy another process published first
  std::size_t stored = 0;        ///< now mapped on this process's own copy, which others may share
  std::size_t kept_private = 0;  ///< left as they were (writable, private)
  std::size_t shared_bytes = 0;  ///< bytes of the shared pieces: what this process no longer holds
  std::string reason;            ///< why the first private piece stayed private; empty when none
};

// ---------------------------------------------------------------------------------------------
// dedup_client
//
// publish(p, n) cuts [p, p+n) into pieces of options.chunk_bytes and, for each, hashes it
// (Hasher), exports a copy (Backend::export_copy: an immutable object, a sealed memfd on the
// host) and sends that copy's descriptor with the size and digest to the broker. The broker
// answers with an equal object someone published before (compared byte for byte) or keeps this
// one; either way the piece's addresses are then remapped onto that object, read-only
// (Backend::map_readonly), and the process's own memory behind them is released. Pointers never
// change. A write to a published range faults (SIGSEGV on the host): make_private(p, n) first,
// which copies the bytes back into private writable memory and drops the references;
// release(p, n) drops them without keeping the bytes (the range is writable; zeros on the host).
//
// Failures never lose data: when the broker is unreachable, refuses a piece, or dies midway,
// the pieces not yet remapped stay exactly as they were (private) and publish reports them in
// its result; an unreachable broker is also said once per client through options.report.
// Every publish tries to reach the broker again. Misuse (a range not aligned to the backend's
// granularity, overlapping a published one; make_private of a range not published as such)
// throws usage_error and changes nothing.
//
// References live as long as the connection: destroying the client (or the process dying)
// drops them all at the broker; the mappings stay valid and read-only in this process (the
// kernel keeps the memory while anything maps it), but the broker no longer offers them to
// new publishers unless another process still holds them.
//
// Complexity: publish is O(n) hashing and copying plus one round trip per piece; make_private
// O(n) copying; release O(pieces). Thread safety: all members may be called concurrently (one
// mutex; the round trips are serialised). The caller must not write a range while it is
// published or being published.
// ---------------------------------------------------------------------------------------------
template <shareable_backend Backend = host_shareable_backend, content_hasher Hasher = fast_content_hasher>
class dedup_client {
 public:
  explicit dedup_client(std::string socket_path, dedup_client_options options = {}, Backend backend = Backend(),
                        Hasher hasher = Hasher())
      : path_(std::move(socket_path)),
        options_(std::move(options)),
        backend_(std::move(backend)),
        hasher_(std::move(hasher)) {
    const std::size_t g = backend_.granularity();
    if (options_.chunk_bytes == 0 || options_.chunk_bytes % g != 0) {
      throw usage_error(usage_error::kind::bad_argument,
                        "glake::dedup_client: chunk_bytes " + std::to_string(options_.chunk_bytes) +
                            " is not a positive multiple of the granularity " + std::to_string(g));
    }
    if (options_.timeout_ms <= 0) options_.timeout_ms = 30000;
  }
  dedup_client(const dedup_client&) = delete;
  dedup_client& operator=(const dedup_client&) = delete;

  /// Deduplicates [p, p+n) with every other process that published the same bytes; see the
  /// class comment. Throws usage_error for misuse; broker trouble is reported, not thrown.
  publish_result publish(void* p, std::size_t bytes) {
    std::lock_guard lock(mutex_);
    leave_parent_connection();
    check_range("publish", p, bytes);
    const auto start = reinterpret_cast<std::uintptr_t>(p);
    if (overlaps(start, bytes)) {
      throw usage_error(usage_error::kind::bad_state,
                        "glake::dedup_client::publish: the range overlaps a range published already");
    }
    // The record first, with room for every piece: nothing below allocates for it, so a piece
    // once remapped is always on record for make_private and release.
    const std::size_t count = (bytes + options_.chunk_bytes - 1) / options_.chunk_bytes;
    auto record = ranges_.emplace(start, published_range{bytes, {}}).first;
    try {
      record->second.pieces.reserve(count);
    } catch (...) {
      ranges_.erase(record);
      throw;
    }
    std::vector<piece>& pieces = record->second.pieces;
    publish_result result;
    std::string down;  // why the broker cannot be used for the rest of this call
    if (!ensure_connected(down)) note_unavailable(down);
    for (std::size_t offset = 0; offset < bytes; offset += options_.chunk_bytes) {
      const std::size_t n = std::min(options_.chunk_bytes, bytes - offset);
      char* at = static_cast<char*>(p) + offset;
      ++result.pieces;
      std::string why = down;
      std::optional<piece> done;
      if (socket_) {
        done = publish_piece(at, n, why);
      } else if (why.empty()) {
        why = "the broker is gone";
      }
      if (!done) {
        ++result.kept_private;
        if (result.reason.empty()) result.reason = why;
        if (!socket_ && down.empty()) down = why;
        continue;
      }
      (done->shared ? result.shared : result.stored) += 1;
      if (done->shared) result.shared_bytes += n;
      done->offset = offset;
      pieces.push_back(*done);
    }
    return result;
  }

  /// Turns the published range [p, p+n) (exactly as published, whatever came of its pieces)
  /// back into private, writable memory with the same bytes, and drops its references. Throws usage_error for a range not
  /// published, out_of_memory or driver_error when a copy fails: the pieces copied so far are
  /// private, the rest still published (make_private again finishes the job).
  void make_private(void* p, std::size_t bytes) {
    std::lock_guard lock(mutex_);
    leave_parent_connection();
    auto it = find_range("make_private", p, bytes);
    auto& pieces = it->second.pieces;
    while (!pieces.empty()) {
      const piece& last = pieces.back();
      backend_.make_private(static_cast<char*>(p) + last.offset, last.bytes);
      send_release(last);
      pieces.pop_back();
    }
    ranges_.erase(it);
  }

  /// Gives up the published range [p, p+n) (exactly as published): its references are dropped
  /// and its shared pieces replaced by writable memory (zeros on the host). Throws usage_error
  /// for a range not published, and nothing else.
  void release(void* p, std::size_t bytes) {
    std::lock_guard lock(mutex_);
    leave_parent_connection();
    auto it = find_range("release", p, bytes);
    for (const piece& x : it->second.pieces) {
      backend_.discard(static_cast<char*>(p) + x.offset, x.bytes);
      send_release(x);
    }
    ranges_.erase(it);
  }

  /// The broker's object ids behind the published range starting at p, in address order
  /// (0 for a piece kept private); empty when p starts no published range.
  std::vector<std::uint64_t> objects_of(const void* p) const {
    std::lock_guard lock(mutex_);
    std::vector<std::uint64_t> ids;
    auto it = ranges_.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == ranges_.end()) return ids;
    std::size_t offset = 0;
    for (const piece& x : it->second.pieces) {
      for (; offset < x.offset; offset += options_.chunk_bytes) ids.push_back(0);
      ids.push_back(x.object);
      offset = x.offset + x.bytes;
    }
    for (; offset < it->second.bytes; offset += options_.chunk_bytes) ids.push_back(0);
    return ids;
  }

  /// Whether a connection to the broker is open now.
  bool connected() const {
    std::lock_guard lock(mutex_);
    return static_cast<bool>(socket_);
  }

  /// The broker's counters; nullopt when it cannot be reached.
  std::optional<dedup::broker_stats> broker_statistics() {
    std::string why;
    return broker_statistics(why);
  }
  /// The same, saying in `why` what went wrong when it returns nullopt.
  std::optional<dedup::broker_stats> broker_statistics(std::string& why) {
    std::lock_guard lock(mutex_);
    leave_parent_connection();
    if (!ensure_connected(why)) return std::nullopt;
    auto answer = round_trip(dedup::encode(dedup::stats_request{}, next_request()), -1, why);
    if (!answer) return std::nullopt;
    if (auto* s = std::get_if<dedup::broker_stats>(&answer->first)) return *s;
    why = "it answered stats with another message";
    return std::nullopt;
  }

 private:
  struct piece {
    std::size_t offset = 0;
    std::size_t bytes = 0;
    std::uint64_t object = 0;
    bool shared = false;
    std::uint64_t connection = 0;  // which connection holds its reference (connection_)
  };
  struct published_range {
    std::size_t bytes = 0;
    std::vector<piece> pieces;  // the pieces not kept private, in address order
  };

  void check_range(const char* who, void* p, std::size_t bytes) const {
    const std::size_t g = backend_.granularity();
    if (p == nullptr || reinterpret_cast<std::uintptr_t>(p) % g != 0 || bytes == 0 || bytes % g != 0) {
      throw usage_error(usage_error::kind::bad_argument,
                        std::string("glake::dedup_client::") + who + ": the range (" +
                            std::to_string(reinterpret_cast<std::uintptr_t>(p)) + ", " + std::to_string(bytes) +
                            " bytes) is null, empty or not aligned to the granularity " + std::to_string(g));
    }
  }

  bool overlaps(std::uintptr_t start, std::size_t bytes) const {
    auto next = ranges_.lower_bound(start);
    if (next != ranges_.end() && next->first < start + bytes) return true;
    if (next != ranges_.begin() && std::prev(next)->first + std::prev(next)->second.bytes > start) return true;
    return false;
  }

  typename std::map<std::uintptr_t, published_range>::iterator find_range(const char* who, void* p, std::size_t bytes) {
    auto it = ranges_.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == ranges_.end() || it->second.bytes != bytes) {
      throw usage_error(usage_error::kind::foreign_pointer,
                        std::string("glake::dedup_client::") + who + ": (" +
                            std::to_string(reinterpret_cast<std::uintptr_t>(p)) + ", " + std::to_string(bytes) +
                            " bytes) is not a range published by this client");
    }
    return it;
  }

  // In a child made by fork, the connection (and every reference) is the parent's: close the
  // child's copy of the socket, so the child speaks on a connection of its own.
  void leave_parent_connection() noexcept {
    if (pid_ == ::getpid()) return;
    pid_ = ::getpid();
    socket_.reset();
    ++connection_;
  }

  void note_unavailable(const std::string& why) {
    if (reported_) return;
    reported_ = true;
    const std::string text = "glake dedup: the broker at " + path_ + " is unavailable (" + why +
                             "); published memory stays private to this process";
    if (options_.report) {
      options_.report(text);
    } else {
      std::fprintf(stderr, "%s\n", text.c_str());
    }
  }

  void disconnect(const std::string& why) {
    socket_.reset();
    note_unavailable(why);
  }

  // Connects and says hello unless connected; false with the reason when the broker cannot be
  // reached or refuses.
  bool ensure_connected(std::string& why) {
    // Between round trips nothing is due from the broker: a readable or hung-up socket means
    // it closed (it died, or restarted): connect again instead of failing the next request.
    if (socket_ && !detail::wait_readable(socket_.get(), 0)) return true;
    socket_.reset();
    ++connection_;  // ids of an earlier connection (or broker) mean nothing on this one
    detail::unique_fd fd = detail::connect_unix(path_, options_.timeout_ms);
    if (!fd && (errno == ENOENT || errno == ECONNREFUSED) && !options_.start_broker.empty()) {
      fd = start_and_connect(why);
      if (!fd) return false;
    }
    if (!fd) {
      why = "connect: " + detail::errno_text(errno);
      return false;
    }
    detail::peer_credentials broker;
    if (!detail::read_peer_credentials(fd.get(), broker)) {
      why = "the broker's credentials cannot be read";
      return false;
    }
    if (broker.uid != options_.broker_uid && !(options_.accept_root_broker && broker.uid == 0)) {
      why = "the broker runs as uid " + std::to_string(broker.uid) + ", not " + std::to_string(options_.broker_uid);
      return false;
    }
    socket_ = std::move(fd);
    auto answer = round_trip(dedup::encode(dedup::hello_request{}, next_request()), -1, why);
    if (!answer) return false;
    if (!std::holds_alternative<dedup::hello_reply>(answer->first)) {
      why = "unexpected answer to hello";
      socket_.reset();
      return false;
    }
    return true;
  }

  // Starts options.start_broker through `sh -c '... &'`, so that the broker is nobody's child
  // here (no zombie to reap) and runs in a session of its own, then connects until timeout_ms.
  detail::unique_fd start_and_connect(std::string& why) {
    // sh -c SCRIPT $0 $1 ...: the script names its arguments, so none is parsed by the shell.
    std::string script = "\"$0\" --socket \"$1\" --quiet";
    std::vector<const char*> argv{"/bin/sh", "-c", nullptr, options_.start_broker.c_str(), path_.c_str()};
    for (std::size_t i = 0; i < options_.start_arguments.size(); ++i) {
      script += " \"${" + std::to_string(i + 2) + "}\"";
      argv.push_back(options_.start_arguments[i].c_str());
    }
    script += " </dev/null >/dev/null &";
    argv[2] = script.c_str();
    argv.push_back(nullptr);
    posix_spawnattr_t attributes;
    posix_spawnattr_init(&attributes);
    posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSID);
    pid_t shell = -1;
    const int spawned = ::posix_spawn(&shell, "/bin/sh", nullptr, &attributes, const_cast<char* const*>(argv.data()), environ);
    posix_spawnattr_destroy(&attributes);
    if (spawned != 0) {
      why = "starting " + options_.start_broker + ": posix_spawn: " + detail::errno_text(spawned);
      return {};
    }
    int status = 0;
    while (::waitpid(shell, &status, 0) < 0 && errno == EINTR) {
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(options_.timeout_ms);
    for (;;) {
      detail::unique_fd fd = detail::connect_unix(path_, options_.timeout_ms);
      if (fd) return fd;
      if ((errno != ENOENT && errno != ECONNREFUSED) || std::chrono::steady_clock::now() > deadline) {
        why = "started " + options_.start_broker + ", but connect: " + detail::errno_text(errno);
        return {};
      }
      ::usleep(5000);
    }
  }

  // Sends one request (with fd unless -1) and waits for its reply; nullopt, with the socket
  // closed and the reason in `why`, when the broker is gone, silent, refuses the connection or
  // breaks the protocol. An error reply that keeps the connection is returned as a reply.
  std::optional<std::pair<dedup::reply, detail::unique_fd>> round_trip(const std::vector<std::byte>& message, int fd,
                                                                       std::string& why) {
    const std::uint32_t id = request_;
    const int sent = fd >= 0 ? detail::send_message(socket_.get(), message, std::span<const int>(&fd, 1))
                             : detail::send_message(socket_.get(), message);
    std::byte buffer[dedup::max_message_bytes + 1];
    // A broker that refused the connection may have closed it before the send: its error reply
    // is still waiting to be read.
    detail::received_message m = detail::receive_message(socket_.get(), buffer, 1, sent != 0 ? MSG_DONTWAIT : 0);
    if (m.error == ECONNRESET) {
      // The broker closed with our request unread; the kernel reports that before the reply it
      // may have queued first (a refusal), which the next read returns.
      detail::received_message queued = detail::receive_message(socket_.get(), buffer, 1, MSG_DONTWAIT);
      if (queued.size != 0) m = std::move(queued);
    }
    if (sent != 0 && m.size == 0) {
      why = "the broker is gone (send: " + detail::errno_text(sent) + ")";
      socket_.reset();
      return std::nullopt;
    }
    if (m.error != 0 || m.size == 0) {
      why = m.error == EAGAIN || m.error == EWOULDBLOCK
                ? "the broker did not answer within " + std::to_string(options_.timeout_ms) + " ms"
                : m.error != 0 ? "the broker is gone (receive: " + detail::errno_text(m.error) + ")"
                               : "the broker is gone (it closed the connection)";
      socket_.reset();
      return std::nullopt;
    }
    dedup::header h;
    auto parsed = m.truncated || m.fds_truncated
                      ? std::variant<dedup::reply, dedup::parse_error>(dedup::parse_error{dedup::errc::bad_message, "a truncated reply", true})
                      : dedup::parse_reply(std::span<const std::byte>(buffer, m.size), m.fds.size(), &h);
    if (auto* e = std::get_if<dedup::parse_error>(&parsed)) {
      why = "the broker broke the protocol: " + e->text;
      socket_.reset();
      return std::nullopt;
    }
    auto& r = std::get<dedup::reply>(parsed);
    const auto* e = std::get_if<dedup::error_reply>(&r);
    // Request 0 names no request: an error about the connection itself (a refusal at accept).
    if (h.request != id && !(e != nullptr && h.request == 0)) {
      why = "the broker answered request " + std::to_string(h.request) + " instead of " + std::to_string(id);
      socket_.reset();
      return std::nullopt;
    }
    if (e != nullptr) {
      if (e->code == dedup::errc::permission_denied || e->code == dedup::errc::unsupported_version ||
          e->code == dedup::errc::bad_message) {
        why = std::string("the broker refused: ") + dedup::to_string(e->code) + ": " + e->text;
        socket_.reset();
        return std::nullopt;
      }
    }
    detail::unique_fd received = m.fds.empty() ? detail::unique_fd() : std::move(m.fds.front());
    return std::pair{std::move(r), std::move(received)};
  }

  // One piece: nullopt (with why) when it stays private; the broker connection may close.
  std::optional<piece> publish_piece(char* at, std::size_t bytes, std::string& why) {
    detail::unique_fd own;
    dedup::publish_request q{bytes, hasher_(at, bytes)};
    try {
      own = backend_.export_copy(at, bytes);
    } catch (const std::exception& e) {
      why = std::string("exporting a copy failed: ") + e.what();
      return std::nullopt;
    }
    auto answer = round_trip(dedup::encode(q, next_request()), own.get(), why);
    if (!answer) {
      note_unavailable(why);
      return std::nullopt;
    }
    auto& [r, received] = *answer;
    if (auto* e = std::get_if<dedup::error_reply>(&r)) {
      why = std::string("the broker refused the piece: ") + dedup::to_string(e->code) + ": " + e->text;
      return std::nullopt;
    }
    const auto* p = std::get_if<dedup::published_reply>(&r);
    if (p == nullptr) {
      disconnect(why = "the broker answered a publish with another reply");
      return std::nullopt;
    }
    const bool shared = p->result == dedup::outcome::shared;
    try {
      backend_.map_readonly(at, bytes, shared ? received.get() : own.get());
    } catch (const std::exception& e) {
      why = std::string("mapping the shared copy failed: ") + e.what();
      send_release(piece{0, bytes, p->object, shared, connection_});
      return std::nullopt;
    }
    return piece{0, bytes, p->object, shared, connection_};
  }

  // Request ids run from 1: 0 marks an error about the connection itself.
  std::uint32_t next_request() noexcept {
    if (++request_ == 0) ++request_;
    return request_;
  }

  // Drops x's reference, if the connection that took it is still open: the references of a
  // closed one went with it, and its ids may name other objects on a new connection.
  // Should even that fail (bad_alloc), the connection is closed: the broker drops every
  // reference it held, this one included.
  void send_release(const piece& x) noexcept {
    if (!socket_ || x.connection != connection_) return;
    try {
      std::string why;
      auto answer = round_trip(dedup::encode(dedup::release_request{x.object}, next_request()), -1, why);
      if (!answer) note_unavailable(why);
    } catch (...) {
      socket_.reset();
    }
  }

  std::string path_;
  dedup_client_options options_;
  [[no_unique_address]] Backend backend_;
  [[no_unique_address]] Hasher hasher_;
  mutable std::mutex mutex_;
  // Under the mutex:
  detail::unique_fd socket_;
  std::uint64_t connection_ = 0;  // counts connections: a reference belongs to one
  pid_t pid_ = ::getpid();        // the process whose connection socket_ is
  std::uint32_t request_ = 0;
  bool reported_ = false;
  std::map<std::uintptr_t, published_range> ranges_;
};

}  // namespace glake
