// tools/replay/snapshot.hpp and progress.hpp: what a replay records for memory_viz, the
// throttle on progress lines, and read_trace telling how far it got.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "configurations.hpp"
#include "progress.hpp"
#include "replay.hpp"
#include "snapshot.hpp"
#include "trace.hpp"

using namespace glake::replay;

namespace {

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

configuration named_configuration(const std::string& name) {
  for (const auto& c : named_configurations()) {
    if (c.name == name) return c;
  }
  FAIL("no configuration " << name);
  return {};
}

// Two tensors, one freed; the third request cannot fit a 64 MiB device.
const char* const small_trace =
    "a,1,4194304,0\n"
    "a,2,1048576,0\n"
    "f,1\n"
    "a,3,1073741824,0\n";

}  // namespace

TEST_CASE("replay snapshot: the history of a configuration that reports segments, and its state") {
  const trace t = parse_trace(small_trace);
  replay_snapshot snapshot(1000);
  const replay_result r = replay_trace(t, named_configuration("glake"), std::size_t{64} << 20, false, {}, &snapshot);
  CHECK(r.failed_allocations == 1);
  CHECK(snapshot.observed);
  CHECK(snapshot.has_segments);
  const std::string& json = snapshot.json;
  CHECK(json.rfind(R"({"segments":[{"device":0,"address":)", 0) == 0);
  CHECK(count(json, R"("action":"alloc")") == 2);
  CHECK(count(json, R"("action":"free_requested")") == 1);
  CHECK(count(json, R"("action":"free_completed")") == 1);  // from the allocator, once
  CHECK(count(json, R"("action":"segment_alloc")") >= 1);
  CHECK(count(json, R"("action":"oom","addr":0,"size":1073741824,"stream":0,"time_us":4,"frames":[],)"
                    R"("device_free":0)") == 1);
  CHECK(count(json, R"("state":"active_allocated")") == 1);  // tensor 2 is live at the end
  CHECK(json.find(R"("size":1048576,"requested_size":1048576,"state":"active_allocated")") != std::string::npos);
}

TEST_CASE("replay snapshot: a configuration without segments records the frees itself") {
  const trace t = parse_trace(small_trace);
  replay_snapshot snapshot(1000);
  (void)replay_trace(t, named_configuration("pytorch-default"), std::size_t{64} << 20, false, {}, &snapshot);
  CHECK_FALSE(snapshot.observed);
  CHECK_FALSE(snapshot.has_segments);
  CHECK(snapshot.json.rfind(R"({"segments":[],"device_traces":[[{"action":"alloc",)", 0) == 0);
  CHECK(count(snapshot.json, R"("action":"free_completed")") == 1);
  CHECK(count(snapshot.json, R"("action":"segment_)") == 0);
}

TEST_CASE("replay snapshot: the history keeps the newest entries") {
  const trace t = parse_trace(small_trace);
  replay_snapshot snapshot(2);
  (void)replay_trace(t, named_configuration("pytorch-default"), std::size_t{64} << 20, false, {}, &snapshot);
  // free_requested and free_completed of event 3 went; the oom of event 4 is last.
  CHECK(count(snapshot.json, R"("action":)") == 2);
  CHECK(snapshot.json.find(R"("action":"free_completed","addr":)") != std::string::npos);
  CHECK(snapshot.json.find(R"("action":"oom")") != std::string::npos);
  CHECK(snapshot.json.find(R"("action":"alloc")") == std::string::npos);
}

TEST_CASE("replay snapshot: the placements are those of a replay without one") {
  const trace t = read_trace(std::string(GLAKE_TRACES_DIR) + "/opt1.3b-LR.trace.gz");
  for (const char* name : {"glake", "pytorch-default"}) {
    replay_snapshot snapshot(10);
    const replay_result with = replay_trace(t, named_configuration(name), std::size_t{1} << 40, false, {}, &snapshot);
    const replay_result without = replay_trace(t, named_configuration(name), std::size_t{1} << 40, false);
    CHECK(with.placement_digest == without.placement_digest);
    CHECK(with.peak_reserved_bytes == without.peak_reserved_bytes);
  }
}

TEST_CASE("progress: at most one line per interval, the first one interval after the start") {
  using namespace std::chrono_literals;
  const progress_throttle::clock::time_point start{};
  progress_throttle throttle(250ms, start);
  CHECK_FALSE(throttle.due(start));
  CHECK_FALSE(throttle.due(start + 249ms));
  CHECK(throttle.due(start + 250ms));
  CHECK_FALSE(throttle.due(start + 400ms));
  CHECK(throttle.due(start + 500ms));
  CHECK(throttle.due(start + 2s));
  CHECK_FALSE(throttle.due(start + 2s + 1ms));
}

TEST_CASE("progress: read_trace tells how much of the file it read, up to all of it") {
  const std::string path = std::string(GLAKE_TRACES_DIR) + "/opt1.3b-LR.trace.gz";
  std::vector<std::uint64_t> reads;
  std::uint64_t size = 0;
  const trace t = read_trace(path, {}, {}, [&](std::uint64_t read, std::uint64_t file_bytes) {
    reads.push_back(read);
    size = file_bytes;
  });
  CHECK(t.allocations > 0);
  REQUIRE(reads.size() >= 2);  // more than one chunk of text
  CHECK(size == std::filesystem::file_size(path));
  for (std::size_t i = 1; i < reads.size(); ++i) CHECK(reads[i] >= reads[i - 1]);
  CHECK(reads.back() == size);
}
