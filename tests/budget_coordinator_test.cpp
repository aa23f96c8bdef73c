// One device budget shared by workloads in several processes through the budget coordinator:
// the protocol's parsers, the coordinator driven by poll_once over real sockets, and
// coordinated_budget in real processes (fork) with simulated devices: needs summing over the
// budget, a process killed while holding bytes, no coordinator, needs above the whole budget.
#include <doctest/doctest.h>

#include <sys/mman.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <variant>
#include <vector>

#include "glake/backends/sim.hpp"
#include "glake/ipc/unix_socket.hpp"
#include "glake/movers/virtual_buffer.hpp"
#include "glake/scheduling/budget_coordinator.hpp"
#include "glake/scheduling/budget_protocol.hpp"
#include "glake/scheduling/coordinated_budget.hpp"
#include "glake/scheduling/lru_policy.hpp"
#include "glake/scheduling/scheduler.hpp"
#include "support/processes.hpp"

namespace {

using namespace glake;
using namespace std::chrono_literals;
namespace bw = glake::budget_wire;
using testing::channel;
using testing::exited_with;
using testing::spawn;
using testing::temp_dir;
using testing::wait_for;

static_assert(budget_service<shared_budget>);
static_assert(budget_service<coordinated_budget>);

// --- protocol ----------------------------------------------------------------------------------

template <class T>
T to_coordinator_round_trip(const T& message, std::uint32_t id = 7) {
  bw::header h;
  auto parsed = bw::parse_to_coordinator(bw::encode(message, id), 0, &h);
  REQUIRE(std::holds_alternative<bw::to_coordinator>(parsed));
  CHECK(h.request == id);
  REQUIRE(std::holds_alternative<T>(std::get<bw::to_coordinator>(parsed)));
  return std::get<T>(std::get<bw::to_coordinator>(parsed));
}

template <class T>
T to_workload_round_trip(const T& message, std::uint32_t id = 9) {
  bw::header h;
  auto parsed = bw::parse_to_workload(bw::encode(message, id), 0, &h);
  REQUIRE(std::holds_alternative<bw::to_workload>(parsed));
  CHECK(h.request == id);
  REQUIRE(std::holds_alternative<T>(std::get<bw::to_workload>(parsed)));
  return std::get<T>(std::get<bw::to_workload>(parsed));
}

std::vector<std::byte> raw(bw::message_type type, std::vector<std::uint8_t> body, std::uint32_t id = 1) {
  glake::detail::wire_writer w(bw::protocol_magic, bw::protocol_version, static_cast<std::uint16_t>(type), id);
  w.put_bytes(body.data(), body.size());
  return std::move(w).finish();
}

std::vector<std::uint8_t> le(std::uint64_t v, int bytes) {
  std::vector<std::uint8_t> out;
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
  return out;
}
std::vector<std::uint8_t> cat(std::initializer_list<std::vector<std::uint8_t>> parts) {
  std::vector<std::uint8_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

}  // namespace

TEST_CASE("budget_protocol: every message survives encoding and parsing unchanged") {
  const auto j = to_coordinator_round_trip(bw::join_request{"trainer", 12345});
  CHECK(j.name == "trainer");
  CHECK(j.pinned == 12345);
  CHECK(to_coordinator_round_trip(bw::leave_request{42}).workload == 42);
  const auto a = to_coordinator_round_trip(bw::acquire_request{3, std::uint64_t{1} << 40, 2500, false});
  CHECK(a.workload == 3);
  CHECK(a.bytes == std::uint64_t{1} << 40);
  CHECK(a.timeout_ms == 2500);
  CHECK_FALSE(a.wait);
  CHECK(to_coordinator_round_trip(bw::acquire_request{3, 5, 0, true}).wait);
  const auto r = to_coordinator_round_trip(bw::release_request{4, 77});
  CHECK((r.workload == 4 && r.bytes == 77));
  const auto p = to_coordinator_round_trip(bw::set_pinned_request{5, 88});
  CHECK((p.workload == 5 && p.bytes == 88));
  const auto d = to_coordinator_round_trip(bw::set_predicted_request{6, 99});
  CHECK((d.workload == 6 && d.bytes == 99));
  to_coordinator_round_trip(bw::stats_request{});
  CHECK(to_coordinator_round_trip(bw::reclaimed_reply{1234}).bytes == 1234);

  const auto joined = to_workload_round_trip(bw::joined_reply{8, 1u << 30});
  CHECK((joined.workload == 8 && joined.budget == 1u << 30));
  const auto granted = to_workload_round_trip(bw::granted_reply{8, 4096});
  CHECK((granted.workload == 8 && granted.bytes == 4096));
  CHECK(to_workload_round_trip(bw::reclaim_request{65536, false}).bytes == 65536);
  CHECK_FALSE(to_workload_round_trip(bw::reclaim_request{65536, false}).from_waiters);
  CHECK(to_workload_round_trip(bw::reclaim_request{1, true}).from_waiters);
  const auto error = to_workload_round_trip(bw::error_reply{bw::errc::out_of_memory, "workload 'x' needs 5 bytes"});
  CHECK(error.code == bw::errc::out_of_memory);
  CHECK(error.text == "workload 'x' needs 5 bytes");

  bw::stats_reply s{1000, 600, 2, {workload_usage{1, "a", 400, 100, 900}, workload_usage{2, "b", 200, 0, 0}}};
  const auto back = to_workload_round_trip(s);
  CHECK(back.budget == 1000);
  CHECK(back.used == 600);
  CHECK(back.workloads == 2);
  REQUIRE(back.lines.size() == 2);
  CHECK((back.lines[0].id == 1 && back.lines[0].name == "a" && back.lines[0].held == 400 &&
         back.lines[0].pinned == 100 && back.lines[0].predicted == 900));
  CHECK((back.lines[1].name == "b" && back.lines[1].held == 200));

  // A stats reply lists what fits in one message and says how many there are.
  bw::stats_reply many{1, 0, 500, {}};
  for (std::uint32_t i = 0; i < 500; ++i) many.lines.push_back(workload_usage{i + 1, std::string(100, 'w'), 0, 0, 0});
  const auto cut = to_workload_round_trip(many);
  CHECK(cut.workloads == 500);
  CHECK(cut.lines.size() > 10);
  CHECK(cut.lines.size() < 500);
}

TEST_CASE("budget_protocol: malformed messages are refused, never thrown or misread") {
  using mt = bw::message_type;
  const auto refused_by_coordinator = [](const std::vector<std::byte>& bytes, std::size_t fds = 0) {
    auto parsed = bw::parse_to_coordinator(bytes, fds);
    return std::holds_alternative<bw::parse_error>(parsed);
  };
  const auto refused_by_workload = [](const std::vector<std::byte>& bytes) {
    return std::holds_alternative<bw::parse_error>(bw::parse_to_workload(bytes));
  };
  const auto good = bw::encode(bw::release_request{1, 2}, 3);
  REQUIRE_FALSE(refused_by_coordinator(good));

  // Framing.
  CHECK(refused_by_coordinator({}));
  CHECK(refused_by_coordinator(std::vector<std::byte>(good.begin(), good.begin() + 10)));
  auto magic = good;
  magic[0] = std::byte{'X'};
  CHECK(refused_by_coordinator(magic));
  auto version = good;
  version[4] = std::byte{9};
  {
    auto parsed = bw::parse_to_coordinator(version);
    REQUIRE(std::holds_alternative<bw::parse_error>(parsed));
    CHECK(std::get<bw::parse_error>(parsed).code == bw::errc::unsupported_version);
  }
  auto longer = good;
  longer.push_back(std::byte{0});  // the header's body length no longer matches
  CHECK(refused_by_coordinator(longer));
  auto shorter = good;
  shorter.pop_back();
  CHECK(refused_by_coordinator(shorter));
  CHECK(refused_by_coordinator(good, 1));  // a descriptor with it
  CHECK(refused_by_coordinator(raw(static_cast<mt>(77), {})));
  CHECK(refused_by_coordinator(raw(mt::granted, cat({le(1, 4), le(0, 4), le(5, 8)}))));  // a reply sent to it
  CHECK(refused_by_coordinator(std::vector<std::byte>(bw::max_message_bytes + 1)));

  // Each message's fields.
  const auto name = [](std::string_view n) { return std::vector<std::uint8_t>(n.begin(), n.end()); };
  CHECK_FALSE(refused_by_coordinator(raw(mt::join, cat({le(0, 8), le(2, 4), le(0, 4), name("ok")}))));
  CHECK(refused_by_coordinator(raw(mt::join, cat({le(0, 8), le(0, 4), le(0, 4)}))));                   // empty name
  CHECK(refused_by_coordinator(raw(mt::join, cat({le(0, 8), le(3, 4), le(0, 4), name("ok")}))));       // length
  CHECK(refused_by_coordinator(raw(mt::join, cat({le(0, 8), le(2, 4), le(1, 4), name("ok")}))));       // reserved
  CHECK(refused_by_coordinator(raw(mt::join, cat({le(0, 8), le(2, 4), le(0, 4), {'a', 0}}))));         // zero byte
  CHECK(refused_by_coordinator(raw(mt::join, cat({le(0, 8), le(129, 4), le(0, 4), name(std::string(129, 'n'))}))));
  CHECK(refused_by_coordinator(raw(mt::join, le(0, 6))));
  CHECK_FALSE(refused_by_coordinator(raw(mt::leave, cat({le(1, 4), le(0, 4)}))));
  CHECK(refused_by_coordinator(raw(mt::leave, le(1, 4))));
  CHECK(refused_by_coordinator(raw(mt::leave, cat({le(1, 4), le(1, 4)}))));
  CHECK_FALSE(refused_by_coordinator(raw(mt::acquire, cat({le(1, 4), le(1, 4), le(10, 4), le(0, 4), le(5, 8)}))));
  CHECK(refused_by_coordinator(raw(mt::acquire, cat({le(1, 4), le(2, 4), le(10, 4), le(0, 4), le(5, 8)}))));  // flag
  CHECK(refused_by_coordinator(raw(mt::acquire, cat({le(1, 4), le(0, 4), le(10, 4), le(3, 4), le(5, 8)}))));  // reserved
  CHECK(refused_by_coordinator(raw(mt::acquire, cat({le(1, 4), le(0, 4), le(10, 4), le(0, 4), le(5, 4)}))));  // short
  for (mt t : {mt::release, mt::set_pinned, mt::set_predicted}) {
    CHECK_FALSE(refused_by_coordinator(raw(t, cat({le(1, 4), le(0, 4), le(5, 8)}))));
    CHECK(refused_by_coordinator(raw(t, cat({le(1, 4), le(7, 4), le(5, 8)}))));
    CHECK(refused_by_coordinator(raw(t, cat({le(1, 4), le(0, 4), le(5, 8), le(0, 1)}))));
    CHECK(refused_by_coordinator(raw(t, le(1, 4))));
  }
  CHECK(refused_by_coordinator(raw(mt::stats, le(0, 1))));
  CHECK(refused_by_coordinator(raw(mt::reclaimed, le(0, 4))));

  // The workload's side.
  CHECK(refused_by_workload(raw(mt::release, cat({le(1, 4), le(0, 4), le(5, 8)}))));  // a request sent to it
  CHECK_FALSE(refused_by_workload(raw(mt::reclaim, cat({le(5, 8), le(1, 4), le(0, 4)}))));
  CHECK(refused_by_workload(raw(mt::reclaim, cat({le(0, 8), le(0, 4), le(0, 4)}))));  // nothing wanted
  CHECK(refused_by_workload(raw(mt::reclaim, cat({le(5, 8), le(2, 4), le(0, 4)}))));  // unknown flag
  CHECK(refused_by_workload(raw(mt::reclaim, cat({le(5, 8), le(0, 4), le(1, 4)}))));  // reserved
  CHECK(refused_by_workload(raw(mt::reclaim, le(5, 8))));
  CHECK(refused_by_workload(raw(mt::joined, cat({le(1, 4), le(1, 4), le(5, 8)}))));
  CHECK(refused_by_workload(raw(mt::error, cat({le(4, 4), le(5, 4), name("abc")}))));  // text length
  CHECK(refused_by_workload(raw(mt::error, cat({le(99, 4), le(3, 4), name("abc")}))));  // unknown code
  CHECK_FALSE(refused_by_workload(raw(mt::error, cat({le(4, 4), le(3, 4), name("abc")}))));
  const auto line = cat({le(1, 4), le(1, 4), le(0, 8), le(0, 8), le(0, 8), name("a")});
  CHECK_FALSE(refused_by_workload(raw(mt::stats_reply, cat({le(10, 8), le(0, 8), le(1, 4), le(1, 4), line}))));
  CHECK(refused_by_workload(raw(mt::stats_reply, cat({le(10, 8), le(0, 8), le(0, 4), le(1, 4), line}))));  // listed > all
  CHECK(refused_by_workload(raw(mt::stats_reply, cat({le(10, 8), le(0, 8), le(2, 4), le(2, 4), line}))));  // missing line
  CHECK(refused_by_workload(raw(mt::stats_reply, cat({le(10, 8), le(0, 8), le(1, 4), le(1, 4), line, le(0, 1)}))));
}

namespace {

// A connection driven by hand against a coordinator that the test polls.
struct raw_client {
  glake::detail::unique_fd fd;
  std::uint32_t next = 0;

