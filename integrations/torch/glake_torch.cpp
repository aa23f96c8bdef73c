// libglake_torch.so: glake's stitching allocator behind PyTorch's CUDAPluggableAllocator, one
// allocator per device (pluggable_allocator over a device_registry). Built with
// GLAKE_TORCH_SIMULATED=1 it serves each device from a simulated 80 GiB GPU instead: the same
// C interface, for tests on machines without one (libglake_torch_sim.so).
//
// Settings: torch_plugin::settings_from_env() when a device's allocator is made (its first
// request). GLAKE_TRACE=<pattern> records each device's requests (trace_file_name: %d device,
// %p pid, %r $RANK). Every function is noexcept except glake_torch_malloc (see glake_torch.h).
#include "glake_torch.h"

#if GLAKE_TORCH_WITH_C10
#include <c10/util/Exception.h>
#endif

#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "glake/adaptors/pluggable_allocator.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/memory_snapshot.hpp"
#include "glake/policies/eviction.hpp"
#include "glake/policies/locking.hpp"
#include "glake/policies/stitching.hpp"
#include "glake/movers/virtual_buffer.hpp"
#include "movable.hpp"
#include "plugin_core.hpp"
#include "scheduled.hpp"
#include "settings.hpp"
#include "shared_weights.hpp"

#if GLAKE_TORCH_SIMULATED
#include <sys/mman.h>

#include "glake/backends/sim.hpp"
#include "glake/presets.hpp"
#include "glake/sharing/host_sharing.hpp"
#else
#include <cuda.h>

#include "glake/backends/cuda.hpp"
#include "glake/cuda_presets.hpp"
#include "glake/sharing/cuda_sharing.hpp"
#endif

namespace {

using namespace glake;

#if GLAKE_TORCH_SIMULATED

using allocator_type = shared_sim_stitching_allocator;
using device_scope = no_device_scope;
constexpr const char* backend_name = "simulated";

constexpr std::size_t simulated_device_bytes = 80 * GiB;

// One simulated device per device id, shared by its general allocator, its private pools and
// its movable buffers as a GPU's memory and addresses are; it lives as long as the process, as
// the allocators do (see plugin()). Its host tier is unlimited.
sim_device& simulated_device(int device) {
  static std::mutex mutex;
  static std::array<sim_device*, 64> devices{};
  std::lock_guard guard(mutex);
  sim_device*& d = devices.at(static_cast<std::size_t>(device));
  if (d == nullptr) d = new sim_device(simulated_device_bytes);
  return *d;
}

std::unique_ptr<allocator_type> make_allocator(int device, const config& settings) {
  sim_device& d = simulated_device(device);
  auto a = std::make_unique<allocator_type>(sim_provider{d}, sim_reserver{d}, settings);
  a->attach_far_memory(sim_host_provider{d}, sim_copier{d});  // offload of the allocator's blocks
  return a;
}

using movable_buffer = virtual_buffer<sim_provider, sim_host_provider, sim_reserver, sim_copier>;

std::unique_ptr<movable_buffer> make_movable(std::size_t bytes, int device) {
  sim_device& d = simulated_device(device);
  return std::make_unique<movable_buffer>(sim_provider{d}, sim_host_provider{d}, sim_reserver{d}, sim_copier{d},
                                          bytes);
}

std::size_t device_total_bytes(int) { return simulated_device_bytes; }

// A scheduler's copy streams: numbers on the simulated devices, whose moves complete on return.
std::shared_ptr<void> make_copy_streams(int, stream_ref& offloads, stream_ref& prefetches) {
  offloads = stream_ref{std::uintptr_t{0x6c616b65}};
  prefetches = stream_ref{std::uintptr_t{0x6c616b66}};
  return nullptr;
}

// Shared weights (glake_shared_create): the simulated devices have no bytes to share, so host
// memory stands in for device memory, shared through memfds as the host backend of the dedup
// client does; 2 MiB pieces, as on a GPU.
struct host_region_maker {
  static constexpr std::size_t piece = 2 * MiB;
  std::size_t granularity() const noexcept { return piece; }
  void* make(std::size_t bytes, int) {
    void* p = ::mmap(nullptr, bytes + piece, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw out_of_memory(bytes, 0, 0, "glake_shared_create: mmap of " + format_bytes(bytes) + " failed");
    auto* start = static_cast<char*>(p);
    auto* aligned = reinterpret_cast<char*>((reinterpret_cast<std::uintptr_t>(start) + piece - 1) / piece * piece);
    if (aligned != start) ::munmap(start, static_cast<std::size_t>(aligned - start));
    const std::size_t tail = piece - static_cast<std::size_t>(aligned - start);
    if (tail != 0) ::munmap(aligned + bytes, tail);
    return aligned;
  }
  void unmake(void* p, std::size_t bytes) noexcept { ::munmap(p, bytes); }
  host_shareable_backend backend(int) const { return host_shareable_backend{}; }
  std::vector<std::string> broker_arguments(int) const { return {}; }
};
static_assert(torch_plugin::region_maker<host_region_maker>);
using weights_registry = torch_plugin::shared_weights_registry<host_region_maker, fast_content_hasher>;

#else

using allocator_type = shared_gpu_stitching_allocator;

/// Makes the device's primary context (PyTorch's) current for one call and restores the caller's
/// afterwards. PyTorch calls alloc_fn with the device current, but frees, record_stream and
/// empty_cache may come from a thread whose current device is another; the allocator records
/// events and synchronizes, which act on the current context. Costs one cuCtxGetCurrent when the
/// context is already the right one.
class cuda_device_scope {
 public:
  explicit cuda_device_scope(int device) noexcept {
    CUcontext wanted = primary_context(device);
    if (wanted == nullptr || cuCtxGetCurrent(&previous_) != CUDA_SUCCESS || previous_ == wanted) return;
    switched_ = cuCtxSetCurrent(wanted) == CUDA_SUCCESS;
  }
  cuda_device_scope(const cuda_device_scope&) = delete;
  cuda_device_scope& operator=(const cuda_device_scope&) = delete;
  ~cuda_device_scope() {
    if (switched_) (void)cuCtxSetCurrent(previous_);
  }

