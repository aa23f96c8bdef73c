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
#include <string>

#include "glake/adaptors/pluggable_allocator.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/policies/eviction.hpp"
#include "glake/policies/locking.hpp"
#include "glake/policies/stitching.hpp"
#include "settings.hpp"

#if GLAKE_TORCH_SIMULATED
#include "glake/backends/sim.hpp"
#else
#include <cuda.h>

#include "glake/backends/cuda.hpp"
#endif

namespace {

using namespace glake;

#if GLAKE_TORCH_SIMULATED

using allocator_type =
    stitching_allocator<sim_provider, sim_reserver, best_fit_tail_stitching, lru_eviction, mutex_lock>;
using device_scope = no_device_scope;
constexpr const char* backend_name = "simulated";

constexpr std::size_t simulated_device_bytes = 80 * GiB;

std::unique_ptr<allocator_type> make_allocator(int, const config& settings) {
  // The simulated device lives as long as the process, as the allocators do (see plugin()).
  auto* device = new sim_device(simulated_device_bytes);
  return std::make_unique<allocator_type>(sim_provider{*device}, sim_reserver{*device}, settings);
}

std::size_t device_total_bytes(int) { return simulated_device_bytes; }

#else

using allocator_type =
    stitching_allocator<cuda_provider, cuda_reserver, best_fit_tail_stitching, lru_eviction, mutex_lock>;

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
  return std::make_unique<allocator_type>(cuda_provider(device), cuda_reserver(device), settings);
}

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

void copy_text(const std::string& text, char* buffer, std::size_t size) noexcept {
  if (buffer == nullptr || size == 0) return;
  const std::size_t n = std::min(text.size(), size - 1);
  std::memcpy(buffer, text.data(), n);
  buffer[n] = '\0';
}

}  // namespace

extern "C" {

GLAKE_TORCH_API void* glake_malloc(size_t size, int device, CUstream_st* stream) {
  const timed_call timed;
  try {
    return plugin().allocate(size, device, stream_ref{stream});
  } catch (...) {
    return nullptr;  // only if the plug-in itself could not be made
  }
}

GLAKE_TORCH_API void* glake_torch_malloc(size_t size, int device, CUstream_st* stream) {
  const timed_call timed;
#if GLAKE_TORCH_WITH_C10
  // Built against torch's own headers and libc10: out of memory is c10::OutOfMemoryError, which
  // PyTorch raises in Python as torch.cuda.OutOfMemoryError, with glake's message.
  try {
    return plugin().allocate_or_throw(size, device, stream_ref{stream});
  } catch (const out_of_memory& e) {
    throw c10::OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, static_cast<std::uint32_t>(__LINE__)},
                                e.what());
  }
#else
  return plugin().allocate_or_throw(size, device, stream_ref{stream});
#endif
}

GLAKE_TORCH_API void glake_free(void* ptr, size_t size, int device, CUstream_st* stream) {
  const timed_call timed;
  try {
    plugin().deallocate(ptr, size, device, stream_ref{stream});
  } catch (...) {
  }
}

GLAKE_TORCH_API void glake_record_stream(void* ptr, CUstream_st* stream) {
  const timed_call timed;
  try {
    plugin().record_stream(ptr, stream_ref{stream});
  } catch (...) {
  }
}

GLAKE_TORCH_API void glake_empty_cache(int device) {
  try {
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

GLAKE_TORCH_API void glake_flush_traces(void) {
  try {
    plugin().flush_traces();
  } catch (...) {
  }
}

}  // extern "C"
