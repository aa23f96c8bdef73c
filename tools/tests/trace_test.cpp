// Reading traces, and replaying the bundled ones: fidelity to PyTorch's measured peaks, and the
// memory glake saves (deterministic numbers, so they are checked here; timings are not).
#include <doctest/doctest.h>

#include <zlib.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "configurations.hpp"
#include "replay.hpp"
#include "trace.hpp"

using namespace glake::replay;

namespace {

std::string bundled(const std::string& name) { return std::string(GLAKE_TRACES_DIR) + "/" + name + ".trace.gz"; }

std::string temp_file(const std::string& name, const std::string& text) {
  const std::string path = "/tmp/glake_trace_test_" + name;
  std::ofstream(path) << text;
  return path;
}

std::string error_of(const std::string& path) {
  try {
    (void)read_trace(path);
  } catch (const trace_error& e) {
    return e.what();
  }
  return "";
}

const configuration& named(const std::string& name) {
  static const std::vector<configuration> all = named_configurations();
  for (const auto& c : all) {
    if (c.name == name) return c;
  }
  throw std::runtime_error("no configuration " + name);
}

// The bundled traces' runs as traces/README.md lists them (H100, PyTorch 2.11): allocations and
// peak active from the traces, peak reserved as measured under each PyTorch allocator.
struct measured {
  const char* trace;
  std::size_t allocations;
  double peak_active_gb, default_reserved_gb, expandable_reserved_gb;
};
constexpr measured runs[] = {
    {"opt1.3b-N", 32660, 23.106, 32.168, 24.19},
    {"opt1.3b-R", 39381, 13.642, 29.037, 15.68},
    {"opt1.3b-LR", 41853, 8.417, 18.832, 10.01},
    {"llama1b-LR", 43510, 5.421, 12.157, 6.42},
};

}  // namespace

TEST_CASE("trace: the bundled traces read back with the counts and peaks their README gives") {
  for (const measured& m : runs) {
    CAPTURE(m.trace);
    const trace t = read_trace(bundled(m.trace));
    CHECK(t.name == m.trace);
    CHECK(t.allocations == m.allocations);
    CHECK(static_cast<double>(t.peak_active_bytes) / 1e9 == doctest::Approx(m.peak_active_gb).epsilon(0.001));
    CHECK(static_cast<double>(t.recorded_peak_reserved) / 1e9 == doctest::Approx(m.default_reserved_gb).epsilon(0.001));
    CHECK(t.streams == 1);
  }
}

TEST_CASE("trace: plain files, comments and frees carrying their sizes") {
  const trace t = read_trace(temp_file("plain", "# comment\nS,2097152\na,7,1024,0\na,8,512,1\nf,7\nU,2097152\n"));
  REQUIRE(t.events.size() == 5);
  CHECK(t.events[3].what == trace_event::kind::free);
  CHECK(t.events[3].bytes == 1024);
  CHECK(t.peak_active_bytes == 1536);
  CHECK(t.recorded_peak_reserved == 2097152);
  CHECK(t.streams == 2);
}

