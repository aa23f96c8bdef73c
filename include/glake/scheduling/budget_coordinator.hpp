// The budget coordinator: one device budget shared by workloads in several processes, served
// over a Unix socket; grants bytes, asks holders to move memory out, queues what cannot be
// granted yet, and takes back the share of a workload whose process went away.
#pragma once

#if !defined(__linux__)
#error "glake/scheduling/budget_coordinator.hpp needs Linux"
#endif

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "glake/errors.hpp"
#include "glake/ipc/unix_listener.hpp"
#include "glake/ipc/unix_socket.hpp"
#include "glake/posix_errors.hpp"
#include "glake/scheduling/budget_ledger.hpp"
#include "glake/scheduling/budget_protocol.hpp"

namespace glake {

struct budget_coordinator_options {
  /// Decides, from the credentials the kernel recorded at connect time, whether a peer may
  /// talk to the coordinator. Default: same_user_or_group{geteuid(), group}.
  std::function<bool(const detail::peer_credentials&)> admit;
  /// A group whose members may connect too: the socket file is given to it with mode 0660
  /// (else 0600), and the default admission accepts its members.
  std::optional<gid_t> group;
  /// The most connections, and the most workloads, at once; later ones are refused.
  std::size_t max_clients = 1024;
  std::size_t max_workloads = 4096;
  /// The most acquires one connection may have waiting at once; one more is refused with
  /// too_many naming the limit. With max_clients it bounds the queue (and the work per poll).
  std::size_t max_waiters = 256;
  /// How long a connection that answered a reclaim with nothing is left alone before it is
  /// asked again (its memory may have become movable without a message saying so).
  std::chrono::milliseconds retry = std::chrono::milliseconds(5);
};

/// A coordinator's counters.
struct budget_coordinator_statistics {
  std::uint64_t grants = 0;           ///< acquires answered with their bytes
  std::uint64_t waits = 0;            ///< acquires that were queued (back-pressure)
  std::uint64_t timeouts = 0;         ///< queued acquires that gave up
  std::uint64_t reclaims = 0;         ///< reclaim requests sent
  std::uint64_t reclaimed_bytes = 0;  ///< bytes the workloads said they gave back for them
  std::uint64_t refused = 0;          ///< error replies sent
  std::uint64_t dropped = 0;          ///< connections closed with workloads still joined
  std::size_t peak_used = 0;
};

// ---------------------------------------------------------------------------------------------
// budget_coordinator
//
// Keeps a budget_ledger whose workloads are those the connections joined, and answers the
// messages of budget_protocol.hpp from one thread with poll (SOCK_SEQPACKET: one message per
// packet). An acquire that fits is granted at once, whatever waits (a waiter that needs more
// does not hold up one that fits: that one may be what must finish before memory comes free).
// One that does not fit is queued (back-pressure) with its deadline; while acquires wait, the
// coordinator asks connections for the missing bytes with reclaim requests, the connection with
// the most unpinned bytes (held - pinned, summed over its workloads) first, each for at most its
// unpinned bytes and one request at a time; the workload process moves memory out (furthest
// next use first, see coordinated_budget), sends a release for each piece and then answers with
// the bytes it gave. When that is not enough, connections with a waiter younger than the oldest
// are asked for what their waiting workloads pin too (from_waiters): of two processes whose
// operations each pin part of what the other needs, the first to wait goes first. A connection
// that gave nothing is asked again after options.retry. As room
// appears the queue is served oldest first, each waiter that fits. A waiter whose deadline
// passes gets out_of_memory naming the workload, the bytes, the budget and what each workload
// holds. A no-wait acquire (a prefetch) is granted or refused with no_room at once, and makes
// nobody move anything: times of next use are not comparable across processes. One connection
// may have at most options.max_waiters acquires waiting; one more is refused with too_many. While
// acquires wait the coordinator wakes only for a deadline or to ask a connection again after
// options.retry, never in a loop.
//
// A connection that closes (the process exited or was killed) leaves with all its workloads:
// their share comes back and waiters are served. A need above the whole budget (join's pinned
// bytes, set_pinned, one acquire) is refused at once with out_of_memory naming the workload and
// the bytes. Malformed messages are answered with bad_message and the connection is closed; a
// refused release, set_pinned, set_predicted or leave (which are otherwise not answered) gets an
// error with its request id. Admission and the socket file as the dedup broker's
// (ipc/unix_listener.hpp): options.admit on the peer's credentials, PATH.lock owns the path.
//
// Complexity: a message O(log W) for W workloads, plus O(Q + C log C) per poll while Q acquires
// wait (C connections); each poll O(connections).
// Thread safety: none; one thread calls poll_once / run. Sends never block (MSG_DONTWAIT): a
// connection that does not read its messages is closed, and its workloads leave.
// ---------------------------------------------------------------------------------------------
class budget_coordinator {
 public:
  /// Binds and listens at `socket_path` (see unix_listener: usage_error for a bad path,
  /// driver_error naming the call, driver_error with code EWOULDBLOCK when another coordinator
  /// holds the path).
  budget_coordinator(std::string socket_path, budget_ledger ledger, budget_coordinator_options options = {})
      : options_(std::move(options)),
        ledger_(std::move(ledger)),
        listener_(std::move(socket_path), options_.group, "glake budget coordinator") {
    if (!options_.admit) options_.admit = same_user_or_group{::geteuid(), options_.group};
  }
  budget_coordinator(std::string socket_path, std::size_t budget_bytes, budget_coordinator_options options = {})
      : budget_coordinator(std::move(socket_path), budget_ledger(budget_bytes), std::move(options)) {}
  budget_coordinator(const budget_coordinator&) = delete;
  budget_coordinator& operator=(const budget_coordinator&) = delete;

