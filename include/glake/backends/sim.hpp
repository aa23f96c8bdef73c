// A simulated backend with no memory behind it, so that a small machine can replay a large GPU's
// workload while every CUDA virtual memory rule is checked and every driver call is counted.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "glake/backends/concepts.hpp"
#include "glake/config.hpp"
#include "glake/errors.hpp"
#include "glake/statistics.hpp"

namespace glake {

/// Names one simulated physical handle. Ids are never reused, so a stale handle stays unknown
/// instead of silently naming a newer one.
struct sim_handle {
  std::uint64_t id = 0;
  friend constexpr bool operator==(sim_handle, sim_handle) noexcept = default;
};

/// What a simulated address is backed by: which handle, where in it, and whether access was
/// enabled there.
struct sim_location {
  std::uint64_t handle = 0;
  std::size_t offset = 0;
  bool accessible = false;
  friend constexpr bool operator==(const sim_location&, const sim_location&) noexcept = default;
};

// ---------------------------------------------------------------------------------------------
// sim_device
//
// The state of one simulated GPU: handles (id -> size, mapping count, live) in a vector indexed
// by id, one entry per handle ever created, so a lookup is O(1) and ids are never reused;
// reservations (base -> size) and mappings (address -> handle, size, accessible), each in a
// std::map ordered by key, so every call is O(log n) (set_access O(log n + k) over k mappings)
// and no call touches bytes. The simulator's own cost is part of what a replay measures per
// operation (glake-replay's host_ns_per_operation), so its calls are kept to one search of each
// map they need. Addresses are numbers from [2^44, 2^47), granularity-aligned; a new reservation is taken
// first-fit from a cursor that moves forward and wraps, so a freed range is reused only after the
// cursor has gone round, which keeps stale pointers from aliasing new ranges for as long as
// possible, and a range is never handed out while any part of it is reserved.
//
// It enforces the rules in backends/concepts.hpp. A broken rule is recorded (violations(),
// last_violation()); in the calls that may throw it also throws usage_error(bad_argument) naming
// the rule, and in the noexcept calls (release, free, unmap) the call then does nothing. Both
// paths count, so a test asserting `violations() == 0` also catches a usage_error that the code
// under test swallowed. Every call is counted in calls(), failed and rejected ones too.
//
// Thread safety: every member function may be called from several threads at once; one
// std::mutex serialises them. Not copyable or movable: providers and reservers point at it.
// ---------------------------------------------------------------------------------------------
class sim_device {
 public:
  static constexpr std::uintptr_t address_base = std::uintptr_t{1} << 44;
  static constexpr std::uintptr_t address_limit = std::uintptr_t{1} << 47;

  /// Throws usage_error when granularity is not a power of two. `host_capacity` bounds the
  /// handles of its host tier (sim_host_provider; 0: unlimited).
  explicit sim_device(std::size_t capacity_bytes, std::size_t granularity = 2 * MiB, std::size_t host_capacity = 0)
      : capacity_(capacity_bytes), granularity_(granularity), host_capacity_(host_capacity) {
    if (granularity == 0 || (granularity & (granularity - 1)) != 0) {
      throw usage_error(usage_error::kind::bad_argument,
                        "glake::sim_device: granularity " + std::to_string(granularity) +
                            " is not a power of two");
    }
  }
  sim_device(const sim_device&) = delete;
  sim_device& operator=(const sim_device&) = delete;

  // --- the driver calls, which sim_provider and sim_reserver forward to ---

  /// Empty when the live handles plus `bytes` would exceed capacity().
  std::optional<sim_handle> try_create(std::size_t bytes) {
    std::lock_guard lock(mutex_);
    ++calls_[driver_call::create];
    check_size("try_create", bytes);
    if (bytes > capacity_ - physical_bytes_) return std::nullopt;
    const std::uint64_t id = new_handle(bytes, false);
    physical_bytes_ += bytes;
    return sim_handle{id};
  }

