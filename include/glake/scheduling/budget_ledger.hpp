// The accounts of one device budget shared by workloads: who holds how much, who must hold how
// much at once; plain requests and replies, so a coordinator in another process can keep it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "glake/detail/printable.hpp"
#include "glake/errors.hpp"
#include "glake/scheduling/concepts.hpp"

namespace glake {

/// One workload's line in a budget_ledger.
struct workload_usage {
  workload_id id = 0;
  std::string name;
  std::size_t held = 0;       ///< device bytes granted to it now
  std::size_t pinned = 0;     ///< bytes it needs at once (its current operation): never moved out
  std::size_t predicted = 0;  ///< its predicted peak, as it reported it (0: not reported)
};

/// A request to a budget_ledger: a plain value, so it can be written to a socket as it is.
struct budget_request {
  enum class kind : std::uint8_t { join, leave, acquire, release, set_pinned, set_predicted };
  kind what = kind::acquire;
  workload_id workload = 0;  ///< who asks (ignored by join)
  std::size_t bytes = 0;     ///< join: its irreducible need; otherwise the operation's bytes
  std::string name;          ///< join: the workload's name
};

/// The answer: `granted` (for join, `workload` names the new workload), `over_budget` (acquire:
/// not now; `bytes` says how many are missing), or `refused` (an error; `message` says which).
struct budget_reply {
  enum class status : std::uint8_t { granted, over_budget, refused };
  status result = status::granted;
  workload_id workload = 0;
  std::size_t bytes = 0;
  std::string message;
};

// ---------------------------------------------------------------------------------------------
// budget_ledger
//
// The device budget (bytes) and, per workload, what it holds, what it must hold at once (its
// pinned working set, the current operation's allocations) and its predicted peak. acquire
// grants bytes only while the sum held stays within the budget; it never waits and never moves
// memory (shared_budget does both around it). A workload whose pinned need exceeds the whole
// budget can never run: join and set_pinned refuse it with out_of_memory naming the workload and
// the bytes. A workload's name is kept as detail::printable makes it (control characters and
// escapes written out), since it is printed in reports and other processes' errors. leave takes back everything the workload held, which is also what a coordinator
// does for a workload whose connection dropped (a crashed process).
//
// Every operation is a typed member function that throws, or handle(request), which answers
// with a reply instead of throwing (for a transport). Workloads are kept in a std::map:
// O(log W) per call, O(W) for snapshot() and the error messages. Thread safety: none; one owner
// (shared_budget, or a coordinator's loop) calls it.
// ---------------------------------------------------------------------------------------------
class budget_ledger {
 public:
  /// Throws usage_error for a zero budget.
  explicit budget_ledger(std::size_t budget_bytes) : budget_(budget_bytes) {
    if (budget_bytes == 0) {
      throw usage_error(usage_error::kind::bad_argument, "glake::budget_ledger: the budget is 0 bytes");
    }
  }
  /// `fraction` (0, 1] of a device of `device_bytes`. usage_error for a fraction out of range.
  static budget_ledger fraction_of(std::size_t device_bytes, double fraction) {
    if (!(fraction > 0.0 && fraction <= 1.0)) {
      throw usage_error(usage_error::kind::bad_argument,
                        "glake::budget_ledger: the fraction " + std::to_string(fraction) + " is not in (0, 1]");
    }
    if (fraction == 1.0) return budget_ledger(device_bytes);
    // Below 1 the product is below 2^64 (rounding of the device's size included), so the
    // conversion is defined; the cap keeps it so where size_t is narrower.
    const double bytes = static_cast<double>(device_bytes) * fraction;
    const double most = static_cast<double>(std::numeric_limits<std::size_t>::max());
    return budget_ledger(bytes >= most ? device_bytes : static_cast<std::size_t>(bytes));
  }

  std::size_t budget() const noexcept { return budget_; }
  std::size_t used() const noexcept { return used_; }
  std::size_t available() const noexcept { return budget_ - used_; }
  std::size_t workloads() const noexcept { return workloads_.size(); }

  /// A new workload that must hold `pinned` bytes at once (0: not known yet). out_of_memory when
  /// that is more than the budget.
  workload_id join(std::string name, std::size_t pinned = 0) {
    name = detail::printable(name);  // printed in reports and in other processes' errors
    check_fits(name, pinned, "declared");
    const workload_id id = next_id_++;
    workloads_.emplace(id, workload_usage{id, std::move(name), 0, pinned, 0});
    return id;
  }

  /// Takes back everything the workload held. Unknown ids are ignored (it left already).
  void leave(workload_id id) noexcept {
    const auto it = workloads_.find(id);
    if (it == workloads_.end()) return;
    used_ -= it->second.held;
    workloads_.erase(it);
  }

