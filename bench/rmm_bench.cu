// glake against RMM's own resources, all used the way RMM users use them: through
// rmm::device_async_resource_ref, by rmm::device_uvector and rmm::exec_policy (thrust's temporary
// storage). One program, one run, one GPU; never run in CI.
//
// Resources, each wrapped in rmm::mr::statistics_resource_adaptor (the same small cost for all; it
// gives the peak of requested bytes, and cudaMalloc's peak):
//   glake       rmm_resource over stitching_allocator<cuda_provider, cuda_reserver> (no_lock: one
//               thread), default config
//   pool        rmm::mr::pool_memory_resource over cuda_memory_resource; initial size
//               --pool-initial-mib (default 0: grows on demand, by max(request, current size),
//               no maximum), never shrinks
//   cuda_async  rmm::mr::cuda_async_memory_resource (its own cudaMemPool), release threshold
//               SIZE_MAX (keeps its memory across synchronizations, as RMM's default does)
//   cudaMalloc  rmm::mr::cuda_memory_resource
// Workloads, each on a fresh resource:
//   sort   thrust::sort of --keys (default 10^8) uint32 keys, hashed from their index, in a
//          device_uvector from the resource; temporary storage through
//          rmm::exec_policy(stream, resource); one warm-up, then --repeats (default 5) timed sorts
//          (host wall time of the call, which synchronizes), median reported; the keys are
//          refilled before each sort and checked sorted after the last.
//   churn  --churn (default 10^6) device_uvector<std::byte> allocations, sizes log-uniform in
//          [256 B, 64 MiB] (exp of a uniform draw between their logarithms); each step first frees
//          a uniformly random live block when --window (default 1000) are live, then allocates; so
//          after the first 1000 steps every allocation pairs with a random free. The same sizes
//          and choices for every resource. Time per allocation+free: wall time of the loop,
//          including the final frees and a stream synchronize, over --churn. Nothing is written
//          into the blocks.
// Memory, per workload: peak reserved as each resource knows it (glake: its statistics'
// peak_reserved_bytes; pool: pool_size() at the end, since the pool never shrinks; cuda_async:
// the pool's cudaMemPoolAttrReservedMemHigh; cudaMalloc: the statistics adaptor's peak, i.e. the
// bytes asked, before the driver's rounding), and as a cross-check the drop of cudaMemGetInfo's
// free bytes below its value when the resource was made (sampled after each sort and every 1000
// churn steps, so memory held only inside one call, e.g. cudaMalloc's temporary storage, is
// missed).
// Order: the list is run twice, the second time reversed, so a drift of the machine over the run
// shows as a difference between the two passes of one resource.
//
// Build: cmake -DGLAKE_WITH_RMM=ON -DGLAKE_RMM_ROOT=... -DCMAKE_BUILD_TYPE=Release, target
// bench_rmm. Run: build/.../bench/bench_rmm [--keys N] [--repeats N] [--churn N] [--window N]
// [--pool-initial-mib N] [--only glake,pool,cuda_async,cudaMalloc] [--seed N]
// Output (stdout): a "# " line naming the device and the settings, one JSON object a line per
// (pass, resource, workload), then a markdown table; progress goes to stderr.
#include <cuda/version>

#include "glake/adaptors/rmm_resource.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/cuda.hpp"

#include <rmm/cuda_stream.hpp>
#include <rmm/device_uvector.hpp>
#include <rmm/exec_policy.hpp>
#include <rmm/mr/cuda_async_memory_resource.hpp>
#include <rmm/mr/cuda_memory_resource.hpp>
#include <rmm/mr/pool_memory_resource.hpp>
#include <rmm/mr/statistics_resource_adaptor.hpp>
#include <rmm/version_config.hpp>

#include <thrust/sort.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;
using glake_allocator = glake::stitching_allocator<glake::cuda_provider, glake::cuda_reserver>;

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}

std::size_t free_device_bytes() {
  std::size_t free = 0, total = 0;
  check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return free;
}

// --- the resources --------------------------------------------------------------------------------

// One resource made for one workload: what the workload allocates through, and its peak reserved.
class subject {
 public:
  virtual ~subject() = default;
  virtual rmm::device_async_resource_ref ref() = 0;
  virtual std::size_t peak_reserved() = 0;
  virtual std::int64_t peak_requested() = 0;
};

