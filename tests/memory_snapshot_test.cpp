// The memory snapshot writer (memory_snapshot.hpp), which the PyTorch plug-in and glake-replay
// share: segments, blocks and stitched ranges in PyTorch's snapshot shape, each with the device
// and pool it was visited under, and one history per device.
#include <doctest/doctest.h>

#include <cstddef>
#include <string>
#include <vector>

#include "glake/memory_snapshot.hpp"

namespace {

using namespace glake;

std::size_t count(const std::string& text, const std::string& part) {
  std::size_t n = 0;
  for (std::size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + part.size())) ++n;
  return n;
}

}  // namespace

TEST_CASE("memory_snapshot_writer: nothing visited is an empty snapshot with one empty trace per device") {
  memory_snapshot_writer w;
  CHECK(w.json({}) == R"({"segments":[],"device_traces":[],"stitched_ranges":[]})");
  memory_snapshot_writer two;
  CHECK(two.json({{}, {}}) == R"({"segments":[],"device_traces":[[],[]],"stitched_ranges":[]})");
}

TEST_CASE("memory_snapshot_writer: a block claimed by a live stitched range is counted once, in the range") {
  memory_snapshot_writer w;
  w.segment(segment_view{4096, 2048, stream_ref{}});
  w.block(block_view{4096, 1024, 1000, block_state::allocated, stream_ref{}, 0, 0});
  w.block(block_view{5120, 1024, 0, block_state::allocated, stream_ref{}, 0, 65536});
  stitched_view range{};
  range.address = 65536;
  range.size = 1024;
  range.claimed = 1024;
  range.requested = 900;
  range.live = true;
  range.state = block_state::allocated;
  w.stitched(range);
  w.piece(stitched_piece_view{5120, 1024});
  const std::string json = w.json({{history_entry{memory_action::oom, 0, 1 << 20, stream_ref{}, 7, 0}}});
  // The physical segment: only its unclaimed block is allocated; the claimed one is inactive.
  CHECK(json.find(R"("address":4096,"total_size":2048,"allocated_size":1024,"active_size":1024,)"
                  R"("requested_size":1000,)") != std::string::npos);
  CHECK(json.find(R"({"address":5120,"size":1024,"requested_size":0,"state":"inactive","frames":[],)"
                  R"("stitched_into":65536})") != std::string::npos);
  // The live range is a segment of its own, holding one allocated block, and a stitched range.
  CHECK(json.find(R"("address":65536,"total_size":1024,"allocated_size":1024,"active_size":1024,)"
                  R"("requested_size":900,"stream":0,"segment_type":"stitched")") != std::string::npos);
  CHECK(count(json, R"("state":"active_allocated")") == 2);
  CHECK(json.find(R"("stitched_ranges":[{"device":0,"address":65536,"size":1024,"live":true,)"
                  R"("stream":0,"segment_pool_id":[0,0],"pieces":[{"address":5120,"size":1024}]}]})") !=
        std::string::npos);
  CHECK(json.find(R"("device_traces":[[{"action":"oom","addr":0,"size":1048576,"stream":0,"time_us":7,)"
                  R"("frames":[],"device_free":0}]])") != std::string::npos);
}

TEST_CASE("memory_snapshot_writer: segments carry the device and pool they were visited under") {
  memory_snapshot_writer w;
  w.device(0);
  w.pool(0, 0);
  w.segment(segment_view{4096, 1024, stream_ref{}});
  w.pool(3, 5);  // a CUDA graph's private pool: closes device 0's general segment first
  w.segment(segment_view{8192, 1024, stream_ref{}});
  w.device(2);
  w.pool(0, 0);
  w.segment(segment_view{16384, 1024, stream_ref{}});
  const std::string json = w.json({{}, {}, {}});
  CHECK(json.find(R"({"device":0,"address":4096,)") != std::string::npos);
  CHECK(json.find(R"({"device":0,"address":8192,)") != std::string::npos);
  CHECK(json.find(R"({"device":2,"address":16384,)") != std::string::npos);
  CHECK(count(json, R"("segment_pool_id":[3,5])") == 1);
  CHECK(count(json, R"("segment_pool_id":[0,0])") == 2);
  CHECK(count(json, R"("segment_type":"large")") == 3);
  CHECK(json.find(R"("device_traces":[[],[],[]])") != std::string::npos);
}
