// A host<->device copy engine that splits one copy between the target device's own host link and
// peer devices' links, each peer forwarding its share over the peer link (NVLink).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "glake/backends/concepts.hpp"
#include "glake/config.hpp"
#include "glake/detail/archetypes.hpp"
#include "glake/errors.hpp"
#include "glake/movers/copy_plan.hpp"
#include "glake/movers/staged_copy.hpp"
#include "glake/stream.hpp"

namespace glake {

/// A peer device a multipath_copier may send shares through.
template <peer_copy_backend Backend>
struct peer_route {
  Backend backend;    ///< the peer device's backend
  stream_ref stream;  ///< a stream of the peer device, used by this copier alone
  /// The path's relative bandwidth, in the unit of multipath_options::direct_weight; 0: unused.
  double weight = 1.0;
  /// The least share worth sending this way.
  std::size_t min_bytes = 64 * MiB;
};

/// The shape of a multipath_copier.
struct multipath_options {
  staged_copy_options staging{};      ///< every path's staged_copier
  double direct_weight = 1.0;         ///< the target's own link, in the unit of the peers' weights
  std::size_t alignment = 2 * MiB;    ///< every share but the last starts and ends on a multiple
  std::size_t scratch_bytes = 64 * MiB;  ///< each peer's buffer in its memory; its share passes in
                                         ///< pieces of this size
};

/// What a multipath_copier did, since it was made.
struct multipath_statistics {
  std::uint64_t copies = 0;        ///< copy calls that moved bytes
  std::uint64_t split_copies = 0;  ///< those that used a peer path
  std::vector<std::uint64_t> path_bytes;  ///< bytes per path: [0] the direct path, [k] peer k - 1
};

namespace detail {
// The classifier a path's staged_copier asks: the user's, except that the path's scratch buffer
// (made by the multipath_copier, unknown to the user's classifier) is its device's memory.
template <class Classifier>
struct scratch_aware_classifier {
  Classifier* inner = nullptr;
  int device = -1;
  const void* scratch = nullptr;
  std::size_t scratch_bytes = 0;
  pointer_info locate(const void* p) {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    const auto s = reinterpret_cast<std::uintptr_t>(scratch);
    if (scratch != nullptr && a - s < scratch_bytes) return {memory_kind::device, device};
    return inner->locate(p);
  }
};
}  // namespace detail

// ---------------------------------------------------------------------------------------------
// multipath_copier
//
// copy(dst, src, n, stream) copies n bytes between host memory and the target device's memory,
// ordered on `stream` (a stream of the target device). plan_copy splits [0, n) among the paths:
// the direct one (the target's own link) and one per peer_route. The direct share goes through a
// staged_copier on `stream` (one device copy when the host side is pinned). Host to device, a
// peer's share is cut into pieces of at most scratch_bytes; each piece is copied from the host
// into the peer's scratch buffer by the peer's own staged_copier on the peer's stream, then from
// the scratch buffer to the target by a peer copy on the same stream, so the next piece waits
// for the previous forward to have read the scratch buffer. Before its first peer copy the peer
// stream waits for an event recorded on `stream` when copy was called, so the work queued there
// earlier runs first. Device to host is the mirror: peer copy into the scratch buffer, then the
// peer's staged_copier drains it to the host. Peer shares run on threads of their own (the
// direct share on the calling thread), so every link is busy at once. At the end `stream` waits
// for an event recorded on each peer stream used: work queued there afterwards sees the data
// (host to device) or may overwrite the source (device to host).
// A copy whose plan is the direct share alone, or that is not between host memory and the
// target device, is the direct staged_copier's copy.
//
// When copy returns: host to device, once the source has been read whole (the last device copies
// may still run); device to host, once the destination holds the data (when it is pageable; a
// pinned destination is ready once `stream` reaches the copy).
// Errors: a null pointer: usage_error; what the staged_copiers refuse (see there). A failure
// midway propagates once every path stopped: the peer streams used are waited for on the host,
// so nothing queued by this call still writes the target or reads a scratch buffer; the target's
// bytes are then unspecified; the copier can be used again. Scratch buffers (one per peer used,
// scratch_bytes, made on first use) and staging rings stay until release_scratch or destruction.
// Cost: one plan (O(paths^2)), one thread per peer share, two events per peer share.
// Thread safety: copy may be called from several threads; copies that use a peer take turns
// (the scratch buffers and peer streams are this copier's). The Classifier's locate is called
// from several threads at once. Streams: `stream` of the target; each peer_route's stream of its
// device, not used by anyone else while this copier lives.
// ---------------------------------------------------------------------------------------------
template <peer_copy_backend Backend, pointer_classifier Classifier>
class multipath_copier {
  using path_classifier = detail::scratch_aware_classifier<Classifier>;
  using path_copier = staged_copier<Backend, path_classifier>;
  using event_type = typename Backend::event_type;

