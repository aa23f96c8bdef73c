// pluggable_allocator: the C-interface adaptor (PyTorch's plug-in) over simulated devices: errors
// stay inside, per-device scopes, statistics, peak resets and traces that stay consistent when
// several threads allocate and free at once. The C library itself is tested in integrations/torch/tests.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "glake/adaptors/pluggable_allocator.hpp"
#include "glake/allocators/segregator.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/sim.hpp"
#include "support/evented_reserver.hpp"

using namespace glake;

namespace {

using sim_stitching = stitching_allocator<sim_provider, sim_reserver, best_fit_tail_stitching, lru_eviction, mutex_lock>;

// Devices that outlive the adaptor using them: one per device id, shared by the allocators
// made for it (the general one and its private pools), as a GPU's memory and addresses are.
struct sim_devices {
  std::mutex mutex;
  std::map<int, std::unique_ptr<sim_device>> devices;
  config settings;
  std::function<std::unique_ptr<sim_stitching>(int)> factory() {
    return [this](int id) {
      std::lock_guard guard(mutex);
      auto& device = devices[id];
      if (device == nullptr) device = std::make_unique<sim_device>(16 * GiB);
      return std::make_unique<sim_stitching>(sim_provider{*device}, sim_reserver{*device}, settings);
    };
  }
};

// Records the device of every scope opened.
thread_local std::vector<int>* scopes_seen = nullptr;
struct recording_scope {
  explicit recording_scope(int device) noexcept {
    if (scopes_seen != nullptr) scopes_seen->push_back(device);
  }
};

std::vector<std::string> lines_of(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::vector<std::string> lines;
  char buffer[1024];
  while (std::fgets(buffer, sizeof buffer, f) != nullptr) {
    std::string line(buffer);
    if (!line.empty() && line.back() == '\n') line.pop_back();
    lines.push_back(line);
  }
  return lines;
}

struct temp_dir {
  std::string path;
  temp_dir() {
    char name[] = "/tmp/glake-pluggable-XXXXXX";
    REQUIRE(::mkdtemp(name) != nullptr);
    path = name;
  }
  ~temp_dir() {
    for (const char* file : {"/trace", "/trace.dev1", "/t-3.trace", "/t-0.trace"}) std::remove((path + file).c_str());
    ::rmdir(path.c_str());
  }
};

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::map<std::string_view, std::uint64_t> named(const std::vector<std::uint64_t>& values) {
  std::map<std::string_view, std::uint64_t> out;
  for (std::size_t i = 0; i < pluggable_stat_names.size(); ++i) out[pluggable_stat_names[i]] = values[i];
  return out;
}

// Options that log to `log` (null: nowhere) and record traces to `trace_pattern` (empty: none).
template <class Plugin>
typename Plugin::options options_for(std::FILE* log, std::string trace_pattern = {}) {
  typename Plugin::options o;
  o.log = log;
  o.trace_pattern = std::move(trace_pattern);
  o.pid = 1;
  o.header = {"settings: test"};
  return o;
}

template <class Plugin>
std::map<std::string_view, std::uint64_t> stats_of(Plugin& plugin, int device) {
  std::vector<std::uint64_t> values(pluggable_stat_names.size() + 2, 99);
  REQUIRE(plugin.stats(device, values.data(), values.size()) == pluggable_stat_names.size());
  CHECK(values[pluggable_stat_names.size()] == 99);  // never writes past the names
  return named(values);
}

}  // namespace

TEST_CASE("pluggable_allocator: out of memory is null with one line, or rethrown, the allocator still serves") {
  sim_devices sim;
  sim.settings.memory_limit = 64 * MiB;
  std::FILE* log = std::tmpfile();
  REQUIRE(log != nullptr);
  using plugin_type = pluggable_allocator<sim_stitching>;
  plugin_type plugin(sim.factory(), options_for<plugin_type>(log));

  void* p = plugin.allocate(32 * MiB, 0, stream_ref{7});
  REQUIRE(p != nullptr);
  CHECK(plugin.allocate(128 * MiB, 0, stream_ref{7}) == nullptr);
  CHECK_THROWS_AS((void)plugin.allocate_or_throw(128 * MiB, 0, stream_ref{7}), out_of_memory);
  CHECK(plugin.allocate(0, 0, default_stream) == nullptr);  // silently
  CHECK(plugin.allocate(MiB, 64, default_stream) == nullptr);  // device id out of range
  CHECK_THROWS_AS((void)plugin.allocate_or_throw(MiB, -1, default_stream), usage_error);

  const auto lines = lines_of(log);
  REQUIRE(lines.size() == 4);
  CHECK(lines[0].find("glake: allocating 134217728 bytes on device 0, stream 0x7 failed:") == 0);
  CHECK(lines[0].find("out of memory") != std::string::npos);
  CHECK(lines[1] == lines[0]);
  CHECK(lines[2].find("device 64") != std::string::npos);
  CHECK(lines[3].find("device -1") != std::string::npos);

  const auto s = stats_of(plugin, 0);
  CHECK(s.at("failed_allocations") == 2);
  CHECK(s.at("errors") == 0);  // failed allocations are answered, not swallowed
  void* q = plugin.allocate(16 * MiB, 0, stream_ref{7});
  CHECK(q != nullptr);
  plugin.deallocate(q, 16 * MiB, 0, stream_ref{7});
  plugin.deallocate(p, 32 * MiB, 0, stream_ref{7});
  CHECK(stats_of(plugin, 0).at("active_bytes") == 0);
  std::fclose(log);
}