  explicit raw_client(const std::string& path) : fd(glake::detail::connect_unix(path, 2000)) { REQUIRE(fd); }
  template <class M>
  std::uint32_t send(const M& message) {
    const std::uint32_t id = ++next;
    REQUIRE(glake::detail::send_message(fd.get(), bw::encode(message, id)) == 0);
    return id;
  }
  // The next message, polling the coordinator until it comes (or 2 s pass).
  std::optional<std::pair<bw::header, bw::to_workload>> receive(budget_coordinator& c, int patience_ms = 2000) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(patience_ms);
    std::vector<std::byte> buffer(bw::max_message_bytes + 1);
    while (std::chrono::steady_clock::now() < deadline) {
      c.poll_once(1);
      auto m = glake::detail::receive_message(fd.get(), buffer, 1, MSG_DONTWAIT);
      if (m.error == EAGAIN) continue;
      if (m.size == 0) return std::nullopt;  // closed
      bw::header h;
      auto parsed = bw::parse_to_workload(std::span<const std::byte>(buffer.data(), m.size), 0, &h);
      REQUIRE(std::holds_alternative<bw::to_workload>(parsed));
      return std::pair{h, std::get<bw::to_workload>(std::move(parsed))};
    }
    return std::nullopt;
  }
  // Nothing arrives while the coordinator is polled for `ms`.
  bool quiet(budget_coordinator& c, int ms = 30) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (std::chrono::steady_clock::now() < deadline) {
      c.poll_once(1);
      if (glake::detail::wait_readable(fd.get(), 0)) return false;
    }
    return true;
  }
  workload_id join(budget_coordinator& c, std::string name, std::uint64_t pinned = 0) {
    const auto id = send(bw::join_request{std::move(name), pinned});
    auto answer = receive(c);
    REQUIRE(answer);
    CHECK(answer->first.request == id);
    REQUIRE(std::holds_alternative<bw::joined_reply>(answer->second));
    return std::get<bw::joined_reply>(answer->second).workload;
  }
};

