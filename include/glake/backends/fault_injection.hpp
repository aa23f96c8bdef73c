// Wrappers that make any backend fail chosen calls on purpose, to prove that allocators roll
// back cleanly when the driver runs out of memory halfway through an operation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "glake/backends/concepts.hpp"
#include "glake/backends/sim.hpp"
#include "glake/errors.hpp"
#include "glake/statistics.hpp"

namespace glake {

// ---------------------------------------------------------------------------------------------
// fault_plan
//
// Counts the calls that the wrappers below see, by kind, and holds one rule saying which call
// to fail: the Nth fallible call of any kind, the Nth call of one kind, or every call of one kind.
// A rule counts from the moment it is set; the one-shot rules disarm after they fire, so a test
// can sweep N = 1, 2, ... over an operation until a run ends with no fault injected, having
// then failed each of the operation's calls once.
//
// Only create, reserve, map and set_access can fail (the others are noexcept in the concepts);
// "the Nth call of any kind" therefore counts only those, or a sweep would land on a release,
// inject nothing and stop early. The noexcept calls are still counted in calls().
//
// O(1) per call. Thread safety: all members may be called concurrently (one std::mutex). Not
// copyable: the wrappers point at it, so it must outlive them.
// ---------------------------------------------------------------------------------------------
class fault_plan {
 public:
  fault_plan() = default;
  fault_plan(const fault_plan&) = delete;
  fault_plan& operator=(const fault_plan&) = delete;

  /// Whether a call of this kind can be failed: it has a failure value in the concepts.
  static constexpr bool fallible(driver_call kind) noexcept {
    return kind == driver_call::create || kind == driver_call::reserve ||
           kind == driver_call::map || kind == driver_call::set_access;
  }

  /// Fails the nth fallible call from now (n >= 1), then no more.
  void fail_nth_call(std::uint64_t n) {
    check_count(n);
    std::lock_guard lock(mutex_);
    arm(mode::nth_call, driver_call::create, fallible_calls_ + n);
  }

  /// Fails the nth call of `kind` from now (n >= 1), then no more.
  void fail_nth_call_of(driver_call kind, std::uint64_t n) {
    check_count(n);
    check_fallible(kind);
    std::lock_guard lock(mutex_);
    arm(mode::nth_call_of, kind, calls_[kind] + n);
  }

  /// Fails every call of `kind` from now until the rule is replaced or cleared.
  void fail_every_call_of(driver_call kind) {
    check_fallible(kind);
    std::lock_guard lock(mutex_);
    arm(mode::every_call_of, kind, 0);
  }

  /// Clears the rule and keeps the counts.
  void never_fail() noexcept {
    std::lock_guard lock(mutex_);
    mode_ = mode::never;
  }

  /// Clears the rule, the call counts and the fault count.
  void reset() noexcept {
    std::lock_guard lock(mutex_);
    mode_ = mode::never;
    calls_ = {};
    fallible_calls_ = 0;
    faults_ = 0;
  }

  /// Counts a call of a fallible kind and says whether the wrapper must fail it.
  bool should_fail(driver_call kind) noexcept {
    std::lock_guard lock(mutex_);
    ++calls_[kind];
    if (!fallible(kind)) return false;
    ++fallible_calls_;
    bool fail = false;
    switch (mode_) {
      case mode::never:
        break;
      case mode::nth_call:
        fail = fallible_calls_ == target_;
        break;
      case mode::nth_call_of:
        fail = kind == kind_ && calls_[kind] == target_;
        break;
      case mode::every_call_of:
        fail = kind == kind_;
        break;
    }
    if (fail) {
      ++faults_;
      if (mode_ != mode::every_call_of) mode_ = mode::never;
    }
    return fail;
  }

  /// Counts a call that cannot fail.
  void count(driver_call kind) noexcept {
    std::lock_guard lock(mutex_);
    ++calls_[kind];
  }

  /// Every call seen since the last reset, failed ones included.
  driver_call_counts calls() const {
    std::lock_guard lock(mutex_);
    return calls_;
  }
  std::uint64_t fallible_calls() const {
    std::lock_guard lock(mutex_);
    return fallible_calls_;
  }
  std::uint64_t faults_injected() const {
    std::lock_guard lock(mutex_);
    return faults_;
  }
  /// Whether a rule is set that may still fire.
  bool armed() const {
    std::lock_guard lock(mutex_);
    return mode_ != mode::never;
  }