  const std::string& socket_path() const noexcept { return listener_.path(); }
  std::size_t budget() const noexcept { return ledger_.budget(); }
  std::size_t used() const noexcept { return ledger_.used(); }
  std::vector<workload_usage> snapshot() const { return ledger_.snapshot(); }
  std::size_t waiting() const noexcept { return queue_.size(); }
  std::size_t clients() const noexcept { return clients_.size(); }
  budget_coordinator_statistics stats() const noexcept { return counters_; }

  /// Waits up to `timeout_ms` (-1: forever; less while acquires wait, for their deadlines and
  /// reclaims) for connections and messages and handles all that arrived. Returns false when
  /// `stop_fd` (if not -1) became readable.
  bool poll_once(int timeout_ms, int stop_fd = -1) {
    std::vector<pollfd> fds;
    fds.reserve(clients_.size() + 2);
    fds.push_back({listener_.get(), listener_.poll_events(), 0});  // none while it backs off
    fds.push_back({stop_fd, POLLIN, 0});
    std::vector<int> order;
    order.reserve(clients_.size());
    for (const auto& [fd, c] : clients_) {
      fds.push_back({fd, POLLIN, 0});
      order.push_back(fd);
    }
    long long wait = std::min<long long>(timeout_ms < 0 ? std::numeric_limits<int>::max() : timeout_ms, next_wakeup_ms());
    if (const int backoff = listener_.backoff_ms(); backoff > 0) wait = std::min<long long>(wait, backoff);
    int ready;
    do {
      ready = ::poll(fds.data(), fds.size(), wait >= std::numeric_limits<int>::max() ? -1 : static_cast<int>(wait));
    } while (ready < 0 && errno == EINTR);
    if (ready < 0) detail::throw_errno("poll", errno);
    if (stop_fd >= 0 && fds[1].revents != 0) return false;
    for (std::size_t i = 0; i < order.size(); ++i) {
      if (fds[i + 2].revents != 0) serve(order[i]);
    }
    if (fds[0].revents & POLLIN) accept_all();
    settle();
    return true;
  }

  /// Serves until `stop_fd` becomes readable (or forever when it is -1).
  void run(int stop_fd = -1) {
    while (poll_once(-1, stop_fd)) {
    }
  }

 private:
  using clock = std::chrono::steady_clock;
  struct client {
    detail::unique_fd fd;
    detail::peer_credentials peer;
    std::vector<workload_id> workloads;
    std::uint32_t reclaim = 0;        // the reclaim request it has not answered; 0: none
    std::uint64_t reclaim_bytes = 0;  // ... and the bytes it asked for
    clock::time_point dry_until{};    // it gave nothing: not asked again before this
    std::size_t waiting = 0;          // its acquires in the queue
  };
  struct waiter {
    int fd = -1;
    std::uint32_t request = 0;
    workload_id workload = 0;
    std::uint64_t bytes = 0;
    std::uint32_t timeout_ms = 0;
    clock::time_point deadline{};
  };

  // The next waiter's deadline, or the moment a connection that gave nothing may be asked
  // again; nothing else changes without a message, so an idle coordinator sleeps till then.
  long long next_wakeup_ms() const {
    if (queue_.empty()) return std::numeric_limits<int>::max();
    const auto now = clock::now();
    auto soonest = clock::time_point::max();
    for (const waiter& w : queue_) soonest = std::min(soonest, w.deadline);
    for (const auto& [fd, c] : clients_) {
      if (c.dry_until > now) soonest = std::min(soonest, c.dry_until);
    }
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(soonest - now).count();
    return std::max<long long>(ms + 1, 0);
  }

