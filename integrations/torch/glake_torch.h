/* The C interface of libglake_torch.so, glake's stitching allocator for PyTorch's
 * CUDAPluggableAllocator (one allocator per device; settings from GLAKE_ALLOC_CONF and GMLake's
 * variables; see integrations/torch/README.md). Streams are CUDA streams (cudaStream_t and CUstream
 * are both `struct CUstream_st*`). Every function may be called from any thread. Except
 * glake_torch_malloc, none lets an error escape: failures are written to stderr, one line each. */
#ifndef GLAKE_TORCH_H
#define GLAKE_TORCH_H

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define GLAKE_TORCH_API __attribute__((visibility("default")))
#else
#define GLAKE_TORCH_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st;

/* PyTorch's alloc_fn: `size` bytes on `device`, used on `stream`; null on any failure (out of
 * memory, a driver error, bad settings), after one line on stderr. Zero bytes give null. */
GLAKE_TORCH_API void* glake_malloc(size_t size, int device, struct CUstream_st* stream);

/* As glake_malloc, but a failure is thrown as a C++ exception after it is logged: glake's
 * out_of_memory (a std::bad_alloc whose message says "out of memory") or the error that stopped
 * it. For PyTorch, which does not check alloc_fn's result for null but turns an exception thrown
 * by it into a Python RuntimeError. Never call it from C or through ctypes. */
GLAKE_TORCH_API void* glake_torch_malloc(size_t size, int device, struct CUstream_st* stream);

/* PyTorch's free_fn: returns `ptr`, allocated with `size` on `device` and `stream`. Null is
 * ignored; a pointer that is not live there is reported and counted (stat "errors"), not freed. */
GLAKE_TORCH_API void glake_free(void* ptr, size_t size, int device, struct CUstream_st* stream);

/* PyTorch's record_stream hook: `ptr` is also used by work queued on `stream`; its memory is
 * reused only once that work has completed. */
GLAKE_TORCH_API void glake_record_stream(void* ptr, struct CUstream_st* stream);

/* Host time spent inside glake_malloc, glake_torch_malloc, glake_free and glake_record_stream
 * (all devices, all threads) and the number of those calls, since the process started. Measured
 * only when GLAKE_HOST_TIMING was set (to anything but "" or "0") at the plug-in's first call:
 * returns 1 then, else 0 with both counts 0. Either pointer may be null. */
GLAKE_TORCH_API int glake_host_time(uint64_t* ns, uint64_t* calls);

/* Releases cached memory (unmaps cached stitched ranges, returns fully free segments) on `device`,
 * or on every device when `device` is negative. */
GLAKE_TORCH_API void glake_empty_cache(int device);

/* glake_empty_cache(-1), with the signature of PyTorch's reset hook (set_reset_fn), which
 * torch.cuda.empty_cache() calls. */
GLAKE_TORCH_API void glake_empty_cache_all(void);

/* Peaks are measured from now on (on `device`, or every device when negative). */
GLAKE_TORCH_API void glake_reset_peak(int device);

/* PyTorch's set_memory_fraction_fn: from now on `device` holds at most `fraction` (0..1) of its
   memory (1: the whole device); cached memory above it is released at once. Makes the device's
   allocator if needed. A fraction outside [0, 1] is refused with one line on stderr. */
GLAKE_TORCH_API void glake_set_memory_fraction(double fraction, int device);

/* Writes up to `capacity` statistics of `device` into `values`, in the order glake_stats_names
 * gives, and returns how many there are (0 for a device id out of range). A device without an
 * allocator yet reads as zeros. */
GLAKE_TORCH_API size_t glake_stats(int device, uint64_t* values, size_t capacity);

/* The names of glake_stats' values, separated by commas. */
GLAKE_TORCH_API const char* glake_stats_names(void);

/* The settings a device's allocator is made with if made now, as "key:value,..." (0), or why the
 * environment's settings are invalid (-1); written into `buffer` (truncated to `size`). */
GLAKE_TORCH_API int glake_settings(char* buffer, size_t size);

/* "cuda", or "simulated" for the test build over the simulated backend. */
GLAKE_TORCH_API const char* glake_backend(void);

