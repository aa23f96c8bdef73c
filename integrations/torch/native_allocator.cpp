// glake as PyTorch's own CUDA allocator (native_allocator.hpp has the table of hooks). Compiled
// into libglake_torch.so when torch's headers are there (bench/torch/build_plugin.sh).
#include "native_allocator.hpp"

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "glake/errors.hpp"
#include "glake_torch.h"
#include "plugin_core.hpp"

namespace glake::torch_plugin {
namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::TraceEntry;
using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatType;
using context_ptr = std::shared_ptr<c10::GatheredContext>;

constexpr std::size_t small_size = std::size_t{1} << 20;  // PyTorch's small pool: requests <= 1 MiB
constexpr int max_devices = 64;

std::size_t pool_index(std::size_t bytes) {
  return static_cast<std::size_t>(bytes <= small_size ? StatType::SMALL_POOL : StatType::LARGE_POOL);
}

// A Stat of PyTorch's, for the aggregate and the request's pool.
void increase(c10::CachingAllocator::StatArray& a, std::size_t pool, std::size_t amount) {
  a[static_cast<std::size_t>(StatType::AGGREGATE)].increase(amount);
  a[pool].increase(amount);
}
void decrease(c10::CachingAllocator::StatArray& a, std::size_t pool, std::size_t amount) {
  a[static_cast<std::size_t>(StatType::AGGREGATE)].decrease(amount);
  a[pool].decrease(amount);
}

std::int64_t now_us() {
  using namespace std::chrono;
  return duration_cast<microseconds>(system_clock::now().time_since_epoch()).count();
}

// A live allocation: what its free must tell glake, and the stack that made it.
struct allocation {
  std::size_t size = 0;
  int device = 0;
  cudaStream_t stream = nullptr;
  context_ptr context;
  std::optional<core::pool_id> pool;  // the private pool that served it
};

// The private pool whose filter took the calling thread's last request (set by the filters
// beginAllocateToPool wraps: glake calls them on the requesting thread).
thread_local std::optional<core::pool_id> routed_to;

std::function<bool(cudaStream_t)> noting_filter(core::pool_id id, std::function<bool(cudaStream_t)> filter) {
  return [id, filter = std::move(filter)](cudaStream_t s) {
    const bool taken = filter && filter(s);
    if (taken) routed_to = id;
    return taken;
  };
}

// A private pool's live allocations, as glake's pools keep them (graph_pools::live).
std::unordered_set<void*> live_in_pool(int device, core::pool_id id) {
  const std::vector<void*> live = core::pool_live_allocations(device, id);
  return {live.begin(), live.end()};
}

// A pool's live allocations when graph trees checkpointed it.
struct pool_checkpoint final : cca::AllocatorState {
  struct entry {
    void* ptr = nullptr;
    allocation a;
  };
  int device = 0;
  core::pool_id pool{};
  std::vector<entry> live;  // in address order
};

class native_allocator;
native_allocator* installed = nullptr;  // set once, never destroyed (see glake_native_install)
void delete_native(void* ptr);

class native_allocator final : public cca::CUDAAllocator {
 public:
  using cca::CUDAAllocator::recordStream;