  void accept_all() {
    while (auto a = listener_.accept_one()) {
      detail::unique_fd fd = std::move(a->fd);
      if (a->turn_away) {
        refuse(fd.get(), 0, budget_wire::errc::too_many, "the coordinator has no descriptor left for a connection");
      } else if (!a->credentials) {
        refuse(fd.get(), 0, budget_wire::errc::permission_denied, "the coordinator cannot read the peer's credentials");
      } else if (!options_.admit(a->peer)) {
        refuse(fd.get(), 0, budget_wire::errc::permission_denied,
               "uid " + std::to_string(a->peer.uid) + " gid " + std::to_string(a->peer.gid) +
                   " may not use this coordinator");
      } else if (clients_.size() >= options_.max_clients) {
        refuse(fd.get(), 0, budget_wire::errc::too_many, "the coordinator serves its most connections already");
      } else {
        const int raw = fd.get();
        client c;
        c.fd = std::move(fd);
        c.peer = std::move(a->peer);
        clients_.emplace(raw, std::move(c));
      }
    }
  }

  void refuse(int fd, std::uint32_t request, budget_wire::errc code, std::string text) {
    ++counters_.refused;
    detail::send_message(fd, budget_wire::encode(budget_wire::error_reply{code, std::move(text)}, request), {},
                         MSG_DONTWAIT);
  }

  // Reads the messages waiting on one connection (a few: one busy client cannot starve the
  // others); drops it when it closed, broke the framing or does not take its answers.
  void serve(int fd) {
    buffer_.resize(budget_wire::max_message_bytes + 1);
    for (int served = 0; served < 16; ++served) {
      auto it = clients_.find(fd);
      if (it == clients_.end()) return;
      detail::received_message m = detail::receive_message(fd, buffer_, 1, MSG_DONTWAIT);
      if (m.error == EAGAIN || m.error == EWOULDBLOCK) return;
      if (m.error != 0 || (m.size == 0 && m.fds.empty() && !m.truncated)) {
        drop(fd);
        return;
      }
      bool keep = false;
      if (m.truncated) {
        reply_error(it->second, 0, budget_wire::errc::bad_message,
                    "message longer than " + std::to_string(budget_wire::max_message_bytes) + " bytes");
      } else if (m.foreign_control) {
        reply_error(it->second, 0, budget_wire::errc::bad_message, "unexpected control data");
      } else {
        keep = handle(it->second, std::span<const std::byte>(buffer_.data(), m.size),
                      m.fds.size() + (m.fds_truncated ? 1 : 0));
      }
      if (!keep) {
        drop(fd);
        return;
      }
    }
  }

  bool owns(const client& c, workload_id w) const {
    return std::find(c.workloads.begin(), c.workloads.end(), w) != c.workloads.end();
  }