 private:
  enum class mode { never, nth_call, nth_call_of, every_call_of };

  static void check_count(std::uint64_t n) {
    if (n == 0) {
      throw usage_error(usage_error::kind::bad_argument,
                        "glake::fault_plan: calls are counted from 1, so n must be at least 1");
    }
  }
  static void check_fallible(driver_call kind) {
    if (!fallible(kind)) {
      throw usage_error(usage_error::kind::unsupported,
                        "glake::fault_plan: " + std::string(to_string(kind)) +
                            " is noexcept and cannot be failed");
    }
  }
  void arm(mode m, driver_call kind, std::uint64_t target) noexcept {
    mode_ = m;
    kind_ = kind;
    target_ = target;
  }

  mutable std::mutex mutex_;
  mode mode_ = mode::never;
  driver_call kind_ = driver_call::create;
  std::uint64_t target_ = 0;
  driver_call_counts calls_{};
  std::uint64_t fallible_calls_ = 0;
  std::uint64_t faults_ = 0;
};

/// A physical_provider that asks a fault_plan before each call: an injected fault makes
/// try_create return empty without calling the wrapped provider; release is counted and always
/// forwarded. Costs one plan lookup per call; thread safety is the wrapped provider's.
template <physical_provider Provider>
class fault_injecting_provider {
 public:
  using handle_type = typename Provider::handle_type;

  fault_injecting_provider(Provider upstream, fault_plan& plan)
      : upstream_(std::move(upstream)), plan_(&plan) {}

  std::size_t granularity() const noexcept { return upstream_.granularity(); }
  memory_location location() const noexcept { return upstream_.location(); }
  /// The wrapped provider's, when it reports one.
  std::size_t capacity() const noexcept
    requires capacity_reporting_provider<Provider>
  {
    return upstream_.capacity();
  }

  std::optional<handle_type> try_create(std::size_t bytes) {
    if (plan_->should_fail(driver_call::create)) return std::nullopt;
    return upstream_.try_create(bytes);
  }
  void release(handle_type handle) noexcept {
    plan_->count(driver_call::release);
    upstream_.release(handle);
  }

  Provider& upstream() noexcept { return upstream_; }
  const Provider& upstream() const noexcept { return upstream_; }
  fault_plan& plan() const noexcept { return *plan_; }

 private:
  [[no_unique_address]] Provider upstream_;
  fault_plan* plan_;
};

/// An address_reserver that asks a fault_plan before each call: an injected fault makes
/// try_reserve return null and try_map / try_set_access return false without calling the
/// wrapped reserver; free and unmap are counted and always forwarded. Costs one plan lookup per
/// call; thread safety is the wrapped reserver's.
template <address_reserver Reserver>
class fault_injecting_reserver {
 public:
  using handle_type = typename Reserver::handle_type;

  fault_injecting_reserver(Reserver upstream, fault_plan& plan)
      : upstream_(std::move(upstream)), plan_(&plan) {}

  std::size_t granularity() const noexcept { return upstream_.granularity(); }

  void* try_reserve(std::size_t bytes) {
    if (plan_->should_fail(driver_call::reserve)) return nullptr;
    return upstream_.try_reserve(bytes);
  }
  void free(void* at, std::size_t bytes) noexcept {
    plan_->count(driver_call::address_free);
    upstream_.free(at, bytes);
  }
  bool try_map(void* at, std::size_t bytes, handle_type handle) {
    if (plan_->should_fail(driver_call::map)) return false;
    return upstream_.try_map(at, bytes, handle);
  }
  bool try_set_access(void* at, std::size_t bytes) {
    if (plan_->should_fail(driver_call::set_access)) return false;
    return upstream_.try_set_access(at, bytes);
  }
  void unmap(void* at, std::size_t bytes) noexcept {
    plan_->count(driver_call::unmap);
    upstream_.unmap(at, bytes);
  }

  Reserver& upstream() noexcept { return upstream_; }
  const Reserver& upstream() const noexcept { return upstream_; }
  fault_plan& plan() const noexcept { return *plan_; }

 private:
  [[no_unique_address]] Reserver upstream_;
  fault_plan* plan_;
};

// The concept checks need a concrete backend; the simulated one is the smallest.
static_assert(physical_provider<fault_injecting_provider<sim_provider>>);
static_assert(address_reserver_for<fault_injecting_reserver<sim_reserver>,
                                   fault_injecting_provider<sim_provider>>);
}  // namespace glake
