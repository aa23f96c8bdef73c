// A provider and reserver pair used together: segments of chunks and stitched mappings made and
// unmade with full rollback, every call counted and timed, physical bytes held against a limit.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#include "glake/backends/concepts.hpp"
#include "glake/detail/accounting.hpp"
#include "glake/detail/driver_meter.hpp"
#include "glake/statistics.hpp"

namespace glake::detail {

/// One physical handle of a segment: where it is mapped in the segment, and its size. `far`: the
/// handle is not the provider's but far memory's (an offloaded allocation's), which its owner
/// releases; the segment's own accounting leaves it out.
template <class Handle>
struct handle_slot {
  Handle handle{};
  std::size_t offset = 0;
  std::size_t size = 0;
  bool far = false;
};

/// A reservation with physical handles mapped back to back, in offset order. Handles may differ
/// in size (each a multiple of the granularity).
template <class Handle>
struct mapped_segment {
  std::uintptr_t base = 0;
  std::size_t size = 0;
  std::size_t count = 0;
  std::unique_ptr<handle_slot<Handle>[]> slots;
  std::size_t reserved = 0;  ///< address space at base (at least size): room to grow in place
  std::size_t capacity = 0;  ///< slots allocated (at least count): a growing segment's slots grow
                             ///< geometrically, not by a copy per growth

  /// Bytes of address space past the mapped handles.
  std::size_t room() const noexcept { return reserved > size ? reserved - size : 0; }

  std::size_t chunks() const noexcept { return count; }
  /// The index of the first handle that starts at or after `offset`. O(log count), without a
  /// data-dependent branch (the halving step compiles to a conditional move): the stitching
  /// allocator searches its segments' handles on most slow-path requests.
  std::size_t first_at_or_after(std::size_t offset) const noexcept {
    if (count == 0) return 0;
    const handle_slot<Handle>* first = slots.get();
    for (std::size_t n = count; n > 1;) {
      const std::size_t half = n / 2;
      first = first[half].offset < offset ? first + half : first;
      n -= half;
    }
    return static_cast<std::size_t>(first - slots.get()) + (first->offset < offset ? 1 : 0);
  }
  /// The index of the handle that starts at `offset` (one must): `hint` when it names that
  /// handle, O(1); else found by first_at_or_after and stored in `hint` for the next call.
  std::size_t index_of(std::size_t offset, std::size_t& hint) const noexcept {
    if (hint >= count || slots[hint].offset != offset) hint = first_at_or_after(offset);
    return hint;
  }
};

/// No request above this can ever be mapped: no machine gives a process more address space
/// (x86-64's five-level paging: 2^57 bytes; CUDA's unified space is smaller). The bound that
/// stands in for a backend that reports no capacity, so that any size fails in O(1).
inline constexpr std::size_t address_space_ceiling = (~std::size_t{0} >> 7) + 1;

/// A handle of a stitched range to replace, or to append: the one at `index` of its layout
/// (an index past the layout's end appends), by `slot`'s.
template <class Handle>
struct handle_replacement {
  std::size_t index = 0;
  handle_slot<Handle> slot{};
};

/// Owns a provider and a reserver and performs the multi-call sequences the allocators need,
/// each one all-or-nothing: if any call fails, everything done so far is undone and the backend
/// is as before. Out-of-memory answers false (or null); other failures propagate as exceptions
/// after the rollback. Not thread-safe; its owner serialises access.
template <physical_provider Provider, address_reserver_for<Provider> Reserver>
class vmm_backend {
 public:
  using handle_type = typename Provider::handle_type;
  using segment_type = mapped_segment<handle_type>;

  vmm_backend(Provider provider, Reserver reserver, std::size_t memory_limit = 0)
      : provider_(std::move(provider)), reserver_(std::move(reserver)), limit_(memory_limit) {}
  // Moved, the spares go along; the moved-from backend holds none.
  vmm_backend(vmm_backend&& other) noexcept(std::is_nothrow_move_constructible_v<Provider> &&
                                            std::is_nothrow_move_constructible_v<Reserver>)
      : provider_(std::move(other.provider_)),
        reserver_(std::move(other.reserver_)),
        limit_(other.limit_),
        physical_bytes_(other.physical_bytes_),
        meter_(other.meter_),
        spares_(std::exchange(other.spares_, {})),
        spare_bytes_(std::exchange(other.spare_bytes_, 0)),
        spare_limit_(other.spare_limit_),
        recycled_(other.recycled_),
        spare_counters_(other.spare_counters_) {}
  vmm_backend& operator=(vmm_backend&&) = delete;
  ~vmm_backend() { release_spares(); }