TEST_CASE("pluggable_allocator: any size up to SIZE_MAX is null at once, counted" * doctest::timeout(30)) {
  sim_devices sim;
  std::FILE* log = std::tmpfile();
  REQUIRE(log != nullptr);
  using plugin_type = pluggable_allocator<sim_stitching>;
  plugin_type plugin(sim.factory(), options_for<plugin_type>(log));
  const std::size_t sizes[] = {16 * GiB + 1, std::size_t{1} << 50, std::size_t{1} << 62, ~std::size_t{0} - 1,
                               ~std::size_t{0}};
  for (std::size_t bytes : sizes) {
    CAPTURE(bytes);
    CHECK(plugin.allocate(bytes, 0, stream_ref{7}) == nullptr);
    CHECK_THROWS_AS((void)plugin.allocate_or_throw(bytes, 0, stream_ref{7}), out_of_memory);
  }
  const auto s = stats_of(plugin, 0);
  CHECK(s.at("failed_allocations") == 2 * std::size(sizes));
  CHECK(s.at("driver_create") == 0);
  CHECK(lines_of(log).size() == 2 * std::size(sizes));
  std::fclose(log);
}

TEST_CASE("pluggable_allocator: bad frees and record_streams are logged and counted, and change nothing") {
  sim_devices sim;
  std::FILE* log = std::tmpfile();
  using plugin_type = pluggable_allocator<sim_stitching>;
  plugin_type plugin(sim.factory(), options_for<plugin_type>(log));
  void* p = plugin.allocate(3 * MiB, 1, default_stream);
  REQUIRE(p != nullptr);
  int local = 0;
  plugin.deallocate(&local, 4, 1, default_stream);       // never allocated
  plugin.deallocate(p, 5 * MiB, 1, default_stream);      // wrong size
  plugin.deallocate(p, 3 * MiB, 2, default_stream);      // a device without an allocator
  plugin.deallocate(p, 3 * MiB, 99, default_stream);     // a device id out of range
  plugin.record_stream(&local, stream_ref{3});           // not live anywhere
  plugin.deallocate(nullptr, 0, 1, default_stream);      // nothing at all
  CHECK(plugin.errors() == 5);
  CHECK(lines_of(log).size() == 5);
  CHECK(stats_of(plugin, 1).at("active_bytes") == 3 * MiB);
  CHECK(stats_of(plugin, 1).at("errors") == 5);
  plugin.record_stream(p, stream_ref{3});  // live: accepted (the sim backend needs no events)
  plugin.deallocate(p, 3 * MiB, 1, default_stream);
  CHECK(plugin.errors() == 5);
  CHECK(stats_of(plugin, 1).at("active_bytes") == 0);
  std::fclose(log);
}

TEST_CASE("pluggable_allocator: record_stream reaches the part of a segregator that owns the pointer") {
  using testing::event_log;
  using testing::evented_reserver;
  using evented_stitching = stitching_allocator<sim_provider, evented_reserver>;
  using two_pools = segregator<evented_stitching, evented_stitching, mutex_lock>;
  static_assert(stream_recording_allocator<two_pools>);
  sim_device device(16 * GiB);
  event_log log;
  config large_settings;
  large_settings.small_limit = 0;
  pluggable_allocator<two_pools> plugin(
      [&](int) {
        return std::make_unique<two_pools>(MiB, std::tuple{sim_provider{device}, evented_reserver{device, log}},
                                           std::tuple{sim_provider{device}, evented_reserver{device, log},
                                                      large_settings});
      },
      options_for<pluggable_allocator<two_pools>>(nullptr));
  const stream_ref a{1}, b{2};
  void* small = plugin.allocate(1000, 0, a);
  void* large = plugin.allocate(8 * MiB, 0, a);
  plugin.record_stream(small, b);
  plugin.record_stream(large, b);
  plugin.deallocate(small, 1000, 0, a);
  plugin.deallocate(large, 8 * MiB, 0, a);
  CHECK(plugin.errors() == 0);
  // Each part keeps its block until b's work is done, rather than reusing it at once.
  two_pools& pools = *plugin.find(0);
  CHECK(log.events.size() == 2);
  CHECK(pools.small().stats().active_bytes == 1000);
  CHECK(pools.large().stats().active_bytes == 8 * MiB);
  log.complete(b);
  plugin.release_cached(0);
  CHECK(pools.small().stats().active_bytes == 0);
  CHECK(pools.large().stats().active_bytes == 0);
  CHECK(stats_of(plugin, 0).at("reserved_bytes") == 0);
}

TEST_CASE("pluggable_allocator: each call runs inside a scope for its device") {
  sim_devices sim;
  using plugin_type = pluggable_allocator<sim_stitching, recording_scope>;
  plugin_type plugin(sim.factory(), options_for<plugin_type>(nullptr));
  std::vector<int> seen;
  scopes_seen = &seen;
  void* a = plugin.allocate(MiB, 2, default_stream);
  void* b = plugin.allocate(4 * MiB, 3, default_stream);
  plugin.deallocate(a, MiB, 2, default_stream);
  // After a's free: simulated devices hand out the same addresses, so a live `a` would be found
  // by device 2 first (CUDA devices share one address space; simulated ones do not).
  plugin.record_stream(b, stream_ref{5});
  plugin.deallocate(b, 4 * MiB, 3, default_stream);
  plugin.release_cached(-1);
  plugin.reset_peak(3);
  std::vector<std::uint64_t> values(pluggable_stat_names.size());
  plugin.stats(3, values.data(), values.size());
  scopes_seen = nullptr;
  std::string text;
  for (int d : seen) text += std::to_string(d);
  CHECK(text == "232332333");
}