  /// A handle of the host tier (CUDA's host-NUMA cuMemCreate): mapped like any other, counted
  /// in host_bytes(), not physical_bytes(). Empty when the host capacity would be exceeded.
  std::optional<sim_handle> try_create_host(std::size_t bytes) {
    std::lock_guard lock(mutex_);
    ++calls_[driver_call::create];
    check_size("try_create_host", bytes);
    if (host_capacity_ != 0 && bytes > host_capacity_ - host_bytes_) return std::nullopt;
    const std::uint64_t id = new_handle(bytes, true);
    host_bytes_ += bytes;
    return sim_handle{id};
  }

  void release(sim_handle handle) noexcept {
    std::lock_guard lock(mutex_);
    ++calls_[driver_call::release];
    handle_info* const h = live_handle(handle.id);
    if (h == nullptr) {
      return record("release: handle " + std::to_string(handle.id) +
                    " is unknown (never created, or already released)");
    }
    if (h->mappings != 0) {
      return record("release: handle " + std::to_string(handle.id) + " still has " +
                    std::to_string(h->mappings) +
                    " mapping(s) (a handle is released only when it has no mappings)");
    }
    (h->host ? host_bytes_ : physical_bytes_) -= h->bytes;
    h->live = false;
    --live_handles_;
  }

  /// Null when no free range of `bytes` is left in the simulated address space.
  void* try_reserve(std::size_t bytes) {
    std::lock_guard lock(mutex_);
    ++calls_[driver_call::reserve];
    check_size("try_reserve", bytes);
    const std::optional<std::uintptr_t> base = find_free_range(bytes);
    if (!base) return nullptr;
    reservations_.emplace(*base, bytes);
    reserved_bytes_ += bytes;
    next_address_ = *base + bytes;
    return to_pointer(*base);
  }

  void free(void* at, std::size_t bytes) noexcept {
    std::lock_guard lock(mutex_);
    ++calls_[driver_call::address_free];
    const std::uintptr_t base = to_address(at);
    const auto it = reservations_.find(base);
    if (it == reservations_.end()) {
      return record("free: " + hex(base) +
                    " is not the base of a reservation (only a whole reservation is freed)");
    }
    if (it->second != bytes) {
      return record("free: the reservation at " + hex(base) + " has " +
                    std::to_string(it->second) + " bytes, not " + std::to_string(bytes) +
                    " (only a whole reservation is freed)");
    }
    const auto inside = mappings_.lower_bound(base);
    if (inside != mappings_.end() && inside->first - base < bytes) {
      return record("free: the reservation at " + hex(base) + " still holds the mapping at " +
                    hex(inside->first) + " (a range is freed only when nothing in it is mapped)");
    }
    reserved_bytes_ -= bytes;
    reservations_.erase(it);
  }

  /// Always true: the simulation never runs out of mapping resources.
  bool try_map(void* at, std::size_t bytes, sim_handle handle) {
    std::lock_guard lock(mutex_);
    ++calls_[driver_call::map];
    const std::uintptr_t address = to_address(at);
    check_address("try_map", address);
    check_size("try_map", bytes);
    handle_info* const h = live_handle(handle.id);
    if (h == nullptr) {
      reject("try_map: handle " + std::to_string(handle.id) +
             " is unknown (never created, or already released)");
    }
    if (h->bytes != bytes) {
      reject("try_map: handle " + std::to_string(handle.id) + " has " +
             std::to_string(h->bytes) + " bytes, not " + std::to_string(bytes) +
             " (a handle is mapped whole)");
    }
    const auto r = reservations_.upper_bound(address);
    if (r == reservations_.begin() || !contains(*std::prev(r), address, bytes)) {
      reject("try_map: [" + hex(address) + ", +" + std::to_string(bytes) +
             ") is not inside one reservation (a mapping lies inside a reserved range)");
    }
    const auto after = mappings_.lower_bound(address);
    if (const auto other = overlapping_mapping(after, address, bytes)) {
      reject("try_map: [" + hex(address) + ", +" + std::to_string(bytes) +
             ") overlaps the mapping at " + hex(*other) + " (mappings must not overlap)");
    }
    mappings_.emplace_hint(after, address, mapping_info{handle.id, bytes, false});
    ++h->mappings;
    return true;
  }

