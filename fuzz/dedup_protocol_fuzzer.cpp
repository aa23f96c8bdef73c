// libFuzzer target: the dedup protocol's parsers (include/glake/sharing/dedup_protocol.hpp) on
// arbitrary bytes, as the broker meets them from a hostile client and a client from a broken
// broker.
//
// The first byte gives the number of descriptors said to come with the message (0-3) and which
// parser runs; the rest is the message. A request that parses must encode back to exactly the
// bytes it came from (every field is meaningful, none is ignored); a reply that parses must
// survive encode and parse unchanged. Nothing may crash, read out of bounds or throw anything
// but bad_alloc.
#include <cstddef>
#include <cstdint>
#include <span>
#include <variant>
#include <vector>

#include "glake/sharing/dedup_protocol.hpp"

#define GLAKE_FUZZ_TARGET "dedup_protocol_fuzzer"
#include "fuzz_support.hpp"

namespace {

using namespace glake::dedup;

bool same(const reply& a, const reply& b) {
  if (a.index() != b.index()) return false;
  if (auto* x = std::get_if<hello_reply>(&a)) {
    const auto& y = std::get<hello_reply>(b);
    return x->version == y.version && x->pid == y.pid;
  }
  if (auto* x = std::get_if<published_reply>(&a)) {
    const auto& y = std::get<published_reply>(b);
    return x->object == y.object && x->result == y.result;
  }
  if (auto* x = std::get_if<released_reply>(&a)) {
    const auto& y = std::get<released_reply>(b);
    return x->object == y.object && x->still_held == y.still_held;
  }
  if (auto* x = std::get_if<broker_stats>(&a)) {
    const auto& y = std::get<broker_stats>(b);
    return x->clients == y.clients && x->objects == y.objects && x->object_bytes == y.object_bytes &&
           x->references == y.references && x->publishes == y.publishes && x->shared == y.shared &&
           x->refused == y.refused;
  }
  const auto& x = std::get<error_reply>(a);
  const auto& y = std::get<error_reply>(b);
  return x.code == y.code && x.text == y.text;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::size_t fds = data[0] & 3;
  const bool as_reply = (data[0] & 4) != 0;
  const std::span<const std::byte> message(reinterpret_cast<const std::byte*>(data + 1), size - 1);
  if (!as_reply) {
    header h;
    auto parsed = parse_request(message, fds, &h);
    if (auto* q = std::get_if<request>(&parsed)) {
      const std::vector<std::byte> back = std::visit([&](const auto& r) { return encode(r, h.request); }, *q);
      GLAKE_FUZZ_CHECK(back.size() == message.size(), 0);
      GLAKE_FUZZ_CHECK(std::equal(back.begin(), back.end(), message.begin()), 0);
      if (auto* p = std::get_if<publish_request>(q)) GLAKE_FUZZ_CHECK(p->bytes != 0 && p->bytes <= max_object_bytes, 0);
      GLAKE_FUZZ_CHECK(fds == (std::holds_alternative<publish_request>(*q) ? 1u : 0u), 0);
    } else {
      GLAKE_FUZZ_CHECK(!std::get<parse_error>(parsed).text.empty(), 0);
    }
  } else {
    header h;
    auto parsed = parse_reply(message, fds, &h);
    if (auto* r = std::get_if<reply>(&parsed)) {
      const std::vector<std::byte> back = std::visit([&](const auto& x) { return encode(x, h.request); }, *r);
      const bool shared = std::holds_alternative<published_reply>(*r) && std::get<published_reply>(*r).result == outcome::shared;
      auto again = parse_reply(back, shared ? 1 : 0);
      GLAKE_FUZZ_CHECK(std::holds_alternative<reply>(again), 0);
      GLAKE_FUZZ_CHECK(same(*r, std::get<reply>(again)), 0);
    }
  }
  return 0;
}