TEST_CASE("pluggable_allocator: statistics in the order of the names, resettable peaks, release_cached") {
  sim_devices sim;
  using plugin_type = pluggable_allocator<sim_stitching>;
  plugin_type plugin(sim.factory(), options_for<plugin_type>(nullptr));
  auto s = stats_of(plugin, 5);  // no allocator yet: zeros
  // Not a structured binding: CHECK_MESSAGE captures `name` in a lambda, which clang < 16 refuses.
  for (const auto& stat : s) CHECK_MESSAGE(stat.second == 0, stat.first);
  CHECK(plugin.find(5) == nullptr);

  void* a = plugin.allocate(10 * MiB, 5, default_stream);
  void* b = plugin.allocate(6 * MiB + 100, 5, default_stream);
  plugin.deallocate(a, 10 * MiB, 5, default_stream);
  s = stats_of(plugin, 5);
  const statistics direct = plugin.find(5)->stats();
  CHECK(s.at("active_bytes") == direct.active_bytes);
  CHECK(s.at("peak_active_bytes") == 16 * MiB + 100);
  CHECK(s.at("allocated_bytes") == direct.allocated_bytes);
  CHECK(s.at("reserved_bytes") == 18 * MiB);
  CHECK(s.at("peak_reserved_bytes") == 18 * MiB);
  CHECK(s.at("allocations") == 2);
  CHECK(s.at("deallocations") == 1);
  CHECK(s.at("segments_created") == direct.segments_created);
  CHECK(s.at("driver_create") == direct.driver_calls[driver_call::create]);
  CHECK(s.at("driver_map") == direct.driver_calls[driver_call::map]);
  CHECK(s.at("driver_set_access") == direct.driver_calls[driver_call::set_access]);
  CHECK(s.at("driver_create_ns") == direct.driver_time[driver_call::create]);
  CHECK(s.at("driver_map_ns") == direct.driver_time[driver_call::map]);
  CHECK(s.at("driver_set_access_ns") == direct.driver_time[driver_call::set_access]);
  CHECK(s.at("driver_map_ns") > 0);
  CHECK(s.at("driver_unmap_ns") == 0);  // nothing unmapped yet
  CHECK(s.at("device_waits") == direct.device_waits);
  CHECK(s.at("stream_joins") == direct.stream_joins);
  CHECK(s.at("events_recorded") == direct.events_recorded);
  CHECK(s.at("event_queries") == direct.event_queries);
  CHECK(s.at("event_ns") == direct.event_ns);
  CHECK(s.at("lifetime_peak_reserved_bytes") == 18 * MiB);

  plugin.release_cached(5);
  CHECK(stats_of(plugin, 5).at("reserved_bytes") == 8 * MiB);
  plugin.reset_peak(-1);
  s = stats_of(plugin, 5);
  CHECK(s.at("peak_active_bytes") == 6 * MiB + 100);
  CHECK(s.at("peak_reserved_bytes") == 8 * MiB);
  void* c = plugin.allocate(4 * MiB, 5, default_stream);
  plugin.deallocate(c, 4 * MiB, 5, default_stream);
  s = stats_of(plugin, 5);
  CHECK(s.at("peak_active_bytes") == 10 * MiB + 100);
  CHECK(s.at("peak_reserved_bytes") == 12 * MiB);
  CHECK(s.at("lifetime_peak_active_bytes") == 16 * MiB + 100);
  plugin.deallocate(b, 6 * MiB + 100, 5, default_stream);

  std::uint64_t one = 7;
  CHECK(plugin.stats(64, &one, 1) == 0);  // out of range
  CHECK(one == 7);
}

TEST_CASE("pluggable_allocator: trace file names") {
  CHECK(trace_file_name("/t/run.trace", 0, 42, "") == "/t/run.trace");
  CHECK(trace_file_name("/t/run.trace", 1, 42, "") == "/t/run.dev1.trace");
  CHECK(trace_file_name("/t/run", 3, 42, "") == "/t/run.dev3");
  CHECK(trace_file_name("/t/run-%d.trace", 3, 42, "") == "/t/run-3.trace");
  CHECK(trace_file_name("/t/r%r-d%d-p%p.trace", 1, 42, "5") == "/t/r5-d1-p42.trace");
  CHECK(trace_file_name("/t/r%r.trace", 0, 42, "") == "/t/r0.trace");
  CHECK(trace_file_name("/t/100%%-%x.trace", 0, 42, "") == "/t/100%-%x.trace");
}

TEST_CASE("pluggable_allocator: the trace of several threads is one consistent request stream") {
  temp_dir dir;
  sim_devices sim;
  using plugin_type = pluggable_allocator<sim_stitching>;
  plugin_type plugin(sim.factory(), options_for<plugin_type>(nullptr, dir.path + "/trace"));

  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&plugin, t] {
      const stream_ref stream{static_cast<std::uintptr_t>(t == 0 ? 0 : 0x100 * t)};
      std::vector<std::pair<void*, std::size_t>> live;
      std::uint64_t x = 12345 + t;
      for (int i = 0; i < 1500; ++i) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        if (!live.empty() && (x >> 60) < 8) {
          const auto [p, n] = live[(x >> 20) % live.size()];
          live.erase(live.begin() + static_cast<std::ptrdiff_t>((x >> 20) % live.size()));
          plugin.deallocate(p, n, 0, stream);
        } else {
          const std::size_t n = (x >> 40) % 2 == 0 ? 512 + (x >> 44) % (2 * MiB) : MiB + (x >> 36) % (24 * MiB);
          void* p = plugin.allocate(n, 0, stream);
          CHECK(p != nullptr);
          if (p != nullptr) live.emplace_back(p, n);
        }
      }
      for (const auto& [p, n] : live) plugin.deallocate(p, n, 0, stream);
    });
  }
  for (auto& th : threads) th.join();
  void* other = plugin.allocate(MiB, 1, default_stream);  // device 1: a file of its own
  plugin.deallocate(other, MiB, 1, default_stream);
  plugin.release_cached(-1);
  plugin.flush_traces();

  const auto lines = read_lines(dir.path + "/trace");
  REQUIRE(lines.size() > 3);
  CHECK(lines[0] == "# glake trace of device 0, process 1");
  CHECK(lines[1] == "# settings: test");
  std::map<std::uint64_t, bool> live;  // id -> freed
  std::set<std::string> streams;
  std::uint64_t allocations = 0, frees = 0;
  long long reserved = 0, peak = 0;
  for (const auto& line : lines) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream in(line);
    std::vector<std::string> f;
    for (std::string field; std::getline(in, field, ',');) f.push_back(field);
    if (f[0] == "a") {
      REQUIRE(f.size() == 4);
      CHECK(live.emplace(std::stoull(f[1]), false).second);  // ids never reused
      streams.insert(f[3]);
      ++allocations;
    } else if (f[0] == "f") {
      REQUIRE(f.size() == 2);
      const auto it = live.find(std::stoull(f[1]));
      REQUIRE_MESSAGE(it != live.end(), line);  // a free never precedes its allocation
      CHECK_FALSE(it->second);                  // nor comes twice
      it->second = true;
      ++frees;
    } else {
      REQUIRE((f[0] == "S" || f[0] == "U"));
      reserved += (f[0] == "S" ? 1 : -1) * std::stoll(f[1]);
      CHECK(reserved >= 0);
      peak = std::max(peak, reserved);
    }
  }
  const statistics s = plugin.find(0)->stats();
  CHECK(allocations == s.allocations);
  CHECK(frees == s.deallocations);
  CHECK(streams == std::set<std::string>{"0", "1", "2", "3"});
  CHECK(peak == static_cast<long long>(s.peak_reserved_bytes));
  CHECK(reserved == static_cast<long long>(s.reserved_bytes));
  CHECK(reserved == 0);
  CHECK(read_lines(dir.path + "/trace.dev1").size() == 2 + 4);  // two header lines, S, a, f, U
}