TEST_CASE("trace: bad input is refused with the file and line, never half-read") {
  CHECK(error_of("/nonexistent/x.trace").find("cannot open") != std::string::npos);
  CHECK(error_of(temp_file("unknown", "a,1,512,0\nx,2\n")).find("glake_trace_test_unknown:2: unknown record 'x'") !=
        std::string::npos);
  CHECK(error_of(temp_file("fields", "a,1,512\n")).find(":1: 'a' takes 3 fields, found 2") != std::string::npos);
  CHECK(error_of(temp_file("number", "a,1,12x,0\n")).find(":1: size '12x' is not a non-negative integer") !=
        std::string::npos);
  CHECK(error_of(temp_file("free", "a,1,512,0\nf,2\n")).find(":2: free of allocation id 2, which is not live") !=
        std::string::npos);
  CHECK(error_of(temp_file("twice", "a,1,512,0\na,1,512,0\n")).find(":2: allocation id 1 is already live") !=
        std::string::npos);
  CHECK(error_of(temp_file("unreserve", "S,10\nU,20\n")).find(":2: releases more segment bytes") != std::string::npos);

  // A gzip file cut short: an error, not a shorter trace.
  const std::string whole = "/tmp/glake_trace_test_whole.gz";
  gzFile out = gzopen(whole.c_str(), "wb");
  for (int i = 0; i < 20000; ++i) gzprintf(out, "a,%d,%d,0\n", i, 512 * (1 + i % 97));
  gzclose(out);
  std::ifstream in(whole, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  const std::string cut = temp_file("cut.gz", bytes.substr(0, bytes.size() / 2));
  CHECK(error_of(cut).find("truncated or corrupt") != std::string::npos);
}

TEST_CASE("replay: pytorch-default reproduces PyTorch's own peak reserved within 5% on every trace") {
  for (const measured& m : runs) {
    CAPTURE(m.trace);
    const replay_result r = replay_trace(read_trace(bundled(m.trace)), named("pytorch-default"), std::size_t{1} << 40, false);
    CHECK(r.failed_allocations == 0);
    const double replayed = static_cast<double>(r.peak_reserved_bytes) / 1e9;
    CHECK(replayed == doctest::Approx(m.default_reserved_gb).epsilon(0.05));
  }
}

TEST_CASE("replay: pytorch-expandable reproduces the measured expandable_segments peak within 5%") {
  for (const measured& m : runs) {
    CAPTURE(m.trace);
    const replay_result r =
        replay_trace(read_trace(bundled(m.trace)), named("pytorch-expandable"), std::size_t{1} << 40, false);
    const double replayed = static_cast<double>(r.peak_reserved_bytes) / 1e9;
    CHECK(replayed == doctest::Approx(m.expandable_reserved_gb).epsilon(0.05));
  }
}

TEST_CASE("replay: glake holds at least 98% of its reserved memory live, and less than expandable segments") {
  for (const measured& m : runs) {
    CAPTURE(m.trace);
    const trace t = read_trace(bundled(m.trace));
    const replay_result glake = replay_trace(t, named("glake"), std::size_t{1} << 40, false);
    const replay_result expandable = replay_trace(t, named("pytorch-expandable"), std::size_t{1} << 40, false);
    CHECK(glake.failed_allocations == 0);
    CHECK(glake.utilization >= 0.98);
    CHECK(glake.peak_reserved_bytes < expandable.peak_reserved_bytes);
    CHECK(glake.peak_active_bytes == t.peak_active_bytes);
  }
}

TEST_CASE("replay: a capacity that cannot hold the trace shows as failed allocations, and the series are recorded") {
  const trace t = read_trace(bundled("opt1.3b-LR"));
  for (const char* name : {"pytorch-default", "pytorch-expandable", "gmlake", "glake"}) {
    CAPTURE(name);
    const replay_result tight = replay_trace(t, named(name), std::size_t{6} << 30, true);
    CHECK(tight.failed_allocations > 0);
    CHECK(tight.peak_reserved_bytes <= std::size_t{6} << 30);
    CHECK(tight.reserved_series.size() == tight.events);
    CHECK(tight.active_series.size() == tight.events);
  }
}

TEST_CASE("replay: where free memory sits at peak is reported for stitching pools") {
  const trace t = read_trace(bundled("opt1.3b-LR"));
  const auto glake_with = [&](const char* overrides) {
    for (const auto& c : named_configurations(overrides)) {
      if (c.name == "glake") return replay_trace(t, c, std::size_t{1} << 40, false);
    }
    FAIL("no glake configuration");
    return replay_result{};
  };
  // 2 MiB handles and blocks of whole chunks: every free chunk is a whole handle.
  const replay_result small = glake_with("max_handle:0,large_round_to:0");
  REQUIRE(small.free_at_peak.has_value());
  CHECK(small.free_at_peak->partial_handles == 0);
  // Larger handles strand memory in place, the more the larger they are: glake's 8 MiB default
  // a little, 1 GiB handles more.
  const replay_result standard = replay_trace(t, named("glake"), std::size_t{1} << 40, false);
  REQUIRE(standard.free_at_peak.has_value());
  const replay_result large = glake_with("max_handle:1GiB");
  REQUIRE(large.free_at_peak.has_value());
  CHECK(standard.free_at_peak->partial_handles > 0);
  CHECK(large.free_at_peak->partial_handles > standard.free_at_peak->partial_handles);
  CHECK_FALSE(replay_trace(t, named("pytorch-default"), std::size_t{1} << 40, false).free_at_peak.has_value());
}

TEST_CASE("replay: on FSDP's three streams glake moves free memory between streams and stays above 98%") {
  // Rank 0 of the two-GPU FSDP runs (bench/results/finetune.md): recorded by the plug-in.
  for (const char* name : {"opt1.3b-N-fsdp2-rank0", "opt1.3b-LR-fsdp2-rank0"}) {
    CAPTURE(name);
    const trace t = read_trace(bundled(name));
    const replay_result glake = replay_trace(t, named("glake"), std::size_t{1} << 40, false);
    const replay_result expandable = replay_trace(t, named("pytorch-expandable"), std::size_t{1} << 40, false);
    CHECK(glake.failed_allocations == 0);
    CHECK(glake.cross_stream_bytes > 0);
    CHECK(glake.utilization >= 0.98);
    CHECK(glake.peak_reserved_bytes < expandable.peak_reserved_bytes);
    CHECK(glake.peak_reserved_bytes <= t.recorded_peak_reserved);  // the GPU run, before cross-stream reuse
  }
}
