// A local service's listening socket: the socket file owned through a lock file beside it, its
// permissions, and the admission rule for peers (same user, or a named group).
#pragma once

#if !defined(__linux__)
#error "glake/ipc/unix_listener.hpp needs Linux"
#endif

#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
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
// died is replaced.
//
// Nothing it did not create is changed or removed. The lock file is opened with O_NOFOLLOW and
// must be a regular file of this user; whatever is at PATH other than a socket is refused
// (usage_error naming PATH). The socket is bound in a fresh private directory (mode 0700, beside
// PATH), given its group and mode 0600 or 0660 there, where nobody else can swap the entry, and
// then renamed to PATH without replacing anything that appeared there meanwhile
// (RENAME_NOREPLACE). The destructor removes PATH and PATH.lock only while they are still the
// files it made.
//
// Out of descriptors: the listener keeps one spare descriptor; when accept fails with EMFILE or
// ENFILE it gives the spare up to take the connection, which the caller refuses and closes, and
// takes the spare back at the next accept_one. When even that fails it backs off
// (backoff_ms, poll_events) for `backoff` instead of letting poll report the listener readable
// in a loop. Thread safety: none; one thread calls accept_one.
// ---------------------------------------------------------------------------------------------
class unix_listener {
 public:
  /// How long accept is not tried again after it failed for want of descriptors.
  static constexpr std::chrono::milliseconds backoff{100};

  /// `service` names the program in the error a second one gets ("glake dedup broker").
  unix_listener(std::string path, std::optional<gid_t> group, const char* service) : path_(std::move(path)) {
    sockaddr_un address;
    unix_address(path_, address);  // only checks the length: clients connect there
    lock_ = take_lock(path_ + ".lock", service);
    try {
      remove_stale_socket();
      fd_ = bind_in_private_directory(group);
    } catch (...) {
      remove_if_same(path_ + ".lock", lock_.get());
      throw;
    }
  }
  unix_listener(const unix_listener&) = delete;
  unix_listener& operator=(const unix_listener&) = delete;
  ~unix_listener() {
    if (fd_) remove_if_same(path_, socket_dev_, socket_ino_);
    if (lock_) remove_if_same(path_ + ".lock", lock_.get());  // while still held: see take_lock
  }

  const std::string& path() const noexcept { return path_; }
  int get() const noexcept { return fd_.get(); }

  /// The events to poll the listener for: POLLIN, or none while backing off.
  short poll_events() const noexcept { return backoff_ms() > 0 ? 0 : POLLIN; }
  /// Milliseconds until accept is tried again (0: now). A poll loop waits at most this long.
  int backoff_ms() const noexcept {
    if (backoff_until_ == clock::time_point{}) return 0;
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(backoff_until_ - clock::now()).count();
    return left > 0 ? static_cast<int>(left) : 0;
  }
  /// Whether the spare descriptor is held (it is given up for a moment per turned-away peer).
  bool has_spare() const noexcept { return static_cast<bool>(spare_); }

