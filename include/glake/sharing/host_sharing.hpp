// The host models of the sharing contracts: a fast content hasher, sealed memfd copies mapped
// read-only and private over a process's own addresses, and the broker's checks of a memfd.
#pragma once

#if !defined(__linux__)
#error "glake/sharing/host_sharing.hpp needs Linux (memfd_create with seals, mremap)"
#endif

#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1  // mremap's MREMAP_FIXED
#endif
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "glake/backends/host.hpp"
#include "glake/errors.hpp"
#include "glake/ipc/unix_socket.hpp"
#include "glake/posix_errors.hpp"
#include "glake/sharing/concepts.hpp"

namespace glake {

// ---------------------------------------------------------------------------------------------
// fast_content_hasher
//
// A 256-bit non-cryptographic digest: four independent 64-bit lanes, each a multiply-rotate
// accumulator over every fourth 8-byte word (xxHash64's round), then mixed with the length and
// each other. About one multiply per 8 bytes, several GB/s on one core. Not collision
// resistant against an adversary, and it need not be: the broker confirms every equal digest
// byte for byte (docs/dedup.md). Stateless; thread-safe.
// ---------------------------------------------------------------------------------------------
struct fast_content_hasher {
  content_digest operator()(const void* data, std::size_t bytes) const noexcept {
    constexpr std::uint64_t p1 = 0x9E3779B185EBCA87ULL, p2 = 0xC2B2AE3D27D4EB4FULL;
    std::uint64_t lane[4] = {p1 + p2, p2, 0, 0 - p1};
    const auto* in = static_cast<const unsigned char*>(data);
    std::size_t at = 0;
    auto word = [](const unsigned char* p) noexcept {
      std::uint64_t w;
      std::memcpy(&w, p, sizeof w);
      return w;
    };
    auto round = [](std::uint64_t acc, std::uint64_t w) noexcept {
      acc += w * p2;
      acc = (acc << 31) | (acc >> 33);
      return acc * p1;
    };
    for (; bytes - at >= 32; at += 32) {
      for (int i = 0; i < 4; ++i) lane[i] = round(lane[i], word(in + at + 8 * i));
    }
    unsigned char tail[32] = {};
    if (bytes > at) std::memcpy(tail, in + at, bytes - at);
    for (int i = 0; i < 4; ++i) lane[i] = round(lane[i], word(tail + 8 * i) ^ (bytes - at));
    content_digest digest;
    for (int i = 0; i < 4; ++i) {
      std::uint64_t h = lane[i] ^ (bytes * p1) ^ lane[(i + 1) % 4];
      h ^= h >> 33;
      h *= p2;
      h ^= h >> 29;
      h *= 0x165667B19E3779F9ULL;
      h ^= h >> 32;
      std::memcpy(digest.bytes.data() + 8 * i, &h, sizeof h);
    }
    return digest;
  }
};
static_assert(content_hasher<fast_content_hasher>);

namespace detail {

// The seals that make a memfd immutable: its bytes (F_SEAL_WRITE, which the kernel grants only
// while no writable shared mapping exists) and its size (SHRINK: no SIGBUS for a mapper; GROW).
inline constexpr int immutable_seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE;

// Null when fd is a memfd sealed immutable of exactly `bytes`; else why not. Only ordinary
// (shmem) memfds: a hugetlbfs one could raise SIGBUS in whoever maps it when huge pages run out.
inline const char* check_sealed_memfd(int fd, std::size_t bytes) noexcept {
  struct stat info {};
  if (fd < 0 || ::fstat(fd, &info) != 0) return "the descriptor is not open";
  if (!S_ISREG(info.st_mode)) return "the descriptor is not a memory file (memfd)";
  struct statfs fs {};
  if (::fstatfs(fd, &fs) != 0 || fs.f_type != TMPFS_MAGIC) return "the descriptor is not an ordinary memory file (memfd)";
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) return "the descriptor is not a sealable memory file (memfd)";
  if ((seals & immutable_seals) != immutable_seals) {
    return "the memory file is not sealed against writing and resizing (F_SEAL_WRITE, F_SEAL_SHRINK, F_SEAL_GROW)";
  }
  if (info.st_size < 0 || static_cast<std::uint64_t>(info.st_size) != bytes) {
    return "the memory file's size differs from the size in the message";
  }
  return nullptr;
}

// Moves the mapping at `from` (n bytes) over [to, to + n) in one step, replacing what was there;
// on failure unmaps `from` and returns the errno.
inline int move_mapping_over(void* from, void* to, std::size_t bytes) noexcept {
  if (::mremap(from, bytes, bytes, MREMAP_MAYMOVE | MREMAP_FIXED, to) == MAP_FAILED) {
    const int error = errno;
    ::munmap(from, bytes);
    return error;
  }
  return 0;
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// host_shareable_backend
//
// export_copy writes the bytes into a new memfd (memfd_create with MFD_ALLOW_SEALING, ftruncate,
// pwrite) and seals it immutable (F_SEAL_WRITE, SHRINK, GROW and SEAL), so neither its creator
// nor anyone it reaches can change it afterwards. map_readonly maps such a file PROT_READ and
// MAP_PRIVATE somewhere free, then moves that mapping over the range with one mremap: the range
// is never unmapped in between, and a write to it faults (SIGSEGV). MAP_PRIVATE rather than
// MAP_SHARED: the pages are the file's own (shared by every process mapping it) until written,
// and should a process mprotect its range writable anyway, its writes copy pages privately
// instead of reaching other processes. make_private copies the bytes into fresh anonymous memory
// mapped elsewhere and moves that over the range the same way; discard lays fresh anonymous
// memory over it. Ranges are page-aligned (granularity(): the page size).
//
// Whatever mapped the range before (anonymous memory, a host_provider handle) is replaced:
// anonymous pages are freed at once; a memory file's pages stay with its owner (a host_provider
// handle keeps its slice until released). Each call is O(1) system calls plus O(n) copying for
// export_copy and make_private. Thread safety: stateless; calls on disjoint ranges may run
// concurrently.
// ---------------------------------------------------------------------------------------------
class host_shareable_backend {
 public:
  std::size_t granularity() const noexcept { return static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)); }

