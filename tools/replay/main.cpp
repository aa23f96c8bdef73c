// glake-replay: replays allocation traces through named allocator configurations on the
// simulated backend and reports memory, failures, driver calls and modeled driver time.
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "glake/config.hpp"
#include "glake/config_io.hpp"
#include "glake/errors.hpp"
#include "configurations.hpp"
#include "replay.hpp"
#include "svg_plot.hpp"
#include "trace.hpp"

namespace {

using namespace glake;
using namespace glake::replay;

constexpr const char* usage =
    "usage: glake-replay [options] TRACE...\n"
    "Replays allocation traces (a,<id>,<bytes>,<stream> / f,<id> / S,<bytes> / U,<bytes>; gzip or plain)\n"
    "through named allocator configurations on a simulated GPU, in trace order, honouring streams.\n"
    "\n"
    "options:\n"
    "  -a, --allocators LIST   comma-separated configurations (default: all); see --list\n"
    "      --list              list the configurations and exit\n"
    "      --capacity SIZE     device memory, e.g. 80GiB (default 1TiB: never binds); with it, a\n"
    "                          request the device cannot hold is reported as failed\n"
    "      --json              one JSON object per trace and configuration, one per line\n"
    "      --plot DIR          write DIR/<trace>.svg: reserved bytes per configuration over time\n"
    "      --training-seconds S  also print modeled driver time as a share of S seconds\n"
    "      --glake-conf TEXT   settings over glake's, as GLAKE_ALLOC_CONF (e.g. max_handle:64MiB)\n"
    "      --max-trace-bytes SIZE  refuse a trace whose text (inflated) is longer (default 1GiB)\n"
    "      --max-events N      refuse a trace of more events (default 33554432)\n"
    "      --quiet             no progress on stderr\n"
    "  -h, --help              this text\n";

struct options {
  std::vector<std::string> traces;
  std::vector<std::string> allocators;
  std::size_t capacity = std::size_t{1} << 40;
  bool json = false;
  bool quiet = false;
  std::string plot_dir;
  double training_seconds = 0;
  std::string glake_conf;
  glake::replay::trace_limits limits;
};

/// Text from the command line or a trace, escaped for the terminal.
std::string shown(std::string_view text, std::size_t limit = std::string_view::npos) {
  return glake::replay::detail::printable(text, limit);
}

[[noreturn]] void fail_usage(const std::string& message) {
  std::fprintf(stderr, "glake-replay: %s\n%s", shown(message, 300).c_str(), usage);
  std::exit(2);
}

std::size_t parse_size(const std::string& text, const char* option = "--capacity") {
  // The config parser already knows sizes with suffixes; reuse it through a one-key string.
  config c;
  try {
    c.apply(("memory_limit:" + text).c_str());
  } catch (const std::exception&) {
    fail_usage(std::string(option) + ": '" + text + "' is not a size (e.g. 80GiB)");
  }
  return c.memory_limit;
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) fail_usage(a + " needs a value");
      return argv[++i];
    };
    if (a == "-h" || a == "--help") {
      std::fputs(usage, stdout);
      std::exit(0);
    } else if (a == "--list") {
      for (const auto& c : named_configurations()) std::printf("%-20s %s\n", c.name.c_str(), c.description.c_str());
      std::exit(0);
    } else if (a == "-a" || a == "--allocators") {
      std::string list = value();
      for (std::size_t start = 0; start <= list.size();) {
        const std::size_t comma = list.find(',', start);
        const std::string name = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        if (!name.empty()) o.allocators.push_back(name);
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
    } else if (a == "--capacity") {
      o.capacity = parse_size(value());
    } else if (a == "--max-trace-bytes") {
      o.limits.max_text_bytes = parse_size(value(), "--max-trace-bytes");
    } else if (a == "--max-events") {
      const std::string v = value();
      char* end = nullptr;
      errno = 0;
      const unsigned long long n = std::strtoull(v.c_str(), &end, 10);
      if (errno != 0 || end == v.c_str() || *end != '\0' || n == 0 || v[0] == '-') {
        fail_usage("--max-events: '" + v + "' is not a positive number");
      }
      o.limits.max_events = static_cast<std::size_t>(n);
    } else if (a == "--json") {
      o.json = true;
    } else if (a == "--plot") {
      o.plot_dir = value();
    } else if (a == "--training-seconds") {
      const std::string v = value();
      char* end = nullptr;
      o.training_seconds = std::strtod(v.c_str(), &end);
      if (end == v.c_str() || *end != '\0' || o.training_seconds <= 0) fail_usage("--training-seconds: bad value '" + v + "'");
    } else if (a == "--glake-conf") {
      o.glake_conf = value();
      try {
        config{}.apply(o.glake_conf.c_str());
      } catch (const std::exception& e) {
        fail_usage(std::string("--glake-conf: ") + e.what());
      }
    } else if (a == "--quiet") {
      o.quiet = true;
    } else if (!a.empty() && a[0] == '-') {
      fail_usage("unknown option " + a);
    } else {
      o.traces.push_back(a);
    }
  }
  if (o.traces.empty()) fail_usage("no trace given");
  return o;
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\';
    if (static_cast<unsigned char>(ch) < 0x20) {
      char buffer[8];
      std::snprintf(buffer, sizeof buffer, "\\u%04x", ch);
      out += buffer;
    } else {
      out += ch;
    }
  }
  return out;
}

