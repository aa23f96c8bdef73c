// Unix-domain socket helpers for the sharing components: owned descriptors, SOCK_SEQPACKET
// listen/connect, peer credentials, and one message with at most a few descriptors each way.
#pragma once

#if !defined(__linux__)
#error "glake/ipc/unix_socket.hpp needs Linux (SOCK_SEQPACKET, SO_PEERCRED, MSG_CMSG_CLOEXEC)"
#endif

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "glake/errors.hpp"

namespace glake::detail {

/// Owns one file descriptor: closed by the destructor, moved, never copied.
class unique_fd {
 public:
  unique_fd() noexcept = default;
  explicit unique_fd(int fd) noexcept : fd_(fd) {}
  unique_fd(unique_fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  unique_fd& operator=(unique_fd&& other) noexcept {
    if (this != &other) reset(std::exchange(other.fd_, -1));
    return *this;
  }
  unique_fd(const unique_fd&) = delete;
  unique_fd& operator=(const unique_fd&) = delete;
  ~unique_fd() { reset(); }

  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  int release() noexcept { return std::exchange(fd_, -1); }
  void reset(int fd = -1) noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

/// Who is at the other end of a connected Unix socket, as the kernel recorded it at connect
/// time (SO_PEERCRED), with the peer's supplementary groups where the kernel tells them
/// (SO_PEERGROUPS, Linux 4.13+).
struct peer_credentials {
  pid_t pid = 0;
  uid_t uid = static_cast<uid_t>(-1);
  gid_t gid = static_cast<gid_t>(-1);
  std::vector<gid_t> groups;

  bool in_group(gid_t group) const noexcept {
    if (gid == group) return true;
    for (gid_t g : groups) {
      if (g == group) return true;
    }
    return false;
  }
};

/// The peer's credentials; false with errno set when the kernel does not say.
inline bool read_peer_credentials(int socket, peer_credentials& out) {
  ucred cred{};
  socklen_t length = sizeof cred;
  if (::getsockopt(socket, SOL_SOCKET, SO_PEERCRED, &cred, &length) != 0) return false;
  out.pid = cred.pid;
  out.uid = cred.uid;
  out.gid = cred.gid;
  out.groups.clear();
#ifdef SO_PEERGROUPS
  std::vector<gid_t> groups(64);
  for (int attempt = 0; attempt < 4; ++attempt) {
    socklen_t bytes = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (::getsockopt(socket, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &bytes) == 0) {
      groups.resize(bytes / sizeof(gid_t));
      out.groups = std::move(groups);
      break;
    }
    if (errno != ERANGE) break;  // an old kernel: the primary group only
    groups.resize(bytes / sizeof(gid_t) + 1);
  }
#endif
  return true;
}

/// Fills a sockaddr_un for `path`; throws usage_error when the path does not fit sun_path
/// (107 bytes and a terminating zero) or is empty.
inline socklen_t unix_address(const std::string& path, sockaddr_un& address) {
  std::memset(&address, 0, sizeof address);
  address.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof address.sun_path || path.find('\0') != std::string::npos) {
    throw usage_error(usage_error::kind::bad_argument,
                      "glake: the socket path '" + path + "' is empty, holds a zero byte or is longer than " +
                          std::to_string(sizeof address.sun_path - 1) + " bytes");
  }
  std::memcpy(address.sun_path, path.data(), path.size());
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size() + 1);
}

/// Sets a socket's send and receive timeouts (0: none), after which a blocking call gives
/// EAGAIN. On a Unix socket the send timeout also bounds connect.
inline void set_socket_timeouts(int socket, int milliseconds) noexcept {
  timeval tv{};
  tv.tv_sec = milliseconds / 1000;
  tv.tv_usec = (milliseconds % 1000) * 1000;
  ::setsockopt(socket, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(socket, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

/// A connected SOCK_SEQPACKET socket to `path` (close-on-exec, blocking, with send and receive
/// timeouts of `timeout_ms`, 0: none); an empty unique_fd with errno set when connect fails
/// (ENOENT, ECONNREFUSED: nobody listens there; EAGAIN: its backlog stayed full that long).
inline unique_fd connect_unix(const std::string& path, int timeout_ms = 0) {
  sockaddr_un address;
  const socklen_t length = unix_address(path, address);
  unique_fd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!fd) return fd;
  if (timeout_ms > 0) set_socket_timeouts(fd.get(), timeout_ms);
  int result;
  do {
    result = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&address), length);
  } while (result != 0 && errno == EINTR);
  if (result != 0) {
    const int error = errno;
    fd.reset();
    errno = error;
  }
  return fd;
}

/// Sends one message with up to four descriptors (SCM_RIGHTS). Returns 0 or the errno
/// (EPIPE, ECONNRESET: the peer is gone; EAGAIN: it does not read). Never raises SIGPIPE.
inline int send_message(int socket, std::span<const std::byte> bytes, std::span<const int> fds = {},
                        int flags = 0) noexcept {
  constexpr std::size_t most_fds = 4;
  if (fds.size() > most_fds) return EINVAL;
  iovec io{const_cast<std::byte*>(bytes.data()), bytes.size()};
  msghdr message{};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * most_fds)];
  if (!fds.empty()) {
    std::memset(control, 0, sizeof control);
    message.msg_control = control;
    message.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* header = CMSG_FIRSTHDR(&message);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(header), fds.data(), sizeof(int) * fds.size());
  }
  for (;;) {
    const ssize_t sent = ::sendmsg(socket, &message, MSG_NOSIGNAL | flags);
    if (sent >= 0) return static_cast<std::size_t>(sent) == bytes.size() ? 0 : EMSGSIZE;
    if (errno != EINTR) return errno;
  }
}

