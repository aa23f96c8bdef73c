// libFuzzer target: the budget coordinator's protocol parsers
// (include/glake/scheduling/budget_protocol.hpp) on arbitrary bytes, as the coordinator meets
// them from a hostile workload and a workload from a broken coordinator.
//
// The first byte gives the number of descriptors said to come with the message (0-3) and which
// parser runs; the rest is the message. A message to the coordinator that parses must encode
// back to exactly the bytes it came from (every field is meaningful, none is ignored); one to a
// workload must survive encode and parse unchanged. Nothing may crash, read out of bounds or
// throw anything but bad_alloc.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <variant>
#include <vector>

#include "glake/scheduling/budget_protocol.hpp"

#define GLAKE_FUZZ_TARGET "budget_protocol_fuzzer"
#include "fuzz_support.hpp"

namespace {

using namespace glake::budget_wire;

bool same(const to_workload& a, const to_workload& b) {
  if (a.index() != b.index()) return false;
  if (auto* x = std::get_if<joined_reply>(&a)) {
    const auto& y = std::get<joined_reply>(b);
    return x->workload == y.workload && x->budget == y.budget;
  }
  if (auto* x = std::get_if<granted_reply>(&a)) {
    const auto& y = std::get<granted_reply>(b);
    return x->workload == y.workload && x->bytes == y.bytes;
  }
  if (auto* x = std::get_if<reclaim_request>(&a)) {
    const auto& y = std::get<reclaim_request>(b);
    return x->bytes == y.bytes && x->from_waiters == y.from_waiters;
  }
  if (auto* x = std::get_if<stats_reply>(&a)) {
    const auto& y = std::get<stats_reply>(b);
    if (x->budget != y.budget || x->used != y.used || x->workloads != y.workloads || x->lines.size() != y.lines.size()) {
      return false;
    }
    for (std::size_t i = 0; i < x->lines.size(); ++i) {
      const auto &p = x->lines[i], &q = y.lines[i];
      if (p.id != q.id || p.name != q.name || p.held != q.held || p.pinned != q.pinned || p.predicted != q.predicted) {
        return false;
      }
    }
    return true;
  }
  const auto& x = std::get<error_reply>(a);
  const auto& y = std::get<error_reply>(b);
  return x.code == y.code && x.text == y.text;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::size_t fds = data[0] & 3;
  const bool to_a_workload = (data[0] & 4) != 0;
  const std::span<const std::byte> message(reinterpret_cast<const std::byte*>(data + 1), size - 1);
  header h;
  if (!to_a_workload) {
    auto parsed = parse_to_coordinator(message, fds, &h);
    if (auto* q = std::get_if<to_coordinator>(&parsed)) {
      GLAKE_FUZZ_CHECK(fds == 0, 0);
      const std::vector<std::byte> back = std::visit([&](const auto& r) { return encode(r, h.request); }, *q);
      GLAKE_FUZZ_CHECK(back.size() == message.size(), 0);
      GLAKE_FUZZ_CHECK(std::equal(back.begin(), back.end(), message.begin()), 0);
      if (auto* j = std::get_if<join_request>(q)) {
        GLAKE_FUZZ_CHECK(!j->name.empty() && j->name.size() <= max_name_bytes, 0);
      }
    } else {
      GLAKE_FUZZ_CHECK(!std::get<parse_error>(parsed).text.empty(), 0);
    }
  } else {
    auto parsed = parse_to_workload(message, fds, &h);
    if (auto* r = std::get_if<to_workload>(&parsed)) {
      GLAKE_FUZZ_CHECK(fds == 0, 0);
      const std::vector<std::byte> back = std::visit([&](const auto& x) { return encode(x, h.request); }, *r);
      auto again = parse_to_workload(back);
      GLAKE_FUZZ_CHECK(std::holds_alternative<to_workload>(again), 0);
      GLAKE_FUZZ_CHECK(same(*r, std::get<to_workload>(again)), 0);
    } else {
      GLAKE_FUZZ_CHECK(!std::get<parse_error>(parsed).text.empty(), 0);
    }
  }
  return 0;
}