  std::size_t granularity() const noexcept {
    return std::max(provider_.granularity(), reserver_.granularity());
  }
  std::size_t physical_bytes() const noexcept { return physical_bytes_; }
  std::size_t memory_limit() const noexcept { return limit_; }
  /// From now on at most `bytes` physical bytes (0: no limit). What is held already stays, even
  /// above the new limit; may_add refuses until enough is given back.
  void set_memory_limit(std::size_t bytes) noexcept { limit_ = bytes; }
  /// The most physical bytes this backend can ever hold: the memory limit or the provider's
  /// capacity (capacity_reporting_provider), whichever is smaller, and never above
  /// address_space_ceiling. A request above it can never be served.
  std::size_t capacity() const noexcept { return capacity_within(provider_, limit_, address_space_ceiling); }
  /// False when `bytes` more physical bytes certainly cannot be had: above the memory limit
  /// less what is held (spare handles not counted: they go first), or above capacity(). O(1),
  /// so callers ask before any work proportional to `bytes`; true does not promise that the
  /// provider has the memory.
  bool may_add(std::size_t bytes) const noexcept { return fits(bytes, physical_bytes_ - spare_bytes_); }

  // --- spare handles: what moves give back, kept for the next moves ---

  /// From now on, handles given back by release_handle are kept, up to `bytes` in all (0: none),
  /// for the next try_create_handle of their size: a move out and a move back of the same
  /// handle sizes then cost no cuMemRelease and no cuMemCreate. Spares stay in physical_bytes
  /// and, with `counters`, in its reserved_bytes; a request the limit or the provider refuses
  /// releases them all and is tried once more, so they never cause an out-of-memory of this
  /// backend. Spares above a smaller new bound are released now.
  void keep_spares(std::size_t bytes, usage_counters* counters) {
    spare_counters_ = counters;
    spare_limit_ = bytes;
    const std::size_t g = std::max<std::size_t>(granularity(), 1);
    spares_.reserve(std::min<std::size_t>(bytes / g, 4096));  // release_handle never allocates
    while (spare_bytes_ > spare_limit_) release_spare(spares_.size() - 1);
  }
  std::size_t spare_limit() const noexcept { return spare_limit_; }
  /// Physical bytes held as spare handles.
  std::size_t spare_bytes() const noexcept { return spare_bytes_; }
  /// Handles try_create_handle took from the spares instead of creating them.
  std::uint64_t recycled_handles() const noexcept { return recycled_; }
  /// Releases every spare handle; returns their bytes.
  std::size_t release_spares() noexcept {
    const std::size_t bytes = spare_bytes_;
    while (!spares_.empty()) release_spare(spares_.size() - 1);
    return bytes;
  }
  const driver_call_counts& calls() const noexcept { return meter_.counts(); }
  const driver_call_times& call_times() const noexcept { return meter_.times(); }
  Provider& provider() noexcept { return provider_; }
  Reserver& reserver() noexcept { return reserver_; }

  /// Creates one handle per entry of `sizes` (each a granularity multiple), reserves one range of
  /// their sum and maps them in order. False when the limit or the backend ran out of memory;
  /// `out` is then untouched.
  /// With `reserve` above their sum, the range reserves that much address space, so that
  /// try_extend_segment can map more handles after them.
  bool try_create_segment(std::span<const std::size_t> sizes, segment_type& out, std::size_t reserve = 0) {
    if (create_segment(sizes, out, reserve)) return true;
    if (spares_.empty()) return false;
    release_spares();
    return create_segment(sizes, out, reserve);
  }