/* Movable buffers: device memory that moves to host memory and back while its addresses stay
 * (glake::virtual_buffer, 64 MiB pieces; docs/offload.md). Not blocks of the allocator: they are
 * made and destroyed here, not by glake_malloc / glake_free, and not counted in glake_stats.
 * The calls below return 0, or after one line on stderr (also kept for glake_last_error) -1 for
 * misuse (a pointer in no movable buffer, a buffer not all on the side it leaves), -2 for out of
 * memory (nothing moved), -3 for another failure. */

/* A movable buffer of at least `bytes` on `device`, all on the device (not zeroed): its first
 * address, or null. */
GLAKE_TORCH_API void* glake_movable_create(size_t bytes, int device);

/* Destroys the movable buffer whose first address is `ptr`. Work using it must have completed. */
GLAKE_TORCH_API int glake_movable_destroy(void* ptr);

/* Moves the movable buffer holding `ptr` to host memory (offload) or back (prefetch), ordered on
 * `stream`: work queued on it afterwards sees the data. The addresses do not change; device code
 * may use an offloaded buffer, over the bus. offload returns once its device memory is free.
 * `ptr` may also be a live allocation of glake's allocator (its first address, as glake_malloc
 * returned it, of at least one whole handle: 2 MiB): its whole handles move the same way
 * (stitching_allocator::offload); a private pool's allocation is refused (-1). */
GLAKE_TORCH_API int glake_offload(void* ptr, struct CUstream_st* stream);
GLAKE_TORCH_API int glake_prefetch(void* ptr, struct CUstream_st* stream);

/* The same for `count` buffers, in order; stops at the first failure (the buffers before it have
 * moved). glake_prefetch_many releases what they need from glake's cache once for all. */
GLAKE_TORCH_API int glake_offload_many(void* const* ptrs, size_t count, struct CUstream_st* stream);
GLAKE_TORCH_API int glake_prefetch_many(void* const* ptrs, size_t count, struct CUstream_st* stream);

/* Marks the allocator's live allocation at `ptr` (nonzero `keep`) as not written while it is on
 * the device, such as a frozen weight, or unmarks it: once it has been offloaded and brought back,
 * its host copy is kept, and its next offload copies nothing (stitching_allocator::keep_far_copy).
 * A write to a marked allocation on the device is lost at its next offload. -1 for a pointer that
 * is not a live allocation of the allocator. */
GLAKE_TORCH_API int glake_keep_far_copy(void* ptr, int keep);

/* Host memory the kept copies of marked allocations hold now, over every device. */
GLAKE_TORCH_API size_t glake_far_copy_bytes(void);

/* Where the movable buffer holding `ptr`, or the allocator's live allocation at `ptr`, is: 1 device,
 * 2 host; -1 for neither. */
GLAKE_TORCH_API int glake_residence(const void* ptr);

/* From now on, on the calling thread, requests to glake_malloc / glake_torch_malloc of at least
 * `min_bytes` (0: none) get movable buffers of their own instead of the allocator's blocks, so
 * tensors made then (a forward pass's activations) can be offloaded and prefetched; glake_free
 * returns them to a cache (same rounded size, device and stream), glake_empty_cache releases it.
 * Returns the previous value, for nesting. */
GLAKE_TORCH_API size_t glake_set_movable_scope(size_t min_bytes);

/* Writes up to `capacity` of: buffers, device bytes, host bytes, cached host bytes, bytes offloaded
 * and prefetched so far, bytes of freed allocations cached, reuses of them (all movable buffers);
 * returns how many there are (8). */
GLAKE_TORCH_API size_t glake_movable_stats(uint64_t* values, size_t capacity);

/* Why the calling thread's last movable-buffer call failed ("" when it did not); truncated to
 * `size`; returns the message's full length. */
GLAKE_TORCH_API size_t glake_last_error(char* buffer, size_t size);

/* Shared weights (docs/dedup.md): a region of device memory of at least `bytes` (rounded up to
 * 2 MiB) on `device`, writable, held by its mappings alone (not by glake's allocator); null on
 * failure (glake_last_error). The simulated library makes host memory instead. */
