// Cross-process deduplication on the host backend: the protocol's parser, the sharing concepts'
// models, and the broker with real client processes (fork): races between publishers, forced
// digest collisions, processes killed mid-publish and while holding shares, a broker killed
// under its clients, writes to shared memory, permissions, malformed messages, forged
// descriptors and descriptor exhaustion.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "glake/sharing/dedup_broker.hpp"
#include "glake/sharing/dedup_client.hpp"
#include "glake/sharing/dedup_protocol.hpp"
#include "glake/sharing/host_sharing.hpp"
#include "support/processes.hpp"

namespace {

using namespace glake;
namespace dd = glake::dedup;

constexpr std::size_t piece = 64 * KiB;  // the tests' chunk_bytes: small, several pages

// --- processes and memory ----------------------------------------------------------------------

using testing::channel;
using testing::exited_with;
using testing::spawn;
using testing::temp_dir;
using testing::wait_for;

// A broker serving in a child process until stopped or killed.
class broker_process {
 public:
  explicit broker_process(std::string path, std::function<dedup_broker_options()> options = {},
                          std::function<void()> in_child = {})
      : path_(std::move(path)) {
    channel ready;
    pid_ = spawn([&]() -> int {
      if (in_child) in_child();
      dedup_broker broker(path_, options ? options() : dedup_broker_options{});
      ready.put('R');
      broker.run(stop_.fds[0]);
      return 0;
    });
    char c = 0;
    REQUIRE(ready.get(c, 30000));
    REQUIRE(c == 'R');
  }
  broker_process(const broker_process&) = delete;
  broker_process& operator=(const broker_process&) = delete;
  ~broker_process() {
    if (pid_ > 0) kill();
  }
  pid_t pid() const { return pid_; }
  int stop() {
    stop_.put('S');
    const int status = wait_for(pid_);
    pid_ = -1;
    return status;
  }
  void kill() {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  std::string path_;
  channel stop_;
  pid_t pid_ = -1;
};

// An anonymous, private, writable range filled from `seed` (seed 0: zeros), unmapped at the end.
struct range {
  void* data = nullptr;
  std::size_t bytes = 0;
  explicit range(std::size_t n, std::uint32_t seed) : bytes(n) {
    data = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(data != MAP_FAILED);
    fill(seed);
  }
  range(const range&) = delete;
  range& operator=(const range&) = delete;
  ~range() { ::munmap(data, bytes); }
  void fill(std::uint32_t seed) {
    auto* words = static_cast<std::uint32_t*>(data);
    for (std::size_t i = 0; i < bytes / 4; ++i) words[i] = seed == 0 ? 0 : seed * 2654435761u + static_cast<std::uint32_t>(i);
  }
  bool holds(std::uint32_t seed) const {
    const auto* words = static_cast<const std::uint32_t*>(data);
    for (std::size_t i = 0; i < bytes / 4; ++i) {
      if (words[i] != (seed == 0 ? 0 : seed * 2654435761u + static_cast<std::uint32_t>(i))) return false;
    }
    return true;
  }
  char* at(std::size_t offset) const { return static_cast<char*>(data) + offset; }
};

// The inode of the file mapped at `p` (0 for anonymous memory), from /proc/self/maps.
unsigned long mapped_inode(const void* p) {
  std::ifstream maps("/proc/self/maps");
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  for (std::string line; std::getline(maps, line);) {
    std::istringstream in(line);
    std::string span, perms, offset, device;
    unsigned long inode = 0;
    in >> span >> perms >> offset >> device >> inode;
    const auto dash = span.find('-');
    const auto lo = std::stoull(span.substr(0, dash), nullptr, 16);
    const auto hi = std::stoull(span.substr(dash + 1), nullptr, 16);
    if (address >= lo && address < hi) return inode;
  }
  return 0;
}

dedup_client_options test_options(std::function<void(std::string_view)> report = [](std::string_view) {}) {
  dedup_client_options o;
  o.chunk_bytes = piece;
  o.timeout_ms = 20000;
  o.report = std::move(report);
  return o;
}

// The broker's counters, asked over a connection of its own (nullopt: unreachable).
std::optional<dd::broker_stats> stats_at(const std::string& path) {
  dedup_client<> probe(path, test_options());
  return probe.broker_statistics();
}

// Polls the broker's counters until `ok` holds (true) or 20 s pass (false). The probe's own
// connection is counted in `clients`.
bool eventually(const std::string& path, const std::function<bool(const dd::broker_stats&)>& ok) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    if (auto s = stats_at(path); s && ok(*s)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

// A sealed memfd holding `bytes` bytes of `seed`'s pattern, as a client would send it.
detail::unique_fd sealed_copy(std::size_t bytes, std::uint32_t seed) {
  range r(bytes, seed);
  return host_shareable_backend{}.export_copy(r.data, bytes);
}

// A raw protocol connection, for what a well-behaved client never sends.
struct raw_connection {
  detail::unique_fd fd;
  explicit raw_connection(const std::string& path) : fd(detail::connect_unix(path)) {
    REQUIRE(fd);
    detail::set_socket_timeouts(fd.get(), 20000);
  }
  int send(const std::vector<std::byte>& bytes, std::vector<int> fds = {}) const {
    return detail::send_message(fd.get(), bytes, fds);
  }
  // The next reply, parsed; the descriptor with it in `received`. A parse_error when the
  // broker closed the connection (text "closed").
  std::variant<dd::reply, dd::parse_error> receive(detail::unique_fd* received = nullptr) const {
    std::byte buffer[dd::max_message_bytes + 1];
    detail::received_message m = detail::receive_message(fd.get(), buffer, 1);
    if (m.size == 0) return dd::parse_error{dd::errc::bad_message, "closed", true};
    auto parsed = dd::parse_reply(std::span<const std::byte>(buffer, m.size), m.fds.size());
    if (received != nullptr && !m.fds.empty()) *received = std::move(m.fds.front());
    return parsed;
  }
  // The error code of the next reply; 0 when it is not an error.
  std::uint32_t error_code() const {
    auto r = receive();
    if (auto* e = std::get_if<dd::parse_error>(&r)) return e->text == "closed" ? 1000 : 2000;
    if (auto* e = std::get_if<dd::error_reply>(&std::get<dd::reply>(r))) return static_cast<std::uint32_t>(e->code);
    return 0;
  }
  bool closed_by_peer() const {
    std::byte buffer[16];
    detail::received_message m = detail::receive_message(fd.get(), buffer, 1);
    return m.size == 0 && m.error == 0;
  }
};

constexpr std::uint32_t code(dd::errc e) { return static_cast<std::uint32_t>(e); }

// --- conformance: every model of each sharing concept -----------------------------------------

struct constant_hasher {
  content_digest operator()(const void*, std::size_t) const noexcept { return content_digest{}; }
};
static_assert(content_hasher<constant_hasher>);

TEST_CASE_TEMPLATE("dedup: content_hasher conformance", H, fast_content_hasher, constant_hasher) {
  range a(3 * piece, 7), b(3 * piece, 7);
  const H h{};
  CHECK(h(a.data, a.bytes) == h(b.data, b.bytes));           // equal bytes, equal digests
  CHECK(h(a.data, 100) == h(b.data, 100));                   // any length
  if constexpr (std::is_same_v<H, fast_content_hasher>) {
    const content_digest before = h(a.data, a.bytes);
    a.at(piece)[5] ^= 1;                                     // one bit
    CHECK_FALSE(h(a.data, a.bytes) == before);
    range zeros(4096, 0);
    CHECK_FALSE(h(zeros.data, 32) == h(zeros.data, 64));     // the length counts
    CHECK_FALSE(h(zeros.data, 33) == h(zeros.data, 34));     // in the tail too
  }
}

TEST_CASE_TEMPLATE("dedup: shareable_backend conformance", B, host_shareable_backend) {
  B backend;
  const std::size_t n = 4 * backend.granularity();
  range mine(n, 3);
  detail::unique_fd copy = backend.export_copy(mine.data, n);
  REQUIRE(copy);
  mine.fill(9);                                // the export is a copy: later writes don't reach it
  range other(n, 0);
  void* const where = other.data;
  backend.map_readonly(other.data, n, copy.get());
  CHECK(other.data == where);
  CHECK(other.holds(3));
  CHECK(mapped_inode(other.data) != 0);
  backend.make_private(other.data, n);         // writable again, same bytes, own memory
  CHECK(other.holds(3));
  CHECK(mapped_inode(other.data) == 0);
  other.fill(5);
  CHECK(other.holds(5));
  backend.map_readonly(other.data, n, copy.get());
  backend.discard(other.data, n);              // writable zeros
  CHECK(other.holds(0));
  other.fill(6);
  CHECK(other.holds(6));
  // Misuse: not immutable, wrong size, unaligned.
  detail::unique_fd plain(::memfd_create("plain", MFD_CLOEXEC));
  REQUIRE(::ftruncate(plain.get(), static_cast<off_t>(n)) == 0);
  CHECK_THROWS_AS(backend.map_readonly(other.data, n, plain.get()), usage_error);
  CHECK_THROWS_AS(backend.map_readonly(other.data, 2 * n, copy.get()), usage_error);
  CHECK_THROWS_AS(backend.map_readonly(other.at(1), n, copy.get()), usage_error);
  CHECK(other.holds(6));                       // none of them touched the range
}

TEST_CASE_TEMPLATE("dedup: content_verifier conformance", V, host_content_verifier) {
  V v{};
  const std::size_t n = 3 * piece;
  detail::unique_fd a = sealed_copy(n, 4), b = sealed_copy(n, 4), c = sealed_copy(n, 5);
  CHECK(v.check(a.get(), n) == nullptr);
  CHECK(v.check(a.get(), n - 4096) != nullptr);              // the size must be exact
  CHECK(v.check(a.get(), n + 4096) != nullptr);
  CHECK(v.equal(a.get(), b.get(), n) == 1);
  CHECK(v.equal(a.get(), c.get(), n) == 0);
  detail::unique_fd plain(::memfd_create("plain", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  REQUIRE(::ftruncate(plain.get(), static_cast<off_t>(n)) == 0);
  CHECK(v.check(plain.get(), n) != nullptr);                 // writable: not immutable
  REQUIRE(::fcntl(plain.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0);
  CHECK(v.check(plain.get(), n) != nullptr);                 // still writable
  CHECK(v.equal(a.get(), plain.get(), n) == -1);
  int p[2];
  REQUIRE(::pipe(p) == 0);
  CHECK(v.check(p[0], n) != nullptr);                        // not a file at all
  ::close(p[0]);
  ::close(p[1]);
  CHECK(v.check(-1, n) != nullptr);
  // A sparse object (never written) reads as zeros, without pages allocated for the holes.
  detail::unique_fd sparse(::memfd_create("sparse", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  REQUIRE(::ftruncate(sparse.get(), static_cast<off_t>(n)) == 0);
  REQUIRE(::fcntl(sparse.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE) == 0);
  CHECK(v.check(sparse.get(), n) == nullptr);
  detail::unique_fd zeros = sealed_copy(n, 0);
  CHECK(v.equal(sparse.get(), zeros.get(), n) == 1);
  CHECK(v.equal(sparse.get(), a.get(), n) == 0);
  struct stat info {};
  REQUIRE(::fstat(sparse.get(), &info) == 0);
  CHECK(info.st_blocks == 0);
  // What the broker indexes for a new object: holds the same bytes, and is immutable too.
  detail::unique_fd kept = v.adopt(std::move(b), n);
  REQUIRE(kept);
  CHECK(v.check(kept.get(), n) == nullptr);
  CHECK(v.equal(a.get(), kept.get(), n) == 1);
  if constexpr (sliced_content_verifier<V>) {
    // Objects that differ in their last page only: equal before it, different in it.
    range last(n, 4);
    last.at(n - 1)[0] ^= 1;
    detail::unique_fd d = host_shareable_backend{}.export_copy(last.data, n);
    CHECK(v.equal_slice(a.get(), d.get(), n, 0, n - 4096) == 1);
    CHECK(v.equal_slice(a.get(), d.get(), n, piece, n - 4096 - piece) == 1);
    CHECK(v.equal_slice(a.get(), d.get(), n, n - 4096, 4096) == 0);
    CHECK(v.equal_slice(a.get(), d.get(), n, 0, n) == 0);
    CHECK(v.equal_slice(a.get(), kept.get(), n, 0, n) == 1);
    CHECK(v.equal_slice(a.get(), d.get(), n, n, 0) == 1);          // an empty slice at the end
    CHECK(v.equal_slice(a.get(), d.get(), n, n - 4096, 8192) == -1);  // past the end
    CHECK(v.equal_slice(a.get(), d.get(), n, n + 1, 0) == -1);
    CHECK(v.equal_slice(a.get(), plain.get(), n, 0, 4096) == -1);     // still checked per slice
  }
}

// --- the protocol ----------------------------------------------------------------------------------

TEST_CASE("dedup: protocol messages round-trip and malformed ones are refused") {
  content_digest d;
  for (std::size_t i = 0; i < d.bytes.size(); ++i) d.bytes[i] = static_cast<std::uint8_t>(i * 7);
  {
    auto bytes = dd::encode(dd::publish_request{12345, d}, 77);
    dd::header h;
    auto r = dd::parse_request(bytes, 1, &h);
    REQUIRE(std::holds_alternative<dd::request>(r));
    auto& q = std::get<dd::publish_request>(std::get<dd::request>(r));
    CHECK(q.bytes == 12345);
    CHECK(q.digest == d);
    CHECK(h.request == 77);
  }
  {
    auto r = dd::parse_reply(dd::encode(dd::published_reply{9, dd::outcome::shared}, 3), 1);
    REQUIRE(std::holds_alternative<dd::reply>(r));
    CHECK(std::get<dd::published_reply>(std::get<dd::reply>(r)).object == 9);
    auto e = dd::parse_reply(dd::encode(dd::error_reply{dd::errc::bad_size, std::string(1000, 'x')}, 3), 0);
    REQUIRE(std::holds_alternative<dd::reply>(e));
    CHECK(std::get<dd::error_reply>(std::get<dd::reply>(e)).text.size() == dd::max_error_text);
    dd::broker_stats s;
    s.objects = 4;
    s.refused = 2;
    auto sr = dd::parse_reply(dd::encode(s, 1), 0);
    CHECK(std::get<dd::broker_stats>(std::get<dd::reply>(sr)).refused == 2);
  }
  auto error_of = [](std::vector<std::byte> bytes, std::size_t fds) {
    auto r = dd::parse_request(bytes, fds);
    REQUIRE(std::holds_alternative<dd::parse_error>(r));
    return std::get<dd::parse_error>(r);
  };
  auto publish = dd::encode(dd::publish_request{4096, d}, 1);
  CHECK(error_of(std::vector<std::byte>(publish.begin(), publish.begin() + 10), 1).fatal);  // short header
  auto bad_magic = publish;
  bad_magic[0] = std::byte{0};
  CHECK(error_of(bad_magic, 1).code == dd::errc::bad_message);
  auto bad_version = publish;
  bad_version[4] = std::byte{9};
  CHECK(error_of(bad_version, 1).code == dd::errc::unsupported_version);
  auto longer = publish;
  longer.push_back(std::byte{0});                               // body length no longer matches
  CHECK(error_of(longer, 1).fatal);
  CHECK(error_of(publish, 0).code == dd::errc::bad_descriptor);  // publish without a descriptor
  CHECK_FALSE(error_of(publish, 0).fatal);
  CHECK(error_of(publish, 2).code == dd::errc::bad_descriptor);
  CHECK(error_of(dd::encode(dd::publish_request{0, d}, 1), 1).code == dd::errc::bad_size);
  CHECK(error_of(dd::encode(dd::publish_request{dd::max_object_bytes + 1, d}, 1), 1).code == dd::errc::bad_size);
  CHECK(error_of(dd::encode(dd::release_request{1}, 1), 1).fatal);  // a descriptor with a release
  auto unknown = dd::encode(dd::stats_request{}, 1);
  unknown[6] = std::byte{0x42};
  CHECK(error_of(unknown, 0).code == dd::errc::bad_message);
  CHECK(error_of(std::vector<std::byte>(dd::max_message_bytes + 1), 0).fatal);
  // Replies: a shared publish needs its descriptor, an error's text its stated length.
  CHECK(std::holds_alternative<dd::parse_error>(dd::parse_reply(dd::encode(dd::published_reply{9, dd::outcome::shared}, 3), 0)));
  CHECK(std::holds_alternative<dd::parse_error>(dd::parse_reply(dd::encode(dd::published_reply{9, dd::outcome::stored}, 3), 1)));
  auto cut = dd::encode(dd::error_reply{dd::errc::bad_size, "abcdef"}, 3);
  cut.erase(cut.end() - 2, cut.end());  // (resize(size() - 2) trips g++ 12's -Wstringop-overflow at -O1)
  std::uint32_t body = static_cast<std::uint32_t>(cut.size() - dd::header_bytes);
  std::memcpy(cut.data() + 12, &body, sizeof body);
  CHECK(std::holds_alternative<dd::parse_error>(dd::parse_reply(cut, 0)));
}

// --- the broker with real processes -------------------------------------------------------------------

TEST_CASE("dedup: publishers of identical bytes racing end with one shared copy") {
  temp_dir dir;
  broker_process broker(dir.socket());
  constexpr int publishers = 4;
  constexpr std::size_t pieces = 3;
  struct report {
    int shared = 0, stored = 0, kept_private = 0;
    std::uint64_t objects[pieces] = {};
    unsigned long inode[pieces] = {};
    bool bytes_intact = false;
  };
  channel results, go;
  std::vector<channel> done(publishers);
  std::vector<pid_t> children;
  for (int i = 0; i < publishers; ++i) {
    children.push_back(spawn([&, i] {
      range mine(pieces * piece, 42);
      dedup_client<> client(dir.socket(), test_options());
      char start = 0;
      if (!go.get(start)) return 2;
      const publish_result r = client.publish(mine.data, mine.bytes);
      report out;
      out.shared = static_cast<int>(r.shared);
      out.stored = static_cast<int>(r.stored);
      out.kept_private = static_cast<int>(r.kept_private);
      const auto ids = client.objects_of(mine.data);
      for (std::size_t k = 0; k < pieces && k < ids.size(); ++k) {
        out.objects[k] = ids[k];
        out.inode[k] = mapped_inode(mine.at(k * piece));
      }
      out.bytes_intact = mine.holds(42);
      results.put(out);
      char finish = 0;
      done[static_cast<std::size_t>(i)].get(finish);  // hold the shares until told
      return 0;
    }));
  }
  for (int i = 0; i < publishers; ++i) go.put('G');  // all at once
  std::vector<report> reports(publishers);
  for (auto& r : reports) REQUIRE(results.get(r));
  int stored = 0, shared = 0;
  for (const report& r : reports) {
    CHECK(r.kept_private == 0);
    CHECK(r.bytes_intact);
    stored += r.stored;
    shared += r.shared;
    for (std::size_t k = 0; k < pieces; ++k) {
      CHECK(r.objects[k] == reports[0].objects[k]);   // one object per piece for everyone
      CHECK(r.inode[k] == reports[0].inode[k]);       // the very same memory file
      CHECK(r.inode[k] != 0);
    }
  }
  CHECK(stored == static_cast<int>(pieces));          // each piece stored once
  CHECK(shared == static_cast<int>(pieces) * (publishers - 1));
  auto s = stats_at(dir.socket());
  REQUIRE(s);
  CHECK(s->objects == pieces);
  CHECK(s->object_bytes == pieces * piece);
  CHECK(s->references == pieces * publishers);
  for (auto& d : done) d.put('D');
  for (pid_t pid : children) CHECK(exited_with(wait_for(pid), 0));
  // Every holder exited: the broker forgot every object.
  CHECK(eventually(dir.socket(), [](const dd::broker_stats& st) { return st.objects == 0 && st.references == 0; }));
}

TEST_CASE("dedup: different bytes under a forced-equal digest are never aliased") {
  temp_dir dir;
  broker_process broker(dir.socket());
  // Every piece has the same digest: only the byte comparison tells them apart.
  dedup_client<host_shareable_backend, constant_hasher> one(dir.socket(), test_options());
  range a(2 * piece, 1), b(2 * piece, 2);
  const publish_result ra = one.publish(a.data, a.bytes);
  CHECK(ra.stored == 2);  // the two pieces of a differ from each other too
  CHECK(ra.shared == 0);
  pid_t child = spawn([&] {
    dedup_client<host_shareable_backend, constant_hasher> two(dir.socket(), test_options());
    const publish_result rb = two.publish(b.data, b.bytes);
    if (rb.stored != 2 || rb.shared != 0 || !b.holds(2)) return 1;
    range a_again(2 * piece, 1);  // the same bytes as a: found among the colliding objects
    const publish_result rc = two.publish(a_again.data, a_again.bytes);
    if (rc.shared != 2 || !a_again.holds(1)) return 2;
    return 0;
  });
  CHECK(exited_with(wait_for(child), 0));
  CHECK(a.holds(1));
}

TEST_CASE("dedup: a digest forged to match another's bytes gets no descriptor") {
  temp_dir dir;
  broker_process broker(dir.socket());
  range secret(piece, 77);
  dedup_client<> victim(dir.socket(), test_options());
  REQUIRE(victim.publish(secret.data, secret.bytes).stored == 1);
  const std::uint64_t secret_id = victim.objects_of(secret.data).at(0);
  // The attacker claims the secret's digest for zeros of the same size.
  raw_connection attacker(dir.socket());
  detail::unique_fd zeros = sealed_copy(piece, 0);
  REQUIRE(attacker.send(dd::encode(dd::publish_request{piece, fast_content_hasher{}(secret.data, piece)}, 1), {zeros.get()}) == 0);
  detail::unique_fd received;
  auto r = attacker.receive(&received);
  REQUIRE(std::holds_alternative<dd::reply>(r));
  const auto* p = std::get_if<dd::published_reply>(&std::get<dd::reply>(r));
  REQUIRE(p != nullptr);
  CHECK(p->result == dd::outcome::stored);  // its own zeros, indexed beside the secret
  CHECK(p->object != secret_id);
  CHECK_FALSE(received);
  // Releasing the secret's object, which it does not hold, is refused and changes nothing.
  REQUIRE(attacker.send(dd::encode(dd::release_request{secret_id}, 2)) == 0);
  CHECK(attacker.error_code() == code(dd::errc::unknown_object));
  auto s = stats_at(dir.socket());
  REQUIRE(s);
  CHECK(s->objects == 2);
  CHECK(s->references == 2);
}

TEST_CASE("dedup: clients killed mid-publish or while holding shares are reclaimed") {
  temp_dir dir;
  broker_process broker(dir.socket());
  channel held, check_now, verdict;
  // A: publishes and holds its shares until asked to check them.
  pid_t a = spawn([&] {
    range mine(2 * piece, 5);
    dedup_client<> client(dir.socket(), test_options());
    if (client.publish(mine.data, mine.bytes).stored != 2) return 1;
    held.put('A');
    char c;
    check_now.get(c);
    verdict.put(static_cast<char>(mine.holds(5) ? 'Y' : 'N'));
    return 0;
  });
  char c = 0;
  REQUIRE(held.get(c));
  // B: sends a publish of other bytes and dies without reading the answer.
  pid_t b = spawn([&] {
    raw_connection raw(dir.socket());
    detail::unique_fd copy = sealed_copy(piece, 6);
    range bytes(piece, 6);
    raw.send(dd::encode(dd::publish_request{piece, fast_content_hasher{}(bytes.data, piece)}, 1), {copy.get()});
    ::raise(SIGKILL);
    return 3;
  });
  // C: shares A's bytes and is killed while holding them.
  pid_t cpid = spawn([&] {
    range mine(2 * piece, 5);
    dedup_client<> client(dir.socket(), test_options());
    if (client.publish(mine.data, mine.bytes).shared != 2) return 1;
    held.put('C');
    ::pause();
    return 0;
  });
  CHECK(WIFSIGNALED(wait_for(b)));
  REQUIRE(held.get(c));
  CHECK(c == 'C');
  ::kill(cpid, SIGKILL);
  CHECK(WIFSIGNALED(wait_for(cpid)));
  // Only A's two references remain, on A's two objects.
  CHECK(eventually(dir.socket(), [](const dd::broker_stats& s) { return s.objects == 2 && s.references == 2; }));
  check_now.put('K');
  char v = 0;
  REQUIRE(verdict.get(v));
  CHECK(v == 'Y');  // A's memory is intact after the others died
  CHECK(exited_with(wait_for(a), 0));
  CHECK(eventually(dir.socket(), [](const dd::broker_stats& s) { return s.objects == 0 && s.references == 0; }));
}

TEST_CASE("dedup: with the broker killed, clients keep private copies and say so once") {
  temp_dir dir;
  std::vector<std::string> messages;
  auto options = test_options([&](std::string_view m) { messages.emplace_back(m); });
  auto broker = std::make_unique<broker_process>(dir.socket());
  dedup_client<> client(dir.socket(), options);
  range first(2 * piece, 8);
  REQUIRE(client.publish(first.data, first.bytes).stored == 2);
  broker->kill();
  CHECK(first.holds(8));  // shared memory outlives the broker
  range second(3 * piece, 9);
  const publish_result r = client.publish(second.data, second.bytes);
  CHECK(r.kept_private == 3);
  CHECK(r.shared + r.stored == 0);
  CHECK_FALSE(r.reason.empty());
  CHECK(second.holds(9));
  second.fill(10);  // still the process's own writable memory
  CHECK(second.holds(10));
  range third(piece, 11);
  CHECK(client.publish(third.data, third.bytes).kept_private == 1);
  CHECK(messages.size() == 1);  // said once
  if (!messages.empty()) CHECK(messages[0].find("private") != std::string::npos);
  CHECK_FALSE(client.connected());
  client.make_private(first.data, first.bytes);  // works without the broker
  first.fill(12);
  CHECK(first.holds(12));
  // No broker at all from the start: the same.
  std::vector<std::string> lonely_messages;
  dedup_client<> lonely(dir.path + "/nobody.sock", test_options([&](std::string_view m) { lonely_messages.emplace_back(m); }));
  range mine(piece, 13);
  CHECK(lonely.publish(mine.data, mine.bytes).kept_private == 1);
  range more(piece, 14);
  CHECK(lonely.publish(more.data, more.bytes).kept_private == 1);
  CHECK(lonely_messages.size() == 1);
  CHECK(mine.holds(13));
}

TEST_CASE("dedup: references of a dead broker's connection are never released on a new broker") {
  temp_dir dir;
  std::vector<std::string> messages;
  dedup_client<> client(dir.socket(), test_options([&](std::string_view m) { messages.emplace_back(m); }));
  range old_range(piece, 81);
  {
    broker_process first(dir.socket());
    REQUIRE(client.publish(old_range.data, old_range.bytes).stored == 1);
    first.kill();
  }
  broker_process second(dir.socket());
  range fresh(piece, 82);
  REQUIRE(client.publish(fresh.data, fresh.bytes).stored == 1);  // reconnects at once
  CHECK(client.objects_of(fresh.data) == client.objects_of(old_range.data));  // both id 1, of two brokers
  client.make_private(old_range.data, old_range.bytes);  // must not release fresh's reference
  CHECK(old_range.holds(81));
  auto s = stats_at(dir.socket());
  REQUIRE(s);
  CHECK(s->objects == 1);
  CHECK(s->references == 1);
  CHECK(messages.empty());  // the broker was never missing when asked
}

TEST_CASE("dedup: a forked child uses a connection of its own, never its parent's references") {
  temp_dir dir;
  broker_process broker(dir.socket());
  dedup_client<> client(dir.socket(), test_options());
  range a(2 * piece, 91);
  REQUIRE(client.publish(a.data, a.bytes).stored == 2);
  const int status = wait_for(spawn([&] {
    range b(piece, 92);
    if (client.publish(b.data, b.bytes).stored != 1) return 1;
    client.make_private(a.data, a.bytes);  // the child's copy: the parent's references stay
    a.fill(93);
    return a.holds(93) && b.holds(92) ? 0 : 2;
  }));
  CHECK(exited_with(status, 0));
  CHECK(a.holds(91));
  CHECK(eventually(dir.socket(), [](const dd::broker_stats& s) { return s.objects == 2 && s.references == 2; }));
  range c(piece, 94);
  CHECK(client.publish(c.data, c.bytes).stored == 1);  // the parent's connection still works
}

TEST_CASE("dedup: a broker that stops answering counts as gone after the timeout") {
  temp_dir dir;
  broker_process broker(dir.socket());
  std::vector<std::string> messages;
  dedup_client_options options = test_options([&](std::string_view m) { messages.emplace_back(m); });
  options.timeout_ms = 300;
  dedup_client<> client(dir.socket(), options);
  range first(piece, 111);
  REQUIRE(client.publish(first.data, first.bytes).stored == 1);
  REQUIRE(::kill(broker.pid(), SIGSTOP) == 0);
  int stopped = 0;
  REQUIRE(::waitpid(broker.pid(), &stopped, WUNTRACED) == broker.pid());  // stopped for sure
  REQUIRE(WIFSTOPPED(stopped));
  range second(2 * piece, 112);
  const publish_result r = client.publish(second.data, second.bytes);
  CHECK(r.kept_private == 2);
  CHECK(r.reason.find("did not answer") != std::string::npos);
  CHECK(second.holds(112));
  CHECK(messages.size() == 1);
  REQUIRE(::kill(broker.pid(), SIGCONT) == 0);
  range third(piece, 113);
  CHECK(client.publish(third.data, third.bytes).stored == 1);  // back once it answers
  CHECK(first.holds(111));
}

TEST_CASE("dedup: a write to shared memory faults without reaching other processes") {
  temp_dir dir;
  broker_process broker(dir.socket());
  dedup_client<> client(dir.socket(), test_options());
  range mine(2 * piece, 21);
  REQUIRE(client.publish(mine.data, mine.bytes).stored == 2);
  // A second process shares the bytes and writes to them: it dies of SIGSEGV.
  const int writer = wait_for(spawn([&] {
    range theirs(2 * piece, 21);
    dedup_client<> other(dir.socket(), test_options());
    if (other.publish(theirs.data, theirs.bytes).shared != 2) return 1;
    static_cast<volatile char*>(theirs.data)[piece + 3] = 'x';
    return 2;  // not reached
  }));
  CHECK(WIFSIGNALED(writer));
  if (WIFSIGNALED(writer)) CHECK(WTERMSIG(writer) == SIGSEGV);
  // One that forces its way (mprotect) only changes a private copy of the page.
  const int forcer = wait_for(spawn([&] {
    range theirs(2 * piece, 21);
    dedup_client<> other(dir.socket(), test_options());
    if (other.publish(theirs.data, theirs.bytes).shared != 2) return 1;
    if (::mprotect(theirs.data, theirs.bytes, PROT_READ | PROT_WRITE) != 0) return 0;  // refused: fine too
    theirs.fill(22);
    return theirs.holds(22) ? 0 : 3;
  }));
  CHECK(exited_with(forcer, 0));
  CHECK(mine.holds(21));
  // A third process still gets the original bytes.
  CHECK(exited_with(wait_for(spawn([&] {
          range theirs(2 * piece, 21);
          dedup_client<> other(dir.socket(), test_options());
          const publish_result r = other.publish(theirs.data, theirs.bytes);
          return r.shared == 2 && theirs.holds(21) ? 0 : 1;
        })),
        0));
}

TEST_CASE("dedup: make_private and release drop references and leave writable memory") {
  temp_dir dir;
  broker_process broker(dir.socket());
  dedup_client<> one(dir.socket(), test_options());
  range a(3 * piece, 31);
  REQUIRE(one.publish(a.data, a.bytes).stored == 3);
  channel published, finish;
  pid_t child = spawn([&] {
    dedup_client<> two(dir.socket(), test_options());
    range b(3 * piece, 31);
    if (two.publish(b.data, b.bytes).shared != 3) return 1;
    published.put('P');
    char c;
    finish.get(c);
    return b.holds(31) ? 0 : 2;
  });
  char c = 0;
  REQUIRE(published.get(c));
  CHECK(eventually(dir.socket(), [](const dd::broker_stats& s) { return s.references == 6; }));
  void* const before = a.data;
  one.make_private(a.data, a.bytes);
  CHECK(a.data == before);
  CHECK(a.holds(31));
  a.fill(32);  // writable, and private: the other process keeps its bytes (checked below)
  CHECK(a.holds(32));
  CHECK(eventually(dir.socket(), [](const dd::broker_stats& s) { return s.references == 3 && s.objects == 3; }));
  finish.put('F');
  CHECK(exited_with(wait_for(child), 0));
  CHECK(eventually(dir.socket(), [](const dd::broker_stats& s) { return s.objects == 0; }));
  // release: references dropped, the range writable zeros.
  range z(2 * piece, 33);
  REQUIRE(one.publish(z.data, z.bytes).stored == 2);
  CHECK(eventually(dir.socket(), [](const dd::broker_stats& s) { return s.objects == 2; }));
  one.release(z.data, z.bytes);
  CHECK(z.holds(0));
  z.fill(34);
  CHECK(z.holds(34));
  CHECK(eventually(dir.socket(), [](const dd::broker_stats& s) { return s.objects == 0 && s.references == 0; }));
}

TEST_CASE("dedup: a connection's quota bounds the objects it makes the broker keep, not what it shares") {
  temp_dir dir;
  broker_process broker(dir.socket(), [] {
    dedup_broker_options o;
    o.max_client_bytes = 2 * piece;
    return o;
  });
  dedup_client<> one(dir.socket(), test_options());
  range a(3 * piece, 41);  // three different pieces: the third is over the quota
  const publish_result r = one.publish(a.data, a.bytes);
  CHECK(r.stored == 2);
  CHECK(r.kept_private == 1);
  CHECK(r.reason.find("quota") != std::string::npos);
  CHECK(a.holds(41));
  CHECK(one.connected());  // a refusal, not a broken connection

  // Another connection stores within its own quota; this one may share that beyond its own.
  channel published, finish;
  const pid_t child = spawn([&] {
    dedup_client<> two(dir.socket(), test_options());
    range b(piece, 42);
    if (two.publish(b.data, b.bytes).stored != 1) return 1;
    published.put('P');
    char c;
    finish.get(c);
    return 0;
  });
  char c = 0;
  REQUIRE(published.get(c));
  range shared(piece, 42);
  CHECK(one.publish(shared.data, shared.bytes).shared == 1);
  CHECK(shared.holds(42));
  finish.put('F');
  CHECK(exited_with(wait_for(child), 0));

  // Giving its objects up gives the quota back (the shared piece was never charged).
  one.release(a.data, a.bytes);
  range d(2 * piece, 43);
  CHECK(one.publish(d.data, d.bytes).stored == 2);
  range e(piece, 44);
  CHECK(one.publish(e.data, e.bytes).kept_private == 1);
}

TEST_CASE("dedup: misuse of the client throws usage_error and changes nothing") {
  temp_dir dir;
  broker_process broker(dir.socket());
  dedup_client<> client(dir.socket(), test_options());
  range a(2 * piece, 41);
  CHECK_THROWS_AS(client.publish(a.at(1), piece), usage_error);           // unaligned
  CHECK_THROWS_AS(client.publish(a.data, 100), usage_error);              // not whole pages
  CHECK_THROWS_AS(client.publish(nullptr, piece), usage_error);
  REQUIRE(client.publish(a.data, a.bytes).stored == 2);
  CHECK_THROWS_AS(client.publish(a.at(piece), piece), usage_error);       // overlaps
  CHECK_THROWS_AS(client.make_private(a.data, piece), usage_error);       // not as published
  CHECK_THROWS_AS(client.release(a.at(piece), piece), usage_error);
  CHECK(a.holds(41));
  CHECK_THROWS_AS(dedup_client<>(dir.socket(), [] {
                    dedup_client_options o;
                    o.chunk_bytes = 1000;
                    return o;
                  }()),
                  usage_error);
}

TEST_CASE("dedup: peers the broker does not admit are refused, and clients refuse a foreign broker") {
  SUBCASE("an admission check that refuses") {
    temp_dir dir;
    broker_process broker(dir.socket(), [] {
      dedup_broker_options o;
      o.admit = [](const detail::peer_credentials&) { return false; };
      return o;
    });
    std::vector<std::string> messages;
    dedup_client<> client(dir.socket(), test_options([&](std::string_view m) { messages.emplace_back(m); }));
    range a(piece, 51);
    const publish_result r = client.publish(a.data, a.bytes);
    CHECK(r.kept_private == 1);
    CHECK_MESSAGE(r.reason.find("permission denied") != std::string::npos, r.reason);
    REQUIRE(messages.size() == 1);
    CHECK(messages[0].find("permission denied") != std::string::npos);
    CHECK(a.holds(51));
  }
  SUBCASE("the default check: the broker's user, or members of the named group") {
    same_user_or_group check{1000, std::nullopt};
    detail::peer_credentials peer;
    peer.uid = 1000;
    peer.gid = 1000;
    CHECK(check(peer));
    peer.uid = 1001;
    CHECK_FALSE(check(peer));
    check.group = 500;
    CHECK_FALSE(check(peer));
    peer.groups = {20, 500};
    CHECK(check(peer));  // a supplementary group
    peer.groups.clear();
    peer.gid = 500;
    CHECK(check(peer));  // the primary group
  }
  SUBCASE("another user is refused by the default check") {
    if (::geteuid() != 0) return;  // needs root to become another user; the injected check covers the rest
    temp_dir dir;
    broker_process broker(dir.socket());
    REQUIRE(::chmod(dir.path.c_str(), 0755) == 0);
    REQUIRE(::chmod(dir.socket().c_str(), 0666) == 0);  // past the file's own permissions
    const int status = wait_for(spawn([&] {
      if (::setgid(65534) != 0 || ::setuid(65534) != 0) return 1;
      dedup_client_options o = test_options();
      o.broker_uid = 0;
      dedup_client<> client(dir.socket(), o);
      range a(piece, 52);
      const publish_result r = client.publish(a.data, a.bytes);
      if (r.kept_private != 1 || !a.holds(52)) return 2;
      if (r.reason.find("permission denied") == std::string::npos) {
        std::fprintf(stderr, "reason: %s\n", r.reason.c_str());
        return 3;
      }
      return 0;
    }));
    CHECK(exited_with(status, 0));
  }
  SUBCASE("a broker of another user is not trusted") {
    temp_dir dir;
    broker_process broker(dir.socket());
    dedup_client_options o = test_options();
    o.broker_uid = ::geteuid() + 1;
    o.accept_root_broker = false;
    dedup_client<> client(dir.socket(), o);
    range a(piece, 53);
    const publish_result r = client.publish(a.data, a.bytes);
    CHECK(r.kept_private == 1);
    CHECK(r.reason.find("runs as uid") != std::string::npos);
    CHECK(stats_at(dir.socket())->publishes == 0);
  }
}

TEST_CASE("dedup: malformed messages and forged descriptors get errors and the broker goes on") {
  temp_dir dir;
  broker_process broker(dir.socket());
  range bytes61(piece, 61);
  const content_digest d = fast_content_hasher{}(bytes61.data, piece);
  raw_connection raw(dir.socket());
  auto publish = [&](std::uint64_t bytes, std::vector<int> fds) {
    REQUIRE(raw.send(dd::encode(dd::publish_request{bytes, d}, 5), std::move(fds)) == 0);
    return raw.error_code();
  };
  // Non-fatal: answered, and the same connection goes on.
  detail::unique_fd writable(::memfd_create("writable", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  REQUIRE(::ftruncate(writable.get(), piece) == 0);
  CHECK(publish(piece, {writable.get()}) == code(dd::errc::bad_descriptor));       // could change later
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
  CHECK(publish(piece, {p[0]}) == code(dd::errc::bad_descriptor));                 // not a file
  ::close(p[0]);
  ::close(p[1]);
  detail::unique_fd good = sealed_copy(piece, 61);
  CHECK(publish(2 * piece, {good.get()}) == code(dd::errc::bad_descriptor));       // claims more than it has
  CHECK(publish(piece / 2, {good.get()}) == code(dd::errc::bad_descriptor));       // or less
  CHECK(publish(0, {good.get()}) == code(dd::errc::bad_size));
  CHECK(publish(piece, {}) == code(dd::errc::bad_descriptor));                     // none
  CHECK(publish(piece, {good.get(), good.get()}) == code(dd::errc::bad_descriptor));  // two
  REQUIRE(raw.send(dd::encode(dd::release_request{12345}, 6)) == 0);
  CHECK(raw.error_code() == code(dd::errc::unknown_object));
  CHECK(publish(piece, {good.get()}) == 0);                                         // still served
  auto s = stats_at(dir.socket());
  REQUIRE(s);
  CHECK(s->objects == 1);
  CHECK(s->refused == 8);
  // Fatal: answered, then closed; the broker serves everyone else.
  auto fatal = [&](std::vector<std::byte> bytes, std::vector<int> fds = {}) {
    raw_connection bad(dir.socket());
    REQUIRE(bad.send(bytes, std::move(fds)) == 0);
    const std::uint32_t got = bad.error_code();
    CHECK(bad.closed_by_peer());
    return got;
  };
  std::vector<std::byte> garbage(40, std::byte{0x5a});
  CHECK(fatal(garbage) == code(dd::errc::bad_message));
  CHECK(fatal(std::vector<std::byte>(dd::max_message_bytes + 100)) == code(dd::errc::bad_message));  // too long
  CHECK(fatal(std::vector<std::byte>(3)) == code(dd::errc::bad_message));                           // too short
  auto versioned = dd::encode(dd::hello_request{}, 1);
  versioned[4] = std::byte{2};
  CHECK(fatal(versioned) == code(dd::errc::unsupported_version));
  CHECK(fatal(dd::encode(dd::stats_request{}, 1), {good.get()}) == code(dd::errc::bad_descriptor));
  s = stats_at(dir.socket());
  REQUIRE(s);
  CHECK(s->objects == 1);
  CHECK(s->clients == 2);  // raw and the probe: the bad connections are gone
  // The first connection's object is still good to share.
  range same(piece, 61);
  dedup_client<> client(dir.socket(), test_options());
  CHECK(client.publish(same.data, same.bytes).shared == 1);
  CHECK(same.holds(61));
}

// --- comparisons in slices: a broker in this process, turned by hand (poll_once(0)) ----------

// Whether a reply waits on the connection.
bool has_reply(const raw_connection& r) { return detail::wait_readable(r.fd.get(), 0); }

// Turns `broker` until `r` has a reply, at most `turns` times; the turns it took (0: none came).
template <class Broker>
int turn_until_reply(Broker& broker, const raw_connection& r, int turns = 100000) {
  for (int i = 1; i <= turns; ++i) {
    broker.poll_once(0);
    if (has_reply(r)) return i;
  }
  return 0;
}

std::size_t open_descriptors() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// A verifier without equal_slice: the broker compares its publishes whole, in one turn.
struct whole_verifier {
  host_content_verifier host;
  const char* check(int fd, std::size_t n) const noexcept { return host.check(fd, n); }
  int equal(int a, int b, std::size_t n) const noexcept { return host.equal(a, b, n); }
  detail::unique_fd adopt(detail::unique_fd&& fd, std::size_t n) noexcept { return host.adopt(std::move(fd), n); }
};
static_assert(content_verifier<whole_verifier> && !sliced_content_verifier<whole_verifier>);

TEST_CASE("dedup: a large publish is compared in slices, and other connections are served between them") {
  temp_dir dir;
  dedup_broker_options options;
  options.compare_slice_bytes = 1 * MiB;
  dedup_broker broker(dir.socket(), options);
  constexpr std::size_t big = 16 * MiB;  // 16 slices
  range bytes(big, 81), small(piece, 82);
  const content_digest d = fast_content_hasher{}(bytes.data, big);
  const content_digest ds = fast_content_hasher{}(small.data, piece);
  raw_connection publisher(dir.socket()), asker(dir.socket()), other(dir.socket());
  auto reply_of = [](const raw_connection& r, detail::unique_fd* fd = nullptr) {
    auto parsed = r.receive(fd);
    REQUIRE(std::holds_alternative<dd::reply>(parsed));
    return std::get<dd::reply>(std::move(parsed));
  };
  // Indexed first: the large object, and a small one the other connection sends again later.
  detail::unique_fd first = sealed_copy(big, 81), again = sealed_copy(big, 81);
  REQUIRE(publisher.send(dd::encode(dd::publish_request{big, d}, 1), {first.get()}) == 0);
  REQUIRE(turn_until_reply(broker, publisher) > 0);
  const auto stored = std::get<dd::published_reply>(reply_of(publisher));
  CHECK(stored.result == dd::outcome::stored);
  detail::unique_fd small1 = sealed_copy(piece, 82), small2 = sealed_copy(piece, 82);
  REQUIRE(other.send(dd::encode(dd::publish_request{piece, ds}, 1), {small1.get()}) == 0);
  REQUIRE(turn_until_reply(broker, other) > 0);
  CHECK(std::get<dd::published_reply>(reply_of(other)).result == dd::outcome::stored);

  // The same 16 MiB again: read and its first slice compared in this turn.
  REQUIRE(publisher.send(dd::encode(dd::publish_request{big, d}, 2), {again.get()}) == 0);
  broker.poll_once(0);
  CHECK_FALSE(has_reply(publisher));
  // Another connection's question is answered in the next turn, before the comparison ends.
  REQUIRE(asker.send(dd::encode(dd::stats_request{}, 3)) == 0);
  broker.poll_once(0);
  REQUIRE(has_reply(asker));
  CHECK_FALSE(has_reply(publisher));
  const auto s = std::get<dd::broker_stats>(reply_of(asker));
  CHECK(s.publishes == 2);  // the two stored; the third is still being compared
  CHECK(s.shared == 0);
  // A small publish that has an equal object indexed gets its turn too.
  REQUIRE(other.send(dd::encode(dd::publish_request{piece, ds}, 4), {small2.get()}) == 0);
  CHECK(turn_until_reply(broker, other, 3) > 0);
  CHECK_FALSE(has_reply(publisher));
  detail::unique_fd small_shared;
  const auto small_reply = std::get<dd::published_reply>(reply_of(other, &small_shared));
  CHECK(small_reply.result == dd::outcome::shared);
  CHECK(small_shared);
  // The large one ends after its remaining slices, shared with the object indexed first.
  const int turns = turn_until_reply(broker, publisher);
  CHECK(turns >= 10);
  CHECK(turns <= 16);
  detail::unique_fd shared;
  const auto r = std::get<dd::published_reply>(reply_of(publisher, &shared));
  CHECK(r.result == dd::outcome::shared);
  CHECK(r.object == stored.object);
  REQUIRE(shared);
  CHECK(host_content_verifier{}.equal(shared.get(), first.get(), big) == 1);
  const auto end = broker.stats();
  CHECK(end.publishes == 4);
  CHECK(end.shared == 2);
  CHECK(end.objects == 2);
}

TEST_CASE("dedup: a publish that differs in its last slice is stored, and one compared whole takes one turn") {
  temp_dir dir;
  constexpr std::size_t big = 8 * MiB;
  range bytes(big, 83);
  const content_digest d = fast_content_hasher{}(bytes.data, big);  // claimed for both
  detail::unique_fd first = sealed_copy(big, 83);
  bytes.at(big - 1)[0] ^= 1;
  detail::unique_fd last_differs = host_shareable_backend{}.export_copy(bytes.data, big);
  SUBCASE("in slices") {
    dedup_broker_options options;
    options.compare_slice_bytes = 1 * MiB;
    dedup_broker broker(dir.socket(), options);
    raw_connection c(dir.socket());
    REQUIRE(c.send(dd::encode(dd::publish_request{big, d}, 1), {first.get()}) == 0);
    REQUIRE(turn_until_reply(broker, c) > 0);
    CHECK(c.error_code() == 0);
    REQUIRE(c.send(dd::encode(dd::publish_request{big, d}, 2), {last_differs.get()}) == 0);
    CHECK(turn_until_reply(broker, c) == 8);
    auto r = c.receive();
    REQUIRE(std::holds_alternative<dd::reply>(r));
    CHECK(std::get<dd::published_reply>(std::get<dd::reply>(r)).result == dd::outcome::stored);
    CHECK(broker.stats().objects == 2);
  }
  SUBCASE("whole") {
    dedup_broker_options options;
    options.compare_slice_bytes = 1 * MiB;
    basic_dedup_broker<whole_verifier> broker(dir.socket(), options);
    raw_connection c(dir.socket());
    REQUIRE(c.send(dd::encode(dd::publish_request{big, d}, 1), {first.get()}) == 0);
    REQUIRE(turn_until_reply(broker, c) > 0);
    CHECK(c.error_code() == 0);
    REQUIRE(c.send(dd::encode(dd::publish_request{big, d}, 2), {last_differs.get()}) == 0);
    CHECK(turn_until_reply(broker, c) == 1);
    auto r = c.receive();
    REQUIRE(std::holds_alternative<dd::reply>(r));
    CHECK(std::get<dd::published_reply>(std::get<dd::reply>(r)).result == dd::outcome::stored);
    CHECK(broker.stats().objects == 2);
  }
}

TEST_CASE("dedup: a publisher that hangs up while its publish is compared leaves nothing behind") {
  temp_dir dir;
  dedup_broker_options options;
  options.compare_slice_bytes = 1 * MiB;
  dedup_broker broker(dir.socket(), options);
  constexpr std::size_t big = 32 * MiB;
  range bytes(big, 84);
  const content_digest d = fast_content_hasher{}(bytes.data, big);
  raw_connection keeper(dir.socket());
  detail::unique_fd first = sealed_copy(big, 84);
  REQUIRE(keeper.send(dd::encode(dd::publish_request{big, d}, 1), {first.get()}) == 0);
  REQUIRE(turn_until_reply(broker, keeper) > 0);
  CHECK(keeper.error_code() == 0);
  const dd::broker_stats before = broker.stats();
  const std::size_t descriptors = open_descriptors();
  {
    raw_connection quitter(dir.socket());
    detail::unique_fd copy = sealed_copy(big, 84);
    REQUIRE(quitter.send(dd::encode(dd::publish_request{big, d}, 2), {copy.get()}) == 0);
    for (int i = 0; i < 3; ++i) broker.poll_once(0);  // accepted, read, 2 of 32 slices compared
    CHECK(broker.stats().clients == before.clients + 1);
    CHECK_FALSE(has_reply(quitter));
  }  // hangs up; its copy is closed here, the broker's descriptor of it stays until dropped
  broker.poll_once(0);
  const dd::broker_stats after = broker.stats();
  CHECK(after.clients == before.clients);
  CHECK(after.objects == before.objects);
  CHECK(after.references == before.references);
  CHECK(after.publishes == before.publishes);  // never answered
  CHECK(open_descriptors() == descriptors);    // the connection and the object it sent: closed
  // The broker goes on: another publish of the same bytes is compared and shared.
  detail::unique_fd later = sealed_copy(big, 84);
  REQUIRE(keeper.send(dd::encode(dd::publish_request{big, d}, 3), {later.get()}) == 0);
  CHECK(turn_until_reply(broker, keeper) == 32);
  detail::unique_fd shared;
  auto r = keeper.receive(&shared);
  REQUIRE(std::holds_alternative<dd::reply>(r));
  CHECK(std::get<dd::published_reply>(std::get<dd::reply>(r)).result == dd::outcome::shared);
  CHECK(shared);
}

TEST_CASE("dedup: a broker out of descriptors refuses pieces and keeps serving") {
  temp_dir dir;
  broker_process broker(dir.socket(), {}, [] {
    // Room for what the broker opens itself plus a few objects.
    std::size_t open = 0;
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++open;
    rlimit limit{static_cast<rlim_t>(open + 12), static_cast<rlim_t>(open + 12)};
    ::setrlimit(RLIMIT_NOFILE, &limit);
  });
  dedup_client<> client(dir.socket(), test_options());
  constexpr std::size_t pieces = 24;
  range many(pieces * piece, 0);
  for (std::size_t k = 0; k < pieces; ++k) std::memset(many.at(k * piece), static_cast<int>(k + 1), piece);  // all different
  const publish_result r = client.publish(many.data, many.bytes);
  CHECK(r.stored > 0);
  CHECK(r.kept_private > 0);
  CHECK(r.stored + r.kept_private == pieces);
  CHECK(r.reason.find("descriptor") != std::string::npos);
  for (std::size_t k = 0; k < pieces; ++k) CHECK(static_cast<unsigned char>(many.at(k * piece)[piece - 1]) == k + 1);
  CHECK(client.connected());
  // Releasing gives the broker its descriptors back: it stores again.
  client.release(many.data, many.bytes);
  range later(piece, 71);
  CHECK(client.publish(later.data, later.bytes).stored == 1);
}

// The host backend, except that while `out_of_descriptors` is set its exports fail as
// memfd_create does without a descriptor left. (Exhausting the test process's descriptors for
// real would also starve UBSan's runtime, whose checks of a thrown exception open a pipe.)
bool out_of_descriptors = false;
struct exhaustible_backend : host_shareable_backend {
  detail::unique_fd export_copy(const void* at, std::size_t bytes) {
    if (out_of_descriptors) detail::throw_errno("memfd_create", EMFILE);
    return host_shareable_backend::export_copy(at, bytes);
  }
};
static_assert(shareable_backend<exhaustible_backend>);

TEST_CASE("dedup: a client that cannot export a piece keeps it private and says why") {
  temp_dir dir;
  broker_process broker(dir.socket());
  dedup_client<exhaustible_backend> client(dir.socket(), test_options());
  range first(piece, 101), mine(2 * piece, 102);
  REQUIRE(client.publish(first.data, first.bytes).stored == 1);  // connected
  out_of_descriptors = true;
  const publish_result r = client.publish(mine.data, mine.bytes);
  out_of_descriptors = false;
  CHECK(r.kept_private == 2);
  CHECK_MESSAGE(r.reason.find("EMFILE") != std::string::npos, r.reason);
  CHECK(mine.holds(102));
  mine.fill(104);  // still private and writable
  CHECK(mine.holds(104));
  CHECK(client.connected());
  range again(piece, 103);
  CHECK(client.publish(again.data, again.bytes).stored == 1);  // and works again after
}

#ifdef GLAKE_DEDUP_EXECUTABLE
// The processes whose command line names `text` and glake-dedup: the brokers of one socket, and
// any still starting (the shell that starts one, a broker about to find the path taken).
// A process that exits while it is read is skipped: its cmdline reads fail (ESRCH), which a
// stream would throw from.
std::vector<pid_t> processes_naming(const std::string& text) {
  std::vector<pid_t> found;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", error)) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const int fd = ::open((entry.path() / "cmdline").c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    std::string line;
    char buffer[4096];
    for (ssize_t n; (n = ::read(fd, buffer, sizeof buffer)) > 0;) line.append(buffer, static_cast<std::size_t>(n));
    ::close(fd);
    if (line.find(text) != std::string::npos && line.find("glake-dedup") != std::string::npos) {
      found.push_back(static_cast<pid_t>(std::stol(name)));
    }
  }
  return found;
}

bool eventually_true(const std::function<bool()>& ok) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    if (ok()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

TEST_CASE("dedup: clients start the broker themselves, and one runs however many race") {
  temp_dir dir;
  constexpr int clients = 3;
  struct report {
    std::size_t stored = 0, shared = 0, kept_private = 0;
  };
  channel results, go, done;
  std::vector<pid_t> children;
  for (int i = 0; i < clients; ++i) {
    children.push_back(spawn([&] {
      dedup_client_options o = test_options();
      o.start_broker = GLAKE_DEDUP_EXECUTABLE;
      dedup_client<> client(dir.socket(), o);
      range mine(piece, 121);
      char c;
      if (!go.get(c)) return 2;
      const publish_result r = client.publish(mine.data, mine.bytes);
      results.put(report{r.stored, r.shared, r.kept_private});
      done.get(c);
      return mine.holds(121) ? 0 : 1;
    }));
  }
  for (int i = 0; i < clients; ++i) go.put('G');
  std::size_t stored = 0, shared = 0;
  for (int i = 0; i < clients; ++i) {
    report r;
    REQUIRE(results.get(r));
    CHECK(r.kept_private == 0);
    stored += r.stored;
    shared += r.shared;
  }
  CHECK(stored == 1);
  CHECK(shared == clients - 1);
  // The others gave way (one that starts late, on a loaded machine, may still find the path
  // free once the winner stopped: that is a broker too, and is stopped below).
  CHECK(eventually_true([&] { return processes_naming(dir.socket()).size() == 1; }));
  raw_connection raw(dir.socket());
  REQUIRE(raw.send(dd::encode(dd::hello_request{}, 1)) == 0);
  auto hello = raw.receive();
  REQUIRE(std::holds_alternative<dd::reply>(hello));
  const auto pid = static_cast<pid_t>(std::get<dd::hello_reply>(std::get<dd::reply>(hello)).pid);
  const std::vector<pid_t> running = processes_naming(dir.socket());
  CHECK(std::find(running.begin(), running.end(), pid) != running.end());
  // SIGTERM stops a broker, which removes its socket.
  CHECK(eventually_true([&] {
    const std::vector<pid_t> left = processes_naming(dir.socket());
    for (pid_t p : left) ::kill(p, SIGTERM);
    return left.empty() && !std::filesystem::exists(dir.socket());
  }));
  for (int i = 0; i < clients; ++i) done.put('D');
  for (pid_t p : children) CHECK(exited_with(wait_for(p), 0));
}

TEST_CASE("dedup: a broker a client starts gets start_arguments on its command line") {
  temp_dir dir;
  dedup_client_options o = test_options();
  o.start_broker = GLAKE_DEDUP_EXECUTABLE;
  o.start_arguments = {"--max-objects", "1"};  // seen only through what the broker refuses
  {
    dedup_client<> client(dir.socket(), o);
    range two(2 * piece, 17);  // two pieces of different bytes
    const publish_result r = client.publish(two.data, two.bytes);
    CHECK(r.stored == 1);
    CHECK(r.kept_private == 1);
    CHECK(r.reason.find("refused") != std::string::npos);
    CHECK(two.holds(17));
  }
  CHECK(eventually_true([&] {
    const std::vector<pid_t> left = processes_naming(dir.socket());
    for (pid_t p : left) ::kill(p, SIGTERM);
    return left.empty() && !std::filesystem::exists(dir.socket());
  }));
}
#endif

TEST_CASE("dedup: one broker per socket path, and a stale socket is replaced") {
  temp_dir dir;
  {
    dedup_broker first(dir.socket());
    try {
      dedup_broker second(dir.socket());
      FAIL("a second broker started on the same path");
    } catch (const driver_error& e) {
      CHECK(e.code() == EWOULDBLOCK);
    }
    struct stat info {};
    REQUIRE(::stat(dir.socket().c_str(), &info) == 0);
    CHECK((info.st_mode & 0777) == 0600);
  }
  CHECK_FALSE(std::filesystem::exists(dir.socket()));  // removed by its broker
  {
    // A socket file left by a broker that died: bound, never listened, closed.
    sockaddr_un address;
    const socklen_t length = detail::unix_address(dir.socket(), address);
    detail::unique_fd stale(::socket(AF_UNIX, SOCK_SEQPACKET, 0));
    REQUIRE(::bind(stale.get(), reinterpret_cast<const sockaddr*>(&address), length) == 0);
  }
  REQUIRE(std::filesystem::exists(dir.socket()));
  broker_process broker(dir.socket());
  CHECK(stats_at(dir.socket()).has_value());
  CHECK_THROWS_AS(dedup_broker(std::string(200, 'x')), usage_error);
}

TEST_CASE("dedup: a broker for a group gives it the socket, mode 0660") {
  temp_dir dir;
  dedup_broker_options options;
  options.group = ::getegid();  // a group this process may give files to
  dedup_broker broker(dir.socket(), options);
  struct stat info {};
  REQUIRE(::stat(dir.socket().c_str(), &info) == 0);
  CHECK((info.st_mode & 0777) == 0660);
  CHECK(info.st_gid == ::getegid());
}

}  // namespace
