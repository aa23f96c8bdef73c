// A measuring instrument for bench/torch/finetune.py (--allocator-timing): wraps whatever CUDA
// allocator PyTorch has installed (its own caching allocator, or glake behind the
// CUDAPluggableAllocator) and adds up the host time spent in its allocations and frees, so that
// the allocator's share of a training step can be measured the same way for every allocator, in
// one process, with the host's speed cancelling out of the ratio.
//
// What it times: allocate() and the deleter of the DataPtr it returns (a tensor's free), and
// raw_alloc / raw_alloc_with_stream / raw_delete. For glake this includes PyTorch's pluggable
// wrapper (its lock and metadata map) around glake's own call; for the default allocator, the
// whole native path. A call that throws (an out-of-memory) is not counted. Every other member is
// forwarded untimed.
//
// How the free is timed: both allocators return DataPtrs whose context is the pointer and whose
// deleter is one plain function; the wrapper swaps in its own deleter, which times a call of the
// original. A DataPtr of another shape is left alone and counted (`untimed`). Members that look
// at a DataPtr's deleter (recordStream, is_simple_data_ptr) get a view with the original one.
//
// Use (after `import torch`, before the first CUDA allocation, and after glake_torch.enable()):
//   lib = ctypes.CDLL(path); lib.glake_timing_install() == 0
//   lib.glake_timing_read(uint64[5]) -> alloc ns, alloc calls, free ns, free calls, untimed
// Built by bench/torch/build_plugin.sh --allocator-timing (needs torch's headers and libraries).
#include <c10/cuda/CUDACachingAllocator.h>

#include <atomic>
#include <chrono>
#include <cstdint>

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using clock_type = std::chrono::steady_clock;

std::atomic<std::uint64_t> alloc_ns{0}, alloc_calls{0}, free_ns{0}, free_calls{0}, untimed{0};
std::atomic<c10::DeleterFnPtr> inner_deleter{nullptr};
cca::CUDAAllocator* inner = nullptr;

std::uint64_t since(clock_type::time_point start) {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(clock_type::now() - start).count());
}

void timed_delete(void* ctx) {
  const auto start = clock_type::now();
  inner_deleter.load(std::memory_order_relaxed)(ctx);
  free_ns.fetch_add(since(start), std::memory_order_relaxed);
  free_calls.fetch_add(1, std::memory_order_relaxed);
}

void timed_raw_delete(void* ptr) {
  const auto start = clock_type::now();
  inner->raw_delete(ptr);
  free_ns.fetch_add(since(start), std::memory_order_relaxed);
  free_calls.fetch_add(1, std::memory_order_relaxed);
}

// The DataPtr `p` as the inner allocator made it (its deleter), for the inner allocator to look
// at. It never owns the memory: its context is released when it goes, even by an exception.
class inner_view {
 public:
  explicit inner_view(const c10::DataPtr& p)
      : view_(p.get(), p.get_context(),
              p.get_deleter() == &timed_delete ? inner_deleter.load(std::memory_order_relaxed) : p.get_deleter(),
              p.device()) {}
  inner_view(const inner_view&) = delete;
  inner_view& operator=(const inner_view&) = delete;
  ~inner_view() { (void)view_.release_context(); }
  const c10::DataPtr& get() const { return view_; }

 private:
  c10::DataPtr view_;
};

struct timing_allocator final : cca::CUDAAllocator {
  c10::DataPtr allocate(size_t n) override {
    const auto start = clock_type::now();
    c10::DataPtr p = inner->allocate(n);
    alloc_ns.fetch_add(since(start), std::memory_order_relaxed);
    alloc_calls.fetch_add(1, std::memory_order_relaxed);
    if (p.get() == nullptr) return p;
    c10::DeleterFnPtr d = p.get_deleter();
    c10::DeleterFnPtr expected = nullptr;
    if (p.get_context() == p.get() && d != nullptr &&
        (inner_deleter.compare_exchange_strong(expected, d) || expected == d) &&
        p.compare_exchange_deleter(d, &timed_delete)) {
      return p;
    }
    untimed.fetch_add(1, std::memory_order_relaxed);
    return p;
  }
  c10::DeleterFnPtr raw_deleter() const override { return &timed_raw_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    inner->copy_data(dest, src, count);
  }
  bool is_simple_data_ptr(const c10::DataPtr& p) const override {
    return inner->is_simple_data_ptr(inner_view(p).get());
  }

