// The main demo: a fine-tuning-like allocation pattern with variable sequence lengths, replayed
// on a simulated 80 GB GPU through a caching allocator and through glake's stitching allocator,
// showing how much reserved memory each needs for the same live data. No GPU required.
#include <glake/glake.hpp>

#include <cinttypes>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace glake;

// One training run: weights and optimizer state live throughout; every step keeps a stack of
// activations whose sizes follow that step's sequence length (drawn from 64..1024, as in
// variable-length fine-tuning), frees them in reverse while gradients come and go, and
// finishes with an optimizer update. Steps of different lengths leave free blocks of the wrong
// sizes behind: the fragmentation that stitching repairs.
template <class Allocator>
statistics run_training(Allocator& allocator) {
  struct held {
    void* p;
    std::size_t bytes;
  };
  std::mt19937_64 rng(2024);
  std::vector<held> persistent;
  const auto take = [&](std::vector<held>& into, std::size_t bytes) {
    into.push_back({allocator.allocate(bytes), bytes});
  };
  for (int layer = 0; layer < 24; ++layer) {  // ~1.2B parameters in bf16, plus AdamW state
    for (std::size_t bytes : {8 * MiB, 8 * MiB, 8 * MiB, 8 * MiB, 32 * MiB, 32 * MiB}) {
      take(persistent, bytes);
      take(persistent, 2 * bytes);  // optimizer moments in fp32
    }
    take(persistent, 8 * KiB);  // layer norms and biases: small-pool traffic
  }
  for (int step = 0; step < 14; ++step) {
    const std::size_t sequence = 64 + rng() % 961;
    const std::size_t tokens = 8 * sequence;  // batch 8
    std::vector<held> activations;
    for (int layer = 0; layer < 24; ++layer) {
      take(activations, tokens * 2048 * 2);        // hidden states
      take(activations, tokens * 8192 * 2);        // MLP intermediate
      take(activations, 8 * 32 * sequence * sequence * 2 / 4);  // attention, chunked
      take(activations, tokens * 4);               // a mask: small
    }
    while (!activations.empty()) {  // backward: gradients appear as activations go
      std::vector<held> gradients;
      take(gradients, activations.back().bytes * 2);
      allocator.deallocate(activations.back().p, activations.back().bytes);
      activations.pop_back();
      for (const held& g : gradients) allocator.deallocate(g.p, g.bytes);
    }
    std::vector<held> update;
    for (int i = 0; i < 6; ++i) take(update, 300 * MiB);  // fused optimizer scratch
    for (const held& u : update) allocator.deallocate(u.p, u.bytes);
  }
  const statistics s = allocator.stats();
  for (const held& h : persistent) allocator.deallocate(h.p, h.bytes);
  return s;
}

void print_row(const char* name, const statistics& s) {
  const double gb = 1e9;
  std::printf("%-34s %9.2f %10.2f %8.3f %9" PRIu64 " %9" PRIu64 " %9" PRIu64 "\n", name,
              static_cast<double>(s.peak_active_bytes) / gb, static_cast<double>(s.peak_reserved_bytes) / gb,
              static_cast<double>(s.peak_active_bytes) / static_cast<double>(s.peak_reserved_bytes),
              s.stitches, s.stitch_cache_hits, s.driver_calls.total());
}

}  // namespace

int main() {
  std::printf("glake demo: 14 fine-tuning steps with sequence lengths from 64 to 1024, replayed on a\n"
              "simulated 80 GB GPU (no GPU needed). Same requests, different allocators.\n\n");
  std::printf("%-34s %9s %10s %8s %9s %9s %9s\n", "allocator", "active GB", "reserved GB", "util",
              "stitches", "reused", "drv calls");

  using sim_segments = vmm_segment_source<sim_provider, sim_reserver>;  // one handle per segment
  {
    sim_device gpu(80 * GiB);
    caching_rules rules;  // PyTorch's large-pool rules: 20 MiB segments under 10 MiB, split > 1 MiB
    rules.min_segment = 20 * MiB;
    rules.segment_threshold = 10 * MiB;
    rules.min_split_remainder = MiB + 512;
    sim_caching_allocator<> caching(sim_segments(sim_provider{gpu}, sim_reserver{gpu}), rules);
    print_row("caching (best fit, split, no stitch)", run_training(caching));
  }
  {
    sim_device gpu(80 * GiB);
    stitching_allocator<sim_provider, sim_reserver, no_stitching> chunks(sim_provider{gpu}, sim_reserver{gpu});
    print_row("2 MiB chunks, stitching off", run_training(chunks));
  }
  {
    sim_device gpu(80 * GiB);
    config gmlake;  // GMLake's defaults: stitch requests of at least 512 MiB
    stitching_allocator<sim_provider, sim_reserver, largest_first_stitching> allocator(sim_provider{gpu},
                                                                                     sim_reserver{gpu}, gmlake);
    print_row("GMLake knobs (fragLimit 512 MiB)", run_training(allocator));
  }
  {
    sim_device gpu(80 * GiB);
    config cfg;
    cfg.frag_limit = 2 * MiB;  // stitch whatever does not fit
    cfg.grow_stitch = true;    // and create only the shortfall
    sim_stitching_allocator<> allocator(sim_provider{gpu}, sim_reserver{gpu}, cfg);
    print_row("glake (stitch all, grow shortfall)", run_training(allocator));
    if (gpu.violations() != 0) {
      std::printf("CUDA rule violations seen by the simulator: %s\n", gpu.last_violation().c_str());
      return 1;
    }
  }
  std::printf("\nutil = peak active / peak reserved. \"reused\" counts requests served by a cached\n"
              "stitched range. Driver calls are what the same run would issue to CUDA's VMM API.\n");
  return 0;
}