 private:
  // Retained once per device and never released: the process keeps using them.
  static CUcontext primary_context(int device) noexcept {
    static std::array<std::atomic<CUcontext>, 64> contexts{};
    if (device < 0 || static_cast<std::size_t>(device) >= contexts.size()) return nullptr;
    auto& slot = contexts[static_cast<std::size_t>(device)];
    if (CUcontext known = slot.load(std::memory_order_acquire)) return known;
    CUdevice handle{};
    CUcontext context = nullptr;
    if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&handle, device) != CUDA_SUCCESS ||
        cuDevicePrimaryCtxRetain(&context, handle) != CUDA_SUCCESS) {
      return nullptr;
    }
    CUcontext expected = nullptr;
    if (!slot.compare_exchange_strong(expected, context, std::memory_order_acq_rel)) {
      (void)cuDevicePrimaryCtxRelease(handle);
      return expected;
    }
    return context;
  }

  CUcontext previous_ = nullptr;
  bool switched_ = false;
};
using device_scope = cuda_device_scope;
constexpr const char* backend_name = "cuda";

std::unique_ptr<allocator_type> make_allocator(int device, const config& settings) {
  auto a = std::make_unique<allocator_type>(cuda_provider(device), cuda_reserver(device), settings);
  // Host-NUMA memory for offloading the allocator's blocks; where the driver offers none, the
  // allocator works without (an offload then says so).
  try {
    a->attach_far_memory(cuda_host_provider(device), cuda_copier{});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "glake: device %d: no host memory for offload (%s)\n", device, e.what());
  }
  return a;
}

using movable_buffer = virtual_buffer<cuda_provider, cuda_host_provider, cuda_reserver, cuda_copier>;

std::unique_ptr<movable_buffer> make_movable(std::size_t bytes, int device) {
  return std::make_unique<movable_buffer>(cuda_provider(device), cuda_host_provider(device), cuda_reserver(device),
                                          cuda_copier{}, bytes);
}

// Shared weights (glake_shared_create): 2 MiB pieces, each mapped on a handle released at once,
// so that the mapping holds the only reference and the dedup client's remap gives it back.
struct cuda_region_maker {
  static constexpr std::size_t piece = 2 * MiB;  // the device granularity on every GPU glake runs on
  std::size_t granularity() const noexcept { return piece; }
  void* make(std::size_t bytes, int device) {
    device_scope scope(device);
    cuda_reserver reserver(device);
    cuda_provider provider(device);
    if (piece % reserver.granularity() != 0) {
      throw usage_error(usage_error::kind::bad_argument, "glake_shared_create: the device's granularity (" +
                                                             std::to_string(reserver.granularity()) +
                                                             " bytes) does not divide 2 MiB");
    }
    void* p = reserver.try_reserve(bytes);
    if (p == nullptr) throw out_of_memory(bytes, 0, 0, "glake_shared_create: out of address space");
    std::size_t mapped = 0;
    try {
      for (; mapped < bytes; mapped += piece) {
        const std::optional<CUmemGenericAllocationHandle> h = provider.try_create(piece);
        if (!h) throw out_of_memory(bytes, 0, 0, "glake_shared_create: out of device memory for " + format_bytes(bytes));
        const bool ok = reserver.try_map(static_cast<char*>(p) + mapped, piece, *h);
        provider.release(*h);  // the mapping keeps it
        if (!ok) throw out_of_memory(bytes, 0, 0, "glake_shared_create: mapping ran out of resources");
      }
      if (!reserver.try_set_access(p, bytes)) throw out_of_memory(bytes, 0, 0, "glake_shared_create: cuMemSetAccess ran out of resources");
    } catch (...) {
      unmap_pieces(p, mapped);
      (void)cuMemAddressFree(reinterpret_cast<CUdeviceptr>(p), bytes);
      throw;
    }
    return p;
  }
  // Piece by piece: a mapping is unmapped whole (the dedup client may have replaced any of them).
  void unmake(void* p, std::size_t bytes) noexcept {
    unmap_pieces(p, bytes);
    (void)cuMemAddressFree(reinterpret_cast<CUdeviceptr>(p), bytes);
  }
  cuda_shareable_backend backend(int device) const { return cuda_shareable_backend(device); }
  // Device memory needs glake-dedup-cuda, told the device.
  std::vector<std::string> broker_arguments(int device) const { return {"--device", std::to_string(device)}; }

 private:
  static void unmap_pieces(void* p, std::size_t bytes) noexcept {
    for (std::size_t at = 0; at < bytes; at += piece) {
      (void)cuMemUnmap(reinterpret_cast<CUdeviceptr>(static_cast<char*>(p) + at), piece);
    }
  }
};
static_assert(torch_plugin::region_maker<cuda_region_maker>);
using weights_registry = torch_plugin::shared_weights_registry<cuda_region_maker, cuda_device_hasher>;

/// The device's memory (cuDeviceTotalMem), what PyTorch's memory fraction is a fraction of; 0
/// when the driver cannot say.
std::size_t device_total_bytes(int device) {
  CUdevice handle{};
  std::size_t total = 0;
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&handle, device) != CUDA_SUCCESS ||
      cuDeviceTotalMem(&total, handle) != CUDA_SUCCESS) {
    return 0;
  }
  return total;
}

