// The dedup broker: indexes the immutable objects clients publish, hands an object only to a
// client that proved it holds the same bytes, and counts references per connection.
#pragma once

#if !defined(__linux__)
#error "glake/sharing/dedup_broker.hpp needs Linux"
#endif

#include <fcntl.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "glake/errors.hpp"
#include "glake/ipc/unix_listener.hpp"
#include "glake/ipc/unix_socket.hpp"
#include "glake/posix_errors.hpp"
#include "glake/sharing/concepts.hpp"
#include "glake/sharing/dedup_protocol.hpp"
#include "glake/sharing/host_sharing.hpp"

namespace glake {

struct dedup_broker_options {
  /// Decides, from the credentials the kernel recorded at connect time, whether a peer may
  /// talk to the broker. Default: same_user_or_group{geteuid(), group}.
  std::function<bool(const detail::peer_credentials&)> admit;
  /// A group whose members may connect too: the socket file is given to it with mode 0660
  /// (else 0600), and the default admission accepts its members.
  std::optional<gid_t> group;
  /// The most distinct objects indexed at once (each holds one descriptor in the broker).
  std::size_t max_objects = std::size_t{1} << 20;
  /// The most connections at once; later ones get an error and are closed.
  std::size_t max_clients = 4096;
  /// The largest object one publish may offer: a bound on the bytes one comparison reads.
  std::uint64_t max_object_bytes = std::uint64_t{4} << 30;
  /// The most different objects indexed under one (digest, size) key: a bound on the byte
  /// comparisons one publish costs, whatever digests clients claim.
  std::size_t max_collisions = 8;
  /// The most bytes of objects one connection may have the broker index for it: objects it
  /// stored (the first publisher of their bytes) and still holds. A bound on what one admitted
  /// peer makes the broker keep; sharing an object indexed already is not charged. Past it a
  /// publish of new bytes is refused (over_quota) and the piece stays private.
  std::uint64_t max_client_bytes = ~std::uint64_t{0};
  /// The most bytes the broker compares in one turn of its poll loop, over all the publishes it
  /// is comparing: between turns it serves every other connection, so one large publish delays
  /// them by about one slice (4 MiB: a few milliseconds), not by the whole comparison. Applies to
  /// a sliced_content_verifier; another verifier compares a publish whole in one turn. At least 1.
  std::size_t compare_slice_bytes = std::size_t{4} << 20;
};

// ---------------------------------------------------------------------------------------------
// basic_dedup_broker
//
// Listens on a SOCK_SEQPACKET Unix socket (one message per packet, so framing needs no length
// prefix and a short or long packet is detectable) and serves connections from one thread with
// poll. A publish carries the client's own object (a descriptor) with its size and digest; the
// broker checks the descriptor (Verifier::check: exactly that size, fit to compare), then
// compares it byte for byte (Verifier::equal) with each indexed object of the same digest and
// size. The comparison is incremental (see "Comparing in slices" below). On a match the client
// gets the indexed object's descriptor and a reference to it; else
// its object is indexed (Verifier::adopt: as it is when immutable, else a copy no client can
// write) and it holds the first reference. A client is therefore never sent
// a descriptor of bytes it did not send itself. Each connection's references are counted;
// release drops one, and a connection that closes (the process exited or died) drops all of
// its own. An object whose count reaches zero leaves the index and the broker closes its
// descriptor (the memory itself lives on in every process still mapping it, until the last
// unmaps it). Every reply is sent without blocking: a client that does not read its replies is
// disconnected.
//
// Admission: the peer's uid/gid (SO_PEERCRED, SO_PEERGROUPS) must pass options.admit, else it
// gets permission_denied and is closed. A socket path is owned through a lock file beside it
// (PATH.lock, flock): a second broker for the same path fails at construction, and a stale
// socket left by a dead broker is replaced.
//
// Comparing in slices: a publish whose key has indexed objects becomes the connection's pending
// comparison; the broker reads no further message from that connection until it is answered
// (replies keep their order) and polls it only for a hang-up, upon which the connection is
// dropped with its comparison and the descriptor it sent. At the end of each poll turn the
// broker compares at most options.compare_slice_bytes (Verifier::equal_slice), taking the
// pending comparisons in turn, so every other connection is served between slices. What to
// compare is read from the index at each step, and the outcome (shared, stored, refused) is
// decided when the last slice is compared, from the index and the limits as they are then: as
// if the publish had been handled whole at that moment. An object released meanwhile is skipped;
// one stored meanwhile under the same key is compared too.
//
// Complexity: a publish is O(log objects + k * n) for k indexed objects of the same key (at
// most max_collisions) of n bytes, spread over turns of at most compare_slice_bytes; a release
// O(log objects); each poll O(connections).
// Thread safety: none; one thread calls poll_once / run. The broker ignores SIGPIPE per send.
// ---------------------------------------------------------------------------------------------
template <content_verifier Verifier = host_content_verifier>
class basic_dedup_broker {
 public:
  /// Binds and listens at `socket_path`. Throws usage_error for a path that does not fit a
  /// socket address, driver_error naming the call for a system refusal, and driver_error with
  /// code EWOULDBLOCK when another broker holds the path.
  explicit basic_dedup_broker(std::string socket_path, dedup_broker_options options = {},
                              Verifier verifier = Verifier())
      : options_(std::move(options)),
        verifier_(std::move(verifier)),
        listener_(std::move(socket_path), options_.group, "glake dedup broker") {
    if (!options_.admit) options_.admit = same_user_or_group{::geteuid(), options_.group};
  }
  basic_dedup_broker(const basic_dedup_broker&) = delete;
  basic_dedup_broker& operator=(const basic_dedup_broker&) = delete;
  ~basic_dedup_broker() {
    clients_.clear();
    objects_.clear();
  }

