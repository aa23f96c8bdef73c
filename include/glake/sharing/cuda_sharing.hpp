// The CUDA models of the sharing contracts: device memory exported as POSIX file descriptors
// and mapped read-only at the same addresses, hashed on the device (or through host memory) and
// compared through host memory. CI compiles them; tests/gpu/dedup_test.cpp runs them on a GPU
// (docs/dedup.md, "The CUDA backend").
#pragma once

#include <cuda.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "glake/backends/cuda.hpp"
#include "glake/errors.hpp"
#include "glake/ipc/unix_socket.hpp"
#include "glake/sharing/concepts.hpp"
#include "glake/sharing/detail/content_hash_ptx.hpp"
#include "glake/sharing/host_sharing.hpp"

namespace glake {

namespace detail {

inline CUdeviceptr device_pointer(const void* p) noexcept { return reinterpret_cast<CUdeviceptr>(p); }

// A handle mapped read-write (or read-only) in an address range of its own, for copies; unmapped
// and the range freed by the destructor. The handle stays the caller's.
class cuda_scratch_view {
 public:
  cuda_scratch_view(CUmemGenericAllocationHandle handle, std::size_t bytes, int device, CUmemAccess_flags flags)
      : bytes_(bytes) {
    cuda_check(cuMemAddressReserve(&address_, bytes, 0, 0, 0), "cuMemAddressReserve");
    if (const CUresult r = cuMemMap(address_, bytes, 0, handle, 0); r != CUDA_SUCCESS) {
      (void)cuMemAddressFree(address_, bytes);
      throw cuda_error("cuMemMap", r);
    }
    const CUmemAccessDesc access = cuda_access(device, flags);
    if (const CUresult r = cuMemSetAccess(address_, bytes, &access, 1); r != CUDA_SUCCESS) {
      (void)cuMemUnmap(address_, bytes);
      (void)cuMemAddressFree(address_, bytes);
      throw cuda_error("cuMemSetAccess", r);
    }
  }
  cuda_scratch_view(const cuda_scratch_view&) = delete;
  cuda_scratch_view& operator=(const cuda_scratch_view&) = delete;
  ~cuda_scratch_view() {
    (void)cuMemUnmap(address_, bytes_);
    (void)cuMemAddressFree(address_, bytes_);
  }
  CUdeviceptr address() const noexcept { return address_; }

 private:
  CUdeviceptr address_ = 0;
  std::size_t bytes_;
};

// Owns one reference to a generic allocation handle.
class cuda_handle {
 public:
  cuda_handle() noexcept = default;
  explicit cuda_handle(CUmemGenericAllocationHandle h) noexcept : handle_(h), owned_(true) {}
  cuda_handle(cuda_handle&& o) noexcept : handle_(o.handle_), owned_(std::exchange(o.owned_, false)) {}
  cuda_handle& operator=(cuda_handle&&) = delete;
  ~cuda_handle() {
    if (owned_) (void)cuMemRelease(handle_);
  }
  CUmemGenericAllocationHandle get() const noexcept { return handle_; }

 private:
  CUmemGenericAllocationHandle handle_ = 0;
  bool owned_ = false;
};

inline cuda_handle import_fd(int fd) {
  CUmemGenericAllocationHandle h = 0;
  cuda_check(cuMemImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd)),
                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
             "cuMemImportFromShareableHandle");
  return cuda_handle(h);
}

// Replaces the one mapping at [p, p+n) by `next` with `flags`; on failure the old handle is
// mapped back read-write and the error thrown. The old handle's mapping reference goes; its
// owner's references stay.
inline void cuda_remap(void* p, std::size_t bytes, CUmemGenericAllocationHandle next, int device,
                       CUmemAccess_flags flags) {
  CUmemGenericAllocationHandle old_raw = 0;
  cuda_check(cuMemRetainAllocationHandle(&old_raw, p), "cuMemRetainAllocationHandle");
  cuda_handle old(old_raw);
  if (const CUresult r = cuMemUnmap(device_pointer(p), bytes); r != CUDA_SUCCESS) {
    throw usage_error(usage_error::kind::bad_argument,
                      "glake::cuda_shareable_backend: [p, p+" + std::to_string(bytes) +
                          ") is not exactly one mapped handle (cuMemUnmap: " + cuda_error("cuMemUnmap", r).what() + ")");
  }
  const CUmemAccessDesc access = cuda_access(device, flags);
  CUresult r = cuMemMap(device_pointer(p), bytes, 0, next, 0);
  if (r == CUDA_SUCCESS) {
    r = cuMemSetAccess(device_pointer(p), bytes, &access, 1);
    if (r == CUDA_SUCCESS) return;
    (void)cuMemUnmap(device_pointer(p), bytes);
  }
  const CUmemAccessDesc back = cuda_access(device, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  if (cuMemMap(device_pointer(p), bytes, 0, old.get(), 0) == CUDA_SUCCESS) {
    (void)cuMemSetAccess(device_pointer(p), bytes, &back, 1);
  }
  throw cuda_error("cuMemMap/cuMemSetAccess", r);
}

}  // namespace detail