// A scheduler's copy streams on `device`: two non-blocking streams (offloads and prefetches use
// the device's two copy directions at once), destroyed with the scheduler. Work still queued
// there completes after cuStreamDestroy; the allocator waits for the copies by their events.
std::shared_ptr<void> make_copy_streams(int device, stream_ref& offloads, stream_ref& prefetches) {
  struct streams {
    int device = 0;
    CUstream out = nullptr;
    CUstream in = nullptr;
    ~streams() {
      const cuda_device_scope scope(device);
      if (out != nullptr) (void)cuStreamDestroy(out);
      if (in != nullptr) (void)cuStreamDestroy(in);
    }
  };
  auto made = std::make_shared<streams>();
  made->device = device;
  const cuda_device_scope scope(device);
  detail::cuda_check(cuStreamCreate(&made->out, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  detail::cuda_check(cuStreamCreate(&made->in, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  offloads = stream_ref{made->out};
  prefetches = stream_ref{made->in};
  return made;
}

#endif

using plugin_type = pluggable_allocator<allocator_type, device_scope>;

plugin_type::options plugin_options() {
  plugin_type::options o;
  if (const char* pattern = std::getenv("GLAKE_TRACE"); pattern != nullptr) o.trace_pattern = pattern;
  o.pid = static_cast<long>(::getpid());
  if (const char* rank = std::getenv("RANK"); rank != nullptr) o.rank = rank;
  try {
    o.header.push_back("settings: " + torch_plugin::settings_from_env().to_string());
  } catch (const std::exception& e) {
    o.header.push_back(std::string("settings: invalid: ") + e.what());
  }
  o.header.push_back(std::string("backend: ") + backend_name);
  return o;
}

// Intentionally never destroyed. PyTorch frees tensors while the interpreter shuts down and from
// static destructors of its own libraries, which run after this library's static destructors
// (it was loaded later, so it is finalized earlier): a registry destroyed at exit would then be
// used after its destruction. The memory it holds goes back to the driver with the process.
plugin_type& plugin() {
  static plugin_type* const instance = new plugin_type(
      [](int device) { return make_allocator(device, torch_plugin::settings_from_env()); }, plugin_options());
  return *instance;
}

// The movable buffers (glake_movable_create), never destroyed for the same reason as plugin().
torch_plugin::movable_registry<movable_buffer>& movables() {
  static auto* const instance = new torch_plugin::movable_registry<movable_buffer>(
      [](std::size_t bytes, int device) {
        device_scope scope(device);
        return make_movable(bytes, device);
      });
  return *instance;
}

// Why the calling thread's last movable-buffer call failed (glake_last_error).
thread_local std::string last_error;

// GLAKE_PREFETCH_RELEASE (read once): "completed" makes prefetches release only cached memory
// whose frees completed; anything else ("wait", the default) releases what they need, waiting.
bool prefetch_release_completed() {
  static const bool completed = [] {
    const char* v = std::getenv("GLAKE_PREFETCH_RELEASE");
    return v != nullptr && std::strcmp(v, "completed") == 0;
  }();
  return completed;
}

// The calling thread's movable scope (glake_set_movable_scope): requests of at least this many
// bytes get movable buffers of their own; 0: none do.
thread_local std::size_t movable_min_bytes = 0;

bool in_movable_scope(std::size_t bytes) noexcept { return movable_min_bytes != 0 && bytes >= movable_min_bytes; }

// A movable buffer for an allocation; out of memory once both caches were released is thrown.
void* movable_allocate(std::size_t bytes, int device, stream_ref stream) {
  device_scope scope(device);
  try {
    return movables().acquire(bytes, device, stream);
  } catch (const out_of_memory&) {
    movables().release_cached(device);
    plugin().release_cached(device);
    return movables().acquire(bytes, device, stream);
  }
}

// Runs a movable-buffer call: 0, or after one line on stderr (kept for glake_last_error) -1 for
// misuse, -2 for out of memory, -3 for any other failure.
template <class F>
int movable_call(const char* what, const void* ptr, F&& f) noexcept {
  auto fail = [&](int code, const char* message) {
    try {
      last_error = message;
    } catch (...) {
    }
    std::fprintf(stderr, "glake: %s of %p failed: %s\n", what, ptr, message);
    return code;
  };
  try {
    f();
    last_error.clear();
    return 0;
  } catch (const usage_error& e) {
    return fail(-1, e.what());
  } catch (const out_of_memory& e) {
    return fail(-2, e.what());
  } catch (const std::exception& e) {
    return fail(-3, e.what());
  } catch (...) {
    return fail(-3, "unknown exception");
  }
}

// Host time spent inside the plug-in's allocation calls, for telling a training step's allocator
// cost apart from everything else in it. Off unless GLAKE_HOST_TIMING is set (to anything but
// "" or "0") when the plug-in is first called: two clock reads per call are not free.
struct host_timing {
  bool on = false;
  std::atomic<std::uint64_t> ns{0};
  std::atomic<std::uint64_t> calls{0};
};

host_timing& timing() noexcept {
  static host_timing* const instance = [] {
    auto* t = new host_timing;
    const char* v = std::getenv("GLAKE_HOST_TIMING");
    t->on = v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
    return t;
  }();
  return *instance;
}

class timed_call {
 public:
  timed_call() noexcept : t_(timing()) {
    if (t_.on) start_ = std::chrono::steady_clock::now();
  }
  timed_call(const timed_call&) = delete;
  timed_call& operator=(const timed_call&) = delete;
  ~timed_call() {
    if (!t_.on) return;
    const auto spent = std::chrono::steady_clock::now() - start_;
    t_.ns.fetch_add(static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(spent).count()),
                    std::memory_order_relaxed);
    t_.calls.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  host_timing& t_;
  std::chrono::steady_clock::time_point start_{};
};

// ------------------------------------------------------------------ snapshots
// PyTorch's snapshot (torch.cuda.memory._snapshot()) as JSON, which glake_torch turns into the
// dict PyTorch's viewers read: glake/memory_snapshot.hpp writes it (its conventions are there),
// over every device the plug-in serves, each pool of each device in turn.
struct snapshot_visitor {
  memory_snapshot_writer& w;
  // The visitor of plugin_type::visit_state.
  void allocator(plugin_type::pool_id pool) { w.pool(pool.first, pool.second); }
  void segment(const segment_view& s) { w.segment(s); }
  void block(const block_view& b) { w.block(b); }
  void stitched(const stitched_view& r) { w.stitched(r); }
  void piece(const stitched_piece_view& p) { w.piece(p); }
};

std::string snapshot_json() {
  constexpr int max_devices = 64;
  memory_snapshot_writer w;
  snapshot_visitor v{w};
  std::vector<std::vector<history_entry>> traces;
  for (int d = 0; d < max_devices; ++d) {
    if (plugin().find(d) == nullptr) continue;
    w.device(d);
    plugin().visit_state(d, v);
    traces.resize(static_cast<std::size_t>(d) + 1);
  }
  for (std::size_t d = 0; d < traces.size(); ++d) traces[d] = plugin().history(static_cast<int>(d));
  return w.json(traces);
}

void copy_text(const std::string& text, char* buffer, std::size_t size) noexcept {
  if (buffer == nullptr || size == 0) return;
  const std::size_t n = std::min(text.size(), size - 1);
  std::memcpy(buffer, text.data(), n);
  buffer[n] = '\0';
}

// Schedulers (below) of `device` move unpinned managed memory out until `bytes` went; the bytes
// moved. For an allocation the device refused.
std::size_t relieve_schedulers(int device, std::size_t bytes);

// An allocation the device refused retries after the device's schedulers moved managed memory
// out: memory the budget does not see (activations, another process's) goes before the
// residence of managed tensors. Throws out_of_memory once nothing more can move.
void* allocate_relieving(std::size_t size, int device, stream_ref stream) {
  for (;;) {
    try {
      return plugin().allocate_or_throw(size, device, stream);
    } catch (const out_of_memory&) {
      if (relieve_schedulers(device, size) == 0) throw;
    }
  }
}

}  // namespace

extern "C" {

GLAKE_TORCH_API void* glake_malloc(size_t size, int device, CUstream_st* stream) {
  const timed_call timed;
  if (in_movable_scope(size)) {
    try {
      return movable_allocate(size, device, stream_ref{stream});
    } catch (const std::exception& e) {
      std::fprintf(stderr, "glake: a movable allocation of %zu bytes on device %d failed: %s\n", size, device, e.what());
      return nullptr;
    }
  }
  try {
    void* p = plugin().allocate(size, device, stream_ref{stream});
    while (p == nullptr && relieve_schedulers(device, size) != 0) p = plugin().allocate(size, device, stream_ref{stream});
    return p;
  } catch (...) {
    return nullptr;  // only if the plug-in itself could not be made
  }
}

GLAKE_TORCH_API void* glake_torch_malloc(size_t size, int device, CUstream_st* stream) {
  const timed_call timed;
  if (in_movable_scope(size)) {
#if GLAKE_TORCH_WITH_C10
    try {
      return movable_allocate(size, device, stream_ref{stream});
    } catch (const out_of_memory& e) {
      throw c10::OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, static_cast<std::uint32_t>(__LINE__)},
                                  e.what());
    }
#else
    return movable_allocate(size, device, stream_ref{stream});
#endif
  }
#if GLAKE_TORCH_WITH_C10
  // Built against torch's own headers and libc10: out of memory is c10::OutOfMemoryError, which
  // PyTorch raises in Python as torch.cuda.OutOfMemoryError, with glake's message.
  try {
    return allocate_relieving(size, device, stream_ref{stream});
  } catch (const out_of_memory& e) {
    throw c10::OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, static_cast<std::uint32_t>(__LINE__)},
                                e.what());
  }
#else
  return allocate_relieving(size, device, stream_ref{stream});
#endif
}