  struct peer_state {
    Backend backend;
    stream_ref stream;
    std::unique_ptr<path_copier> copier;
    void* scratch = nullptr;
  };

 public:
  static constexpr bool synchronous = false;

  /// Checks the paths (config_error, as plan_copy does, or for scratch_bytes 0) and makes one
  /// staged_copier a path (threads started, no memory pinned yet).
  multipath_copier(Backend target, std::vector<peer_route<Backend>> peers, Classifier classifier = {},
                   multipath_options options = {})
      : options_(options), classifier_(std::move(classifier)), target_(target) {
    if (options_.scratch_bytes == 0) throw config_error("glake::multipath_copier: scratch_bytes is 0");
    paths_.push_back(copy_path{target.device(), options_.direct_weight, 0});
    for (const peer_route<Backend>& p : peers) paths_.push_back(copy_path{p.backend.device(), p.weight, p.min_bytes});
    (void)plan_copy(0, target.device(), paths_, options_.alignment);  // throws config_error
    direct_ = std::make_unique<path_copier>(target, path_classifier{&classifier_, target.device()}, options_.staging);
    for (peer_route<Backend>& p : peers) {
      const int device = p.backend.device();
      peers_.push_back(peer_state{p.backend, p.stream,
                                  std::make_unique<path_copier>(p.backend, path_classifier{&classifier_, device},
                                                                options_.staging)});
    }
    path_bytes_.assign(paths_.size(), 0);
  }
  multipath_copier(const multipath_copier&) = delete;
  multipath_copier& operator=(const multipath_copier&) = delete;
  ~multipath_copier() { release_scratch(); }

  const multipath_options& options() const noexcept { return options_; }
  /// The paths plans are made from: [0] direct, [k] via peer k - 1.
  const std::vector<copy_path>& paths() const noexcept { return paths_; }

  /// Copies `bytes` from `src` to `dst`, ordered on `stream` (see the class comment).
  void copy(void* dst, const void* src, std::size_t bytes, stream_ref stream = {}) {
    if (bytes == 0) return;
    if (dst == nullptr || src == nullptr) {
      throw usage_error(usage_error::kind::bad_argument, std::string("glake::multipath_copier::copy: the ") +
                                                             (dst == nullptr ? "destination" : "source") +
                                                             " is a null pointer");
    }
    const int target = target_.device();
    // A device range must be the target's from end to end; anything else goes to the direct
    // staged_copier, which copies it or says why not.
    const auto on_target = [&](const void* p) {
      const pointer_info first = classifier_.locate(p);
      const pointer_info last = classifier_.locate(static_cast<const char*>(p) + (bytes - 1));
      return first.kind == memory_kind::device && first.device == target && last == first;
    };
    const auto host = [&](const void* p) {
      const memory_kind k = classifier_.locate(p).kind;
      return k == memory_kind::pageable || k == memory_kind::pinned;
    };
    const bool to_device = on_target(dst) && host(src);
    const bool to_host = !to_device && on_target(src) && host(dst);
    const copy_plan plan = plan_copy(bytes, target, paths_, options_.alignment);
    if ((!to_device && !to_host) || (plan.shares.size() == 1 && plan.shares[0].path == 0)) {
      direct_->copy(dst, src, bytes, stream);
      count(plan, false, to_device || to_host);
      return;
    }
    std::lock_guard lock(mutex_);
    run(plan, static_cast<char*>(dst), static_cast<const char*>(src), to_device, stream);
    count(plan, true, true);
  }

  /// Waits for the peer streams, then frees the scratch buffers and every path's staging memory.
  void release_scratch() noexcept {
    std::lock_guard lock(mutex_);
    for (peer_state& p : peers_) {
      if (p.scratch == nullptr) continue;
      p.backend.wait_stream(p.stream);
      p.backend.free_device(p.scratch, options_.scratch_bytes);
      p.scratch = nullptr;
      p.copier->classifier().scratch = nullptr;
    }
  }