  // One message; false when the connection must close.
  bool handle(client& c, std::span<const std::byte> bytes, std::size_t fds) {
    namespace bw = budget_wire;
    bw::header h;
    auto parsed = bw::parse_to_coordinator(bytes, fds, &h);
    if (auto* e = std::get_if<bw::parse_error>(&parsed)) {
      const bool sent = reply_error(c, h.request, e->code, e->text);
      return sent && !e->fatal;
    }
    auto& q = std::get<bw::to_coordinator>(parsed);
    const auto unknown = [&](workload_id w) {
      return reply_error(c, h.request, bw::errc::unknown_workload,
                         "workload " + std::to_string(w) + " was not joined on this connection (or left)");
    };
    c.dry_until = {};  // anything it says may mean memory became movable
    if (auto* j = std::get_if<bw::join_request>(&q)) {
      if (ledger_.workloads() >= options_.max_workloads) {
        return reply_error(c, h.request, bw::errc::too_many, "the coordinator holds its most workloads already");
      }
      workload_id id = 0;
      try {
        id = ledger_.join(j->name, j->pinned);
      } catch (const out_of_memory& e) {
        return reply_error(c, h.request, bw::errc::out_of_memory, e.what());
      }
      c.workloads.push_back(id);
      return send(c, bw::encode(bw::joined_reply{id, ledger_.budget()}, h.request));
    }
    if (auto* l = std::get_if<bw::leave_request>(&q)) {
      if (!owns(c, l->workload)) return unknown(l->workload);
      leave(c, l->workload);
      return true;
    }
    if (auto* a = std::get_if<bw::acquire_request>(&q)) {
      if (!owns(c, a->workload)) return unknown(a->workload);
      return acquire(c, h.request, *a);
    }
    if (auto* r = std::get_if<bw::release_request>(&q)) {
      if (!owns(c, r->workload)) return unknown(r->workload);
      try {
        ledger_.release(r->workload, r->bytes);
      } catch (const std::exception& e) {
        return reply_error(c, h.request, bw::errc::bad_size, e.what());
      }
      return true;
    }
    if (auto* p = std::get_if<bw::set_pinned_request>(&q)) {
      if (!owns(c, p->workload)) return unknown(p->workload);
      try {
        ledger_.set_pinned(p->workload, p->bytes);
      } catch (const out_of_memory& e) {
        return reply_error(c, h.request, bw::errc::out_of_memory, e.what());
      }
      return true;
    }
    if (auto* p = std::get_if<bw::set_predicted_request>(&q)) {
      if (!owns(c, p->workload)) return unknown(p->workload);
      ledger_.set_predicted(p->workload, p->bytes);
      return true;
    }
    if (std::holds_alternative<bw::stats_request>(q)) {
      bw::stats_reply s;
      s.budget = ledger_.budget();
      s.used = ledger_.used();
      s.lines = ledger_.snapshot();
      s.workloads = static_cast<std::uint32_t>(s.lines.size());
      return send(c, bw::encode(s, h.request));
    }
    const auto& r = std::get<bw::reclaimed_reply>(q);
    if (c.reclaim != 0 && h.request == c.reclaim) {
      c.reclaim = 0;
      c.reclaim_bytes = 0;
      counters_.reclaimed_bytes += r.bytes;
      if (r.bytes == 0) c.dry_until = clock::now() + options_.retry;
    }
    return true;
  }

  bool acquire(client& c, std::uint32_t request, const budget_wire::acquire_request& a) {
    namespace bw = budget_wire;
    try {
      ledger_.require_fits(a.workload, a.bytes, "one request");
    } catch (const out_of_memory& e) {
      return reply_error(c, request, bw::errc::out_of_memory, e.what());
    }
    if (grant(a.workload, a.bytes)) return send(c, bw::encode(bw::granted_reply{a.workload, a.bytes}, request));
    if (!a.wait) {
      return reply_error(c, request, bw::errc::no_room,
                         "asked for " + format_bytes(a.bytes) + ", " + format_bytes(ledger_.available()) +
                             " of the budget of " + format_bytes(ledger_.budget()) + " left");
    }
    if (++c.waiting > options_.max_waiters) {
      --c.waiting;
      return reply_error(c, request, bw::errc::too_many,
                         "this connection has " + std::to_string(options_.max_waiters) +
                             " acquires waiting already, the most the coordinator queues for one");
    }
    ++counters_.waits;
    queue_.push_back(waiter{c.fd.get(), request, a.workload, a.bytes, a.timeout_ms,
                            clock::now() + std::chrono::milliseconds(a.timeout_ms)});
    return true;
  }

  bool grant(workload_id w, std::uint64_t bytes) {
    if (!ledger_.try_acquire(w, bytes)) return false;
    ++counters_.grants;
    counters_.peak_used = std::max(counters_.peak_used, ledger_.used());
    return true;
  }

  // Serves the queue oldest first, times out waiters past their deadline, and asks for room
  // for the rest. Connections that do not take a message are dropped, and that repeats.
  void settle() {
    namespace bw = budget_wire;
    for (;;) {
      const auto now = clock::now();
      std::vector<int> gone;
      for (auto it = queue_.begin(); it != queue_.end();) {
        auto owner = clients_.find(it->fd);
        if (grant(it->workload, it->bytes)) {
          --owner->second.waiting;
          if (!send(owner->second, bw::encode(bw::granted_reply{it->workload, it->bytes}, it->request))) {
            gone.push_back(it->fd);
          }
          it = queue_.erase(it);
        } else if (it->deadline <= now) {
          ++counters_.timeouts;
          const workload_usage self = ledger_.usage(it->workload);
          const std::string text =
              "glake::budget_coordinator: workload '" + self.name + "' waited " + std::to_string(it->timeout_ms) +
              " ms for " + std::to_string(it->bytes) + " bytes (" + format_bytes(it->bytes) + ") of the budget of " +
              format_bytes(ledger_.budget()) + "; " + format_bytes(ledger_.available()) +
              " are left and nothing more could be moved out: " + ledger_.describe();
          --owner->second.waiting;
          if (!reply_error(owner->second, it->request, bw::errc::out_of_memory, text)) gone.push_back(it->fd);
          it = queue_.erase(it);
        } else {
          ++it;
        }
      }
      if (gone.empty()) gone = ask_for_room(now);
      if (gone.empty()) return;
      for (int fd : gone) drop(fd);
    }
  }

