// The services' listening socket (detail/unix_listener.hpp) against a hostile local user: files
// it did not create are never changed or removed, symbolic links are never followed, and a
// process out of descriptors turns peers away without losing its spare or spinning.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "glake/ipc/unix_listener.hpp"
#include "support/processes.hpp"

using namespace glake;
using testing::temp_dir;

namespace {

// The attacker's move, made at the worst moment: right after bind() creates the socket file at
// `swap_at`, it is renamed away and a symbolic link to `swap_to` takes its place.
std::string swap_at;
std::string swap_to;

}  // namespace

// Every bind of this test executable goes through here; it only acts while swap_at is set.
extern "C" int bind(int fd, const sockaddr* address, socklen_t length) noexcept {
  const long result = ::syscall(SYS_bind, fd, address, length);
  if (result == 0 && !swap_at.empty() && address->sa_family == AF_UNIX) {
    const auto* unix_address = reinterpret_cast<const sockaddr_un*>(address);
    if (swap_at == unix_address->sun_path) {
      ::rename(swap_at.c_str(), (swap_at + ".moved").c_str());
      [[maybe_unused]] const int ignored = ::symlink(swap_to.c_str(), swap_at.c_str());
    }
  }
  return static_cast<int>(result);
}

namespace {

mode_t mode_of(const std::string& path) {
  struct stat info {};
  REQUIRE(::lstat(path.c_str(), &info) == 0);
  return info.st_mode;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_file(const std::string& path, const std::string& text, mode_t mode) {
  std::ofstream(path) << text;
  REQUIRE(::chmod(path.c_str(), mode) == 0);
}

}  // namespace

TEST_CASE("unix_listener: a symbolic link swapped in after bind is never followed") {
  temp_dir dir;
  const std::string victim = dir.path + "/victim";
  write_file(victim, "secret", 0640);
  swap_at = dir.socket();
  swap_to = victim;
  {
    detail::unix_listener listener(dir.socket(), ::getegid(), "test service");
    swap_at.clear();
    CHECK((mode_of(victim) & 07777) == 0640);  // not given to the group with mode 0660
    CHECK(read_all(victim) == "secret");
    // Whatever the attacker managed, the socket the service listens on has its mode.
    if (S_ISSOCK(mode_of(dir.socket()))) CHECK((mode_of(dir.socket()) & 0777) == 0660);
  }
  swap_at.clear();
  CHECK(read_all(victim) == "secret");
}

TEST_CASE("unix_listener: the lock file is never opened through a symbolic link") {
  temp_dir dir;
  const std::string elsewhere = dir.path + "/made-elsewhere";
  REQUIRE(::symlink(elsewhere.c_str(), (dir.socket() + ".lock").c_str()) == 0);
  try {
    detail::unix_listener listener(dir.socket(), std::nullopt, "test service");
    FAIL("a listener took a symbolic link as its lock file");
  } catch (const std::exception& e) {
    CHECK(std::string(e.what()).find(dir.socket() + ".lock") != std::string::npos);
  }
  CHECK_FALSE(std::filesystem::exists(elsewhere));
  CHECK(S_ISLNK(mode_of(dir.socket() + ".lock")));  // left as it was
  CHECK_FALSE(std::filesystem::exists(dir.socket()));
}

TEST_CASE("unix_listener: what is at the path and is not a socket is refused, named and kept") {
  temp_dir dir;
  SUBCASE("a regular file") {
    write_file(dir.socket(), "notes", 0600);
    try {
      detail::unix_listener listener(dir.socket(), std::nullopt, "test service");
      FAIL("a listener replaced a regular file");
    } catch (const usage_error& e) {
      CHECK(std::string(e.what()).find(dir.socket()) != std::string::npos);
      CHECK(std::string(e.what()).find("not a socket") != std::string::npos);
    }
    CHECK(read_all(dir.socket()) == "notes");
  }
  SUBCASE("a directory") {
    REQUIRE(::mkdir(dir.socket().c_str(), 0700) == 0);
    try {
      detail::unix_listener listener(dir.socket(), std::nullopt, "test service");
      FAIL("a listener started on a directory");
    } catch (const usage_error& e) {
      CHECK(std::string(e.what()).find(dir.socket()) != std::string::npos);
      CHECK(std::string(e.what()).find("not a socket") != std::string::npos);
    }
    CHECK(std::filesystem::is_directory(dir.socket()));
  }
  SUBCASE("a missing directory") {
    const std::string path = dir.path + "/missing/service.sock";
    try {
      detail::unix_listener listener(path, std::nullopt, "test service");
      FAIL("a listener started in a missing directory");
    } catch (const driver_error& e) {
      CHECK(e.code() == ENOENT);
      CHECK(std::string(e.what()).find(dir.path + "/missing/") != std::string::npos);
    }
  }
  CHECK_FALSE(std::filesystem::exists(dir.socket() + ".lock"));
  // Only the test's own entries are left: no private directory of the listener.
  std::size_t entries = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir.path)) ++entries;
  CHECK(entries <= 1);
}