GLAKE_TORCH_API void glake_free(void* ptr, size_t size, int device, CUstream_st* stream) {
  const timed_call timed;
  try {
    if (movables().holds(ptr)) {
      device_scope scope(device);
      movables().recycle(ptr, stream_ref{stream});
      return;
    }
    plugin().deallocate(ptr, size, device, stream_ref{stream});
  } catch (...) {
  }
}

GLAKE_TORCH_API void glake_record_stream(void* ptr, CUstream_st* stream) {
  const timed_call timed;
  try {
    if (movables().record_stream(ptr, stream_ref{stream})) return;
    plugin().record_stream(ptr, stream_ref{stream});
  } catch (...) {
  }
}

GLAKE_TORCH_API void glake_empty_cache(int device) {
  try {
    movables().release_cached(device);
    plugin().release_cached(device);
  } catch (...) {
  }
}

GLAKE_TORCH_API void glake_empty_cache_all(void) { glake_empty_cache(-1); }

GLAKE_TORCH_API void glake_set_memory_fraction(double fraction, int device) {
  try {
    if (!(fraction >= 0.0 && fraction <= 1.0)) {
      std::fprintf(stderr, "glake: memory fraction %g for device %d is not within [0, 1]; ignored\n", fraction, device);
      return;
    }
    const std::size_t total = device_total_bytes(device);
    if (total == 0) {
      std::fprintf(stderr, "glake: the size of device %d is unknown; memory fraction %g ignored\n", device, fraction);
      return;
    }
    // 1.0 is the whole device: no limit beyond the device's own.
    const auto bytes = fraction >= 1.0 ? std::size_t{0} : static_cast<std::size_t>(fraction * static_cast<double>(total));
    // A fraction of 0 is PyTorch's "nothing may be allocated": the smallest limit there is (0
    // would mean none).
    plugin().set_memory_limit(device, bytes == 0 && fraction < 1.0 ? 1 : bytes);
  } catch (...) {
  }
}

