// The growth check shared by the thrust adaptor's tests on the host (tests/thrust_allocator_test.cpp,
// thrust's CPP system) and on the GPU (tests/gpu/thrust_test.cu): a vector pushed one element at a
// time, then resized in steps of half its size up to `target` elements, with every byte of it
// accounted by the glake allocator after each step.
#pragma once

#include <doctest/doctest.h>
#include <thrust/sequence.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace glake::testing {

/// Grows `v` (empty, of std::uint32_t, its memory from `allocator`) to `target` elements filled
/// with 0, 1, 2, ...; returns how many times its capacity changed.
template <class Vector, class Allocator>
int grow_checked(Vector& v, const Allocator& allocator, std::size_t target) {
  for (std::uint32_t i = 0; i < 1000; ++i) v.push_back(i);  // one element at a time
  CHECK(allocator.stats().active_bytes == v.capacity() * sizeof(std::uint32_t));
  int reallocations = 0;
  while (v.size() < target) {  // then in steps of half the size
    const std::size_t old_size = v.size();
    const std::size_t old_capacity = v.capacity();
    v.resize(std::min(target, old_size + old_size / 2 + 1));
    thrust::sequence(v.begin() + static_cast<std::ptrdiff_t>(old_size), v.end(), static_cast<std::uint32_t>(old_size));
    CAPTURE(v.size());
    CHECK(allocator.stats().active_bytes == v.capacity() * sizeof(std::uint32_t));
    CHECK(allocator.stats().allocations - allocator.stats().deallocations == 1);  // one live block
    reallocations += v.capacity() != old_capacity;
  }
  return reallocations;
}

}  // namespace glake::testing
