// The presets through the compiled library glake::presets: this file is built with
// GLAKE_PRESETS_EXTERN, so allocate and deallocate below come from src/presets.cpp. Exits 0 when
// the preset allocates, stitches and frees as the header-only one does.
#include <cstdio>

#include "glake/presets.hpp"

#if !defined(GLAKE_PRESETS_EXTERN)
#error "built against glake::presets, which defines GLAKE_PRESETS_EXTERN"
#endif

int main() {
  using namespace glake;
  config cfg;
  cfg.frag_limit = 2 * MiB;
  shared_host_stitching_allocator allocator(host_provider(), host_reserver(), cfg);
  void* blocks[4];
  for (void*& b : blocks) b = allocator.allocate(8 * MiB);
  allocator.deallocate(blocks[0], 8 * MiB);
  allocator.deallocate(blocks[2], 8 * MiB);
  void* big = allocator.allocate(16 * MiB);
  const statistics s = allocator.stats();
  allocator.deallocate(big, 16 * MiB);
  allocator.deallocate(blocks[1], 8 * MiB);
  allocator.deallocate(blocks[3], 8 * MiB);

  sim_device gpu(64 * MiB);
  sim_caching_allocator<> caching(vmm_segment_source<sim_provider, sim_reserver>(sim_provider{gpu}, sim_reserver{gpu}));
  void* small = caching.try_allocate(4096);
  const bool cached = small != nullptr && caching.stats().active_bytes == 4096;
  caching.deallocate(small, 4096);

  const bool ok = s.stitches == 1 && s.reserved_bytes == 32 * MiB && allocator.stats().active_bytes == 0 && cached;
  std::printf("presets through glake::presets: stitches %llu, reserved %zu MiB, caching %s: %s\n",
              static_cast<unsigned long long>(s.stitches), static_cast<std::size_t>(s.reserved_bytes / MiB),
              cached ? "ok" : "wrong", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
