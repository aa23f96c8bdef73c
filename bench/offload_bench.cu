// Stable-address offload on a GPU: virtual_buffer's offload and prefetch (copy and remap, end to
// end) against cudaMemcpyAsync between device memory and pinned host memory, the remap cost per
// handle, and what a kernel reads per second through an offloaded pointer. One program, one run,
// one GPU; never run in CI.
//
// Sizes 2 MiB to 4 GiB (--max-mib). For each size, --repeats rounds (fewer above 256 MiB); each
// round times, in an order that alternates between rounds: cudaMemcpyAsync device->pinned host
// and back on one stream (until cudaStreamSynchronize), then virtual_buffer::offload (returns
// once every piece is remapped, i.e. after the copies) and virtual_buffer::prefetch plus a
// cudaStreamSynchronize. The first offload of a buffer makes its host handles ("cold": it pins
// host pages); later ones reuse them ("warm", what the rounds time). Bandwidth = bytes / time.
// Piece sizes: --piece-mib (default 64) for the sweep over sizes; a second sweep over piece sizes
// at 256 MiB and 1 GiB.
// Remap: the driver calls one piece of an offload or prefetch costs on the host (unmap, map,
// set_access), timed alone per handle size.
// Kernel reads: a kernel summing 1 GiB as uint4 words (grid-stride), device-resident and then
// offloaded, timed with events; median of --repeats.
// Output (stdout): a "# " header line, one JSON object a line, then markdown tables.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "glake/backends/cuda.hpp"
#include "glake/movers/virtual_buffer.hpp"

namespace {

using namespace glake;
using cuda_buffer = virtual_buffer<cuda_provider, cuda_host_provider, cuda_reserver, cuda_copier>;
using clock_type = std::chrono::steady_clock;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

struct summary {
  double median, p10, p90;
};
summary summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[static_cast<std::size_t>(q * static_cast<double>(v.size() - 1) + 0.5)]; };
  return {at(0.5), at(0.1), at(0.9)};
}

__global__ void read_sum(const uint4* p, std::size_t words, unsigned long long* out) {
  unsigned long long sum = 0;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += std::size_t{gridDim.x} * blockDim.x) {
    const uint4 w = p[i];
    sum += w.x ^ w.y ^ w.z ^ w.w;
  }
  if (sum == 0x1234567) atomicAdd(out, sum);  // keeps the loads
}

double gbps(std::size_t bytes, double s) { return static_cast<double>(bytes) / s / 1e9; }

struct row {
  std::size_t bytes, piece;
  summary d2h, h2d, offload, prefetch;
  double cold_offload;
};

row measure(std::size_t bytes, std::size_t piece, int repeats, cudaStream_t stream) {
  void* dev = nullptr;
  void* host = nullptr;
  check(cudaMalloc(&dev, bytes), "cudaMalloc");
  check(cudaMallocHost(&host, bytes), "cudaMallocHost");
  check(cudaMemset(dev, 1, bytes), "cudaMemset");
  std::memset(host, 2, bytes);
  cuda_buffer buffer(cuda_provider(0), cuda_host_provider(0), cuda_reserver(0), cuda_copier{}, bytes, piece);
  buffer.commit(0, bytes);
  check(cudaMemsetAsync(buffer.data(), 3, bytes, stream), "cudaMemsetAsync");
  check(cudaStreamSynchronize(stream), "sync");
  const stream_ref s{stream};

  auto t = clock_type::now();
  buffer.offload(0, bytes, s);
  const double cold = seconds_since(t);
  buffer.prefetch(0, bytes, s);
  check(cudaStreamSynchronize(stream), "sync");

  std::vector<double> d2h, h2d, off, pre;
  auto copies = [&] {
    auto t0 = clock_type::now();
    check(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, stream), "D2H");
    check(cudaStreamSynchronize(stream), "sync");
    d2h.push_back(seconds_since(t0));
    t0 = clock_type::now();
    check(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream), "H2D");
    check(cudaStreamSynchronize(stream), "sync");
    h2d.push_back(seconds_since(t0));
  };
  auto moves = [&] {
    auto t0 = clock_type::now();
    buffer.offload(0, bytes, s);
    off.push_back(seconds_since(t0));
    t0 = clock_type::now();
    buffer.prefetch(0, bytes, s);
    check(cudaStreamSynchronize(stream), "sync");
    pre.push_back(seconds_since(t0));
  };
  for (int r = 0; r < repeats; ++r) {
    if (r % 2 == 0) {
      copies();
      moves();
    } else {
      moves();
      copies();
    }
  }
  check(cudaFree(dev), "cudaFree");
  check(cudaFreeHost(host), "cudaFreeHost");
  return row{bytes, piece, summarize(d2h), summarize(h2d), summarize(off), summarize(pre), cold};
}