  /// Creates one handle per entry of `sizes` and maps them after `segment`'s handles, inside its
  /// reservation (one access grant over them). False when the limit, the backend or the
  /// segment's room ran out, with nothing changed. The segment's slots move to a larger array:
  /// pointers to them are invalidated.
  bool try_extend_segment(segment_type& segment, std::span<const std::size_t> sizes) {
    if (extend_segment(segment, sizes)) return true;
    if (spares_.empty()) return false;
    release_spares();
    return extend_segment(segment, sizes);
  }

 private:
  bool extend_segment(segment_type& segment, std::span<const std::size_t> sizes) {
    std::size_t bytes = 0;
    for (std::size_t size : sizes) {
      if (size > ~std::size_t{0} - bytes) return false;
      bytes += size;
    }
    if (bytes == 0 || bytes > segment.room() || !fits(bytes, physical_bytes_)) return false;
    const std::size_t first = segment.count, count = first + sizes.size();
    std::unique_ptr<handle_slot<handle_type>[]> grown;
    if (count > std::max(segment.capacity, first)) {
      const std::size_t capacity = std::max(count, 2 * first);
      grown = std::make_unique<handle_slot<handle_type>[]>(capacity);
      std::copy(segment.slots.get(), segment.slots.get() + first, grown.get());
    }
    handle_slot<handle_type>* slots = grown ? grown.get() : segment.slots.get();
    for (std::size_t i = first, offset = segment.size; i < count; offset += sizes[i - first], ++i) {
      slots[i].offset = offset;
      slots[i].size = sizes[i - first];
    }
    const auto at = [&](std::size_t i) { return reinterpret_cast<char*>(segment.base) + slots[i].offset; };
    std::size_t created = first, mapped = first;
    auto undo = [&]() noexcept {
      for (std::size_t i = mapped; i-- > first;) unmap(at(i), slots[i].size);
      for (std::size_t i = created; i-- > first;) release(slots[i].handle);
    };
    const driver_meter::sequence calls(meter_);
    try {
      for (; created < count; ++created) {
        auto h = meter_(driver_call::create, [&] { return provider_.try_create(slots[created].size); });
        if (!h) return undo(), false;
        slots[created].handle = *h;
      }
      for (; mapped < count; ++mapped) {
        if (!map(at(mapped), slots[mapped])) return undo(), false;
      }
      if (!set_access(at(first), bytes)) return undo(), false;
    } catch (...) {
      undo();
      throw;
    }
    physical_bytes_ += bytes;
    segment.size += bytes;
    segment.count = count;
    if (grown) {
      segment.capacity = std::max(count, 2 * first);
      segment.slots = std::move(grown);
    }
    return true;
  }

  bool create_segment(std::span<const std::size_t> sizes, segment_type& out, std::size_t reserve) {
    std::size_t bytes = 0;
    for (std::size_t size : sizes) {
      if (size > ~std::size_t{0} - bytes) return false;  // no backend holds that much
      bytes += size;
    }
    if (!fits(bytes, physical_bytes_)) return false;
    const std::size_t count = sizes.size();
    auto slots = std::make_unique<handle_slot<handle_type>[]>(count);
    for (std::size_t i = 0, offset = 0; i < count; offset += sizes[i], ++i) {
      slots[i].offset = offset;
      slots[i].size = sizes[i];
    }
    std::size_t created = 0;
    void* base = nullptr;
    std::size_t mapped = 0;
    const std::size_t reserved = std::max(bytes, reserve);
    auto undo = [&]() noexcept {
      for (std::size_t i = mapped; i-- > 0;) unmap(static_cast<char*>(base) + slots[i].offset, slots[i].size);
      if (base != nullptr) free_range(base, reserved);
      for (std::size_t i = created; i-- > 0;) release(slots[i].handle);
    };
    const driver_meter::sequence calls(meter_);
    try {
      for (; created < count; ++created) {
        auto h = meter_(driver_call::create, [&] { return provider_.try_create(slots[created].size); });
        if (!h) return undo(), false;
        slots[created].handle = *h;
      }
      base = meter_(driver_call::reserve, [&] { return reserver_.try_reserve(reserved); });
      if (base == nullptr) return undo(), false;
      for (; mapped < count; ++mapped) {
        if (!map(static_cast<char*>(base) + slots[mapped].offset, slots[mapped])) return undo(), false;
      }
      if (!set_access(base, bytes)) return undo(), false;
    } catch (...) {
      undo();
      throw;
    }
    physical_bytes_ += bytes;
    out.base = reinterpret_cast<std::uintptr_t>(base);
    out.size = bytes;
    out.count = count;
    out.slots = std::move(slots);
    out.reserved = reserved;
    out.capacity = count;
    return true;
  }

