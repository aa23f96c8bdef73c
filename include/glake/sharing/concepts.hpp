// The contracts of cross-process sharing of read-only memory: hashing content, exporting a copy
// as a file descriptor and mapping one read-only (client side), and checking what a client sent
// (broker side).
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "glake/ipc/unix_socket.hpp"

namespace glake {

/// A content digest as the dedup protocol carries it: 32 bytes. A hasher with a shorter output
/// fills the rest with zeros. Digests are lookup keys only: equal digests are always confirmed
/// byte for byte, so a collision (or a lying client) cannot make different bytes share memory.
struct content_digest {
  std::array<std::uint8_t, 32> bytes{};
  friend constexpr bool operator==(const content_digest&, const content_digest&) noexcept = default;
};

// ---------------------------------------------------------------------------------------------
// content_hasher
//
// Hashes a range of memory that the hasher can read: host memory for a host hasher; a hasher
// for device memory runs on the device and reads the device pointer it is given.
//
// | expression          | returns        | throws | meaning
// |---------------------|----------------|--------|-----------------------------------------------
// | ch(p, n)            | content_digest | no     | the digest of the n bytes at p; equal bytes
// |                     |                |        | give equal digests in every process
//
// Smallest model: any lambda `[](const void*, std::size_t) noexcept { return content_digest{}; }`
// (every range collides: still correct, since the broker compares bytes). Real model:
// fast_content_hasher (sharing/host_sharing.hpp).
// ---------------------------------------------------------------------------------------------
template <class H>
concept content_hasher = std::copy_constructible<H> && requires(const H& ch, const void* p, std::size_t n) {
  { ch(p, n) } noexcept -> std::same_as<content_digest>;
};

// ---------------------------------------------------------------------------------------------
// shareable_backend (client side)
//
// How a process turns a range of its memory into an object another process can map, and maps
// such objects read-only over its own addresses. An exported object is immutable from the moment
// it is exported (the host backend seals its memory file; see docs/dedup.md for a device), and
// the mapping that replaces a range is read-only: writing to it faults.
//
// | expression                | returns       | throws                     | meaning
// |---------------------------|---------------|----------------------------|--------------------------
// | cb.granularity()          | std::size_t   | no                         | ranges and their pieces are
// |                           |               |                            | aligned to and sized in it
// | b.export_copy(p, n)       | detail::      | driver_error, out_of_memory| a new immutable object
// |                           | unique_fd     |                            | holding the n bytes at p
// | b.map_readonly(p, n, fd)  | void          | driver_error, usage_error  | [p, p+n) now shows the
// |                           |               | (fd not an immutable object| object of fd, read-only;
// |                           |               | of at least n bytes)       | on throw it is unchanged
// | b.make_private(p, n)      | void          | driver_error, out_of_memory| [p, p+n) is writable
// |                           |               |                            | private memory holding the
// |                           |               |                            | same bytes; on throw unchanged
// | b.discard(p, n)           | void          | no                         | [p, p+n) is writable
// |                           |               |                            | private memory of zeros
//
// The pointer never changes: every operation replaces the memory behind [p, p+n) in place.
// Model: host_shareable_backend (sharing/host_sharing.hpp).
// ---------------------------------------------------------------------------------------------
template <class B>
concept shareable_backend = requires(B& b, const B& cb, void* p, const void* cp, std::size_t n, int fd) {
  { cb.granularity() } noexcept -> std::same_as<std::size_t>;
  { b.export_copy(cp, n) };
  { b.export_copy(cp, n).get() } -> std::same_as<int>;
  { b.map_readonly(p, n, fd) } -> std::same_as<void>;
  { b.make_private(p, n) } -> std::same_as<void>;
  { b.discard(p, n) } noexcept -> std::same_as<void>;
};

// ---------------------------------------------------------------------------------------------
// content_verifier (broker side)
//
// What the broker asks of a descriptor a client sent before it may index it or hand anything
// back: that it names an object of the claimed size the broker can read, whether two objects
// hold the same bytes, and what to index when the object is new. None of it may trust the
// client: a descriptor may name a pipe, a file that is still writable, or an object shorter than
// claimed, and none of that may crash the broker (no SIGBUS from mapping past an end) or share
// memory. The object indexed must be one no client can change afterwards: where the client's
// own object is immutable (a sealed memfd) it is indexed as it is; where it is not (device memory
// exported by its owner), adopt copies it into memory of the broker's own.
//
// | expression               | returns          | throws | meaning
// |--------------------------|------------------|--------|--------------------------------------
// | cv.check(fd, n)          | const char*      | no     | null when fd names an object of
// |                          |                  |        | exactly n bytes fit to compare and
// |                          |                  |        | adopt; else why not ("not sealed")
// | cv.equal(a, b, n)        | int              | no     | 1: the first n bytes of a (indexed)
// |                          |                  |        | and b (a client's) are equal; 0: they
// |                          |                  |        | differ; -1: they could not be read
// | v.adopt(std::move(u), n) | detail::unique_fd| no     | the object to index for the client's
// |                          |                  |        | u: u itself when immutable, else a
// |                          |                  |        | copy; empty when that failed
//
// Model: host_content_verifier (sharing/host_sharing.hpp).
// ---------------------------------------------------------------------------------------------
template <class V>
concept content_verifier = requires(V& v, const V& cv, int fd, std::size_t n, detail::unique_fd&& owned) {
  { cv.check(fd, n) } noexcept -> std::same_as<const char*>;
  { cv.equal(fd, fd, n) } noexcept -> std::same_as<int>;
  { v.adopt(std::move(owned), n) } noexcept -> std::same_as<detail::unique_fd>;
};

// ---------------------------------------------------------------------------------------------
// sliced_content_verifier (broker side, optional)
//
// A content_verifier that can compare two objects a slice at a time, so that the broker, one
// thread, serves its other connections between the slices of a large comparison instead of
// stalling them for the whole of it. A verifier without it is compared whole, in one call.
//
// | expression                 | returns | throws | meaning
// |----------------------------|---------|--------|----------------------------------------------
// | cv.equal_slice(a, b, n,    | int     | no     | for two objects of n bytes (a indexed, b a
// |                at, m)      |         |        | client's): 1 when their bytes [at, at + m)
// |                            |         |        | are equal, 0 when they differ there, -1 when
// |                            |         |        | they could not be read or the slice is not
// |                            |         |        | within n; equal(a, b, n) is 1 exactly when
// |                            |         |        | every slice of a cover of [0, n) gives 1
//
// Model: host_content_verifier (sharing/host_sharing.hpp).
// ---------------------------------------------------------------------------------------------
template <class V>
concept sliced_content_verifier = content_verifier<V> && requires(const V& cv, int fd, std::size_t n) {
  { cv.equal_slice(fd, fd, n, n, n) } noexcept -> std::same_as<int>;
};

}  // namespace glake