GLAKE_TORCH_API void glake_reset_peak(int device) {
  try {
    plugin().reset_peak(device);
  } catch (...) {
  }
}

GLAKE_TORCH_API size_t glake_stats(int device, uint64_t* values, size_t capacity) {
  try {
    return plugin().stats(device, values, capacity);
  } catch (...) {
    return 0;
  }
}

GLAKE_TORCH_API const char* glake_stats_names(void) {
  static const std::string names = [] {
    std::string text;
    for (const auto name : pluggable_stat_names) text.append(text.empty() ? "" : ",").append(name);
    return text;
  }();
  return names.c_str();
}

GLAKE_TORCH_API int glake_settings(char* buffer, size_t size) {
  try {
    copy_text(torch_plugin::settings_from_env().to_string(), buffer, size);
    return 0;
  } catch (const std::exception& e) {
    copy_text(e.what(), buffer, size);
    return -1;
  } catch (...) {
    copy_text("unknown error", buffer, size);
    return -1;
  }
}

GLAKE_TORCH_API const char* glake_backend(void) { return backend_name; }

GLAKE_TORCH_API int glake_host_time(uint64_t* ns, uint64_t* calls) {
  const host_timing& t = timing();
  if (ns != nullptr) *ns = t.ns.load(std::memory_order_relaxed);
  if (calls != nullptr) *calls = t.calls.load(std::memory_order_relaxed);
  return t.on ? 1 : 0;
}

GLAKE_TORCH_API int glake_record_history(int enabled, size_t max_entries) {
  try {
    return plugin().record_history(enabled != 0, max_entries) ? 0 : -1;
  } catch (...) {
    return -1;
  }
}

GLAKE_TORCH_API size_t glake_snapshot(char* buffer, size_t size) {
  try {
    const std::string text = snapshot_json();
    if (buffer != nullptr && size > text.size()) {
      std::memcpy(buffer, text.data(), text.size());
      buffer[text.size()] = '\0';
    }
    return text.size();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "glake: taking a snapshot failed: %s\n", e.what());
    return 0;
  } catch (...) {
    return 0;
  }
}

GLAKE_TORCH_API void glake_flush_traces(void) {
  try {
    plugin().flush_traces();
  } catch (...) {
  }
}

GLAKE_TORCH_API void* glake_movable_create(size_t bytes, int device) {
  void* p = nullptr;
  movable_call("creating a movable buffer", nullptr, [&] { p = movables().create(bytes, device); });
  return p;
}

GLAKE_TORCH_API int glake_movable_destroy(void* ptr) {
  return movable_call("destroying the movable buffer", ptr, [&] {
    if (!movables().destroy(ptr)) {
      throw usage_error(usage_error::kind::foreign_pointer, "it is not the first address of a movable buffer");
    }
  });
}

GLAKE_TORCH_API int glake_offload_many(void* const* ptrs, size_t count, CUstream_st* stream) {
  return movable_call("offloading", count != 0 ? ptrs[0] : nullptr, [&] {
    for (std::size_t i = 0; i < count; ++i) {
      if (!movables().contains(ptrs[i])) {
        plugin().offload(ptrs[i], stream_ref{stream});  // one of the allocator's blocks
        continue;
      }
      movables().with(ptrs[i], [&](movable_buffer& b, int device) {
        device_scope scope(device);
        b.offload(0, b.size(), stream_ref{stream});
      });
    }
  });
}

GLAKE_TORCH_API int glake_offload(void* ptr, CUstream_st* stream) { return glake_offload_many(&ptr, 1, stream); }

GLAKE_TORCH_API int glake_prefetch_many(void* const* ptrs, size_t count, CUstream_st* stream) {
  return movable_call("prefetching movable buffers", count != 0 ? ptrs[0] : nullptr, [&] {
    // The memory comes back in place of what glake's allocator caches on the device (memory
    // that the offloads freed and the allocator grew into meanwhile), not on top of it: what the
    // buffers need is released from the cache first. GLAKE_PREFETCH_RELEASE=wait (the default)
    // releases it after waiting for the device once; =completed releases only memory whose
    // frees have completed, never waiting, and takes fresh memory for the rest (faster, but the
    // peak may keep the cache and the buffers both: bench/results/offload.md). When the device
    // is still short of memory, the whole cache goes.
    std::array<std::size_t, 64> needed{};
    for (std::size_t i = 0; i < count; ++i) {
      if (!movables().contains(ptrs[i])) continue;  // an allocator block: its prefetch makes room itself
      movables().with(ptrs[i], [&](movable_buffer& b, int device) {
        if (device >= 0 && static_cast<std::size_t>(device) < needed.size()) needed[device] += b.stats().host_bytes;
      });
    }
    for (std::size_t d = 0; d < needed.size(); ++d) {
      if (needed[d] == 0) continue;
      if (prefetch_release_completed()) {
        plugin().release_completed(static_cast<int>(d), needed[d]);
      } else {
        plugin().release_cached(static_cast<int>(d), needed[d]);
      }
    }
    for (std::size_t i = 0; i < count; ++i) {
      if (!movables().contains(ptrs[i])) {
        plugin().prefetch(ptrs[i], stream_ref{stream});
        continue;
      }
      movables().with(ptrs[i], [&](movable_buffer& b, int device) {
        device_scope scope(device);
        try {
          b.prefetch(0, b.size(), stream_ref{stream});
        } catch (const out_of_memory&) {
          plugin().release_cached(device);
          b.prefetch(0, b.size(), stream_ref{stream});
        }
      });
    }
  });
}