  // ------------------------------------------------------------------ allocation
  c10::DataPtr allocate(std::size_t n) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    void* p = n == 0 ? nullptr : malloc(n, device, c10::cuda::getCurrentCUDAStream(device).stream());
    return {p, p, &delete_native, c10::Device(c10::DeviceType::CUDA, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_native; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }
  void* raw_alloc(std::size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    const c10::DeviceIndex device = c10::cuda::current_device();
    return malloc(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }
  void* raw_alloc_with_stream(std::size_t nbytes, cudaStream_t stream) override {
    if (nbytes == 0) return nullptr;
    return malloc(nbytes, c10::cuda::current_device(), stream);
  }
  void raw_delete(void* ptr) override { free(ptr); }

  void* malloc(std::size_t size, int device, cudaStream_t stream) {
    TORCH_CHECK(device >= 0 && device < max_devices, "glake: device ", device, " is out of range");
    const auto when = when_.load(std::memory_order_relaxed);
    context_ptr context = when != c10::CachingDeviceAllocator::RecordContext::NEVER ? gather() : nullptr;
    void* p = nullptr;
    routed_to.reset();
    try {
      p = core::allocate(size, device, stream);
    } catch (const std::bad_alloc& e) {
      out_of_memory(size, device, stream, context, e.what());  // throws
    }
    TORCH_CHECK(p != nullptr, "glake: allocating ", size, " bytes on device ", device, " failed");
    std::vector<TraceEntry> traced;
    {
      std::lock_guard guard(mutex_);
      auto& d = devices_[static_cast<std::size_t>(device)];
      const std::size_t pool = pool_index(size);
      increase(d.stats.allocation, pool, 1);
      increase(d.stats.active, pool, 1);
      increase(d.stats.allocated_bytes, pool, size);
      increase(d.stats.active_bytes, pool, size);
      increase(d.stats.requested_bytes, pool, size);
      live_[p] = allocation{size, device, stream, context, routed_to};
      if (tracing()) {
        traced.push_back(trace(d, TraceEntry::ALLOC, device, reinterpret_cast<std::uintptr_t>(p), size, stream,
                               when >= c10::CachingDeviceAllocator::RecordContext::ALLOC ? context : nullptr));
      }
    }
    tell_trackers(traced);
    return p;
  }

  void free(void* ptr) {
    if (ptr == nullptr) return;
    allocation a;
    std::vector<TraceEntry> traced;
    const bool free_context = when_.load(std::memory_order_relaxed) == c10::CachingDeviceAllocator::RecordContext::ALL;
    context_ptr context = free_context ? gather() : nullptr;
    {
      std::lock_guard guard(mutex_);
      const auto it = live_.find(ptr);
      TORCH_CHECK(it != live_.end(), "glake: free of ", ptr, ", which is not a live allocation of glake's allocator");
      a = std::move(it->second);
      live_.erase(it);
      auto& d = devices_[static_cast<std::size_t>(a.device)];
      const std::size_t pool = pool_index(a.size);
      decrease(d.stats.allocation, pool, 1);
      decrease(d.stats.active, pool, 1);
      decrease(d.stats.allocated_bytes, pool, a.size);
      decrease(d.stats.active_bytes, pool, a.size);
      decrease(d.stats.requested_bytes, pool, a.size);
      if (tracing()) {
        traced.push_back(trace(d, TraceEntry::FREE_REQUESTED, a.device, reinterpret_cast<std::uintptr_t>(ptr), a.size,
                               a.stream, context));
      }
    }
    tell_trackers(traced);
    if (a.pool && hold(ptr, a)) return;
    glake_free(ptr, a.size, a.device, a.stream);
  }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (ptr.get() == nullptr || ptr.get_deleter() != &delete_native) return;  // not glake's
    glake_record_stream(ptr.get(), stream.stream());
  }

  // ------------------------------------------------------------------ cache, limits, devices
  void init(int device_count) override {
    device_count_ = device_count;
    initialized_.store(true);
  }
  bool initialized() override { return initialized_.load(); }
  void emptyCache(c10::MempoolId_t /*mempool_id*/) override {
    // A pool's free memory goes back once the pool has no use left (glake's private pools).
    glake_empty_cache(-1);
  }
  double getMemoryFraction(c10::DeviceIndex device) override {
    std::lock_guard guard(mutex_);
    return devices_.at(static_cast<std::size_t>(device)).fraction;
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    TORCH_CHECK(0 <= fraction && fraction <= 1, "invalid fraction:", fraction, ". Please set within [0, 1].");
    TORCH_CHECK(device >= 0 && device < max_devices, "glake: device ", static_cast<int>(device), " is out of range");
    glake_set_memory_fraction(fraction, device);
    std::lock_guard guard(mutex_);
    devices_[static_cast<std::size_t>(device)].fraction = fraction;
  }
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override { return {}; }
  void enable(bool value) override { enabled_ = value; }
  bool isEnabled() const override { return enabled_; }
  // The largest request that can be served (cuDNN sizes its workspaces by it): as PyTorch's, the
  // device's free memory when asked with 0, or more if the cache holds more; glake stitches its
  // free blocks, so the cache can serve all of its cached bytes at once.
  void cacheInfo(c10::DeviceIndex device, std::size_t* largestBlock) override {
    if (*largestBlock == 0) {
      const c10::cuda::CUDAGuard guard(device);
      std::size_t free_bytes = 0;
      std::size_t total = 0;
      C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
      *largestBlock = free_bytes;
    }
    const statistics st = core::device_statistics(device);
    const std::size_t cached = st.reserved_bytes > st.allocated_bytes ? st.reserved_bytes - st.allocated_bytes : 0;
    *largestBlock = std::max(*largestBlock, cached);
  }
  void* getBaseAllocation(void* ptr, std::size_t* size) override {
    std::lock_guard guard(mutex_);
    const auto it = live_.find(ptr);
    if (it != live_.end() && size != nullptr) *size = it->second.size;
    return ptr;
  }
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    const c10::cuda::CUDAGuard guard(dev);
    const cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
    } else {
      C10_CUDA_CHECK(err);
    }
  }
  // glake maps its memory for its own device only (as PyTorch's expandable segments before they
  // grant peers access): copies between devices go through the peer copy.
  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice, std::size_t count,
                          cudaStream_t stream, bool /*p2p_enabled*/) override {
    if (dstDevice == srcDevice) return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }
  std::string name() override { return "glake"; }

  // ------------------------------------------------------------------ statistics
  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    TORCH_CHECK(device >= 0 && device < max_devices, "glake: device ", static_cast<int>(device), " is out of range");
    const statistics st = core::device_statistics(device);
    std::lock_guard guard(mutex_);
    auto& d = devices_[static_cast<std::size_t>(device)];
    sync_reserved(d, st);
    DeviceStats out = d.stats;
    out.num_device_alloc = static_cast<std::int64_t>(st.driver_calls[driver_call::create]);
    out.num_device_free = static_cast<std::int64_t>(st.driver_calls[driver_call::release]);
    out.num_sync_all_streams = static_cast<std::int64_t>(st.device_waits);
    out.max_split_size = -1;  // glake splits any block (PyTorch's "no limit")
    return out;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    std::lock_guard guard(mutex_);
    auto& s = devices_.at(static_cast<std::size_t>(device)).stats;
    for (auto* a : {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes, &s.reserved_bytes,
                    &s.active_bytes, &s.inactive_split_bytes, &s.requested_bytes}) {
      for (Stat& stat : *a) stat.reset_accumulated();
    }
    s.num_alloc_retries = 0;
    s.num_ooms = 0;
    s.oversize_allocations.reset_accumulated();
    s.oversize_segments.reset_accumulated();
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    glake_reset_peak(device);
    const statistics st = core::device_statistics(device);
    std::lock_guard guard(mutex_);
    auto& d = devices_.at(static_cast<std::size_t>(device));
    sync_reserved(d, st);
    auto& s = d.stats;
    for (auto* a : {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes, &s.reserved_bytes,
                    &s.active_bytes, &s.inactive_split_bytes, &s.requested_bytes}) {
      for (Stat& stat : *a) stat.reset_peak();
    }
    s.oversize_allocations.reset_peak();
    s.oversize_segments.reset_peak();
  }

  // ------------------------------------------------------------------ private pools
  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) override {
    release_held(device, id, false);  // what no checkpoint needs any more: the new requests may use it
    TORCH_CHECK(core::begin_allocate_to_pool(device, id, noting_filter(id, std::move(filter))), "glake: device ",
                static_cast<int>(device), " could not begin allocating to pool (", id.first, ", ", id.second,
                "): see the line glake wrote to stderr");
  }
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t id) override {
    glake_end_allocate_to_pool(device, id);
  }
  // The use counts are glake's pools' own (graph_pools): begin and createOrIncrefPool add one,
  // releasePool drops one.
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t id) override {
    if (core::pool_use_count(device, id) == 1) release_held(device, id, true);  // its last use
    glake_release_pool(device, id);
  }
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t id) override {
    return static_cast<int>(core::pool_use_count(device, id));
  }
  // MemPool(): one more use of the pool, made now; requests reach it under use_mem_pool.
  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    TORCH_CHECK(allocator == nullptr || allocator.get() == this,
                "glake: a torch.cuda.MemPool with an allocator of its own is not served by glake's allocator; "
                "create the MemPool without one (glake serves each pool with a stitching allocator of its own)");
    TORCH_CHECK(core::begin_allocate_to_pool(device, id, [](cudaStream_t) { return false; }), "glake: pool (",
                id.first, ", ", id.second, ") could not be made on device ", static_cast<int>(device));
    glake_end_allocate_to_pool(device, id);
  }
  // A pool's requests never fall back to other pools, and glake splits and stitches in every pool:
  // both settings are accepted and change nothing.
  void setUseOnOOM(c10::DeviceIndex, c10::MempoolId_t, bool) override {}
  void setNoSplit(c10::DeviceIndex, c10::MempoolId_t) override {}

  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t id,
                                const std::unordered_set<void*>& expected) override {
    std::unordered_set<void*> live = live_in_pool(device, id);
    drop_held(live);
    return live == expected;
  }

  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device, c10::MempoolId_t id) override {
    std::unordered_set<void*> live = live_in_pool(device, id);
    drop_held(live);
    auto state = std::make_shared<pool_checkpoint>();
    state->device = device;
    state->pool = id;
    std::lock_guard guard(mutex_);
    auto& kept = checkpoints_[{device, id}];
    std::erase_if(kept, [](const auto& w) { return w.expired(); });
    kept.push_back(state);
    for (void* p : live) {
      const auto it = live_.find(p);
      if (it != live_.end()) state->live.push_back({p, it->second});
    }
    std::sort(state->live.begin(), state->live.end(), [](const auto& a, const auto& b) { return a.ptr < b.ptr; });
    return state;
  }

  // Makes the pool's live allocations those of the checkpoint: the others are freed; those freed
  // since are allocated again, which must give their old addresses (glake's pool serves them
  // from the memory it retained, in address order); where it does not, the pool is left as the
  // checkpoint minus those and an error says so.
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState> pps) override {
    auto state = std::dynamic_pointer_cast<pool_checkpoint>(pps);
    TORCH_CHECK(state != nullptr && state->device == device, "glake: not a checkpoint of glake's allocator on device ",
                static_cast<int>(device));
    std::unordered_set<void*> live = live_in_pool(device, state->pool);
    drop_held(live);
    cca::CheckpointDelta delta;
    std::unordered_set<void*> wanted;
    for (const auto& e : state->live) wanted.insert(e.ptr);
    for (void* p : live) {
      if (wanted.contains(p)) continue;
      free(p);
      delta.ptrs_freed.push_back(p);
    }
    const c10::Device where(c10::DeviceType::CUDA, device);
    std::vector<const pool_checkpoint::entry*> missing;
    for (const auto& e : state->live) {
      if (live.contains(e.ptr) || revive(e.ptr, e.a)) {
        delta.dataptrs_allocd.emplace_back(e.ptr, e.ptr, &delete_native, where);
      } else {
        missing.push_back(&e);
      }
    }
    if (missing.empty()) return delta;
    TORCH_CHECK(core::begin_allocate_to_pool(device, state->pool,
                                             noting_filter(state->pool, [](cudaStream_t) { return true; })),
                "glake: cannot restore a checkpoint of pool (", state->pool.first, ", ", state->pool.second, ")");
    std::string refused;
    for (const auto* e : missing) {
      void* p = nullptr;
      try {
        p = malloc(e->a.size, device, e->a.stream);
      } catch (const std::exception&) {
        p = nullptr;
      }
      if (p == e->ptr) {
        std::lock_guard guard(mutex_);
        live_[p].context = e->a.context;
        delta.dataptrs_allocd.emplace_back(p, p, &delete_native, where);
        continue;
      }
      if (p != nullptr) free(p);
      refused += refused.empty() ? "" : ", ";
      refused += std::to_string(e->a.size) + " bytes at " + std::to_string(reinterpret_cast<std::uintptr_t>(e->ptr));
    }
    glake_end_allocate_to_pool(device, state->pool);
    glake_release_pool(device, state->pool);  // the use begin added
    TORCH_CHECK(refused.empty(),
                "glake: restoring a CUDA graph tree's checkpoint of pool (", state->pool.first, ", ",
                state->pool.second, ") needs allocations at the addresses they had, which glake's pool could not "
                "give again (", refused,
                "). Record this model with torch._inductor.config.triton.cudagraph_trees = False (one pool per "
                "graph), or without glake");
    return delta;
  }

  // ------------------------------------------------------------------ history and snapshots
  bool isHistoryEnabled() override { return history_on_.load(); }

  void recordHistory(bool enabled, cca::CreateContextFn context_recorder, std::size_t alloc_trace_max_entries,
                     c10::CachingDeviceAllocator::RecordContext when, bool clearHistory,
                     const std::vector<std::string>& skip_actions) override {
    std::lock_guard guard(mutex_);
    recorder_.store(enabled ? context_recorder : nullptr);
    when_.store(enabled ? when : c10::CachingDeviceAllocator::RecordContext::NEVER);
    max_entries_ = std::max<std::size_t>(alloc_trace_max_entries, 1);
    skip_.clear();
    for (const std::string& a : skip_actions) skip_.insert(c10::CachingDeviceAllocator::parseTraceEntryAction(a));
    if (clearHistory || enabled) {
      for (auto& d : devices_) d.trace.clear();
    }
    history_on_.store(enabled);
    // glake's own history gives the segment entries and when frees completed. It is a ring
    // allocated up front: PyTorch's default (every entry, max_entries = sys.maxsize) keeps the
    // newest 100,000 per device there, as glake_torch.record_memory_history does.
    constexpr std::size_t glake_ring_cap = 100'000;
    (void)glake_record_history(enabled ? 1 : 0, std::min(max_entries_, glake_ring_cap));
  }

  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard guard(mutex_);
    oom_observers_.push_back(std::move(observer));
  }
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override {
    std::lock_guard guard(mutex_);
    trackers_.push_back(std::move(tracker));
    has_trackers_.store(true);
  }

  cca::SnapshotInfo snapshot(c10::MempoolId_t mempool_id, bool include_traces) override;

  // ------------------------------------------------------------------ IPC
  cca::ShareableHandle shareIpcHandle(void*) override {
    TORCH_CHECK(false, ipc_refusal);
  }
  std::shared_ptr<void> getIpcDevPtr(std::string) override { TORCH_CHECK(false, ipc_refusal); }

 private:
  static constexpr const char* ipc_refusal =
      "glake's allocator does not share its memory with other processes through CUDA IPC (torch.multiprocessing's "
      "CUDA tensors): its allocations are stitched from VMM handles, which CUDA IPC cannot open. Share weights "
      "between processes with glake_torch.share_weights (docs/dedup.md), or send the tensor from a process without "
      "glake_torch.enable()";

  struct device_state {
    DeviceStats stats;
    std::size_t seen_reserved = 0;       // glake's reserved bytes at the last reading
    std::uint64_t seen_segments = 0;     // glake's segments created at the last reading
    std::uint64_t seen_released = 0;     // and released
    double fraction = 1.0;
    std::deque<TraceEntry> trace;
  };

  // Reserved bytes and segments are glake's: what changed since the last reading is added to
  // PyTorch's counters (allocated / freed count those changes as seen at readings).
  static void sync_reserved(device_state& d, const statistics& st) {
    constexpr auto all = static_cast<std::size_t>(StatType::AGGREGATE);
    constexpr auto large = static_cast<std::size_t>(StatType::LARGE_POOL);
    if (st.reserved_bytes > d.seen_reserved) increase(d.stats.reserved_bytes, large, st.reserved_bytes - d.seen_reserved);
    if (st.reserved_bytes < d.seen_reserved) decrease(d.stats.reserved_bytes, large, d.seen_reserved - st.reserved_bytes);
    d.seen_reserved = st.reserved_bytes;
    for (std::size_t i : {all, large}) {
      d.stats.reserved_bytes[i].peak = std::max<std::int64_t>(d.stats.reserved_bytes[i].peak,
                                                              static_cast<std::int64_t>(st.peak_reserved_bytes));
    }
    if (st.segments_created > d.seen_segments) increase(d.stats.segment, large, st.segments_created - d.seen_segments);
    if (st.segments_released > d.seen_released) decrease(d.stats.segment, large, st.segments_released - d.seen_released);
    d.seen_segments = st.segments_created;
    d.seen_released = st.segments_released;
    // Free bytes inside glake's memory: PyTorch's "inactive split" bytes.
    for (std::size_t i : {all, large}) {
      const std::int64_t held = d.stats.reserved_bytes[i].current;
      const std::int64_t used = d.stats.allocated_bytes[all].current;
      d.stats.inactive_split_bytes[i].current = i == all || held > used ? std::max<std::int64_t>(held - used, 0) : 0;
      d.stats.inactive_split_bytes[i].peak =
          std::max(d.stats.inactive_split_bytes[i].peak, d.stats.inactive_split_bytes[i].current);
    }
  }

  // Graph trees restore a pool to a checkpoint (setCheckpointPoolState), which needs the
  // checkpoint's allocations at their addresses again; glake cannot place an allocation at a
  // chosen address, so an allocation of a pool that a living checkpoint lists, freed while no
  // request goes to that pool (an output the program dropped), is held instead: still allocated
  // in glake, free for PyTorch's statistics, revived by a restore. Held allocations no living
  // checkpoint lists go back when requests go to the pool again, all of them once it has no use.
  bool hold(void* ptr, const allocation& a) {
    if (core::allocating_to_pool(a.device, *a.pool)) return false;
    std::lock_guard guard(mutex_);
    const std::pair<int, c10::MempoolId_t> key{a.device, *a.pool};
    if (!listed(key, ptr)) return false;
    held_[ptr] = a;
    // Free for PyTorch: the history says so (glake's never will).
    if (tracing()) {
      (void)trace(devices_[static_cast<std::size_t>(a.device)], TraceEntry::FREE_COMPLETED, a.device,
                  reinterpret_cast<std::uintptr_t>(ptr), a.size, a.stream, nullptr);
    }
    return true;
  }
  // Under mutex_: whether a living checkpoint of the pool lists `ptr`.
  bool listed(const std::pair<int, c10::MempoolId_t>& key, void* ptr) {
    const auto it = checkpoints_.find(key);
    if (it == checkpoints_.end()) return false;
    for (const auto& w : it->second) {
      if (const auto c = w.lock()) {
        for (const auto& e : c->live) {
          if (e.ptr == ptr) return true;
        }
      }
    }
    return false;
  }
  bool revive(void* ptr, const allocation& wanted) {
    std::lock_guard guard(mutex_);
    const auto it = held_.find(ptr);
    if (it == held_.end() || it->second.size != wanted.size) return false;
    allocation a = std::move(it->second);
    held_.erase(it);
    auto& d = devices_[static_cast<std::size_t>(a.device)];
    const std::size_t pool = pool_index(a.size);
    increase(d.stats.allocation, pool, 1);
    increase(d.stats.active, pool, 1);
    increase(d.stats.allocated_bytes, pool, a.size);
    increase(d.stats.active_bytes, pool, a.size);
    increase(d.stats.requested_bytes, pool, a.size);
    a.context = wanted.context;
    if (tracing()) {
      (void)trace(d, TraceEntry::ALLOC, a.device, reinterpret_cast<std::uintptr_t>(ptr), a.size, a.stream, a.context);
    }
    live_[ptr] = std::move(a);
    return true;
  }
  void drop_held(std::unordered_set<void*>& live) {
    std::lock_guard guard(mutex_);
    for (const auto& [ptr, a] : held_) live.erase(ptr);
  }
  // Frees the pool's held allocations that no living checkpoint lists (all of them: `all`).
  void release_held(int device, c10::MempoolId_t id, bool all) {
    std::vector<std::pair<void*, allocation>> going;
    {
      std::lock_guard guard(mutex_);
      const std::pair<int, c10::MempoolId_t> key{device, id};
      for (auto it = held_.begin(); it != held_.end();) {
        if (it->second.device == device && it->second.pool == id && (all || !listed(key, it->first))) {
          going.emplace_back(it->first, std::move(it->second));
          it = held_.erase(it);
        } else {
          ++it;
        }
      }
      if (all) checkpoints_.erase(key);
    }
    for (const auto& [ptr, a] : going) glake_free(ptr, a.size, a.device, a.stream);
  }

  context_ptr gather() const {
    const cca::CreateContextFn recorder = recorder_.load();
    return recorder != nullptr ? recorder() : nullptr;
  }

  bool tracing() const { return history_on_.load(std::memory_order_relaxed) || has_trackers_.load(); }

  // A trace entry, kept in the device's ring (while the history records) and returned for the
  // trackers. Under mutex_.
  TraceEntry trace(device_state& d, TraceEntry::Action action, int device, std::uintptr_t addr, std::size_t size,
                   cudaStream_t stream, context_ptr context) {
    TraceEntry e(action, static_cast<c10::DeviceIndex>(device), addr, size, stream, c10::MempoolId_t{0, 0}, 0,
                 std::move(context));
    e.time_.t_ = static_cast<time_t>(now_us());
    if (history_on_.load(std::memory_order_relaxed) && !skip_.contains(action)) {
      d.trace.push_back(e);
      while (d.trace.size() > max_entries_) d.trace.pop_front();
    }
    return e;
  }

  void tell_trackers(const std::vector<TraceEntry>& entries) {
    if (entries.empty()) return;
    std::vector<cca::AllocatorTraceTracker> trackers;
    {
      std::lock_guard guard(mutex_);
      trackers = trackers_;
    }
    for (const auto& e : entries) {
      for (const auto& t : trackers) t(e);
    }
  }

  [[noreturn]] void out_of_memory(std::size_t size, int device, cudaStream_t stream, const context_ptr& context,
                                  const char* why) {
    std::size_t free_bytes = 0;
    std::size_t total = 0;
    (void)cuMemGetInfo(&free_bytes, &total);
    std::vector<cca::OutOfMemoryObserver> observers;
    std::vector<TraceEntry> traced;
    double fraction = 1.0;
    {
      std::lock_guard guard(mutex_);
      auto& d = devices_[static_cast<std::size_t>(device)];
      ++d.stats.num_ooms;
      fraction = d.fraction;
      observers = oom_observers_;
      if (tracing()) traced.push_back(trace(d, TraceEntry::OOM, device, free_bytes, size, stream, context));
    }
    tell_trackers(traced);
    const auto allowed = fraction < 1.0 ? static_cast<std::size_t>(fraction * static_cast<double>(total)) : total;
    for (const auto& o : observers) o(device, size, allowed, free_bytes);
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ", format_bytes(size),
                     ". GPU ", device, " has a total capacity of ", format_bytes(total), " of which ",
                     format_bytes(free_bytes), " is free. glake: ", why);
  }

  friend class snapshot_builder;

  std::mutex mutex_;
  std::array<device_state, max_devices> devices_{};
  std::unordered_map<void*, allocation> live_;
  std::map<std::pair<int, c10::MempoolId_t>, std::vector<std::weak_ptr<pool_checkpoint>>> checkpoints_;
  std::unordered_map<void*, allocation> held_;  // see hold()
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
  std::vector<cca::AllocatorTraceTracker> trackers_;
  std::atomic<cca::CreateContextFn> recorder_{nullptr};
  std::atomic<c10::CachingDeviceAllocator::RecordContext> when_{c10::CachingDeviceAllocator::RecordContext::NEVER};
  std::atomic<bool> history_on_{false};
  std::atomic<bool> has_trackers_{false};
  std::size_t max_entries_ = 1;
  std::set<TraceEntry::Action> skip_;
  std::atomic<bool> initialized_{false};
  int device_count_ = 0;
  bool enabled_ = true;
};

