// Types that model one of glake's concepts and nothing more, so that a header can check a class
// template against its concept right after the class without depending on a real backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "glake/backends/concepts.hpp"
#include "glake/memory_state.hpp"
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

/// A state_visitor and nothing more.
struct state_visitor_archetype {
  void segment(const segment_view& s);
  void block(const block_view& b);
  void stitched(const stitched_view& r);
  void piece(const stitched_piece_view& p);
};
static_assert(state_visitor<state_visitor_archetype>);

/// A physical_provider and nothing more.
struct provider_archetype {
  using handle_type = int;
  std::size_t granularity() const noexcept;
  memory_location location() const noexcept;
  std::optional<handle_type> try_create(std::size_t bytes);
  void release(handle_type handle) noexcept;
};

/// An address_reserver for provider_archetype's handles, without events.
struct reserver_archetype {
  using handle_type = int;
  std::size_t granularity() const noexcept;
  void* try_reserve(std::size_t bytes);
  void free(void* at, std::size_t bytes) noexcept;
  bool try_map(void* at, std::size_t bytes, handle_type handle);
  bool try_set_access(void* at, std::size_t bytes);
  void unmap(void* at, std::size_t bytes) noexcept;
};

/// The same with events: a stream_ordered_reserver.
struct evented_reserver_archetype : reserver_archetype {
  struct event_type {};
  event_type record_event(stream_ref stream);
  bool event_done(event_type event);
  void recycle_event(event_type event) noexcept;
  void wait_event(event_type event) noexcept;
  void synchronize_device() noexcept;
};

/// The same whose streams wait for events: a stream_joining_reserver.
struct joining_reserver_archetype : evented_reserver_archetype {
  void stream_wait_event(stream_ref stream, event_type event);
};

/// A copy_backend and nothing more.
struct copy_backend_archetype {
  struct event_type {};
  int device() const noexcept;
  void* try_allocate_staging(std::size_t bytes);
  void free_staging(void* p, std::size_t bytes) noexcept;
  void enqueue_copy(void* to, const void* from, std::size_t bytes, stream_ref stream);
  event_type record_event(stream_ref stream);
  bool event_done(event_type event);
  void wait_event(event_type event) noexcept;
  void recycle_event(event_type event) noexcept;
  void wait_stream(stream_ref stream) noexcept;
};
static_assert(copy_backend<copy_backend_archetype>);

/// A peer_copy_backend and nothing more.
struct peer_copy_backend_archetype : copy_backend_archetype {
  void* try_allocate_device(std::size_t bytes);
  void free_device(void* p, std::size_t bytes) noexcept;
  void enqueue_peer_copy(void* to, int to_device, const void* from, int from_device, std::size_t bytes,
                         stream_ref stream);
  void stream_wait_event(stream_ref stream, event_type event);
};
static_assert(peer_copy_backend<peer_copy_backend_archetype>);

/// A pointer_classifier and nothing more.
struct pointer_classifier_archetype {
  pointer_info locate(const void* p);
};
static_assert(pointer_classifier<pointer_classifier_archetype>);

}  // namespace glake::detail