  detail::unique_fd export_copy(const void* at, std::size_t bytes) {
    detail::unique_fd fd(::memfd_create("glake-shared", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (!fd) detail::throw_errno("memfd_create", errno);
    if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) detail::throw_errno("ftruncate", errno);
    const auto* from = static_cast<const char*>(at);
    for (std::size_t done = 0; done < bytes;) {
      const ssize_t wrote = ::pwrite(fd.get(), from + done, bytes - done, static_cast<off_t>(done));
      if (wrote < 0 && errno == EINTR) continue;
      if (wrote <= 0) detail::throw_errno("pwrite", wrote < 0 ? errno : ENOSPC);
      done += static_cast<std::size_t>(wrote);
    }
    if (::fcntl(fd.get(), F_ADD_SEALS, detail::immutable_seals | F_SEAL_SEAL) != 0) {
      detail::throw_errno("fcntl(F_ADD_SEALS)", errno);
    }
    return fd;
  }

  void map_readonly(void* at, std::size_t bytes, int fd) {
    check_range("glake::host_shareable_backend::map_readonly", at, bytes);
    if (const char* why = detail::check_sealed_memfd(fd, bytes)) {
      throw usage_error(usage_error::kind::bad_argument,
                        std::string("glake::host_shareable_backend::map_readonly: ") + why);
    }
    void* view = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    if (view == MAP_FAILED) detail::throw_errno("mmap", errno);
    if (const int error = detail::move_mapping_over(view, at, bytes)) detail::throw_errno("mremap", error);
  }

  void make_private(void* at, std::size_t bytes) {
    check_range("glake::host_shareable_backend::make_private", at, bytes);
    void* copy = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (copy == MAP_FAILED) {
      if (errno == ENOMEM) throw out_of_memory(bytes, 0, 0, "glake::host_shareable_backend::make_private: mmap of " + format_bytes(bytes) + " failed (ENOMEM)");
      detail::throw_errno("mmap", errno);
    }
    std::memcpy(copy, at, bytes);
    if (const int error = detail::move_mapping_over(copy, at, bytes)) detail::throw_errno("mremap", error);
  }

  void discard(void* at, std::size_t bytes) noexcept {
    ::mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  }

 private:
  void check_range(const char* who, void* at, std::size_t bytes) const {
    detail::check_host_address(who, at, granularity());
    detail::check_host_size(who, bytes, granularity());
  }
};
static_assert(shareable_backend<host_shareable_backend>);

// ---------------------------------------------------------------------------------------------
// host_content_verifier
//
// check: the descriptor is an ordinary memfd (shmem, a regular file with seals) sealed
// F_SEAL_WRITE, SHRINK and GROW, of exactly the claimed size, so its bytes cannot change after
// the broker compared them and mapping it within that size cannot raise SIGBUS. equal and
// equal_slice (the whole objects, or one slice of them): check both again, then read both with
// pread in 256 KiB steps and compare with memcmp. adopt keeps
// the client's memfd itself (its seals make it immutable). Reading
// rather than mapping: a read error is an error code, never a signal, and holes in a sparse file
// read as zeros without the broker allocating pages for them. O(n) time for n bytes compared, at
// most 512 KiB of buffers per call; stateless.
// ---------------------------------------------------------------------------------------------
struct host_content_verifier {
  const char* check(int fd, std::size_t bytes) const noexcept { return detail::check_sealed_memfd(fd, bytes); }

  /// A sealed memfd is immutable already: indexed as it came.
  detail::unique_fd adopt(detail::unique_fd&& fd, std::size_t) noexcept { return std::move(fd); }

  static bool read_exactly(int fd, char* to, std::size_t n, std::size_t offset) noexcept {
    for (std::size_t done = 0; done < n;) {
      const ssize_t got = ::pread(fd, to + done, n - done, static_cast<off_t>(offset + done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return false;
      done += static_cast<std::size_t>(got);
    }
    return true;
  }

  int equal(int a, int b, std::size_t bytes) const noexcept {
    if (bytes == 0) return 1;
    return equal_slice(a, b, bytes, 0, bytes);
  }

  /// The bytes [at, at + n) of two objects of `bytes` bytes each (the broker's slices).
  int equal_slice(int a, int b, std::size_t bytes, std::size_t at, std::size_t n) const noexcept {
    if (detail::check_sealed_memfd(a, bytes) != nullptr || detail::check_sealed_memfd(b, bytes) != nullptr) return -1;
    if (at > bytes || n > bytes - at) return -1;
    if (a == b || n == 0) return 1;
    constexpr std::size_t step = 256 * 1024;
    const std::size_t buffer = n < step ? n : step;
    std::unique_ptr<char[]> buffers(new (std::nothrow) char[2 * buffer]);
    if (!buffers) return -1;
    char* const ba = buffers.get();
    char* const bb = buffers.get() + buffer;
    for (std::size_t done = 0; done < n; done += buffer) {
      const std::size_t k = n - done < buffer ? n - done : buffer;
      if (!read_exactly(a, ba, k, at + done) || !read_exactly(b, bb, k, at + done)) return -1;
      if (std::memcmp(ba, bb, k) != 0) return 0;
    }
    return 1;
  }
};
static_assert(sliced_content_verifier<host_content_verifier>);

}  // namespace glake