GLAKE_TORCH_API void* glake_shared_create(size_t bytes, int device);

/* Publishes the whole region starting at `ptr` to the dedup broker at `socket` (starting the
 * glake-dedup executable `start_broker` there when none listens, unless null): each 2 MiB piece
 * another process published with the same bytes is mapped on that process's copy, and this
 * process's memory behind it goes back to the driver. The region is read-only from then on (a
 * write faults). Work that filled it must have completed. Writes up to `capacity` of: pieces,
 * pieces shared (mapped on an earlier copy), pieces stored (this copy kept for others), pieces
 * kept private (the broker was unreachable or refused them: the reason went to stderr), bytes
 * given back; returns 0, -1 misuse (not a region, published already, no socket), -2 out of
 * memory, -3 another failure. */
GLAKE_TORCH_API int glake_share(void* ptr, const char* socket, const char* start_broker, uint64_t* values,
                                size_t capacity);

/* Destroys the region starting at `ptr`, giving up its references at the broker. Work using it
 * must have completed. */
GLAKE_TORCH_API int glake_shared_destroy(void* ptr);

/* Swap scheduling of the allocator's own blocks (docs/scheduling.md): a workload that keeps the
 * allocations it manages within `budget_bytes` of device memory, moving them to host memory and
 * back under the same pointers (a planned policy: the furthest next use goes out first, and
 * prefetches are placed from the recorded iterations). With `socket`, the budget is shared with
 * every process whose workloads joined the glake-budget coordinator there (alone with
 * `budget_bytes` when none answers, said once on stderr). Moves are queued on `stream`. `name`
 * names the workload in errors (null: the process id). Returns a handle, or null (glake_last_error). */
GLAKE_TORCH_API void* glake_scheduler_create(int device, size_t budget_bytes, const char* socket, const char* name,
                                             struct CUstream_st* stream);
/* The same with a choice of moves: 0 as glake_scheduler_create (each move waits for the device);
 * 1 deferred (a move queues its copies on `stream` and returns; the memory is remapped once they
 * are done; will_use settles what it names); 2 deferred with the copies on two streams of the
 * scheduler's own (offloads, prefetches), after the work queued on `stream`, so that transfers
 * overlap the work queued after them. With 1 or 2, managed memory that work uses without
 * will_use must be settled first (glake_scheduler_settle). */
GLAKE_TORCH_API void* glake_scheduler_create_with(int device, size_t budget_bytes, const char* socket,
                                                  const char* name, struct CUstream_st* stream, int moves);
GLAKE_TORCH_API int glake_scheduler_destroy(void* scheduler);

/* Manages the live allocation starting at `ptr` (`bytes` long, as the tensor's storage says);
 * unmanage leaves its memory where it is. -1: not a live allocation of glake's allocator, managed
 * already, or not movable (a private pool's; less than one whole 2 MiB handle). */
GLAKE_TORCH_API int glake_scheduler_manage(void* scheduler, void* ptr, size_t bytes);
GLAKE_TORCH_API int glake_scheduler_unmanage(void* scheduler, void* ptr);

/* The next operation uses the managed allocations holding these addresses: on return they are on
 * the device (others moved out, or waited for, as the budget needs). -2: they need more than the
 * whole budget, or no room came within 30 s (the message names the workload and the bytes). */
GLAKE_TORCH_API int glake_scheduler_will_use(void* scheduler, void* const* ptrs, size_t count);

/* An iteration begins (the plan is recorded from, then followed by, iterations); idle: no
 * operation runs, everything may move. */
GLAKE_TORCH_API int glake_scheduler_iteration_begin(void* scheduler);
GLAKE_TORCH_API int glake_scheduler_idle(void* scheduler);

/* Completes every pending (deferred) move of the managed allocations, waiting for their copies:
 * before work that uses them unannounced (an optimizer step over all parameters). */
GLAKE_TORCH_API int glake_scheduler_settle(void* scheduler);

/* Writes up to `capacity` of the values glake_scheduler_stats_names lists (comma-separated);
 * returns how many there are, 0 for a bad handle. */