template <class Resource>
class counted_subject : public subject {
 public:
  template <class... Args>
  explicit counted_subject(Args&&... args) : resource_(std::forward<Args>(args)...), counted_(resource_) {}
  rmm::device_async_resource_ref ref() override { return rmm::device_async_resource_ref{counted_}; }
  std::int64_t peak_requested() override { return counted_.get_bytes_counter().peak; }

 protected:
  Resource resource_;
  rmm::mr::statistics_resource_adaptor counted_;
};

class glake_subject final : public counted_subject<glake::rmm_resource<glake_allocator>> {
 public:
  glake_subject()
      : counted_subject(std::make_shared<glake_allocator>(glake::cuda_provider(0), glake::cuda_reserver(0))) {}
  std::size_t peak_reserved() override { return resource_.allocator().stats().peak_reserved_bytes; }
};

class pool_subject final : public counted_subject<rmm::mr::pool_memory_resource> {
 public:
  explicit pool_subject(std::size_t initial) : counted_subject(rmm::mr::cuda_memory_resource{}, initial) {}
  std::size_t peak_reserved() override { return resource_.pool_size(); }
};

class async_subject final : public counted_subject<rmm::mr::cuda_async_memory_resource> {
 public:
  async_subject() : counted_subject(std::nullopt, std::numeric_limits<std::size_t>::max()) {}
  std::size_t peak_reserved() override {
    cuuint64_t high = 0;
    check(cudaMemPoolGetAttribute(resource_.pool_handle(), cudaMemPoolAttrReservedMemHigh, &high),
          "cudaMemPoolGetAttribute(ReservedMemHigh)");
    return static_cast<std::size_t>(high);
  }
};

class cuda_malloc_subject final : public counted_subject<rmm::mr::cuda_memory_resource> {
 public:
  std::size_t peak_reserved() override { return static_cast<std::size_t>(counted_.get_bytes_counter().peak); }
};

struct candidate {
  std::string name;
  std::function<std::unique_ptr<subject>()> make;
};

// --- the workloads --------------------------------------------------------------------------------

struct options {
  std::size_t keys = 100'000'000;
  int repeats = 5;
  std::size_t churn = 1'000'000;
  std::size_t window = 1000;
  std::size_t pool_initial_mib = 0;
  std::uint64_t seed = 1;
  std::vector<std::string> only;
};

struct result {
  int pass = 0;
  std::string resource;
  std::string workload;
  std::vector<double> times;  // sort: ms per sort; churn: one entry, µs per allocation+free
  double value = 0;           // sort: median ms; churn: µs per allocation+free
  std::size_t peak_reserved = 0;
  std::size_t free_drop = 0;
  std::int64_t peak_requested = 0;
  std::string error;
};

// Tracks the lowest free-memory reading against the one taken when the resource was made.
class free_memory_watch {
 public:
  free_memory_watch() : start_(free_device_bytes()), low_(start_) {}
  void sample() { low_ = std::min(low_, free_device_bytes()); }
  std::size_t drop() const { return start_ - low_; }

 private:
  std::size_t start_;
  std::size_t low_;
};

__global__ void hash_keys(std::uint32_t* keys, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    std::uint32_t x = static_cast<std::uint32_t>(i) ^ seed;  // murmur3's finalizer
    x ^= x >> 16;
    x *= 0x85ebca6bu;
    x ^= x >> 13;
    x *= 0xc2b2ae35u;
    x ^= x >> 16;
    keys[i] = x;
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double elapsed_ms(clock_type::time_point since) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - since).count();
}

