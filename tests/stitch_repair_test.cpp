// The repair planner (allocators/stitching/stitch_repair.hpp) over segments filled in by hand: which handle
// replaces which, what is appended within the reservation, and the pieces and changes it plans.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <vector>

#include "glake/config.hpp"
#include "glake/allocators/stitching/stitch_cache.hpp"
#include "glake/allocators/stitching/stitch_repair.hpp"
#include "glake/detail/vmm_backend.hpp"

namespace {

using namespace glake;
constexpr std::size_t M = MiB;

struct fake_segment {
  detail::mapped_segment<int> mapping;
};
struct fake_block {
  int id = 0;
};
using piece = detail::stitched_range<fake_segment, fake_block, int>::piece;
using plan_type = detail::stitch_repair_plan<fake_segment, fake_block, int, piece>;
using slot = detail::handle_slot<int>;

// Handles of the given sizes mapped back to back from `base`, numbered from `first_handle`.
void fill(fake_segment& s, std::uintptr_t base, std::initializer_list<std::size_t> sizes, int first_handle) {
  s.mapping.base = base;
  s.mapping.count = sizes.size();
  s.mapping.slots = std::make_unique<slot[]>(sizes.size());
  std::size_t i = 0, offset = 0;
  for (std::size_t size : sizes) {
    s.mapping.slots[i] = slot{first_handle + static_cast<int>(i), offset, size};
    offset += size;
    ++i;
  }
  s.mapping.size = offset;
}

bool same(const piece& p, const fake_segment* home, std::size_t offset, std::size_t size) {
  return p.home == home && p.offset == offset && p.size == size && p.claimed == nullptr;
}

std::vector<int> handles(std::span<const slot> slots) {
  std::vector<int> out;
  for (const slot& s : slots) out.push_back(s.handle);
  return out;
}

}  // namespace

TEST_CASE("stitch repair: a handle taken since the range was cached is replaced by an offered spare of its size") {
  fake_segment s1, s2;
  fill(s1, 0x1000000000, {2 * M, 2 * M, 2 * M, 2 * M}, 10);
  fill(s2, 0x2000000000, {2 * M, 2 * M, 4 * M}, 20);
  fake_block b0{0}, b2{2}, c{3};
  plan_type plan;
  std::vector<piece> pieces;

  // The range maps s1's handles 10, 11, 12; 11 is in use now.
  plan.begin();
  plan.add_current(&s1, s1.mapping.slots[0], &b0, false);
  plan.add_current(&s1, s1.mapping.slots[1], &b0, true);
  plan.add_current(&s1, s1.mapping.slots[2], &b2, false);
  plan.expect(6 * M, 6 * M);
  CHECK(plan.replaced() == 1);
  CHECK(plan.needs_handles());
  CHECK(plan.wanted_bytes() == 2 * M);
  CHECK(plan.short_bytes() == 0);
  CHECK_FALSE(plan.satisfied());
  CHECK(handles(plan.layout()) == std::vector<int>{10, 11, 12});

  // Members are what the caller skips when it offers free handles.
  CHECK(plan.is_member(&s1, 0));
  CHECK(plan.is_member(&s1, 2 * M));
  CHECK(plan.is_member(&s1, 4 * M));
  CHECK_FALSE(plan.is_member(&s1, 6 * M));
  CHECK_FALSE(plan.is_member(&s2, 0));
  CHECK_FALSE(plan.is_member(&s1, 1 * M));

  plan.offer(&s2, s2.mapping.slots[2], &c);  // 4 MiB: no handle of that size is wanted, none short
  CHECK_FALSE(plan.satisfied());
  CHECK(plan.wanted_bytes() == 2 * M);
  plan.offer(&s1, s1.mapping.slots[3], &b2);
  CHECK(plan.satisfied());
  CHECK(plan.wanted_bytes() == 0);

  CHECK(plan.finish(6 * M, pieces) == 6 * M);
  REQUIRE(plan.changes().size() == 1);
  CHECK(plan.changes()[0].index == 1);
  CHECK(plan.changes()[0].slot.handle == 13);
  CHECK(plan.changes()[0].slot.offset == 6 * M);
  CHECK(plan.changes()[0].slot.size == 2 * M);
  CHECK(plan.appended() == 0);
  CHECK(handles(plan.layout()) == std::vector<int>{10, 11, 12});  // the layout is what it maps now
  REQUIRE(pieces.size() == 3);
  CHECK(same(pieces[0], &s1, 0, 2 * M));
  CHECK(same(pieces[1], &s1, 6 * M, 2 * M));
  CHECK(same(pieces[2], &s1, 4 * M, 2 * M));
}