GLAKE_TORCH_API int glake_prefetch(void* ptr, CUstream_st* stream) { return glake_prefetch_many(&ptr, 1, stream); }

GLAKE_TORCH_API int glake_keep_far_copy(void* ptr, int keep) {
  return movable_call(keep != 0 ? "marking read-only" : "unmarking", ptr,
                      [&] { plugin().keep_far_copy(ptr, keep != 0); });
}

GLAKE_TORCH_API size_t glake_far_copy_bytes(void) {
  try {
    return plugin().far_copy_bytes();
  } catch (...) {
    return 0;
  }
}

GLAKE_TORCH_API int glake_residence(const void* ptr) {
  try {  // a question, not a failure: no line on stderr for a pointer outside every buffer
    if (!movables().contains(ptr)) {
      const std::optional<residence> r = plugin().residence_of(ptr);
      return r ? static_cast<int>(*r) : -1;
    }
    return movables().with(ptr, [&](movable_buffer& b, int) { return static_cast<int>(b.residence_of(0)); });
  } catch (...) {
    return -1;
  }
}

GLAKE_TORCH_API size_t glake_movable_stats(uint64_t* values, size_t capacity) {
  try {
    const auto t = movables().totals();
    const std::uint64_t all[] = {t.buffers,         t.device_bytes,     t.host_bytes,
                                 t.cached_host_bytes, t.offloaded_bytes, t.prefetched_bytes,
                                 t.cached_buffer_bytes, t.cache_reuses};
    for (std::size_t i = 0; i < capacity && i < std::size(all); ++i) values[i] = all[i];
    return std::size(all);
  } catch (...) {
    return 0;
  }
}

GLAKE_TORCH_API size_t glake_set_movable_scope(size_t min_bytes) {
  const std::size_t previous = movable_min_bytes;
  movable_min_bytes = min_bytes;
  return previous;
}

GLAKE_TORCH_API size_t glake_last_error(char* buffer, size_t size) {
  copy_text(last_error, buffer, size);
  return last_error.size();
}

}  // extern "C"

// Shared weights: regions of device memory of their own (shared_weights.hpp), published to a
// dedup broker. Never destroyed, for the same reason as plugin(): the process's end unmaps them
// and its connections' end drops their references at the broker.
namespace {
weights_registry& shared_weights() {
  static auto* const instance = new weights_registry();
  return *instance;
}
}  // namespace

extern "C" {

GLAKE_TORCH_API void* glake_shared_create(size_t bytes, int device) {
  void* p = nullptr;
  movable_call("creating a shared region", nullptr, [&] { p = shared_weights().create(bytes, device); });
  return p;
}

GLAKE_TORCH_API int glake_share(void* ptr, const char* socket, const char* start_broker, uint64_t* values,
                                size_t capacity) {
  return movable_call("sharing", ptr, [&] {
    const int device = shared_weights().device_of(ptr);
    if (device < 0) {
      throw usage_error(usage_error::kind::foreign_pointer, "it starts no shared region (glake_shared_create)");
    }
    device_scope scope(device);
    const torch_plugin::share_totals t =
        shared_weights().publish(ptr, socket != nullptr ? socket : "", start_broker != nullptr ? start_broker : "");
    const std::uint64_t all[] = {t.pieces, t.shared, t.stored, t.kept_private, t.shared_bytes};
    for (std::size_t i = 0; i < capacity && i < std::size(all); ++i) values[i] = all[i];
  });
}

GLAKE_TORCH_API int glake_shared_destroy(void* ptr) {
  return movable_call("destroying the shared region", ptr, [&] {
    const int device = shared_weights().device_of(ptr);
    device_scope scope(device < 0 ? 0 : device);
    shared_weights().destroy(ptr);
  });
}

}  // extern "C"

// Swap schedulers over the allocator's blocks (scheduled.hpp), made and destroyed through the C
// interface; a handle is the workload's address, checked against the set of live ones.
namespace {
std::mutex& schedulers_mutex() {
  static auto* const m = new std::mutex();
  return *m;
}
std::set<torch_plugin::scheduled_workload*>& schedulers() {
  static auto* const s = new std::set<torch_plugin::scheduled_workload*>();
  return *s;
}
std::size_t relieve_schedulers(int device, std::size_t bytes) {
  std::size_t freed = 0;
  try {
    std::lock_guard guard(schedulers_mutex());  // held: a scheduler is not destroyed meanwhile
    for (torch_plugin::scheduled_workload* w : schedulers()) {
      if (w->device == device && freed < bytes) freed += w->relieve(bytes - freed);
    }
  } catch (...) {
  }
  return freed;
}
torch_plugin::scheduled_workload& scheduler_of(void* handle) {
  std::lock_guard guard(schedulers_mutex());
  auto it = schedulers().find(static_cast<torch_plugin::scheduled_workload*>(handle));
  if (it == schedulers().end()) {
    throw usage_error(usage_error::kind::foreign_pointer, "it is not a scheduler made by glake_scheduler_create");
  }
  return **it;
}
}  // namespace

static_assert(deferring_tiered_memory<torch_plugin::plugin_block<plugin_type>>);