void run_sort(const options& o, subject& s, free_memory_watch& watch, result& r) {
  rmm::cuda_stream stream;
  const cuda::stream_ref on = stream;
  rmm::device_uvector<std::uint32_t> keys(o.keys, on, s.ref());
  for (int i = -1; i < o.repeats; ++i) {  // i == -1: the warm-up
    hash_keys<<<1024, 256, 0, stream.value()>>>(keys.data(), keys.size(), static_cast<std::uint32_t>(o.seed));
    check(cudaGetLastError(), "hash_keys");
    stream.synchronize();
    const auto start = clock_type::now();
    thrust::sort(rmm::exec_policy(on, s.ref()), keys.begin(), keys.end());
    stream.synchronize();
    const double ms = elapsed_ms(start);
    watch.sample();
    if (i >= 0) r.times.push_back(ms);
  }
  if (!thrust::is_sorted(rmm::exec_policy(on, s.ref()), keys.begin(), keys.end())) {
    throw std::runtime_error("the keys are not sorted");
  }
  r.value = median(r.times);
}

// The churn's script, the same for every resource.
struct churn_script {
  std::vector<std::size_t> sizes;
  std::vector<std::uint64_t> victims;  // taken modulo the number of live blocks
};

churn_script make_script(const options& o) {
  churn_script script;
  std::mt19937_64 random(o.seed);
  std::uniform_real_distribution<double> log_size(std::log(256.0), std::log(64.0 * 1024 * 1024));
  script.sizes.resize(o.churn);
  script.victims.resize(o.churn);
  for (std::size_t i = 0; i < o.churn; ++i) {
    script.sizes[i] = static_cast<std::size_t>(std::llround(std::exp(log_size(random))));
    script.victims[i] = random();
  }
  return script;
}

void run_churn(const options& o, const churn_script& script, subject& s, free_memory_watch& watch, result& r) {
  rmm::cuda_stream stream;
  const cuda::stream_ref on = stream;
  std::vector<rmm::device_uvector<std::byte>> live;
  live.reserve(o.window);
  const auto start = clock_type::now();
  for (std::size_t i = 0; i < o.churn; ++i) {
    if (live.size() >= o.window) {
      const std::size_t victim = script.victims[i] % live.size();
      std::swap(live[victim], live.back());
      live.pop_back();
    }
    live.emplace_back(script.sizes[i], on, s.ref());
    if (i % 1000 == 999) watch.sample();
  }
  live.clear();
  stream.synchronize();
  const double us = elapsed_ms(start) * 1000.0 / static_cast<double>(o.churn);
  r.times.push_back(us);
  r.value = us;
}

// --- output ---------------------------------------------------------------------------------------

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out;
}

void print_json(const result& r) {
  std::ostringstream times;
  for (std::size_t i = 0; i < r.times.size(); ++i) times << (i ? "," : "") << r.times[i];
  std::printf(
      "{\"pass\":%d,\"resource\":\"%s\",\"workload\":\"%s\",\"%s\":%.4f,\"times\":[%s],\"peak_reserved_bytes\":%zu,"
      "\"free_drop_bytes\":%zu,\"peak_requested_bytes\":%lld%s%s%s}\n",
      r.pass, r.resource.c_str(), r.workload.c_str(), r.workload == "sort" ? "median_ms" : "us_per_alloc_free",
      r.value, times.str().c_str(), r.peak_reserved, r.free_drop, static_cast<long long>(r.peak_requested),
      r.error.empty() ? "" : ",\"error\":\"", json_escape(r.error).c_str(), r.error.empty() ? "" : "\"");
  std::fflush(stdout);
}

std::string mib(std::size_t bytes) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.0f", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buffer;
}

