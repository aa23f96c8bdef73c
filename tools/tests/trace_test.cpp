// Reading traces, and replaying the bundled ones: fidelity to PyTorch's measured peaks, and the
// memory glake saves (deterministic numbers, so they are checked here; timings are not).
#include <doctest/doctest.h>

#include <unistd.h>
#include <zlib.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <new>
#include <optional>
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

TEST_CASE("trace: an empty file, a 0-byte .gz and a file of comments are refused: no events") {
  CHECK(error_of(temp_file("empty", "")).find("glake_trace_test_empty: no events") != std::string::npos);
  CHECK(error_of(temp_file("empty.gz", "")).find("glake_trace_test_empty.gz: no events") != std::string::npos);
  CHECK(error_of(temp_file("comments", "# nothing\n\n")).find(": no events") != std::string::npos);
  CHECK(error_of(temp_file("segments_only", "S,512\nU,512\n")).find(": no allocations") != std::string::npos);
  CHECK_THROWS_AS((void)parse_trace("", "buffer"), trace_error);
}

TEST_CASE("trace: sizes beyond 2^48 bytes and numbers that do not fit are errors naming file and line") {
  CHECK(error_of(temp_file("huge", "a,0,512,0\na,1,9223372036854775808,0\n"))
            .find("glake_trace_test_huge:2: size 9223372036854775808 is more than 2^48 bytes") != std::string::npos);
  CHECK(error_of(temp_file("huge_segment", "S,281474976710657\n")).find(":1: segment size 281474976710657 is more") !=
        std::string::npos);
  CHECK_NOTHROW((void)parse_trace("a,0,281474976710656,0\n", "buffer"));  // 2^48 itself is allowed
  CHECK(error_of(temp_file("id_overflow", "a,18446744073709551616,512,0\n"))
            .find(":1: id '18446744073709551616' is out of range (at most 18446744073709551615)") != std::string::npos);
  CHECK(error_of(temp_file("stream_overflow", "a,1,512,4294967296\n")).find(":1: stream '4294967296' is out of range") !=
        std::string::npos);
  CHECK(error_of(temp_file("negative", "a,1,-100,0\n")).find(":1: size '-100' is not a non-negative integer") !=
        std::string::npos);
  CHECK(error_of(temp_file("plus", "a,+1,512,0\n")).find(":1: id '+1' is not a non-negative integer") !=
        std::string::npos);
  CHECK(error_of(temp_file("space", "a,1, 512,0\n")).find(":1: size ' 512' is not") != std::string::npos);
  CHECK(error_of(temp_file("empty_field", "a,1,,0\n")).find(":1: size is empty") != std::string::npos);
  // The sum of live bytes must fit too: 65536 live allocations of 2^48 bytes are 2^64.
  std::string many;
  for (int i = 0; i < 65536; ++i) many += "a," + std::to_string(i) + ",281474976710656,0\n";
  CHECK(error_of(temp_file("sum", many)).find(":65536: live allocations exceed 2^64 bytes") != std::string::npos);
}

TEST_CASE("trace: a NUL byte is named as such, with its line and column") {
  CHECK(error_of(temp_file("nul", std::string("a,1,512,0\na,2,5\0""12,0\n", 20)))
            .find("glake_trace_test_nul:2: NUL byte at column 6") != std::string::npos);
  CHECK(error_of(temp_file("nul_comment", std::string("# \0\na,1,512,0\n", 14))).find(":1: NUL byte at column 3") !=
        std::string::npos);
}

TEST_CASE("trace: control characters are escaped and long fragments truncated in messages") {
  const std::string message = error_of(temp_file("control", "a,1,512,0\n\x1b[31mred,1\n"));
  CHECK(message.find(":2: unknown record '\\x1b[31mred'") != std::string::npos);
  CHECK(message.find('\x1b') == std::string::npos);
  const std::string high = error_of(temp_file("high", "a,1,\xff\xfe,0\n"));
  CHECK(high.find("size '\\xff\\xfe' is not") != std::string::npos);
  const std::string long_field = error_of(temp_file("long_field", "a,1," + std::string(1000, '7') + "x,0\n"));
  CHECK(long_field.find(":1: size '" + std::string(32, '7') + "...' (1001 bytes) is not") != std::string::npos);
  CHECK(long_field.size() < 200);
  CHECK(error_of(temp_file("too_long", "# " + std::string(5000, 'x') + "\n")).find(":1: line longer than 4096 bytes") !=
        std::string::npos);
}

