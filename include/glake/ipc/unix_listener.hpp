// A local service's listening socket: the socket file owned through a lock file beside it, its
// permissions, and the admission rule for peers (same user, or a named group).
#pragma once

#if !defined(__linux__)
#error "glake/ipc/unix_listener.hpp needs Linux"
#endif

#include <fcntl.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <optional>
#include <string>
#include <utility>

#include "glake/errors.hpp"
#include "glake/ipc/unix_socket.hpp"
#include "glake/posix_errors.hpp"

namespace glake {

/// Who may connect: the service's own user, and the members of one group if the operator names
/// one. The default admission check of the dedup broker and the budget coordinator.
struct same_user_or_group {
  uid_t uid = ::geteuid();
  std::optional<gid_t> group;
  bool operator()(const detail::peer_credentials& peer) const noexcept {
    return peer.uid == uid || (group && peer.in_group(*group));
  }
};

namespace detail {

// ---------------------------------------------------------------------------------------------
// unix_listener
//
// Binds and listens (SOCK_SEQPACKET, non-blocking, close-on-exec) at a path it owns through
// PATH.lock (flock): a second service for the same path fails at construction with driver_error
// code EWOULDBLOCK ("another <service> serves PATH"), and a stale socket left by a service that
// died is replaced. The socket file gets mode 0600, or 0660 and the group when one is named.
// The destructor removes the socket and the lock file. Thread safety: none needed after
// construction (the descriptor is only read).
// ---------------------------------------------------------------------------------------------
class unix_listener {
 public:
  /// `service` names the program in the error a second one gets ("glake dedup broker").
  unix_listener(std::string path, std::optional<gid_t> group, const char* service) : path_(std::move(path)) {
    sockaddr_un address;
    const socklen_t length = unix_address(path_, address);
    lock_ = take_lock(path_ + ".lock", service);
    ::unlink(path_.c_str());  // a stale socket of a service that died: the lock says none runs
    unique_fd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) {
      const int error = errno;
      ::unlink((path_ + ".lock").c_str());
      throw_errno("socket", error);
    }
    if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&address), length) != 0) {
      const int error = errno;
      ::unlink((path_ + ".lock").c_str());
      throw_errno("bind", error);
    }
    try {
      // Until chmod the file has the umask's mode; nobody is admitted before listen, and the
      // admission check stands behind the mode anyway.
      if (group) {
        if (::chown(path_.c_str(), static_cast<uid_t>(-1), *group) != 0) throw_errno("chown", errno);
        if (::chmod(path_.c_str(), 0660) != 0) throw_errno("chmod", errno);
      } else if (::chmod(path_.c_str(), 0600) != 0) {
        throw_errno("chmod", errno);
      }
      if (::listen(fd.get(), 128) != 0) throw_errno("listen", errno);
    } catch (...) {
      ::unlink(path_.c_str());
      ::unlink((path_ + ".lock").c_str());
      throw;
    }
    fd_ = std::move(fd);
  }
  unix_listener(const unix_listener&) = delete;
  unix_listener& operator=(const unix_listener&) = delete;
  ~unix_listener() {
    if (fd_) ::unlink(path_.c_str());
    if (lock_) ::unlink((path_ + ".lock").c_str());  // while still held: see take_lock
  }

  const std::string& path() const noexcept { return path_; }
  int get() const noexcept { return fd_.get(); }

  /// One connection taken from the backlog (non-blocking, close-on-exec), with its peer's
  /// credentials when the kernel tells them (`credentials`). `turn_away` is set when the
  /// process is out of descriptors: the connection was taken with a spare one so that it does
  /// not wake poll forever, and the caller must refuse it and close it at once.
  struct accepted {
    unique_fd fd;
    peer_credentials peer;
    bool credentials = false;
    bool turn_away = false;
  };
  /// The next pending connection; nullopt when none is left (or accept failed: poll again).
  std::optional<accepted> accept_one() {
    for (;;) {
      accepted a;
      a.fd.reset(::accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (!a.fd) {
        if (errno == EINTR) continue;
        if ((errno == EMFILE || errno == ENFILE) && spare_) {
          spare_.reset();
          a.fd.reset(::accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
          spare_.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
          if (!a.fd) return std::nullopt;
          a.turn_away = true;
          return a;
        }
        return std::nullopt;  // EAGAIN: none left; anything else: try again on the next poll
      }
      a.credentials = read_peer_credentials(a.fd.get(), a.peer);
      return a;
    }
  }

 private:
  // Opens and locks PATH.lock. A lock file unlinked by a service that exited between our open
  // and our flock is not the one at the path any more: check, and try again.
  static unique_fd take_lock(const std::string& lock_path, const char* service) {
    for (int attempt = 0; attempt < 16; ++attempt) {
      unique_fd fd(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
      if (!fd) throw_errno("open", errno);
      if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
        const int error = errno;
        if (error == EWOULDBLOCK) {
          throw driver_error("flock", EWOULDBLOCK,
                             std::string("another ") + service + " serves " + lock_path.substr(0, lock_path.size() - 5));
        }
        throw_errno("flock", error);
      }
      struct stat held {}, at_path {};
      if (::fstat(fd.get(), &held) == 0 && ::stat(lock_path.c_str(), &at_path) == 0 &&
          held.st_ino == at_path.st_ino && held.st_dev == at_path.st_dev) {
        return fd;
      }
    }
    throw driver_error("flock", EAGAIN, "the lock file " + lock_path + " keeps being replaced");
  }

  std::string path_;
  unique_fd lock_;  // declared before fd_: the socket goes first, then the lock
  unique_fd fd_;
  unique_fd spare_{::open("/dev/null", O_RDONLY | O_CLOEXEC)};  // given up to take one connection
};

}  // namespace detail
}  // namespace glake