  // Reclaim requests for what the queue misses beyond what is asked for already; the
  // connections that did not take theirs.
  std::vector<int> ask_for_room(clock::time_point now) {
    std::vector<int> gone;
    if (queue_.empty()) return gone;
    std::uint64_t wanted = 0, asked = 0;
    for (const waiter& w : queue_) wanted += w.bytes;
    for (const auto& [fd, c] : clients_) asked += c.reclaim_bytes;
    const std::uint64_t have = ledger_.available() + asked;
    if (wanted <= have) return gone;
    std::uint64_t missing = wanted - have;
    std::vector<std::pair<std::uint64_t, int>> holders;  // unpinned bytes, connection
    for (const auto& [fd, c] : clients_) {
      if (c.reclaim != 0 || now < c.dry_until) continue;
      std::uint64_t unpinned = 0;
      for (workload_id w : c.workloads) {
        const workload_usage u = ledger_.usage(w);
        unpinned += u.held - std::min(u.pinned, u.held);
      }
      if (unpinned > 0) holders.emplace_back(unpinned, fd);
    }
    std::sort(holders.begin(), holders.end(), std::greater<>());
    for (const auto& [unpinned, fd] : holders) {
      if (missing == 0) break;
      const std::uint64_t ask = std::min(missing, unpinned);
      if (!ask_reclaim(clients_.at(fd), ask, false)) gone.push_back(fd);
      missing -= ask;
    }
    // Still short: the oldest waiter may take what younger waiters of other connections pin (as
    // in one process: of two workloads that each pin part of what the other needs, the first to
    // wait goes first instead of both waiting until their timeouts).
    const int oldest = queue_.front().fd;
    for (const waiter& w : queue_) {
      if (missing == 0) break;
      if (w.fd == oldest) continue;
      client& c = clients_.at(w.fd);
      if (c.reclaim != 0 || now < c.dry_until) continue;
      std::uint64_t held = 0;
      for (workload_id id : c.workloads) held += ledger_.usage(id).held;
      if (held == 0) continue;
      const std::uint64_t ask = std::min(missing, held);
      if (!ask_reclaim(c, ask, true)) gone.push_back(w.fd);
      missing -= ask;
    }
    return gone;
  }

  bool ask_reclaim(client& c, std::uint64_t bytes, bool from_waiters) {
    if (++next_reclaim_ == 0) ++next_reclaim_;
    c.reclaim = next_reclaim_;
    c.reclaim_bytes = bytes;
    ++counters_.reclaims;
    return send(c, budget_wire::encode(budget_wire::reclaim_request{bytes, from_waiters}, c.reclaim));
  }

  void leave(client& c, workload_id w) {
    // Its waiting acquire (a thread of that process, waiting still) is told it left.
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (it->workload == w) {
        --c.waiting;
        reply_error(c, it->request, budget_wire::errc::unknown_workload, "the workload left while waiting");
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    ledger_.leave(w);
    std::erase(c.workloads, w);
  }

  // The connection closed (or must): its workloads leave, their share comes back.
  void drop(int fd) noexcept {
    auto it = clients_.find(fd);
    if (it == clients_.end()) return;
    if (!it->second.workloads.empty()) ++counters_.dropped;
    std::erase_if(queue_, [fd](const waiter& w) { return w.fd == fd; });
    for (workload_id w : it->second.workloads) ledger_.leave(w);
    clients_.erase(it);
  }

  bool reply_error(client& c, std::uint32_t request, budget_wire::errc code, std::string text) {
    ++counters_.refused;
    return send(c, budget_wire::encode(budget_wire::error_reply{code, std::move(text)}, request));
  }

  // False when the client does not take the message (gone, or not reading): drop it.
  bool send(client& c, const std::vector<std::byte>& bytes) {
    return detail::send_message(c.fd.get(), bytes, {}, MSG_DONTWAIT) == 0;
  }

  budget_coordinator_options options_;
  budget_ledger ledger_;
  detail::unix_listener listener_;
  std::map<int, client> clients_;
  std::vector<waiter> queue_;  // oldest first
  std::uint32_t next_reclaim_ = 0;
  std::vector<std::byte> buffer_;
  budget_coordinator_statistics counters_;
};

}  // namespace glake