TEST_CASE("stitch repair: the k-th replaced handle of a size gets the k-th spare of that size, so neighbours stay neighbours") {
  fake_segment s1, s2;
  fill(s1, 0x1000000000, {2 * M, 2 * M, 2 * M, 2 * M}, 10);
  fill(s2, 0x2000000000, {2 * M, 2 * M}, 20);
  fake_block b0{0}, b3{3}, c{4};
  plan_type plan;
  std::vector<piece> pieces;

  const auto plan_with_offers = [&](std::initializer_list<std::size_t> order) {
    plan.begin();
    plan.add_current(&s1, s1.mapping.slots[0], &b0, false);
    plan.add_current(&s1, s1.mapping.slots[1], nullptr, true);
    plan.add_current(&s1, s1.mapping.slots[2], nullptr, true);
    plan.add_current(&s1, s1.mapping.slots[3], &b3, false);
    plan.expect(8 * M, 8 * M);
    CHECK(plan.wanted_bytes() == 4 * M);
    for (std::size_t i : order) plan.offer(&s2, s2.mapping.slots[i], &c);
    REQUIRE(plan.satisfied());
    return plan.finish(8 * M, pieces);
  };

  SUBCASE("offered in address order: one piece for both") {
    CHECK(plan_with_offers({0, 1}) == 8 * M);
    REQUIRE(plan.changes().size() == 2);
    CHECK(plan.changes()[0].index == 1);
    CHECK(plan.changes()[0].slot.handle == 20);
    CHECK(plan.changes()[1].index == 2);
    CHECK(plan.changes()[1].slot.handle == 21);
    REQUIRE(pieces.size() == 3);
    CHECK(same(pieces[0], &s1, 0, 2 * M));
    CHECK(same(pieces[1], &s2, 0, 4 * M));
    CHECK(same(pieces[2], &s1, 6 * M, 2 * M));
  }
  SUBCASE("offered in reverse: taken in the order offered, two pieces") {
    CHECK(plan_with_offers({1, 0}) == 8 * M);
    REQUIRE(plan.changes().size() == 2);
    CHECK(plan.changes()[0].slot.handle == 21);
    CHECK(plan.changes()[1].slot.handle == 20);
    REQUIRE(pieces.size() == 4);
    CHECK(same(pieces[1], &s2, 2 * M, 2 * M));
    CHECK(same(pieces[2], &s2, 0, 2 * M));
  }
}

TEST_CASE("stitch repair: handles of several sizes are matched by size, in layout order") {
  fake_segment s3, s4;
  fill(s3, 0x3000000000, {4 * M, 2 * M, 4 * M}, 30);
  fill(s4, 0x4000000000, {2 * M, 4 * M, 4 * M, 4 * M}, 40);
  fake_block d{1};
  plan_type plan;
  std::vector<piece> pieces;
  plan.begin();
  for (std::size_t i = 0; i < 3; ++i) plan.add_current(&s3, s3.mapping.slots[i], nullptr, true);
  plan.expect(10 * M, 10 * M);
  CHECK(plan.replaced() == 3);
  CHECK(plan.wanted_bytes() == 10 * M);
  plan.offer(&s4, s4.mapping.slots[0], &d);  // 2 MiB
  CHECK(plan.wanted_bytes() == 8 * M);
  plan.offer(&s4, s4.mapping.slots[1], &d);  // 4 MiB
  plan.offer(&s4, s4.mapping.slots[2], &d);  // 4 MiB
  CHECK(plan.satisfied());
  plan.offer(&s4, s4.mapping.slots[3], &d);  // more than wanted: ignored
  CHECK(plan.satisfied());

  CHECK(plan.finish(10 * M, pieces) == 10 * M);
  REQUIRE(plan.changes().size() == 3);
  CHECK(plan.changes()[0].index == 0);
  CHECK(plan.changes()[0].slot.handle == 41);
  CHECK(plan.changes()[1].index == 1);
  CHECK(plan.changes()[1].slot.handle == 40);
  CHECK(plan.changes()[2].index == 2);
  CHECK(plan.changes()[2].slot.handle == 42);
  for (std::size_t i = 0; i < 3; ++i) CHECK(plan.changes()[i].slot.size == plan.layout()[i].size);
  REQUIRE(pieces.size() == 3);
  CHECK(same(pieces[0], &s4, 2 * M, 4 * M));
  CHECK(same(pieces[1], &s4, 0, 2 * M));
  CHECK(same(pieces[2], &s4, 6 * M, 4 * M));
}