TEST_CASE("pluggable_allocator: a record_stream'd free is traced where its memory became reusable") {
  // Over a backend with events: the free waits for stream B's work, so its `f` line must come
  // when the allocator finished it, not at the call, or a replay would reuse it too early.
  using evented_stitching =
      stitching_allocator<sim_provider, testing::evented_reserver, best_fit_tail_stitching, lru_eviction, mutex_lock>;
  using plugin_type = pluggable_allocator<evented_stitching>;
  temp_dir dir;
  sim_device device(1 * GiB);
  testing::event_log events;
  auto factory = [&](int) {
    return std::make_unique<evented_stitching>(sim_provider{device}, testing::evented_reserver{device, events}, config{});
  };
  const stream_ref A{1}, B{2};
  std::vector<std::string> at_free;
  {
    plugin_type plugin(factory, options_for<plugin_type>(nullptr, dir.path + "/trace"));
    void* p = plugin.allocate(8 * MiB, 0, A);
    void* q = plugin.allocate(8 * MiB, 0, A);
    REQUIRE((p != nullptr && q != nullptr));
    plugin.record_stream(p, B);
    plugin.deallocate(p, 8 * MiB, 0, A);  // deferred: B's event has not completed
    plugin.deallocate(q, 8 * MiB, 0, A);  // at once
    plugin.flush_traces();
    at_free = read_lines(dir.path + "/trace");
    events.complete(B);
    void* r = plugin.allocate(8 * MiB, 0, A);  // finishes the deferred free first
    REQUIRE(r != nullptr);
    plugin.deallocate(r, 8 * MiB, 0, A);
    plugin.flush_traces();
  }
  const auto lines = read_lines(dir.path + "/trace");
  std::vector<std::string> requests;  // without the header and the S/U lines
  for (const auto& line : lines) {
    if (line.rfind("# glake", 0) == 0 || line.rfind("# settings", 0) == 0 || line[0] == 'S' || line[0] == 'U') continue;
    requests.push_back(line);
  }
  CHECK(requests == std::vector<std::string>{"a,0,8388608,1", "a,1,8388608,1", "# record_stream 0 2", "# deferred free 0",
                                             "f,1", "f,0", "a,2,8388608,1", "f,2"});
  // At the deferred free's call, only the comment was written: no `f,0` yet.
  CHECK(std::count(at_free.begin(), at_free.end(), "# deferred free 0") == 1);
  CHECK(std::count(at_free.begin(), at_free.end(), "f,0") == 0);
  CHECK(std::count(at_free.begin(), at_free.end(), "f,1") == 1);
}

// ------------------------------------------------------------------ memory history

namespace {
std::vector<memory_action> actions_of(const std::vector<history_entry>& entries) {
  std::vector<memory_action> out;
  for (const auto& e : entries) out.push_back(e.action);
  return out;
}
}  // namespace