bw::error_reply expect_error(std::optional<std::pair<bw::header, bw::to_workload>> answer) {
  REQUIRE(answer);
  REQUIRE(std::holds_alternative<bw::error_reply>(answer->second));
  return std::get<bw::error_reply>(answer->second);
}

std::size_t held_by(const budget_coordinator& c, workload_id w) {
  for (const workload_usage& u : c.snapshot()) {
    if (u.id == w) return u.held;
  }
  return 0;
}

}  // namespace

TEST_CASE("budget_coordinator: grants what fits, queues what does not, reclaims from the largest unpinned holder") {
  temp_dir dir;
  budget_coordinator coordinator(dir.socket(), 100);
  raw_client a(dir.socket()), b(dir.socket()), c(dir.socket());
  const workload_id wa = a.join(coordinator, "a");
  const workload_id wb = b.join(coordinator, "b");
  const workload_id wc = c.join(coordinator, "c");
  CHECK(coordinator.clients() == 3);

  a.send(bw::acquire_request{wa, 50, 1000, true});
  auto got = a.receive(coordinator);
  REQUIRE(got);
  CHECK(std::get<bw::granted_reply>(got->second).bytes == 50);
  b.send(bw::acquire_request{wb, 30, 1000, true});
  REQUIRE(b.receive(coordinator));
  b.send(bw::set_pinned_request{wb, 30});  // b's bytes are its running operation's

  // 20 left: a no-wait acquire of 40 is refused at once, and nobody is asked to move anything.
  c.send(bw::acquire_request{wc, 40, 1000, false});
  const auto no_room = expect_error(c.receive(coordinator));
  CHECK(no_room.code == bw::errc::no_room);
  CHECK(a.quiet(coordinator));
  CHECK(b.quiet(coordinator));

  // A waiting one is queued and a, the only holder with unpinned bytes, is asked for the 20 missing.
  const auto asked = c.send(bw::acquire_request{wc, 40, 5000, true});
  CHECK(c.quiet(coordinator));
  CHECK(coordinator.waiting() == 1);
  auto reclaim = a.receive(coordinator);
  REQUIRE(reclaim);
  REQUIRE(std::holds_alternative<bw::reclaim_request>(reclaim->second));
  CHECK(std::get<bw::reclaim_request>(reclaim->second).bytes == 20);
  CHECK(b.quiet(coordinator));  // all of b's bytes are pinned
  // a moves 24 bytes out, releases them and answers.
  a.send(bw::release_request{wa, 24});
  glake::detail::send_message(a.fd.get(), bw::encode(bw::reclaimed_reply{24}, reclaim->first.request));
  auto granted = c.receive(coordinator);
  REQUIRE(granted);
  CHECK(granted->first.request == asked);
  CHECK(std::get<bw::granted_reply>(granted->second).bytes == 40);
  CHECK(coordinator.waiting() == 0);
  CHECK(held_by(coordinator, wa) == 26);
  CHECK(held_by(coordinator, wc) == 40);
  CHECK(coordinator.used() == 96);
  CHECK(coordinator.stats().reclaims == 1);
  CHECK(coordinator.stats().reclaimed_bytes == 24);
  CHECK(coordinator.stats().peak_used <= 100);

  // The ledger as a workload sees it.
  c.send(bw::stats_request{});
  auto stats = c.receive(coordinator);
  REQUIRE(stats);
  const auto& s = std::get<bw::stats_reply>(stats->second);
  CHECK(s.budget == 100);
  CHECK(s.used == 96);
  REQUIRE(s.lines.size() == 3);
  CHECK((s.lines[1].name == "b" && s.lines[1].pinned == 30));

  // Releasing more than held, or naming another connection's workload, is refused by name.
  a.send(bw::release_request{wa, 1000});
  CHECK(expect_error(a.receive(coordinator)).code == bw::errc::bad_size);
  a.send(bw::release_request{wb, 1});
  CHECK(expect_error(a.receive(coordinator)).code == bw::errc::unknown_workload);
  CHECK(held_by(coordinator, wb) == 30);
}