  /// Always true: the simulation never runs out of resources here.
  bool try_set_access(void* at, std::size_t bytes) {
    std::lock_guard lock(mutex_);
    ++calls_[driver_call::set_access];
    const std::uintptr_t address = to_address(at);
    check_address("try_set_access", address);
    check_size("try_set_access", bytes);
    // Validate the whole range before changing anything, so a rejected call leaves no trace.
    // Counting down the remaining bytes, rather than comparing with an end address, keeps a
    // bogus address near the top of the address space from wrapping round.
    const auto first = mappings_.find(address);
    auto it = first;
    std::uintptr_t covered = address;
    std::size_t remaining = bytes;
    while (remaining != 0) {
      if (it == mappings_.end() || it->first != covered) {
        reject("try_set_access: " + hex(covered) +
               " does not start a mapping (access is set over whole mappings, with no gaps)");
      }
      if (it->second.bytes > remaining) {
        reject("try_set_access: the range ends inside the mapping at " + hex(covered) +
               " (access is set over whole mappings)");
      }
      covered += it->second.bytes;
      remaining -= it->second.bytes;
      ++it;
    }
    for (auto marked = first; marked != it; ++marked) {
      marked->second.accessible = true;
      ++set_access_mappings_;
    }
    return true;
  }

  void unmap(void* at, std::size_t bytes) noexcept {
    std::lock_guard lock(mutex_);
    ++calls_[driver_call::unmap];
    const std::uintptr_t address = to_address(at);
    const auto it = mappings_.find(address);
    if (it == mappings_.end()) {
      return record("unmap: " + hex(address) +
                    " is not the start of a mapping (unmap takes exactly one mapping)");
    }
    if (it->second.bytes != bytes) {
      return record("unmap: the mapping at " + hex(address) + " has " +
                    std::to_string(it->second.bytes) + " bytes, not " + std::to_string(bytes) +
                    " (unmap takes exactly one mapping)");
    }
    --live_handle(it->second.handle)->mappings;  // a mapped handle is live (release checks)
    mappings_.erase(it);
  }

  // --- stream capture (a test's stand-in for CUDA graph capture) ---

  /// Work queued on `stream` is captured from now on, until end_capture(stream).
  void begin_capture(stream_ref stream) {
    std::lock_guard lock(mutex_);
    if (std::find(capturing_.begin(), capturing_.end(), stream) == capturing_.end()) capturing_.push_back(stream);
  }
  void end_capture(stream_ref stream) {
    std::lock_guard lock(mutex_);
    capturing_.erase(std::remove(capturing_.begin(), capturing_.end(), stream), capturing_.end());
  }
  bool is_capturing(stream_ref stream) const {
    std::lock_guard lock(mutex_);
    return std::find(capturing_.begin(), capturing_.end(), stream) != capturing_.end();
  }

  // --- observers ---

  std::size_t granularity() const noexcept { return granularity_; }
  std::size_t capacity() const noexcept { return capacity_; }
  /// 0: unlimited.
  std::size_t host_capacity() const noexcept { return host_capacity_; }
  /// Bytes of live host-tier handles.
  std::size_t host_bytes() const {
    std::lock_guard lock(mutex_);
    return host_bytes_;
  }
  /// Whether the live handle `handle` is of the host tier; empty for an unknown handle.
  std::optional<bool> is_host(sim_handle handle) const {
    std::lock_guard lock(mutex_);
    const handle_info* const h = live_handle(handle.id);
    if (h == nullptr) return std::nullopt;
    return h->host;
  }