TEST_CASE("unix_listener: the socket and lock are removed at the end only while they are its own") {
  temp_dir dir;
  {
    detail::unix_listener listener(dir.socket(), std::nullopt, "test service");
    CHECK(S_ISSOCK(mode_of(dir.socket())));
    CHECK((mode_of(dir.socket()) & 0777) == 0600);
    // Someone replaces both while it runs.
    REQUIRE(::rename(dir.socket().c_str(), (dir.path + "/moved.sock").c_str()) == 0);
    write_file(dir.socket(), "theirs", 0600);
    REQUIRE(::rename((dir.socket() + ".lock").c_str(), (dir.path + "/moved.lock").c_str()) == 0);
    write_file(dir.socket() + ".lock", "their lock", 0600);
  }
  CHECK(read_all(dir.socket()) == "theirs");
  CHECK(read_all(dir.socket() + ".lock") == "their lock");
  {
    std::filesystem::remove(dir.socket());
    std::filesystem::remove(dir.socket() + ".lock");
    detail::unix_listener listener(dir.socket(), std::nullopt, "test service");
  }
  CHECK_FALSE(std::filesystem::exists(dir.socket()));
  CHECK_FALSE(std::filesystem::exists(dir.socket() + ".lock"));
}

TEST_CASE("unix_listener: out of descriptors, each peer is turned away and the spare is kept") {
  temp_dir dir;
  const std::string path = dir.socket();
  // In a child: running the test process out of descriptors would starve the test framework.
  const pid_t child = testing::spawn([&] {
    detail::unix_listener listener(path, std::nullopt, "test service");
    sockaddr_un address;
    const socklen_t length = detail::unix_address(path, address);
    std::vector<detail::unique_fd> clients;
    for (int i = 0; i < 6; ++i) clients.emplace_back(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    const auto connect = [&](int i) {
      return ::connect(clients[i].get(), reinterpret_cast<const sockaddr*>(&address), length) == 0;
    };
    rlimit limit{};
    ::getrlimit(RLIMIT_NOFILE, &limit);
    limit.rlim_cur = std::min<rlim_t>(limit.rlim_max, 256);
    ::setrlimit(RLIMIT_NOFILE, &limit);
    std::vector<detail::unique_fd> filler;
    for (;;) {
      detail::unique_fd fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
      if (!fd) break;
      filler.push_back(std::move(fd));
    }
    for (int round = 0; round < 3; ++round) {
      if (!connect(round)) return 10 + round;
      auto a = listener.accept_one();
      if (!a || !a->turn_away) return 20 + round;  // the spare was lost at an earlier round
    }
    if (listener.accept_one()) return 30;  // the backlog is empty
    if (!connect(3)) return 31;
    auto held = listener.accept_one();  // turned away but not closed yet: no spare to give up
    if (!held || !held->turn_away) return 32;
    if (!connect(4)) return 33;
    if (listener.accept_one()) return 34;
    if (listener.poll_events() != 0 || listener.backoff_ms() <= 0) return 35;  // backs off
    if (listener.accept_one()) return 36;
    held.reset();
    ::usleep(static_cast<useconds_t>(detail::unix_listener::backoff.count()) * 1000 + 20000);
    if (listener.poll_events() != POLLIN || listener.backoff_ms() != 0) return 37;
    auto later = listener.accept_one();
    if (!later || !later->turn_away) return 38;
    return 0;
  });
  const int status = testing::wait_for(child);
  INFO("the child's exit status: " << (WIFEXITED(status) ? WEXITSTATUS(status) : -1));
  CHECK(testing::exited_with(status, 0));
}
