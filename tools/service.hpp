// What the socket services' programs (glake-dedup, glake-budget) share: stopping on SIGTERM or
// SIGINT through a pipe the service's poll loop watches, the group named by --group, the soft
// descriptor limit raised to the hard one, and how a service's failures become exit statuses.
#pragma once

#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <system_error>

#include "glake/errors.hpp"

namespace glake::tools {

namespace detail {
inline int stop_pipe[2] = {-1, -1};
extern "C" inline void write_stop_byte(int) {
  const char c = 's';
  [[maybe_unused]] const ssize_t ignored = ::write(stop_pipe[1], &c, 1);
}
}  // namespace detail

/// A descriptor that becomes readable once SIGTERM or SIGINT arrives (for a service's run(fd));
/// SIGPIPE is ignored from now on. Throws driver_error when no pipe can be made.
inline int stop_on_signals() {
  if (::pipe2(detail::stop_pipe, O_CLOEXEC) != 0) {
    const int error = errno;
    throw glake::driver_error("pipe2", error, std::generic_category().message(error));
  }
  struct sigaction action {};
  action.sa_handler = detail::write_stop_byte;
  ::sigemptyset(&action.sa_mask);
  ::sigaction(SIGTERM, &action, nullptr);
  ::sigaction(SIGINT, &action, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  return detail::stop_pipe[0];
}

/// Raises the soft limit on open descriptors to the hard one: each connection, and each object
/// the dedup broker indexes, holds a descriptor, and the usual soft limit of 1024 is reached by
/// about a thousand objects. Returns the soft limit now in force.
inline rlim_t raise_descriptor_limit() noexcept {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return 0;
  if (limit.rlim_cur < limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) limit = raised;
  }
  return limit.rlim_cur;
}

/// The id of the group `name`; empty after a line on stderr when there is none.
inline std::optional<gid_t> group_id(const char* tool, const std::string& name) {
  const group* g = ::getgrnam(name.c_str());
  if (g == nullptr) {
    std::fprintf(stderr, "%s: no group named '%s'\n", tool, name.c_str());
    return std::nullopt;
  }
  return g->gr_gid;
}

/// An error's text as a tool prints it after its own name: without the "glake: " that the
/// library puts before messages meant to stand alone ("glake-dedup: PATH exists ...", not
/// "glake-dedup: glake: PATH exists ...").
inline const char* without_library_prefix(const char* what) noexcept {
  constexpr char prefix[] = "glake: ";
  return std::strncmp(what, prefix, sizeof prefix - 1) == 0 ? what + sizeof prefix - 1 : what;
}

/// Runs a service's body and turns what it throws into an exit status: another service holding
/// the socket's lock is not a failure (0, said unless quiet); anything else is 1 after a line on
/// stderr.
template <class Body>
int serve(const char* tool, bool quiet, Body&& body) {
  try {
    return body();
  } catch (const glake::driver_error& e) {
    if (e.code() == EWOULDBLOCK && e.call() == "flock") {
      if (!quiet) std::fprintf(stderr, "%s: %s; nothing to do\n", tool, without_library_prefix(e.what()));
      return 0;
    }
    std::fprintf(stderr, "%s: %s\n", tool, without_library_prefix(e.what()));
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", tool, without_library_prefix(e.what()));
    return 1;
  }
}

}  // namespace glake::tools
