// The named allocator configurations glake-replay compares, each a composition of the
// library's own templates over the simulated backend.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "glake/allocators/caching_allocator.hpp"
#include "glake/allocators/concepts.hpp"
#include "glake/allocators/segment_source.hpp"
#include "glake/allocators/segregator.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/sim.hpp"
#include "glake/config.hpp"
#include "glake/config_io.hpp"
#include "glake/policies/eviction.hpp"
#include "glake/policies/stitching.hpp"
#include "snapshot.hpp"

namespace glake::replay {

/// How a configuration's driver time is modeled: VMM calls as the sim device counted them, or
/// one cudaMalloc/cudaFree per segment (PyTorch's default allocator).
enum class driver_model { vmm, cuda_malloc };

/// Where the free memory of a stitching pool sits (see stitching_allocator::free_memory).
struct free_breakdown {
  std::size_t whole_handles = 0;
  std::size_t partial_handles = 0;
  std::size_t small_pool = 0;
  std::size_t partial_at_segment_end = 0;  ///< of partial_handles: in a block ending its segment
  std::size_t block_rounding = 0;          ///< live blocks' bytes beyond their requests
  std::size_t stitched_tails = 0;          ///< live stitched ranges' bytes beyond their requests
};

/// A configuration behind one interface, owning the simulated device it runs on.
class replayable {
 public:
  /// The stitching pool's free memory by kind; nothing for configurations without one.
  virtual std::optional<free_breakdown> free_memory() const = 0;
  virtual ~replayable() = default;
  virtual void* try_allocate(std::size_t bytes, stream_ref stream) = 0;
  virtual void deallocate(void* p, std::size_t bytes, stream_ref stream) = 0;
  virtual std::size_t reserved_bytes() const = 0;
  virtual statistics stats() const = 0;
  virtual void verify() const = 0;
  virtual const sim_device& device() const = 0;
  /// From now on tells `history` (null: nobody) of segment changes and free_completed, where the
  /// allocator reports them (an observable_allocator); false where it does not.
  virtual bool observe(replay_history*) { return false; }
  /// Shows the allocator's segments, blocks and stitched ranges to `w` where it can (a
  /// snapshotting_allocator); false where it cannot.
  virtual bool visit_state(memory_snapshot_writer&) const { return false; }
};

template <allocator Allocator>
class replayable_allocator final : public replayable {
 public:
  template <class Make>
  replayable_allocator(std::size_t capacity, Make&& make) : device_(capacity), allocator_(make(device_)) {
    // A trace ends with tensors still live (the model's weights): not a leak to report.
    if constexpr (requires { allocator_.set_live_report(nullptr); }) allocator_.set_live_report(nullptr);
  }

  void* try_allocate(std::size_t bytes, stream_ref stream) override { return allocator_.try_allocate(bytes, stream); }
  void deallocate(void* p, std::size_t bytes, stream_ref stream) override { allocator_.deallocate(p, bytes, stream); }
  std::size_t reserved_bytes() const override { return allocator_.reserved_bytes(); }
  statistics stats() const override { return allocator_.stats(); }
  void verify() const override { allocator_.verify(); }
  const sim_device& device() const override { return device_; }
  bool observe(replay_history* history) override {
    if constexpr (observable_allocator<Allocator>) {
      allocator_.set_memory_observer(history != nullptr ? &replay_history::observe : nullptr, history);
      return true;
    } else {
      return false;
    }
  }
  bool visit_state(memory_snapshot_writer& w) const override {
    if constexpr (snapshotting_allocator<Allocator>) {
      allocator_.visit_state(w);
      return true;
    } else {
      return false;
    }
  }
  std::optional<free_breakdown> free_memory() const override {
    if constexpr (requires { allocator_.free_memory(); }) {
      const auto r = allocator_.free_memory();
      return free_breakdown{r.whole_handles, r.partial_handles, r.small_pool, r.partial_at_segment_end,
                            r.block_rounding, r.stitched_tails};
    } else if constexpr (requires { allocator_.large().free_memory(); }) {
      const auto r = const_cast<Allocator&>(allocator_).large().free_memory();
      return free_breakdown{r.whole_handles, r.partial_handles, r.small_pool, r.partial_at_segment_end,
                            r.block_rounding, r.stitched_tails};
    } else {
      return std::nullopt;
    }
  }

