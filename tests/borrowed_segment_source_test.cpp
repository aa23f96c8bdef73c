// borrowed_segment_source (allocators/borrowed_segment_source.hpp): the segment_lender concept,
// and a source that forwards every segment to a lender and gives it back there.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <utility>
#include <vector>

#include "glake/allocators/borrowed_segment_source.hpp"
#include "glake/allocators/segment_source.hpp"
#include "glake/config.hpp"

namespace {

using namespace glake;
constexpr std::size_t M = MiB;
const stream_ref A{1}, B{2};

struct lender_log {
  std::vector<std::pair<std::size_t, stream_ref>> lent;
  std::vector<std::uintptr_t> taken_back;
  std::uintptr_t next = 0x100000000;
  bool full = false;
  bool fail = false;
};

// Lends consecutive ranges, or nothing when full, or throws as a driver would.
struct fake_lender {
  lender_log* log;
  std::size_t lending_granularity() const noexcept { return 2 * M; }
  bool lend(std::size_t bytes, stream_ref stream, std::uintptr_t& base) {
    if (log->fail) throw std::runtime_error("driver failure");
    if (log->full) return false;
    log->lent.emplace_back(bytes, stream);
    base = log->next;
    log->next += bytes;
    return true;
  }
  void take_back(std::uintptr_t base) noexcept { log->taken_back.push_back(base); }
};

// Not lenders: one that cannot be copied; one whose take_back may throw; one whose granularity may.
struct move_only_lender : fake_lender {
  std::unique_ptr<int> state;
};
struct throwing_take_back {
  std::size_t lending_granularity() const noexcept { return 1; }
  bool lend(std::size_t, stream_ref, std::uintptr_t&) { return false; }
  void take_back(std::uintptr_t) {}
};
struct throwing_granularity {
  std::size_t lending_granularity() const { return 1; }
  bool lend(std::size_t, stream_ref, std::uintptr_t&) { return false; }
  void take_back(std::uintptr_t) noexcept {}
};

static_assert(segment_lender<fake_lender>);
static_assert(!segment_lender<move_only_lender>);
static_assert(!segment_lender<throwing_take_back>);
static_assert(!segment_lender<throwing_granularity>);
static_assert(segment_source<borrowed_segment_source<fake_lender>>);
static_assert(!extensible_segment_source<borrowed_segment_source<fake_lender>>);

}  // namespace

TEST_CASE("borrowed segment source: each segment is lent by the lender for its stream, and given back to it") {
  lender_log log;
  borrowed_segment_source<fake_lender> source(fake_lender{&log});
  CHECK(source.granularity() == 2 * M);

  borrowed_segment_source<fake_lender>::lease_type first, second;
  REQUIRE(source.try_acquire(4 * M, A, first));
  CHECK(first.base == 0x100000000);
  CHECK(first.size == 4 * M);
  REQUIRE(source.try_acquire(2 * M, B, second));
  CHECK(second.base == 0x100000000 + 4 * M);
  CHECK(second.size == 2 * M);
  REQUIRE(log.lent.size() == 2);
  CHECK(log.lent[0] == std::pair<std::size_t, stream_ref>{4 * M, A});
  CHECK(log.lent[1] == std::pair<std::size_t, stream_ref>{2 * M, B});
  CHECK(log.taken_back.empty());

  source.release(second);
  source.release(first);
  CHECK(log.taken_back == std::vector<std::uintptr_t>{0x100000000 + 4 * M, 0x100000000});
}

TEST_CASE("borrowed segment source: a lender out of memory is false with the lease untouched, its errors propagate") {
  lender_log log;
  borrowed_segment_source<fake_lender> source(fake_lender{&log});
  borrowed_segment_source<fake_lender>::lease_type lease;
  lease.base = 0x1234;
  lease.size = 77;
  log.full = true;
  CHECK_FALSE(source.try_acquire(4 * M, A, lease));
  CHECK(lease.base == 0x1234);
  CHECK(lease.size == 77);
  log.full = false;
  log.fail = true;
  CHECK_THROWS_AS(source.try_acquire(4 * M, A, lease), std::runtime_error);
  CHECK(lease.base == 0x1234);
  CHECK(log.lent.empty());
  CHECK(log.taken_back.empty());
}
