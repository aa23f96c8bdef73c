// Far memory for an allocator's offloads: a provider of handles the device reaches over the bus
// (host memory) and the copier that moves bytes to and from them, behind one interface, so that
// the allocator's type does not name them.
#pragma once

#include <concepts>
#include <cstddef>
#include <iterator>
#include <optional>
#include <utility>
#include <vector>

#include "glake/backends/concepts.hpp"
#include "glake/stream.hpp"

namespace glake {

// ---------------------------------------------------------------------------------------------
// far_memory<Handle>
//
// What an allocator asks of the tier its allocations are offloaded to. The handles are of the
// same type as the allocator's own, so one reserver maps both (CUDA: host-NUMA and device
// handles are both CUmemGenericAllocationHandle).
//
// | expression              | returns                | throws       | meaning
// |-------------------------|------------------------|--------------|------------------------------
// | f.granularity()         | size_t                 | no           | handles come in multiples of it
// | f.try_create(n)         | optional<Handle>       | driver_error | n bytes of far memory; empty
// |                         |                        |              | when it ran out
// | f.release(h)            | void                   | no           | gives h back
// | f.copy(d, s, n, st)     | void                   | driver_error | n bytes from s to d (mapped,
// |                         |                        |              | accessible), ordered on st
// | f.synchronous()         | bool                   | no           | a copy is done when it returns
// | f.trim()                | size_t                 | no           | gives back the handles kept
// |                         |                        |              | for reuse; returns their bytes
// | f.home_of(h)            | void*                  | no           | where a handle it made is
// |                         |                        |              | mapped and accessible for
// |                         |                        |              | copies, or null (none)
//
// Model: far_memory_of<Host, Copier> over a physical_provider and a byte_copier.
// Thread safety: as the provider and copier; the allocator calls it under its lock.
// ---------------------------------------------------------------------------------------------
template <class Handle>
class far_memory {
 public:
  virtual ~far_memory() = default;
  virtual std::size_t granularity() const noexcept = 0;
  virtual std::optional<Handle> try_create(std::size_t bytes) = 0;
  virtual void release(Handle handle) noexcept = 0;
  virtual void copy(void* to, const void* from, std::size_t bytes, stream_ref stream) = 0;
  virtual bool synchronous() const noexcept = 0;
  virtual std::size_t trim() noexcept = 0;
  virtual void* home_of(const Handle& handle) const noexcept = 0;
};

/// Where an allocator keeps the memory it moved to far memory, while it is there.
enum class far_residence : unsigned char {
  /// Mapped at the allocation's own addresses: device code reads and writes it there, over the
  /// bus. Each move remaps them, and sets access over far memory (over host memory, 12-15 us a
  /// MiB on an H100).
  mapped,
  /// Not mapped at the allocation's addresses: a use before prefetch faults. For callers that
  /// bring memory back before every use (a workload_scheduler with every use declared). Far
  /// handles keep a mapping of their own for copies, so a move makes no mapping of far memory
  /// and sets no access over it: an offload is a copy, an unmap and a release; a prefetch a
  /// create, a map, an access and a copy.
  unmapped,
};

/// far_memory_of's mapper when its handles get no home mapping.
struct no_far_homes {};

/// far_memory over a provider of far handles (cuda_host_provider, sim_host_provider, a second
/// host_provider) and the copier between them and the device's (cuda_copier, sim_copier,
/// host_copier).
///
/// Released handles are kept for reuse by a later try_create of the same size: making far
/// memory is slow where it pins host memory (cuMemCreate of host-NUMA memory runs at about
/// 5 GB/s on an H200, a tenth of the bus), and an allocation moved out and back every
/// iteration would pay that each time. What is kept is at most what was offloaded at once
/// before; trim() gives it back (the allocator's release_cached does), and so does a
/// try_create the provider cannot serve, before trying again. Their contents are stale, which
/// is all an offload needs (it copies over them). try_create and release are O(live + kept
/// handles); release never allocates.
///
/// With a `Mapper` (an address_reserver for Host's handles), each handle made is also mapped,
/// accessible, in an address range of its own, its *home*, for as long as it exists (kept
/// handles too): an offload copies straight into it (home_of) instead of mapping the handle in a
/// temporary range each time, which over host memory costs a cuMemSetAccess of 12-15 us per MiB
/// (docs/offload.md). A handle whose home cannot be made (no address range or mapping left) has
/// none; home_of says so and the caller maps it itself. Mapping costs are not counted in the
/// allocator's driver statistics.
template <physical_provider Host, byte_copier Copier, class Mapper = no_far_homes>
class far_memory_of final : public far_memory<typename Host::handle_type> {
  static constexpr bool homes = !std::same_as<Mapper, no_far_homes>;