 private:
  sim_device device_;
  Allocator allocator_;
};

struct configuration {
  std::string name;
  std::string description;
  driver_model model;
  std::function<std::unique_ptr<replayable>(std::size_t capacity)> make;
};

using sim_segments = vmm_segment_source<sim_provider, sim_reserver>;
using sim_expandable_segments = expandable_segment_source<sim_provider, sim_reserver>;

/// PyTorch's small pool: 512 B rounding, 2 MiB segments, split whenever 512 B remain.
inline caching_rules pytorch_small_rules() {
  caching_rules rules;
  rules.round_to = 512;
  rules.min_segment = 2 * MiB;
  rules.segment_threshold = MiB + 1;
  rules.min_split_remainder = 512;
  return rules;
}

/// PyTorch's large pool: 20 MiB segments for requests under 10 MiB, else the request rounded to
/// 2 MiB; a free block is split only when more than 1 MiB would remain.
inline caching_rules pytorch_large_rules() {
  caching_rules rules;
  rules.round_to = 512;
  rules.min_segment = 20 * MiB;
  rules.segment_threshold = 10 * MiB;
  rules.min_split_remainder = MiB + 512;
  return rules;
}

/// expandable_segments:True: segments grow in pages (2 MiB small, 20 MiB large); any remainder
/// of 512 B or more is split off.
inline caching_rules expandable_rules(std::size_t page) {
  caching_rules rules;
  rules.round_to = 512;
  rules.min_segment = page;
  rules.segment_threshold = 0;
  rules.min_split_remainder = 512;
  return rules;
}

/// GMLake's knobs on the master branch: stitch requests of 512 MiB and more, reuse cached
/// stitches up to 10x the request, stitch before growing, StitchFree past 1000 GiB.
inline config gmlake_config() {
  config cfg;
  cfg.small_limit = 0;  // GMLake keeps PyTorch's small pool beside its stitching pool
  cfg.large_round_to = 0;  // blocks of whole 2 MiB chunks
  cfg.frag_limit = 512 * MiB;
  cfg.reuse_limit = 10.0;
  cfg.defrag_level = 0;
  cfg.auto_gc = 1000 * GiB;
  return cfg;
}

/// glake's composition: stitch whatever no free block serves, grow only the shortfall, keep the
/// small pool inside the stitching pool so its empty blocks return to it, keep cached stitched
/// ranges mapped (auto_gc at its default, 1000 GiB: they cost address space, not memory, and
/// unmapping them cost ~20 us per handle during training steps; on the H100 an 8 GiB cap made
/// recompute and LoRA steps 7-13% slower than PyTorch's, see docs/experiments.md).
/// New memory in handles of up to 8 MiB (max_handle): a mapped handle costs the same driver time
/// whatever its size, so large stitches make ~4x fewer calls than from 2 MiB handles, for a little
/// memory stranded in handles partly in use (see bench/results/replay.md, "Key findings";
/// `max_handle:0` keeps 2 MiB handles only). Segments grow in place (segment_reserve), so a
/// block's tail in its last handle starts the next request (docs/stitching.md).
inline config glake_config() {
  config cfg;
  cfg.frag_limit = 2 * MiB;
  cfg.grow_stitch = true;
  cfg.reuse_limit = 2.0;
  cfg.small_limit = 256 * KiB;  // a small segment holds at least eight small requests
  cfg.max_handle = 8 * MiB;
  cfg.segment_reserve = 256 * GiB;  // at most the device's memory: a stream's segment grows in place
  cfg.stream_join = true;  // the plug-in's; the simulated backend has no events, so neither acts here
  cfg.event_interval_us = 200;
  return cfg;
}

/// All configurations; `glake_overrides` ("key:value,...", as GLAKE_ALLOC_CONF) is applied over
/// glake's settings, for sweeps.
inline std::vector<configuration> named_configurations(const std::string& glake_overrides = {}) {
  config glake_settings = glake_config();
  glake_settings.apply(glake_overrides.c_str());
  std::vector<configuration> all;
  all.push_back({"pytorch-default", "PyTorch's CUDA caching allocator rules (cudaMalloc segments)",
                 driver_model::cuda_malloc, [](std::size_t capacity) -> std::unique_ptr<replayable> {
                   using pool = caching_allocator<sim_segments>;
                   using type = segregator<pool, pool>;
                   return std::make_unique<replayable_allocator<type>>(capacity, [](sim_device& d) {
                     return type(MiB, std::tuple{sim_segments{sim_provider{d}, sim_reserver{d}}, pytorch_small_rules()},
                                 std::tuple{sim_segments{sim_provider{d}, sim_reserver{d}}, pytorch_large_rules()});
                   });
                 }});
  all.push_back({"pytorch-expandable", "expandable_segments:True (pages of 2 MiB small, 20 MiB large)",
                 driver_model::vmm, [](std::size_t capacity) -> std::unique_ptr<replayable> {
                   using pool = caching_allocator<sim_expandable_segments>;
                   using type = segregator<pool, pool>;
                   return std::make_unique<replayable_allocator<type>>(capacity, [capacity](sim_device& d) {
                     // Each segment reserves about 1.125 x device memory of address space.
                     const auto virtual_size = [capacity](std::size_t page) {
                       return detail::round_up(capacity + capacity / 8, page);
                     };
                     return type(MiB,
                                 std::tuple{sim_expandable_segments{sim_provider{d}, sim_reserver{d}, 2 * MiB,
                                                                    virtual_size(2 * MiB)},
                                            expandable_rules(2 * MiB)},
                                 std::tuple{sim_expandable_segments{sim_provider{d}, sim_reserver{d}, 20 * MiB,
                                                                    virtual_size(20 * MiB)},
                                            expandable_rules(20 * MiB)});
                   });
                 }});
  all.push_back({"gmlake", "GMLake: 2 MiB chunks, largest-first stitching, its default knobs, PyTorch's small pool",
                 driver_model::vmm, [](std::size_t capacity) -> std::unique_ptr<replayable> {
                   using small = caching_allocator<sim_segments>;
                   using large = stitching_allocator<sim_provider, sim_reserver, largest_first_stitching, lru_eviction>;
                   using type = segregator<small, large>;
                   return std::make_unique<replayable_allocator<type>>(capacity, [](sim_device& d) {
                     return type(MiB, std::tuple{sim_segments{sim_provider{d}, sim_reserver{d}}, pytorch_small_rules()},
                                 std::tuple{sim_provider{d}, sim_reserver{d}, gmlake_config()});
                   });
                 }});
  all.push_back({"glake", "glake: best-fit-tail stitching of anything that does not fit, grow only the shortfall",
                 driver_model::vmm, [glake_settings](std::size_t capacity) -> std::unique_ptr<replayable> {
                   using type = stitching_allocator<sim_provider, sim_reserver, best_fit_tail_stitching, lru_eviction>;
                   return std::make_unique<replayable_allocator<type>>(capacity, [glake_settings](sim_device& d) {
                     return type(sim_provider{d}, sim_reserver{d}, glake_settings);
                   });
                 }});
  return all;
}

}  // namespace glake::replay