 public:
  /// Who releases far slots' handles when their segment goes (the allocator that moved them).
  using far_releaser = void (*)(void* context, handle_type handle) noexcept;

  /// Unmaps, frees and releases everything of a segment made by try_create_segment. A far slot's
  /// handle goes to `release_far(context, handle)` (not the provider's, not counted in
  /// physical_bytes).
  /// With `free_address` false its address range stays reserved (another segment shares it; the
  /// owner frees it with free_reserved_range).
  void destroy_segment(segment_type& segment, far_releaser release_far = nullptr, void* context = nullptr,
                       bool free_address = true) noexcept {
    void* base = reinterpret_cast<void*>(segment.base);
    for (std::size_t i = 0; i < segment.count; ++i) {
      unmap(static_cast<char*>(base) + segment.slots[i].offset, segment.slots[i].size);
    }
    if (free_address) free_range(base, std::max(segment.size, segment.reserved));
    std::size_t own = 0;
    for (std::size_t i = 0; i < segment.count; ++i) {
      if (segment.slots[i].far) {
        if (release_far != nullptr) release_far(context, segment.slots[i].handle);
        continue;
      }
      release(segment.slots[i].handle);
      own += segment.slots[i].size;
    }
    physical_bytes_ -= own;
    segment = segment_type{};
  }

  // --- single handles, for moving an allocation's memory (each call metered) ---

  /// A handle of the provider's, counted in physical_bytes: a spare of that size if one is kept
  /// (keep_spares), else a new one; empty when the limit or the provider is out of memory.
  std::optional<handle_type> try_create_handle(std::size_t bytes) {
    for (std::size_t i = spares_.size(); i-- > 0;) {
      if (spares_[i].size != bytes) continue;
      const handle_type h = spares_[i].handle;
      spares_[i] = spares_.back();
      spares_.pop_back();
      unspare(bytes);
      ++recycled_;
      return h;
    }
    if (auto h = create_handle(bytes)) return h;
    if (spares_.empty()) return std::nullopt;
    release_spares();
    return create_handle(bytes);
  }
  /// Gives back a handle of try_create_handle (or of a segment's slot, which then is the
  /// caller's to forget): kept as a spare while the spares' bound and the memory limit allow.
  /// `counted`: the keep_spares counters count the handle as reserved until the caller takes it
  /// out (a segment's slot moving out), so it is not a new peak; otherwise (a handle made for a
  /// move that did not happen) it joins reserved_bytes now, peak included.
  void release_handle(handle_type& handle, std::size_t bytes, bool counted = false) noexcept {
    const bool keep = bytes <= spare_limit_ - spare_bytes_ && spares_.size() < spares_.capacity() &&
                      (limit_ == 0 || physical_bytes_ <= limit_);
    if (keep) {
      spares_.push_back(spare{handle, bytes});  // within the capacity reserved
      spare_bytes_ += bytes;
      if (spare_counters_ != nullptr) {
        if (counted) {
          spare_counters_->s.reserved_bytes += bytes;  // the caller's move out takes it away again
        } else {
          spare_counters_->on_extend(bytes);
        }
      }
      return;
    }
    release(handle);
    physical_bytes_ -= bytes;
  }
  void* try_reserve_range(std::size_t bytes) {
    return meter_(driver_call::reserve, [&] { return reserver_.try_reserve(bytes); });
  }
  void free_reserved_range(void* base, std::size_t bytes) noexcept { free_range(base, bytes); }
  /// Maps `handle` (`bytes`, of this provider's or of far memory: the reserver maps both) at
  /// `at` and grants access; false when out of mapping resources, with nothing left mapped.
  bool try_map_handle(void* at, std::size_t bytes, handle_type handle) {
    if (!map(at, handle_slot<handle_type>{handle, 0, bytes, false})) return false;
    try {
      if (set_access(at, bytes)) return true;
    } catch (...) {
      unmap(at, bytes);
      throw;
    }
    unmap(at, bytes);
    return false;
  }
  void unmap_handle(void* at, std::size_t bytes) noexcept { unmap(at, bytes); }

