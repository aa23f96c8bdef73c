// The two concepts every backend implements: a physical chunk provider and a virtual address
// reserver, shaped by the rules of CUDA's virtual memory management API.
#pragma once

#include <concepts>
#include <cstddef>
#include <optional>
#include <type_traits>
#include <utility>

#include "glake/stream.hpp"

namespace glake {

/// Where the memory a provider creates lives, as a property users can test.
enum class memory_location { host, device, simulated };

namespace detail {
template <class P>
constexpr std::optional<memory_location> static_location_of() {
  if constexpr (requires { std::integral_constant<memory_location, P::location()>{}; }) {
    return P::location();
  } else if constexpr (requires(const P& p) { p.upstream(); }) {
    return static_location_of<std::remove_cvref_t<decltype(std::declval<const P&>().upstream())>>();
  } else {
    return std::nullopt;
  }
}
}  // namespace detail

/// Where P's memory lives when P's type alone says so: its `location()` is a static constexpr
/// member (the host, sim and CUDA providers), or P wraps such a provider and exposes it as
/// `upstream()` (the fault-injecting wrappers). Empty otherwise. Adaptors that must state the
/// memory's kind in a type (cuda::mr's device_accessible / host_accessible) read it.
template <class P>
inline constexpr std::optional<memory_location> static_location_v = detail::static_location_of<P>();

// ---------------------------------------------------------------------------------------------
// physical_provider
//
// Creates and releases physical memory handles. A handle is the unit of mapping: it is always
// mapped whole (cuMemMap refuses an offset into a handle), so stitching moves whole handles.
//
// | expression           | returns                     | throws                   | meaning
// |----------------------|-----------------------------|--------------------------|-----------------------------
// | P::handle_type       |                             |                          | copyable, cheap: names one handle
// | cp.granularity()     | std::size_t (power of two)  | no                       | every handle size is a multiple
// | cp.location()        | memory_location             | no                       | where created memory lives
// | p.try_create(n)      | optional<handle_type>       | driver_error, usage_error| n bytes (a granularity multiple);
// |                      |                             |                          | empty when out of memory
// | p.release(h)         | void                        | no                       | h is gone; it must be unmapped
//
// Smallest model: sim_provider in backends/sim.hpp.
// ---------------------------------------------------------------------------------------------
template <class P>
concept physical_provider =
    std::copyable<typename P::handle_type> &&
    requires(P& p, const P& cp, std::size_t bytes, typename P::handle_type handle) {
      { cp.granularity() } noexcept -> std::same_as<std::size_t>;
      { cp.location() } noexcept -> std::same_as<memory_location>;
      { p.try_create(bytes) } -> std::same_as<std::optional<typename P::handle_type>>;
      { p.release(handle) } noexcept -> std::same_as<void>;
    };

// ---------------------------------------------------------------------------------------------
// capacity_reporting_provider (optional refinement)
//
// | expression       | returns     | throws | meaning
// |------------------|-------------|--------|----------------------------------------------------
// | cp.capacity()    | std::size_t | no     | the most bytes its live handles can ever total
// |                  |             |        | (a device's memory size); 0 when unknown or unlimited
//
// The allocators refuse a request above it at once, before any work proportional to its size
// (planning one handle per chunk of an impossible request, or emptying caches for it).
// ---------------------------------------------------------------------------------------------
template <class P>
concept capacity_reporting_provider = physical_provider<P> && requires(const P& cp) {
  { cp.capacity() } noexcept -> std::same_as<std::size_t>;
};

/// The most bytes `provider` can hold within `most` and a memory `limit` (0: none): the smallest
/// of `most`, the limit and the provider's capacity where it reports one.
template <physical_provider P>
std::size_t capacity_within(const P& provider, std::size_t limit, std::size_t most) noexcept {
  if (limit != 0) most = limit < most ? limit : most;
  if constexpr (capacity_reporting_provider<P>) {
    if (const std::size_t c = provider.capacity(); c != 0 && c < most) most = c;
  }
  return most;
}

// ---------------------------------------------------------------------------------------------
// address_reserver
//
// Reserves virtual address ranges and maps handles into them, following CUDA's rules, which the
// simulated backend enforces so that code tested on it behaves on the GPU:
//   - ranges and mappings are aligned to and sized in multiples of the granularity;
//   - a handle is mapped whole, at any granularity-aligned offset of a reserved range;
//   - memory is accessible only after set_access over a range of whole mappings;
//   - unmap takes exactly one earlier mapping (its address and its handle's size);
//   - a range is freed only when nothing in it is mapped.
// The same handle may be mapped in several places at once (that is what stitching does).
//
// | expression                 | returns        | throws                    | meaning
// |----------------------------|----------------|---------------------------|-------------------------------
// | R::handle_type             |                |                           | the provider handles it maps
// | cr.granularity()           | std::size_t    | no                        | alignment of ranges and mappings
// | r.try_reserve(n)           | void*          | driver_error, usage_error | null when out of address space
// | r.free(p, n)               | void           | no                        | the range [p, p+n) from try_reserve
// | r.try_map(p, n, h)         | bool           | driver_error, usage_error | map h (of n bytes) at p; false
// |                            |                |                           | when out of resources
// | r.try_set_access(p, n)     | bool           | driver_error, usage_error | make [p, p+n) readable and
// |                            |                |                           | writable; false when out of resources
// | r.unmap(p, n)              | void           | no                        | undo the mapping at p of n bytes
//
// Smallest model: sim_reserver in backends/sim.hpp.
// ---------------------------------------------------------------------------------------------
template <class R>
concept address_reserver =
    std::copyable<typename R::handle_type> &&
    requires(R& r, const R& cr, std::size_t bytes, void* at, typename R::handle_type handle) {
      { cr.granularity() } noexcept -> std::same_as<std::size_t>;
      { r.try_reserve(bytes) } -> std::same_as<void*>;
      { r.free(at, bytes) } noexcept -> std::same_as<void>;
      { r.try_map(at, bytes, handle) } -> std::same_as<bool>;
      { r.try_set_access(at, bytes) } -> std::same_as<bool>;
      { r.unmap(at, bytes) } noexcept -> std::same_as<void>;
    };

// ---------------------------------------------------------------------------------------------
// stream_ordered_reserver (optional refinement)
//
// A reserver whose memory is used by asynchronous work queued on streams (CUDA) also offers
// events, so the allocator never unmaps or releases memory that queued work may still read.
// Backends without asynchronous work (host, sim) do not model it, and the allocators then need
// no events at all.
//
// | expression            | returns       | throws        | meaning
// |-----------------------|---------------|---------------|------------------------------------
// | R::event_type         |               |               | copyable, names one recorded event
// | r.record_event(s)     | event_type    | driver_error  | marks everything queued on s so far
// | r.event_done(e)       | bool          | driver_error  | that work has completed
// | r.recycle_event(e)    | void          | no            | e goes back to a pool
// | r.wait_event(e)       | void          | no            | returns when that work has completed
// | r.synchronize_device()| void          | no            | returns when all queued work completed
//
// Streams may be destroyed by their users at any time, so an allocator never keeps a stream to
// wait on later: it records events (valid after their stream is gone) or waits for the device.
// ---------------------------------------------------------------------------------------------
template <class R>
concept stream_ordered_reserver =
    address_reserver<R> && std::copyable<typename R::event_type> &&
    requires(R& r, stream_ref stream, typename R::event_type event) {
      { r.record_event(stream) } -> std::same_as<typename R::event_type>;
      { r.event_done(event) } -> std::same_as<bool>;
      { r.recycle_event(event) } noexcept;
      { r.wait_event(event) } noexcept;
      { r.synchronize_device() } noexcept;
    };

// ---------------------------------------------------------------------------------------------
// stream_joining_reserver (refines stream_ordered_reserver)
//
// A reserver whose streams can wait for each other's events without the host waiting: a mover
// queues its copies on a stream of their own, after the work queued on the stream that used the
// memory, so that the copies run beside later work instead of in line with it.
//
// | expression                | returns | throws       | meaning
// |---------------------------|---------|--------------|---------------------------------------
// | r.stream_wait_event(s, e) | void    | driver_error | work queued on s from now on starts
// |                           |         |              | once e's work has completed; e may be
// |                           |         |              | recycled right after
//
// Models: cuda_reserver (cuStreamWaitEvent).
// ---------------------------------------------------------------------------------------------
template <class R>
concept stream_joining_reserver =
    stream_ordered_reserver<R> && requires(R& r, stream_ref stream, typename R::event_type event) {
      { r.stream_wait_event(stream, event) } -> std::same_as<void>;
    };

// ---------------------------------------------------------------------------------------------
// capture_aware_reserver (optional refinement)
//
// A reserver whose streams may be capturing work into a graph (CUDA stream capture) says so.
// Work queued on a capturing stream is recorded, not run, and waiting for it is not allowed; a
// mover that remaps memory now and queues copies on a stream must refuse such a stream instead
// of recording its copies into someone's graph.
//
// | expression            | returns | throws       | meaning
// |-----------------------|---------|--------------|-------------------------------------------
// | r.is_capturing(s)     | bool    | driver_error | work queued on s now is being captured
//
// Models: cuda_reserver (cuStreamIsCapturing), sim_reserver (sim_device::begin_capture).
// ---------------------------------------------------------------------------------------------
template <class R>
concept capture_aware_reserver = address_reserver<R> && requires(const R& r, stream_ref stream) {
  { r.is_capturing(stream) } -> std::same_as<bool>;
};

// ---------------------------------------------------------------------------------------------
// byte_copier
//
// Copies bytes between two accessible mapped ranges of one backend, ordered on a stream: the
// mover that takes memory from one handle to another (offload to far memory and back). A
// backend without asynchronous work copies at once; a CUDA copier queues the copy after the
// work already queued on the stream, and whoever must know it completed records an event there
// (stream_ordered_reserver) after it.
//
// | expression            | returns | throws                    | meaning
// |-----------------------|---------|---------------------------|--------------------------------
// | c.copy(d, s, n, st)   | void    | driver_error, usage_error | n bytes from s to d, ordered on
// |                       |         |                           | stream st; the ranges are mapped,
// |                       |         |                           | accessible and do not overlap
// | C::synchronous        | bool    | (constexpr)               | the copy is done when copy returns
//
// A copier that is not synchronous must be used with a stream_ordered_reserver, whose events
// tell when a copy is done (users check it with copier_fits_reserver).
// Smallest model: host_copier in backends/host.hpp (memcpy).
// ---------------------------------------------------------------------------------------------
template <class C>
concept byte_copier = requires(C& c, void* to, const void* from, std::size_t bytes, stream_ref stream) {
  { c.copy(to, from, bytes, stream) } -> std::same_as<void>;
  { std::bool_constant<C::synchronous>{} };
};

/// Whether something that copies with C and unmaps with R can know when a copy is done: C copies
/// synchronously, or R has events.
template <class C, class R>
concept copier_fits_reserver = byte_copier<C> && (C::synchronous || stream_ordered_reserver<R>);

// ---------------------------------------------------------------------------------------------
// copy_backend
//
// What a copy engine needs from a device to move bytes between host and device memory through
// pinned staging buffers: page-locked host memory, copies queued on a stream, and events that
// say when the copies queued so far have completed. Streams order everything: a copy runs after
// the work queued before it on its stream. A copy between staging memory and device memory
// reads and writes only when the stream reaches it, so the staging buffer must stay untouched
// until an event recorded after the copy has completed.
//
// | expression                  | returns      | throws        | meaning
// |-----------------------------|--------------|---------------|-----------------------------------
// | cb.device()                 | int          | no            | the device whose memory it copies
// | b.try_allocate_staging(n)   | void*        | driver_error  | n bytes of pinned host memory, the
// |                             |              |               | source or target of fast copies;
// |                             |              |               | null when out of memory
// | b.free_staging(p, n)        | void         | no            | p, n from try_allocate_staging
// | b.enqueue_copy(d, s, n, st) | void         | driver_error  | queues n bytes from s to d on
// |                             |              |               | stream st, after its earlier work
// | B::event_type               |              |               | copyable, names one recorded event
// | b.record_event(st)          | event_type   | driver_error  | marks everything queued on st so far
// | b.event_done(e)             | bool         | driver_error  | that work has completed
// | b.wait_event(e)             | void         | no            | returns when that work has completed
// | b.recycle_event(e)          | void         | no            | e goes back to a pool
// | b.wait_stream(st)           | void         | no            | returns when all work queued on st
// |                             |              |               | has completed (the fallback when an
// |                             |              |               | event cannot be recorded)
//
// Smallest model: host_dma_backend in backends/host_dma.hpp (streams are host threads). CUDA
// model: cuda_copy_backend in backends/cuda_copy.hpp.
// ---------------------------------------------------------------------------------------------
template <class B>
concept copy_backend =
    std::copyable<typename B::event_type> &&
    requires(B& b, const B& cb, void* to, const void* from, std::size_t bytes, stream_ref stream,
             typename B::event_type event) {
      { cb.device() } noexcept -> std::same_as<int>;
      { b.try_allocate_staging(bytes) } -> std::same_as<void*>;
      { b.free_staging(to, bytes) } noexcept -> std::same_as<void>;
      { b.enqueue_copy(to, from, bytes, stream) } -> std::same_as<void>;
      { b.record_event(stream) } -> std::same_as<typename B::event_type>;
      { b.event_done(event) } -> std::same_as<bool>;
      { b.wait_event(event) } noexcept -> std::same_as<void>;
      { b.recycle_event(event) } noexcept -> std::same_as<void>;
      { b.wait_stream(stream) } noexcept -> std::same_as<void>;
    };

// ---------------------------------------------------------------------------------------------
// peer_copy_backend (optional refinement of copy_backend)
//
// What a multi-path copy needs besides: scratch memory on a peer device that a share passes
// through, copies between two devices' memory, and a stream that waits for an event recorded on
// another device's stream. Events and streams of the backends of one process's devices mix: an
// event recorded by the backend of device a may be waited for by the backend of device b.
//
// | expression                         | returns | throws       | meaning
// |------------------------------------|---------|--------------|------------------------------------
// | b.try_allocate_device(n)           | void*   | driver_error | n bytes of b.device()'s memory;
// |                                    |         |              | null when out of memory
// | b.free_device(p, n)                | void    | no           | p, n from try_allocate_device; no
// |                                    |         |              | queued work may still use it
// | b.enqueue_peer_copy(d, dd, s, sd, n, st) | void | driver_error | queues n bytes from s (memory of
// |                                    |         |              | device sd) to d (of device dd) on
// |                                    |         |              | stream st of b.device()
// | b.stream_wait_event(st, e)         | void    | driver_error | work queued on st from now on runs
// |                                    |         |              | after the work e marks; e may be
// |                                    |         |              | recycled right after the call
//
// Smallest model: host_dma_backend in backends/host_dma.hpp (on_device(k) gives the backend of
// simulated device k). CUDA model: cuda_copy_backend in backends/cuda_copy.hpp.
// ---------------------------------------------------------------------------------------------
template <class B>
concept peer_copy_backend =
    copy_backend<B> && requires(B& b, void* to, const void* from, int device, std::size_t bytes, stream_ref stream,
                                typename B::event_type event) {
      { b.try_allocate_device(bytes) } -> std::same_as<void*>;
      { b.free_device(to, bytes) } noexcept -> std::same_as<void>;
      { b.enqueue_peer_copy(to, device, from, device, bytes, stream) } -> std::same_as<void>;
      { b.stream_wait_event(stream, event) } -> std::same_as<void>;
    };

/// What a pointer points at, as a copy engine needs to know it.
enum class memory_kind : unsigned char {
  pageable,  ///< ordinary host memory: the device cannot read it directly
  pinned,    ///< page-locked host memory (allocated pinned or registered): copies go straight
  device,    ///< one device's memory
  managed,   ///< memory the driver migrates between host and devices on demand
};

constexpr const char* to_string(memory_kind k) noexcept {
  switch (k) {
    case memory_kind::pageable: return "pageable host memory";
    case memory_kind::pinned: return "pinned host memory";
    case memory_kind::device: return "device memory";
    case memory_kind::managed: return "managed memory";
  }
  return "?";
}

/// A pointer's kind and, for device memory, its device (-1 otherwise).
struct pointer_info {
  memory_kind kind = memory_kind::pageable;
  int device = -1;
  friend constexpr bool operator==(pointer_info, pointer_info) noexcept = default;
};

// ---------------------------------------------------------------------------------------------
// pointer_classifier
//
// Tells which kind of memory an address lies in, so a copy engine sends pinned memory straight
// to the device and stages pageable memory. An address no allocation of the driver's knows is
// pageable host memory.
//
// | expression     | returns      | throws       | meaning
// |----------------|--------------|--------------|--------------------------------------------
// | c.locate(p)    | pointer_info | driver_error | the kind of memory byte p lies in
//
// Smallest model: range_classifier in backends/host_dma.hpp (ranges a test names). CUDA model:
// cuda_pointer_classifier in backends/cuda_copy.hpp (cuPointerGetAttributes).
// ---------------------------------------------------------------------------------------------
template <class C>
concept pointer_classifier = requires(C& c, const void* p) {
  { c.locate(p) } -> std::same_as<pointer_info>;
};

/// A reserver that maps the handles a given provider creates.
template <class R, class P>
concept address_reserver_for = physical_provider<P> && address_reserver<R> &&
                               std::same_as<typename R::handle_type, typename P::handle_type>;

}  // namespace glake