TEST_CASE("trace: CRLF line endings and a last line without its newline are accepted") {
  const trace t = read_trace(temp_file("crlf", "# made on Windows\r\na,1,512,0\r\nf,1\r\na,2,1024,3"));
  REQUIRE(t.events.size() == 3);
  CHECK(t.events[2].bytes == 1024);
  CHECK(t.events[2].stream == 3);
  CHECK(error_of(temp_file("cr_cr", "a,1,512,0\r\r\n")).find(":1: stream '0\\x0d' is not") != std::string::npos);
}

TEST_CASE("trace: parse_trace reads a buffer as read_trace reads a file, and maps events to lines") {
  const trace t = parse_trace("# header\n\na,1,512,0\nf,1\n# mid\na,2,512,0\n", "mem", "name");
  CHECK(t.name == "name");
  CHECK(t.source == "mem");
  REQUIRE(t.events.size() == 3);
  CHECK(t.line_of(0) == 3);
  CHECK(t.line_of(1) == 4);
  CHECK(t.line_of(2) == 6);
  std::string message;
  try {
    (void)parse_trace("a,1,512,0\nf,2\n", "mem");
  } catch (const trace_error& e) {
    message = e.what();
  }
  CHECK(message == "mem:2: free of allocation id 2, which is not live");
  // Whatever the bytes, only trace_error comes out.
  std::string noise;
  for (unsigned i = 0; i < 4096; ++i) noise += static_cast<char>((i * 2654435761u) >> 13);
  for (std::size_t cut = 0; cut < noise.size(); cut += 97) {
    CHECK_THROWS_AS((void)parse_trace(std::string_view(noise).substr(cut), "noise"), trace_error);
  }
  const trace bundled_from_memory = [] {
    gzFile in = gzopen(bundled("opt1.3b-LR").c_str(), "rb");
    std::string text;
    char buffer[1 << 16];
    for (int n; (n = gzread(in, buffer, sizeof buffer)) > 0;) text.append(buffer, static_cast<std::size_t>(n));
    gzclose(in);
    return parse_trace(text);
  }();
  CHECK(bundled_from_memory.events.size() == read_trace(bundled("opt1.3b-LR")).events.size());
}

TEST_CASE("trace: a directory or a truncated gzip header is an error, not an empty trace") {
  CHECK(error_of("/tmp").find("/tmp:1: cannot read: Is a directory") != std::string::npos);
  CHECK(error_of(temp_file("header_only.gz", std::string("\x1f\x8b\x08\x00", 4))).find("truncated or corrupt") !=
        std::string::npos);
}

namespace {

/// A configuration's allocator that throws std::bad_alloc on its `fail_at`-th request, as one
/// that runs the host out of memory would.
class throwing_replayable final : public replayable {
 public:
  throwing_replayable(std::unique_ptr<replayable> inner, int fail_at) : inner_(std::move(inner)), fail_at_(fail_at) {}
  void* try_allocate(std::size_t bytes, glake::stream_ref stream) override {
    if (++calls_ == fail_at_) throw std::bad_alloc();
    return inner_->try_allocate(bytes, stream);
  }
  void deallocate(void* p, std::size_t bytes, glake::stream_ref stream) override { inner_->deallocate(p, bytes, stream); }
  std::optional<free_breakdown> free_memory() const override { return inner_->free_memory(); }
  std::size_t reserved_bytes() const override { return inner_->reserved_bytes(); }
  glake::statistics stats() const override { return inner_->stats(); }
  void verify() const override { inner_->verify(); }
  const glake::sim_device& device() const override { return inner_->device(); }

 private:
  std::unique_ptr<replayable> inner_;
  int fail_at_;
  int calls_ = 0;
};

}  // namespace