  /// Reserves a fresh range of at least `reserve` bytes and maps the given handles side by side
  /// at its start: a stitched range. Addresses past the handles stay reserved, unmapped, so that
  /// try_restitch can append handles later. Null when out of address space or mapping
  /// resources; nothing is left behind. The range is freed with free_stitched(base, reserved)
  /// where reserved = max(reserve, sum of the handles' sizes).
  void* try_map_stitched(std::span<const handle_slot<handle_type>> handles, std::size_t reserve = 0) {
    std::size_t bytes = 0;
    for (const auto& h : handles) bytes += h.size;
    const std::size_t reserved = std::max(bytes, reserve);
    const driver_meter::sequence calls(meter_);
    void* base = meter_(driver_call::reserve, [&] { return reserver_.try_reserve(reserved); });
    if (base == nullptr) return nullptr;
    std::size_t mapped = 0, offset = 0;
    auto undo = [&]() noexcept {
      std::size_t at = 0;
      for (std::size_t i = 0; i < mapped; ++i) {
        unmap(static_cast<char*>(base) + at, handles[i].size);
        at += handles[i].size;
      }
      free_range(base, reserved);
    };
    try {
      for (; mapped < handles.size(); ++mapped) {
        if (!map(static_cast<char*>(base) + offset, handles[mapped])) return undo(), nullptr;
        offset += handles[mapped].size;
      }
      if (!set_access(base, bytes)) return undo(), nullptr;
    } catch (...) {
      undo();
      throw;
    }
    return base;
  }

  using replacement = handle_replacement<handle_type>;

  /// Replaces handles of a stitched range in place, and appends handles after it within its
  /// reservation. `layout` is what the range at `base` maps now, side by side, and `reserved`
  /// the bytes reserved at `base`. Changes come in increasing `index`: one inside the layout
  /// (the same size as the handle it replaces) unmaps that handle and maps the new one in its
  /// place; those at layout.size(), layout.size() + 1, ... map new handles after the layout,
  /// which must fit in `reserved`. Then access is granted over the new ones, one call per run of
  /// neighbours. Costs an unmap (replaced handles only), a map and access per change. True when
  /// done. On failure (false when out of mapping resources, or the error propagates) the whole
  /// range is unmapped and its addresses freed, whatever it mapped at that point: the caller
  /// then forgets it, as if it had been evicted.
  bool try_restitch(void* base, std::size_t reserved, std::span<const handle_slot<handle_type>> layout,
                    std::span<const replacement> changes) {
    std::size_t total = 0;
    for (const auto& h : layout) total += h.size;
    const std::size_t first_append = appends_from(changes, layout.size());
    for (std::size_t c = 0; c < changes.size(); ++c) {
      const std::size_t index = changes[c].index;
      const bool ordered = c == 0 || changes[c - 1].index < index;
      const bool appends = index >= layout.size();
      if (!ordered || (appends && index != layout.size() + (c - first_append)) ||
          (!appends && changes[c].slot.size != layout[index].size)) {
        throw std::invalid_argument("glake: try_restitch: changes out of order, misplaced or of the wrong size");
      }
      if (appends) total += changes[c].slot.size;
    }
    if (total > reserved) throw std::invalid_argument("glake: try_restitch: appended handles exceed the reservation");

    char* const at0 = static_cast<char*>(base);
    const driver_meter::sequence calls(meter_);
    std::size_t applied = 0;  // changes [0, applied) map their new handle
    bool hole = false;        // change `applied` has unmapped the old handle, not mapped the new
    auto undo = [&]() noexcept {
      std::size_t at = 0, c = 0;
      for (std::size_t i = 0; i < layout.size(); at += layout[i].size, ++i) {
        const bool changed = c < changes.size() && changes[c].index == i;
        if (!(changed && c == applied && hole)) unmap(at0 + at, layout[i].size);
        if (changed) ++c;
      }
      for (; c < applied; at += changes[c].slot.size, ++c) unmap(at0 + at, changes[c].slot.size);
      free_range(base, reserved);
    };
    try {
      std::size_t at = 0, i = 0;
      for (const replacement& change : changes) {
        for (; i < change.index; ++i) at += layout[i].size;  // appends are consecutive: i < layout.size()
        if (i < layout.size()) {
          unmap(at0 + at, layout[i].size);
          hole = true;
        }
        if (!map(at0 + at, change.slot)) return undo(), false;
        hole = false;
        ++applied;
        at += change.slot.size;
        ++i;
      }
      // Access over each run of neighbouring changed handles.
      at = 0, i = 0;
      for (std::size_t c = 0; c < changes.size();) {
        for (; i < changes[c].index; ++i) at += layout[i].size;
        std::size_t run = 0;
        for (; c < changes.size() && changes[c].index == i; ++c, ++i) run += changes[c].slot.size;
        if (!set_access(at0 + at, run)) return undo(), false;
        at += run;
      }
    } catch (...) {
      undo();
      throw;
    }
    return true;
  }