TEST_CASE("pluggable_allocator: the memory history is off by default, ordered, bounded, and stops") {
  using enum memory_action;
  sim_devices sim;
  using plugin_type = pluggable_allocator<sim_stitching>;
  plugin_type plugin(sim.factory(), options_for<plugin_type>(nullptr));
  plugin.deallocate(plugin.allocate(4 * MiB, 0, default_stream), 4 * MiB, 0, default_stream);
  CHECK(!plugin.recording_history());
  CHECK(plugin.history(0).empty());

  REQUIRE(plugin.record_history(true, 100));
  const stream_ref s{7};
  void* a = plugin.allocate(3 * MiB, 0, s);   // from the cached segment: no segment entry
  void* b = plugin.allocate(30 * MiB, 0, s);  // a new segment
  plugin.deallocate(a, 3 * MiB, 0, s);
  CHECK(plugin.allocate(std::size_t{1} << 40, 0, s) == nullptr);
  plugin.release_cached(0);
  auto h = plugin.history(0);
  // The first segment, fully free once `a` was freed, went back with release_cached.
  CHECK(actions_of(h) == std::vector{alloc, segment_alloc, alloc, free_requested, free_completed, oom, segment_free});
  CHECK(h[0].address == reinterpret_cast<std::uintptr_t>(a));
  CHECK(h[0].size == 3 * MiB);
  CHECK(h[0].stream == s);
  CHECK(h[2].address == reinterpret_cast<std::uintptr_t>(b));
  CHECK(h[1].size >= 30 * MiB);
  CHECK(h[3].address == h[0].address);
  CHECK(h[5].size == std::size_t{1} << 40);
  for (std::size_t i = 1; i < h.size(); ++i) CHECK(h[i].time_us >= h[i - 1].time_us);
  CHECK(h[0].time_us > 1'600'000'000'000'000ULL);  // microseconds since the epoch, not since boot
  CHECK(h[6].size == 4 * MiB);
  plugin.deallocate(b, 30 * MiB, 0, s);
  plugin.release_cached(0);
  h = plugin.history(0);
  CHECK(h.back().action == segment_free);

  // A free of something not live is not in the history.
  const std::size_t before = h.size();
  plugin.deallocate(reinterpret_cast<void*>(0x1000), 8, 0, s);
  CHECK(plugin.history(0).size() == before);

  // Bounded: the newest entries stay.
  REQUIRE(plugin.record_history(true, 4));
  for (int i = 0; i < 5; ++i) plugin.deallocate(plugin.allocate(MiB + i, 0, s), MiB + i, 0, s);
  h = plugin.history(0);
  REQUIRE(h.size() == 4);
  CHECK(actions_of(h) == std::vector{free_completed, alloc, free_requested, free_completed});
  CHECK(h[1].size == MiB + 4);

  // Stopped: kept, no more entries.
  plugin.record_history(false, 0);
  plugin.deallocate(plugin.allocate(MiB, 0, s), MiB, 0, s);
  CHECK(plugin.history(0).size() == 4);
}

TEST_CASE("pluggable_allocator: a device made while the history records has one") {
  using enum memory_action;
  sim_devices sim;
  using plugin_type = pluggable_allocator<sim_stitching>;
  plugin_type plugin(sim.factory(), options_for<plugin_type>(nullptr));
  REQUIRE(plugin.record_history(true, 10));
  void* p = plugin.allocate(5 * MiB, 3, default_stream);
  CHECK(actions_of(plugin.history(3)) == std::vector{segment_alloc, alloc});
  CHECK(plugin.history(3).back().device == 3);
  plugin.deallocate(p, 5 * MiB, 3, default_stream);
}

// ------------------------------------------------------------------ private pools

namespace {
using pool_plugin = pluggable_allocator<sim_stitching>;
const stream_ref capture_stream{42}, other_stream{43};
const pool_plugin::pool_id graph_pool{0, 1};
pool_plugin::stream_filter only(stream_ref s) {
  return [s](stream_ref t) { return t == s; };
}
}  // namespace

TEST_CASE("pluggable_allocator: private pools serve their capture's stream, keep their blocks, and give memory back") {
  sim_devices sim;
  pool_plugin plugin(sim.factory(), options_for<pool_plugin>(nullptr));
  void* general_before = plugin.allocate(MiB, 0, capture_stream);
  REQUIRE(plugin.begin_allocate_to_pool(0, graph_pool, only(capture_stream)));
  CHECK(plugin.pool_count(0) == 1);
  void* in_pool = plugin.allocate(64 * MiB, 0, capture_stream);
  void* kept = plugin.allocate(8 * MiB, 0, capture_stream);
  void* elsewhere = plugin.allocate(64 * MiB, 0, other_stream);  // the filter says no
  REQUIRE(plugin.pool_stats(0, graph_pool).has_value());
  CHECK(plugin.pool_stats(0, graph_pool)->allocations == 2);
  CHECK(plugin.find(0)->stats().allocations == 2);
  CHECK(plugin.find(0)->owns(elsewhere));
  CHECK(!plugin.find(0)->owns(in_pool));
  plugin.deallocate(in_pool, 64 * MiB, 0, capture_stream);  // back to the pool, during capture
  CHECK(plugin.pool_stats(0, graph_pool)->deallocations == 1);
  plugin.end_allocate_to_pool(0, graph_pool);

  // After the capture: the same request on the same stream goes to the general allocator, and
  // the pool's freed block is not handed out.
  const std::size_t pool_reserved = plugin.pool_stats(0, graph_pool)->reserved_bytes;
  void* after = plugin.allocate(64 * MiB, 0, capture_stream);
  CHECK(after != in_pool);
  CHECK(plugin.find(0)->owns(after));
  CHECK(plugin.pool_stats(0, graph_pool)->allocations == 2);
  // empty_cache leaves the pool's memory alone: a graph's replays use it.
  plugin.release_cached(-1);
  CHECK(plugin.pool_stats(0, graph_pool)->reserved_bytes == pool_reserved);

  // Statistics: the sums.
  auto s = stats_of(plugin, 0);
  CHECK(s.at("reserved_bytes") == plugin.find(0)->stats().reserved_bytes + pool_reserved);
  CHECK(s.at("allocations") == 3 + 2);
  CHECK(s.at("active_bytes") == MiB + 64 * MiB + 64 * MiB + 8 * MiB);

  // Released while a block is live: the free segment (in_pool's) goes back at once, the live
  // block's once it is freed.
  const std::size_t physical = sim.devices.at(0)->physical_bytes();
  CHECK(physical == pool_reserved + plugin.find(0)->stats().reserved_bytes);
  plugin.release_pool(0, graph_pool);
  CHECK(plugin.pool_count(0) == 1);
  const std::size_t pool_now = plugin.pool_stats(0, graph_pool)->reserved_bytes;
  CHECK(pool_now >= 8 * MiB);
  CHECK(pool_now <= pool_reserved - 64 * MiB);
  CHECK(sim.devices.at(0)->physical_bytes() == physical - (pool_reserved - pool_now));
  plugin.deallocate(kept, 8 * MiB, 0, capture_stream);
  CHECK(plugin.pool_count(0) == 0);
  CHECK(sim.devices.at(0)->physical_bytes() == physical - pool_reserved);
  CHECK(!plugin.pool_stats(0, graph_pool).has_value());
  s = stats_of(plugin, 0);
  CHECK(s.at("reserved_bytes") == plugin.find(0)->stats().reserved_bytes);
  CHECK(s.at("allocations") == 5);  // the pool's counts stay
  CHECK(s.at("deallocations") == 2);
  CHECK(s.at("segments_released") == s.at("segments_created") - plugin.find(0)->stats().segments_created +
                                         plugin.find(0)->stats().segments_released);
  for (auto [p, n] : {std::pair{general_before, MiB}, {elsewhere, 64 * MiB}, {after, 64 * MiB}}) {
    plugin.deallocate(p, n, 0, default_stream);
  }
  CHECK(plugin.errors() == 0);
}

TEST_CASE("pluggable_allocator: the peak reserved is the highest general + pools sum, not the sum of their peaks") {
  sim_devices sim;
  pool_plugin plugin(sim.factory(), options_for<pool_plugin>(nullptr));
  // The general allocator's peak first (a model loading), its memory given back ...
  void* big = plugin.allocate(256 * MiB, 0, default_stream);
  plugin.deallocate(big, 256 * MiB, 0, default_stream);
  plugin.release_cached(-1);
  const std::size_t general_peak = plugin.find(0)->stats().peak_reserved_bytes;
  REQUIRE(general_peak >= 256 * MiB);
  CHECK(stats_of(plugin, 0).at("peak_reserved_bytes") == general_peak);
  // ... then a capture's pool, while the general allocator holds little.
  void* small = plugin.allocate(MiB, 0, default_stream);
  REQUIRE(plugin.begin_allocate_to_pool(0, graph_pool, only(capture_stream)));
  void* in_pool = plugin.allocate(64 * MiB, 0, capture_stream);
  plugin.end_allocate_to_pool(0, graph_pool);
  const std::size_t pool_reserved = plugin.pool_stats(0, graph_pool)->reserved_bytes;
  const std::size_t general_now = plugin.find(0)->stats().reserved_bytes;
  REQUIRE(general_now + pool_reserved < general_peak);
  auto s = stats_of(plugin, 0);
  CHECK(s.at("reserved_bytes") == general_now + pool_reserved);
  CHECK(s.at("peak_reserved_bytes") == general_peak);  // the sum of peaks would count the pool twice
  CHECK(s.at("lifetime_peak_reserved_bytes") == general_peak);
  // The general allocator grows past its old peak while the pool holds its memory: that sum is the peak.
  void* more = plugin.allocate(512 * MiB, 0, default_stream);
  const std::size_t together = plugin.find(0)->stats().reserved_bytes + pool_reserved;
  CHECK(stats_of(plugin, 0).at("peak_reserved_bytes") == together);
  // reset_peak: from the sum now.
  plugin.deallocate(more, 512 * MiB, 0, default_stream);
  plugin.release_cached(-1);
  plugin.reset_peak(0);
  s = stats_of(plugin, 0);
  CHECK(s.at("peak_reserved_bytes") == s.at("reserved_bytes"));
  CHECK(s.at("lifetime_peak_reserved_bytes") == together);
  plugin.deallocate(in_pool, 64 * MiB, 0, capture_stream);
  plugin.release_pool(0, graph_pool);
  plugin.deallocate(small, MiB, 0, default_stream);
  CHECK(plugin.errors() == 0);
}

namespace {
// A mutex that counts the locks taken, of all its instances together.
std::atomic<std::uint64_t> locks_taken{0};
struct counting_lock {
  void lock() {
    locks_taken.fetch_add(1, std::memory_order_relaxed);
    mutex.lock();
  }
  void unlock() noexcept { mutex.unlock(); }
  std::mutex mutex;
};
static_assert(lock_policy<counting_lock>);
using counted_stitching =
    stitching_allocator<sim_provider, sim_reserver, best_fit_tail_stitching, lru_eviction, counting_lock>;
}  // namespace

TEST_CASE("pluggable_allocator: while pools hold memory, a general allocation that adds none locks the allocator once") {
  using plugin_type = pluggable_allocator<counted_stitching>;
  sim_device gpu(16 * GiB);
  plugin_type plugin([&](int) { return std::make_unique<counted_stitching>(sim_provider{gpu}, sim_reserver{gpu}); },
                     options_for<plugin_type>(nullptr));
  REQUIRE(plugin.begin_allocate_to_pool(0, graph_pool, only(capture_stream)));
  void* in_pool = plugin.allocate(64 * MiB, 0, capture_stream);
  plugin.end_allocate_to_pool(0, graph_pool);
  const std::size_t pool_reserved = plugin.pools(0)->reserved_bytes();
  REQUIRE(pool_reserved >= 64 * MiB);
  // A general allocation that adds memory: the sum is sampled.
  void* p = plugin.allocate(32 * MiB, 0, default_stream);
  const std::size_t general = plugin.find(0)->reserved_bytes();
  CHECK(stats_of(plugin, 0).at("peak_reserved_bytes") == general + pool_reserved);
  plugin.deallocate(p, 32 * MiB, 0, default_stream);
  // One from the cache: the allocator's own lock, and nothing more.
  const std::uint64_t segments = plugin.find(0)->stats().segments_created;
  const std::uint64_t before = locks_taken.load();
  p = plugin.allocate(32 * MiB, 0, default_stream);
  CHECK(locks_taken.load() - before == 1);
  CHECK(plugin.find(0)->stats().segments_created == segments);
  // Growing past it while the pool holds its memory: that sum is the peak.
  void* q = plugin.allocate(256 * MiB, 0, default_stream);
  const std::size_t together = plugin.find(0)->reserved_bytes() + pool_reserved;
  CHECK(together > general + pool_reserved);
  CHECK(stats_of(plugin, 0).at("peak_reserved_bytes") == together);
  // With the history recording too (the same observer), and after it stops.
  for (const bool history : {true, false}) {
    REQUIRE(plugin.record_history(history, 64));
    plugin.deallocate(q, 256 * MiB, 0, default_stream);
    plugin.release_cached(0);
    plugin.reset_peak(0);
    q = plugin.allocate(512 * MiB, 0, default_stream);
    const std::size_t peak = plugin.find(0)->reserved_bytes() + pool_reserved;
    plugin.deallocate(q, 512 * MiB, 0, default_stream);
    plugin.release_cached(0);
    const auto s = stats_of(plugin, 0);
    CHECK(s.at("reserved_bytes") < peak);
    CHECK(s.at("peak_reserved_bytes") == peak);
    if (history) CHECK(!plugin.history(0).empty());
    q = plugin.allocate(256 * MiB, 0, default_stream);
  }
  plugin.deallocate(q, 256 * MiB, 0, default_stream);
  plugin.deallocate(p, 32 * MiB, 0, default_stream);
  plugin.deallocate(in_pool, 64 * MiB, 0, capture_stream);
  plugin.release_pool(0, graph_pool);
  CHECK(plugin.errors() == 0);
}

TEST_CASE("pluggable_allocator: a pool is shared by captures into it, and released by each") {
  sim_devices sim;
  pool_plugin plugin(sim.factory(), options_for<pool_plugin>(nullptr));
  REQUIRE(plugin.begin_allocate_to_pool(0, graph_pool, only(capture_stream)));
  CHECK(!plugin.begin_allocate_to_pool(0, graph_pool, only(other_stream)));  // already capturing into it
  CHECK(plugin.errors() == 1);
  void* p = plugin.allocate(32 * MiB, 0, capture_stream);
  plugin.deallocate(p, 32 * MiB, 0, capture_stream);
  plugin.end_allocate_to_pool(0, graph_pool);
  // A second capture into the same pool reuses its free memory.
  REQUIRE(plugin.begin_allocate_to_pool(0, graph_pool, only(capture_stream)));
  void* q = plugin.allocate(32 * MiB, 0, capture_stream);
  CHECK(q == p);
  CHECK(plugin.pool_stats(0, graph_pool)->segments_created == 1);
  plugin.deallocate(q, 32 * MiB, 0, capture_stream);
  plugin.end_allocate_to_pool(0, graph_pool);
  plugin.release_pool(0, graph_pool);
  CHECK(plugin.pool_count(0) == 1);  // the first capture's use is still there
  plugin.release_pool(0, graph_pool);
  CHECK(plugin.pool_count(0) == 0);
  CHECK(sim.devices.at(0)->physical_bytes() == 0);
  plugin.release_pool(0, graph_pool);  // no such pool any more
  CHECK(plugin.errors() == 2);
}

// A stitching allocator that remembers whether it was last told to retain its memory.
struct retain_noting : sim_stitching {
  using sim_stitching::sim_stitching;
  void retain_memory(bool retain) {
    retaining = retain;
    sim_stitching::retain_memory(retain);
  }
  bool retaining = false;
};
static_assert(pluggable_allocatable<retain_noting> && memory_retaining_allocator<retain_noting>);

TEST_CASE("pluggable_allocator: a pool released with a live block retains its memory again once begun again") {
  // PyTorch's graph trees warm up in a pool (begin, end, release: no use left, outputs live),
  // then capture into it: the capture's frees must keep their memory.
  sim_devices sim;
  std::vector<retain_noting*> made;
  pluggable_allocator<retain_noting> plugin(
      [&](int id) {
        auto& device = sim.devices[id];
        if (device == nullptr) device = std::make_unique<sim_device>(16 * GiB);
        auto a = std::make_unique<retain_noting>(sim_provider{*device}, sim_reserver{*device}, sim.settings);
        made.push_back(a.get());
        return a;
      },
      options_for<pluggable_allocator<retain_noting>>(nullptr));
  void* general = plugin.allocate(MiB, 0, default_stream);
  REQUIRE(made.size() == 1);
  REQUIRE(plugin.begin_allocate_to_pool(0, graph_pool, only(capture_stream)));
  REQUIRE(made.size() == 2);
  CHECK(made[1]->retaining);
  void* output = plugin.allocate(8 * MiB, 0, capture_stream);
  plugin.end_allocate_to_pool(0, graph_pool);
  plugin.release_pool(0, graph_pool);
  CHECK(plugin.pool_count(0) == 1);  // the live output keeps it
  CHECK(!made[1]->retaining);
  REQUIRE(plugin.begin_allocate_to_pool(0, graph_pool, only(capture_stream)));
  CHECK(made.size() == 2);  // the same pool
  CHECK(made[1]->retaining);
  plugin.end_allocate_to_pool(0, graph_pool);
  plugin.release_pool(0, graph_pool);
  plugin.deallocate(output, 8 * MiB, 0, capture_stream);
  CHECK(plugin.pool_count(0) == 0);
  plugin.deallocate(general, MiB, 0, default_stream);
  CHECK(plugin.errors() == 0);
}

TEST_CASE("pluggable_allocator: a pool out of memory has the general cache released and tries again") {
  sim_devices sim;  // 16 GiB per device, shared by the general allocator and the pool
  pool_plugin plugin(sim.factory(), options_for<pool_plugin>(nullptr));
  void* big = plugin.allocate(8 * GiB, 0, other_stream);
  plugin.deallocate(big, 8 * GiB, 0, other_stream);
  REQUIRE(plugin.find(0)->stats().reserved_bytes == 8 * GiB);
  REQUIRE(plugin.begin_allocate_to_pool(0, graph_pool, only(capture_stream)));
  void* p = plugin.allocate(12 * GiB, 0, capture_stream);
  CHECK(p != nullptr);
  CHECK(plugin.find(0)->stats().reserved_bytes == 0);  // released on the way
  CHECK(plugin.pool_stats(0, graph_pool)->failed_allocations == 1);  // the first try
  CHECK(plugin.allocate(12 * GiB, 0, capture_stream) == nullptr);  // nothing left to release
  plugin.deallocate(p, 12 * GiB, 0, capture_stream);
  plugin.end_allocate_to_pool(0, graph_pool);
  plugin.release_pool(0, graph_pool);
  CHECK(plugin.pool_count(0) == 0);
  CHECK(sim.devices.at(0)->physical_bytes() == 0);
}

TEST_CASE("threads: pool and general requests from several threads during a capture stay apart") {
  sim_devices sim;
  pool_plugin plugin(sim.factory(), options_for<pool_plugin>(nullptr));
  REQUIRE(plugin.begin_allocate_to_pool(0, graph_pool, only(capture_stream)));
  constexpr int threads = 4, rounds = 300;
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      const stream_ref stream = t % 2 == 0 ? capture_stream : other_stream;
      std::vector<std::pair<void*, std::size_t>> live;
      for (int i = 0; i < rounds; ++i) {
        const std::size_t bytes = (i % 3 == 0 ? 3 * MiB : 1000) + static_cast<std::size_t>(t * 512 + i);
        if (void* p = plugin.allocate(bytes, 0, stream)) live.emplace_back(p, bytes);
        if (live.size() > 5) {
          plugin.deallocate(live.front().first, live.front().second, 0, stream);
          live.erase(live.begin());
        }
      }
      for (auto [p, n] : live) plugin.deallocate(p, n, 0, stream);
    });
  }
  for (auto& w : workers) w.join();
  CHECK(plugin.errors() == 0);
  const statistics pool = *plugin.pool_stats(0, graph_pool);
  const statistics general = plugin.find(0)->stats();
  CHECK(pool.allocations == 2 * rounds);  // the threads on the capture stream, exactly
  CHECK(general.allocations == 2 * rounds);
  CHECK(pool.active_bytes == 0);
  CHECK(general.active_bytes == 0);
  plugin.find(0)->verify();
  plugin.end_allocate_to_pool(0, graph_pool);
  plugin.release_pool(0, graph_pool);
  CHECK(plugin.pool_count(0) == 0);
}

