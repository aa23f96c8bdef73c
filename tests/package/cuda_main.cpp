// Uses glake::cuda through the package: compiled and linked only (see CMakeLists.txt).
#include <glake/allocators/stitching_allocator.hpp>
#include <glake/backends/cuda.hpp>

#include <cstdio>

int main() {
  using allocator = glake::stitching_allocator<glake::cuda_provider, glake::cuda_reserver>;
  try {
    allocator a(glake::cuda_provider(0), glake::cuda_reserver(0));
    void* p = a.allocate(std::size_t{8} << 20);
    a.deallocate(p, std::size_t{8} << 20);
    std::printf("glake cuda consumer: allocated and freed 8 MiB on device 0\n");
  } catch (const std::exception& e) {
    std::printf("glake cuda consumer: %s\n", e.what());
  }
  return 0;
}