TEST_CASE("budget_coordinator: a dropped connection gives its share back and the waiter is served") {
  temp_dir dir;
  budget_coordinator coordinator(dir.socket(), 100);
  auto a = std::make_unique<raw_client>(dir.socket());
  raw_client b(dir.socket());
  const workload_id wa = a->join(coordinator, "a");
  const workload_id wa2 = a->join(coordinator, "a2");
  const workload_id wb = b.join(coordinator, "b");
  a->send(bw::acquire_request{wa, 60, 1000, true});
  REQUIRE(a->receive(coordinator));
  a->send(bw::acquire_request{wa2, 30, 1000, true});
  REQUIRE(a->receive(coordinator));
  a->send(bw::set_pinned_request{wa, 60});
  a->send(bw::set_pinned_request{wa2, 30});
  b.send(bw::acquire_request{wb, 50, 10000, true});
  CHECK(b.quiet(coordinator, 50));
  CHECK(a->quiet(coordinator));  // everything a holds is pinned: nothing to ask for
  CHECK(coordinator.waiting() == 1);
  a.reset();  // the process is gone
  auto granted = b.receive(coordinator);
  REQUIRE(granted);
  CHECK(std::holds_alternative<bw::granted_reply>(granted->second));
  CHECK(coordinator.snapshot().size() == 1);
  CHECK(coordinator.used() == 50);
  CHECK(coordinator.stats().dropped == 1);
}

TEST_CASE("budget_coordinator: a queued acquire times out with out_of_memory naming the workload, the bytes and the holders") {
  temp_dir dir;
  budget_coordinator coordinator(dir.socket(), 100);
  raw_client a(dir.socket()), b(dir.socket());
  const workload_id wa = a.join(coordinator, "holder");
  const workload_id wb = b.join(coordinator, "late-comer");
  a.send(bw::acquire_request{wa, 80, 1000, true});
  REQUIRE(a.receive(coordinator));
  a.send(bw::set_pinned_request{wa, 80});
  const auto start = std::chrono::steady_clock::now();
  b.send(bw::acquire_request{wb, 50, 60, true});
  const auto error = expect_error(b.receive(coordinator));
  CHECK(std::chrono::steady_clock::now() - start >= 60ms);
  CHECK(error.code == bw::errc::out_of_memory);
  CHECK(error.text.find("'late-comer'") != std::string::npos);
  CHECK(error.text.find("50 bytes") != std::string::npos);
  CHECK(error.text.find("'holder' holds") != std::string::npos);
  CHECK(coordinator.waiting() == 0);
  CHECK(coordinator.stats().timeouts == 1);
  CHECK(held_by(coordinator, wb) == 0);
}

TEST_CASE("budget_coordinator: a need above the whole budget is refused at once, naming the workload and the bytes") {
  temp_dir dir;
  budget_coordinator coordinator(dir.socket(), 1000);
  raw_client a(dir.socket());
  a.send(bw::join_request{"big-model", 4096});
  auto error = expect_error(a.receive(coordinator));
  CHECK(error.code == bw::errc::out_of_memory);
  CHECK(error.text.find("'big-model' needs 4096 bytes") != std::string::npos);
  CHECK(coordinator.snapshot().empty());
  const workload_id w = a.join(coordinator, "big-model");
  a.send(bw::acquire_request{w, 1001, 10000, true});
  error = expect_error(a.receive(coordinator, 500));  // at once, not after 10 s
  CHECK(error.text.find("'big-model' needs 1001 bytes") != std::string::npos);
  const auto id = a.send(bw::set_pinned_request{w, 2000});
  auto answer = a.receive(coordinator);
  CHECK(expect_error(answer).text.find("2000 bytes") != std::string::npos);
  CHECK(answer->first.request == id);
  CHECK(coordinator.waiting() == 0);
}

TEST_CASE("budget_coordinator: admission, malformed messages and a second coordinator are refused") {
  temp_dir dir;
  budget_coordinator_options options;
  int asked = 0;
  options.admit = [&](const glake::detail::peer_credentials& peer) {
    ++asked;
    return peer.pid != ::getpid();  // this process is turned away
  };
  {
    budget_coordinator coordinator(dir.socket(), 100, options);
    raw_client a(dir.socket());
    const auto error = expect_error(a.receive(coordinator));
    CHECK(error.code == bw::errc::permission_denied);
    CHECK(asked == 1);
    CHECK(coordinator.clients() == 0);
  }
  budget_coordinator coordinator(dir.socket(), 100);
  CHECK_THROWS_AS(budget_coordinator(dir.socket(), 100), driver_error);
  raw_client a(dir.socket());
  a.join(coordinator, "a");
  const std::byte junk[20] = {};
  REQUIRE(glake::detail::send_message(a.fd.get(), junk) == 0);
  CHECK(expect_error(a.receive(coordinator)).code == bw::errc::bad_message);
  CHECK_FALSE(a.receive(coordinator, 200));  // closed after
  CHECK(coordinator.snapshot().empty());     // and its workload left
}

namespace {

// Offers nothing: a workload whose memory is all in use.
struct nothing_to_give final : budget_member {
  std::optional<victim> offer_victim(const ask&) override { return std::nullopt; }
  std::size_t evict(const ask&, allocation_id) override { return 0; }
};

// A coordinator in a child process, until the test ends (or kills it).
class coordinator_process {
 public:
  coordinator_process(std::string path, std::size_t budget) {
    channel ready;
    pid_ = spawn([&]() -> int {
      budget_coordinator coordinator(path, budget);
      ready.put('R');
      coordinator.run(stop_.fds[0]);
      return 0;
    });
    char c = 0;
    REQUIRE(ready.get(c));
  }
  ~coordinator_process() {
    stop_.put('S');
    wait_for(pid_);
  }

 private:
  channel stop_;
  pid_t pid_ = -1;
};

}  // namespace