 public:
  using handle_type = typename Host::handle_type;

  far_memory_of(Host host, Copier copier, Mapper mapper = Mapper())
    requires(!homes || address_reserver_for<Mapper, Host>)
      : host_(std::move(host)), copier_(std::move(copier)), mapper_(std::move(mapper)) {}
  far_memory_of(const far_memory_of&) = delete;
  far_memory_of& operator=(const far_memory_of&) = delete;
  ~far_memory_of() override {
    trim();
    for (sized& h : live_) unmap_home(h);  // leaked by the caller: at least no mapping stays
  }

  std::size_t granularity() const noexcept override { return host_.granularity(); }
  std::optional<handle_type> try_create(std::size_t bytes) override {
    for (auto it = kept_.begin(); it != kept_.end(); ++it) {
      if (it->bytes != bytes) continue;
      const sized h = *it;
      live_.push_back(h);  // no allocation: room was reserved when it was made
      kept_.erase(it);
      kept_bytes_ -= bytes;
      return h.handle;
    }
    // Room for the record first, so that nothing after the handle exists can fail.
    live_.reserve(live_.size() + 1);
    kept_.reserve(kept_.size() + live_.size() + 1);
    std::optional<handle_type> h = host_.try_create(bytes);
    if (!h && !kept_.empty()) {
      trim();
      h = host_.try_create(bytes);
    }
    if (h) live_.push_back(sized{*h, bytes, map_home(*h, bytes)});
    return h;
  }
  void* home_of(const handle_type& handle) const noexcept override {
    for (auto it = live_.rbegin(); it != live_.rend(); ++it) {
      if (it->handle == handle) return it->home;
    }
    return nullptr;
  }
  void release(handle_type handle) noexcept override {
    for (auto it = live_.rbegin(); it != live_.rend(); ++it) {
      if (!(it->handle == handle)) continue;
      kept_.push_back(*it);  // room reserved by try_create
      kept_bytes_ += it->bytes;
      live_.erase(std::next(it).base());
      return;
    }
    host_.release(handle);  // not one this made: nothing to keep, no home
  }
  void copy(void* to, const void* from, std::size_t bytes, stream_ref stream) override {
    copier_.copy(to, from, bytes, stream);
  }
  bool synchronous() const noexcept override { return Copier::synchronous; }
  std::size_t trim() noexcept override {
    const std::size_t bytes = kept_bytes_;
    for (sized& h : kept_) {
      unmap_home(h);
      host_.release(h.handle);
    }
    kept_.clear();
    kept_bytes_ = 0;
    return bytes;
  }
  /// Bytes of the handles kept for reuse.
  std::size_t kept_bytes() const noexcept { return kept_bytes_; }

  Host& host() noexcept { return host_; }

 private:
  struct sized {
    handle_type handle;
    std::size_t bytes;
    void* home = nullptr;
  };

  // A home for a new handle, or null where none can be had.
  void* map_home([[maybe_unused]] const handle_type& handle, [[maybe_unused]] std::size_t bytes) noexcept {
    if constexpr (homes) {
      // A driver error at any step counts as "no home": what was done is undone.
      void* at = nullptr;
      try {
        at = mapper_.try_reserve(bytes);
      } catch (...) {
      }
      if (at == nullptr) return nullptr;
      bool mapped = false;
      try {
        mapped = mapper_.try_map(at, bytes, handle);
      } catch (...) {
      }
      if (!mapped) {
        mapper_.free(at, bytes);
        return nullptr;
      }
      bool accessible = false;
      try {
        accessible = mapper_.try_set_access(at, bytes);
      } catch (...) {
      }
      if (!accessible) {
        mapper_.unmap(at, bytes);
        mapper_.free(at, bytes);
        return nullptr;
      }
      return at;
    } else {
      return nullptr;
    }
  }
  void unmap_home([[maybe_unused]] sized& h) noexcept {
    if constexpr (homes) {
      if (h.home == nullptr) return;
      mapper_.unmap(h.home, h.bytes);
      mapper_.free(h.home, h.bytes);
      h.home = nullptr;
    }
  }

  Host host_;
  Copier copier_;
  [[no_unique_address]] Mapper mapper_;
  // Handles know no order, only equality: plain vectors, searched linearly (few far handles
  // are live at once: one per piece of each offloaded allocation). kept_ has room for every
  // live handle, so release never allocates.
  std::vector<sized> live_;  // handed out by try_create, not released yet
  std::vector<sized> kept_;  // released, kept for reuse
  std::size_t kept_bytes_ = 0;
};

}  // namespace glake