void print_json(const replay_result& r, std::size_t capacity) {
  std::printf("{\"trace\":\"%s\",\"allocator\":\"%s\",\"events\":%zu,\"peak_active_bytes\":%zu,"
              "\"peak_reserved_bytes\":%zu,\"utilization\":%.6f,\"failed_allocations\":%zu,"
              "\"capacity_bytes\":%zu,\"out_of_memory\":%s,\"driver_calls\":{",
              json_escape(r.trace).c_str(), json_escape(r.allocator).c_str(), r.events, r.peak_active_bytes,
              r.peak_reserved_bytes, r.utilization, r.failed_allocations, capacity,
              r.failed_allocations > 0 ? "true" : "false");
  for (std::size_t k = 0; k < driver_call_kinds; ++k) {
    std::printf("%s\"%s\":%" PRIu64, k == 0 ? "" : ",", std::string(to_string(static_cast<driver_call>(k))).c_str(),
                r.driver_calls.counts[k]);
  }
  std::printf("},\"segments_created\":%" PRIu64 ",\"segments_released\":%" PRIu64 ",\"stitches\":%" PRIu64
              ",\"stitch_cache_hits\":%" PRIu64 ",\"stitch_repairs\":%" PRIu64 ",\"stitch_grows\":%" PRIu64 ",\"cross_stream_bytes\":%" PRIu64
              ",\"modeled_driver_us\":%.1f,\"host_ns_per_operation\":%.1f,\"recorded_peak_reserved_bytes\":%zu",
              r.segments_created, r.segments_released, r.stitches, r.stitch_cache_hits, r.stitch_repairs,
              r.stitch_grows, r.cross_stream_bytes,
              r.modeled_driver_us,
              r.host_ns_per_operation, r.recorded_peak_reserved);
  std::printf(",\"splits\":%" PRIu64 ",\"merges\":%" PRIu64 ",\"stitch_evictions\":%" PRIu64
              ",\"peak_allocated_bytes\":%zu,\"placement_digest\":\"%016" PRIx64 "\"",
              r.splits, r.merges, r.stitch_evictions, r.peak_allocated_bytes, r.placement_digest);
  if (r.free_at_peak) {
    std::printf(",\"free_at_peak\":{\"whole_handle_bytes\":%zu,\"partial_handle_bytes\":%zu,\"small_pool_bytes\":%zu,"
                "\"partial_at_segment_end_bytes\":%zu,\"block_rounding_bytes\":%zu,\"stitched_tail_bytes\":%zu}",
                r.free_at_peak->whole_handles, r.free_at_peak->partial_handles, r.free_at_peak->small_pool,
                r.free_at_peak->partial_at_segment_end, r.free_at_peak->block_rounding, r.free_at_peak->stitched_tails);
  }
  std::printf("}\n");
}

