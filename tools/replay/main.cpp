// glake-replay: replays allocation traces through named allocator configurations on the
// simulated backend and reports memory, failures, driver calls and modeled driver time.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "glake/config.hpp"
#include "glake/config_io.hpp"
#include "glake/errors.hpp"
#include "../args.hpp"
#include "../json.hpp"
#include "configurations.hpp"
#include "progress.hpp"
#include "replay.hpp"
#include "snapshot.hpp"
#include "svg_plot.hpp"
#include "trace.hpp"

namespace {

using namespace glake;
using namespace glake::replay;

struct options {
  std::vector<std::string> traces;
  std::vector<std::string> allocators;
  std::size_t capacity = std::size_t{1} << 40;
  bool json = false;
  bool quiet = false;
  std::string plot_dir;
  std::string snapshot_dir;
  std::size_t snapshot_entries = 100'000;
  double training_seconds = 0;
  std::string glake_conf;
  glake::replay::trace_limits limits;
};

/// Text from the command line or a trace, escaped for the terminal.
std::string shown(std::string_view text, std::size_t limit = std::string_view::npos) {
  return glake::replay::detail::printable(text, limit);
}

/// A size with a suffix (80GiB, 512M), as config strings read them.
std::size_t parse_size(const std::string& text) {
  // The config parser already knows sizes with suffixes; reuse it through a one-key string.
  config c;
  try {
    c.apply(("memory_limit:" + text).c_str());
  } catch (const std::exception&) {
    throw glake::tools::usage_error("'" + text + "' is not a size (e.g. 80GiB)");
  }
  return c.memory_limit;
}

std::size_t parse_count(const std::string& text) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long n = std::strtoull(text.c_str(), &end, 10);
  if (errno != 0 || end == text.c_str() || *end != '\0' || n == 0 || text[0] == '-') {
    throw glake::tools::usage_error("'" + text + "' is not a positive number");
  }
  return static_cast<std::size_t>(n);
}

glake::tools::arg_parser make_parser(options& o) {
  glake::tools::arg_parser args(
      "glake-replay", GLAKE_TOOLS_VERSION, "glake-replay [options] TRACE...",
      "Replays allocation traces (a,<id>,<bytes>,<stream> / f,<id> / S,<bytes> / U,<bytes>; gzip or plain)\n"
      "through named allocator configurations on a simulated GPU, in trace order, honouring streams.");
  using glake::tools::usage_error;
  args.positional("TRACE", "a trace file, gzip or plain (traces/README.md)",
                  [&o](const std::string& v) { o.traces.push_back(v); },
                  glake::tools::arg_parser::occurs::one_or_more)
      .option("-a, --allocators", "LIST", "comma-separated configurations (default: all); see --list",
              [&o](const std::string& list) {
                for (std::size_t start = 0; start <= list.size();) {
                  const std::size_t comma = list.find(',', start);
                  const std::string name =
                      list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
                  if (!name.empty()) o.allocators.push_back(name);
                  if (comma == std::string::npos) break;
                  start = comma + 1;
                }
              })
      .flag("--list", "list the configurations and exit",
            [] {
              for (const auto& c : named_configurations()) {
                std::printf("%-20s %s\n", c.name.c_str(), c.description.c_str());
              }
              std::exit(0);
            })
      .option("--capacity", "SIZE",
              "device memory, e.g. 80GiB (default 1TiB: never binds); with it, a\n"
              "request the device cannot hold is reported as failed",
              [&o](const std::string& v) { o.capacity = parse_size(v); })
      .flag("--json", "one JSON object per trace and configuration, one per line", o.json)
      .option("--snapshot", "DIR",
              "write DIR/<trace>.<configuration>.json: the memory snapshot at the end\n"
              "and the history before it, as torch.cuda.memory._snapshot() gives them\n"
              "(tools/README.md: to a pickle for pytorch.org/memory_viz)",
              o.snapshot_dir)
      .option("--snapshot-entries", "N", "history entries kept per snapshot, the newest (default 100000)",
              [&o](const std::string& v) { o.snapshot_entries = parse_count(v); })
      .option("--plot", "DIR", "write DIR/<trace>.svg: reserved bytes per configuration over time", o.plot_dir)
      .option("--training-seconds", "S", "also print modeled driver time as a share of S seconds",
              [&o](const std::string& v) {
                char* end = nullptr;
                o.training_seconds = std::strtod(v.c_str(), &end);
                if (end == v.c_str() || *end != '\0' || !(o.training_seconds > 0)) {
                  throw usage_error("bad value '" + v + "'");
                }
              })
      .option("--glake-conf", "TEXT", "settings over glake's, as GLAKE_ALLOC_CONF (e.g. max_handle:64MiB)",
              [&o](const std::string& v) {
                try {
                  config{}.apply(v.c_str());
                } catch (const std::exception& e) {
                  throw usage_error(e.what());
                }
                o.glake_conf = v;
              })
      .option("--max-trace-bytes", "SIZE", "refuse a trace whose text (inflated) is longer (default 1GiB)",
              [&o](const std::string& v) { o.limits.max_text_bytes = parse_size(v); })
      .option("--max-events", "N", "refuse a trace of more events (default 33554432)",
              [&o](const std::string& v) { o.limits.max_events = parse_count(v); })
      .flag("--quiet", "no progress on stderr", o.quiet);
  return args;
}

