// A std::pmr::memory_resource over any glake allocator, for code written against pmr.
#pragma once

#include <cstddef>
#include <memory_resource>
#include <string>

#include "glake/allocators/concepts.hpp"
#include "glake/errors.hpp"
#include "glake/stream.hpp"

namespace glake {

/// What pmr_resource needs of an allocator: any glake allocator (it uses allocate, deallocate
/// and alignment, and no optional capability).
template <class A>
concept pmr_adaptable = allocator<A>;

/// Adapts an allocator the caller owns (by reference) to std::pmr::memory_resource, on one
/// stream fixed at construction. Zero-byte requests get a distinct one-byte allocation, as pmr
/// expects a usable pointer. Alignments above the allocator's guarantee are refused with
/// usage_error rather than served misaligned. Equality is identity. Thread safety and errors are
/// the allocator's (out_of_memory is a std::bad_alloc, as pmr requires).
template <pmr_adaptable Allocator>
class pmr_resource final : public std::pmr::memory_resource {
 public:
  explicit pmr_resource(Allocator& allocator, stream_ref stream = default_stream) noexcept
      : allocator_(&allocator), stream_(stream) {}

  Allocator& allocator() const noexcept { return *allocator_; }
  stream_ref stream() const noexcept { return stream_; }

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    if (alignment > allocator_->alignment()) {
      throw usage_error(usage_error::kind::unsupported,
                        "glake::pmr_resource: alignment " + std::to_string(alignment) +
                            " exceeds the allocator's guaranteed " +
                            std::to_string(allocator_->alignment()));
    }
    return allocator_->allocate(bytes == 0 ? 1 : bytes, stream_);
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t) override {
    allocator_->deallocate(p, bytes == 0 ? 1 : bytes, stream_);
  }
  bool do_is_equal(const std::pmr::memory_resource& other) const noexcept override {
    return this == &other;
  }

  Allocator* allocator_;
  stream_ref stream_;
};

}  // namespace glake