void print_header(double training_seconds) {
  std::printf("%-14s %-20s %9s %11s %7s %7s %10s %10s %8s%s\n", "trace", "allocator", "active GB", "reserved GB",
              "util", "failed", "drv calls", "drv ms", "ns/op", training_seconds > 0 ? "  drv/train" : "");
}

void print_row(const replay_result& r, double training_seconds) {
  std::printf("%-14s %-20s %9.3f %11.3f %7.4f %7zu %10" PRIu64 " %10.2f %8.1f", r.trace.c_str(), r.allocator.c_str(),
              static_cast<double>(r.peak_active_bytes) / 1e9, static_cast<double>(r.peak_reserved_bytes) / 1e9,
              r.utilization, r.failed_allocations, r.driver_calls.total(), r.modeled_driver_us / 1000.0,
              r.host_ns_per_operation);
  if (training_seconds > 0) std::printf("  %8.3f%%", 100.0 * r.modeled_driver_us / 1e6 / training_seconds);
  std::printf("\n");
}

/// Reads one trace and replays it through every chosen configuration, printing as it goes.
void replay_file(const std::string& path, const options& o, const std::vector<configuration>& chosen,
                 bool show_progress) {
  const trace t = read_trace(path, {}, o.limits);
  std::vector<plot_series> plots;
  for (const configuration& c : chosen) {
    const auto progress = [&](double fraction) {
      std::fprintf(stderr, "\r%s / %s: %3.0f%%", t.name.c_str(), c.name.c_str(), 100.0 * fraction);
    };
    replay_result r = replay_trace(t, c, o.capacity, !o.plot_dir.empty(),
                                   show_progress ? std::function<void(double)>(progress) : nullptr);
    if (show_progress) std::fprintf(stderr, "\r%*s\r", 60, "");
    if (o.json) {
      print_json(r, o.capacity);
    } else {
      print_row(r, o.training_seconds);
    }
    std::fflush(stdout);
    if (!o.plot_dir.empty()) plots.push_back({r.allocator, std::move(r.reserved_series), std::move(r.active_series)});
  }
  if (!o.json && t.recorded_peak_reserved > 0) {
    std::printf("%-14s %-20s %9s %11.3f   (the recorded run's own peak reserved, from the trace's S/U lines)\n",
                t.name.c_str(), "recorded", "", static_cast<double>(t.recorded_peak_reserved) / 1e9);
  }
  if (!o.plot_dir.empty()) {
    const std::string file = o.plot_dir + "/" + t.name + ".svg";
    write_svg(file, t.name + ": reserved bytes over the trace", plots);
    if (!o.quiet) std::fprintf(stderr, "wrote %s\n", shown(file).c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  std::vector<configuration> chosen;
  const std::vector<configuration> all = named_configurations(o.glake_conf);
  if (o.allocators.empty()) {
    chosen = all;
  } else {
    for (const std::string& name : o.allocators) {
      bool found = false;
      for (const auto& c : all) {
        if (c.name == name) {
          chosen.push_back(c);
          found = true;
        }
      }
      if (!found) fail_usage("unknown configuration '" + name + "' (see --list)");
    }
  }
  const bool show_progress = !o.quiet && isatty(STDERR_FILENO);
  if (!o.json) print_header(o.training_seconds);
  for (const std::string& path : o.traces) {
    try {
      replay_file(path, o, chosen, show_progress);
    } catch (const trace_error& e) {  // names the file and line already
      std::fprintf(stderr, "glake-replay: %s\n", shown(e.what()).c_str());
      return 1;
    } catch (const replay_error& e) {  // and the configuration and event
      std::fprintf(stderr, "glake-replay: %s\n", shown(e.what()).c_str());
      return 1;
    } catch (const std::exception& e) {  // e.g. the plot cannot be written
      std::fprintf(stderr, "glake-replay: %s: %s\n", shown(path).c_str(), shown(e.what()).c_str());
      return 1;
    }
  }
  return 0;
}
