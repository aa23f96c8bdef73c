// libFuzzer target: bytes decoded into a stream of allocator operations (allocate, deallocate,
// record_stream, release_cached, injected driver faults, completed events, memory limits set at
// run time, offload and prefetch of live blocks to far memory, read-only marks that keep a
// block's far copy) on the host and simulated
// backends, with verify(), the statistics and every live block's contents checked.
//
// The first byte picks one of the compositions in `run_one` (stitching, caching and segregator
// over host or sim, with or without fault injection or events), the next few bytes its knobs,
// and the rest is operations (`op` below). Every live block of a host composition is filled with
// a pattern derived from its id (wholly when small, else its first and last 256 bytes and one
// word per 64 KiB granule, so a block stitched from the wrong handles shows), checked before it
// is freed and every 16 operations; the sim device's page tables stand in for contents on sim.
//
// Any exception other than glake::out_of_memory, a failed check, or a sanitizer report is a
// crash. Requests of absurd size (2^40, 2^62, SIZE_MAX, ...) are one size class among four;
// GLAKE_FUZZ_ABSURD=0 in the environment (or -DGLAKE_FUZZ_ABSURD_DEFAULT=0 at build time) maps
// them to small requests instead. The operations executed are counted and printed at exit.
#include <array>
#include <cinttypes>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <new>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "fuzz_support.hpp"
#include "glake/allocators/caching_allocator.hpp"
#include "glake/allocators/segment_source.hpp"
#include "glake/allocators/segregator.hpp"
#include "glake/allocators/stitching_allocator.hpp"
#include "glake/backends/fault_injection.hpp"
#include "glake/backends/host.hpp"
#include "glake/backends/sim.hpp"
#include "glake/policies/eviction.hpp"
#include "glake/policies/stitching.hpp"
#include "support/evented_reserver.hpp"

#ifndef GLAKE_FUZZ_ABSURD_DEFAULT
#define GLAKE_FUZZ_ABSURD_DEFAULT 1
#endif

#define GLAKE_FUZZ_TARGET "alloc_ops_fuzzer"

