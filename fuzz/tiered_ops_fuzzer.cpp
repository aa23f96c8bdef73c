// libFuzzer target: bytes decoded into a stream of virtual_buffer operations (commit, decommit,
// offload, prefetch, release_cached, record_stream, writes, injected driver faults, completed
// events) on host memory (every piece's bytes checked) and on the simulated device with events
// (the driver's rules and the memory counts checked).
//
// The first byte picks the composition and the buffer's shape (pieces, piece size), the rest is
// operations: each takes an opcode byte and a range byte (first piece, piece count). After every
// operation, and whatever it threw, the buffer's statistics must match the backends' own counts
// (no handle leaked, none released twice), every committed piece must hold the bytes last
// written to it, and the simulated device must have seen no broken rule. A move that throws must
// leave every piece where it was. Any exception other than out_of_memory or usage_error, a failed
// check, or a sanitizer report is a crash. The operations executed are counted and printed at exit.
#include <array>
#include <cinttypes>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "fuzz_support.hpp"
#include "glake/backends/fault_injection.hpp"
#include "glake/backends/host.hpp"
#include "glake/backends/sim.hpp"
#include "glake/movers/virtual_buffer.hpp"
#include "support/evented_reserver.hpp"
#include "support/stamp.hpp"

#define GLAKE_FUZZ_TARGET "tiered_ops_fuzzer"

