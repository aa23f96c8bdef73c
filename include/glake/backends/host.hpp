// A host backend on Linux memfd and mmap, so that stitched blocks are real contiguous bytes
// that tests can write through one mapping and read back through another.
#pragma once

#if !defined(__linux__)
#error "glake/backends/host.hpp needs Linux (memfd_create, mmap with MAP_FIXED)"
#endif

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <system_error>

#include "glake/backends/concepts.hpp"
#include "glake/config.hpp"
#include "glake/errors.hpp"

namespace glake {

namespace detail {

// Throws usage_error unless granularity is a power of two and a multiple of the page size, the
// conditions under which every granularity-aligned range is also a page-aligned one for mmap.
inline void check_host_granularity(const char* who, std::size_t granularity) {
  const long page = ::sysconf(_SC_PAGESIZE);
  const bool power_of_two = granularity != 0 && (granularity & (granularity - 1)) == 0;
  if (!power_of_two || page <= 0 || granularity % static_cast<std::size_t>(page) != 0) {
    throw usage_error(usage_error::kind::bad_argument,
                      std::string(who) + ": granularity " + std::to_string(granularity) +
                          " is not a power of two multiple of the page size " +
                          std::to_string(page));
  }
}

inline void check_host_size(const char* who, std::size_t bytes, std::size_t granularity) {
  if (bytes == 0 || bytes % granularity != 0) {
    throw usage_error(usage_error::kind::bad_argument,
                      std::string(who) + ": size " + std::to_string(bytes) +
                          " is not a positive multiple of the granularity " +
                          std::to_string(granularity));
  }
}

inline void check_host_address(const char* who, const void* at, std::size_t granularity) {
  if (at == nullptr || reinterpret_cast<std::uintptr_t>(at) % granularity != 0) {
    throw usage_error(usage_error::kind::bad_argument,
                      std::string(who) + ": address " +
                          std::to_string(reinterpret_cast<std::uintptr_t>(at)) +
                          " is null or not aligned to the granularity " +
                          std::to_string(granularity));
  }
}

[[noreturn]] inline void throw_errno(const char* call, int error) {
  throw driver_error(call, error, std::generic_category().message(error));
}

// The errno values that mean "the system is out of something", which the backend reports as an
// ordinary failure (empty optional, null, false) rather than as a driver_error.
constexpr bool out_of_resources(int error) noexcept {
  return error == ENOMEM || error == ENOSPC || error == EMFILE || error == ENFILE ||
         error == EAGAIN || error == EFBIG;
}

// Lays a fresh inaccessible, uncommitted anonymous mapping over [at, at + bytes): the state of a
// reserved range that holds no handle.
inline bool restore_reservation(void* at, std::size_t bytes) noexcept {
  return ::mmap(at, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
                -1, 0) != MAP_FAILED;
}

}  // namespace detail

/// Names one host handle: a memfd and its size. The size travels with the fd so that release
/// can return it to the capacity count and try_map can check that the handle is mapped whole.
struct host_handle {
  int fd = -1;
  std::size_t bytes = 0;
  friend constexpr bool operator==(host_handle, host_handle) noexcept = default;
};

// ---------------------------------------------------------------------------------------------
// host_provider
//
// Creates each handle as an anonymous memory file (memfd_create + ftruncate); its pages are
// committed by the kernel on first touch, so the optional capacity is what stands in for the
// GPU's fixed memory size: try_create returns empty once the live handle bytes would exceed it.
// Each call is one or two system calls, O(1). Out-of-resources errno values (ENOMEM, ENOSPC,
// EMFILE, ENFILE, ...) give an empty optional; any other failure throws driver_error naming the
// call. release closes the fd; the memory lives on while any mapping of it does, as with CUDA.
//
// Copies share the capacity count (a shared_ptr to an atomic), so a provider copied into several
// allocators still enforces one limit. Thread safety: all members may be called concurrently.
// ---------------------------------------------------------------------------------------------
class host_provider {
 public:
  using handle_type = host_handle;

  /// capacity 0 means unlimited. Throws usage_error when granularity is not a power of two
  /// multiple of the page size.
  explicit host_provider(std::size_t granularity = 2 * MiB, std::size_t capacity = 0)
      : state_((detail::check_host_granularity("glake::host_provider", granularity),
                std::make_shared<state>(granularity, capacity))) {}

  std::size_t granularity() const noexcept { return state_->granularity; }
  memory_location location() const noexcept { return memory_location::host; }
  /// 0 when unlimited.
  std::size_t capacity() const noexcept { return state_->capacity; }
  /// Bytes of handles created and not yet released, by this provider and its copies.
  std::size_t created_bytes() const noexcept { return state_->created.load(); }

  std::optional<handle_type> try_create(std::size_t bytes) {
    detail::check_host_size("glake::host_provider::try_create", bytes, state_->granularity);
    if (!claim(bytes)) return std::nullopt;
    const int fd = ::memfd_create("glake", MFD_CLOEXEC);
    if (fd < 0) {
      const int error = errno;
      state_->created -= bytes;
      if (detail::out_of_resources(error)) return std::nullopt;
      detail::throw_errno("memfd_create", error);
    }
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      const int error = errno;
      ::close(fd);
      state_->created -= bytes;
      if (detail::out_of_resources(error)) return std::nullopt;
      detail::throw_errno("ftruncate", error);
    }
    return host_handle{fd, bytes};
  }

  void release(handle_type handle) noexcept {
    if (handle.fd < 0) return;
    ::close(handle.fd);
    state_->created -= handle.bytes;
  }

