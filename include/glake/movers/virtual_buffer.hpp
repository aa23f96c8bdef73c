// A reserved address range whose physical memory is committed, decommitted, and moved between
// the device and the host in pieces, while every address in it stays the same.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "glake/backends/concepts.hpp"
#include "glake/config.hpp"
#include "glake/errors.hpp"
#include "glake/movers/concepts.hpp"
#include "glake/stream.hpp"

namespace glake {

namespace detail {
/// The event type of a reserver that has events; an empty stand-in otherwise.
template <class Reserver, bool = stream_ordered_reserver<Reserver>>
struct buffer_event {
  struct type {};
};
template <class Reserver>
struct buffer_event<Reserver, true> {
  using type = typename Reserver::event_type;
};
}  // namespace detail

/// A virtual_buffer's accounting.
struct virtual_buffer_statistics {
  std::size_t capacity_bytes = 0;     ///< addresses reserved
  std::size_t device_bytes = 0;       ///< pieces on the device
  std::size_t host_bytes = 0;         ///< pieces offloaded to the host
  std::size_t cached_host_bytes = 0;  ///< host memory kept for the next offload, holding no data
  std::uint64_t offloads = 0;         ///< offload calls that moved something
  std::uint64_t prefetches = 0;
  std::uint64_t offloaded_bytes = 0;  ///< moved to the host, in all
  std::uint64_t prefetched_bytes = 0;
  std::uint64_t host_handles_created = 0;  ///< host handles made (each pins its pages once)
};

// ---------------------------------------------------------------------------------------------
// virtual_buffer
//
// One reserved range cut into pieces of `piece` bytes (the last may be shorter; every piece a
// multiple of both providers' granularities). Each piece is one physical handle of the Device
// provider or of the Host provider mapped at the piece's own addresses, or nothing. commit maps
// new device handles, decommit gives them back; offload copies a piece into a host handle and
// maps that handle in place of the device one, which goes back to the provider at once; prefetch
// is the reverse. Pointers into the buffer never change: device code reads an offloaded piece
// from host memory over the bus.
//
// A host handle is mapped, once, in an address range of its own (its "home") besides the
// piece it backs: copies go between a piece's addresses and the home, so neither side needs a
// temporary mapping. Host handles freed by a prefetch or decommit stay cached, mapped at home,
// for the next offload (creating one pins its pages, which costs milliseconds on a GPU);
// release_cached gives them back.
//
// Offload waits for the work queued before it, maps each piece's device handle a second time in
// a shadow range (kept until the handle goes), queues every piece's copy from the shadow to the
// home, and meanwhile remaps the pieces' own addresses to the host handles: the copies and the
// remapping (whose cuMemSetAccess over host memory costs about as much per byte as the copy on
// an H200) overlap instead of adding up. Work queued on the stream afterwards comes after the
// copies; the device handles go back as their copies complete, before offload returns.
// Prefetch waits for the work queued on its stream, then maps a new device handle in place of
// each piece and queues its copy from the home at once, and returns: work queued on the stream
// afterwards sees the data; the host handles return to the cache once the copies are done.
//
// Each call is all-or-nothing (tiered_memory): a failure to get memory throws out_of_memory, a
// driver failure its error, after every piece is put back as it was with its data (the device
// handles an offload replaces are released only once every piece is remapped). Should putting a
// mapping back fail in turn, the call throws driver_error saying so; that piece's data stays in
// its handle, which the buffer keeps.
//
// Streams: every move is ordered on the stream it is given; memory is unmapped only after the
// work queued on that stream, and on every stream given to record_stream, has completed (events,
// where the Reserver has them; host and simulated backends have no queued work). Work queued on
// other streams must be ordered by the caller (an event wait), as for any asynchronous copy.
// Graphs: a move on a stream that is capturing a graph (that stream or a recorded one) is a
// usage_error before anything changes, where the Reserver can tell (capture_aware_reserver). A
// graph captured earlier may be replayed over moved memory, since its addresses stay valid (it
// reads an offloaded piece over the bus); a replay on a stream neither given nor recorded is
// ordered by the caller, as above.
// Complexity: O(pieces of the range) driver calls per call, plus O(cached host handles) to find
// one of a piece's size. Thread safety: none; one owner calls it (or locks around it).
// ---------------------------------------------------------------------------------------------
template <physical_provider Device, physical_provider Host, class Reserver, byte_copier Copier>
  requires address_reserver_for<Reserver, Device> && address_reserver_for<Reserver, Host> &&
           copier_fits_reserver<Copier, Reserver>
class virtual_buffer {
  static constexpr bool has_events = stream_ordered_reserver<Reserver>;
  using device_handle = typename Device::handle_type;
  using host_handle_type = typename Host::handle_type;