TEST_CASE("pluggable_allocator: visit_state shows the general allocator, then each pool by its id") {
  sim_devices sim;
  pool_plugin plugin(sim.factory(), options_for<pool_plugin>(nullptr));
  void* g = plugin.allocate(5 * MiB, 0, other_stream);
  REQUIRE(plugin.begin_allocate_to_pool(0, graph_pool, only(capture_stream)));
  void* p = plugin.allocate(7 * MiB, 0, capture_stream);
  struct pools_seen {
    std::vector<std::pair<pool_plugin::pool_id, std::uintptr_t>> allocated;  // (pool, block)
    pool_plugin::pool_id current{};
    std::size_t segments = 0;
    void allocator(pool_plugin::pool_id id) { current = id; }
    void segment(const segment_view&) { ++segments; }
    void block(const block_view& b) {
      if (b.state == block_state::allocated) allocated.emplace_back(current, b.address);
    }
    void stitched(const stitched_view&) {}
    void piece(const stitched_piece_view&) {}
  } seen;
  CHECK(!plugin.visit_state(9, seen));
  REQUIRE(plugin.visit_state(0, seen));
  CHECK(seen.segments == 2);
  const std::vector<std::pair<pool_plugin::pool_id, std::uintptr_t>> expected{
      {{0, 0}, reinterpret_cast<std::uintptr_t>(g)}, {graph_pool, reinterpret_cast<std::uintptr_t>(p)}};
  CHECK(seen.allocated == expected);
  plugin.deallocate(p, 7 * MiB, 0, capture_stream);
  plugin.deallocate(g, 5 * MiB, 0, other_stream);
  plugin.end_allocate_to_pool(0, graph_pool);
  plugin.release_pool(0, graph_pool);
}