namespace {

using namespace glake;

std::uint64_t operations_executed = 0;
std::uint64_t inputs_executed = 0;
std::uint64_t absurd_requests = 0;
std::uint64_t absurd_granted = 0;
bool absurd_enabled = GLAKE_FUZZ_ABSURD_DEFAULT != 0;

using fuzzing::byte_reader;

constexpr std::size_t host_granularity = 64 * KiB;
constexpr std::size_t host_capacity = 256 * MiB;
constexpr std::size_t sim_granularity = 2 * MiB;
constexpr std::size_t sim_capacity = 4 * GiB;
const stream_ref streams[] = {stream_ref{0}, stream_ref{7}, stream_ref{9}};

constexpr std::size_t absurd_sizes[] = {
    std::size_t{1} << 40,
    std::size_t{1} << 48,
    std::size_t{1} << 62,
    (std::size_t{1} << 63) + 1,
    std::numeric_limits<std::size_t>::max() - 511,
    std::numeric_limits<std::size_t>::max(),
};

// small: 0..1 MiB, mid: 1..64 MiB, large: 64 MiB..1 GiB, absurd: the list above. Log-uniform
// within each class, from 16 bits of input.
std::size_t request_size(byte_reader& in) {
  const std::uint8_t cls = in.byte();
  const std::uint16_t bits = in.u16();
  const auto log_uniform = [bits](unsigned lo, unsigned hi) {
    const unsigned span = hi - lo;
    const unsigned shift = lo + (bits >> 8) % span;
    const std::size_t base = std::size_t{1} << shift;
    return base + (base * (bits & 0xff) >> 8);
  };
  switch (cls % 16) {
    case 15:
      if (absurd_enabled) {
        ++absurd_requests;
        return absurd_sizes[bits % std::size(absurd_sizes)];
      }
      [[fallthrough]];
    default:  // 0..10: small, the common case as in training workloads
      return bits % 97 == 0 ? 0 : log_uniform(0, 20);
    case 11:
    case 12:
    case 13:
      return log_uniform(20, 26);
    case 14:
      return log_uniform(26, 30);
  }
}

std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The pattern: the 8-byte word at offset o of block `id` is mix(id * 2^40 + o) (byte-wise, so
// unaligned offsets work too). Small blocks are filled wholly; larger ones at head, tail and
// one word per granule, to keep the cost per operation bounded.
template <class Visit>
void for_each_pattern_range(std::size_t bytes, Visit&& visit) {
  constexpr std::size_t whole = 16 * KiB, edge = 256;
  if (bytes <= whole) {
    visit(std::size_t{0}, bytes);
    return;
  }
  visit(std::size_t{0}, edge);
  for (std::size_t o = host_granularity; o + 8 <= bytes - edge; o += host_granularity) visit(o, std::size_t{8});
  visit(bytes - edge, edge);
}

std::uint8_t pattern_byte(std::uint64_t id, std::size_t offset) {
  const std::uint64_t word = mix(id << 40 ^ (offset & ~std::size_t{7}));
  return static_cast<std::uint8_t>(word >> (8 * (offset & 7)));
}

void fill_pattern(void* p, std::size_t bytes, std::uint64_t id) {
  auto* b = static_cast<std::uint8_t*>(p);
  for_each_pattern_range(bytes, [&](std::size_t from, std::size_t n) {
    for (std::size_t o = from; o < from + n; ++o) b[o] = pattern_byte(id, o);
  });
}

bool pattern_intact(const void* p, std::size_t bytes, std::uint64_t id) {
  const auto* b = static_cast<const std::uint8_t*>(p);
  bool ok = true;
  for_each_pattern_range(bytes, [&](std::size_t from, std::size_t n) {
    for (std::size_t o = from; o < from + n && ok; ++o) ok = b[o] == pattern_byte(id, o);
  });
  return ok;
}

struct live_block {
  void* p;
  std::size_t bytes;
  stream_ref stream;
  std::uint64_t id;
  bool recorded = false;  ///< record_stream'd: its free may be deferred
  bool offloaded = false;  ///< its memory is in far memory
};

// What a composition offers the driver loop beyond the allocator itself.
struct host_world {
  static constexpr bool real_memory = true;
  fault_plan plan;
  host_provider raw_provider{host_granularity, host_capacity};
  host_provider far_provider{host_granularity, host_capacity};
  std::size_t physical_bytes() const { return raw_provider.created_bytes(); }
  bool clean_after_teardown() const { return raw_provider.created_bytes() == 0 && far_provider.created_bytes() == 0; }
  template <class A>
  void attach_far_memory(A& a) {
    a.attach_far_memory(fault_injecting_provider<host_provider>{far_provider, plan}, host_copier{});
  }
  bool mapped(const void*) const { return true; }  // the pattern check covers it
  void complete(stream_ref) {}
  fault_plan* faults() { return &plan; }
};

struct sim_world {
  static constexpr bool real_memory = false;
  fault_plan plan;
  sim_device device{sim_capacity, sim_granularity};
  testing::event_log events;
  bool with_faults = true;
  std::size_t physical_bytes() const { return device.physical_bytes(); }
  bool clean_after_teardown() const {
    return device.physical_bytes() == 0 && device.live_handles() == 0 && device.reserved_bytes() == 0 &&
           device.live_mappings() == 0 && device.violations() == 0 && device.host_bytes() == 0;
  }
  template <class A>
  void attach_far_memory(A& a) {
    if (with_faults) {
      a.attach_far_memory(fault_injecting_provider<sim_host_provider>{sim_host_provider{device}, plan}, sim_copier{device});
    } else {
      a.attach_far_memory(sim_host_provider{device}, sim_copier{device});
    }
  }
  bool mapped(const void* p) const {
    const auto where = device.resolve(p);
    return where.has_value() && where->accessible;
  }
  void complete(stream_ref s) { events.complete(s); }
  fault_plan* faults() { return with_faults ? &plan : nullptr; }
};

config fuzzed_config(byte_reader& in) {
  config c;
  const std::uint8_t a = in.byte(), b = in.byte();
  constexpr std::size_t frag_limits[] = {0, 1 * MiB, 64 * MiB, 512 * MiB};
  constexpr std::size_t max_handles[] = {0, 0, 4 * MiB, 64 * MiB};
  constexpr std::size_t auto_gcs[] = {1000 * GiB, 64 * MiB, 512 * MiB, 4 * GiB};
  constexpr double reuse_limits[] = {10.0, 1.0, 2.0, 4.0};
  c.frag_limit = frag_limits[a & 3];
  c.grow_stitch = (a >> 2) & 1;
  c.defrag_level = ((a >> 3) & 3) % 3;
  c.far_unmapped = ((a >> 3) & 3) == 3;  // offloaded memory not mapped while away (defrag level 0)
  c.max_handle = max_handles[(a >> 5) & 3];
  c.stitching = (a >> 7) == 0 || (b & 1);
  c.auto_gc = auto_gcs[(b >> 1) & 3];
  c.reuse_limit = reuse_limits[(b >> 3) & 3];
  c.small_limit = (b >> 5) & 1 ? 0 : 1 * MiB;
  c.memory_limit = (b >> 6) & 1 ? 192 * MiB : 0;
  c.stitch_reserve = (b >> 7) ? 1.0 : 2.0;
  // Spare handles for moves in half the inputs, from bits shared with the settings above (a byte
  // more would shift every input of the corpus).
  c.move_spares = ((a ^ b) >> 4) & 1 ? 32 * MiB : 0;
  return c;
}

// The driver loop: one composition, operations until the input ends, then a full teardown.
template <class Allocator, class World>
void run_operations(Allocator& allocator, World& world, byte_reader& in) {
  std::vector<live_block> live;
  std::map<std::uintptr_t, std::size_t> ranges;  // live [p, p + bytes), to catch overlap anywhere
  std::size_t active = 0;
  // Frees of record_stream'd blocks wait for their streams' events and stay active until then;
  // release_cached waits for all of them.
  std::size_t deferred = 0;
  std::uint64_t next_id = 1, step = 0;
  int every_call_armed_for = 0;

  // Offloaded memory that maps nothing at its addresses (its whole handles; bytes in handles
  // shared with neighbours stay) is not read there; its bytes are checked once back.
  bool away_unmapped = false;
  if constexpr (requires { allocator.far_residence_of_moves(); }) {
    away_unmapped = allocator.far_residence_of_moves() == far_residence::unmapped;
  }
  const auto check_block = [&](const live_block& b) {
    if (b.offloaded && away_unmapped) return;
    if constexpr (World::real_memory) {
      GLAKE_FUZZ_CHECK(pattern_intact(b.p, b.bytes, b.id), step);
    } else {
      GLAKE_FUZZ_CHECK(world.mapped(b.p), step);
      GLAKE_FUZZ_CHECK(world.mapped(static_cast<const std::byte*>(b.p) + b.bytes - 1), step);
    }
  };
  const auto add = [&](void* p, std::size_t bytes, stream_ref s) {
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    GLAKE_FUZZ_CHECK(at % allocator.alignment() == 0, step);
    GLAKE_FUZZ_CHECK(at + bytes >= at, step);  // no wrap-around
    const auto next = ranges.lower_bound(at);
    GLAKE_FUZZ_CHECK(next == ranges.end() || next->first >= at + bytes, step);
    GLAKE_FUZZ_CHECK(next == ranges.begin() || std::prev(next)->first + std::prev(next)->second <= at, step);
    ranges.emplace(at, bytes);
    live.push_back({p, bytes, s, next_id++});
    if constexpr (World::real_memory) fill_pattern(p, bytes, live.back().id);
    check_block(live.back());
    active += bytes;
  };
  const auto remove = [&](std::size_t i) {
    const live_block b = live[i];
    check_block(b);
    ranges.erase(reinterpret_cast<std::uintptr_t>(b.p));
    live[i] = live.back();
    live.pop_back();
    active -= b.bytes;
    if (b.recorded) deferred += b.bytes;
    allocator.deallocate(b.p, b.bytes, b.stream);
  };

  while (!in.done()) {
    ++step;
    ++operations_executed;
    const std::uint8_t op = in.byte();
    switch (op % 16) {
      case 0: case 1: case 2: case 3: case 4: case 5: {
        const std::size_t bytes = request_size(in);
        const stream_ref s = streams[(op >> 4) % 3];
        const bool absurd = bytes > (std::size_t{1} << 39);
        void* p = nullptr;
        if (op & 0x80) {
          p = allocator.try_allocate(bytes, s);
        } else {
          try {
            p = allocator.allocate(bytes, s);
          } catch (const out_of_memory& e) {
            GLAKE_FUZZ_CHECK(e.requested_bytes() == bytes, step);
          }
        }
        if (p != nullptr) {
          GLAKE_FUZZ_CHECK(bytes != 0, step);
          if (absurd) ++absurd_granted;
          // An absurd request that succeeds is itself a finding; the range check in add()
          // would then report it as wrapping or overlapping.
          add(p, bytes, s);
        }
        break;
      }
      case 6: case 7: case 8: case 9:
        if (!live.empty()) remove(in.byte() % live.size());
        break;
      case 10:
        if constexpr (requires(void* p) { allocator.record_stream(p, streams[0]); }) {
          if (!live.empty()) {
            auto& b = live[in.byte() % live.size()];
            allocator.record_stream(b.p, streams[(op >> 4) % 3]);
            b.recorded = true;
          }
        }
        break;
      case 11:
        allocator.release_cached();
        deferred = 0;
        break;
      case 12:
        if (fault_plan* plan = world.faults()) {
          const std::uint8_t how = in.byte();
          constexpr driver_call kinds[] = {driver_call::create, driver_call::reserve, driver_call::map,
                                           driver_call::set_access};
          const driver_call kind = kinds[(how >> 2) & 3];
          const std::uint64_t n = 1 + (how >> 4);
          switch (how & 3) {
            case 0: plan->fail_nth_call(n); break;
            case 1: plan->fail_nth_call_of(kind, n); break;
            case 2:
              plan->fail_every_call_of(kind);
              every_call_armed_for = 1 + (how >> 4) % 4;
              break;
            case 3: plan->never_fail(); break;
          }
        }
        break;
      case 13:
        world.complete(streams[(op >> 4) % 3]);
        break;
      case 14:
        // With the high bit: offload a live block's memory, or bring it back.
        if constexpr (offloading_allocator<Allocator>) {
          if ((op & 0x80) && !live.empty()) {
            live_block& b = live[in.byte() % live.size()];
            try {
              if (b.offloaded) {
                allocator.prefetch(b.p, b.stream);
              } else {
                allocator.offload(b.p, b.stream);
              }
              b.offloaded = !b.offloaded;
            } catch (const out_of_memory&) {
            } catch (const usage_error& e) {
              // Refused only for what cannot move: a block with no whole handle of its own, one
              // in the small pool, or one whose handles a live stitched allocation also maps.
              const std::string what = e.what();
              GLAKE_FUZZ_CHECK(!b.offloaded && (what.find("no whole handle") != std::string::npos ||
                                                what.find("small allocation") != std::string::npos ||
                                                what.find("live stitched allocation") != std::string::npos),
                               step);
            }
            GLAKE_FUZZ_CHECK(allocator.residence_of(b.p) == (b.offloaded ? residence::host : residence::device), step);
            check_block(b);
            break;
          }
          // With 0x40: mark a live block read-only, or unmark it (keep_far_copy). Blocks are
          // written only when allocated, so a kept far copy is always the block's bytes.
          if constexpr (far_copy_keeping_allocator<Allocator>) {
            if ((op & 0x40) && !live.empty()) {
              const std::uint8_t which = in.byte();
              live_block& b = live[which % live.size()];
              try {
                allocator.keep_far_copy(b.p, (which & 0x80) == 0);
              } catch (const usage_error& e) {
                const std::string what = e.what();
                GLAKE_FUZZ_CHECK(what.find("not a live large allocation") != std::string::npos, step);
              }
              check_block(b);
              break;
            }
          }
        }
        for (const auto& b : live) check_block(b);
        break;
      case 15:
        // With the high bit: a new memory limit at run time (what remains held above a lowered
        // limit stays until freed; the checks below hold either way).
        if (op & 0x80) {
          if constexpr (requires { allocator.set_memory_limit(std::size_t{0}); }) {
            constexpr std::size_t limits[] = {0, 16 * MiB, 64 * MiB, 192 * MiB};
            const std::size_t limit = limits[in.byte() % 4];
            allocator.set_memory_limit(limit);
            GLAKE_FUZZ_CHECK(allocator.memory_limit() == limit, step);
          }
        } else if constexpr (requires { allocator.reset_peaks(); }) {
          allocator.reset_peaks();
        }
        break;
    }
    if (every_call_armed_for > 0 && --every_call_armed_for == 0) world.faults()->never_fail();

    allocator.verify();
    const statistics s = allocator.stats();
    GLAKE_FUZZ_CHECK(s.active_bytes >= active && s.active_bytes <= active + deferred, step);
    GLAKE_FUZZ_CHECK(s.peak_active_bytes >= s.active_bytes, step);
    GLAKE_FUZZ_CHECK(s.reserved_bytes == world.physical_bytes(), step);
    GLAKE_FUZZ_CHECK(s.peak_reserved_bytes >= s.reserved_bytes, step);
    if (step % 16 == 0) {
      for (const auto& b : live) check_block(b);
    }
  }

  if (fault_plan* plan = world.faults()) plan->never_fail();
  while (!live.empty()) remove(live.size() - 1);
  world.complete(streams[0]);
  world.complete(streams[1]);
  world.complete(streams[2]);
  allocator.verify();
  allocator.release_cached();
  allocator.verify();
  GLAKE_FUZZ_CHECK(allocator.stats().active_bytes == 0, step);
  if constexpr (far_copy_keeping_allocator<Allocator>) GLAKE_FUZZ_CHECK(allocator.far_copy_bytes() == 0, step);
}

template <class Allocator, class World, class... Args>
void run_composition(World& world, byte_reader& in, Args&&... args) {
  {
    Allocator allocator(std::forward<Args>(args)...);
    if constexpr (offloading_allocator<Allocator>) world.attach_far_memory(allocator);
    run_operations(allocator, world, in);
  }
  GLAKE_FUZZ_CHECK(world.clean_after_teardown(), 0);
}

using fi_host_provider = fault_injecting_provider<host_provider>;
using fi_host_reserver = fault_injecting_reserver<host_reserver>;
using fi_sim_provider = fault_injecting_provider<sim_provider>;
using fi_sim_reserver = fault_injecting_reserver<sim_reserver>;
using host_source = vmm_segment_source<fi_host_provider, fi_host_reserver>;
using sim_source = vmm_segment_source<fi_sim_provider, fi_sim_reserver>;

using host_stitching = stitching_allocator<fi_host_provider, fi_host_reserver>;
using sim_stitching = stitching_allocator<fi_sim_provider, fi_sim_reserver>;
using sim_stitching_largest =
    stitching_allocator<fi_sim_provider, fi_sim_reserver, largest_first_stitching, largest_first_eviction>;
using evented_stitching = stitching_allocator<sim_provider, testing::evented_reserver>;
using host_caching = caching_allocator<host_source>;
using sim_caching = caching_allocator<sim_source>;
using sim_segregator = segregator<sim_caching, sim_stitching>;
using host_segregator = segregator<host_caching, host_stitching>;

void run_one(const std::uint8_t* data, std::size_t size) {
  byte_reader in(data, size);
  const std::uint8_t which = in.byte();
  const config cfg = fuzzed_config(in);
  switch (which % 8) {
    case 0: {
      host_world w;
      run_composition<host_stitching>(w, in, fi_host_provider{w.raw_provider, w.plan},
                                      fi_host_reserver{host_reserver{host_granularity}, w.plan}, cfg);
      break;
    }
    case 1: {
      sim_world w;
      run_composition<sim_stitching>(w, in, fi_sim_provider{sim_provider{w.device}, w.plan},
                                     fi_sim_reserver{sim_reserver{w.device}, w.plan}, cfg);
      break;
    }
    case 2: {
      sim_world w;
      run_composition<sim_stitching_largest>(w, in, fi_sim_provider{sim_provider{w.device}, w.plan},
                                             fi_sim_reserver{sim_reserver{w.device}, w.plan}, cfg);
      break;
    }
    case 3: {
      sim_world w;
      w.with_faults = false;  // the fault wrappers do not forward events
      run_composition<evented_stitching>(w, in, sim_provider{w.device},
                                         testing::evented_reserver{w.device, w.events}, cfg);
      break;
    }
    case 4: {
      host_world w;
      run_composition<host_caching>(w, in, host_source{fi_host_provider{w.raw_provider, w.plan},
                                                       fi_host_reserver{host_reserver{host_granularity}, w.plan},
                                                       cfg.memory_limit});
      break;
    }
    case 5: {
      sim_world w;
      run_composition<sim_caching>(w, in, sim_source{fi_sim_provider{sim_provider{w.device}, w.plan},
                                                     fi_sim_reserver{sim_reserver{w.device}, w.plan}});
      break;
    }
    case 6: {
      sim_world w;
      run_composition<sim_segregator>(
          w, in, 1 * MiB,
          std::make_tuple(sim_source{fi_sim_provider{sim_provider{w.device}, w.plan},
                                     fi_sim_reserver{sim_reserver{w.device}, w.plan}}),
          std::make_tuple(fi_sim_provider{sim_provider{w.device}, w.plan},
                          fi_sim_reserver{sim_reserver{w.device}, w.plan}, cfg));
      break;
    }
    case 7: {
      host_world w;
      run_composition<host_segregator>(
          w, in, 1 * MiB,
          std::make_tuple(host_source{fi_host_provider{w.raw_provider, w.plan},
                                      fi_host_reserver{host_reserver{host_granularity}, w.plan}}),
          std::make_tuple(fi_host_provider{w.raw_provider, w.plan},
                          fi_host_reserver{host_reserver{host_granularity}, w.plan}, cfg));
      break;
    }
  }
  ++inputs_executed;
}

void print_counts() {
  std::fprintf(stderr,
               "alloc_ops_fuzzer: %" PRIu64 " allocator operations in %" PRIu64
               " inputs; absurd sizes %s: %" PRIu64 " requested, %" PRIu64 " granted\n",
               operations_executed, inputs_executed, absurd_enabled ? "on" : "off", absurd_requests,
               absurd_granted);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* v = std::getenv("GLAKE_FUZZ_ABSURD")) absurd_enabled = std::strcmp(v, "0") != 0;
  std::atexit(print_counts);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  run_one(data, size);
  return 0;
}