namespace {

using namespace glake;
using testing::stamp;
using testing::stamped;

std::uint64_t operations_executed = 0;
std::uint64_t inputs_executed = 0;
std::uint64_t moves_refused = 0;

using fuzzing::byte_reader;

constexpr std::size_t granularity = 64 * KiB;


// Host memory behind fault-injecting wrappers: the bytes are real.
struct host_setup {
  fault_plan plan;
  host_provider device{granularity, 48 * granularity};
  host_provider host{granularity, 40 * granularity};
  using buffer_type = virtual_buffer<fault_injecting_provider<host_provider>, fault_injecting_provider<host_provider>,
                                     fault_injecting_reserver<host_reserver>, host_copier>;
  std::unique_ptr<buffer_type> make(std::size_t capacity, std::size_t piece) {
    return std::make_unique<buffer_type>(fault_injecting_provider<host_provider>(device, plan),
                                         fault_injecting_provider<host_provider>(host, plan),
                                         fault_injecting_reserver<host_reserver>(host_reserver(granularity), plan),
                                         host_copier{}, capacity, piece);
  }
  std::size_t device_bytes() const { return device.created_bytes(); }
  std::size_t host_bytes() const { return host.created_bytes(); }
  bool sound() const { return true; }
  void complete_events() {}
  static constexpr bool has_bytes = true;
};

// The simulated device with hand-completed events: the rules and the stream waits.
struct sim_setup {
  fault_plan plan;
  sim_device gpu{48 * granularity, granularity, 40 * granularity};
  testing::event_log log;
  using buffer_type = virtual_buffer<fault_injecting_provider<sim_provider>, fault_injecting_provider<sim_host_provider>,
                                     testing::evented_reserver, sim_copier>;
  std::unique_ptr<buffer_type> make(std::size_t capacity, std::size_t piece) {
    return std::make_unique<buffer_type>(fault_injecting_provider<sim_provider>(sim_provider(gpu), plan),
                                         fault_injecting_provider<sim_host_provider>(sim_host_provider(gpu), plan),
                                         testing::evented_reserver(gpu, log), sim_copier(gpu), capacity, piece);
  }
  std::size_t device_bytes() const { return gpu.physical_bytes(); }
  std::size_t host_bytes() const { return gpu.host_bytes(); }
  bool sound() const { return gpu.violations() == 0; }
  void complete_events() {
    for (auto& [id, e] : log.events) e.second = true;
  }
  static constexpr bool has_bytes = false;
};

template <class Setup>
void run(byte_reader& in, std::uint8_t shape) {
  Setup setup;
  const std::size_t pieces = 1 + shape % 12;
  const std::size_t piece = granularity * (1 + (shape >> 4) % 4);
  // The last piece is shorter when the capacity is not a multiple of the piece.
  const std::size_t capacity = pieces * piece - ((shape & 0x80) != 0 && piece > granularity ? granularity : 0);
  auto buffer = setup.make(capacity, piece);
  char* const base = static_cast<char*>(buffer->data());
  const std::size_t count = buffer->piece_count();
  auto size_of = [&](std::size_t i) { return std::min(buffer->piece_size(), buffer->size() - i * buffer->piece_size()); };
  std::vector<std::uint64_t> tags(count, 0);  // 0: nothing written (or no memory)
  std::uint64_t next_tag = 1;
  const stream_ref streams[] = {default_stream, stream_ref{std::uintptr_t{7}}, stream_ref{std::uintptr_t{9}}};

  for (std::uint64_t step = 0; !in.done() && step < 512; ++step) {
    const std::uint8_t op = in.byte();
    const std::uint8_t range = in.byte();
    const std::size_t first = range % count;
    const std::size_t n = 1 + (range >> 4) % (count - first);
    const std::size_t offset = first * buffer->piece_size();
    const std::size_t bytes = std::min(buffer->size() - offset, n * buffer->piece_size());
    const stream_ref stream = streams[(op >> 6) % 3];
    std::vector<residence> before(count);
    for (std::size_t i = 0; i < count; ++i) before[i] = buffer->residence_of(i * buffer->piece_size());
    if ((op & 0x20) != 0) setup.plan.fail_nth_call(1 + (op & 0x0f));  // a fault somewhere ahead
    bool threw = false;
    try {
      switch (op % 8) {
        case 0:
        case 1:
          buffer->offload(offset, bytes, stream);
          break;
        case 2:
        case 3:
          buffer->prefetch(offset, bytes, stream);
          break;
        case 4:
          buffer->commit(offset, bytes);
          break;
        case 5:
          buffer->decommit(offset, bytes, stream);
          for (std::size_t i = first; i < first + n && i < count; ++i) tags[i] = 0;
          break;
        case 6:
          // Write through the pointer wherever the piece lives (host setups only touch bytes).
          if constexpr (Setup::has_bytes) {
            if (before[first] != residence::none) {
              tags[first] = next_tag++;
              stamp(base + first * buffer->piece_size(), size_of(first), tags[first]);
            }
          }
          break;
        default:
          if ((op & 0x10) != 0) {
            buffer->release_cached();
          } else {
            buffer->record_stream(stream);
            setup.complete_events();
          }
      }
    } catch (const out_of_memory&) {
      threw = true;
    } catch (const usage_error&) {
      threw = true;
    }
    setup.plan.never_fail();
    ++operations_executed;
    if (threw) {
      ++moves_refused;
      if (op % 8 < 4) {  // a refused move leaves every piece where it was
        for (std::size_t i = 0; i < count; ++i) {
          GLAKE_FUZZ_CHECK(buffer->residence_of(i * buffer->piece_size()) == before[i], step);
        }
      }
    }
    if (op % 8 == 4 && !threw) {
      for (std::size_t i = first; i < first + n && i < count; ++i) {
        if (before[i] == residence::none && Setup::has_bytes) {
          tags[i] = next_tag++;
          stamp(base + i * buffer->piece_size(), size_of(i), tags[i]);
        }
      }
    }
    const auto s = buffer->stats();
    std::size_t device = 0, host = 0;
    for (std::size_t i = 0; i < count; ++i) {
      const residence r = buffer->residence_of(i * buffer->piece_size());
      if (r == residence::device) device += size_of(i);
      if (r == residence::host) host += size_of(i);
      if constexpr (Setup::has_bytes) {
        if (r != residence::none && tags[i] != 0) {
          GLAKE_FUZZ_CHECK(stamped(base + i * buffer->piece_size(), size_of(i), tags[i]), step);
        }
      }
    }
    GLAKE_FUZZ_CHECK(s.device_bytes == device, step);
    GLAKE_FUZZ_CHECK(s.host_bytes == host, step);
    GLAKE_FUZZ_CHECK(setup.device_bytes() == device, step);
    GLAKE_FUZZ_CHECK(setup.host_bytes() == host + s.cached_host_bytes, step);
    GLAKE_FUZZ_CHECK(setup.sound(), step);
  }
  setup.complete_events();
  buffer.reset();
  GLAKE_FUZZ_CHECK(setup.device_bytes() == 0, 0);
  GLAKE_FUZZ_CHECK(setup.host_bytes() == 0, 0);
  GLAKE_FUZZ_CHECK(setup.sound(), 0);
}

void report_at_exit() {
  std::fprintf(stderr, "tiered_ops_fuzzer: %" PRIu64 " operations in %" PRIu64 " inputs, %" PRIu64 " refused\n",
               operations_executed, inputs_executed, moves_refused);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const bool registered = [] { return std::atexit(report_at_exit) == 0; }();
  (void)registered;
  ++inputs_executed;
  byte_reader in(data, size);
  const std::uint8_t which = in.byte();
  const std::uint8_t shape = in.byte();
  if (which % 2 == 0) {
    run<host_setup>(in, shape);
  } else {
    run<sim_setup>(in, shape);
  }
  return 0;
}