  friend bool operator==(const host_provider&, const host_provider&) noexcept = default;

 private:
  struct state {
    state(std::size_t g, std::size_t c) noexcept : granularity(g), capacity(c) {}
    const std::size_t granularity;
    const std::size_t capacity;
    std::atomic<std::size_t> created{0};
  };

  // Counts the bytes before creating them, so that concurrent creators cannot together pass
  // the capacity.
  bool claim(std::size_t bytes) noexcept {
    std::size_t current = state_->created.load();
    do {
      if (state_->capacity != 0 && bytes > state_->capacity - current) return false;
    } while (!state_->created.compare_exchange_weak(current, current + bytes));
    return true;
  }

  std::shared_ptr<state> state_;
};
static_assert(physical_provider<host_provider>);

// ---------------------------------------------------------------------------------------------
// host_reserver
//
// Reserves with an inaccessible, uncommitted anonymous mapping (over-reserved by one granule and
// trimmed, since mmap aligns only to pages), maps a handle with MAP_FIXED over part of that
// range, grants access with mprotect, and unmaps by laying a fresh reservation back over the
// range, so the range stays reserved. Each call is O(1) system calls.
//
// It checks its arguments (alignment, sizes, null, a handle mapped whole) but keeps no record
// of what is mapped where, so it cannot catch what the simulated backend catches: mapping over
// an existing mapping silently replaces it, and set_access over an unmapped part of a
// reservation makes anonymous memory accessible. Test allocators on sim_device for the rules
// and here for the bytes. Stateless apart from the granularity; thread safety: all members may
// be called concurrently (the kernel serialises address-space changes).
// ---------------------------------------------------------------------------------------------
class host_reserver {
 public:
  using handle_type = host_handle;

  /// Throws usage_error when granularity is not a power of two multiple of the page size.
  explicit host_reserver(std::size_t granularity = 2 * MiB) : granularity_(granularity) {
    detail::check_host_granularity("glake::host_reserver", granularity);
  }

  std::size_t granularity() const noexcept { return granularity_; }

  void* try_reserve(std::size_t bytes) {
    detail::check_host_size("glake::host_reserver::try_reserve", bytes, granularity_);
    if (bytes > SIZE_MAX - granularity_) return nullptr;
    const std::size_t padded = bytes + granularity_;
    void* raw = ::mmap(nullptr, padded, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
    if (raw == MAP_FAILED) {
      const int error = errno;
      if (detail::out_of_resources(error)) return nullptr;
      detail::throw_errno("mmap", error);
    }
    const auto start = reinterpret_cast<std::uintptr_t>(raw);
    const std::uintptr_t aligned = (start + granularity_ - 1) & ~(std::uintptr_t{granularity_} - 1);
    const std::size_t head = aligned - start;
    const std::size_t tail = padded - head - bytes;
    // Trimming only shrinks a mapping we own; should it fail, the slop stays reserved and
    // inaccessible, which wastes address space but breaks nothing.
    if (head != 0) ::munmap(raw, head);
    if (tail != 0) ::munmap(reinterpret_cast<void*>(aligned + bytes), tail);
    return reinterpret_cast<void*>(aligned);
  }

  void free(void* at, std::size_t bytes) noexcept {
    if (at != nullptr && bytes != 0) ::munmap(at, bytes);
  }

  bool try_map(void* at, std::size_t bytes, handle_type handle) {
    check_range("glake::host_reserver::try_map", at, bytes);
    if (handle.fd < 0 || handle.bytes != bytes) {
      throw usage_error(usage_error::kind::bad_argument,
                        "glake::host_reserver::try_map: the handle (fd " +
                            std::to_string(handle.fd) + ", " + std::to_string(handle.bytes) +
                            " bytes) is invalid or not " + std::to_string(bytes) +
                            " bytes (a handle is mapped whole)");
    }
    // PROT_NONE: as with CUDA, a fresh mapping is inaccessible until set_access.
    if (::mmap(at, bytes, PROT_NONE, MAP_SHARED | MAP_FIXED, handle.fd, 0) == MAP_FAILED) {
      const int error = errno;
      // A failed MAP_FIXED may already have unmapped part of the range; put the reservation
      // back so the caller's rollback finds the range as it left it.
      detail::restore_reservation(at, bytes);
      if (detail::out_of_resources(error)) return false;
      detail::throw_errno("mmap", error);
    }
    return true;
  }

  bool try_set_access(void* at, std::size_t bytes) {
    check_range("glake::host_reserver::try_set_access", at, bytes);
    if (::mprotect(at, bytes, PROT_READ | PROT_WRITE) != 0) {
      // ENOMEM also covers an unmapped range; reporting it as a failure lets the caller roll
      // back either way.
      const int error = errno;
      if (detail::out_of_resources(error)) return false;
      detail::throw_errno("mprotect", error);
    }
    return true;
  }

  void unmap(void* at, std::size_t bytes) noexcept {
    if (at == nullptr || bytes == 0) return;
    // Should the kernel refuse the replacement, drop the mapping anyway: a hole in the
    // reservation is harmless, a live alias of a handle the caller thinks unmapped is not.
    if (!detail::restore_reservation(at, bytes)) ::munmap(at, bytes);
  }

  friend bool operator==(const host_reserver&, const host_reserver&) noexcept = default;

 private:
  void check_range(const char* who, void* at, std::size_t bytes) const {
    detail::check_host_address(who, at, granularity_);
    detail::check_host_size(who, bytes, granularity_);
  }

  std::size_t granularity_;
};
static_assert(address_reserver_for<host_reserver, host_provider>);

}  // namespace glake