  const std::string& socket_path() const noexcept { return listener_.path(); }
  dedup::broker_stats stats() const noexcept {
    dedup::broker_stats s = counters_;
    s.clients = clients_.size();
    s.objects = objects_.size();
    return s;
  }

  /// Waits up to `timeout_ms` (-1: forever) for connections and messages and handles all that
  /// arrived. Returns false when `stop_fd` (if not -1) became readable.
  bool poll_once(int timeout_ms, int stop_fd = -1) {
    std::vector<pollfd> fds;
    fds.reserve(clients_.size() + 2);
    fds.push_back({listener_.get(), listener_.poll_events(), 0});  // none while it backs off
    fds.push_back({stop_fd, POLLIN, 0});
    std::vector<int> order;
    order.reserve(clients_.size());
    bool comparing = false;
    for (const auto& [fd, c] : clients_) {
      // A connection with a comparison pending is polled for a hang-up only (always reported).
      fds.push_back({fd, c.pending ? short{0} : short{POLLIN}, 0});
      order.push_back(fd);
      comparing |= static_cast<bool>(c.pending);
    }
    if (const int backoff = listener_.backoff_ms(); backoff > 0 && (timeout_ms < 0 || backoff < timeout_ms)) {
      timeout_ms = backoff;
    }
    if (comparing) timeout_ms = 0;  // the next slice is due: only look at what is ready
    int ready;
    do {
      ready = ::poll(fds.data(), fds.size(), timeout_ms);
    } while (ready < 0 && errno == EINTR);
    if (ready < 0) detail::throw_errno("poll", errno);
    if (stop_fd >= 0 && fds[1].revents != 0) return false;
    for (std::size_t i = 0; i < order.size(); ++i) {
      if (fds[i + 2].revents == 0) continue;
      if (fds[i + 2].events == 0) {
        drop(clients_.find(order[i]));  // hung up while its publish was compared: all of it goes
        continue;
      }
      serve(order[i]);
    }
    if (fds[0].revents & POLLIN) accept_all();
    compare_turn();
    return true;
  }

  /// Serves until `stop_fd` becomes readable (or forever when it is -1).
  void run(int stop_fd = -1) {
    while (poll_once(-1, stop_fd)) {
    }
  }

 private:
  struct object {
    detail::unique_fd fd;
    std::uint64_t bytes = 0;
    content_digest digest;
    std::uint64_t references = 0;
  };
  // A publish being compared with the indexed objects of its key, a slice per turn.
  struct comparison {
    std::uint32_t request = 0;
    dedup::publish_request q;
    detail::unique_fd fd;                 // the client's object
    std::vector<std::uint64_t> different;  // indexed objects it differs from, or unreadable
    std::uint64_t against = 0;            // the object compared now; 0: pick the next
    std::uint64_t equal_bytes = 0;        // bytes of it found equal so far
    bool unreadable = false;              // some object could not be read
  };
  struct client {
    detail::unique_fd fd;
    detail::peer_credentials peer;
    std::map<std::uint64_t, std::uint64_t> held;  // object id -> references
    std::set<std::uint64_t> stored;               // objects charged to it (it stored them)
    std::uint64_t charged = 0;                    // their bytes
    std::unique_ptr<comparison> pending;          // its publish being compared, if any
  };
  using key = std::pair<std::array<std::uint8_t, 32>, std::uint64_t>;
  static constexpr std::size_t most_fds = 4;