TEST_CASE("stitch repair: a spare next to a kept handle of the same free block joins its piece") {
  fake_segment s1;
  fill(s1, 0x1000000000, {2 * M, 2 * M, 2 * M}, 10);
  fake_block b{0};
  plan_type plan;
  std::vector<piece> pieces;
  // The range maps handles 10 and 12; 12 is in use, and 11, free beside 10, replaces it.
  plan.begin();
  plan.add_current(&s1, s1.mapping.slots[0], &b, false);
  plan.add_current(&s1, s1.mapping.slots[2], nullptr, true);
  plan.expect(4 * M, 4 * M);
  CHECK_FALSE(plan.is_member(&s1, 2 * M));
  plan.offer(&s1, s1.mapping.slots[1], &b);
  REQUIRE(plan.satisfied());
  CHECK(plan.finish(4 * M, pieces) == 4 * M);
  REQUIRE(pieces.size() == 1);
  CHECK(same(pieces[0], &s1, 0, 4 * M));
  REQUIRE(plan.changes().size() == 1);
  CHECK(plan.changes()[0].slot.handle == 11);
}

TEST_CASE("stitch repair: a range short of the request appends free handles, only within its reservation") {
  fake_segment s1, s5;
  fill(s1, 0x1000000000, {2 * M}, 10);
  fill(s5, 0x5000000000, {8 * M, 2 * M, 4 * M, 2 * M}, 50);
  fake_block b0{0}, e{5};
  plan_type plan;
  std::vector<piece> pieces;

  plan.begin();
  plan.add_current(&s1, s1.mapping.slots[0], &b0, false);
  plan.expect(6 * M, 6 * M);
  CHECK(plan.replaced() == 0);
  CHECK(plan.needs_handles());
  CHECK(plan.short_bytes() == 4 * M);
  CHECK(plan.wanted_bytes() == 0);

  plan.offer(&s5, s5.mapping.slots[0], &e);  // 8 MiB: past the reservation
  CHECK(plan.short_bytes() == 4 * M);
  plan.offer(&s5, s5.mapping.slots[1], &e);
  CHECK(plan.short_bytes() == 2 * M);
  plan.offer(&s5, s5.mapping.slots[2], &e);  // 4 MiB: 2 + 2 + 4 > 6
  CHECK(plan.short_bytes() == 2 * M);
  CHECK_FALSE(plan.satisfied());
  plan.offer(&s5, s5.mapping.slots[3], &e);
  CHECK(plan.satisfied());

  CHECK(plan.finish(6 * M, pieces) == 6 * M);
  CHECK(plan.appended() == 2);
  REQUIRE(plan.changes().size() == 2);
  CHECK(plan.changes()[0].index == 1);  // after the layout, one after another
  CHECK(plan.changes()[0].slot.handle == 51);
  CHECK(plan.changes()[0].slot.offset == 8 * M);
  CHECK(plan.changes()[1].index == 2);
  CHECK(plan.changes()[1].slot.handle == 53);
  REQUIRE(pieces.size() == 3);
  CHECK(same(pieces[0], &s1, 0, 2 * M));
  CHECK(same(pieces[1], &s5, 8 * M, 2 * M));
  CHECK(same(pieces[2], &s5, 14 * M, 2 * M));

  SUBCASE("the last handle appended may overshoot the request, within the reservation") {
    plan.begin();
    plan.add_current(&s1, s1.mapping.slots[0], &b0, false);
    plan.expect(4 * M, 10 * M);
    plan.offer(&s5, s5.mapping.slots[2], &e);
    CHECK(plan.satisfied());
    CHECK(plan.finish(4 * M, pieces) == 6 * M);
    REQUIRE(pieces.size() == 2);
    CHECK(same(pieces[1], &s5, 10 * M, 4 * M));
  }
}