void delete_native(void* ptr) { installed->free(ptr); }

// PyTorch's SegmentInfo for each of glake's segments (general allocator and pools), blocks in
// address order tiling the segment (PyTorch computes block addresses from their sizes). A block
// that a live stitched allocation claims is shown allocated with that allocation's stack: the
// stitched range itself is a view of those blocks, not more memory, and is not a segment.
class snapshot_builder final : public core::state_sink {
 public:
  snapshot_builder(int device, c10::MempoolId_t only, const std::unordered_map<void*, allocation>& live,
                   const std::unordered_set<void*>& held, std::vector<c10::CachingDeviceAllocator::SegmentInfo>& out)
      : device_(device), only_(only), live_(live), held_(held), out_(out) {}
  void pool(core::pool_id id) override {
    pool_ = id;
    take_ = only_ == c10::MempoolId_t{0, 0} || only_ == id;
    current_ = nullptr;
  }
  void segment(const segment_view& s) override {
    current_ = nullptr;
    if (!take_) return;
    auto& seg = out_.emplace_back();
    seg.device = static_cast<c10::DeviceIndex>(device_);
    seg.address = s.address;
    seg.total_size = s.size;
    seg.stream = reinterpret_cast<void*>(s.stream.id());
    seg.is_large = true;
    seg.is_expandable = false;
    seg.owner_private_pool_id = pool_;
    current_ = &seg;
    cursor_ = s.address;
    end_ = s.address + s.size;
  }
  void block(const block_view& b) override {
    if (current_ == nullptr || b.address < cursor_ || b.address + b.size > end_) return;
    if (b.address > cursor_) add(b.address - cursor_, 0, false, false, nullptr);  // a gap glake did not show
    void* owner = reinterpret_cast<void*>(b.stitched_into != 0 ? b.stitched_into : b.address);
    const bool is_held = held_.contains(owner);
    const bool allocated = b.state == block_state::allocated && !is_held;
    const bool active = b.state != block_state::free && !is_held;
    const auto it = live_.find(owner);
    const context_ptr context = active && it != live_.end() ? it->second.context : nullptr;
    const std::size_t requested = !active ? 0 : (b.requested != 0 && b.stitched_into == 0 ? b.requested : b.size);
    add(b.size, requested, allocated, active, context);
    cursor_ = b.address + b.size;
  }
  void stitched(const stitched_view&) override { close(); }
  void piece(const stitched_piece_view&) override {}
  void close() {
    if (current_ != nullptr && cursor_ < end_) add(end_ - cursor_, 0, false, false, nullptr);
    current_ = nullptr;
  }

