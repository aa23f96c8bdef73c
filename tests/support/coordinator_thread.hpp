// A budget coordinator served by a thread of the test, on a socket in a temporary directory,
// until the fixture ends; and a budget member that never has anything to give.
#pragma once

#include <cstddef>
#include <optional>
#include <thread>

#include "glake/scheduling/budget.hpp"
#include "glake/scheduling/budget_coordinator.hpp"
#include "support/processes.hpp"

namespace glake::testing {

struct coordinator_thread {
  temp_dir dir;
  budget_coordinator coordinator;
  channel stop;
  std::thread server;
  explicit coordinator_thread(std::size_t budget_bytes)
      : coordinator(dir.socket(), budget_bytes), server([this] { coordinator.run(stop.fds[0]); }) {}
  coordinator_thread(const coordinator_thread&) = delete;
  coordinator_thread& operator=(const coordinator_thread&) = delete;
  ~coordinator_thread() { join(); }
  std::string socket() const { return dir.socket(); }
  /// Stops the coordinator; its ledger may be read after (the thread is gone).
  void join() {
    if (!server.joinable()) return;
    stop.put('S');
    server.join();
  }
};

// Offers nothing: a workload whose memory is all in use.
struct nothing_to_give final : budget_member {
  std::optional<victim> offer_victim(const ask&) override { return std::nullopt; }
  std::size_t evict(const ask&, allocation_id) override { return 0; }
  void settle_evictions() override {}
};

}  // namespace glake::testing
