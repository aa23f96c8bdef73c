// A process's side of a device budget shared with other processes through a budget
// coordinator: the workloads of this process join it, ask it for bytes, and move memory out
// when it asks; without a coordinator the process runs alone with a local budget and says so.
#pragma once

#if !defined(__linux__)
#error "glake/scheduling/coordinated_budget.hpp needs Linux"
#endif

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "glake/errors.hpp"
#include "glake/ipc/unix_socket.hpp"
#include "glake/posix_errors.hpp"
#include "glake/scheduling/budget.hpp"
#include "glake/scheduling/budget_protocol.hpp"

namespace glake {

struct coordinated_budget_options {
  /// A coordinator that does not take a connection or answer within this long counts as gone
  /// (an acquire waits this long beyond its own timeout).
  int timeout_ms = 30000;
  /// The user the coordinator must run as (SO_PEERCRED); root is accepted too when
  /// accept_root_coordinator. Default: this process's effective user.
  uid_t coordinator_uid = ::geteuid();
  bool accept_root_coordinator = true;
  /// Where the one message about an unavailable or lost coordinator goes, and the text of
  /// one-way messages the coordinator refused; default: a line on stderr.
  std::function<void(std::string_view)> report;
};

namespace detail {

// Sends one message and waits for the answer to it on a socket nobody else reads; nullopt with
// the reason when the coordinator is gone, silent or breaks the protocol.
inline std::optional<budget_wire::to_workload> budget_round_trip(int fd, const std::vector<std::byte>& message,
                                                                 std::uint32_t request, int timeout_ms,
                                                                 std::string& why) {
  if (const int sent = send_message(fd, message); sent != 0) {
    why = "send: " + errno_text(sent);
    return std::nullopt;
  }
  std::vector<std::byte> buffer(budget_wire::max_message_bytes + 1);
  if (!wait_readable(fd, timeout_ms)) {
    why = "no answer within " + std::to_string(timeout_ms) + " ms";
    return std::nullopt;
  }
  received_message m = receive_message(fd, buffer, 1, MSG_DONTWAIT);
  if (m.error != 0 || m.size == 0) {
    why = m.error != 0 ? "receive: " + errno_text(m.error) : "it closed the connection";
    return std::nullopt;
  }
  budget_wire::header h;
  auto parsed = budget_wire::parse_to_workload(std::span<const std::byte>(buffer.data(), m.truncated ? buffer.size() : m.size),
                                               m.fds.size(), &h);
  if (auto* e = std::get_if<budget_wire::parse_error>(&parsed)) {
    why = "it broke the protocol: " + e->text;
    return std::nullopt;
  }
  auto& r = std::get<budget_wire::to_workload>(parsed);
  if (auto* e = std::get_if<budget_wire::error_reply>(&r); e != nullptr && h.request == 0) {
    why = std::string("it refused the connection: ") + budget_wire::to_string(e->code) + ": " + e->text;
    return std::nullopt;
  }
  if (h.request != request) {
    why = "it answered request " + std::to_string(h.request) + " instead of " + std::to_string(request);
    return std::nullopt;
  }
  return std::move(r);
}

// A connection to the coordinator at `path` whose peer runs as `uid` (or root when allowed);
// empty with the reason when there is none.
inline unique_fd connect_budget_coordinator(const std::string& path, const coordinated_budget_options& options,
                                            std::string& why) {
  unique_fd fd = connect_unix(path, options.timeout_ms);
  if (!fd) {
    why = "connect: " + errno_text(errno);
    return fd;
  }
  peer_credentials peer;
  if (!read_peer_credentials(fd.get(), peer)) {
    why = "its credentials cannot be read";
    return {};
  }
  if (peer.uid != options.coordinator_uid && !(options.accept_root_coordinator && peer.uid == 0)) {
    why = "it runs as uid " + std::to_string(peer.uid) + ", not " + std::to_string(options.coordinator_uid);
    return {};
  }
  return fd;
}

}  // namespace detail

/// The ledger of the coordinator at `path` (budget, used, each workload); nullopt with the
/// reason in `why` when none answers.
inline std::optional<budget_wire::stats_reply> query_budget_coordinator(const std::string& path, std::string& why,
                                                                        coordinated_budget_options options = {}) {
  detail::unique_fd fd = detail::connect_budget_coordinator(path, options, why);
  if (!fd) return std::nullopt;
  auto answer = detail::budget_round_trip(fd.get(), budget_wire::encode(budget_wire::stats_request{}, 1), 1,
                                          options.timeout_ms, why);
  if (!answer) return std::nullopt;
  if (auto* s = std::get_if<budget_wire::stats_reply>(&*answer)) return std::move(*s);
  why = "it answered stats with another message";
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// coordinated_budget
//
// A budget_service for the workloads of one process when several processes share a device
// through a budget_coordinator. It keeps a shared_budget of its own (`local`) that registers
// this process's workloads and mirrors what they hold, and asks the coordinator for every byte:
//
// - acquire(w, n): a no-wait acquire at the coordinator; when there is no room, this process's
//   own victims first (local.move_out: any local workload's, furthest next use first, and what
//   younger local waiters pinned, as in one process), then again; then a waiting acquire at the
//   coordinator, which queues it and asks other processes to move memory out, up to the
//   timeout. try_acquire (a prefetch) moves out local memory used after its own use only, and
//   never waits or makes other processes move anything.
// - release, set_pinned, set_predicted, leave are sent without waiting for an answer (a refusal
//   is reported through options.report); set_pinned and join check the whole budget locally
//   first, so an irreducible need above it throws out_of_memory naming the workload at once.
// - A thread of its own reads the connection: answers go to the threads waiting for them, and
//   a reclaim request is served with local.move_out (unpinned memory, furthest next use first,
//   and with from_waiters also what local workloads that wait themselves pinned; each piece
//   moved out is released to the coordinator as it goes) and answered with the bytes given back.
//
// Without a coordinator (nobody listens at the path, it refuses, or runs as another user) the
// process runs alone with a local budget of `local_budget` bytes and says so once through
// options.report. A coordinator lost later (it died, or broke the protocol) is reported the
// same way and the process goes on alone with the budget it had, which is the whole device
// budget: other processes may then use the same memory.
//
// Complexity: one round trip per acquire that needs the coordinator (a few microseconds on a
// Unix socket), none for release, set_pinned, set_predicted. Thread safety: every member may be
// called from any thread. Fork: a child must make its own (the reading thread is the parent's);
// using the parent's in a child throws usage_error. Lifetime: it must outlive every workload
// that joined it.
// ---------------------------------------------------------------------------------------------
class coordinated_budget {
 public:
  /// Connects to the coordinator at `socket_path`; without one, runs alone with
  /// `local_budget` bytes (usage_error when that is 0) and says so.
  coordinated_budget(std::string socket_path, std::size_t local_budget, coordinated_budget_options options = {})
      : path_(std::move(socket_path)), options_(std::move(options)) {
    if (options_.timeout_ms <= 0) options_.timeout_ms = 30000;
    if (local_budget == 0) {
      throw usage_error(usage_error::kind::bad_argument, "glake::coordinated_budget: the local budget is 0 bytes");
    }
    std::string why;
    detail::unique_fd fd = detail::connect_budget_coordinator(path_, options_, why);
    std::optional<budget_wire::to_workload> answer;
    if (fd) {
      const std::uint32_t id = next_request();
      answer = detail::budget_round_trip(fd.get(), budget_wire::encode(budget_wire::stats_request{}, id), id,
                                         options_.timeout_ms, why);
    }
    const auto* stats = answer ? std::get_if<budget_wire::stats_reply>(&*answer) : nullptr;
    if (stats == nullptr || stats->budget == 0) {
      if (answer) why = "it answered stats with another message";
      local_.emplace(local_budget);
      report("glake budget: the coordinator at " + path_ + " is unavailable (" + why +
             "); this process runs alone with a local budget of " + std::to_string(local_budget) + " bytes (" +
             format_bytes(local_budget) + ")");
      return;
    }
    local_.emplace(static_cast<std::size_t>(stats->budget));
    socket_ = std::move(fd);
    // The reader waits for messages however long; sends keep their timeout (a coordinator that
    // stopped reading counts as gone).
    timeval forever{};
    ::setsockopt(socket_.get(), SOL_SOCKET, SO_RCVTIMEO, &forever, sizeof forever);
    online_ = true;
    reader_ = std::thread([this] { read_loop(); });
  }
  coordinated_budget(const coordinated_budget&) = delete;
  coordinated_budget& operator=(const coordinated_budget&) = delete;
  ~coordinated_budget() {
    stopping_ = true;
    if (socket_) ::shutdown(socket_.get(), SHUT_RDWR);
    if (reader_.joinable()) reader_.join();
  }

  /// Whether the coordinator serves this process now (false: it runs alone).
  bool coordinated() const noexcept { return online_; }
  /// The budget: the coordinator's (the whole device budget), or the local one.
  std::size_t budget() const noexcept { return local_->budget(); }
  /// What this process's workloads hold, as it keeps them.
  std::vector<workload_usage> snapshot() const { return local_->snapshot(); }
  budget_statistics stats() const { return local_->stats(); }

  workload_id join(std::string name, budget_member& member, std::size_t pinned = 0) {
    check_process();
    const workload_id id = local_->join(name, member, pinned);
    if (!online_) return id;
    const std::uint32_t request = next_request();
    auto answer = ask(budget_wire::encode(budget_wire::join_request{name, pinned}, request), request,
                      std::chrono::milliseconds(options_.timeout_ms));
    if (!answer) return id;  // lost: alone from now on
    if (auto* j = std::get_if<budget_wire::joined_reply>(&*answer)) {
      std::lock_guard lock(mutex_);
      remote_[id] = j->workload;
      return id;
    }
    local_->leave(id);
    throw_refusal(*answer, pinned, "join");
  }

  void leave(workload_id id) noexcept {
    local_->leave(id);
    if (const auto r = take_remote(id)) send_one_way(budget_wire::encode(budget_wire::leave_request{*r}, next_request()));
  }

  /// Local tickets start at 2: ticket 1 stands for a waiter of another process that the
  /// coordinator found older (a reclaim request from_waiters).
  std::uint64_t take_ticket() noexcept { return local_->take_ticket() + 1; }

  bool acquire(workload_id id, std::size_t bytes, std::chrono::nanoseconds timeout, std::uint64_t ticket = 0) {
    check_process();
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto remote = remote_of(id);
    if (!remote) return local_->acquire(id, bytes, timeout, ticket);
    // Now, with this process's own victims first.
    for (;;) {
      auto answer = remote_acquire(*remote, bytes, false, 0);
      if (!answer) return local_->acquire(id, bytes, left(deadline), ticket);
      if (std::holds_alternative<budget_wire::granted_reply>(*answer)) return mirror(id, *remote, bytes), false;
      if (!is_error(*answer, budget_wire::errc::no_room)) throw_refusal(*answer, bytes, "acquire");
      // Others may take the room made before this asks again: bounded by the deadline.
      if (std::chrono::steady_clock::now() >= deadline ||
          local_->move_out(budget_member::ask{id, ticket, schedule_time::min(), true}, bytes) == 0) {
        break;
      }
    }
    // Then wait at the coordinator, which asks the other processes for room.
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left(deadline)).count();
    const auto wait_ms = static_cast<std::uint32_t>(std::min<long long>(ms, std::numeric_limits<std::uint32_t>::max()));
    auto answer = remote_acquire(*remote, bytes, true, wait_ms);
    if (!answer) return local_->acquire(id, bytes, left(deadline), ticket), true;
    if (std::holds_alternative<budget_wire::granted_reply>(*answer)) return mirror(id, *remote, bytes), true;
    throw_refusal(*answer, bytes, "acquire");
  }

  bool try_acquire(workload_id id, std::size_t bytes, schedule_time later_than) {
    auto remote = remote_of(id);
    if (!remote) return local_->try_acquire(id, bytes, later_than);
    for (int round = 0; round < 2; ++round) {
      auto answer = remote_acquire(*remote, bytes, false, 0);
      if (!answer) return local_->try_acquire(id, bytes, later_than);
      if (std::holds_alternative<budget_wire::granted_reply>(*answer)) return mirror(id, *remote, bytes), true;
      if (!is_error(*answer, budget_wire::errc::no_room)) return false;
      if (round == 0 && local_->move_out(budget_member::ask{id, 0, later_than, true}, bytes) == 0) return false;
    }
    return false;
  }

  void release(workload_id id, std::size_t bytes) {
    local_->release(id, bytes);  // usage_error when it holds fewer: nothing sent then
    if (const auto r = remote_of(id)) {
      send_one_way(budget_wire::encode(budget_wire::release_request{*r, bytes}, next_request()));
    }
  }

  void set_pinned(workload_id id, std::size_t bytes) {
    local_->set_pinned(id, bytes);  // out_of_memory naming the workload above the whole budget
    if (const auto r = remote_of(id)) {
      send_one_way(budget_wire::encode(budget_wire::set_pinned_request{*r, bytes}, next_request()));
    }
  }

  void set_predicted(workload_id id, std::size_t bytes) {
    local_->set_predicted(id, bytes);
    if (const auto r = remote_of(id)) {
      send_one_way(budget_wire::encode(budget_wire::set_predicted_request{*r, bytes}, next_request()));
    }
  }

  void changed() noexcept { local_->changed(); }

 private:
  static std::chrono::nanoseconds left(std::chrono::steady_clock::time_point deadline) {
    return std::max(std::chrono::nanoseconds::zero(), deadline - std::chrono::steady_clock::now());
  }
  static bool is_error(const budget_wire::to_workload& a, budget_wire::errc code) {
    const auto* e = std::get_if<budget_wire::error_reply>(&a);
    return e != nullptr && e->code == code;
  }

  void check_process() const {
    if (::getpid() != pid_) {
      throw usage_error(usage_error::kind::bad_state,
                        "glake::coordinated_budget: used in a child process after fork; make one in the child");
    }
  }

  // The error an answer other than the one expected stands for.
  std::exception_ptr refusal_ptr(const budget_wire::to_workload& a, std::size_t bytes, const char* what) const {
    if (const auto* e = std::get_if<budget_wire::error_reply>(&a)) {
      if (e->code == budget_wire::errc::out_of_memory || e->code == budget_wire::errc::no_room) {
        return std::make_exception_ptr(out_of_memory(bytes, local_->used(), 0, e->text));
      }
      return std::make_exception_ptr(usage_error(usage_error::kind::bad_argument,
                                                 std::string("glake::coordinated_budget::") + what +
                                                     ": the coordinator refused: " + budget_wire::to_string(e->code) +
                                                     ": " + e->text));
    }
    return std::make_exception_ptr(usage_error(usage_error::kind::bad_argument,
                                               std::string("glake::coordinated_budget::") + what +
                                                   ": the coordinator answered with another message"));
  }
  [[noreturn]] void throw_refusal(const budget_wire::to_workload& a, std::size_t bytes, const char* what) const {
    std::rethrow_exception(refusal_ptr(a, bytes, what));
  }

  void mirror(workload_id id, workload_id remote, std::size_t bytes) {
    // The local accounts hold at most what the coordinator granted (grants there first,
    // releases here first), so this always fits.
    if (local_->try_acquire(id, bytes, never_used)) return;
    send_one_way(budget_wire::encode(budget_wire::release_request{remote, bytes}, next_request()));
    throw out_of_memory(bytes, local_->used(), 0, "glake::coordinated_budget: the local accounts disagree with the coordinator's");
  }

  std::optional<budget_wire::to_workload> remote_acquire(workload_id remote, std::size_t bytes, bool wait,
                                                         std::uint32_t timeout_ms) {
    const std::uint32_t request = next_request();
    return ask(budget_wire::encode(budget_wire::acquire_request{remote, bytes, timeout_ms, wait}, request), request,
               std::chrono::milliseconds(timeout_ms) + std::chrono::milliseconds(options_.timeout_ms));
  }

  std::optional<workload_id> remote_of(workload_id id) const {
    std::lock_guard lock(mutex_);
    if (!online_) return std::nullopt;
    const auto it = remote_.find(id);
    if (it == remote_.end()) return std::nullopt;
    return it->second;
  }
  std::optional<workload_id> take_remote(workload_id id) noexcept {
    std::lock_guard lock(mutex_);
    const auto it = remote_.find(id);
    if (it == remote_.end()) return std::nullopt;
    const workload_id r = it->second;
    remote_.erase(it);
    if (!online_) return std::nullopt;
    return r;
  }

  std::uint32_t next_request() noexcept {
    std::uint32_t id = ++requests_;
    if (id == 0) id = ++requests_;  // 0 names the connection itself
    return id;
  }

  bool send_raw(const std::vector<std::byte>& message) {
    std::lock_guard lock(send_mutex_);
    const int sent = detail::send_message(socket_.get(), message);
    if (sent != 0) {
      lose("send: " + detail::errno_text(sent));
      return false;
    }
    return true;
  }
  void send_one_way(const std::vector<std::byte>& message) noexcept {
    if (!online_) return;
    try {
      send_raw(message);
    } catch (...) {
      lose("out of memory");
    }
  }

  // Sends a request and waits for its answer (the reader thread delivers it); nullopt when the
  // coordinator is lost (then this process runs alone).
  std::optional<budget_wire::to_workload> ask(const std::vector<std::byte>& message, std::uint32_t request,
                                              std::chrono::milliseconds patience) {
    {
      std::lock_guard lock(mutex_);
      if (!online_) return std::nullopt;
      waiting_.push_back(request);
    }
    if (!send_raw(message)) {
      std::lock_guard lock(mutex_);
      std::erase(waiting_, request);
      return std::nullopt;
    }
    std::unique_lock lock(mutex_);
    const bool came = answered_.wait_for(lock, patience, [&] { return !online_ || answers_.contains(request); });
    std::erase(waiting_, request);
    const auto it = answers_.find(request);
    if (it == answers_.end()) {
      lock.unlock();
      if (!came) lose("no answer within " + std::to_string(patience.count()) + " ms");
      return std::nullopt;
    }
    auto answer = std::move(it->second);
    answers_.erase(it);
    return answer;
  }

  void read_loop() {
    std::vector<std::byte> buffer(budget_wire::max_message_bytes + 1);
    while (!stopping_) {
      detail::received_message m = detail::receive_message(socket_.get(), buffer, 1);
      if (stopping_) return;
      if (m.error == EAGAIN || m.error == EWOULDBLOCK) continue;
      if (m.error != 0 || m.size == 0) {
        lose(m.error != 0 ? "receive: " + detail::errno_text(m.error) : "it closed the connection");
        return;
      }
      budget_wire::header h;
      auto parsed = m.truncated ? std::variant<budget_wire::to_workload, budget_wire::parse_error>(
                                      budget_wire::parse_error{budget_wire::errc::bad_message, "a message too long", true})
                                : budget_wire::parse_to_workload(std::span<const std::byte>(buffer.data(), m.size),
                                                                 m.fds.size(), &h);
      if (auto* e = std::get_if<budget_wire::parse_error>(&parsed)) {
        lose("it broke the protocol: " + e->text);
        return;
      }
      auto& message = std::get<budget_wire::to_workload>(parsed);
      if (auto* r = std::get_if<budget_wire::reclaim_request>(&message)) {
        // Another process waits: move out what this one's workloads do not need now.
        std::size_t freed = 0;
        try {
          const std::uint64_t ticket = r->from_waiters ? 1 : 0;
          // Settled (as every move_out here): bytes given back to the coordinator may go to
          // another process at once, so a deferred offload must have freed its device memory.
          freed = local_->move_out(budget_member::ask{0, ticket, schedule_time::min(), true},
                                   static_cast<std::size_t>(r->bytes));
        } catch (const std::exception& e) {
          report(std::string("glake budget: moving memory out for the coordinator failed: ") + e.what());
        }
        send_one_way(budget_wire::encode(budget_wire::reclaimed_reply{freed}, h.request));
        continue;
      }
      std::unique_lock lock(mutex_);
      if (std::find(waiting_.begin(), waiting_.end(), h.request) != waiting_.end()) {
        answers_.insert_or_assign(h.request, std::move(message));
        lock.unlock();
        answered_.notify_all();
      } else if (auto* e = std::get_if<budget_wire::error_reply>(&message)) {
        lock.unlock();
        report(std::string("glake budget: the coordinator refused a message: ") + budget_wire::to_string(e->code) +
               ": " + e->text);
      }
    }
  }

  // The coordinator is gone: every waiting thread goes on alone; said once.
  void lose(const std::string& why) noexcept {
    {
      std::lock_guard lock(mutex_);
      if (!online_ || stopping_) return;
      online_ = false;
    }
    answered_.notify_all();
    try {
      report("glake budget: lost the coordinator at " + path_ + " (" + why +
             "); this process goes on alone with the budget of " + format_bytes(local_->budget()));
    } catch (...) {
    }
  }

  void report(const std::string& text) {
    if (options_.report) {
      options_.report(text);
    } else {
      std::fprintf(stderr, "%s\n", text.c_str());
    }
  }

  std::string path_;
  coordinated_budget_options options_;
  std::optional<shared_budget> local_;
  detail::unique_fd socket_;
  pid_t pid_ = ::getpid();
  std::atomic<std::uint32_t> requests_{0};
  std::atomic<bool> online_{false};
  std::atomic<bool> stopping_{false};
  mutable std::mutex mutex_;  // remote_, waiting_, answers_
  std::condition_variable answered_;
  std::map<workload_id, workload_id> remote_;  // local id -> the coordinator's
  std::vector<std::uint32_t> waiting_;
  std::map<std::uint32_t, budget_wire::to_workload> answers_;
  std::mutex send_mutex_;
  std::thread reader_;
};

static_assert(budget_service<coordinated_budget>);

}  // namespace glake
