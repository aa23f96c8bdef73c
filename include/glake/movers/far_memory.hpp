// Far memory for an allocator's offloads: a provider of handles the device reaches over the bus
// (host memory) and the copier that moves bytes to and from them, behind one interface, so that
// the allocator's type does not name them.
#pragma once

#include <cstddef>
#include <optional>
#include <utility>

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
};

/// far_memory over a provider of far handles (cuda_host_provider, sim_host_provider, a second
/// host_provider) and the copier between them and the device's (cuda_copier, sim_copier,
/// host_copier).
template <physical_provider Host, byte_copier Copier>
class far_memory_of final : public far_memory<typename Host::handle_type> {
 public:
  using handle_type = typename Host::handle_type;

  far_memory_of(Host host, Copier copier) : host_(std::move(host)), copier_(std::move(copier)) {}

  std::size_t granularity() const noexcept override { return host_.granularity(); }
  std::optional<handle_type> try_create(std::size_t bytes) override { return host_.try_create(bytes); }
  void release(handle_type handle) noexcept override { host_.release(handle); }
  void copy(void* to, const void* from, std::size_t bytes, stream_ref stream) override {
    copier_.copy(to, from, bytes, stream);
  }
  bool synchronous() const noexcept override { return Copier::synchronous; }

  Host& host() noexcept { return host_; }

 private:
  Host host_;
  Copier copier_;
};

}  // namespace glake