  multipath_statistics stats() const {
    std::lock_guard lock(stats_mutex_);
    return {copies_, split_copies_, path_bytes_};
  }

 private:
  void count(const copy_plan& plan, bool split, bool planned) {
    std::lock_guard lock(stats_mutex_);
    ++copies_;
    if (split) ++split_copies_;
    if (!planned) {
      path_bytes_[0] += plan.bytes;
      return;
    }
    for (const copy_share& s : plan.shares) path_bytes_[s.path] += s.bytes;
  }

  void make_scratch(peer_state& p) {
    if (p.scratch != nullptr) return;
    p.scratch = p.backend.try_allocate_device(options_.scratch_bytes);
    if (p.scratch == nullptr) {
      throw out_of_memory(options_.scratch_bytes, 0, 0,
                          "glake::multipath_copier: allocating a scratch buffer of " +
                              format_bytes(options_.scratch_bytes) + " on device " +
                              std::to_string(p.backend.device()) + " failed");
    }
    path_classifier& c = p.copier->classifier();
    c.scratch = p.scratch;
    c.scratch_bytes = options_.scratch_bytes;
  }

  // One peer's share [offset, offset + bytes), in pieces through its scratch buffer.
  void run_peer(peer_state& p, char* dst, const char* src, std::size_t offset, std::size_t bytes, bool to_device,
                event_type start) {
    make_scratch(p);
    const int target = target_.device();
    const int peer = p.backend.device();
    char* const scratch = static_cast<char*>(p.scratch);
    bool ordered = false;  // the peer stream waits for the caller's earlier work
    for (std::size_t at = 0; at < bytes; at += options_.scratch_bytes) {
      const std::size_t n = std::min(options_.scratch_bytes, bytes - at);
      if (to_device) {
        p.copier->copy(scratch, src + offset + at, n, p.stream);
        if (!ordered) p.backend.stream_wait_event(p.stream, start);
        ordered = true;
        p.backend.enqueue_peer_copy(dst + offset + at, target, scratch, peer, n, p.stream);
      } else {
        if (!ordered) p.backend.stream_wait_event(p.stream, start);
        ordered = true;
        p.backend.enqueue_peer_copy(scratch, peer, src + offset + at, target, n, p.stream);
        p.copier->copy(dst + offset + at, scratch, n, p.stream);
      }
    }
  }

  void run(const copy_plan& plan, char* dst, const char* src, bool to_device, stream_ref stream) {
    const event_type start = target_.record_event(stream);
    std::vector<std::future<void>> running;
    std::vector<peer_state*> used;
    std::exception_ptr failure;
    try {
      for (const copy_share& s : plan.shares) {
        if (s.path == 0) continue;
        peer_state* p = &peers_[s.path - 1];
        used.push_back(p);
        running.push_back(std::async(std::launch::async, [this, p, dst, src, s, to_device, start] {
          run_peer(*p, dst, src, s.offset, s.bytes, to_device, start);
        }));
      }
      for (const copy_share& s : plan.shares) {
        if (s.path == 0) direct_->copy(dst + s.offset, src + s.offset, s.bytes, stream);
      }
    } catch (...) {
      failure = std::current_exception();
    }
    for (std::future<void>& f : running) {
      try {
        f.get();
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
    }
    target_.recycle_event(start);
    if (!failure) {
      try {
        for (peer_state* p : used) {
          const event_type done = p->backend.record_event(p->stream);
          try {
            target_.stream_wait_event(stream, done);
          } catch (...) {
            p->backend.recycle_event(done);
            throw;
          }
          p->backend.recycle_event(done);
        }
      } catch (...) {
        failure = std::current_exception();
      }
    }
    if (failure) {
      for (peer_state* p : used) p->backend.wait_stream(p->stream);
      std::rethrow_exception(failure);
    }
  }

  multipath_options options_;
  Classifier classifier_;  ///< before the copiers, whose classifiers point at it
  Backend target_;
  std::vector<copy_path> paths_;
  std::unique_ptr<path_copier> direct_;
  std::vector<peer_state> peers_;
  std::mutex mutex_;  ///< one copy that uses peers at a time
  mutable std::mutex stats_mutex_;
  std::uint64_t copies_ = 0, split_copies_ = 0;
  std::vector<std::uint64_t> path_bytes_;
};
static_assert(byte_copier<multipath_copier<detail::peer_copy_backend_archetype, detail::pointer_classifier_archetype>>);

}  // namespace glake
