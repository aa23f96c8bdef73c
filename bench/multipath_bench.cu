// Host<->device copies into one GPU (device 0) over its own host link alone, against glake's
// multipath_copier splitting them with 1..k-1 peer GPUs. One program, one run; never run in CI.
//
// First the links are measured, one at a time, 1 GiB (or --max-mib) each: every GPU's own host
// link (pinned cudaMemcpyAsync into and out of its memory), every peer link to and from device 0
// (cudaMemcpyPeerAsync), and all host links at once. The split's weights come from these
// measured bandwidths (one weight set a direction): direct = device 0's own link; peer d = its
// own link and its peer link in series, 1 / (1 / link + 1 / peer link), since a piece crosses
// the two one after the other on the peer's stream.
// Then for each GPU count k in --gpus (devices 0..k-1) and each size (64 MiB .. --max-mib), both
// directions, pinned and pageable host memory, --repeats rounds (5 from 4 GiB up), each round
// timing every method once, in an order reversed every other round:
//   direct          pinned: cudaMemcpyAsync; pageable: glake's staged_copier (the best single path)
//   multipath       multipath_copier with the measured weights
// A time runs from the call to the end of cudaStreamSynchronize on device 0's stream (which waits
// for the peers' streams). Bandwidth = bytes / time (GB/s, 1e9 bytes): median and p10-p90. The
// multipath copies' bytes are checked once per size against the source.
// Output (stdout): "# " header lines (GPUs, driver), one JSON object a line, then markdown.
//
// Build: nvcc -std=c++20 -O3 -arch=sm_90 -Iinclude bench/multipath_bench.cu -lcuda -o /tmp/multipath_bench
// (or the CMake target bench_multipath).
#include <cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "copy_bench_support.hpp"
#include "glake/backends/cuda_copy.hpp"
#include "glake/movers/multipath_copy.hpp"
#include "glake/movers/staged_copy.hpp"

namespace {

using namespace glake;
using namespace glake::bench;
using multipath = multipath_copier<cuda_copy_backend, cuda_pointer_classifier>;
using single = staged_copier<cuda_copy_backend, cuda_pointer_classifier>;

void json_line(const std::string& fields, const summary& s, std::size_t repeats) {
  std::printf("{\"bench\":\"multipath\",%s,\"median_gbps\":%s,\"p10_gbps\":%s,\"p90_gbps\":%s,\"repeats\":%zu}\n",
              fields.c_str(), number(s.median).c_str(), number(s.p10).c_str(), number(s.p90).c_str(), repeats);
  std::fflush(stdout);
}

std::vector<int> parse_list(const char* text) {
  std::vector<int> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) out.push_back(std::atoi(item.c_str()));
  }
  return out;
}

// Waits for every stream of devices [0, k).
void sync_all(const std::vector<cudaStream_t>& streams, int k) {
  for (int d = 0; d < k; ++d) check(cudaStreamSynchronize(streams[static_cast<std::size_t>(d)]), "sync");
}

struct link_rates {
  summary own_h2d, own_d2h;    // the device's own host link
  summary to_0, from_0;        // its memory to device 0's, and back, cudaMemcpyPeerAsync (peers only)
};

double in_series(double a, double b) { return 1.0 / (1.0 / a + 1.0 / b); }

struct row {
  int gpus;
  std::size_t bytes;
  const char* host;       // "pinned" | "pageable"
  const char* direction;  // "h2d" | "d2h"
  summary direct, split;
  std::vector<double> shares;  // fraction of the bytes per path in the multipath copies
  bool ok;
};

}  // namespace