TEST_CASE("stitch repair: pieces join neighbouring handles of one home and one block, split where the claimed prefix ends") {
  fake_segment s1;
  fill(s1, 0x1000000000, {2 * M, 2 * M, 2 * M, 2 * M}, 10);
  fake_block b{0}, other{1};
  plan_type plan;
  std::vector<piece> pieces;

  SUBCASE("one block: one piece up to the prefix's end, one after it") {
    plan.begin();
    for (std::size_t i = 0; i < 4; ++i) plan.add_current(&s1, s1.mapping.slots[i], &b, false);
    plan.expect(4 * M, 8 * M);
    CHECK_FALSE(plan.needs_handles());
    CHECK(plan.satisfied());
    CHECK(plan.finish(4 * M, pieces) == 8 * M);
    CHECK(plan.changes().empty());
    REQUIRE(pieces.size() == 2);
    CHECK(same(pieces[0], &s1, 0, 4 * M));
    CHECK(same(pieces[1], &s1, 4 * M, 4 * M));

    CHECK(plan.finish(8 * M, pieces) == 8 * M);  // the whole range claimed: one piece
    REQUIRE(pieces.size() == 1);
    CHECK(same(pieces[0], &s1, 0, 8 * M));
  }
  SUBCASE("neighbours in different free blocks are different pieces") {
    plan.begin();
    plan.add_current(&s1, s1.mapping.slots[0], &b, false);
    plan.add_current(&s1, s1.mapping.slots[1], &other, false);
    plan.expect(4 * M, 4 * M);
    CHECK(plan.finish(4 * M, pieces) == 4 * M);
    REQUIRE(pieces.size() == 2);
    CHECK(same(pieces[0], &s1, 0, 2 * M));
    CHECK(same(pieces[1], &s1, 2 * M, 2 * M));
  }
  SUBCASE("handles out of address order are different pieces") {
    plan.begin();
    plan.add_current(&s1, s1.mapping.slots[1], &b, false);
    plan.add_current(&s1, s1.mapping.slots[0], &b, false);
    plan.expect(4 * M, 4 * M);
    CHECK(plan.finish(4 * M, pieces) == 4 * M);
    CHECK(pieces.size() == 2);
  }
}

TEST_CASE("stitch repair: begin forgets the previous plan") {
  fake_segment s1, s2;
  fill(s1, 0x1000000000, {2 * M, 2 * M}, 10);
  fill(s2, 0x2000000000, {2 * M, 2 * M}, 20);
  fake_block b{0}, c{1};
  plan_type plan;
  std::vector<piece> pieces;
  plan.begin();
  plan.add_current(&s1, s1.mapping.slots[0], nullptr, true);
  plan.expect(2 * M, 4 * M);
  plan.offer(&s2, s2.mapping.slots[0], &c);
  REQUIRE(plan.satisfied());
  plan.finish(2 * M, pieces);
  REQUIRE(plan.changes().size() == 1);

  plan.begin();
  plan.add_current(&s2, s2.mapping.slots[1], &b, false);
  plan.expect(2 * M, 2 * M);
  CHECK(plan.replaced() == 0);
  CHECK_FALSE(plan.needs_handles());
  CHECK_FALSE(plan.is_member(&s1, 0));
  CHECK(plan.is_member(&s2, 2 * M));
  CHECK(plan.finish(2 * M, pieces) == 2 * M);
  CHECK(plan.changes().empty());
  CHECK(handles(plan.layout()) == std::vector<int>{21});
  REQUIRE(pieces.size() == 1);
  CHECK(same(pieces[0], &s2, 2 * M, 2 * M));
}
