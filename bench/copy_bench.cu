// Host<->device copies from and to pageable memory: cudaMemcpyAsync from pageable memory (the
// baseline), from pinned memory (the ceiling), registering the pageable buffer for the copy
// (cudaHostRegister + cudaMemcpyAsync + cudaHostUnregister), and glake's staged_copier with its
// default options. One program, one run, one GPU; never run in CI.
//
// Sizes 64 MiB, 256 MiB, 1 GiB, 4 GiB, 8 GiB (up to --max-mib). For each size and direction,
// --repeats rounds (5 from 4 GiB up); each round times every method once, in an order that
// reverses every other round. A time runs from the call to the end of cudaStreamSynchronize; the
// pageable buffer is allocated and written once beforehand (its pages exist, as a numpy array's
// do). Bandwidth = bytes / time, in GB/s (1e9 bytes); the tables give the median and p10-p90.
// glake's bytes are checked once per size and direction against the source.
// Sweeps at 1 GiB (or --max-mib if smaller): chunk size 2..32 MiB x threads 1..12 with the
// default ring of buffers, and the number of buffers 2..16 with the default chunk and threads.
// Checkpoint load: a file of --file-bytes (default 2.6e9) written to /tmp, then loaded into
// device memory by (a) read() into a pageable buffer, then cudaMemcpy, (b) read() into pinned
// memory, then cudaMemcpy (a ceiling for a read-then-copy), (c) staged_copier::copy_from_file
// (pread by the engine's threads straight into its pinned buffers). The file stays in the page
// cache (dropping it needs root): this measures the copies, not the disk.
// Output (stdout): a "# " header naming the GPU and driver, one JSON object a line, then markdown.
//
// Build: nvcc -std=c++20 -O3 -arch=sm_90 -Iinclude bench/copy_bench.cu -lcuda -o /tmp/copy_bench
// (or the CMake target bench_copy).
#include <cuda.h>
#include <cuda_runtime.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "glake/backends/cuda_copy.hpp"
#include "glake/movers/staged_copy.hpp"
#include "copy_bench_support.hpp"

namespace {

using namespace glake;
using namespace glake::bench;
using copier_type = staged_copier<cuda_copy_backend, cuda_pointer_classifier>;

void json(const char* test, std::size_t bytes, const char* direction, const std::string& name, const summary& s,
          std::size_t repeats, const std::string& extra = "") {
  std::printf(
      "{\"bench\":\"copy\",\"test\":\"%s\",\"bytes\":%zu,\"direction\":\"%s\",\"method\":\"%s\",\"median_gbps\":%s,"
      "\"p10_gbps\":%s,\"p90_gbps\":%s,\"repeats\":%zu%s}\n",
      test, bytes, direction, name.c_str(), number(s.median).c_str(), number(s.p10).c_str(), number(s.p90).c_str(),
      repeats, extra.c_str());
  std::fflush(stdout);
}

struct sizes_row {
  std::size_t bytes;
  std::vector<summary> h2d, d2h;  // in method order
  bool h2d_ok, d2h_ok;
};

}  // namespace

