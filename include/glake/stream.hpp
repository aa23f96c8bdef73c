// A non-owning reference to an execution stream, the unit that orders allocations and frees.
#pragma once

#include <compare>
#include <cstdint>

namespace glake {

/// Names a stream without owning it: a `cudaStream_t` on the GPU, a plain number in traces and
/// on the host and simulated backends. Two references are equal when they name the same stream;
/// the default-constructed reference is the default (null) stream.
class stream_ref {
 public:
  constexpr stream_ref() noexcept = default;
  constexpr explicit stream_ref(std::uintptr_t id) noexcept : id_(id) {}
  /// Accepts any stream handle that is a pointer, `cudaStream_t` included, without naming CUDA.
  template <class T>
  explicit stream_ref(T* handle) noexcept : id_(reinterpret_cast<std::uintptr_t>(handle)) {}

  constexpr std::uintptr_t id() const noexcept { return id_; }
  template <class T>
  T* as() const noexcept {
    return reinterpret_cast<T*>(id_);
  }

  friend constexpr bool operator==(stream_ref, stream_ref) noexcept = default;
  friend constexpr auto operator<=>(stream_ref, stream_ref) noexcept = default;

 private:
  std::uintptr_t id_ = 0;
};

inline constexpr stream_ref default_stream{};

}  // namespace glake