  void accept_all() {
    while (auto a = listener_.accept_one()) {
      detail::unique_fd fd = std::move(a->fd);
      if (a->turn_away) {
        refuse(fd.get(), 0, dedup::errc::out_of_descriptors, "the broker has no descriptor left for a connection");
        continue;
      }
      if (!a->credentials) {
        refuse(fd.get(), 0, dedup::errc::permission_denied, "the broker cannot read the peer's credentials");
        continue;
      }
      if (!options_.admit(a->peer)) {
        refuse(fd.get(), 0, dedup::errc::permission_denied,
               "uid " + std::to_string(a->peer.uid) + " gid " + std::to_string(a->peer.gid) + " may not use this broker");
        continue;
      }
      if (clients_.size() >= options_.max_clients) {
        refuse(fd.get(), 0, dedup::errc::out_of_descriptors, "the broker serves its most connections already");
        continue;
      }
      const int raw = fd.get();
      clients_.emplace(raw, client{std::move(fd), std::move(a->peer), {}, {}, 0, nullptr});
    }
  }

  void refuse(int fd, std::uint32_t request, dedup::errc code, std::string text) {
    ++counters_.refused;
    detail::send_message(fd, dedup::encode(dedup::error_reply{code, std::move(text)}, request), {}, MSG_DONTWAIT);
  }

  // Reads every message waiting on one connection; drops the connection when it closed, broke
  // the framing or does not take its replies.
  void serve(int fd) {
    std::byte buffer[dedup::max_message_bytes + 1];
    // At most a few messages per connection and poll, so that one busy client cannot starve
    // the others; the rest wait for the next poll.
    for (int served = 0; served < 16; ++served) {
      auto it = clients_.find(fd);
      if (it == clients_.end()) return;
      if (it->second.pending) return;  // read again once its publish is answered
      // Room for more descriptors than any request takes, so that a client sending two is
      // told so (bad_descriptor) rather than taken for the broker running out (MSG_CTRUNC).
      detail::received_message m = detail::receive_message(fd, buffer, most_fds, MSG_DONTWAIT);
      if (m.error == EAGAIN || m.error == EWOULDBLOCK) return;
      if (m.error != 0 || (m.size == 0 && m.fds.empty() && !m.truncated)) {
        drop(it);
        return;
      }
      if (!handle(it->second, std::span<const std::byte>(buffer, std::min(m.size, sizeof buffer)), m)) {
        drop(clients_.find(fd));
        return;
      }
    }
  }

  // One message; false when the connection must close.
  bool handle(client& c, std::span<const std::byte> bytes, detail::received_message& m) {
    dedup::header h;
    if (m.truncated) {
      return reply_error(c, 0, dedup::errc::bad_message, "message longer than " + std::to_string(dedup::max_message_bytes) + " bytes"), false;
    }
    // MSG_CTRUNC with fewer descriptors than there was room for: the kernel could not install
    // them (EMFILE); with the room full: the client sent too many.
    const bool out_of_fds = m.fds_truncated && m.fds.size() < most_fds;
    auto parsed = dedup::parse_request(bytes, m.fds_truncated ? most_fds + 1 : m.fds.size(), &h);
    if (auto* e = std::get_if<dedup::parse_error>(&parsed)) {
      if (out_of_fds && !e->fatal) {
        return reply_error(c, h.request, dedup::errc::out_of_descriptors,
                           "the broker could not receive the descriptor (it is out of file descriptors)");
      }
      const bool keep = reply_error(c, h.request, e->code, e->text);
      return keep && !e->fatal;
    }
    if (m.foreign_control) return reply_error(c, h.request, dedup::errc::bad_message, "unexpected control data");
    auto& q = std::get<dedup::request>(parsed);
    if (std::holds_alternative<dedup::hello_request>(q)) {
      return send(c, dedup::encode(dedup::hello_reply{dedup::protocol_version, static_cast<std::uint64_t>(::getpid())}, h.request));
    }
    if (std::holds_alternative<dedup::stats_request>(q)) return send(c, dedup::encode(stats(), h.request));
    if (auto* r = std::get_if<dedup::release_request>(&q)) return release(c, h.request, r->object);
    return publish(c, h.request, std::get<dedup::publish_request>(q), std::move(m.fds.front()));
  }

