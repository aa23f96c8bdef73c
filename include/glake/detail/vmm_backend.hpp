// A provider and reserver pair used together: segments of chunks and stitched mappings made and
// unmade with full rollback, every call counted, physical bytes held against a limit.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>

#include "glake/backends/concepts.hpp"
#include "glake/statistics.hpp"

namespace glake::detail {

/// A reservation with `chunks` physical handles of `chunk` bytes mapped back to back.
template <class Handle>
struct mapped_segment {
  std::uintptr_t base = 0;
  std::size_t size = 0;
  std::size_t chunk = 0;
  std::unique_ptr<Handle[]> handles;

  std::size_t chunks() const noexcept { return chunk == 0 ? 0 : size / chunk; }
};

/// Owns a provider and a reserver and performs the multi-call sequences the allocators need,
/// each one all-or-nothing: if any call fails, everything done so far is undone and the backend
/// is as before. Out-of-memory answers false (or null); other failures propagate as exceptions
/// after the rollback. Not thread-safe; its owner serialises access.
template <physical_provider Provider, address_reserver_for<Provider> Reserver>
class vmm_backend {
 public:
  using handle_type = typename Provider::handle_type;
  using segment_type = mapped_segment<handle_type>;

  vmm_backend(Provider provider, Reserver reserver, std::size_t memory_limit = 0)
      : provider_(std::move(provider)), reserver_(std::move(reserver)), limit_(memory_limit) {}

  std::size_t granularity() const noexcept {
    return std::max(provider_.granularity(), reserver_.granularity());
  }
  std::size_t physical_bytes() const noexcept { return physical_bytes_; }
  std::size_t memory_limit() const noexcept { return limit_; }
  const driver_call_counts& calls() const noexcept { return calls_; }
  Provider& provider() noexcept { return provider_; }
  Reserver& reserver() noexcept { return reserver_; }

  /// Creates `bytes / chunk` handles, reserves one range and maps them in order. False when the
  /// limit or the backend ran out of memory; `out` is then untouched.
  bool try_create_segment(std::size_t bytes, std::size_t chunk, segment_type& out) {
    if (limit_ != 0 && physical_bytes_ + bytes > limit_) return false;
    const std::size_t count = bytes / chunk;
    auto handles = std::make_unique<handle_type[]>(count);
    std::size_t created = 0;
    void* base = nullptr;
    std::size_t mapped = 0;
    auto undo = [&]() noexcept {
      for (std::size_t i = mapped; i-- > 0;) unmap(static_cast<char*>(base) + i * chunk, chunk);
      if (base != nullptr) free_range(base, bytes);
      for (std::size_t i = created; i-- > 0;) release(handles[i]);
    };
    try {
      for (; created < count; ++created) {
        ++calls_[driver_call::create];
        auto h = provider_.try_create(chunk);
        if (!h) return undo(), false;
        handles[created] = *h;
      }
      ++calls_[driver_call::reserve];
      base = reserver_.try_reserve(bytes);
      if (base == nullptr) return undo(), false;
      for (; mapped < count; ++mapped) {
        ++calls_[driver_call::map];
        if (!reserver_.try_map(static_cast<char*>(base) + mapped * chunk, chunk, handles[mapped])) {
          return undo(), false;
        }
      }
      ++calls_[driver_call::set_access];
      if (!reserver_.try_set_access(base, bytes)) return undo(), false;
    } catch (...) {
      undo();
      throw;
    }
    physical_bytes_ += bytes;
    out.base = reinterpret_cast<std::uintptr_t>(base);
    out.size = bytes;
    out.chunk = chunk;
    out.handles = std::move(handles);
    return true;
  }

  /// Unmaps, frees and releases everything of a segment made by try_create_segment.
  void destroy_segment(segment_type& segment) noexcept {
    void* base = reinterpret_cast<void*>(segment.base);
    const std::size_t count = segment.chunks();
    for (std::size_t i = 0; i < count; ++i) unmap(static_cast<char*>(base) + i * segment.chunk, segment.chunk);
    free_range(base, segment.size);
    for (std::size_t i = 0; i < count; ++i) release(segment.handles[i]);
    physical_bytes_ -= segment.size;
    segment = segment_type{};
  }

  /// Reserves a fresh range and maps `handles` (each `chunk` bytes) side by side in it: a
  /// stitched range. Null when out of address space or mapping resources; nothing is left behind.
  void* try_map_stitched(std::span<const handle_type> handles, std::size_t chunk) {
    const std::size_t bytes = handles.size() * chunk;
    ++calls_[driver_call::reserve];
    void* base = reserver_.try_reserve(bytes);
    if (base == nullptr) return nullptr;
    std::size_t mapped = 0;
    auto undo = [&]() noexcept {
      for (std::size_t i = mapped; i-- > 0;) unmap(static_cast<char*>(base) + i * chunk, chunk);
      free_range(base, bytes);
    };
    try {
      for (; mapped < handles.size(); ++mapped) {
        ++calls_[driver_call::map];
        if (!reserver_.try_map(static_cast<char*>(base) + mapped * chunk, chunk, handles[mapped])) {
          return undo(), nullptr;
        }
      }
      ++calls_[driver_call::set_access];
      if (!reserver_.try_set_access(base, bytes)) return undo(), nullptr;
    } catch (...) {
      undo();
      throw;
    }
    return base;
  }

  /// Undoes try_map_stitched. The physical memory stays with its segments.
  void unmap_stitched(void* base, std::size_t count, std::size_t chunk) noexcept {
    for (std::size_t i = 0; i < count; ++i) unmap(static_cast<char*>(base) + i * chunk, chunk);
    free_range(base, count * chunk);
  }

 private:
  void unmap(void* at, std::size_t bytes) noexcept {
    ++calls_[driver_call::unmap];
    reserver_.unmap(at, bytes);
  }
  void free_range(void* base, std::size_t bytes) noexcept {
    ++calls_[driver_call::address_free];
    reserver_.free(base, bytes);
  }
  void release(handle_type& handle) noexcept {
    ++calls_[driver_call::release];
    provider_.release(handle);
  }

  Provider provider_;
  Reserver reserver_;
  std::size_t limit_ = 0;
  std::size_t physical_bytes_ = 0;
  driver_call_counts calls_{};
};

}  // namespace glake::detail