  /// One connection taken from the backlog (non-blocking, close-on-exec), with its peer's
  /// credentials when the kernel tells them (`credentials`). `turn_away` is set when the
  /// process is out of descriptors: the connection was taken with the spare one so that it does
  /// not wake poll forever, and the caller must refuse it and close it before the next call.
  struct accepted {
    unique_fd fd;
    peer_credentials peer;
    bool credentials = false;
    bool turn_away = false;
  };
  /// The next pending connection; nullopt when none is left, or while backing off.
  std::optional<accepted> accept_one() {
    if (backoff_ms() > 0) return std::nullopt;
    backoff_until_ = {};
    if (!spare_) spare_ = open_spare();  // the last turned-away connection is closed by now
    for (;;) {
      accepted a;
      a.fd.reset(::accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (a.fd) {
        a.credentials = read_peer_credentials(a.fd.get(), a.peer);
        return a;
      }
      const int error = errno;
      if (error == EINTR || error == ECONNABORTED) continue;
      if (error == EAGAIN || error == EWOULDBLOCK) return std::nullopt;
      if ((error == EMFILE || error == ENFILE) && spare_) {
        spare_.reset();
        a.fd.reset(::accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (a.fd) {
          a.turn_away = true;
          return a;
        }
        const int again = errno;
        spare_ = open_spare();
        // accept4 says EMFILE before it looks at the backlog: it may have been empty.
        if (again == EAGAIN || again == EWOULDBLOCK) return std::nullopt;
      }
      // Out of descriptors with no spare to give up, or another failure: poll would report the
      // listener readable at once again, so leave it alone for a while.
      backoff_until_ = clock::now() + backoff;
      return std::nullopt;
    }
  }

 private:
  using clock = std::chrono::steady_clock;

  static unique_fd open_spare() noexcept { return unique_fd(::open("/dev/null", O_RDONLY | O_CLOEXEC)); }

  [[noreturn]] static void fail(const char* call, int error, const std::string& what) {
    throw driver_error(call, error, what + ": " + errno_text(error));
  }

  // Opens and locks PATH.lock: created with O_EXCL, or the regular file of this user that a
  // service left there; never through a symbolic link. A lock file unlinked by a service that
  // exited between our open and our flock is not the one at the path any more: check, and try
  // again.
  static unique_fd take_lock(const std::string& lock_path, const char* service) {
    constexpr int flags = O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC;
    for (int attempt = 0; attempt < 16; ++attempt) {
      unique_fd fd(::open(lock_path.c_str(), flags | O_CREAT | O_EXCL, 0600));
      if (!fd && errno == EEXIST) {
        fd.reset(::open(lock_path.c_str(), flags));
        if (!fd && errno == ENOENT) continue;  // removed since: create it again
      }
      if (!fd) {
        const int error = errno;
        if (error == ELOOP) {
          throw usage_error(usage_error::kind::bad_argument,
                            "glake: the lock file " + lock_path + " is a symbolic link; not following it");
        }
        fail("open", error, "cannot open the lock file " + lock_path);
      }
      struct stat held {};
      if (::fstat(fd.get(), &held) != 0) fail("fstat", errno, lock_path);
      if (!S_ISREG(held.st_mode) || held.st_uid != ::geteuid()) {
        throw usage_error(usage_error::kind::bad_argument,
                          "glake: " + lock_path + " is not a regular file of uid " + std::to_string(::geteuid()) +
                              "; not using it as the lock file");
      }
      if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
        const int error = errno;
        if (error == EWOULDBLOCK) {
          throw driver_error("flock", EWOULDBLOCK,
                             std::string("another ") + service + " serves " + lock_path.substr(0, lock_path.size() - 5));
        }
        fail("flock", error, lock_path);
      }
      struct stat at_path {};
      if (::lstat(lock_path.c_str(), &at_path) == 0 && held.st_ino == at_path.st_ino && held.st_dev == at_path.st_dev) {
        return fd;
      }
    }
    throw driver_error("flock", EAGAIN, "the lock file " + lock_path + " keeps being replaced");
  }

  // A socket left by a service that died (the lock says none runs) is removed; anything else
  // at the path is refused.
  void remove_stale_socket() const {
    struct stat at {};
    if (::lstat(path_.c_str(), &at) != 0) {
      if (errno == ENOENT) return;
      fail("lstat", errno, path_);
    }
    if (!S_ISSOCK(at.st_mode)) {
      throw usage_error(usage_error::kind::bad_argument,
                        "glake: " + path_ + " exists and is not a socket; not replacing it (give another --socket path)");
    }
    if (::unlink(path_.c_str()) != 0 && errno != ENOENT) fail("unlink", errno, "cannot remove the stale socket " + path_);
  }

  static std::string directory_of(const std::string& path) {
    const auto slash = path.rfind('/');
    if (slash == std::string::npos) return ".";
    return slash == 0 ? "/" : path.substr(0, slash);
  }

  // Binds "s" in a new directory of mode 0700 beside the path, sets its group and mode there,
  // listens, and renames it to the path (refusing to replace anything that appeared there).
  unique_fd bind_in_private_directory(std::optional<gid_t> group) {
    std::string private_dir = directory_of(path_) + "/.glake-XXXXXX";
    if (::mkdtemp(private_dir.data()) == nullptr) {
      fail("mkdtemp", errno, "cannot make a directory beside the socket " + path_);
    }
    struct private_directory {
      std::string path;
      unique_fd fd;
      ~private_directory() {
        if (fd) ::unlinkat(fd.get(), "s", 0);
        ::rmdir(path.c_str());
      }
    } dir{private_dir, unique_fd(::open(private_dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC))};
    if (!dir.fd) fail("open", errno, private_dir);
    struct stat own {};
    if (::fstat(dir.fd.get(), &own) != 0 || own.st_uid != ::geteuid() || (own.st_mode & 0077) != 0) {
      throw driver_error("mkdtemp", EPERM, private_dir + " was replaced while the socket was made");
    }

    unique_fd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) throw_errno("socket", errno);
    // Through the open directory, so that a rename of it cannot redirect the bind.
    sockaddr_un address;
    socklen_t length = unix_address("/proc/self/fd/" + std::to_string(dir.fd.get()) + "/s", address);
    if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&address), length) != 0) {
      const int error = errno;
      if (error != ENOENT || private_dir.size() + 2 >= sizeof address.sun_path) fail("bind", error, path_);
      length = unix_address(private_dir + "/s", address);  // no /proc
      if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&address), length) != 0) fail("bind", errno, path_);
    }
    struct stat made {};
    if (::fstatat(dir.fd.get(), "s", &made, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISSOCK(made.st_mode)) {
      throw driver_error("bind", ENOENT, "the socket bound in " + private_dir + " is not there");
    }
    if (group && ::fchownat(dir.fd.get(), "s", static_cast<uid_t>(-1), *group, AT_SYMLINK_NOFOLLOW) != 0) {
      fail("fchownat", errno, "cannot give the socket " + path_ + " to group " + std::to_string(*group));
    }
    if (::fchmodat(dir.fd.get(), "s", group ? 0660 : 0600, 0) != 0) fail("fchmodat", errno, path_);
    if (::listen(fd.get(), 128) != 0) throw_errno("listen", errno);
    if (::renameat2(dir.fd.get(), "s", AT_FDCWD, path_.c_str(), RENAME_NOREPLACE) != 0) {
      const int error = errno;
      if (error == EEXIST) {
        throw usage_error(usage_error::kind::bad_argument,
                          "glake: something appeared at " + path_ + " while the socket was made; not replacing it");
      }
      if (error != EINVAL && error != ENOSYS) fail("renameat2", error, "cannot move the socket to " + path_);
      // A file system without RENAME_NOREPLACE: link fails as well when the path exists.
      if (::linkat(dir.fd.get(), "s", AT_FDCWD, path_.c_str(), 0) != 0) {
        fail("linkat", errno, "cannot move the socket to " + path_);
      }
    }
    socket_dev_ = made.st_dev;
    socket_ino_ = made.st_ino;
    return fd;
  }

  // Removes `path` if it is still the file `dev`/`ino` (or the one `fd` has open).
  static void remove_if_same(const std::string& path, dev_t dev, ino_t ino) noexcept {
    struct stat at {};
    if (::lstat(path.c_str(), &at) == 0 && at.st_dev == dev && at.st_ino == ino) ::unlink(path.c_str());
  }
  static void remove_if_same(const std::string& path, int fd) noexcept {
    struct stat held {};
    if (::fstat(fd, &held) == 0) remove_if_same(path, held.st_dev, held.st_ino);
  }

  std::string path_;
  unique_fd lock_;  // declared before fd_: the socket goes first, then the lock
  unique_fd fd_;
  dev_t socket_dev_ = 0;
  ino_t socket_ino_ = 0;
  unique_fd spare_ = open_spare();  // given up to take one connection
  clock::time_point backoff_until_{};
};

}  // namespace detail
}  // namespace glake