namespace detail {

/// A digest no other range gets (a process-wide counter), for a range that could not be read:
/// it is at worst indexed alone, never wrongly matched, since the broker compares bytes.
inline content_digest digest_of_no_content() noexcept {
  static std::atomic<std::uint64_t> counter{0};
  content_digest d;
  d.bytes.fill(0xA5);
  const std::uint64_t n = ++counter;
  std::memcpy(d.bytes.data(), &n, sizeof n);
  return d;
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// cuda_staged_hasher
//
// Copies device memory to a host buffer in 8 MiB steps (cuMemcpyDtoH) and hashes the digests
// of the steps (fast_content_hasher), so equal bytes give equal digests in every process using
// it. A step that cannot be copied gives a digest no other piece gets (a process-wide counter
// mixed in): the piece is at worst indexed alone, never wrongly matched, since the broker
// compares bytes. cuda_device_hasher (below) hashes on the device instead; the two give
// different digests for the same bytes, so processes sharing memory must use the same one.
// Thread safety: each call uses a buffer of its own.
// ---------------------------------------------------------------------------------------------
struct cuda_staged_hasher {
  content_digest operator()(const void* device, std::size_t bytes) const noexcept {
    constexpr std::size_t step = 8 * MiB;
    const fast_content_hasher hash;
    std::unique_ptr<char[]> buffer(new (std::nothrow) char[step]);
    std::unique_ptr<content_digest[]> steps(new (std::nothrow) content_digest[(bytes + step - 1) / step + 1]);
    if (!buffer || !steps) return unique();
    std::size_t count = 0;
    for (std::size_t at = 0; at < bytes; at += step) {
      const std::size_t n = bytes - at < step ? bytes - at : step;
      if (cuMemcpyDtoH(buffer.get(), detail::device_pointer(device) + at, n) != CUDA_SUCCESS) return unique();
      steps[count++] = hash(buffer.get(), n);
    }
    return hash(steps.get(), count * sizeof(content_digest));
  }

 private:
  static content_digest unique() noexcept { return detail::digest_of_no_content(); }
};
static_assert(content_hasher<cuda_staged_hasher>);

namespace detail {

/// The four lanes of glake_content_hash (tools/kernels/content_hash.cu) over `n` 8-byte words,
/// computed on the host with the same arithmetic, starting from `lanes`: what the kernel adds
/// to its zeroed output. Used where the device cannot run the kernel, and by the tests.
inline void content_hash_lanes(const void* data, std::uint64_t first, std::uint64_t n, std::uint64_t lanes[4]) noexcept {
  const auto mix = [](std::uint64_t x) noexcept {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return x;
  };
  const auto* in = static_cast<const unsigned char*>(data);
  for (std::uint64_t k = 0; k < n; ++k) {
    const std::uint64_t i = first + k;
    std::uint64_t w;
    std::memcpy(&w, in + 8 * k, sizeof w);
    const std::uint64_t x = mix(w ^ (i * 0x9E3779B97F4A7C15ULL));
    lanes[0] += x;
    lanes[1] ^= ((x << 23) | (x >> 41)) + i;
    lanes[2] += x * (2 * i + 1);
    lanes[3] += mix(w + 0xD1B54A32D192ED03ULL * (i + 1));
  }
}

/// The digest of a range from its lanes, its length and its last (bytes % 8) bytes.
inline content_digest content_digest_of(const std::uint64_t lanes[4], std::size_t bytes, const unsigned char* tail,
                                        std::size_t tail_bytes) noexcept {
  unsigned char summary[4 * 8 + 8 + 8] = {};
  std::memcpy(summary, lanes, 4 * 8);
  const std::uint64_t n = bytes;
  std::memcpy(summary + 32, &n, sizeof n);
  if (tail_bytes != 0) std::memcpy(summary + 40, tail, tail_bytes);
  return fast_content_hasher{}(summary, sizeof summary);
}

/// glake_content_hash in the current context: loaded from the embedded PTX once per context
/// (kept for the process's life, as primary contexts are); null where no context is current or
/// the driver cannot load it.
inline CUfunction content_hash_function() noexcept {
  CUcontext context = nullptr;
  if (cuCtxGetCurrent(&context) != CUDA_SUCCESS || context == nullptr) return nullptr;
  static std::mutex mutex;
  static std::vector<std::pair<CUcontext, CUfunction>> loaded;
  std::lock_guard lock(mutex);
  for (const auto& [c, f] : loaded) {
    if (c == context) return f;
  }
  CUmodule module = nullptr;
  CUfunction function = nullptr;
  if (cuModuleLoadData(&module, content_hash_ptx) != CUDA_SUCCESS) return nullptr;
  if (cuModuleGetFunction(&function, module, "glake_content_hash") != CUDA_SUCCESS) {
    (void)cuModuleUnload(module);
    return nullptr;
  }
  try {
    loaded.emplace_back(context, function);
  } catch (...) {
    (void)cuModuleUnload(module);
    return nullptr;
  }
  return function;
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// cuda_device_hasher
//
// Hashes device memory where it is: one kernel (glake_content_hash, embedded as PTX and loaded
// once per context) reduces the range's 8-byte words to four 64-bit lanes, each word mixed with
// its index, combined by sums and an exclusive or so that the result does not depend on thread
// order; the host then hashes the lanes, the length and the last bytes % 8 bytes into the digest.
// The kernel runs on the legacy default stream (after the work queued on blocking streams, as
// cuMemcpyDtoH would), and the call waits for it. Where the kernel cannot run (no current
// context, the PTX refused, a misaligned pointer), the same lanes are computed on the host from
// a staged copy: equal bytes give equal digests on every path and in every process. A failure
// of both gives a digest no other piece gets (never a wrong match: the broker compares bytes).
// Cost: per call a 32-byte device allocation, a memset, a launch and a 32-byte copy back, about
// the same whatever the size up to a few MiB; the bytes are read once, at device bandwidth.
// Thread safety: any thread; each call uses buffers of its own.
// ---------------------------------------------------------------------------------------------
struct cuda_device_hasher {
  content_digest operator()(const void* device, std::size_t bytes) const noexcept {
    const std::size_t words = bytes / 8;
    unsigned char tail[8] = {};
    const std::size_t tail_bytes = bytes % 8;
    if (tail_bytes != 0 && cuMemcpyDtoH(tail, detail::device_pointer(device) + words * 8, tail_bytes) != CUDA_SUCCESS) {
      return unique();
    }
    std::uint64_t lanes[4] = {0, 0, 0, 0};
    if (words != 0 && !on_device(device, words, lanes) && !on_host(device, words, lanes)) return unique();
    return detail::content_digest_of(lanes, bytes, tail, tail_bytes);
  }

 private:
  static bool on_device(const void* device, std::uint64_t words, std::uint64_t lanes[4]) noexcept {
    if (reinterpret_cast<std::uintptr_t>(device) % 8 != 0) return false;
    CUfunction function = detail::content_hash_function();
    if (function == nullptr) return false;
    CUdeviceptr out = 0;
    if (cuMemAlloc(&out, 4 * sizeof(std::uint64_t)) != CUDA_SUCCESS) return false;
    constexpr unsigned threads = 256;
    const std::uint64_t wanted = (words + threads * 8 - 1) / (threads * 8);
    const unsigned blocks = static_cast<unsigned>(wanted < 1024 ? wanted : 1024);
    CUdeviceptr in = detail::device_pointer(device);
    unsigned long long n = words;
    void* arguments[] = {&in, &n, &out};
    const bool done = cuMemsetD8(out, 0, 4 * sizeof(std::uint64_t)) == CUDA_SUCCESS &&
                      cuLaunchKernel(function, blocks, 1, 1, threads, 1, 1, 0, nullptr, arguments, nullptr) ==
                          CUDA_SUCCESS &&
                      cuMemcpyDtoH(lanes, out, 4 * sizeof(std::uint64_t)) == CUDA_SUCCESS;
    (void)cuMemFree(out);
    return done;
  }

  static bool on_host(const void* device, std::uint64_t words, std::uint64_t lanes[4]) noexcept {
    constexpr std::size_t step = 8 * MiB;
    std::unique_ptr<char[]> buffer(new (std::nothrow) char[step]);
    if (!buffer) return false;
    lanes[0] = lanes[1] = lanes[2] = lanes[3] = 0;
    for (std::uint64_t at = 0; at < words;) {
      const std::uint64_t n = words - at < step / 8 ? words - at : step / 8;
      if (cuMemcpyDtoH(buffer.get(), detail::device_pointer(device) + at * 8, n * 8) != CUDA_SUCCESS) return false;
      detail::content_hash_lanes(buffer.get(), at, n, lanes);
      at += n;
    }
    return true;
  }

  static content_digest unique() noexcept { return detail::digest_of_no_content(); }
};
static_assert(content_hasher<cuda_device_hasher>);

// ---------------------------------------------------------------------------------------------
// cuda_shareable_backend
//
// export_copy: a new handle made exportable (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), mapped
// in a scratch range, filled with cuMemcpyDtoD from the piece, exported as a file descriptor
// (cuMemExportToShareableHandle) and released: the descriptor keeps the memory. map_readonly:
// imports the descriptor (cuMemImportFromShareableHandle) and maps it over the piece in place of
// the handle mapped there (cuMemRetainAllocationHandle finds it; the piece must be exactly one
// mapped handle, since cuMemUnmap takes whole mappings), with CU_MEM_ACCESS_FLAGS_PROT_READ;
// on failure the old handle is mapped back. make_private: a new handle filled from the piece and
// mapped over it read-write. The memory of the handle replaced goes back to the driver only when
// its owner holds no reference any more (memory mapped and released at once, as cudaMalloc-like
// code does; an allocator that keeps its handles must release them itself).
// The work that filled a piece must be complete before export_copy (it copies on the legacy
// stream and waits for the context). Each call is O(1) driver calls plus an O(n) copy.
// Thread safety: the driver's; stateless besides the device. Never used after a fork (CUDA).
// ---------------------------------------------------------------------------------------------
class cuda_shareable_backend {
 public:
  explicit cuda_shareable_backend(int device = 0) : device_(device) {
    detail::cuda_check(cuInit(0), "cuInit");
    const CUmemAllocationProp prop = detail::cuda_device_properties(device, true);
    detail::cuda_check(cuMemGetAllocationGranularity(&granularity_, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                       "cuMemGetAllocationGranularity");
  }

  std::size_t granularity() const noexcept { return granularity_; }

  detail::unique_fd export_copy(const void* at, std::size_t bytes) {
    detail::cuda_handle copy = create(bytes, true);
    {
      detail::cuda_scratch_view view(copy.get(), bytes, device_, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
      detail::cuda_check(cuMemcpyDtoD(view.address(), detail::device_pointer(at), bytes), "cuMemcpyDtoD");
      detail::cuda_check(cuCtxSynchronize(), "cuCtxSynchronize");
    }
    int fd = -1;
    detail::cuda_check(cuMemExportToShareableHandle(&fd, copy.get(), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                       "cuMemExportToShareableHandle");
    return detail::unique_fd(fd);
  }

  void map_readonly(void* at, std::size_t bytes, int fd) {
    detail::cuda_handle imported = detail::import_fd(fd);
    detail::cuda_remap(at, bytes, imported.get(), device_, CU_MEM_ACCESS_FLAGS_PROT_READ);
  }

  void make_private(void* at, std::size_t bytes) {
    detail::cuda_handle own = create(bytes, false);
    {
      detail::cuda_scratch_view view(own.get(), bytes, device_, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
      detail::cuda_check(cuMemcpyDtoD(view.address(), detail::device_pointer(at), bytes), "cuMemcpyDtoD");
      detail::cuda_check(cuCtxSynchronize(), "cuCtxSynchronize");
    }
    detail::cuda_remap(at, bytes, own.get(), device_, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  }

  /// Writable memory in place of the shared piece (its contents are not cleared: device memory
  /// from cuMemCreate is not); the shared mapping stays when no memory can be had.
  void discard(void* at, std::size_t bytes) noexcept {
    try {
      detail::cuda_handle own = create(bytes, false);
      detail::cuda_remap(at, bytes, own.get(), device_, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    } catch (...) {
    }
  }

 private:
  detail::cuda_handle create(std::size_t bytes, bool shareable) const {
    const CUmemAllocationProp prop = detail::cuda_device_properties(device_, shareable);
    CUmemGenericAllocationHandle h = 0;
    const CUresult r = cuMemCreate(&h, bytes, &prop, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
      throw out_of_memory(bytes, 0, 0, "glake::cuda_shareable_backend: cuMemCreate of " + format_bytes(bytes) +
                                           " failed: out of device memory");
    }
    detail::cuda_check(r, "cuMemCreate");
    return detail::cuda_handle(h);
  }

  int device_;
  std::size_t granularity_ = 0;
};
static_assert(shareable_backend<cuda_shareable_backend>);

// ---------------------------------------------------------------------------------------------
// cuda_content_verifier
//
// The broker's checks of device memory exported by clients. check imports the descriptor and
// maps it read-only in a scratch range of the claimed size (an object shorter than that, or a
// descriptor that is no CUDA allocation, fails there); equal and equal_slice (the whole objects,
// or one slice of them) import both, map them in scratch ranges and compare through host buffers
// in steps of at most 8 MiB (cuMemcpyDtoH, memcmp); adopt keeps the client's
// descriptor. Copying into a handle of the broker's own would not make the object immutable: a
// CUDA handle carries no access rights, so any process holding its descriptor can map it
// read-write. On the GPU, read-only holds per mapping, against accidental writes, not against an
// admitted peer set on writing (docs/dedup.md). The broker initialises CUDA itself (it is
// started with exec) and retains the device's primary context, made current on the thread
// of each call. O(n) per n bytes compared, plus O(1) driver calls per call; thread safety: one
// broker thread.
// ---------------------------------------------------------------------------------------------
class cuda_content_verifier {
 public:
  explicit cuda_content_verifier(int device = 0)
      : device_(device), context_(std::make_shared<detail::cuda_primary_context>(device)) {}

  const char* check(int fd, std::size_t bytes) const noexcept {
    try {
      current();
      detail::cuda_handle h = detail::import_fd(fd);
      detail::cuda_scratch_view view(h.get(), bytes, device_, CU_MEM_ACCESS_FLAGS_PROT_READ);
      return nullptr;
    } catch (...) {
      return "the descriptor is not an exported CUDA allocation of the claimed size";
    }
  }

  int equal(int a, int b, std::size_t bytes) const noexcept { return equal_slice(a, b, bytes, 0, bytes); }

  /// The bytes [at, at + n) of two objects of `bytes` bytes each (the broker's slices). Both are
  /// imported and mapped whole again for each slice: a few driver calls, and nothing kept that
  /// a descriptor number reused for another object could alias.
  int equal_slice(int a, int b, std::size_t bytes, std::size_t at, std::size_t n) const noexcept {
    if (at > bytes || n > bytes - at) return -1;
    try {
      current();
      constexpr std::size_t most = 8 * MiB;
      const std::size_t step = n < most ? n : most;
      std::unique_ptr<char[]> buffers(new (std::nothrow) char[2 * step]);
      if (!buffers) return -1;
      detail::cuda_handle ha = detail::import_fd(a), hb = detail::import_fd(b);
      detail::cuda_scratch_view va(ha.get(), bytes, device_, CU_MEM_ACCESS_FLAGS_PROT_READ);
      detail::cuda_scratch_view vb(hb.get(), bytes, device_, CU_MEM_ACCESS_FLAGS_PROT_READ);
      for (std::size_t done = 0; done < n; done += step) {
        const std::size_t k = n - done < step ? n - done : step;
        if (cuMemcpyDtoH(buffers.get(), va.address() + at + done, k) != CUDA_SUCCESS ||
            cuMemcpyDtoH(buffers.get() + step, vb.address() + at + done, k) != CUDA_SUCCESS) {
          return -1;
        }
        if (std::memcmp(buffers.get(), buffers.get() + step, k) != 0) return 0;
      }
      return 1;
    } catch (...) {
      return -1;
    }
  }

  detail::unique_fd adopt(detail::unique_fd&& fd, std::size_t) noexcept { return std::move(fd); }

 private:
  // The mappings and copies need a context: the device's primary one, made current on the
  // calling thread (the broker's) at each call.
  void current() const { detail::cuda_check(cuCtxSetCurrent(context_->context), "cuCtxSetCurrent"); }

  int device_;
  std::shared_ptr<detail::cuda_primary_context> context_;
};
static_assert(sliced_content_verifier<cuda_content_verifier>);

}  // namespace glake