TEST_CASE("replay: an exception while replaying names the file, the line, the configuration and the event") {
  configuration c = named("glake");
  const auto make = c.make;
  c.make = [make](std::size_t capacity) -> std::unique_ptr<replayable> {
    return std::make_unique<throwing_replayable>(make(capacity), 2);
  };
  const trace t = read_trace(temp_file("throws", "a,1,512,0\n# note\na,2,1024,3\nf,1\n"));
  std::string message;
  try {
    (void)replay_trace(t, c, std::size_t{1} << 40, false);
  } catch (const replay_error& e) {
    message = e.what();
  }
  CHECK(message == "/tmp/glake_trace_test_throws:3: glake, event 2 (a,2,1024,3): out of host memory (std::bad_alloc)");
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

TEST_CASE("replay: traces glake's plug-in recorded on an H200 replay with glake to the run's own peak") {
  // traces/README.md: 14 steps of bench/torch/finetune.py on one H200 (2026-11-28); the S/U lines
  // are glake's reserved memory in that run.
  struct recorded_run {
    const char* trace;
    std::size_t allocations;
    double peak_active_gb;
  };
  // The runs predate segments that grow in place: segment_reserve:0 replays their rules.
  configuration as_recorded{};
  for (auto& c : named_configurations("segment_reserve:0")) {
    if (c.name == "glake") as_recorded = c;
  }
  REQUIRE(as_recorded.make);
  for (const recorded_run& m : {recorded_run{"t5-base-N", 57074, 13.245}, recorded_run{"mistral1.2b-N", 28415, 21.302}}) {
    CAPTURE(m.trace);
    const trace t = read_trace(bundled(m.trace));
    CHECK(t.allocations == m.allocations);
    CHECK(static_cast<double>(t.peak_active_bytes) / 1e9 == doctest::Approx(m.peak_active_gb).epsilon(0.001));
    const replay_result r = replay_trace(t, as_recorded, std::size_t{1} << 40, false);
    CHECK(r.failed_allocations == 0);
    CHECK(static_cast<double>(r.peak_reserved_bytes) ==
          doctest::Approx(static_cast<double>(t.recorded_peak_reserved)).epsilon(0.002));
    CHECK(r.host_ns_per_operation > 0);
    // Today's glake holds less than expandable segments and keeps 98% of it live (T5-base's tails
    // in handles partly in use start the next request: docs/stitching.md).
    const replay_result now = replay_trace(t, named("glake"), std::size_t{1} << 40, false);
    const replay_result expandable = replay_trace(t, named("pytorch-expandable"), std::size_t{1} << 40, false);
    CHECK(now.peak_reserved_bytes < expandable.peak_reserved_bytes);
    CHECK(now.utilization >= 0.98);
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

TEST_CASE("trace: the inflated bytes and the events are bounded, the error naming the file, the line and the limit") {
  std::string text;
  for (int i = 0; i < 100; ++i) text += "a," + std::to_string(i) + ",4096,0\n";
  trace_limits few_events;
  few_events.max_events = 10;
  try {
    (void)parse_trace(text, "many.trace", {}, few_events);
    FAIL("a trace over the event limit was read");
  } catch (const trace_error& e) {
    CHECK(std::string(e.what()).find("many.trace:11: ") == 0);
    CHECK(std::string(e.what()).find("more than 10 events") != std::string::npos);
  }
  trace_limits few_bytes;
  few_bytes.max_text_bytes = 500;
  try {
    (void)parse_trace(text, "long.trace", {}, few_bytes);
    FAIL("a trace over the byte limit was read");
  } catch (const trace_error& e) {
    CHECK(std::string(e.what()).find("long.trace:") == 0);
    CHECK(std::string(e.what()).find("longer than 500 bytes") != std::string::npos);
  }
  // A small .gz that inflates far beyond the limit is refused without reading it all.
  const std::string path = "/tmp/glake-trace-bomb-" + std::to_string(::getpid()) + ".trace.gz";
  {
    gzFile out = gzopen(path.c_str(), "wb9");
    REQUIRE(out != nullptr);
    std::string lines;
    for (int i = 0; i < 1024; ++i) lines += std::string(63, '#') + "\n";
    for (int i = 0; i < 64; ++i) gzwrite(out, lines.data(), static_cast<unsigned>(lines.size()));  // 4 MiB
    gzclose(out);
  }
  trace_limits one_mib;
  one_mib.max_text_bytes = 1 << 20;
  try {
    (void)read_trace(path, {}, one_mib);
    FAIL("a trace over the byte limit was read");
  } catch (const trace_error& e) {
    CHECK(std::string(e.what()).find(path + ":") == 0);
    CHECK(std::string(e.what()).find("longer than 1048576 bytes (inflated)") != std::string::npos);
  }
  std::remove(path.c_str());
  // The defaults hold every bundled trace with room to spare.
  CHECK(trace_limits{}.max_events >= 10 * read_trace(bundled("opt1.3b-LR")).events.size());
}

TEST_CASE("replay: a 0-byte allocation gets no memory and is not counted as failed") {
  const trace t = parse_trace("a,1,0,0\na,2,4096,0\nf,1\nf,2\n", "zero.trace");
  for (const char* name : {"pytorch-default", "glake"}) {
    CAPTURE(name);
    const replay_result r = replay_trace(t, named(name), std::size_t{1} << 40, false);
    CHECK(r.failed_allocations == 0);
    CHECK(r.peak_active_bytes == 4096);
  }
}
