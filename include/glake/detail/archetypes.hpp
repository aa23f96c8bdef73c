// Types that model one of glake's concepts and nothing more, so that a header can check a class
// template against its concept right after the class without depending on a real backend.
#pragma once

#include <cstddef>
#include <cstdint>

#include "glake/statistics.hpp"
#include "glake/stream.hpp"

namespace glake::detail {

// The members are declared and never defined: these types exist for static_asserts only, and a
// call to one fails to link.

/// A segment_source and nothing more.
struct segment_source_archetype {
  struct lease_type {
    std::uintptr_t base = 0;
    std::size_t size = 0;
  };
  std::size_t granularity() const noexcept;
  bool try_acquire(std::size_t bytes, stream_ref stream, lease_type& out);
  void release(lease_type& lease) noexcept;
};

/// An allocator with none of the optional capabilities.
struct allocator_archetype {
  void* allocate(std::size_t bytes, stream_ref stream);
  void* try_allocate(std::size_t bytes, stream_ref stream);
  void deallocate(void* p, std::size_t bytes, stream_ref stream);
  statistics stats() const;
  std::size_t reserved_bytes() const;
  std::size_t alignment() const noexcept;
  void verify() const;
};

/// An allocator with every optional capability.
struct full_allocator_archetype : allocator_archetype {
  bool owns(const void* p) const;
  void release_cached();
  statistics reset_peaks();
  void record_stream(void* p, stream_ref stream);
};

}  // namespace glake::detail