void print_row(const row& r) {
  std::printf(
      "{\"kind\":\"move\",\"bytes\":%zu,\"piece\":%zu,\"d2h_s\":%.6g,\"h2d_s\":%.6g,\"offload_s\":%.6g,"
      "\"offload_p10\":%.6g,\"offload_p90\":%.6g,\"prefetch_s\":%.6g,\"prefetch_p10\":%.6g,\"prefetch_p90\":%.6g,"
      "\"d2h_p10\":%.6g,\"d2h_p90\":%.6g,\"h2d_p10\":%.6g,\"h2d_p90\":%.6g,\"cold_offload_s\":%.6g}\n",
      r.bytes, r.piece, r.d2h.median, r.h2d.median, r.offload.median, r.offload.p10, r.offload.p90, r.prefetch.median,
      r.prefetch.p10, r.prefetch.p90, r.d2h.p10, r.d2h.p90, r.h2d.p10, r.h2d.p90, r.cold_offload);
  std::fflush(stdout);
}

// unmap + map + set_access of one piece, device handle <-> host handle, as an offload does.
summary remap_cost(std::size_t piece, int repeats) {
  cuda_provider device(0);
  cuda_host_provider host(0);
  cuda_reserver reserver(0);
  void* at = reserver.try_reserve(piece);
  const auto d = device.try_create(piece);
  const auto h = host.try_create(piece);
  if (at == nullptr || !d || !h) {
    std::fprintf(stderr, "remap_cost: out of memory\n");
    std::exit(1);
  }
  reserver.try_map(at, piece, *d);
  reserver.try_set_access(at, piece);
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    const bool to_host = r % 2 == 0;
    const auto t0 = clock_type::now();
    reserver.unmap(at, piece);
    reserver.try_map(at, piece, to_host ? *h : *d);
    reserver.try_set_access(at, piece);
    times.push_back(seconds_since(t0));
  }
  reserver.unmap(at, piece);
  reserver.free(at, piece);
  device.release(*d);
  host.release(*h);
  return summarize(times);
}