  /// A copy of `bytes` from `from` to `to` (sim_copier): both ranges must lie in accessible
  /// mappings and must not overlap; otherwise a usage_error names the rule. Counted in copies()
  /// and copied_bytes(). O(log n + k) over the k mappings the ranges cross.
  void copy(void* to, const void* from, std::size_t bytes) {
    std::lock_guard lock(mutex_);
    if (bytes == 0) return;
    check_accessible("copy (destination)", to_address(to), bytes);
    check_accessible("copy (source)", to_address(from), bytes);
    const std::uintptr_t a = to_address(to), b = to_address(from);
    if ((a < b ? b - a : a - b) < bytes) {
      reject("copy: [" + hex(a) + ", +" + std::to_string(bytes) + ") and [" + hex(b) +
             ", ...) overlap (a copy's ranges are disjoint)");
    }
    ++copies_;
    copied_bytes_ += bytes;
  }
  std::uint64_t copies() const {
    std::lock_guard lock(mutex_);
    return copies_;
  }
  std::uint64_t copied_bytes() const {
    std::lock_guard lock(mutex_);
    return copied_bytes_;
  }

  /// Bytes of live handles.
  std::size_t physical_bytes() const {
    std::lock_guard lock(mutex_);
    return physical_bytes_;
  }
  std::size_t live_handles() const {
    std::lock_guard lock(mutex_);
    return live_handles_;
  }
  /// Virtual bytes in live reservations.
  std::size_t reserved_bytes() const {
    std::lock_guard lock(mutex_);
    return reserved_bytes_;
  }
  std::size_t live_mappings() const {
    std::lock_guard lock(mutex_);
    return mappings_.size();
  }
  driver_call_counts calls() const {
    std::lock_guard lock(mutex_);
    return calls_;
  }

  /// The handle bytes behind `p`, or empty when no mapping covers `p`. Tests use it as an
  /// oracle: two live allocations must never resolve to the same handle and offset.
  std::optional<sim_location> resolve(const void* p) const {
    std::lock_guard lock(mutex_);
    const std::uintptr_t address = to_address(p);
    auto it = mappings_.upper_bound(address);
    if (it == mappings_.begin()) return std::nullopt;
    --it;
    const std::size_t offset = address - it->first;
    if (offset >= it->second.bytes) return std::nullopt;
    return sim_location{it->second.handle, offset, it->second.accessible};
  }

  /// Rule violations so far, in throwing and noexcept calls alike.
  /// Mappings covered by set_access calls so far: the driver charges set-access per handle.
  std::uint64_t set_access_mappings() const {
    std::lock_guard lock(mutex_);
    return set_access_mappings_;
  }
  std::uint64_t violations() const {
    std::lock_guard lock(mutex_);
    return violations_;
  }
  std::string last_violation() const {
    std::lock_guard lock(mutex_);
    return last_violation_;
  }

 private:
  struct handle_info {
    std::size_t bytes;
    std::size_t mappings;
    bool host;
    bool live;  ///< false once released: the entry stays, so that its id is never reused
  };
  struct mapping_info {
    std::uint64_t handle;
    std::size_t bytes;
    bool accessible;
  };

  static std::uintptr_t to_address(const void* p) noexcept {
    return reinterpret_cast<std::uintptr_t>(p);
  }
  static void* to_pointer(std::uintptr_t address) noexcept {
    return reinterpret_cast<void*>(address);
  }
  static std::string hex(std::uintptr_t address) {
    char buffer[24];
    std::snprintf(buffer, sizeof buffer, "%#llx", static_cast<unsigned long long>(address));
    return buffer;
  }
  static bool contains(const std::pair<const std::uintptr_t, std::size_t>& reservation,
                       std::uintptr_t address, std::size_t bytes) noexcept {
    const std::size_t offset = address - reservation.first;
    return offset < reservation.second && bytes <= reservation.second - offset;
  }

  // Callers hold mutex_. Allocation failure while building the message must not escape the
  // noexcept calls, so the counter is bumped first and the message is best effort.
  void record(const std::string& message) noexcept {
    ++violations_;
    try {
      last_violation_ = "glake::sim_device::" + message;
    } catch (...) {
    }
  }
  [[noreturn]] void reject(const std::string& message) {
    record(message);
    throw usage_error(usage_error::kind::bad_argument, last_violation_);
  }
  void check_size(const char* call, std::size_t bytes) {
    if (bytes == 0 || bytes % granularity_ != 0) {
      reject(std::string(call) + ": size " + std::to_string(bytes) +
             " is not a positive multiple of the granularity " + std::to_string(granularity_) +
             " (sizes are granularity-aligned)");
    }
  }
  void check_address(const char* call, std::uintptr_t address) {
    if (address % granularity_ != 0) {
      reject(std::string(call) + ": address " + hex(address) +
             " is not aligned to the granularity " + std::to_string(granularity_) +
             " (addresses are granularity-aligned)");
    }
  }