GLAKE_TORCH_API size_t glake_scheduler_stats(void* scheduler, uint64_t* values, size_t capacity);
GLAKE_TORCH_API const char* glake_scheduler_stats_names(void);

/* Writes out buffered trace lines (GLAKE_TRACE); exit() does it as well. */
GLAKE_TORCH_API void glake_flush_traces(void);

/* Starts (enabled != 0: every device's history emptied, its newest `max_entries` entries kept)
 * or stops (entries kept) the memory history: per device, alloc / free_requested /
 * free_completed / segment_alloc / segment_free / segment_map / segment_unmap / oom entries, as
 * PyTorch's _record_memory_history. 0, or -1 when the history could not be allocated. */
GLAKE_TORCH_API int glake_record_history(int enabled, size_t max_entries);

/* The state of every device (segments and their blocks, stitched ranges) and its memory
 * history, as JSON in the shape of PyTorch's torch.cuda.memory._snapshot() (see
 * integrations/torch/README.md, "Memory snapshots"). Returns its length in bytes; writes it and
 * a terminating NUL into `buffer` only when `size` exceeds that length (call with 0 to ask).
 * 0 on failure. */
GLAKE_TORCH_API size_t glake_snapshot(char* buffer, size_t size);

#ifdef __cplusplus
}
#endif

#ifdef __cplusplus
/* PyTorch's C++ hooks for CUDA graphs' private pools, with the exact types of
 * CUDAPluggableAllocator's set_begin_allocate_to_pool, set_end_allocate_to_pool_fn and
 * set_release_pool (torch/csrc/cuda/CUDAPluggableAllocator.h: a MempoolId_t is a
 * std::pair<unsigned long long, unsigned long long>). C++ functions (g++ / libstdc++, as torch),
 * with unmangled names so that Python can hand their addresses to torch; never call them from C.
 *
 * begin: from now on, allocations on `device` whose stream `filter` accepts come from private
 * pool `pool` (made on first use) until end. A pool's blocks return to it only; release drops
 * one use, and a pool without uses gives its memory back once its last block is freed. */
#include <functional>
#include <utility>

extern "C" {
GLAKE_TORCH_API void glake_begin_allocate_to_pool(int device, std::pair<unsigned long long, unsigned long long> pool,
                                                  std::function<bool(struct CUstream_st*)> filter);
GLAKE_TORCH_API void glake_end_allocate_to_pool(int device, std::pair<unsigned long long, unsigned long long> pool);
GLAKE_TORCH_API void glake_release_pool(int device, std::pair<unsigned long long, unsigned long long> pool);
}
#endif

#ifdef __cplusplus
extern "C" {
#endif
/* Copies `bytes` from `src` to `dst` between device memory and host memory, ordered on `stream`:
 * pageable host memory through glake's staged copier (pinned buffers filled or drained by several
 * threads), pinned and device memory with one cuMemcpyAsync. To the device it returns once `src`
 * was read (it may be reused); to pageable host memory once `dst` holds the data. 0; -1 misuse
 * (null, overlap, another device's memory...), -2 out of pinned memory, -3 a driver error; the
 * reason in glake_last_error. Only in libglake_torch.so (CUDA), not in the simulated library. */
GLAKE_TORCH_API int glake_copy(void* dst, const void* src, size_t bytes, struct CUstream_st* stream);
/* Reads `bytes` of the open file `fd` from `offset` (pread: the file position is untouched) into
 * device memory at `dst`, ordered on `stream`, through the same staged copier (several threads
 * read the file into pinned buffers while the GPU copies the previous one). Returns once the file
 * range has been read. 0; -1 misuse (not device memory, a bad fd, a range past the file's end),
 * -2 out of pinned memory, -3 a read or driver error; the reason in glake_last_error. Only in
 * libglake_torch.so (CUDA). */
GLAKE_TORCH_API int glake_copy_from_file(void* dst, int fd, uint64_t offset, size_t bytes, struct CUstream_st* stream);
#ifdef __cplusplus
}
#endif

#endif /* GLAKE_TORCH_H */
