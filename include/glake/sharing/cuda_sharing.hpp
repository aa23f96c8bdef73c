// The CUDA models of the sharing contracts: device memory exported as POSIX file descriptors
// and mapped read-only at the same addresses, hashed and compared through host memory.
// Compiled in CI; not yet run on a GPU (docs/dedup.md, "The CUDA backend").
#pragma once

#include <cuda.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include "glake/backends/cuda.hpp"
#include "glake/detail/unix_socket.hpp"
#include "glake/errors.hpp"
#include "glake/sharing/concepts.hpp"
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

// ---------------------------------------------------------------------------------------------
// cuda_staged_hasher
//
// Copies device memory to a host buffer in 8 MiB steps (cuMemcpyDtoH) and hashes the digests
// of the steps (fast_content_hasher), so equal bytes give equal digests in every process using
// it. A step that cannot be copied gives a digest no other piece gets (a process-wide counter
// mixed in): the piece is at worst indexed alone, never wrongly matched, since the broker
// compares bytes. A device hasher (a kernel per block) is the faster model still to come.
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
  static content_digest unique() noexcept {
    static std::atomic<std::uint64_t> counter{0};
    content_digest d;
    d.bytes.fill(0xA5);
    const std::uint64_t n = ++counter;
    std::memcpy(d.bytes.data(), &n, sizeof n);
    return d;
  }
};
static_assert(content_hasher<cuda_staged_hasher>);

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
// descriptor that is no CUDA allocation, fails there); equal imports both and compares them
// through host buffers in 8 MiB steps (cuMemcpyDtoH, memcmp); adopt keeps the client's
// descriptor. Copying into a handle of the broker's own would not make the object immutable: a
// CUDA handle carries no access rights, so any process holding its descriptor can map it
// read-write. On the GPU, read-only holds per mapping, against accidental writes, not against an
// admitted peer set on writing (docs/dedup.md). The broker initialises CUDA itself (it is
// started with exec) and retains the device's primary context, made current on the thread
// of each call. O(n) per comparison; thread safety: one broker thread.
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

  int equal(int a, int b, std::size_t bytes) const noexcept {
    try {
      current();
      constexpr std::size_t step = 8 * MiB;
      std::unique_ptr<char[]> buffers(new (std::nothrow) char[2 * step]);
      if (!buffers) return -1;
      detail::cuda_handle ha = detail::import_fd(a), hb = detail::import_fd(b);
      detail::cuda_scratch_view va(ha.get(), bytes, device_, CU_MEM_ACCESS_FLAGS_PROT_READ);
      detail::cuda_scratch_view vb(hb.get(), bytes, device_, CU_MEM_ACCESS_FLAGS_PROT_READ);
      for (std::size_t at = 0; at < bytes; at += step) {
        const std::size_t n = bytes - at < step ? bytes - at : step;
        if (cuMemcpyDtoH(buffers.get(), va.address() + at, n) != CUDA_SUCCESS ||
            cuMemcpyDtoH(buffers.get() + step, vb.address() + at, n) != CUDA_SUCCESS) {
          return -1;
        }
        if (std::memcmp(buffers.get(), buffers.get() + step, n) != 0) return 0;
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
static_assert(content_verifier<cuda_content_verifier>);

}  // namespace glake
