// The smallest useful glake program: a stitching allocator over real host memory, used directly
// and as a std::pmr resource.
#include <glake/glake.hpp>

#include <cstdio>
#include <cstring>
#include <memory_resource>
#include <vector>

int main() {
  using namespace glake;

  // Compose: physical chunks from memfd, address ranges from mmap, GMLake-style stitching.
  config cfg = config::from_env();  // GLAKE_ALLOC_CONF="frag_limit:2MiB,..." or GMLake's variables
  cfg.frag_limit = 2 * MiB;         // stitch any request that no free block can serve
  host_stitching_allocator<> allocator(host_provider(), host_reserver(), cfg);  // glake/presets.hpp

  // Fragment: four 8 MiB blocks, free every other one.
  void* blocks[4];
  for (void*& b : blocks) b = allocator.allocate(8 * MiB);
  allocator.deallocate(blocks[0], 8 * MiB);
  allocator.deallocate(blocks[2], 8 * MiB);

  // 16 MiB fits in no free block, but the two free ones are stitched into one contiguous range.
  auto* big = static_cast<char*>(allocator.allocate(16 * MiB));
  std::memset(big, 42, 16 * MiB);
  const statistics s = allocator.stats();
  std::printf("stitches: %llu, reserved: %s, active: %s\n", static_cast<unsigned long long>(s.stitches),
              format_bytes(s.reserved_bytes).c_str(), format_bytes(s.active_bytes).c_str());

  // The same allocator behind standard containers.
  pmr_resource resource(allocator);
  std::pmr::vector<int> numbers({1, 2, 3}, &resource);

  allocator.deallocate(big, 16 * MiB);
  allocator.deallocate(blocks[1], 8 * MiB);
  allocator.deallocate(blocks[3], 8 * MiB);
  return s.stitches == 1 && s.reserved_bytes == 32 * MiB && numbers.size() == 3 ? 0 : 1;
}