extern "C" {

GLAKE_TORCH_API void* glake_scheduler_create_with(int device, size_t budget_bytes, const char* socket,
                                                  const char* name, CUstream_st* stream, int moves) {
  torch_plugin::scheduled_workload* made = nullptr;
  movable_call("creating a scheduler", nullptr, [&] {
    if (budget_bytes == 0) throw usage_error(usage_error::kind::bad_argument, "a budget of 0 bytes");
    if (moves < 0 || moves > 2) {
      throw usage_error(usage_error::kind::bad_argument,
                        "moves must be 0 (wait), 1 (deferred) or 2 (deferred, on copy streams), not " +
                            std::to_string(moves));
    }
    scheduler_options options;
    options.stream = stream_ref{stream};
    options.moves = moves != 0 ? move_completion::deferred : move_completion::on_return;
    std::shared_ptr<void> streams;
    if (moves == 2) {
      stream_ref out, in;
      streams = make_copy_streams(device, out, in);
      options.offload_copies = out;
      options.prefetch_copies = in;
    }
    std::string workload = name != nullptr && *name != '\0' ? name : "pid " + std::to_string(::getpid());
    workload += " on device " + std::to_string(device);
    std::unique_ptr<torch_plugin::scheduled_workload> w;
    if (socket != nullptr && *socket != '\0') {
      w = std::make_unique<torch_plugin::scheduled_workload_of<plugin_type, coordinated_budget>>(
          plugin(), std::move(workload), options, std::string(socket), budget_bytes);
    } else {
      w = std::make_unique<torch_plugin::scheduled_workload_of<plugin_type, shared_budget>>(
          plugin(), std::move(workload), options, budget_bytes);
    }
    w->resources = std::move(streams);
    w->device = device;
    std::lock_guard guard(schedulers_mutex());
    schedulers().insert(w.get());
    made = w.release();
  });
  return made;
}

GLAKE_TORCH_API void* glake_scheduler_create(int device, size_t budget_bytes, const char* socket, const char* name,
                                             CUstream_st* stream) {
  return glake_scheduler_create_with(device, budget_bytes, socket, name, stream, 0);
}

GLAKE_TORCH_API int glake_scheduler_destroy(void* handle) {
  return movable_call("destroying the scheduler", handle, [&] {
    torch_plugin::scheduled_workload* w = &scheduler_of(handle);
    {
      std::lock_guard guard(schedulers_mutex());
      schedulers().erase(w);
    }
    delete w;
  });
}

GLAKE_TORCH_API int glake_scheduler_manage(void* handle, void* ptr, size_t bytes) {
  return movable_call("managing", ptr, [&] { scheduler_of(handle).manage(ptr, bytes); });
}

GLAKE_TORCH_API int glake_scheduler_unmanage(void* handle, void* ptr) {
  return movable_call("unmanaging", ptr, [&] { scheduler_of(handle).unmanage(ptr); });
}

GLAKE_TORCH_API int glake_scheduler_will_use(void* handle, void* const* ptrs, size_t count) {
  return movable_call("bringing in for use", count != 0 ? ptrs[0] : nullptr,
                      [&] { scheduler_of(handle).will_use(std::span<void* const>(ptrs, count)); });
}

GLAKE_TORCH_API int glake_scheduler_iteration_begin(void* handle) {
  return movable_call("beginning an iteration of", handle, [&] { scheduler_of(handle).iteration_begin(); });
}

GLAKE_TORCH_API int glake_scheduler_idle(void* handle) {
  return movable_call("idling", handle, [&] { scheduler_of(handle).idle(); });
}

GLAKE_TORCH_API int glake_scheduler_settle(void* handle) {
  return movable_call("settling the moves of", handle, [&] { scheduler_of(handle).settle(); });
}

GLAKE_TORCH_API size_t glake_scheduler_stats(void* handle, uint64_t* values, size_t capacity) {
  try {
    return torch_plugin::write_scheduler_stats(scheduler_of(handle).stats(), values, capacity);
  } catch (...) {
    return 0;
  }
}

GLAKE_TORCH_API const char* glake_scheduler_stats_names(void) { return torch_plugin::scheduler_stat_names; }

}  // extern "C"

// PyTorch's C++ hook types (see glake_torch.h); extern "C" for their unmangled names only.
extern "C" {

GLAKE_TORCH_API void glake_begin_allocate_to_pool(int device, std::pair<unsigned long long, unsigned long long> pool,
                                                  std::function<bool(CUstream_st*)> filter) {
  try {
    plugin().begin_allocate_to_pool(
        device, plugin_type::pool_id{pool.first, pool.second},
        [filter = std::move(filter)](stream_ref s) { return filter && filter(s.as<CUstream_st>()); });
  } catch (...) {
  }
}

GLAKE_TORCH_API void glake_end_allocate_to_pool(int device, std::pair<unsigned long long, unsigned long long> pool) {
  try {
    plugin().end_allocate_to_pool(device, plugin_type::pool_id{pool.first, pool.second});
  } catch (...) {
  }
}

GLAKE_TORCH_API void glake_release_pool(int device, std::pair<unsigned long long, unsigned long long> pool) {
  try {
    plugin().release_pool(device, plugin_type::pool_id{pool.first, pool.second});
  } catch (...) {
  }
}

}  // extern "C"

// Copies between device memory and pageable host memory through a staged_copier per device
// (movers/staged_copy.hpp: pinned staging buffers filled and drained by several threads).
// CUDA only: the simulated backend has no device bytes to copy, so libglake_torch_sim.so has no
// glake_copy.
#if !GLAKE_TORCH_SIMULATED
#include "glake/backends/cuda_copy.hpp"
#include "glake/movers/staged_copy.hpp"

