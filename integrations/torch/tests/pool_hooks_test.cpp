// The plug-in's private-pool hooks called as PyTorch calls them: through function pointers of
// CUDAPluggableAllocator's C++ types (a MempoolId_t pair, a std::function filter), over
// libglake_torch_sim.so loaded with dlopen as torch loads the plug-in.
//
//   glake_torch_pool_hooks_test <path of libglake_torch_sim.so>
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>

struct CUstream_st;

namespace {

// PyTorch's types (torch/csrc/cuda/CUDAPluggableAllocator.h, torch 2.11).
using mempool_id = std::pair<unsigned long long, unsigned long long>;
using begin_fn = void (*)(int, mempool_id, std::function<bool(CUstream_st*)>);
using end_fn = void (*)(int, mempool_id);
using malloc_fn = void* (*)(std::size_t, int, CUstream_st*);
using free_fn = void (*)(void*, std::size_t, int, CUstream_st*);
using stats_fn = std::size_t (*)(int, std::uint64_t*, std::size_t);
using names_fn = const char* (*)();

int failures = 0;
void check(bool ok, const char* what) {
  std::printf("%s: %s\n", ok ? "ok" : "FAILED", what);
  failures += ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <libglake_torch_sim.so>\n", argv[0]);
    return 2;
  }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    std::fprintf(stderr, "dlopen: %s\n", dlerror());
    return 2;
  }
  // What torch does with the addresses Python hands it: casts them to its function types.
  const auto begin = reinterpret_cast<begin_fn>(dlsym(lib, "glake_begin_allocate_to_pool"));
  const auto end = reinterpret_cast<end_fn>(dlsym(lib, "glake_end_allocate_to_pool"));
  const auto release = reinterpret_cast<end_fn>(dlsym(lib, "glake_release_pool"));
  const auto alloc = reinterpret_cast<malloc_fn>(dlsym(lib, "glake_malloc"));
  const auto dealloc = reinterpret_cast<free_fn>(dlsym(lib, "glake_free"));
  const auto stats = reinterpret_cast<stats_fn>(dlsym(lib, "glake_stats"));
  const auto names = reinterpret_cast<names_fn>(dlsym(lib, "glake_stats_names"));
  check(begin && end && release && alloc && dealloc && stats && names, "the hooks are exported unmangled");
  if (failures != 0) return 1;

  const auto stat = [&](int device, const std::string& name) {
    std::uint64_t values[64] = {};
    const std::size_t count = stats(device, values, 64);
    std::string all = names();
    std::size_t index = 0, at = 0;
    while (at < all.size() && index < count) {
      const std::size_t comma = all.find(',', at);
      if (all.substr(at, comma - at) == name) return values[index];
      at = comma == std::string::npos ? all.size() : comma + 1;
      ++index;
    }
    return ~std::uint64_t{0};
  };

  const int device = 3;
  auto* capturing = reinterpret_cast<CUstream_st*>(0x42);
  auto* other = reinterpret_cast<CUstream_st*>(0x43);
  const mempool_id pool{1, 7};
  int filter_calls = 0;
  begin(device, pool, [&](CUstream_st* s) {
    ++filter_calls;
    return s == capturing;
  });
  void* in_pool = alloc(64 << 20, device, capturing);
  void* general = alloc(64 << 20, device, other);
  check(in_pool != nullptr && general != nullptr, "both requests served");
  check(filter_calls == 2, "the filter decides each request while the capture is under way");
  dealloc(in_pool, 64 << 20, device, capturing);
  end(device, pool);
  void* after = alloc(64 << 20, device, capturing);
  check(filter_calls == 2, "no filter once the capture ended");
  check(after != in_pool, "the pool's free block is not handed to a request after the capture");
  const std::uint64_t reserved = stat(device, "reserved_bytes");
  check(reserved >= 3 * (64u << 20), "statistics count the pool's memory");
  release(device, pool);
  check(stat(device, "reserved_bytes") == reserved - (64u << 20), "a released pool without blocks gives its memory back");
  check(stat(device, "errors") == 0, "no error logged");
  dealloc(general, 64 << 20, device, other);
  dealloc(after, 64 << 20, device, capturing);
  return failures == 0 ? 0 : 1;
}