using glake::tools::json_escape;

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

/// Reads a trace, saying how far it got on stderr unless quiet: on a terminal one line rewritten
/// at most 4 times a second, elsewhere a line a second; nothing for a trace read within that time.
trace read_with_progress(const std::string& path, const options& o) {
  if (o.quiet) return read_trace(path, {}, o.limits);
  const bool terminal = isatty(STDERR_FILENO) != 0;
  using namespace std::chrono_literals;
  progress_throttle throttle(terminal ? 250ms : 1s);
  bool said = false;
  const std::string name = shown(path, 200);
  trace t = read_trace(path, {}, o.limits, [&](std::uint64_t read, std::uint64_t file_bytes) {
    if (!throttle.due()) return;
    said = true;
    std::string line = "glake-replay: reading " + name + ": ";
    if (file_bytes > 0) {
      char percent[16];
      std::snprintf(percent, sizeof percent, "%3.0f%% ",
                    100.0 * static_cast<double>(std::min(read, file_bytes)) / static_cast<double>(file_bytes));
      line += percent;
      line += "(" + format_bytes(read) + " of " + format_bytes(file_bytes) + ")";
    } else {
      line += format_bytes(read);
    }
    std::fprintf(stderr, terminal ? "\r%s\x1b[K" : "%s\n", line.c_str());
  });
  if (said && terminal) std::fprintf(stderr, "\r\x1b[K");
  return t;
}

/// Reads one trace and replays it through every chosen configuration, printing as it goes.
void replay_file(const std::string& path, const options& o, const std::vector<configuration>& chosen,
                 bool show_progress) {
  const trace t = read_with_progress(path, o);
  std::vector<plot_series> plots;
  for (const configuration& c : chosen) {
    using namespace std::chrono_literals;
    progress_throttle throttle(250ms);
    const auto progress = [&](double fraction) {
      if (throttle.due()) std::fprintf(stderr, "\r%s / %s: %3.0f%%", t.name.c_str(), c.name.c_str(), 100.0 * fraction);
    };
    std::optional<replay_snapshot> snapshot;
    if (!o.snapshot_dir.empty()) snapshot.emplace(o.snapshot_entries);
    replay_result r = replay_trace(t, c, o.capacity, !o.plot_dir.empty(),
                                   show_progress ? std::function<void(double)>(progress) : nullptr,
                                   snapshot ? &*snapshot : nullptr);
    if (show_progress) std::fprintf(stderr, "\r%*s\r", 60, "");
    if (o.json) {
      print_json(r, o.capacity);
    } else {
      print_row(r, o.training_seconds);
    }
    std::fflush(stdout);
    if (!o.plot_dir.empty()) plots.push_back({r.allocator, std::move(r.reserved_series), std::move(r.active_series)});
    if (snapshot) {
      const std::string file = o.snapshot_dir + "/" + t.name + "." + c.name + ".json";
      write_text_file(file, snapshot->json);
      if (!o.quiet) {
        std::fprintf(stderr, "wrote %s%s\n", shown(file).c_str(),
                     snapshot->has_segments ? "" : " (allocations only: this configuration shows no segments)");
      }
    }
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
  options o;
  glake::tools::arg_parser args = make_parser(o);
  args.parse_or_exit(argc, argv);
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
      if (!found) args.fail("unknown configuration '" + name.substr(0, 300) + "' (see --list)");
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