namespace {

using torch_copier = staged_copier<cuda_copy_backend, cuda_pointer_classifier>;

// One copier per device, made on its first copy and kept for the life of the process (with its
// threads and pinned buffers), as the allocators are.
torch_copier& copier_for(int device) {
  static std::mutex mutex;
  static std::array<torch_copier*, 64> copiers{};
  std::lock_guard guard(mutex);
  torch_copier*& c = copiers.at(static_cast<std::size_t>(device));
  if (c == nullptr) c = new torch_copier(cuda_copy_backend(device));
  return *c;
}

}  // namespace

extern "C" GLAKE_TORCH_API int glake_copy(void* dst, const void* src, size_t bytes, CUstream_st* stream) {
  return movable_call("copying to", dst, [&] {
    if (bytes == 0) return;
    // The device of whichever side is device memory (a host-to-host copy: device 0's copier).
    const cuda_pointer_classifier classify;
    const pointer_info to = classify.locate(dst);
    const pointer_info from = classify.locate(src);
    int device = to.kind == memory_kind::device ? to.device : from.kind == memory_kind::device ? from.device : 0;
    if (device < 0) device = 0;
    device_scope scope(device);
    copier_for(device).copy(dst, src, bytes, stream_ref{stream});
  });
}

extern "C" GLAKE_TORCH_API int glake_copy_from_file(void* dst, int fd, uint64_t offset, size_t bytes,
                                                    CUstream_st* stream) {
  return movable_call("loading a file into", dst, [&] {
    if (bytes == 0) return;
    const pointer_info to = cuda_pointer_classifier{}.locate(dst);
    if (to.kind != memory_kind::device || to.device < 0) {
      throw usage_error(usage_error::kind::bad_argument,
                        std::string("glake_copy_from_file: the destination is ") + to_string(to.kind) +
                            ", not device memory");
    }
    device_scope scope(to.device);
    copier_for(to.device).copy_from_file(dst, fd, offset, bytes, stream_ref{stream});
  });
}
#endif

// ------------------------------------------------------------------ plugin_core.hpp
namespace glake::torch_plugin::core {

void* allocate(std::size_t bytes, int device, CUstream_st* stream) {
  const timed_call timed;
  if (in_movable_scope(bytes)) return movable_allocate(bytes, device, stream_ref{stream});
  return allocate_relieving(bytes, device, stream_ref{stream});
}

namespace {
// plugin_type::visit_state's visitor, forwarding to a state_sink.
struct sink_visitor {
  state_sink& sink;
  void allocator(plugin_type::pool_id pool) { sink.pool(pool_id{pool.first, pool.second}); }
  void segment(const segment_view& s) { sink.segment(s); }
  void block(const block_view& b) { sink.block(b); }
  void stitched(const stitched_view& r) { sink.stitched(r); }
  void piece(const stitched_piece_view& p) { sink.piece(p); }
};
}  // namespace

bool visit_device_state(int device, state_sink& sink) {
  sink_visitor v{sink};
  return plugin().visit_state(device, v);
}

statistics device_statistics(int device) {
  std::array<std::uint64_t, pluggable_stat_names.size()> v{};
  plugin().stats(device, v.data(), v.size());
  statistics st;
  std::size_t i = 0;
  for (std::size_t* field : {&st.active_bytes, &st.peak_active_bytes, &st.allocated_bytes, &st.peak_allocated_bytes,
                             &st.reserved_bytes, &st.peak_reserved_bytes, &st.cached_stitch_bytes, &st.offloaded_bytes}) {
    *field = static_cast<std::size_t>(v[i++]);
  }
  for (std::uint64_t* field : {&st.allocations, &st.deallocations, &st.failed_allocations, &st.splits, &st.merges,
                               &st.segments_created, &st.segments_released, &st.stitches, &st.stitch_cache_hits,
                               &st.stitch_repairs, &st.stitch_grows, &st.stitch_evictions, &st.cross_stream_bytes,
                               &st.device_waits, &st.stream_joins, &st.events_recorded, &st.event_queries, &st.event_ns}) {
    *field = v[i++];
  }
  st.spare_bytes = static_cast<std::size_t>(v[i++]);
  st.recycled_handles = v[i++];
  for (std::uint64_t& calls : st.driver_calls.counts) calls = v[i++];
  for (std::uint64_t& ns : st.driver_time.ns) ns = v[i++];
  detail::read_move_costs(st.offloads, v.data() + i);
  i += detail::move_cost_values;
  detail::read_move_costs(st.prefetches, v.data() + i);
  return st;
}

std::vector<history_entry> device_history(int device) { return plugin().history(device); }

bool begin_allocate_to_pool(int device, pool_id pool, std::function<bool(CUstream_st*)> filter) {
  return plugin().begin_allocate_to_pool(
      device, plugin_type::pool_id{pool.first, pool.second},
      [filter = std::move(filter)](stream_ref s) { return filter && filter(s.as<CUstream_st>()); });
}

std::size_t pool_use_count(int device, pool_id pool) {
  const auto* pools = plugin().pools(device);
  return pools == nullptr ? 0 : pools->use_count(plugin_type::pool_id{pool.first, pool.second});
}

bool allocating_to_pool(int device, pool_id pool) {
  const auto* pools = plugin().pools(device);
  return pools != nullptr && pools->capturing(plugin_type::pool_id{pool.first, pool.second});
}

std::vector<void*> pool_live_allocations(int device, pool_id pool) {
  const auto* pools = plugin().pools(device);
  return pools == nullptr ? std::vector<void*>{} : pools->live(plugin_type::pool_id{pool.first, pool.second});
}

std::size_t device_total_bytes(int device) { return ::device_total_bytes(device); }

}  // namespace glake::torch_plugin::core