int main(int argc, char** argv) {
  std::size_t max_mib = 8192;
  int repeats = 10;
  std::size_t file_bytes = 2'600'000'000;
  bool sweep = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--max-mib" && i + 1 < argc) {
      max_mib = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--repeats" && i + 1 < argc) {
      repeats = std::atoi(argv[++i]);
    } else if (a == "--file-bytes" && i + 1 < argc) {
      file_bytes = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--no-sweep") {
      sweep = false;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--max-mib N (8192)] [--repeats N (10)] [--file-bytes N (2600000000; 0: none)] "
                   "[--no-sweep]\n",
                   argv[0]);
      return 2;
    }
  }

  check(cudaSetDevice(0), "cudaSetDevice");
  check(cudaFree(nullptr), "cudaFree");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  int runtime = 0;
  cudaRuntimeGetVersion(&runtime);
  char host[256] = "?";
  gethostname(host, sizeof host - 1);
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  const staged_copy_options defaults;
  std::printf("# copy_bench: %s, driver %s, CUDA runtime %d, host %s (%u hardware threads), %s; defaults: "
              "%zu MiB chunks x %zu buffers, %u threads\n",
              prop.name, driver_version().c_str(), runtime, host, std::thread::hardware_concurrency(), date,
              defaults.chunk_bytes / MiB, defaults.chunks, defaults.threads);

  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const stream_ref sref{stream};
  copier_type copier{cuda_copy_backend(0)};
  // Registering needs the locked-memory limit (ulimit -l) to allow it; without it, that method is
  // left out ("nan").
  bool can_register = false;
  {
    std::vector<unsigned char> probe(64 * MiB);
    can_register = cudaHostRegister(probe.data(), probe.size(), cudaHostRegisterDefault) == cudaSuccess;
    if (can_register) check(cudaHostUnregister(probe.data()), "cudaHostUnregister");
    (void)cudaGetLastError();
    if (!can_register) std::printf("# cudaHostRegister is refused here (ulimit -l?): its method is left out\n");
  }

  // --- sizes -----------------------------------------------------------------------------------
  const char* names[] = {"pageable cudaMemcpyAsync", "pinned cudaMemcpyAsync", "register + cudaMemcpyAsync",
                         "glake staged_copier"};
  std::vector<sizes_row> rows;
  for (const std::size_t mib : {64, 256, 1024, 4096, 8192}) {
    if (mib > max_mib) break;
    const std::size_t n = mib * MiB;
    const int reps = mib >= 4096 ? std::min(repeats, 5) : repeats;
    void* dev = nullptr;
    check(cudaMalloc(&dev, n), "cudaMalloc");
    host_buffers host(n, 1);
    void* const pinned = host.pinned;
    unsigned char* const pageable = host.pageable;
    unsigned char* const back = host.back;
    sizes_row row{n, {}, {}, false, false};

    // Correctness, once: glake's copy there and back.
    copier.copy(dev, pageable, n, sref);
    copier.copy(back, dev, n, sref);
    check(cudaStreamSynchronize(stream), "sync");
    row.h2d_ok = row.d2h_ok = same_bytes(back, pageable, n);

    std::vector<method> h2d = {
        {names[0], [&] { check(cudaMemcpyAsync(dev, pageable, n, cudaMemcpyHostToDevice, stream), "h2d"); }, {}},
        {names[1], [&] { check(cudaMemcpyAsync(dev, pinned, n, cudaMemcpyHostToDevice, stream), "h2d"); }, {}},
        {names[2],
         can_register ? std::function<void()>([&] {
           check(cudaHostRegister(pageable, n, cudaHostRegisterDefault), "cudaHostRegister");
           check(cudaMemcpyAsync(dev, pageable, n, cudaMemcpyHostToDevice, stream), "h2d");
           check(cudaStreamSynchronize(stream), "sync");
           check(cudaHostUnregister(pageable), "cudaHostUnregister");
         })
                      : std::function<void()>(),
         {}},
        {names[3], [&] { copier.copy(dev, pageable, n, sref); }, {}},
    };
    measure(h2d, n, reps, stream);
    std::vector<method> d2h = {
        {names[0], [&] { check(cudaMemcpyAsync(back, dev, n, cudaMemcpyDeviceToHost, stream), "d2h"); }, {}},
        {names[1], [&] { check(cudaMemcpyAsync(pinned, dev, n, cudaMemcpyDeviceToHost, stream), "d2h"); }, {}},
        {names[2],
         can_register ? std::function<void()>([&] {
           check(cudaHostRegister(back, n, cudaHostRegisterDefault), "cudaHostRegister");
           check(cudaMemcpyAsync(back, dev, n, cudaMemcpyDeviceToHost, stream), "d2h");
           check(cudaStreamSynchronize(stream), "sync");
           check(cudaHostUnregister(back), "cudaHostUnregister");
         })
                      : std::function<void()>(),
         {}},
        {names[3], [&] { copier.copy(back, dev, n, sref); }, {}},
    };
    measure(d2h, n, reps, stream);
    for (std::size_t k = 0; k < h2d.size(); ++k) {
      row.h2d.push_back(summarize(h2d[k].rates));
      row.d2h.push_back(summarize(d2h[k].rates));
      json("sizes", n, "h2d", h2d[k].name, row.h2d.back(), h2d[k].rates.size());
      json("sizes", n, "d2h", d2h[k].name, row.d2h.back(), d2h[k].rates.size());
    }
    rows.push_back(row);
    check(cudaFree(dev), "cudaFree");
  }
  copier.release_staging();

  // --- sweeps at 1 GiB -------------------------------------------------------------------------
  const std::size_t chunks_mib[] = {2, 4, 8, 16, 32};
  const unsigned thread_counts[] = {1, 2, 4, 8, 12};
  const std::size_t ring_counts[] = {2, 4, 8, 16};
  const std::size_t sweep_bytes = std::min<std::size_t>(1024, max_mib) * MiB;
  std::vector<std::vector<summary>> sweep_h2d, sweep_d2h;  // [chunk][threads]
  std::vector<summary> ring_h2d, ring_d2h;
  if (sweep) {
    void* dev = nullptr;
    check(cudaMalloc(&dev, sweep_bytes), "cudaMalloc");
    auto* pageable = static_cast<unsigned char*>(std::malloc(sweep_bytes));
    fill_pattern(pageable, sweep_bytes, 2);
    const int reps = std::max(3, repeats / 2);
    auto run = [&](staged_copy_options o, summary& h, summary& d) {
      copier_type c{cuda_copy_backend(0), {}, o};
      std::vector<method> m = {{"h2d", [&] { c.copy(dev, pageable, sweep_bytes, sref); }, {}},
                               {"d2h", [&] { c.copy(pageable, dev, sweep_bytes, sref); }, {}}};
      measure(m, sweep_bytes, reps, stream);
      h = summarize(m[0].rates);
      d = summarize(m[1].rates);
      const std::string extra = ",\"chunk_bytes\":" + std::to_string(o.chunk_bytes) + ",\"buffers\":" +
                                std::to_string(o.chunks) + ",\"threads\":" + std::to_string(o.threads);
      json("sweep", sweep_bytes, "h2d", "glake staged_copier", h, m[0].rates.size(), extra);
      json("sweep", sweep_bytes, "d2h", "glake staged_copier", d, m[1].rates.size(), extra);
    };
    for (const std::size_t c : chunks_mib) {
      sweep_h2d.emplace_back();
      sweep_d2h.emplace_back();
      for (const unsigned t : thread_counts) {
        staged_copy_options o;
        o.chunk_bytes = c * MiB;
        o.threads = t;
        summary h{}, d{};
        run(o, h, d);
        sweep_h2d.back().push_back(h);
        sweep_d2h.back().push_back(d);
      }
    }
    for (const std::size_t r : ring_counts) {
      staged_copy_options o;
      o.chunks = r;
      summary h{}, d{};
      run(o, h, d);
      ring_h2d.push_back(h);
      ring_d2h.push_back(d);
    }
    std::free(pageable);
    check(cudaFree(dev), "cudaFree");
  }

  // --- checkpoint load -------------------------------------------------------------------------
  std::vector<summary> load;
  bool load_ok = false;
  const char* load_names[] = {"read() to pageable + cudaMemcpy", "read() to pinned + cudaMemcpy",
                              "glake copy_from_file"};
  if (file_bytes > 0) {
    const char* path = "/tmp/glake_copy_bench.bin";
    const int out = ::open(path, O_CREAT | O_TRUNC | O_WRONLY, 0600);
    if (out < 0) {
      std::perror(path);
      return 1;
    }
    {
      std::vector<unsigned char> block(64 * MiB);
      for (std::size_t at = 0; at < file_bytes; at += block.size()) {
        const std::size_t n = std::min(block.size(), file_bytes - at);
        fill_pattern(block.data(), n, static_cast<unsigned>(at / block.size()));
        if (::write(out, block.data(), n) != static_cast<ssize_t>(n)) {
          std::perror("write");
          return 1;
        }
      }
    }
    ::fsync(out);
    ::close(out);
    const int fd = ::open(path, O_RDONLY);
    void* dev = nullptr;
    void* pinned = nullptr;
    check(cudaMalloc(&dev, file_bytes), "cudaMalloc");
    check(cudaMallocHost(&pinned, file_bytes), "cudaMallocHost");
    auto* pageable = static_cast<unsigned char*>(std::malloc(file_bytes));
    std::memset(pageable, 0, file_bytes);
    auto read_all = [&](void* to) {
      std::size_t done = 0;
      while (done < file_bytes) {
        const ssize_t got = ::pread(fd, static_cast<char*>(to) + done, file_bytes - done, static_cast<off_t>(done));
        if (got <= 0) {
          std::perror("pread");
          std::exit(1);
        }
        done += static_cast<std::size_t>(got);
      }
    };
    std::vector<method> m = {
        {load_names[0],
         [&] {
           read_all(pageable);
           check(cudaMemcpyAsync(dev, pageable, file_bytes, cudaMemcpyHostToDevice, stream), "h2d");
         },
         {}},
        {load_names[1],
         [&] {
           read_all(pinned);
           check(cudaMemcpyAsync(dev, pinned, file_bytes, cudaMemcpyHostToDevice, stream), "h2d");
         },
         {}},
        {load_names[2], [&] { copier.copy_from_file(dev, fd, 0, file_bytes, sref); }, {}},
    };
    measure(m, file_bytes, std::max(3, repeats / 2), stream);
    // What glake loaded, back in pinned memory, against what read() got.
    copier.copy_from_file(dev, fd, 0, file_bytes, sref);
    check(cudaMemcpyAsync(pinned, dev, file_bytes, cudaMemcpyDeviceToHost, stream), "d2h");
    check(cudaStreamSynchronize(stream), "sync");
    read_all(pageable);
    load_ok = same_bytes(pinned, pageable, file_bytes);
    for (method& x : m) {
      load.push_back(summarize(x.rates));
      json("checkpoint_load", file_bytes, "h2d", x.name, load.back(), x.rates.size());
    }
    std::free(pageable);
    check(cudaFreeHost(pinned), "cudaFreeHost");
    check(cudaFree(dev), "cudaFree");
    ::close(fd);
    ::unlink(path);
  }

  // --- tables ----------------------------------------------------------------------------------
  for (const char* direction : {"h2d", "d2h"}) {
    const bool h = std::strcmp(direction, "h2d") == 0;
    std::printf("\n### %s, GB/s: median (p10-p90)\n\n| size | %s | %s | %s | %s | glake / pageable | glake bytes |\n",
                h ? "Host to device" : "Device to host", names[0], names[1], names[2], names[3]);
    std::printf("|---|---|---|---|---|---|---|\n");
    for (const sizes_row& r : rows) {
      const std::vector<summary>& s = h ? r.h2d : r.d2h;
      std::printf("| %zu MiB | %s | %s | %s | %s | %.1fx | %s |\n", r.bytes / MiB, cell(s[0]).c_str(),
                  cell(s[1]).c_str(), cell(s[2]).c_str(), cell(s[3]).c_str(), s[3].median / s[0].median,
                  (h ? r.h2d_ok : r.d2h_ok) ? "ok" : "WRONG");
    }
  }
  if (sweep) {
    for (int d = 0; d < 2; ++d) {
      std::printf("\n### Sweep at %zu MiB, %s, GB/s (median): chunk size x threads, %zu buffers\n\n| chunk |",
                  sweep_bytes / MiB, d == 0 ? "host to device" : "device to host", defaults.chunks);
      for (const unsigned t : thread_counts) std::printf(" %u threads |", t);
      std::printf("\n|---|");
      for (std::size_t i = 0; i < std::size(thread_counts); ++i) std::printf("---|");
      std::printf("\n");
      for (std::size_t c = 0; c < std::size(chunks_mib); ++c) {
        std::printf("| %zu MiB |", chunks_mib[c]);
        for (const summary& s : (d == 0 ? sweep_h2d : sweep_d2h)[c]) std::printf(" %.1f |", s.median);
        std::printf("\n");
      }
    }
    std::printf("\n### Buffers in the ring at %zu MiB (%zu MiB chunks, %u threads), GB/s: median (p10-p90)\n\n"
                "| buffers | host to device | device to host |\n|---|---|---|\n",
                sweep_bytes / MiB, defaults.chunk_bytes / MiB, defaults.threads);
    for (std::size_t r = 0; r < std::size(ring_counts); ++r) {
      std::printf("| %zu | %s | %s |\n", ring_counts[r], cell(ring_h2d[r]).c_str(), cell(ring_d2h[r]).c_str());
    }
  }
  if (!load.empty()) {
    std::printf("\n### Checkpoint load: %.2f GB file (page cache) into device memory, GB/s: median (p10-p90)\n\n"
                "| method | GB/s |\n|---|---|\n",
                static_cast<double>(file_bytes) / 1e9);
    for (std::size_t k = 0; k < load.size(); ++k) std::printf("| %s | %s |\n", load_names[k], cell(load[k]).c_str());
    std::printf("\nglake's loaded bytes: %s\n", load_ok ? "ok" : "WRONG");
  }
  check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  bool ok = load_ok || load.empty();
  for (const sizes_row& r : rows) ok = ok && r.h2d_ok && r.d2h_ok;
  return ok ? 0 : 1;
}