namespace {

// The budget_service models, ready to use: a shared_budget, or a coordinated_budget connected
// to a coordinator served by a thread of the test.
template <class B>
struct budget_fixture;

template <>
struct budget_fixture<shared_budget> {
  shared_budget budget;
  explicit budget_fixture(std::size_t bytes) : budget(bytes) {}
};

template <>
struct budget_fixture<coordinated_budget> {
  temp_dir dir;
  budget_coordinator coordinator;
  channel stop;
  std::thread server;
  coordinated_budget budget;
  explicit budget_fixture(std::size_t bytes)
      : coordinator(dir.socket(), bytes),
        server([this] { coordinator.run(stop.fds[0]); }),
        budget(dir.socket(), 1) {
    REQUIRE(budget.coordinated());
  }
  ~budget_fixture() {
    stop.put('S');
    server.join();
  }
};

// A workload with one allocation it gives up when asked (evict releases its bytes).
template <class B>
struct one_victim final : budget_member {
  B& budget;
  workload_id id = 0;
  std::size_t bytes;
  std::atomic<bool> on_device{false};
  std::atomic<int> evictions{0};
  one_victim(B& b, std::string name, std::size_t n) : budget(b), bytes(n) { id = budget.join(std::move(name), *this); }
  ~one_victim() { budget.leave(id); }
  void bring_in() {
    budget.acquire(id, bytes, 1s);
    on_device = true;
  }
  std::optional<victim> offer_victim(const ask&) override {
    if (!on_device) return std::nullopt;
    return victim{never_used, bytes, 0};
  }
  std::size_t evict(const ask&, allocation_id) override {
    if (!on_device.exchange(false)) return 0;
    ++evictions;
    budget.release(id, bytes);
    return bytes;
  }
};

}  // namespace