summary kernel_read(const void* p, std::size_t bytes, int repeats, cudaStream_t stream, unsigned long long* out) {
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "event");
  check(cudaEventCreate(&b), "event");
  std::vector<double> times;
  for (int r = 0; r < repeats + 1; ++r) {
    check(cudaEventRecord(a, stream), "record");
    read_sum<<<132 * 8, 512, 0, stream>>>(static_cast<const uint4*>(p), bytes / sizeof(uint4), out);
    check(cudaEventRecord(b, stream), "record");
    check(cudaEventSynchronize(b), "sync");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, a, b), "elapsed");
    if (r > 0) times.push_back(ms / 1e3);  // the first launch warms up
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return summarize(times);
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = 30;
  std::size_t max_mib = 4096, piece_mib = 64;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--repeats") repeats = std::atoi(argv[i + 1]);
    if (a == "--max-mib") max_mib = std::strtoull(argv[i + 1], nullptr, 10);
    if (a == "--piece-mib") piece_mib = std::strtoull(argv[i + 1], nullptr, 10);
  }
  check(cudaSetDevice(0), "cudaSetDevice");
  check(cudaFree(nullptr), "init");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "props");
  int driver = 0;
  cudaDriverGetVersion(&driver);
  std::printf("# %s, driver API %d, repeats %d, piece %zu MiB\n", prop.name, driver, repeats, piece_mib);
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");

  std::vector<row> rows;
  for (std::size_t mib : {2, 8, 32, 64, 256, 1024, 4096}) {
    if (mib > max_mib) break;
    const int n = mib <= 256 ? repeats : std::max(5, repeats / 3);
    const std::size_t piece = std::min<std::size_t>(piece_mib, mib) * MiB;
    std::fprintf(stderr, "size %zu MiB\n", mib);
    rows.push_back(measure(mib * MiB, piece, n, stream));
    print_row(rows.back());
  }
  std::vector<row> pieces;
  for (std::size_t mib : {256, 1024}) {
    if (mib > max_mib) break;
    for (std::size_t p : {2, 8, 32, 64, 128, 512}) {
      if (p > mib || p == piece_mib) continue;
      std::fprintf(stderr, "size %zu MiB, piece %zu MiB\n", mib, p);
      pieces.push_back(measure(mib * MiB, p * MiB, std::max(5, repeats / 3), stream));
      print_row(pieces.back());
    }
  }
  std::vector<std::pair<std::size_t, summary>> remaps;
  for (std::size_t p : {2, 32, 256}) {
    remaps.push_back({p, remap_cost(p * MiB, 200)});
    std::printf("{\"kind\":\"remap\",\"piece\":%zu,\"median_s\":%.6g,\"p10\":%.6g,\"p90\":%.6g}\n", p * MiB,
                remaps.back().second.median, remaps.back().second.p10, remaps.back().second.p90);
  }
  // Kernel reads through a 1 GiB buffer on the device, then offloaded.
  const std::size_t read_bytes = std::min<std::size_t>(1024, max_mib) * MiB;
  unsigned long long* out = nullptr;
  check(cudaMalloc(&out, sizeof *out), "cudaMalloc");
  summary on_device{}, offloaded{};
  {
    cuda_buffer buffer(cuda_provider(0), cuda_host_provider(0), cuda_reserver(0), cuda_copier{}, read_bytes, 32 * MiB);
    buffer.commit(0, read_bytes);
    check(cudaMemsetAsync(buffer.data(), 7, read_bytes, stream), "memset");
    on_device = kernel_read(buffer.data(), read_bytes, repeats, stream, out);
    buffer.offload(0, read_bytes, stream_ref{stream});
    offloaded = kernel_read(buffer.data(), read_bytes, repeats, stream, out);
    std::printf("{\"kind\":\"kernel_read\",\"bytes\":%zu,\"device_s\":%.6g,\"offloaded_s\":%.6g,\"offloaded_p10\":%.6g,"
                "\"offloaded_p90\":%.6g}\n",
                read_bytes, on_device.median, offloaded.median, offloaded.p10, offloaded.p90);
  }
  cudaFree(out);

  std::printf("\n| size | pinned D2H GB/s | offload GB/s (p10-p90) | offload / D2H | pinned H2D GB/s | prefetch GB/s (p10-p90) | prefetch / H2D | cold offload GB/s |\n|---|---|---|---|---|---|---|---|\n");
  for (const row& r : rows) {
    const double d2h = gbps(r.bytes, r.d2h.median), h2d = gbps(r.bytes, r.h2d.median);
    const double off = gbps(r.bytes, r.offload.median), pre = gbps(r.bytes, r.prefetch.median);
    std::printf("| %zu MiB | %.1f | %.1f (%.1f-%.1f) | %.2f | %.1f | %.1f (%.1f-%.1f) | %.2f | %.1f |\n", r.bytes / MiB, d2h,
                off, gbps(r.bytes, r.offload.p90), gbps(r.bytes, r.offload.p10), off / d2h, h2d, pre,
                gbps(r.bytes, r.prefetch.p90), gbps(r.bytes, r.prefetch.p10), pre / h2d, gbps(r.bytes, r.cold_offload));
  }
  std::printf("\n| size | piece | offload / D2H | prefetch / H2D |\n|---|---|---|---|\n");
  for (const row& r : pieces) {
    std::printf("| %zu MiB | %zu MiB | %.2f | %.2f |\n", r.bytes / MiB, r.piece / MiB, r.d2h.median / r.offload.median,
                r.h2d.median / r.prefetch.median);
  }
  std::printf("\n| handle | remap (unmap + map + set_access), median us (p10-p90) |\n|---|---|\n");
  for (const auto& [p, s] : remaps) std::printf("| %zu MiB | %.1f (%.1f-%.1f) |\n", p, s.median * 1e6, s.p10 * 1e6, s.p90 * 1e6);
  std::printf("\nkernel read of %zu MiB: on the device %.0f GB/s, offloaded %.1f GB/s\n", read_bytes / MiB,
              gbps(read_bytes, on_device.median), gbps(read_bytes, offloaded.median));
  cudaStreamDestroy(stream);
  return 0;
}
