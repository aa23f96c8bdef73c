// A free list of fixed-size nodes, so that bookkeeping on the hot path never touches the heap.
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <new>
#include <utility>
#include <vector>

namespace glake::detail {

/// Hands out storage for objects of type T from slabs it owns and takes it back into a free
/// list. Once `reserve` has run (or the pool has warmed up), `create` and `destroy` are O(1) and
/// allocate nothing. `reserve(n)` is the way to make a later sequence of `create` calls
/// non-throwing, which the allocators use to keep their strong exception guarantee.
/// Not thread-safe: its owner serialises access. Objects still alive at destruction are not
/// destroyed (the owner destroys them first).
template <class T>
class node_pool {
  union slot {
    slot* next;
    alignas(T) unsigned char storage[sizeof(T)];
  };

 public:
  node_pool() = default;
  node_pool(const node_pool&) = delete;
  node_pool& operator=(const node_pool&) = delete;

  /// Makes sure at least `count` more nodes can be created without allocating.
  void reserve(std::size_t count) {
    while (free_count_ < count) grow(std::max<std::size_t>(count - free_count_, next_slab_));
  }

  template <class... Args>
  T* create(Args&&... args) {
    if (free_ == nullptr) grow(next_slab_);
    slot* s = free_;
    free_ = s->next;  // read before the object's constructor overwrites the link
    --free_count_;
    try {
      return ::new (static_cast<void*>(s->storage)) T(std::forward<Args>(args)...);
    } catch (...) {
      s->next = free_;
      free_ = s;
      ++free_count_;
      throw;
    }
  }

  void destroy(T* object) noexcept {
    object->~T();
    slot* s = reinterpret_cast<slot*>(object);
    s->next = free_;
    free_ = s;
    ++free_count_;
  }

  std::size_t free_count() const noexcept { return free_count_; }

 private:
  void grow(std::size_t count) {
    slabs_.reserve(slabs_.size() + 1);  // the only step that can throw after the slab exists
    auto slab = std::make_unique<slot[]>(count);
    for (std::size_t i = 0; i < count; ++i) {
      slab[i].next = free_;
      free_ = &slab[i];
    }
    free_count_ += count;
    slabs_.push_back(std::move(slab));
    if (next_slab_ < 4096) next_slab_ *= 2;
  }

  std::vector<std::unique_ptr<slot[]>> slabs_;
  slot* free_ = nullptr;
  std::size_t free_count_ = 0;
  std::size_t next_slab_ = 64;
};

}  // namespace glake::detail