  // Every byte of [address, address + bytes) lies in a mapping with access set.
  void check_accessible(const char* call, std::uintptr_t address, std::size_t bytes) {
    auto it = mappings_.upper_bound(address);
    if (it == mappings_.begin()) reject(std::string(call) + ": " + hex(address) + " is not mapped");
    --it;
    std::uintptr_t at = address;
    std::size_t remaining = bytes;
    while (remaining != 0) {
      if (it == mappings_.end() || at - it->first >= it->second.bytes) {
        reject(std::string(call) + ": " + hex(at) + " is not mapped (a copy reads and writes mapped memory)");
      }
      if (!it->second.accessible) {
        reject(std::string(call) + ": the mapping at " + hex(it->first) +
               " has no access set (memory is accessible only after set_access)");
      }
      const std::size_t here = std::min(remaining, it->second.bytes - (at - it->first));
      at += here;
      remaining -= here;
      ++it;
    }
  }

  // Handle `id`'s entry (ids count from 1, one entry per handle ever created), or null when
  // the handle is unknown or released. O(1).
  handle_info* live_handle(std::uint64_t id) noexcept {
    if (id == 0 || id > handles_.size() || !handles_[id - 1].live) return nullptr;
    return &handles_[id - 1];
  }
  const handle_info* live_handle(std::uint64_t id) const noexcept {
    return const_cast<sim_device*>(this)->live_handle(id);
  }
  std::uint64_t new_handle(std::size_t bytes, bool host) {
    handles_.push_back(handle_info{bytes, 0, host, true});
    ++live_handles_;
    return handles_.size();
  }

  // The start of a mapping that overlaps [address, address + bytes), if any; `it` is
  // mappings_.lower_bound(address).
  std::optional<std::uintptr_t> overlapping_mapping(std::map<std::uintptr_t, mapping_info>::const_iterator it,
                                                    std::uintptr_t address, std::size_t bytes) const {
    if (it != mappings_.end() && it->first - address < bytes) return it->first;
    if (it != mappings_.begin()) {
      --it;
      if (address - it->first < it->second.bytes) return it->first;
    }
    return std::nullopt;
  }

  // First fit from the cursor, wrapping once to address_base. Each step jumps past one
  // reservation, so the search is O(k log n) over the k reservations it skips.
  std::optional<std::uintptr_t> find_free_range(std::size_t bytes) const {
    if (bytes > address_limit - address_base) return std::nullopt;
    std::uintptr_t start = next_address_;
    bool wrapped = false;
    for (;;) {
      if (bytes > address_limit - start) {
        if (wrapped) return std::nullopt;
        wrapped = true;
        start = address_base;
        continue;
      }
      auto it = reservations_.upper_bound(start);
      if (it != reservations_.begin()) {
        const auto before = std::prev(it);
        if (start - before->first < before->second) {
          start = before->first + before->second;
          continue;
        }
      }
      if (it != reservations_.end() && it->first - start < bytes) {
        start = it->first + it->second;
        continue;
      }
      return start;
    }
  }

  mutable std::mutex mutex_;
  std::vector<stream_ref> capturing_;  ///< streams begin_capture named
  const std::size_t capacity_;
  const std::size_t granularity_;
  const std::size_t host_capacity_;
  std::size_t physical_bytes_ = 0;
  std::size_t host_bytes_ = 0;
  std::uint64_t copies_ = 0;
  std::uint64_t copied_bytes_ = 0;
  std::size_t reserved_bytes_ = 0;
  std::uintptr_t next_address_ = address_base;
  // Indexed by id - 1: O(1) lookups, at the cost of one entry per handle ever created.
  std::vector<handle_info> handles_;
  std::size_t live_handles_ = 0;
  std::map<std::uintptr_t, std::size_t> reservations_;
  std::map<std::uintptr_t, mapping_info> mappings_;
  driver_call_counts calls_{};
  std::uint64_t violations_ = 0;
  std::uint64_t set_access_mappings_ = 0;
  std::string last_violation_;
};

/// The physical_provider face of a sim_device: a pointer, so copies are cheap and share the
/// device. Thread safety and complexity are the device's.
class sim_provider {
 public:
  using handle_type = sim_handle;