  /// A host handle mapped at its home range.
  struct host_slot {
    host_handle_type handle{};
    void* home = nullptr;
    std::size_t size = 0;
  };
  struct piece_state {
    residence where = residence::none;
    bool shadowed = false;  ///< its device handle is also mapped at shadow(i)
    device_handle device{};
    host_slot host{};
  };
  using event_type = typename detail::buffer_event<Reserver>::type;
  /// Host slots whose prefetch copies may still be reading them, with the event after those.
  struct pending_slots {
    event_type event{};
    std::vector<host_slot> slots;
  };

 public:
  using device_provider_type = Device;
  using host_provider_type = Host;
  using reserver_type = Reserver;
  /// The most pieces one buffer tracks (its table costs about 100 bytes a piece): 256 TiB in
  /// pieces of 64 MiB. More is refused with usage_error before anything is reserved.
  static constexpr std::size_t max_pieces = std::size_t{1} << 22;

  /// Reserves `capacity` bytes (rounded up to the granularity) in pieces of `piece` bytes
  /// (rounded up to the granularity; 0: 64 MiB), twice (the pieces' addresses and their shadows).
  /// Nothing is committed. Pieces of 64 MiB or more move at 87-96% of pinned cudaMemcpyAsync's
  /// bandwidth on an H200; small pieces cost a remap each (bench/results/offload.md). Throws out_of_memory when
  /// the address space runs out (checked before the piece table is made), usage_error for a zero
  /// capacity or more than max_pieces pieces.
  virtual_buffer(Device device, Host host, Reserver reserver, Copier copier, std::size_t capacity,
                 std::size_t piece = 64 * MiB)
      : device_(std::move(device)), host_(std::move(host)), reserver_(std::move(reserver)), copier_(std::move(copier)) {
    granularity_ = std::max({device_.granularity(), host_.granularity(), reserver_.granularity()});
    if (capacity == 0) {
      throw usage_error(usage_error::kind::bad_argument, "glake::virtual_buffer: the capacity is 0 bytes");
    }
    if (capacity > ~std::size_t{0} - granularity_ || piece > ~std::size_t{0} - granularity_) {
      throw out_of_memory(capacity, 0, 0, "glake::virtual_buffer: " + std::to_string(capacity) +
                                              " bytes are more than any address space holds");
    }
    size_ = round_up(capacity);
    piece_ = std::min(round_up(piece == 0 ? 64 * MiB : piece), size_);
    const std::size_t count = size_ / piece_ + (size_ % piece_ != 0 ? 1 : 0);
    if (count > max_pieces) {
      throw usage_error(usage_error::kind::bad_argument,
                        "glake::virtual_buffer: a capacity of " + std::to_string(capacity) + " bytes in pieces of " +
                            std::to_string(piece_) + " bytes makes " + std::to_string(count) +
                            " pieces, more than the " + std::to_string(max_pieces) + " one buffer tracks; use larger pieces");
    }
    // The address space first: a capacity it cannot hold is refused before any table is sized.
    base_ = reserver_.try_reserve(size_);
    if (base_ != nullptr) {
      try {
        shadow_ = reserver_.try_reserve(size_);
      } catch (...) {
        reserver_.free(base_, size_);
        throw;
      }
      if (shadow_ == nullptr) reserver_.free(base_, size_);
    }
    if (base_ == nullptr || shadow_ == nullptr) {
      throw out_of_memory(size_, 0, 0, "glake::virtual_buffer: reserving 2 x " + format_bytes(size_) +
                                           " of address space failed (out of address space)");
    }
    try {
      pieces_.resize(count);
    } catch (const std::bad_alloc&) {
      reserver_.free(shadow_, size_);
      reserver_.free(base_, size_);
      throw out_of_memory(count * sizeof(piece_state), 0, 0,
                          "glake::virtual_buffer: no host memory for the table of " + std::to_string(count) +
                              " pieces of a " + format_bytes(size_) + " buffer");
    }
  }
  virtual_buffer(const virtual_buffer&) = delete;
  virtual_buffer& operator=(const virtual_buffer&) = delete;
  /// Waits for its own copies, then gives every handle and range back. Work that may still use
  /// the buffer must have completed (as before freeing any memory).
  ~virtual_buffer() {
    reclaim_pending(true);
    for (std::size_t i = 0; i < pieces_.size(); ++i) drop_piece(i);
    for (const host_slot& s : cache_) destroy_slot(s);
    reserver_.free(base_, size_);
    reserver_.free(shadow_, size_);
  }

