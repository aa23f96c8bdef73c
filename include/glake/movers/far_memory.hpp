// Far memory for an allocator's offloads: a provider of handles the device reaches over the bus
// (host memory) and the copier that moves bytes to and from them, behind one interface, so that
// the allocator's type does not name them.
#pragma once

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
};

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
template <physical_provider Host, byte_copier Copier>
class far_memory_of final : public far_memory<typename Host::handle_type> {
 public:
  using handle_type = typename Host::handle_type;

  far_memory_of(Host host, Copier copier) : host_(std::move(host)), copier_(std::move(copier)) {}
  far_memory_of(const far_memory_of&) = delete;
  far_memory_of& operator=(const far_memory_of&) = delete;
  ~far_memory_of() override { trim(); }

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
    if (h) live_.push_back(sized{*h, bytes});
    return h;
  }
  void release(handle_type handle) noexcept override {
    for (auto it = live_.rbegin(); it != live_.rend(); ++it) {
      if (!(it->handle == handle)) continue;
      kept_.push_back(*it);  // room reserved by try_create
      kept_bytes_ += it->bytes;
      live_.erase(std::next(it).base());
      return;
    }
    host_.release(handle);  // not one this made: nothing to keep
  }
  void copy(void* to, const void* from, std::size_t bytes, stream_ref stream) override {
    copier_.copy(to, from, bytes, stream);
  }
  bool synchronous() const noexcept override { return Copier::synchronous; }
  std::size_t trim() noexcept override {
    const std::size_t bytes = kept_bytes_;
    for (const sized& h : kept_) host_.release(h.handle);
    kept_.clear();
    kept_bytes_ = 0;
    return bytes;
  }
  /// Bytes of the handles kept for reuse.
  std::size_t kept_bytes() const noexcept { return kept_bytes_; }

  Host& host() noexcept { return host_; }

 private:
  Host host_;
  Copier copier_;
  struct sized {
    handle_type handle;
    std::size_t bytes;
  };
  // Handles know no order, only equality: plain vectors, searched linearly (few far handles
  // are live at once: one per piece of each offloaded allocation). kept_ has room for every
  // live handle, so release never allocates.
  std::vector<sized> live_;  // handed out by try_create, not released yet
  std::vector<sized> kept_;  // released, kept for reuse
  std::size_t kept_bytes_ = 0;
};

}  // namespace glake