void print_table(const std::vector<result>& results) {
  std::printf("\n| pass | resource | workload | time | peak reserved (MiB) | free-memory drop (MiB) | "
              "peak requested (MiB) |\n|---|---|---|---|---|---|---|\n");
  for (const result& r : results) {
    char time[64];
    if (!r.error.empty()) {
      std::snprintf(time, sizeof time, "failed");
    } else if (r.workload == "sort") {
      std::snprintf(time, sizeof time, "%.2f ms (median of %zu)", r.value, r.times.size());
    } else {
      std::snprintf(time, sizeof time, "%.2f us / alloc+free", r.value);
    }
    std::printf("| %d | %s | %s | %s | %s | %s | %s |\n", r.pass, r.resource.c_str(), r.workload.c_str(), time,
                mib(r.peak_reserved).c_str(), mib(r.free_drop).c_str(),
                mib(static_cast<std::size_t>(std::max<std::int64_t>(r.peak_requested, 0))).c_str());
  }
  for (const result& r : results) {
    if (!r.error.empty()) std::printf("\n%s %s (pass %d) failed: %s\n", r.resource.c_str(), r.workload.c_str(), r.pass, r.error.c_str());
  }
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--keys") {
      o.keys = std::stoull(value());
    } else if (arg == "--repeats") {
      o.repeats = std::stoi(value());
    } else if (arg == "--churn") {
      o.churn = std::stoull(value());
    } else if (arg == "--window") {
      o.window = std::stoull(value());
    } else if (arg == "--pool-initial-mib") {
      o.pool_initial_mib = std::stoull(value());
    } else if (arg == "--seed") {
      o.seed = std::stoull(value());
    } else if (arg == "--only") {
      std::stringstream list(value());
      for (std::string name; std::getline(list, name, ',');) o.only.push_back(name);
    } else {
      throw std::invalid_argument("unknown argument " + arg +
                                  " (--keys N --repeats N --churn N --window N --pool-initial-mib N --seed N "
                                  "--only glake,pool,cuda_async,cudaMalloc)");
    }
  }
  if (o.repeats < 1 || o.window < 1 || o.keys < 1) throw std::invalid_argument("--keys, --repeats, --window must be >= 1");
  return o;
}

}  // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  check(cudaSetDevice(0), "cudaSetDevice");
  check(cudaFree(nullptr), "cudaFree(nullptr)");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  int driver = 0, runtime = 0;
  check(cudaDriverGetVersion(&driver), "cudaDriverGetVersion");
  check(cudaRuntimeGetVersion(&runtime), "cudaRuntimeGetVersion");
  std::printf("# %s, driver %d, runtime %d, RMM %s, CCCL %d.%d.%d; keys %zu, repeats %d, churn %zu, window %zu, "
              "pool initial %zu MiB, seed %llu\n",
              prop.name, driver, runtime, RMM_VERSION, CCCL_MAJOR_VERSION, CCCL_MINOR_VERSION, CCCL_PATCH_VERSION,
              o.keys, o.repeats, o.churn, o.window, o.pool_initial_mib, static_cast<unsigned long long>(o.seed));

  const std::size_t pool_initial = o.pool_initial_mib * 1024 * 1024;
  std::vector<candidate> candidates = {
      {"glake", [] { return std::make_unique<glake_subject>(); }},
      {"pool", [pool_initial] { return std::make_unique<pool_subject>(pool_initial); }},
      {"cuda_async", [] { return std::make_unique<async_subject>(); }},
      {"cudaMalloc", [] { return std::make_unique<cuda_malloc_subject>(); }},
  };
  if (!o.only.empty()) {
    std::erase_if(candidates, [&](const candidate& c) {
      return std::find(o.only.begin(), o.only.end(), c.name) == o.only.end();
    });
  }
  std::vector<candidate> order = candidates;
  order.insert(order.end(), candidates.rbegin(), candidates.rend());

  const churn_script script = make_script(o);
  std::vector<result> results;
  for (std::size_t k = 0; k < order.size(); ++k) {
    const int pass = k < candidates.size() ? 1 : 2;
    for (const char* workload : {"sort", "churn"}) {
      result r;
      r.pass = pass;
      r.resource = order[k].name;
      r.workload = workload;
      std::fprintf(stderr, "# pass %d: %s %s ...", pass, r.resource.c_str(), workload);
      const auto phase_start = clock_type::now();
      try {
        check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
        free_memory_watch watch;
        {
          std::unique_ptr<subject> s = order[k].make();
          if (r.workload == "sort") {
            run_sort(o, *s, watch, r);
          } else {
            run_churn(o, script, *s, watch, r);
          }
          r.peak_reserved = s->peak_reserved();
          r.peak_requested = s->peak_requested();
        }
        r.free_drop = watch.drop();
      } catch (const std::exception& e) {
        r.error = e.what();
      }
      std::fprintf(stderr, " %.1f s\n", elapsed_ms(phase_start) / 1000.0);
      print_json(r);  // at once, so a run cut short keeps what it measured
      results.push_back(std::move(r));
    }
  }
  print_table(results);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_rmm: %s\n", e.what());
  return 1;
}
