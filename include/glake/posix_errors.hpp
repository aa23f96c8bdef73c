// errno values as glake reports them: a symbolic name, a readable text, and the driver_error a
// failed system call throws. Shared by the host backend and the IPC layer.
#pragma once

#include <cerrno>
#include <string>
#include <system_error>

#include "glake/errors.hpp"

namespace glake::detail {

// The symbolic name of an errno value ("EMFILE"), for the values the host backend can meet;
// "errno N" for the rest.
inline std::string errno_name(int error) {
  switch (error) {
    case EMFILE: return "EMFILE";
    case ENFILE: return "ENFILE";
    case ENOMEM: return "ENOMEM";
    case ENOSPC: return "ENOSPC";
    case EFBIG: return "EFBIG";
    case EAGAIN: return "EAGAIN";
    case EINVAL: return "EINVAL";
    case EBADF: return "EBADF";
    case EACCES: return "EACCES";
    case EPERM: return "EPERM";
    case ENODEV: return "ENODEV";
    case EOVERFLOW: return "EOVERFLOW";
    case EINTR: return "EINTR";
    case EOPNOTSUPP: return "EOPNOTSUPP";
    default: return "errno " + std::to_string(error);
  }
}

// "Too many open files (EMFILE)".
inline std::string errno_text(int error) {
  return std::generic_category().message(error) + " (" + errno_name(error) + ")";
}

[[noreturn]] inline void throw_errno(const char* call, int error) {
  throw driver_error(call, error, errno_text(error));
}

}  // namespace glake::detail
