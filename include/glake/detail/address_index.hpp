// A flat hash map from an allocation's address to its descriptor, so that a free finds its block
// in one or two cache lines instead of a walk down the address tree.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

namespace glake::detail {

/// Open addressing with linear probing over a power-of-two table of (address, T*) slots, at most
/// half full; address 0 marks an empty slot, so 0 is not a valid key. Erase shifts the probe run
/// back instead of leaving tombstones, so lookups never slow down with churn.
///
/// Why not a tree: on an allocator's free path the descriptors are cold (the caller's own work
/// ran since), and every node of a walk is a cache miss. Here a hit reads the slot's line and
/// then the descriptor.
///
/// Complexity: O(1) expected per operation. `reserve(n)` makes the next n inserts unable to
/// throw; `insert` and `erase` of an existing key never allocate otherwise; erase never throws.
/// Thread safety: none; the owner serialises access.
template <class T>
class address_index {
  struct slot {
    std::uintptr_t key = 0;
    T* value = nullptr;
  };

 public:
  address_index() = default;
  address_index(const address_index&) = delete;
  address_index& operator=(const address_index&) = delete;

  /// The value stored for `key`, or null.
  T* find(std::uintptr_t key) const noexcept {
    if (size_ == 0) return nullptr;
    for (std::size_t i = home(key);; i = (i + 1) & mask_) {
      const slot& s = slots_[i];
      if (s.key == key) return s.value;
      if (s.key == 0) return nullptr;
    }
  }

  /// Makes room for `count` more keys without allocating again. May throw std::bad_alloc; then
  /// nothing changed.
  void reserve(std::size_t count) {
    const std::size_t wanted = size_ + count;
    if (wanted * 2 <= capacity_) return;
    rehash(std::bit_ceil(std::max<std::size_t>(wanted * 2, 64)));
  }

  /// Adds `key` (not present, not 0). Allocates only when no room was reserved.
  void insert(std::uintptr_t key, T* value) {
    reserve(1);
    place(key, value);
    ++size_;
  }

  /// Removes `key` if present; true when it was.
  bool erase(std::uintptr_t key) noexcept {
    if (size_ == 0) return false;
    std::size_t i = home(key);
    while (slots_[i].key != key) {
      if (slots_[i].key == 0) return false;
      i = (i + 1) & mask_;
    }
    // Backward-shift deletion: move later members of the run into the hole when their home
    // does not lie (cyclically) between the hole and their slot.
    for (std::size_t j = (i + 1) & mask_;; j = (j + 1) & mask_) {
      if (slots_[j].key == 0) break;
      const std::size_t h = home(slots_[j].key);
      const bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
      if (stays) continue;
      slots_[i] = slots_[j];
      i = j;
    }
    slots_[i] = slot{};
    --size_;
    return true;
  }

  void clear() noexcept {
    for (std::size_t i = 0; i < capacity_; ++i) slots_[i] = slot{};
    size_ = 0;
  }

  std::size_t size() const noexcept { return size_; }

 private:
  std::size_t home(std::uintptr_t key) const noexcept {
    // Addresses are aligned, so their low bits say little: Fibonacci hashing spreads the rest.
    return static_cast<std::size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_);
  }

  void place(std::uintptr_t key, T* value) noexcept {
    std::size_t i = home(key);
    while (slots_[i].key != 0) i = (i + 1) & mask_;
    slots_[i] = slot{key, value};
  }

  void rehash(std::size_t capacity) {
    auto old = std::exchange(slots_, std::make_unique<slot[]>(capacity));  // may throw: first
    const std::size_t old_capacity = std::exchange(capacity_, capacity);
    mask_ = capacity - 1;
    shift_ = 64 - static_cast<unsigned>(std::countr_zero(capacity));
    for (std::size_t i = 0; i < old_capacity; ++i) {
      if (old[i].key != 0) place(old[i].key, old[i].value);
    }
  }

  std::unique_ptr<slot[]> slots_;
  std::size_t capacity_ = 0;
  std::size_t mask_ = 0;
  unsigned shift_ = 64;
  std::size_t size_ = 0;
};

}  // namespace glake::detail