/// What receive_message got: the message's bytes (its length in `size`), the descriptors that
/// came with it (owned: closed unless taken), and whether the kernel cut either short.
struct received_message {
  std::size_t size = 0;         ///< bytes received; 0 with error 0: the peer closed
  std::vector<unique_fd> fds;   ///< every descriptor received, whatever else was wrong
  bool truncated = false;       ///< the message was longer than the buffer (MSG_TRUNC)
  bool fds_truncated = false;   ///< descriptors were dropped (MSG_CTRUNC: too many, or EMFILE)
  bool foreign_control = false; ///< control data other than SCM_RIGHTS (ignored)
  int error = 0;                ///< errno of recvmsg, 0 on success
};

/// Receives one message into `buffer`, with up to `most_fds` descriptors (close-on-exec).
/// Descriptors beyond that are closed by the kernel and reported as fds_truncated.
inline received_message receive_message(int socket, std::span<std::byte> buffer, std::size_t most_fds,
                                        int flags = 0) {
  received_message result;
  iovec io{buffer.data(), buffer.size()};
  msghdr message{};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  std::vector<char> control_storage(CMSG_SPACE(sizeof(int) * (most_fds == 0 ? 1 : most_fds)) + sizeof(cmsghdr));
  message.msg_control = control_storage.data();
  message.msg_controllen = CMSG_SPACE(sizeof(int) * (most_fds == 0 ? 1 : most_fds));
  ssize_t got;
  do {
    got = ::recvmsg(socket, &message, MSG_CMSG_CLOEXEC | flags);
  } while (got < 0 && errno == EINTR);
  if (got < 0) {
    result.error = errno;
    return result;
  }
  result.size = static_cast<std::size_t>(got);
  result.truncated = (message.msg_flags & MSG_TRUNC) != 0;
  result.fds_truncated = (message.msg_flags & MSG_CTRUNC) != 0;
  for (cmsghdr* header = CMSG_FIRSTHDR(&message); header != nullptr; header = CMSG_NXTHDR(&message, header)) {
    if (header->cmsg_level == SOL_SOCKET && header->cmsg_type == SCM_RIGHTS) {
      const std::size_t count = (header->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(header) + i * sizeof(int), sizeof fd);
        result.fds.emplace_back(fd);
      }
    } else {
      result.foreign_control = true;
    }
  }
  if (result.fds.size() > most_fds) result.fds_truncated = true;
  return result;
}

/// Waits until `fd` is readable or `milliseconds` pass (-1: forever). True when readable (or
/// closed, or in error: the next read tells which).
inline bool wait_readable(int fd, int milliseconds) noexcept {
  pollfd p{fd, POLLIN, 0};
  int result;
  do {
    result = ::poll(&p, 1, milliseconds);
  } while (result < 0 && errno == EINTR);
  return result > 0;
}

}  // namespace glake::detail