  explicit sim_provider(sim_device& device) noexcept : device_(&device) {}

  std::size_t granularity() const noexcept { return device_->granularity(); }
  static constexpr memory_location location() noexcept { return memory_location::simulated; }
  /// The device's capacity.
  std::size_t capacity() const noexcept { return device_->capacity(); }
  std::optional<handle_type> try_create(std::size_t bytes) { return device_->try_create(bytes); }
  void release(handle_type handle) noexcept { device_->release(handle); }

  sim_device& device() const noexcept { return *device_; }
  friend bool operator==(const sim_provider&, const sim_provider&) noexcept = default;

 private:
  sim_device* device_;
};
static_assert(physical_provider<sim_provider>);
static_assert(capacity_reporting_provider<sim_provider>);

/// The address_reserver face of a sim_device, mapping the handles of a sim_provider on the same
/// device. Thread safety and complexity are the device's.
class sim_reserver {
 public:
  using handle_type = sim_handle;

  explicit sim_reserver(sim_device& device) noexcept : device_(&device) {}

  std::size_t granularity() const noexcept { return device_->granularity(); }
  void* try_reserve(std::size_t bytes) { return device_->try_reserve(bytes); }
  void free(void* at, std::size_t bytes) noexcept { device_->free(at, bytes); }
  bool try_map(void* at, std::size_t bytes, handle_type handle) {
    return device_->try_map(at, bytes, handle);
  }
  bool try_set_access(void* at, std::size_t bytes) { return device_->try_set_access(at, bytes); }
  void unmap(void* at, std::size_t bytes) noexcept { device_->unmap(at, bytes); }
  bool is_capturing(stream_ref stream) const { return device_->is_capturing(stream); }

  sim_device& device() const noexcept { return *device_; }
  friend bool operator==(const sim_reserver&, const sim_reserver&) noexcept = default;

 private:
  sim_device* device_;
};
static_assert(address_reserver_for<sim_reserver, sim_provider>);
static_assert(capture_aware_reserver<sim_reserver>);

/// The host tier of a sim_device (what cuda_host_provider is on a GPU): its handles count
/// against the device's host capacity and are mapped by the device's sim_reserver like any other.
class sim_host_provider {
 public:
  using handle_type = sim_handle;

  explicit sim_host_provider(sim_device& device) noexcept : device_(&device) {}

  std::size_t granularity() const noexcept { return device_->granularity(); }
  static constexpr memory_location location() noexcept { return memory_location::simulated; }
  /// The device's host capacity (0: unlimited).
  std::size_t capacity() const noexcept { return device_->host_capacity(); }
  std::optional<handle_type> try_create(std::size_t bytes) { return device_->try_create_host(bytes); }
  void release(handle_type handle) noexcept { device_->release(handle); }

  sim_device& device() const noexcept { return *device_; }
  friend bool operator==(const sim_host_provider&, const sim_host_provider&) noexcept = default;

 private:
  sim_device* device_;
};
static_assert(physical_provider<sim_host_provider>);
static_assert(address_reserver_for<sim_reserver, sim_host_provider>);

/// The byte_copier of a sim_device: no bytes move, but both ranges are checked to be mapped and
/// accessible (sim_device::copy), so code that copies through unmapped memory fails here as it
/// would on a GPU.
class sim_copier {
 public:
  static constexpr bool synchronous = true;
  explicit sim_copier(sim_device& device) noexcept : device_(&device) {}
  void copy(void* to, const void* from, std::size_t bytes, stream_ref) { device_->copy(to, from, bytes); }
  sim_device& device() const noexcept { return *device_; }

 private:
  sim_device* device_;
};
static_assert(byte_copier<sim_copier>);

}  // namespace glake