  bool publish(client& c, std::uint32_t request, const dedup::publish_request& q, detail::unique_fd fd) {
    if (q.bytes > options_.max_object_bytes) {
      return reply_error(c, request, dedup::errc::bad_size,
                         "objects of at most " + std::to_string(options_.max_object_bytes) + " bytes are accepted");
    }
    if (const char* why = verifier_.check(fd.get(), q.bytes)) {
      return reply_error(c, request, dedup::errc::bad_descriptor, why);
    }
    c.pending = std::make_unique<comparison>();
    c.pending->request = request;
    c.pending->q = q;
    c.pending->fd = std::move(fd);
    // Nothing to compare with: answered now. Else compared at the end of this turn and later.
    if (index_.find(key{q.digest.bytes, q.bytes}) != index_.end()) return true;
    std::size_t none = 0;
    return compare(c, none);
  }

  // Compares the pending publishes, at most options_.compare_slice_bytes in all, beginning after
  // the connection the last turn began with, so that each gets its turn.
  void compare_turn() {
    std::vector<int> turn;
    for (auto it = clients_.upper_bound(last_compared_); it != clients_.end(); ++it) {
      if (it->second.pending) turn.push_back(it->first);
    }
    for (auto it = clients_.begin(); it != clients_.end() && it->first <= last_compared_; ++it) {
      if (it->second.pending) turn.push_back(it->first);
    }
    if (turn.empty()) return;
    last_compared_ = turn.front();
    std::size_t budget = std::max<std::size_t>(options_.compare_slice_bytes, 1);
    for (const int fd : turn) {
      if (budget == 0) break;
      auto it = clients_.find(fd);
      if (!compare(it->second, budget)) drop(it);
    }
  }

  // Advances c's pending comparison by at most `budget` bytes (taken off it), and answers the
  // publish once that is decided. False when the connection must close.
  bool compare(client& c, std::size_t& budget) {
    comparison& p = *c.pending;
    const std::uint64_t bytes = p.q.bytes;
    for (;;) {
      if (p.against == 0) {
        p.against = next_candidate(key{p.q.digest.bytes, bytes}, p.different);
        p.equal_bytes = 0;
        if (p.against == 0) return store(c);  // none left holds the same bytes
      }
      const auto o = objects_.find(p.against);
      if (o == objects_.end()) {  // released since: out of the index too
        p.against = 0;
        continue;
      }
      if (budget == 0) return true;  // next turn
      int same;
      if constexpr (sliced_content_verifier<Verifier>) {
        const std::uint64_t n = std::min<std::uint64_t>(budget, bytes - p.equal_bytes);
        same = verifier_.equal_slice(o->second.fd.get(), p.fd.get(), bytes, p.equal_bytes, n);
        budget -= static_cast<std::size_t>(n);
        p.equal_bytes += n;
      } else {
        same = verifier_.equal(o->second.fd.get(), p.fd.get(), bytes);
        budget -= static_cast<std::size_t>(std::min<std::uint64_t>(budget, bytes));
        p.equal_bytes = bytes;
      }
      if (same == 1 && p.equal_bytes == bytes) return share(c, p.against);
      if (same != 1) {
        p.unreadable |= same < 0;
        p.different.push_back(p.against);
        p.against = 0;
      }
    }
  }

  // The first object indexed under `k` not in `different`; 0 when none is (ids start at 1).
  std::uint64_t next_candidate(const key& k, const std::vector<std::uint64_t>& different) const {
    const auto chain = index_.find(k);
    if (chain == index_.end()) return 0;
    for (const std::uint64_t id : chain->second) {
      if (std::find(different.begin(), different.end(), id) == different.end()) return id;
    }
    return 0;
  }

  // The pending publish holds the bytes of object `id`: the client gets a reference to it.
  bool share(client& c, std::uint64_t id) {
    const std::uint32_t request = std::exchange(c.pending, nullptr)->request;
    object& o = objects_.at(id);
    ++o.references;
    ++c.held[id];
    ++counters_.references;
    ++counters_.publishes;
    ++counters_.shared;
    const int shared_fd = o.fd.get();
    return send(c, dedup::encode(dedup::published_reply{id, dedup::outcome::shared}, request), {&shared_fd, 1});
  }