TEST_CASE("pluggable_allocator: offload and prefetch reach the allocator that holds a block, never a pool's") {
  sim_devices sim;
  auto make = sim.factory();
  pool_plugin plugin(
      [&](int id) {
        auto a = make(id);
        sim_device& d = *sim.devices.at(id);
        a->attach_far_memory(sim_host_provider{d}, sim_copier{d});
        return a;
      },
      options_for<pool_plugin>(nullptr));
  // (Simulated devices share one address space each from the same base: one device here.)
  void* kept = plugin.allocate(64 * MiB, 0, other_stream);
  void* moved = plugin.allocate(32 * MiB, 0, other_stream);
  plugin.offload(moved, other_stream);
  CHECK(plugin.residence_of(moved) == residence::host);
  CHECK(plugin.residence_of(kept) == residence::device);
  CHECK(sim.devices.at(0)->host_bytes() == 32 * MiB);
  CHECK(plugin.find(0)->stats().offloaded_bytes == 32 * MiB);
  CHECK(stats_of(plugin, 0).at("offloaded_bytes") == 32 * MiB);
  CHECK_FALSE(plugin.residence_of(&sim).has_value());
  CHECK_THROWS_AS(plugin.offload(&sim, other_stream), usage_error);
  CHECK_THROWS_AS(plugin.prefetch(kept, other_stream), usage_error);  // not offloaded
  // A graph's pool keeps its mappings: its blocks do not move.
  REQUIRE(plugin.begin_allocate_to_pool(0, graph_pool, only(capture_stream)));
  void* in_pool = plugin.allocate(64 * MiB, 0, capture_stream);
  plugin.end_allocate_to_pool(0, graph_pool);
  try {
    plugin.offload(in_pool, other_stream);
    FAIL("a pool's block must not move");
  } catch (const usage_error& e) {
    CHECK(std::string(e.what()).find("private pool") != std::string::npos);
  }
  plugin.prefetch(moved, other_stream);
  CHECK(plugin.residence_of(moved) == residence::device);
  CHECK(sim.devices.at(0)->host_bytes() == 32 * MiB);  // kept for the next offload
  plugin.deallocate(in_pool, 64 * MiB, 0, capture_stream);
  plugin.release_pool(0, graph_pool);
  plugin.deallocate(kept, 64 * MiB, 0, other_stream);
  plugin.deallocate(moved, 32 * MiB, 0, other_stream);
  plugin.release_cached(0);  // the far memory kept goes with the cache
  CHECK(sim.devices.at(0)->host_bytes() == 0);
  CHECK(plugin.errors() == 0);
}