int main(int argc, char** argv) {
  std::size_t max_mib = 8192;
  int repeats = 7;
  std::vector<int> gpu_counts = {2, 3, 4, 8};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--max-mib" && i + 1 < argc) {
      max_mib = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--repeats" && i + 1 < argc) {
      repeats = std::atoi(argv[++i]);
    } else if (a == "--gpus" && i + 1 < argc) {
      gpu_counts = parse_list(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--max-mib N (8192)] [--repeats N (7)] [--gpus 2,3,4,8]\n", argv[0]);
      return 2;
    }
  }
  int count = 0;
  check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  gpu_counts.erase(std::remove_if(gpu_counts.begin(), gpu_counts.end(), [&](int k) { return k < 2 || k > count; }),
                   gpu_counts.end());
  if (gpu_counts.empty()) {
    std::printf("# multipath_bench: %d GPU(s) here; it needs 2 or more\n", count);
    return 2;
  }
  const int most = *std::max_element(gpu_counts.begin(), gpu_counts.end());
  const std::size_t max_bytes = max_mib * MiB;
  const std::size_t cal_bytes = std::min<std::size_t>(1024 * MiB, max_bytes);

  char host[256] = "?";
  gethostname(host, sizeof host - 1);
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  int runtime = 0;
  cudaRuntimeGetVersion(&runtime);
  std::printf("# multipath_bench: %d GPUs, driver %s, CUDA runtime %d, host %s (%u hardware threads), %s\n", count,
              driver_version().c_str(), runtime, host, std::thread::hardware_concurrency(), date);
  std::vector<cuda_copy_backend> backends;
  std::vector<cudaStream_t> streams(static_cast<std::size_t>(most));
  std::vector<void*> own(static_cast<std::size_t>(most));
  for (int d = 0; d < most; ++d) {
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, d), "cudaGetDeviceProperties");
    std::printf("# GPU %d: %s, PCI %04x:%02x:%02x\n", d, prop.name, prop.pciDomainID, prop.pciBusID, prop.pciDeviceID);
    check(cudaSetDevice(d), "cudaSetDevice");
    check(cudaFree(nullptr), "cudaFree");
    check(cudaStreamCreateWithFlags(&streams[static_cast<std::size_t>(d)], cudaStreamNonBlocking), "stream");
    check(cudaMalloc(&own[static_cast<std::size_t>(d)], cal_bytes), "cudaMalloc");
    backends.emplace_back(d);
  }
  for (int a = 0; a < most; ++a) {
    for (int b = a + 1; b < most; ++b) cuda_enable_peer_access(backends[static_cast<std::size_t>(a)],
                                                               backends[static_cast<std::size_t>(b)]);
  }
  check(cudaSetDevice(0), "cudaSetDevice");
  void* target = nullptr;
  check(cudaMalloc(&target, max_bytes), "cudaMalloc");
  host_buffers buffers(max_bytes, 7);
  void* const pinned = buffers.pinned;
  unsigned char* const pageable = buffers.pageable;
  unsigned char* const back = buffers.back;

  // --- links, one at a time ----------------------------------------------------------------------
  const int cal_reps = std::max(3, repeats);
  auto rate = [&](int device, const std::function<void()>& run) {
    std::vector<method> m = {{"", [&] {
                                check(cudaSetDevice(device), "cudaSetDevice");
                                run();
                                check(cudaSetDevice(0), "cudaSetDevice");
                              },
                              {}}};
    measure(m, cal_bytes, cal_reps, streams[static_cast<std::size_t>(device)]);
    return summarize(m[0].rates);
  };
  std::vector<link_rates> links(static_cast<std::size_t>(most));
  for (int d = 0; d < most; ++d) {
    link_rates& l = links[static_cast<std::size_t>(d)];
    cudaStream_t s = streams[static_cast<std::size_t>(d)];
    void* mine = own[static_cast<std::size_t>(d)];
    l.own_h2d = rate(d, [&] { check(cudaMemcpyAsync(mine, pinned, cal_bytes, cudaMemcpyHostToDevice, s), "h2d"); });
    l.own_d2h = rate(d, [&] { check(cudaMemcpyAsync(pinned, mine, cal_bytes, cudaMemcpyDeviceToHost, s), "d2h"); });
    if (d == 0) continue;
    l.to_0 = rate(d, [&] { check(cudaMemcpyPeerAsync(target, 0, mine, d, cal_bytes, s), "peer"); });
    l.from_0 = rate(d, [&] { check(cudaMemcpyPeerAsync(mine, d, target, 0, cal_bytes, s), "peer"); });
    json_line("\"test\":\"link\",\"path\":\"peer " + std::to_string(d) + " to 0\",\"direction\":\"d2d\",\"bytes\":" +
                  std::to_string(cal_bytes), l.to_0, static_cast<std::size_t>(cal_reps));
    json_line("\"test\":\"link\",\"path\":\"peer 0 to " + std::to_string(d) + "\",\"direction\":\"d2d\",\"bytes\":" +
                  std::to_string(cal_bytes), l.from_0, static_cast<std::size_t>(cal_reps));
  }
  for (int d = 0; d < most; ++d) {
    const link_rates& l = links[static_cast<std::size_t>(d)];
    json_line("\"test\":\"link\",\"path\":\"own " + std::to_string(d) + "\",\"direction\":\"h2d\",\"bytes\":" +
                  std::to_string(cal_bytes), l.own_h2d, static_cast<std::size_t>(cal_reps));
    json_line("\"test\":\"link\",\"path\":\"own " + std::to_string(d) + "\",\"direction\":\"d2h\",\"bytes\":" +
                  std::to_string(cal_bytes), l.own_d2h, static_cast<std::size_t>(cal_reps));
  }
  // Every host link at once, each GPU into (out of) its own memory: the host side's ceiling.
  std::vector<summary> together_h2d, together_d2h;
  for (const int k : gpu_counts) {
    for (const bool h2d : {true, false}) {
      std::vector<method> m = {{"", [&] {
                                  for (int d = 0; d < k; ++d) {
                                    void* mine = own[static_cast<std::size_t>(d)];
                                    // Each GPU its own slice of the host buffer where it has room.
                                    const std::size_t slice = static_cast<std::size_t>(d) * cal_bytes;
                                    void* host = static_cast<char*>(pinned) + (slice + cal_bytes <= max_bytes ? slice : 0);
                                    check(cudaSetDevice(d), "cudaSetDevice");
                                    check(cudaMemcpyAsync(h2d ? mine : host, h2d ? host : mine, cal_bytes,
                                                          cudaMemcpyDefault, streams[static_cast<std::size_t>(d)]),
                                          "together");
                                  }
                                  check(cudaSetDevice(0), "cudaSetDevice");
                                  sync_all(streams, k);
                                },
                                {}}};
      measure(m, cal_bytes * static_cast<std::size_t>(k), cal_reps, streams[0]);
      (h2d ? together_h2d : together_d2h).push_back(summarize(m[0].rates));
      json_line("\"test\":\"links_together\",\"gpus\":" + std::to_string(k) + ",\"direction\":\"" +
                    (h2d ? "h2d" : "d2h") + "\",\"bytes\":" + std::to_string(cal_bytes * static_cast<std::size_t>(k)),
                (h2d ? together_h2d : together_d2h).back(), static_cast<std::size_t>(cal_reps));
    }
  }

  // --- copies into device 0, direct against split ---------------------------------------------------
  single direct_copier{backends[0]};
  std::vector<row> rows;
  for (std::size_t gi = 0; gi < gpu_counts.size(); ++gi) {
    const int k = gpu_counts[gi];
    // One copier a direction, its weights from the measured bandwidths.
    auto make = [&](bool h2d) {
      std::vector<peer_route<cuda_copy_backend>> peers;
      for (int d = 1; d < k; ++d) {
        const link_rates& l = links[static_cast<std::size_t>(d)];
        const double weight =
            h2d ? in_series(l.own_h2d.median, l.to_0.median) : in_series(l.own_d2h.median, l.from_0.median);
        peers.push_back({backends[static_cast<std::size_t>(d)], stream_ref{streams[static_cast<std::size_t>(d)]}, weight});
      }
      multipath_options o;
      o.direct_weight = h2d ? links[0].own_h2d.median : links[0].own_d2h.median;
      return std::make_unique<multipath>(backends[0], std::move(peers), cuda_pointer_classifier{}, o);
    };
    std::unique_ptr<multipath> split_h2d = make(true);
    std::unique_ptr<multipath> split_d2h = make(false);
    const stream_ref s0{streams[0]};
    for (const std::size_t mib : {64, 256, 1024, 2048, 4096, 8192}) {
      if (mib > max_mib) break;
      const std::size_t n = mib * MiB;
      const int reps = mib >= 4096 ? std::min(repeats, 5) : repeats;
      // The bytes, once: there and back through pageable memory.
      check(cudaMemsetAsync(target, 0, n, streams[0]), "memset");
      split_h2d->copy(target, pageable, n, s0);
      std::memset(back, 0, n);
      split_d2h->copy(back, target, n, s0);
      check(cudaStreamSynchronize(streams[0]), "sync");
      const bool ok = same_bytes(back, pageable, n);
      for (const bool is_pinned : {true, false}) {
        unsigned char* const mem = is_pinned ? static_cast<unsigned char*>(pinned) : pageable;
        unsigned char* const dst_host = is_pinned ? static_cast<unsigned char*>(pinned) : back;
        for (const bool h2d : {true, false}) {
          multipath& split = h2d ? *split_h2d : *split_d2h;
          const multipath_statistics before = split.stats();
          std::vector<method> m = {
              {"direct",
               [&] {
                 if (is_pinned) {
                   check(cudaMemcpyAsync(h2d ? target : dst_host, h2d ? static_cast<void*>(mem) : target, n,
                                         cudaMemcpyDefault, streams[0]),
                         "direct");
                 } else if (h2d) {
                   direct_copier.copy(target, mem, n, s0);
                 } else {
                   direct_copier.copy(dst_host, target, n, s0);
                 }
               },
               {}},
              {"multipath", [&] { h2d ? split.copy(target, mem, n, s0) : split.copy(dst_host, target, n, s0); }, {}},
          };
          measure(m, n, reps, streams[0]);
          const multipath_statistics after = split.stats();
          row r{k, n, is_pinned ? "pinned" : "pageable", h2d ? "h2d" : "d2h", summarize(m[0].rates),
                summarize(m[1].rates), {}, ok};
          std::uint64_t total = 0;
          for (std::size_t p = 0; p < after.path_bytes.size(); ++p) total += after.path_bytes[p] - before.path_bytes[p];
          for (std::size_t p = 0; p < after.path_bytes.size(); ++p) {
            r.shares.push_back(total == 0 ? 0.0
                                          : static_cast<double>(after.path_bytes[p] - before.path_bytes[p]) /
                                                static_cast<double>(total));
          }
          for (std::size_t q = 0; q < m.size(); ++q) {
            json_line("\"test\":\"copy\",\"gpus\":" + std::to_string(k) + ",\"bytes\":" + std::to_string(n) +
                          ",\"host\":\"" + r.host + "\",\"direction\":\"" + r.direction + "\",\"method\":\"" +
                          m[q].name + "\",\"bytes_ok\":" + (ok ? "true" : "false"),
                      summarize(m[q].rates), m[q].rates.size());
          }
          rows.push_back(r);
        }
      }
    }
  }

  // --- tables ------------------------------------------------------------------------------------
  std::printf("\n### Links, %zu MiB, GB/s: median (p10-p90)\n\n"
              "| GPU | own link h2d | own link d2h | its memory to GPU 0's | GPU 0's memory to its |\n"
              "|---|---|---|---|---|\n",
              cal_bytes / MiB);
  for (int d = 0; d < most; ++d) {
    const link_rates& l = links[static_cast<std::size_t>(d)];
    std::printf("| %d | %s | %s | %s | %s |\n", d, cell(l.own_h2d).c_str(), cell(l.own_d2h).c_str(),
                d == 0 ? "-" : cell(l.to_0).c_str(), d == 0 ? "-" : cell(l.from_0).c_str());
  }
  std::printf("\n### Every host link at once (each GPU its own %zu MiB), GB/s in total\n\n"
              "| GPUs | h2d | d2h |\n|---|---|---|\n",
              cal_bytes / MiB);
  for (std::size_t gi = 0; gi < gpu_counts.size(); ++gi) {
    std::printf("| %d | %s | %s |\n", gpu_counts[gi], cell(together_h2d[gi]).c_str(), cell(together_d2h[gi]).c_str());
  }
  for (const char* hostkind : {"pinned", "pageable"}) {
    for (const char* direction : {"h2d", "d2h"}) {
      std::printf("\n### %s, %s memory, into GPU 0's memory%s, GB/s: median (p10-p90)\n\n"
                  "| GPUs | size | direct | multipath | multipath / direct | shares (direct, peers) | bytes |\n"
                  "|---|---|---|---|---|---|---|\n",
                  std::strcmp(direction, "h2d") == 0 ? "Host to device" : "Device to host", hostkind,
                  std::strcmp(direction, "h2d") == 0 ? "" : " (out of)");
      for (const row& r : rows) {
        if (std::strcmp(r.host, hostkind) != 0 || std::strcmp(r.direction, direction) != 0) continue;
        std::string shares;
        for (const double f : r.shares) {
          char b[16];
          std::snprintf(b, sizeof b, "%s%.2f", shares.empty() ? "" : " ", f);
          shares += b;
        }
        std::printf("| %d | %zu MiB | %s | %s | %.2fx | %s | %s |\n", r.gpus, r.bytes / MiB, cell(r.direct).c_str(),
                    cell(r.split).c_str(), r.split.median / r.direct.median, shares.c_str(), r.ok ? "ok" : "WRONG");
      }
    }
  }
  bool ok = true;
  for (const row& r : rows) ok = ok && r.ok;
  direct_copier.release_staging();
  check(cudaFree(target), "cudaFree");
  for (int d = 0; d < most; ++d) {
    check(cudaSetDevice(d), "cudaSetDevice");
    check(cudaFree(own[static_cast<std::size_t>(d)]), "cudaFree");
    check(cudaStreamDestroy(streams[static_cast<std::size_t>(d)]), "cudaStreamDestroy");
  }
  return ok ? 0 : 1;
}