  /// Grants `bytes` when they fit in what is left of the budget; false (nothing changes) if not.
  bool try_acquire(workload_id id, std::size_t bytes) {
    workload_usage& w = at(id, "acquire");
    if (bytes > available()) return false;
    w.held += bytes;
    used_ += bytes;
    return true;
  }

  /// Gives back `bytes`. usage_error when the workload holds fewer.
  void release(workload_id id, std::size_t bytes) {
    workload_usage& w = at(id, "release");
    if (bytes > w.held) {
      throw usage_error(usage_error::kind::size_mismatch,
                        "glake::budget_ledger: workload '" + w.name + "' releases " + std::to_string(bytes) +
                            " bytes but holds " + std::to_string(w.held));
    }
    w.held -= bytes;
    used_ -= bytes;
  }

  /// The workload must now hold `bytes` at once. out_of_memory (nothing changes) when that is
  /// more than the whole budget.
  void set_pinned(workload_id id, std::size_t bytes) {
    workload_usage& w = at(id, "set_pinned");
    check_fits(w.name, bytes, "its current operation");
    w.pinned = bytes;
  }

  void set_predicted(workload_id id, std::size_t bytes) { at(id, "set_predicted").predicted = bytes; }

  /// out_of_memory naming the workload when `bytes` (for `what`) are more than the whole budget.
  void require_fits(workload_id id, std::size_t bytes, const char* what) const {
    check_fits(find(id, "require_fits").name, bytes, what);
  }

  /// One workload's line. usage_error for an unknown id.
  workload_usage usage(workload_id id) const { return find(id, "usage"); }

  /// Every workload's line, by id.
  std::vector<workload_usage> snapshot() const {
    std::vector<workload_usage> lines;
    lines.reserve(workloads_.size());
    for (const auto& [id, w] : workloads_) lines.push_back(w);
    return lines;
  }

  /// "'a' holds 6.00 MiB (4.00 MiB pinned), 'b' holds ...": for error messages.
  std::string describe() const {
    std::string text;
    for (const auto& [id, w] : workloads_) {
      if (!text.empty()) text += ", ";
      text += "'" + w.name + "' holds " + format_bytes(w.held) + " (" + format_bytes(w.pinned) + " pinned)";
    }
    return text.empty() ? "no workload holds anything" : text;
  }

  /// Any request, answered without throwing (usage errors and refusals become `refused`).
  budget_reply handle(const budget_request& r) {
    budget_reply reply;
    reply.workload = r.workload;
    try {
      switch (r.what) {
        case budget_request::kind::join:
          reply.workload = join(r.name, r.bytes);
          break;
        case budget_request::kind::leave:
          leave(r.workload);
          break;
        case budget_request::kind::acquire:
          if (!try_acquire(r.workload, r.bytes)) {
            reply.result = budget_reply::status::over_budget;
            reply.bytes = r.bytes - available();
            reply.message = "asked for " + format_bytes(r.bytes) + ", " + format_bytes(available()) +
                            " of the budget of " + format_bytes(budget_) + " left";
          }
          break;
        case budget_request::kind::release:
          release(r.workload, r.bytes);
          break;
        case budget_request::kind::set_pinned:
          set_pinned(r.workload, r.bytes);
          break;
        case budget_request::kind::set_predicted:
          set_predicted(r.workload, r.bytes);
          break;
      }
    } catch (const std::exception& e) {
      reply.result = budget_reply::status::refused;
      reply.message = e.what();
    }
    return reply;
  }

 private:
  workload_usage& at(workload_id id, const char* what) { return const_cast<workload_usage&>(find(id, what)); }
  const workload_usage& find(workload_id id, const char* what) const {
    const auto it = workloads_.find(id);
    if (it == workloads_.end()) {
      throw usage_error(usage_error::kind::foreign_pointer,
                        std::string("glake::budget_ledger::") + what + ": no workload " + std::to_string(id) +
                            " (it never joined, or left)");
    }
    return it->second;
  }

  void check_fits(const std::string& name, std::size_t bytes, const char* what) const {
    if (bytes <= budget_) return;
    throw out_of_memory(bytes, used_, 0,
                        "glake: workload '" + name + "' needs " + std::to_string(bytes) + " bytes (" +
                            format_bytes(bytes) + ") on the device at once (" + what +
                            "), more than the whole budget of " + std::to_string(budget_) + " bytes (" +
                            format_bytes(budget_) + "): it can never run; raise the budget or use less at once");
  }

  std::size_t budget_;
  std::size_t used_ = 0;
  workload_id next_id_ = 1;
  std::map<workload_id, workload_usage> workloads_;
};

}  // namespace glake