  void* raw_alloc(size_t nbytes) override {
    const auto start = clock_type::now();
    void* p = inner->raw_alloc(nbytes);
    alloc_ns.fetch_add(since(start), std::memory_order_relaxed);
    alloc_calls.fetch_add(1, std::memory_order_relaxed);
    return p;
  }
  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    const auto start = clock_type::now();
    void* p = inner->raw_alloc_with_stream(nbytes, stream);
    alloc_ns.fetch_add(since(start), std::memory_order_relaxed);
    alloc_calls.fetch_add(1, std::memory_order_relaxed);
    return p;
  }
  void raw_delete(void* ptr) override { timed_raw_delete(ptr); }

  bool initialized() override { return inner->initialized(); }
  void emptyCache(c10::MempoolId_t id) override { inner->emptyCache(id); }
  void recordStream(const c10::DataPtr& p, c10::cuda::CUDAStream stream) override {
    inner->recordStream(inner_view(p).get(), stream);
  }
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    return inner->getDeviceStats(device);
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override { inner->resetAccumulatedStats(device); }
  void resetPeakStats(c10::DeviceIndex device) override { inner->resetPeakStats(device); }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    return inner->getMemoryInfo(device);
  }

  void init(int device_count) override { inner->init(device_count); }
  double getMemoryFraction(c10::DeviceIndex device) override { return inner->getMemoryFraction(device); }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    inner->setMemoryFraction(fraction, device);
  }
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex device) override {
    return inner->getExpandableSegmentSizes(device);
  }
  void enable(bool value) override { inner->enable(value); }
  bool isEnabled() const override { return inner->isEnabled(); }
  void cacheInfo(c10::DeviceIndex device, size_t* largest) override { inner->cacheInfo(device, largest); }
  void* getBaseAllocation(void* ptr, size_t* size) override { return inner->getBaseAllocation(ptr, size); }
  cca::SnapshotInfo snapshot(c10::MempoolId_t id, bool include_traces) override {
    return inner->snapshot(id, include_traces);
  }
  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) override {
    inner->beginAllocateToPool(device, id, std::move(filter));
  }
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t id) override {
    inner->endAllocateToPool(device, id);
  }
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t id) override { inner->releasePool(device, id); }
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t id) override {
    return inner->getPoolUseCount(device, id);
  }
  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    inner->createOrIncrefPool(device, id, std::move(allocator));
  }
  void setUseOnOOM(c10::DeviceIndex device, c10::MempoolId_t id, bool use) override {
    inner->setUseOnOOM(device, id, use);
  }
  void setNoSplit(c10::DeviceIndex device, c10::MempoolId_t id) override { inner->setNoSplit(device, id); }
  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t id,
                                const std::unordered_set<void*>& expected) override {
    return inner->checkPoolLiveAllocations(device, id, expected);
  }
  cca::ShareableHandle shareIpcHandle(void* ptr) override { return inner->shareIpcHandle(ptr); }
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override { return inner->getIpcDevPtr(std::move(handle)); }
  bool isHistoryEnabled() override { return inner->isHistoryEnabled(); }
  void recordHistory(bool enabled, cca::CreateContextFn recorder, size_t max_entries, cca::RecordContext when,
                     bool clear, const std::vector<std::string>& skip) override {
    inner->recordHistory(enabled, std::move(recorder), max_entries, when, clear, skip);
  }
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    inner->recordAnnotation(md);
  }
  void pushCompileContext(std::string& md) override { inner->pushCompileContext(md); }
  void popCompileContext() override { inner->popCompileContext(); }
  void setUserMetadata(const std::string& md) override { inner->setUserMetadata(md); }
  std::string getUserMetadata() override { return inner->getUserMetadata(); }
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    inner->attachOutOfMemoryObserver(std::move(observer));
  }
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override {
    inner->attachAllocatorTraceTracker(std::move(tracker));
  }
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    inner->enablePeerAccess(dev, dev_to_access);
  }
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    return inner->memcpyAsync(dst, dst_device, src, src_device, count, stream, p2p_enabled);
  }
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device, c10::MempoolId_t id) override {
    return inner->getCheckpointState(device, id);
  }
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState> state) override {
    return inner->setCheckpointPoolState(device, std::move(state));
  }
  std::string name() override { return "timing(" + inner->name() + ")"; }
};

}  // namespace

extern "C" {

/// Wraps the current CUDA allocator. 0 on success; -1 when there is none; -2 when called twice.
/// It may be initialized already (glake_torch.enable() initializes the pluggable one): anything
/// allocated before keeps the inner deleter and is freed, untimed, as before.
__attribute__((visibility("default"))) int glake_timing_install() {
  static timing_allocator* installed = nullptr;
  if (installed != nullptr) return -2;
  cca::CUDAAllocator* current = cca::allocator.load();
  if (current == nullptr) return -1;
  inner = current;
  installed = new timing_allocator;  // lives as long as the process, as PyTorch's own does
  cca::allocator.store(installed);
  return 0;
}

/// Writes alloc ns, alloc calls, free ns, free calls and untimed allocations, in that order.
__attribute__((visibility("default"))) void glake_timing_read(std::uint64_t* out) {
  out[0] = alloc_ns.load(std::memory_order_relaxed);
  out[1] = alloc_calls.load(std::memory_order_relaxed);
  out[2] = free_ns.load(std::memory_order_relaxed);
  out[3] = free_calls.load(std::memory_order_relaxed);
  out[4] = untimed.load(std::memory_order_relaxed);
}

}  // extern "C"
