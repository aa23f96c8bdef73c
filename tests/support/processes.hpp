// Tests with real processes: a temporary directory for sockets, children made by fork whose
// exit status is the test's verdict, and pipes to pass records and go-signals between them.
#pragma once

#include <doctest/doctest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <system_error>
#include <thread>

#include "glake/ipc/unix_socket.hpp"

namespace glake::testing {

struct temp_dir {
  std::string path;
  temp_dir() {
    char name[] = "/tmp/glake-test-XXXXXX";
    REQUIRE(::mkdtemp(name) != nullptr);
    path = name;
  }
  ~temp_dir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
  std::string socket() const { return path + "/service.sock"; }
};

// Runs `body` in a forked child whose exit status is its return value (99 when it throws).
inline pid_t spawn(const std::function<int()>& body) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // The test framework's crash handlers would report a child's fault as a failed test case
    // and go on running tests in the child: a child dies of its signals.
    for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTERM}) ::signal(sig, SIG_DFL);
    int code = 99;
    try {
      code = body();
    } catch (...) {
    }
    ::_exit(code);
  }
  return pid;
}

// The child's wait status; kills it (and fails) after 30 s.
inline int wait_for(pid_t pid) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  int status = 0;
  for (;;) {
    const pid_t got = ::waitpid(pid, &status, WNOHANG);
    if (got == pid) return status;
    if (got < 0) return -1;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      FAIL("a child process did not finish within 30 s");
      return status;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

inline bool exited_with(int status, int code) { return WIFEXITED(status) && WEXITSTATUS(status) == code; }

// A pipe to pass fixed-size records from children to the parent, and go-signals back.
struct channel {
  int fds[2] = {-1, -1};
  channel() { REQUIRE(::pipe2(fds, O_CLOEXEC) == 0); }
  ~channel() {
    ::close(fds[0]);
    ::close(fds[1]);
  }
  template <class T>
  void put(const T& value) const {
    REQUIRE(::write(fds[1], &value, sizeof value) == static_cast<ssize_t>(sizeof value));
  }
  template <class T>
  bool get(T& value, int timeout_ms = 30000) const {
    if (!glake::detail::wait_readable(fds[0], timeout_ms)) return false;
    return ::read(fds[0], &value, sizeof value) == static_cast<ssize_t>(sizeof value);
  }
};

}  // namespace glake::testing