  void* data() const noexcept { return base_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t piece_size() const noexcept { return piece_; }
  std::size_t piece_count() const noexcept { return pieces_.size(); }
  std::size_t granularity() const noexcept { return granularity_; }

  /// Where the piece holding byte `offset` lives. usage_error when offset >= size().
  residence residence_of(std::size_t offset) const {
    if (offset >= size_) {
      throw usage_error(usage_error::kind::bad_argument,
                        "glake::virtual_buffer: offset " + std::to_string(offset) + " is outside its " +
                            std::to_string(size_) + " bytes");
    }
    return pieces_[offset / piece_].where;
  }

  /// Work queued on `stream` also uses the buffer: moves and decommits wait for it as well.
  void record_stream(stream_ref stream) {
    if (std::find(streams_.begin(), streams_.end(), stream) == streams_.end()) streams_.push_back(stream);
  }

  /// Device memory for every piece covering [offset, offset + bytes) that has none (pieces
  /// already committed, on the device or the host, stay as they are); new memory is not zeroed.
  /// out_of_memory when the device provider runs out, after undoing what this call did.
  void commit(std::size_t offset, std::size_t bytes) {
    const auto [first, last] = piece_range("commit", offset, bytes);
    std::vector<std::size_t> made;
    std::size_t made_bytes = 0;
    try {
      made.reserve(last - first);
      for (std::size_t i = first; i < last; ++i) {
        if (pieces_[i].where != residence::none) continue;
        const std::optional<device_handle> h = device_.try_create(size_of(i));
        if (!h) throw_out_of_memory("committing", first, last, "the device provider ran out of memory", made_bytes);
        bool mapped = false;
        try {
          mapped = map_new(i, *h);
        } catch (...) {
          device_.release(*h);
          throw;
        }
        if (!mapped) {
          device_.release(*h);
          throw_out_of_memory("committing", first, last, "mapping the new device memory ran out of resources",
                              made_bytes);
        }
        pieces_[i].where = residence::device;
        pieces_[i].device = *h;
        device_bytes_ += size_of(i);
        made_bytes += size_of(i);
        made.push_back(i);
        shadow_piece(i, first, last, made_bytes);
      }
    } catch (...) {
      for (std::size_t i : made) drop_piece(i);
      throw;
    }
  }

  /// Gives back the memory of every piece covering [offset, offset + bytes), wherever it is,
  /// once the work queued on `stream` (and on recorded streams) has completed. The bytes are lost.
  void decommit(std::size_t offset, std::size_t bytes, stream_ref stream = default_stream) {
    const auto [first, last] = piece_range("decommit", offset, bytes);
    bool any = false;
    for (std::size_t i = first; i < last; ++i) any = any || pieces_[i].where != residence::none;
    if (!any) return;
    refuse_capture("decommit", stream);
    wait_for_streams(stream);
    for (std::size_t i = first; i < last; ++i) {
      piece_state& p = pieces_[i];
      if (p.where == residence::host) {
        reserver_.unmap(at(i), size_of(i));
        host_bytes_ -= size_of(i);
        cache_slot(p.host);
        p = piece_state{};
      } else if (p.where == residence::device) {
        drop_piece(i);
      }
    }
  }

  /// Moves every piece covering [offset, offset + bytes) to the host (see the class comment).
  /// usage_error when one of them is not on the device; out_of_memory when host memory runs out.
  void offload(std::size_t offset, std::size_t bytes, stream_ref stream = default_stream) {
    const auto [first, last] = piece_range("offload", offset, bytes);
    require_all(first, last, residence::device, "offload");
    refuse_capture("offload", stream);
    reclaim_pending(false);
    const std::size_t count = last - first;
    std::vector<host_slot> slots;
    std::vector<std::size_t> shadowed_now;
    std::vector<event_type> events;
    std::size_t remapped = 0;
    bool copied = false;
    try {
      slots.reserve(count);
      shadowed_now.reserve(count);
      if constexpr (has_events) events.reserve(count);
      // Nothing queued before this call may still touch the pieces once they are remapped.
      wait_for_streams(stream);
      for (std::size_t i = first; i < last; ++i) {
        if (!pieces_[i].shadowed) {
          shadow_piece(i, first, last);
          shadowed_now.push_back(i);
        }
      }
      for (std::size_t i = first; i < last; ++i) slots.push_back(take_slot(size_of(i), first, last));
      // The copies read the device handles through their shadow mappings, so each piece's own
      // addresses are remapped to host memory while the copies run; work queued on the stream
      // after this call comes after the copies.
      for (std::size_t k = 0; k < count; ++k) {
        copied = true;
        copier_.copy(slots[k].home, shadow(first + k), size_of(first + k), stream);
        if constexpr (has_events) events.push_back(reserver_.record_event(stream));
      }
      for (; remapped < count; ++remapped) {
        const std::size_t i = first + remapped;
        reserver_.unmap(at(i), size_of(i));
        if (!map_here_or_restore(i, slots[remapped].handle, pieces_[i].device)) {
          throw_out_of_memory("offloading", first, last, "mapping host memory ran out of resources");
        }
      }
    } catch (...) {
      // Pieces [first, first + remapped) now map host memory: put their device handles back.
      std::string failed_restore;
      for (std::size_t k = 0; k < remapped; ++k) {
        const std::size_t i = first + k;
        reserver_.unmap(at(i), size_of(i));
        if (!map_back(i, pieces_[i].device) && failed_restore.empty()) failed_restore = describe_piece(i);
      }
      if constexpr (has_events) {
        // No copy may still write a slot that goes back to the cache.
        for (event_type e : events) {
          reserver_.wait_event(e);
          reserver_.recycle_event(e);
        }
        if (copied && events.size() < count) reserver_.synchronize_device();
      }
      for (const host_slot& s : slots) cache_slot(s);
      for (std::size_t i : shadowed_now) unshadow(i);
      if (!failed_restore.empty()) throw_restore_failure(failed_restore);
      throw;
    }
    // A device handle goes back once its copy is done.
    for (std::size_t k = 0; k < count; ++k) {
      if constexpr (has_events) {
        reserver_.wait_event(events[k]);
        reserver_.recycle_event(events[k]);
      }
      const std::size_t i = first + k;
      piece_state& p = pieces_[i];
      unshadow(i);
      device_.release(p.device);
      p.device = device_handle{};
      p.host = slots[k];
      p.where = residence::host;
      device_bytes_ -= size_of(i);
      host_bytes_ += size_of(i);
      offloaded_bytes_ += size_of(i);
    }
    ++offloads_;
  }

  /// Moves every piece covering [offset, offset + bytes) back to the device (see the class
  /// comment). usage_error when one of them is not on the host; out_of_memory when the device
  /// provider runs out.
  void prefetch(std::size_t offset, std::size_t bytes, stream_ref stream = default_stream) {
    const auto [first, last] = piece_range("prefetch", offset, bytes);
    require_all(first, last, residence::host, "prefetch");
    refuse_capture("prefetch", stream);
    const std::size_t count = last - first;
    std::vector<device_handle> handles;
    handles.reserve(count);
    pending_slots pending;
    pending.slots.reserve(count);
    wait_for_streams(stream);  // nothing queued may still read the host memory being unmapped
    std::size_t remapped = 0;
    bool copied = false;
    std::vector<std::size_t> shadowed;
    try {
      shadowed.reserve(count);
      for (std::size_t i = first; i < last; ++i) {
        const std::optional<device_handle> h = device_.try_create(size_of(i));
        if (!h) throw_out_of_memory("prefetching", first, last, "the device provider ran out of memory");
        handles.push_back(*h);
      }
      // Each piece's copy is queued as soon as it is remapped, so the copies run while the
      // next pieces are remapped.
      for (; remapped < count; ++remapped) {
        const std::size_t i = first + remapped;
        reserver_.unmap(at(i), size_of(i));
        if (!map_here_or_restore(i, handles[remapped], pieces_[i].host.handle)) {
          throw_out_of_memory("prefetching", first, last, "mapping device memory ran out of resources");
        }
        copied = true;
        copier_.copy(at(i), pieces_[i].host.home, size_of(i), stream);
      }
      // The next offload copies through the shadow mappings: made now, while the copies run.
      for (std::size_t k = 0; k < count; ++k) {
        shadow_piece_with(first + k, handles[k], first, last);
        shadowed.push_back(first + k);
      }
      if constexpr (has_events) pending.event = reserver_.record_event(stream);
    } catch (...) {
      if (copied) {
        if constexpr (has_events) {
          // Copies already queued write the device handles being released: let them finish.
          reserver_.synchronize_device();
        }
      }
      std::string failed_restore;
      for (std::size_t i : shadowed) unshadow(i);
      for (std::size_t k = 0; k < remapped; ++k) {
        const std::size_t i = first + k;
        reserver_.unmap(at(i), size_of(i));
        if (!map_back(i, pieces_[i].host.handle) && failed_restore.empty()) failed_restore = describe_piece(i);
      }
      for (device_handle h : handles) device_.release(h);
      if (!failed_restore.empty()) throw_restore_failure(failed_restore);
      throw;
    }
    for (std::size_t k = 0; k < count; ++k) {
      piece_state& p = pieces_[first + k];
      pending.slots.push_back(p.host);
      p.host = host_slot{};
      p.device = handles[k];
      p.where = residence::device;
      host_bytes_ -= size_of(first + k);
      device_bytes_ += size_of(first + k);
      prefetched_bytes_ += size_of(first + k);
    }
    ++prefetches_;
    if constexpr (has_events) {
      try {
        pending_.push_back(std::move(pending));
      } catch (...) {
        reserver_.wait_event(pending.event);  // nowhere to keep them: let the copies finish
        reserver_.recycle_event(pending.event);
        for (const host_slot& s : pending.slots) cache_slot(s);
      }
    } else {
      for (const host_slot& s : pending.slots) cache_slot(s);
    }
  }

  /// Gives back the cached host handles (waiting for prefetch copies still reading them).
  void release_cached() noexcept {
    reclaim_pending(true);
    for (const host_slot& s : cache_) destroy_slot(s);
    cache_.clear();
    cached_bytes_ = 0;
  }

  virtual_buffer_statistics stats() const noexcept {
    virtual_buffer_statistics s;
    s.capacity_bytes = size_;
    s.device_bytes = device_bytes_;
    s.host_bytes = host_bytes_;
    s.cached_host_bytes = cached_bytes_;
    for (const pending_slots& p : pending_) {
      for (const host_slot& slot : p.slots) s.cached_host_bytes += slot.size;
    }
    s.offloads = offloads_;
    s.prefetches = prefetches_;
    s.offloaded_bytes = offloaded_bytes_;
    s.prefetched_bytes = prefetched_bytes_;
    s.host_handles_created = host_handles_created_;
    return s;
  }

  Device& device_provider() noexcept { return device_; }
  Host& host_provider() noexcept { return host_; }
  Reserver& reserver() noexcept { return reserver_; }

 private:

  std::size_t round_up(std::size_t bytes) const noexcept { return (bytes + granularity_ - 1) / granularity_ * granularity_; }
  std::size_t size_of(std::size_t i) const noexcept { return std::min(piece_, size_ - i * piece_); }
  void* at(std::size_t i) const noexcept { return static_cast<char*>(base_) + i * piece_; }
  /// Where piece i's device handle is mapped a second time while an offload copies it.
  void* shadow(std::size_t i) const noexcept { return static_cast<char*>(shadow_) + i * piece_; }

  std::pair<std::size_t, std::size_t> piece_range(const char* what, std::size_t offset, std::size_t bytes) const {
    if (offset > size_ || bytes > size_ - offset) {
      throw usage_error(usage_error::kind::bad_argument,
                        std::string("glake::virtual_buffer::") + what + ": [" + std::to_string(offset) + ", +" +
                            std::to_string(bytes) + ") is outside its " + std::to_string(size_) + " bytes");
    }
    if (bytes == 0) return {0, 0};
    return {offset / piece_, (offset + bytes - 1) / piece_ + 1};
  }

  void require_all(std::size_t first, std::size_t last, residence wanted, const char* what) const {
    for (std::size_t i = first; i < last; ++i) {
      if (pieces_[i].where != wanted) {
        throw usage_error(usage_error::kind::bad_state,
                          std::string("glake::virtual_buffer::") + what + ": " + describe_piece(i) + " is on " +
                              to_string(pieces_[i].where) + ", not on " + to_string(wanted) +
                              " (nothing was moved)");
      }
    }
  }

  std::string describe_piece(std::size_t i) const {
    return "piece " + std::to_string(i) + " (" + format_bytes(size_of(i)) + " at offset " +
           std::to_string(i * piece_) + ")";
  }

  // `undone`: device bytes this call added and will take back before the exception leaves it.
  [[noreturn]] void throw_out_of_memory(const char* what, std::size_t first, std::size_t last, const char* why,
                                        std::size_t undone = 0) const {
    const std::size_t bytes = std::min(size_, last * piece_) - first * piece_;
    const std::size_t device = device_bytes_ - undone;
    throw out_of_memory(bytes, device + host_bytes_, device,
                        std::string("glake::virtual_buffer: ") + what + " " + format_bytes(bytes) + " failed: " + why +
                            " (the buffer holds " + format_bytes(device) + " on the device, " +
                            format_bytes(host_bytes_) + " on the host, " + format_bytes(cached_bytes_) +
                            " of cached host memory; nothing was moved)");
  }

  [[noreturn]] static void throw_restore_failure(const std::string& piece) {
    throw driver_error("glake::virtual_buffer", -1,
                       "undoing a failed move could not map " + piece +
                           " back; its data is kept in its handle, but the addresses are unmapped");
  }

  // Maps `h` at piece i and sets access; on failure maps `previous` back (best effort) and
  // answers false for out of resources, rethrows a driver error. On a failed restore throws.
  template <class H, class P>
  bool map_here_or_restore(std::size_t i, H h, P previous) {
    bool mapped = false;
    try {
      mapped = reserver_.try_map(at(i), size_of(i), h);
      if (mapped && reserver_.try_set_access(at(i), size_of(i))) return true;
    } catch (...) {
      if (mapped) reserver_.unmap(at(i), size_of(i));
      if (!map_back(i, previous)) throw_restore_failure(describe_piece(i));
      throw;
    }
    if (mapped) reserver_.unmap(at(i), size_of(i));
    if (!map_back(i, previous)) throw_restore_failure(describe_piece(i));
    return false;
  }

  template <class H>
  bool map_back(std::size_t i, H h) noexcept {
    try {
      if (!reserver_.try_map(at(i), size_of(i), h)) return false;
      if (reserver_.try_set_access(at(i), size_of(i))) return true;
      reserver_.unmap(at(i), size_of(i));
    } catch (...) {
    }
    return false;
  }

  // Maps `h` at `where` (n bytes) with access; false (nothing mapped) when out of resources.
  template <class H>
  bool map_new_at(void* where, std::size_t n, H h) {
    if (!reserver_.try_map(where, n, h)) return false;
    try {
      if (reserver_.try_set_access(where, n)) return true;
    } catch (...) {
      reserver_.unmap(where, n);
      throw;
    }
    reserver_.unmap(where, n);
    return false;
  }
  template <class H>
  bool map_new(std::size_t i, H h) {
    return map_new_at(at(i), size_of(i), h);
  }

  // Maps piece i's device handle (or `h`) at its shadow too; out_of_memory when out of resources.
  void shadow_piece(std::size_t i, std::size_t first, std::size_t last, std::size_t undone = 0) {
    shadow_piece_with(i, pieces_[i].device, first, last, undone);
  }
  void shadow_piece_with(std::size_t i, device_handle h, std::size_t first, std::size_t last, std::size_t undone = 0) {
    if (!map_new_at(shadow(i), size_of(i), h)) {
      throw_out_of_memory("mapping", first, last, "mapping device memory a second time ran out of resources", undone);
    }
    pieces_[i].shadowed = true;
  }

  void unshadow(std::size_t i) noexcept {
    if (!pieces_[i].shadowed) return;
    reserver_.unmap(shadow(i), size_of(i));
    pieces_[i].shadowed = false;
  }

  // Unmaps and releases piece i's device memory, or caches its host slot.
  void drop_piece(std::size_t i) noexcept {
    piece_state& p = pieces_[i];
    if (p.where == residence::none) return;
    reserver_.unmap(at(i), size_of(i));
    if (p.where == residence::device) {
      unshadow(i);
      device_.release(p.device);
      device_bytes_ -= size_of(i);
    } else {
      host_bytes_ -= size_of(i);
      destroy_slot(p.host);
    }
    p = piece_state{};
  }

  // A host handle of `size` bytes mapped at its home: a cached one, else a new one.
  host_slot take_slot(std::size_t size, std::size_t first, std::size_t last) {
    for (std::size_t k = 0; k < cache_.size(); ++k) {
      if (cache_[k].size != size) continue;
      const host_slot s = cache_[k];
      cache_[k] = cache_.back();
      cache_.pop_back();
      cached_bytes_ -= size;
      return s;
    }
    const std::optional<host_handle_type> h = host_.try_create(size);
    if (!h) throw_out_of_memory("offloading", first, last, "the host provider ran out of memory");
    ++host_handles_created_;
    void* home = nullptr;
    try {
      home = reserver_.try_reserve(size);
      if (home == nullptr) {
        host_.release(*h);
        throw_out_of_memory("offloading", first, last, "out of address space for host memory");
      }
      if (!reserver_.try_map(home, size, *h)) {
        reserver_.free(home, size);
        host_.release(*h);
        throw_out_of_memory("offloading", first, last, "mapping host memory ran out of resources");
      }
    } catch (const out_of_memory&) {
      throw;
    } catch (...) {
      if (home != nullptr) reserver_.free(home, size);
      host_.release(*h);
      throw;
    }
    bool access = false;
    try {
      access = reserver_.try_set_access(home, size);
    } catch (...) {
      destroy_slot(host_slot{*h, home, size});
      throw;
    }
    if (!access) {
      destroy_slot(host_slot{*h, home, size});
      throw_out_of_memory("offloading", first, last, "making host memory accessible ran out of resources");
    }
    return host_slot{*h, home, size};
  }

  void cache_slot(const host_slot& s) noexcept {
    try {
      cache_.push_back(s);
      cached_bytes_ += s.size;
    } catch (...) {
      destroy_slot(s);
    }
  }

  void destroy_slot(const host_slot& s) noexcept {
    reserver_.unmap(s.home, s.size);
    reserver_.free(s.home, s.size);
    host_.release(s.handle);
  }

  // Host slots of finished prefetches go back to the cache; with `wait`, all of them.
  void reclaim_pending(bool wait) noexcept {
    if constexpr (has_events) {
      std::size_t kept = 0;
      for (std::size_t k = 0; k < pending_.size(); ++k) {
        bool done = wait;
        if (!done) {
          try {
            done = reserver_.event_done(pending_[k].event);
          } catch (...) {
            done = false;  // a failed query only means "not known to be done"
          }
        }
        if (wait) reserver_.wait_event(pending_[k].event);
        if (done) {
          reserver_.recycle_event(pending_[k].event);
          for (const host_slot& s : pending_[k].slots) cache_slot(s);
        } else {
          if (kept != k) pending_[kept] = std::move(pending_[k]);
          ++kept;
        }
      }
      pending_.resize(kept);
    }
  }

  // A move remaps memory now, on the host, and waits for queued work: on a stream that is
  // capturing a graph its copies would be recorded instead of run, and waiting is not allowed.
  // Refused before anything changes, when the Reserver can tell.
  void refuse_capture(const char* what, stream_ref stream) const {
    if constexpr (capture_aware_reserver<Reserver>) {
      for (std::size_t k = 0; k <= streams_.size(); ++k) {
        const stream_ref s = k == 0 ? stream : streams_[k - 1];
        if (!reserver_.is_capturing(s)) continue;
        char id[32];
        std::snprintf(id, sizeof id, "%#llx", static_cast<unsigned long long>(s.id()));
        throw usage_error(usage_error::kind::bad_state,
                          std::string("glake::virtual_buffer::") + what + ": stream " + id +
                              (k == 0 ? "" : " (given to record_stream)") +
                              " is capturing a graph; a move remaps memory at once and would record "
                              "its copies in the graph instead of running them: move before or after "
                              "the capture");
      }
    }
  }

  // The work queued so far on `stream` and on every recorded stream has completed.
  void wait_for_streams(stream_ref stream) {
    if constexpr (has_events) {
      const event_type e = reserver_.record_event(stream);
      reserver_.wait_event(e);
      reserver_.recycle_event(e);
    }
    wait_for_recorded_streams();
  }
  void wait_for_recorded_streams() {
    if constexpr (has_events) {
      for (stream_ref s : streams_) {
        const event_type e = reserver_.record_event(s);
        reserver_.wait_event(e);
        reserver_.recycle_event(e);
      }
    }
  }

  [[no_unique_address]] Device device_;
  [[no_unique_address]] Host host_;
  [[no_unique_address]] Reserver reserver_;
  [[no_unique_address]] Copier copier_;
  std::size_t granularity_ = 0;
  std::size_t size_ = 0;
  std::size_t piece_ = 0;
  void* base_ = nullptr;
  void* shadow_ = nullptr;  ///< a second reservation of size_, for offload's copies
  std::vector<piece_state> pieces_;
  std::vector<host_slot> cache_;
  std::vector<pending_slots> pending_;
  std::vector<stream_ref> streams_;
  std::size_t device_bytes_ = 0;
  std::size_t host_bytes_ = 0;
  std::size_t cached_bytes_ = 0;
  std::uint64_t offloads_ = 0;
  std::uint64_t prefetches_ = 0;
  std::uint64_t offloaded_bytes_ = 0;
  std::uint64_t prefetched_bytes_ = 0;
  std::uint64_t host_handles_created_ = 0;
};

}  // namespace glake