 private:
  void add(std::size_t size, std::size_t requested, bool allocated, bool active, context_ptr context) {
    auto& block = current_->blocks.emplace_back();
    block.size = size;
    block.requested_size = requested;
    block.allocated = allocated;
    block.active = active;
    block.context_when_allocated = std::move(context);
    if (allocated) current_->allocated_size += size;
    if (active) {
      current_->active_size += size;
      current_->requested_size += requested;
    }
    cursor_ += size;
  }

  int device_;
  c10::MempoolId_t only_;
  const std::unordered_map<void*, allocation>& live_;
  const std::unordered_set<void*>& held_;  // free for PyTorch (native_allocator::hold)
  std::vector<c10::CachingDeviceAllocator::SegmentInfo>& out_;
  core::pool_id pool_{};
  bool take_ = true;
  c10::CachingDeviceAllocator::SegmentInfo* current_ = nullptr;
  std::uintptr_t cursor_ = 0, end_ = 0;
};

cca::SnapshotInfo native_allocator::snapshot(c10::MempoolId_t mempool_id, bool include_traces) {
  cca::SnapshotInfo info;
  std::unordered_map<void*, allocation> live;
  std::unordered_set<void*> held;
  {
    std::lock_guard guard(mutex_);
    live = live_;
    for (const auto& [ptr, a] : held_) held.insert(ptr);
  }
  int last_device = -1;
  for (int d = 0; d < max_devices; ++d) {
    snapshot_builder b(d, mempool_id, live, held, info.segments);
    if (!core::visit_device_state(d, b)) continue;
    b.close();
    last_device = d;
  }
  // A segment followed by another one was left untiled at its end: fill it with a free block.
  for (auto& seg : info.segments) {
    std::size_t covered = 0;
    for (const auto& block : seg.blocks) covered += block.size;
    if (covered < seg.total_size) {
      auto& block = seg.blocks.emplace_back();
      block.size = seg.total_size - covered;
    }
  }
  if (include_traces) {
    std::lock_guard guard(mutex_);
    info.device_traces.resize(static_cast<std::size_t>(last_device + 1));
    for (int d = 0; d <= last_device; ++d) {
      auto& out = info.device_traces[static_cast<std::size_t>(d)];
      out.assign(devices_[static_cast<std::size_t>(d)].trace.begin(), devices_[static_cast<std::size_t>(d)].trace.end());
      // glake's history: physical memory coming and going, and when frees completed.
      for (const history_entry& h : core::device_history(d)) {
        TraceEntry::Action a{};
        switch (h.action) {
          case memory_action::segment_alloc:
            a = TraceEntry::SEGMENT_ALLOC;
            break;
          case memory_action::segment_free:
            a = TraceEntry::SEGMENT_FREE;
            break;
          case memory_action::free_completed:
            a = TraceEntry::FREE_COMPLETED;
            break;
          default:
            continue;  // alloc, free_requested and oom are recorded here with their stacks
        }
        if (skip_.contains(a)) continue;
        TraceEntry e(a, static_cast<c10::DeviceIndex>(d), h.address, h.size, reinterpret_cast<void*>(h.stream.id()),
                     c10::MempoolId_t{0, 0}, 0);
        e.time_.t_ = static_cast<time_t>(h.time_us);
        out.push_back(std::move(e));
      }
      std::stable_sort(out.begin(), out.end(),
                       [](const TraceEntry& x, const TraceEntry& y) { return x.time_.t_ < y.time_.t_; });
    }
  }
  info.config_metadata.garbage_collection_threshold = 0;
  info.config_metadata.max_split_size = static_cast<std::size_t>(-1);
  info.config_metadata.pinned_num_register_threads = 0;
  info.config_metadata.expandable_segments = false;
  info.config_metadata.release_lock_on_malloc = false;
  info.config_metadata.pinned_use_host_register = false;
  info.config_metadata.graph_capture_record_stream_reuse = false;
  char settings[512] = {};
  (void)glake_settings(settings, sizeof settings);
  info.config_metadata.last_allocator_settings = std::string("glake ") + settings;
  return info;
}

}  // namespace
}  // namespace glake::torch_plugin

extern "C" GLAKE_TORCH_NATIVE_API int glake_native_install(char* message, unsigned long size) {
  using glake::torch_plugin::installed;
  using glake::torch_plugin::native_allocator;
  try {
    // Kept for the life of the process, as torch keeps the allocator it was given: tensors are
    // freed through it during interpreter shutdown.
    static auto* const keep = new std::shared_ptr<native_allocator>(std::make_shared<native_allocator>());
    installed = keep->get();
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(*keep);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "glake: installing the native allocator failed: %s\n", e.what());
    if (message != nullptr && size != 0) {
      std::snprintf(message, size, "%s", e.what());
    }
    return -1;
  }
}