  // No indexed object holds the pending publish's bytes: its object is indexed, within limits.
  bool store(client& c) {
    const std::unique_ptr<comparison> p = std::exchange(c.pending, nullptr);
    const std::uint32_t request = p->request;
    const dedup::publish_request& q = p->q;
    const key k{q.digest.bytes, q.bytes};
    const auto found = index_.find(k);
    const std::size_t chain_length = found == index_.end() ? 0 : found->second.size();
    if (p->unreadable) return reply_error(c, request, dedup::errc::unreadable, "an indexed object of this digest could not be read");
    if (chain_length >= options_.max_collisions) {
      return reply_error(c, request, dedup::errc::too_many_objects,
                         std::to_string(chain_length) + " different objects of this digest and size are indexed already");
    }
    if (objects_.size() >= options_.max_objects) {
      return reply_error(c, request, dedup::errc::too_many_objects, "the broker indexes its most objects already");
    }
    if (q.bytes > options_.max_client_bytes - c.charged) {
      return reply_error(c, request, dedup::errc::over_quota,
                         "this connection's objects hold " + std::to_string(c.charged) + " bytes; " +
                             std::to_string(q.bytes) + " more would exceed its quota of " +
                             std::to_string(options_.max_client_bytes));
    }
    detail::unique_fd kept = verifier_.adopt(std::move(p->fd), q.bytes);
    if (!kept) return reply_error(c, request, dedup::errc::unreadable, "the broker could not keep a copy of the object");
    const std::uint64_t id = next_id_++;
    objects_.emplace(id, object{std::move(kept), q.bytes, q.digest, 1});
    index_[k].push_back(id);
    c.stored.insert(id);
    c.charged += q.bytes;
    ++c.held[id];
    ++counters_.references;
    ++counters_.publishes;
    counters_.object_bytes += q.bytes;
    return send(c, dedup::encode(dedup::published_reply{id, dedup::outcome::stored}, request));
  }

  bool release(client& c, std::uint32_t request, std::uint64_t id) {
    auto held = c.held.find(id);
    if (held == c.held.end()) {
      return reply_error(c, request, dedup::errc::unknown_object, "object " + std::to_string(id) + " is not held by this connection");
    }
    const std::uint64_t left = --held->second;
    if (left == 0) {
      c.held.erase(held);
      if (c.stored.erase(id) != 0) c.charged -= objects_.at(id).bytes;  // its last reference: uncharged
    }
    unreference(id, 1);
    return send(c, dedup::encode(dedup::released_reply{id, left}, request));
  }

  void unreference(std::uint64_t id, std::uint64_t count) noexcept {
    auto it = objects_.find(id);
    if (it == objects_.end()) return;
    it->second.references -= count;
    counters_.references -= count;
    if (it->second.references != 0) return;
    const key k{it->second.digest.bytes, it->second.bytes};
    counters_.object_bytes -= it->second.bytes;
    if (auto chain = index_.find(k); chain != index_.end()) {
      std::erase(chain->second, id);
      if (chain->second.empty()) index_.erase(chain);
    }
    objects_.erase(it);
  }

  void drop(typename std::map<int, client>::iterator it) noexcept {
    if (it == clients_.end()) return;
    for (const auto& [id, count] : it->second.held) unreference(id, count);
    clients_.erase(it);
  }

  bool reply_error(client& c, std::uint32_t request, dedup::errc code, std::string text) {
    ++counters_.refused;
    return send(c, dedup::encode(dedup::error_reply{code, std::move(text)}, request));
  }

  // False when the client does not take the reply (gone, or not reading): drop it.
  bool send(client& c, const std::vector<std::byte>& bytes, std::span<const int> fds = {}) {
    return detail::send_message(c.fd.get(), bytes, fds, MSG_DONTWAIT) == 0;
  }

  dedup_broker_options options_;
  [[no_unique_address]] Verifier verifier_;
  detail::unix_listener listener_;
  std::map<int, client> clients_;
  std::map<std::uint64_t, object> objects_;
  std::map<key, std::vector<std::uint64_t>> index_;
  std::uint64_t next_id_ = 1;
  dedup::broker_stats counters_;
  int last_compared_ = -1;  // the connection whose comparison began the last turn
};

using dedup_broker = basic_dedup_broker<>;

}  // namespace glake