TEST_CASE_TEMPLATE("budget_service: grants within the budget, moves victims out, refuses what can never fit, waits and gives up",
                   B, shared_budget, coordinated_budget) {
  budget_fixture<B> f(1000);
  B& budget = f.budget;
  nothing_to_give busy;
  const workload_id a = budget.join("a", busy);
  const workload_id b = budget.join("b", busy, 100);
  CHECK(a != b);
  CHECK_FALSE(budget.acquire(a, 600, 1s));  // fits: no wait
  CHECK_FALSE(budget.try_acquire(b, 500, never_used));
  CHECK(budget.try_acquire(b, 400, never_used));
  // More than the whole budget: at once, naming the workload and the bytes.
  try {
    budget.set_pinned(a, 1001);
    FAIL("pinned more than the budget");
  } catch (const out_of_memory& e) {
    CHECK(std::string(e.what()).find("'a' needs 1001 bytes") != std::string::npos);
  }
  // Full, nothing movable: waits, then out_of_memory naming the workload.
  const auto start = std::chrono::steady_clock::now();
  try {
    budget.acquire(b, 100, 50ms, budget.take_ticket());
    FAIL("granted beyond the budget");
  } catch (const out_of_memory& e) {
    CHECK(std::string(e.what()).find("'b'") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - start >= 50ms);
  budget.release(a, 600);
  budget.release(b, 400);
  {
    // A victim is moved out for a request that does not fit otherwise, and not for one that does.
    one_victim<B> v(budget, "v", 700);
    v.bring_in();
    CHECK_FALSE(budget.acquire(a, 300, 1s));
    CHECK(v.evictions.load() == 0);
    budget.acquire(b, 200, 1s);
    CHECK(v.evictions.load() == 1);
    CHECK_FALSE(v.on_device.load());
    budget.release(a, 300);
    budget.release(b, 200);
    budget.changed();
  }
  // A workload that left gave its share back: all of it can be granted again.
  budget.leave(a);
  CHECK_FALSE(budget.acquire(b, 1000, 1s));
  budget.release(b, 1000);
  budget.leave(b);
}

TEST_CASE("coordinated_budget: without a coordinator the process runs alone with its local budget and says so once") {
  temp_dir dir;
  std::vector<std::string> said;
  coordinated_budget_options options;
  options.report = [&](std::string_view text) { said.emplace_back(text); };
  coordinated_budget budget(dir.socket(), 1000, options);
  CHECK_FALSE(budget.coordinated());
  CHECK(budget.budget() == 1000);
  REQUIRE(said.size() == 1);
  CHECK(said[0].find(dir.socket()) != std::string::npos);
  CHECK(said[0].find("runs alone with a local budget of 1000 bytes") != std::string::npos);
  nothing_to_give m;
  const workload_id w = budget.join("alone", m);
  CHECK_FALSE(budget.acquire(w, 600, 0ms));
  CHECK_FALSE(budget.try_acquire(w, 600, never_used));
  CHECK_THROWS_AS(budget.acquire(w, 600, 1ms), out_of_memory);
  budget.release(w, 600);
  CHECK(budget.try_acquire(w, 600, never_used));
  CHECK_THROWS_AS(budget.set_pinned(w, 2000), out_of_memory);
  budget.leave(w);
  CHECK(said.size() == 1);
  CHECK_THROWS_AS(coordinated_budget(dir.socket(), 0), usage_error);
}

TEST_CASE("coordinated_budget: a need above the coordinator's budget throws out_of_memory naming the workload") {
  temp_dir dir;
  coordinator_process server(dir.socket(), 1000);
  coordinated_budget budget(dir.socket(), 1 << 30);
  REQUIRE(budget.coordinated());
  CHECK(budget.budget() == 1000);
  nothing_to_give m;
  try {
    budget.join("huge", m, 5000);
    FAIL("joined with a need above the budget");
  } catch (const out_of_memory& e) {
    CHECK(std::string(e.what()).find("'huge' needs 5000 bytes") != std::string::npos);
  }
  const workload_id w = budget.join("grows", m);
  try {
    budget.acquire(w, 1500, 10s);
    FAIL("granted more than the budget");
  } catch (const out_of_memory& e) {
    CHECK(std::string(e.what()).find("'grows' needs 1500 bytes") != std::string::npos);
  }
  CHECK_THROWS_AS(budget.set_pinned(w, 1001), out_of_memory);
  CHECK_FALSE(budget.acquire(w, 1000, 1s));
  CHECK_FALSE(budget.try_acquire(w, 1, never_used));
  budget.release(w, 1000);
  CHECK(budget.try_acquire(w, 1, never_used));
}

TEST_CASE("coordinated_budget: a process killed while holding bytes gives its share back, and a waiter proceeds") {
  temp_dir dir;
  budget_coordinator coordinator(dir.socket(), 1000);
  channel holding, go;
  const pid_t holder = spawn([&]() -> int {
    char c;
    if (!go.get(c)) return 2;
    coordinated_budget budget(dir.socket(), 1000);
    nothing_to_give m;
    const workload_id w = budget.join("holder", m);
    budget.acquire(w, 900, 5s);
    budget.set_pinned(w, 900);
    holding.put('H');
    for (;;) ::pause();
  });
  const pid_t waiter = spawn([&]() -> int {
    char c;
    if (!go.get(c)) return 2;
    if (!holding.get(c)) return 3;  // the holder's share is granted
    coordinated_budget budget(dir.socket(), 1000);
    nothing_to_give m;
    const workload_id w = budget.join("waiter", m);
    const bool waited = budget.acquire(w, 500, 20s);
    return waited ? 0 : 4;
  });
  go.put('g');
  go.put('g');
  // Serve until the waiter waits, then kill the holder.
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (coordinator.waiting() == 0 && std::chrono::steady_clock::now() < deadline) coordinator.poll_once(5);
  REQUIRE(coordinator.waiting() == 1);
  CHECK(coordinator.used() == 900);
  ::kill(holder, SIGKILL);
  wait_for(holder);
  int status = -1;
  while (::waitpid(waiter, &status, WNOHANG) == 0 && std::chrono::steady_clock::now() < deadline) {
    coordinator.poll_once(5);
  }
  CHECK(exited_with(status, 0));
  CHECK(coordinator.stats().dropped >= 1);
  CHECK(coordinator.stats().timeouts == 0);
}

namespace {

constexpr std::size_t G = 64 * 1024;  // the simulated device's granularity
using sim_buffer = virtual_buffer<sim_provider, sim_host_provider, sim_reserver, sim_copier>;

// Device bytes of managed memory over every process, in memory the processes share: a move
// onto a device counts before its copy, a move off after, so `over` sees every moment the
// devices together held more than the budget.
struct device_count {
  std::atomic<std::int64_t> bytes{0};
  std::atomic<std::int64_t> peak{0};
  std::atomic<int> over{0};
  std::atomic<int> moves{0};
  std::int64_t budget = 0;
};
static_assert(std::atomic<std::int64_t>::is_always_lock_free);

struct shared_count {
  device_count* count = nullptr;
  shared_count() {
    void* p = ::mmap(nullptr, sizeof(device_count), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    REQUIRE(p != MAP_FAILED);
    count = new (p) device_count;
  }
  ~shared_count() { ::munmap(count, sizeof(device_count)); }
};

// A sim_buffer whose moves are counted in a device_count.
class counted_buffer {
 public:
  counted_buffer(sim_buffer& b, device_count& c) : b_(&b), c_(&c) {}
  void* data() const noexcept { return b_->data(); }
  std::size_t size() const noexcept { return b_->size(); }
  residence residence_of(std::size_t offset) const { return b_->residence_of(offset); }
  void offload(std::size_t offset, std::size_t bytes, stream_ref s) {
    b_->offload(offset, bytes, s);
    c_->bytes -= static_cast<std::int64_t>(bytes);
    ++c_->moves;
  }
  void prefetch(std::size_t offset, std::size_t bytes, stream_ref s) {
    const std::int64_t now = c_->bytes += static_cast<std::int64_t>(bytes);
    if (now > c_->budget) ++c_->over;
    std::int64_t peak = c_->peak.load();
    while (now > peak && !c_->peak.compare_exchange_weak(peak, now)) {
    }
    b_->prefetch(offset, bytes, s);
    ++c_->moves;
  }
  void record_stream(stream_ref s) { b_->record_stream(s); }

 private:
  sim_buffer* b_;
  device_count* c_;
};
static_assert(tiered_memory<counted_buffer>);

struct manual_clock {
  using time_point = std::chrono::time_point<std::chrono::steady_clock, std::chrono::nanoseconds>;
  std::shared_ptr<std::atomic<std::int64_t>> ns = std::make_shared<std::atomic<std::int64_t>>(0);
  time_point now() const { return time_point(std::chrono::nanoseconds(ns->load())); }
  void advance(std::chrono::nanoseconds d) const { ns->fetch_add(d.count()); }
};

using coordinated_scheduler = workload_scheduler<counted_buffer, lru_policy, manual_clock, coordinated_budget>;

// One workload on its own simulated device: a cyclic sweep over `sizes`, each operation using
// two neighbours, for `iterations`. 0 when every operation found its memory on the device and
// the device never held more than the scheduler says; else which check failed.
int run_sweep(coordinated_budget& budget, device_count& count, const std::string& name,
              const std::vector<std::size_t>& sizes, int iterations, const std::function<void()>& ready = {}) {
  sim_device gpu{1024 * G, G, 1024 * G};
  std::vector<std::unique_ptr<sim_buffer>> buffers;
  std::vector<std::unique_ptr<counted_buffer>> counted;
  manual_clock clock;
  coordinated_scheduler scheduler(budget, name, lru_policy{}, scheduler_options{}, clock);
  std::vector<allocation_id> ids;
  for (std::size_t s : sizes) {
    buffers.push_back(std::make_unique<sim_buffer>(sim_provider(gpu), sim_host_provider(gpu), sim_reserver(gpu),
                                                   sim_copier(gpu), s, s));
    buffers.back()->commit(0, s);
    buffers.back()->offload(0, s);
    counted.push_back(std::make_unique<counted_buffer>(*buffers.back(), count));
    ids.push_back(scheduler.manage(*counted.back()));
  }
  if (ready) ready();
  for (int i = 0; i < iterations; ++i) {
    scheduler.iteration_begin();
    for (std::size_t k = 0; k < ids.size(); ++k) {
      const allocation_id use[] = {ids[k], ids[(k + 1) % ids.size()]};
      scheduler.will_use(std::span<const allocation_id>(use));
      for (allocation_id id : use) {
        if (buffers[id]->residence_of(0) != residence::device) return 10;
      }
      // The scheduler's count first: moves out for other workloads may happen meanwhile, and
      // only lower the device's.
      const std::size_t says = scheduler.stats().device_bytes;
      if (gpu.physical_bytes() > says) return 11;
      clock.advance(100us);
    }
  }
  // Done: each allocation leaves the device before its share goes back (the other way round,
  // another workload could be granted those bytes while they are still here). Pinned, it is not
  // moved for anyone meanwhile.
  for (allocation_id id : ids) {
    scheduler.will_use(id);
    counted[id]->offload(0, sizes[id], default_stream);
    scheduler.unmanage(id);
  }
  return gpu.violations() == 0 && gpu.physical_bytes() == 0 ? 0 : 12;
}

}  // namespace

TEST_CASE("coordinated_budget: two processes whose needs sum over the budget both finish, the devices never over it") {
  temp_dir dir;
  shared_count shared;
  const std::size_t budget_bytes = 12 * G;  // each sweeps 16 G and needs 8 G at once
  shared.count->budget = static_cast<std::int64_t>(budget_bytes);
  channel go, joined, start;
  const auto worker = [&](const char* name) {
    return spawn([&, name]() -> int {
      char c;
      if (!go.get(c)) return 2;
      bool alone = false;
      coordinated_budget_options options;
      options.report = [&](std::string_view) { alone = true; };
      coordinated_budget budget(dir.socket(), budget_bytes, options);
      if (!budget.coordinated() || alone) return 3;
      // Both sweeps run at once: each waits for the other to have joined.
      const auto barrier = [&] {
        joined.put('J');
        char s;
        start.get(s);
      };
      return run_sweep(budget, *shared.count, name, {4 * G, 4 * G, 4 * G, 4 * G}, 20, barrier);
    });
  };
  const pid_t a = worker("a");
  const pid_t b = worker("b");
  budget_coordinator coordinator(dir.socket(), budget_bytes);
  go.put('g');
  go.put('g');
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  int ready = 0;
  while (ready < 2 && std::chrono::steady_clock::now() < deadline) {
    coordinator.poll_once(2);
    if (glake::detail::wait_readable(joined.fds[0], 0)) {
      char c;
      REQUIRE(::read(joined.fds[0], &c, 1) == 1);
      ++ready;
    }
  }
  CHECK(coordinator.snapshot().size() == 2);
  start.put('s');
  start.put('s');
  int status_a = -1, status_b = -1;
  while ((status_a == -1 || status_b == -1) && std::chrono::steady_clock::now() < deadline) {
    coordinator.poll_once(2);
    if (status_a == -1 && ::waitpid(a, &status_a, WNOHANG) == 0) status_a = -1;
    if (status_b == -1 && ::waitpid(b, &status_b, WNOHANG) == 0) status_b = -1;
    CHECK(coordinator.used() <= budget_bytes);
  }
  if (status_a == -1) ::kill(a, SIGKILL), wait_for(a);
  if (status_b == -1) ::kill(b, SIGKILL), wait_for(b);
  INFO("worker a: exited ", WIFEXITED(status_a), " status ", WEXITSTATUS(status_a), " signal ", WTERMSIG(status_a));
  INFO("worker b: exited ", WIFEXITED(status_b), " status ", WEXITSTATUS(status_b), " signal ", WTERMSIG(status_b));
  CHECK(exited_with(status_a, 0));
  CHECK(exited_with(status_b, 0));
  CHECK(shared.count->over.load() == 0);
  CHECK(shared.count->peak.load() <= static_cast<std::int64_t>(budget_bytes));
  CHECK(shared.count->peak.load() >= static_cast<std::int64_t>(8 * G));
  CHECK(shared.count->moves.load() > 2 * 20 * 4);  // every operation moved something
  CHECK(coordinator.stats().grants > 2 * 20 * 4);
  CHECK(coordinator.stats().timeouts == 0);
  CHECK(coordinator.stats().peak_used <= budget_bytes);
  for (int i = 0; i < 100 && coordinator.clients() != 0; ++i) coordinator.poll_once(10);
  CHECK(coordinator.snapshot().empty());  // both left
}

TEST_CASE("threads: coordinated budgets on their own threads share one device through a coordinator thread") {
  temp_dir dir;
  const std::size_t budget_bytes = 12 * G;
  budget_coordinator coordinator(dir.socket(), budget_bytes);
  channel stop;
  std::thread server([&] { coordinator.run(stop.fds[0]); });
  device_count count;
  count.budget = static_cast<std::int64_t>(budget_bytes);
  std::atomic<int> results{0};
  {
    // Two "processes": one connection each.
    coordinated_budget one(dir.socket(), budget_bytes), two(dir.socket(), budget_bytes);
    CHECK(one.coordinated());
    CHECK(two.coordinated());
    std::thread ta([&] { results += run_sweep(one, count, "a", {2 * G, 3 * G, 2 * G, 3 * G}, 6) == 0 ? 1 : 100; });
    std::thread tb([&] { results += run_sweep(two, count, "b", {4 * G, 2 * G, 4 * G}, 6) == 0 ? 1 : 100; });
    ta.join();
    tb.join();
  }
  stop.put('S');
  server.join();
  CHECK(results.load() == 2);
  CHECK(count.over.load() == 0);
  CHECK(count.peak.load() > 7 * G);
  CHECK(coordinator.stats().timeouts == 0);
  CHECK(coordinator.stats().peak_used <= budget_bytes);
  // Both connections closed when the budgets were destroyed (the stop may have come first).
  for (int i = 0; i < 100 && coordinator.clients() != 0; ++i) coordinator.poll_once(10);
  CHECK(coordinator.clients() == 0);
  CHECK(coordinator.snapshot().empty());
}

TEST_CASE("coordinated_budget: a process holding the whole budget moves memory out when another process needs it") {
  temp_dir dir;
  shared_count shared;
  const std::size_t budget_bytes = 12 * G;
  shared.count->budget = static_cast<std::int64_t>(budget_bytes);
  channel go, holding, done, offloads;
  const pid_t holder = spawn([&]() -> int {
    char c;
    if (!go.get(c)) return 2;
    coordinated_budget budget(dir.socket(), budget_bytes);
    if (!budget.coordinated()) return 3;
    sim_device gpu{1024 * G, G, 1024 * G};
    std::vector<std::unique_ptr<sim_buffer>> buffers;
    std::vector<std::unique_ptr<counted_buffer>> counted;
    coordinated_scheduler scheduler(budget, "holder", lru_policy{}, scheduler_options{}, manual_clock{});
    for (int i = 0; i < 3; ++i) {
      buffers.push_back(std::make_unique<sim_buffer>(sim_provider(gpu), sim_host_provider(gpu), sim_reserver(gpu),
                                                     sim_copier(gpu), 4 * G, 4 * G));
      buffers.back()->commit(0, 4 * G);
      buffers.back()->offload(0, 4 * G);
      counted.push_back(std::make_unique<counted_buffer>(*buffers.back(), *shared.count));
      scheduler.will_use(scheduler.manage(*counted.back()));
    }
    scheduler.idle();  // all 12 G on the device, none of it in use
    holding.put('H');
    if (!done.get(c)) return 4;  // meanwhile its reading thread serves the coordinator
    offloads.put(static_cast<int>(scheduler.stats().offloads));
    for (allocation_id id = 0; id < 3; ++id) {
      if (scheduler.residence_of(id) == residence::device) counted[id]->offload(0, 4 * G, default_stream);
      scheduler.unmanage(id);
    }
    return 0;
  });
  const pid_t needer = spawn([&]() -> int {
    char c;
    if (!holding.get(c)) return 2;
    coordinated_budget budget(dir.socket(), budget_bytes);
    sim_device gpu{1024 * G, G, 1024 * G};
    std::vector<std::unique_ptr<sim_buffer>> buffers;
    std::vector<std::unique_ptr<counted_buffer>> counted;
    coordinated_scheduler scheduler(budget, "needer", lru_policy{}, scheduler_options{}, manual_clock{});
    std::vector<allocation_id> ids;
    for (int i = 0; i < 2; ++i) {
      buffers.push_back(std::make_unique<sim_buffer>(sim_provider(gpu), sim_host_provider(gpu), sim_reserver(gpu),
                                                     sim_copier(gpu), 4 * G, 4 * G));
      buffers.back()->commit(0, 4 * G);
      buffers.back()->offload(0, 4 * G);
      counted.push_back(std::make_unique<counted_buffer>(*buffers.back(), *shared.count));
      ids.push_back(scheduler.manage(*counted.back()));
    }
    scheduler.will_use(std::span<const allocation_id>(ids));  // 8 G: only the holder has them
    for (const auto& b : buffers) {
      if (b->residence_of(0) != residence::device) return 5;
    }
    const int waited = static_cast<int>(scheduler.stats().waits);
    for (allocation_id id : ids) {
      counted[id]->offload(0, 4 * G, default_stream);
      scheduler.unmanage(id);
    }
    return waited == 1 ? 0 : 6;
  });
  budget_coordinator coordinator(dir.socket(), budget_bytes);
  go.put('g');
  int status = -1;
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (::waitpid(needer, &status, WNOHANG) == 0 && std::chrono::steady_clock::now() < deadline) {
    coordinator.poll_once(2);
  }
  CHECK(exited_with(status, 0));
  done.put('d');
  int moved = -1;
  while (!glake::detail::wait_readable(offloads.fds[0], 0) && std::chrono::steady_clock::now() < deadline) {
    coordinator.poll_once(2);
  }
  REQUIRE(offloads.get(moved, 0));
  CHECK(moved == 2);  // two of its three allocations went to the host for the other process
  int holder_status = -1;
  while (::waitpid(holder, &holder_status, WNOHANG) == 0 && std::chrono::steady_clock::now() < deadline) {
    coordinator.poll_once(2);
  }
  CHECK(exited_with(holder_status, 0));
  CHECK(coordinator.stats().reclaims >= 1);
  CHECK(coordinator.stats().reclaimed_bytes == 8 * G);
  CHECK(coordinator.stats().waits == 1);
  CHECK(coordinator.stats().timeouts == 0);
  CHECK(shared.count->over.load() == 0);
  CHECK(shared.count->peak.load() == static_cast<std::int64_t>(budget_bytes));
}

TEST_CASE("budget_coordinator: waiting acquires are bounded per connection, one beyond is refused naming the limit") {
  temp_dir dir;
  budget_coordinator_options options;
  options.max_waiters = 4;
  budget_coordinator coordinator(dir.socket(), 100, options);
  raw_client a(dir.socket()), b(dir.socket());
  const workload_id wa = a.join(coordinator, "holder");
  const workload_id wb = b.join(coordinator, "flooder");
  a.send(bw::acquire_request{wa, 100, 1000, true});
  REQUIRE(a.receive(coordinator));
  a.send(bw::set_pinned_request{wa, 100});
  for (int i = 0; i < 4; ++i) b.send(bw::acquire_request{wb, 10, 10000, true});
  CHECK(b.quiet(coordinator));
  CHECK(coordinator.waiting() == 4);
  const auto refused = b.send(bw::acquire_request{wb, 10, 10000, true});
  auto answer = b.receive(coordinator, 500);  // at once
  const auto error = expect_error(answer);
  CHECK(answer->first.request == refused);
  CHECK(error.code == bw::errc::too_many);
  CHECK(error.text.find("4 acquires") != std::string::npos);
  CHECK(coordinator.waiting() == 4);
  // Another connection may still wait.
  raw_client c(dir.socket());
  const workload_id wc = c.join(coordinator, "patient");
  c.send(bw::acquire_request{wc, 10, 10000, true});
  CHECK(c.quiet(coordinator));
  CHECK(coordinator.waiting() == 5);
}

TEST_CASE("budget_coordinator: with acquires waiting and nothing to reclaim it sleeps until a deadline") {
  temp_dir dir;
  budget_coordinator coordinator(dir.socket(), 100);
  raw_client a(dir.socket()), b(dir.socket());
  const workload_id wa = a.join(coordinator, "holder");
  const workload_id wb = b.join(coordinator, "waiter");
  a.send(bw::acquire_request{wa, 100, 1000, true});
  REQUIRE(a.receive(coordinator));
  a.send(bw::set_pinned_request{wa, 100});  // nothing a holds may move
  b.send(bw::acquire_request{wb, 10, 1000, true});
  CHECK(b.quiet(coordinator));
  REQUIRE(coordinator.waiting() == 1);
  // The waiter's deadline is about a second away and nobody can give anything: each poll should
  // sleep until its timeout, not wake every few milliseconds.
  int polls = 0;
  const auto end = std::chrono::steady_clock::now() + 300ms;
  while (std::chrono::steady_clock::now() < end) {
    coordinator.poll_once(150);
    ++polls;
  }
  CHECK(polls <= 4);
  CHECK(coordinator.waiting() == 1);
}

TEST_CASE("budget_ledger: workload names are printed without control characters") {
  budget_ledger ledger(100);
  const workload_id w = ledger.join("evil\nworkload 9 forged held 0\x1b[2J\x7f\\", 0);
  const std::string name = ledger.usage(w).name;
  CHECK(name.find('\n') == std::string::npos);
  CHECK(name.find('\x1b') == std::string::npos);
  CHECK(name.find('\x7f') == std::string::npos);
  CHECK(name == "evil\\nworkload 9 forged held 0\\x1b[2J\\x7f\\\\");
  CHECK(ledger.describe().find('\n') == std::string::npos);
  try {
    ledger.join("big\r\nmodel", 1000);
    FAIL("a need above the budget was accepted");
  } catch (const out_of_memory& e) {
    CHECK(std::string(e.what()).find("'big\\r\\nmodel'") != std::string::npos);
  }
}

TEST_CASE("budget_ledger: a fraction of the largest device is its exact share, never an undefined conversion") {
  constexpr std::size_t most = std::numeric_limits<std::size_t>::max();
  CHECK(budget_ledger::fraction_of(most, 1.0).budget() == most);
  CHECK(budget_ledger::fraction_of(80 * (std::size_t{1} << 30), 0.5).budget() == 40 * (std::size_t{1} << 30));
  const std::size_t near_all = budget_ledger::fraction_of(most, 0.9999999999999999).budget();
  CHECK(near_all > most / 2);
  CHECK(near_all < most);
  CHECK_THROWS_AS(budget_ledger::fraction_of(1, 0.25), usage_error);  // rounds to 0 bytes
}
