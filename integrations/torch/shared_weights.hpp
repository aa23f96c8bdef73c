// The plug-in's shared weights: regions of device memory that are the mappings' own (no
// allocator keeps their handles), published to a dedup broker so that processes loading the
// same weights keep one copy of them (docs/dedup.md).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "glake/errors.hpp"
#include "glake/sharing/dedup_client.hpp"

namespace glake::torch_plugin {

// ---------------------------------------------------------------------------------------------
// region_maker
//
// Makes and unmakes regions whose every piece of `granularity()` bytes is mapped on a handle of
// its own that nothing but the mapping holds, so that a dedup client replacing a piece's mapping
// (shareable_backend::map_readonly) gives the piece's memory back.
//
// | expression            | returns     | throws        | meaning
// |-----------------------|-------------|---------------|----------------------------------------
// | m.granularity()       | std::size_t | no            | regions are sized in multiples of it
// | m.make(n, device)     | void*       | out_of_memory,| n bytes (a multiple of the granularity),
// |                       |             | driver_error  | writable, on the device
// | m.unmake(p, n)        | void        | no            | unmaps and frees what make returned
// | cm.backend(device)    | a shareable | driver_error  | the dedup client's backend for the
// |                       | backend     |               | device's regions
// | cm.broker_arguments(  | std::vector | bad_alloc     | what a broker started for these regions
// |   device)             | <string>    |               | needs besides --socket (glake-dedup-cuda:
// |                       |             |               | --device N)
// ---------------------------------------------------------------------------------------------
template <class M>
concept region_maker = requires(M& m, const M& cm, void* p, std::size_t n, int device) {
  { cm.granularity() } noexcept -> std::same_as<std::size_t>;
  { m.make(n, device) } -> std::same_as<void*>;
  { m.unmake(p, n) } noexcept -> std::same_as<void>;
  { cm.backend(device) } -> shareable_backend;
  { cm.broker_arguments(device) } -> std::same_as<std::vector<std::string>>;
};

/// What glake_share reports of one region, as dedup_client's publish_result says it.
struct share_totals {
  std::uint64_t pieces = 0;
  std::uint64_t shared = 0;
  std::uint64_t stored = 0;
  std::uint64_t kept_private = 0;
  std::uint64_t shared_bytes = 0;
};

// ---------------------------------------------------------------------------------------------
// shared_weights_registry
//
// Regions made by a Maker, kept by their first address; publish hands one whole region to the
// dedup client of a socket (one client per socket path and device, kept for the life of the registry: a
// piece's references at the broker live as long as its connection). destroy gives a published
// region's references up before unmaking it. Every call runs under one mutex; a publish holds it
// for its round trips (one per piece). Errors: usage_error for a pointer that starts no region,
// a region published twice, an empty socket path; out_of_memory / driver_error from the maker.
// A broker that cannot be reached, or that refuses pieces, is not an error: the pieces stay
// private and the totals say so (kept_private), with a line on stderr giving the first reason.
// ---------------------------------------------------------------------------------------------
template <region_maker Maker, content_hasher Hasher>
class shared_weights_registry {
 public:
  using backend_type = decltype(std::declval<const Maker&>().backend(0));
  using client_type = dedup_client<backend_type, Hasher>;

  explicit shared_weights_registry(Maker maker = Maker()) : maker_(std::move(maker)) {}
  shared_weights_registry(const shared_weights_registry&) = delete;
  shared_weights_registry& operator=(const shared_weights_registry&) = delete;
  ~shared_weights_registry() {
    for (auto& [start, r] : regions_) {
      if (r.client != nullptr) r.client->release(reinterpret_cast<void*>(start), r.bytes);
      maker_.unmake(reinterpret_cast<void*>(start), r.bytes);
    }
  }

  /// A region of at least `bytes` (rounded up to the granularity) on `device`.
  void* create(std::size_t bytes, int device) {
    if (bytes == 0) throw usage_error(usage_error::kind::bad_argument, "a shared region of 0 bytes");
    const std::size_t g = maker_.granularity();
    const std::size_t rounded = (bytes + g - 1) / g * g;
    std::lock_guard lock(mutex_);
    void* p = maker_.make(rounded, device);
    try {
      regions_.emplace(reinterpret_cast<std::uintptr_t>(p), region{rounded, device, nullptr});
    } catch (...) {
      maker_.unmake(p, rounded);
      throw;
    }
    return p;
  }

  /// The device of the region starting at p (-1: none does).
  int device_of(const void* p) const {
    std::lock_guard lock(mutex_);
    auto it = regions_.find(reinterpret_cast<std::uintptr_t>(p));
    return it == regions_.end() ? -1 : it->second.device;
  }

  /// Publishes the whole region starting at p with the broker at `socket` (starting
  /// `start_broker` there when none listens and it is not empty). The region is read-only
  /// afterwards, whatever the broker did with each piece.
  share_totals publish(void* p, const std::string& socket, const std::string& start_broker = {}) {
    if (socket.empty()) throw usage_error(usage_error::kind::bad_argument, "glake_share: no socket path");
    std::lock_guard lock(mutex_);
    region& r = find("glake_share", p);
    if (r.client != nullptr) {
      throw usage_error(usage_error::kind::bad_state, "glake_share: the region is published already");
    }
    client_type& c = client_for(socket, r.device, start_broker);
    const publish_result got = c.publish(p, r.bytes);
    r.client = &c;
    if (got.kept_private != 0 && !got.reason.empty()) {
      std::fprintf(stderr, "glake_share: %zu of %zu pieces kept private: %s\n", got.kept_private, got.pieces,
                   got.reason.c_str());
    }
    return share_totals{got.pieces, got.shared, got.stored, got.kept_private, got.shared_bytes};
  }

  /// Unmakes the region starting at p, giving up its references first. Work using it must have
  /// completed.
  void destroy(void* p) {
    std::lock_guard lock(mutex_);
    auto it = regions_.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == regions_.end()) {
      throw usage_error(usage_error::kind::foreign_pointer, "glake_shared_destroy: it starts no shared region");
    }
    if (it->second.client != nullptr) it->second.client->release(p, it->second.bytes);
    maker_.unmake(p, it->second.bytes);
    regions_.erase(it);
  }

 private:
  struct region {
    std::size_t bytes = 0;
    int device = 0;
    client_type* client = nullptr;  ///< the client it was published with; null while private
  };

  region& find(const char* who, const void* p) {
    auto it = regions_.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == regions_.end()) {
      throw usage_error(usage_error::kind::foreign_pointer, std::string(who) + ": it starts no shared region");
    }
    return it->second;
  }

  // One client per socket and device (its backend maps on that device).
  client_type& client_for(const std::string& socket, int device, const std::string& start_broker) {
    const auto key = std::make_pair(socket, device);
    auto it = clients_.find(key);
    if (it == clients_.end()) {
      dedup_client_options options;
      options.chunk_bytes = maker_.granularity();
      options.start_broker = start_broker;
      options.start_arguments = maker_.broker_arguments(device);
      it = clients_.emplace(key, std::make_unique<client_type>(socket, std::move(options), maker_.backend(device))).first;
    }
    return *it->second;
  }

  Maker maker_;
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, region> regions_;
  std::map<std::pair<std::string, int>, std::unique_ptr<client_type>> clients_;
};

}  // namespace glake::torch_plugin