  /// Unmaps one handle of a stitched range; with free_stitched (of the bytes reserved), undoes
  /// try_map_stitched.
  void unmap_stitched(void* at, std::size_t bytes) noexcept { unmap(at, bytes); }
  void free_stitched(void* base, std::size_t bytes) noexcept { free_range(base, bytes); }

 private:
  struct spare {
    handle_type handle{};
    std::size_t size = 0;
  };

  bool fits(std::size_t bytes, std::size_t held) const noexcept {
    if (limit_ != 0 && (held >= limit_ || bytes > limit_ - held)) return false;
    return bytes <= capacity();
  }
  std::optional<handle_type> create_handle(std::size_t bytes) {
    if (!fits(bytes, physical_bytes_)) return std::nullopt;
    auto h = meter_(driver_call::create, [&] { return provider_.try_create(bytes); });
    if (h) physical_bytes_ += bytes;
    return h;
  }
  void unspare(std::size_t bytes) noexcept {
    spare_bytes_ -= bytes;
    if (spare_counters_ != nullptr) spare_counters_->s.reserved_bytes -= bytes;
  }
  void release_spare(std::size_t i) noexcept {
    spare s = spares_[i];
    spares_[i] = spares_.back();
    spares_.pop_back();
    unspare(s.size);
    release(s.handle);
    physical_bytes_ -= s.size;
  }

  // The index of the first change that appends (changes.size() when none does).
  static std::size_t appends_from(std::span<const replacement> changes, std::size_t layout_size) noexcept {
    std::size_t c = 0;
    while (c < changes.size() && changes[c].index < layout_size) ++c;
    return c;
  }

  bool map(void* at, const handle_slot<handle_type>& slot) {
    return meter_(driver_call::map, [&] { return reserver_.try_map(at, slot.size, slot.handle); });
  }
  bool set_access(void* at, std::size_t bytes) {
    return meter_(driver_call::set_access, [&] { return reserver_.try_set_access(at, bytes); });
  }
  void unmap(void* at, std::size_t bytes) noexcept {
    meter_(driver_call::unmap, [&]() noexcept { reserver_.unmap(at, bytes); });
  }
  void free_range(void* base, std::size_t bytes) noexcept {
    meter_(driver_call::address_free, [&]() noexcept { reserver_.free(base, bytes); });
  }
  void release(handle_type& handle) noexcept {
    meter_(driver_call::release, [&]() noexcept { provider_.release(handle); });
  }

  Provider provider_;
  Reserver reserver_;
  std::size_t limit_ = 0;
  std::size_t physical_bytes_ = 0;
  driver_meter meter_;
  std::vector<spare> spares_;
  std::size_t spare_bytes_ = 0;
  std::size_t spare_limit_ = 0;
  std::uint64_t recycled_ = 0;
  usage_counters* spare_counters_ = nullptr;
};

}  // namespace glake::detail
