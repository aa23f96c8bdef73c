// RMM code moved onto glake with one line: set_current_device_resource. Everything below it is
// plain RMM (device_uvector, device_buffer, RMM's statistics and failure-callback adaptors), and
// takes its memory from a stitching allocator on the GPU. Needs RMM (GLAKE_WITH_RMM) and a GPU;
// the test that runs it skips without one.
#include <glake/adaptors/rmm_resource.hpp>
#include <glake/cuda_presets.hpp>

#include <rmm/cuda_stream.hpp>
#include <rmm/device_buffer.hpp>
#include <rmm/device_uvector.hpp>
#include <rmm/mr/failure_callback_resource_adaptor.hpp>
#include <rmm/mr/per_device_resource.hpp>
#include <rmm/mr/statistics_resource_adaptor.hpp>

#include <cstdio>
#include <vector>

namespace {

// What a spilling framework does when memory runs out: free something, then ask for a retry.
struct spill_state {
  std::vector<rmm::device_buffer>* spillable;
  int calls = 0;
};
bool spill(std::size_t, void* arg) {
  auto* state = static_cast<spill_state*>(arg);
  ++state->calls;
  if (state->spillable->empty()) return false;
  state->spillable->pop_back();  // "spilled"
  return true;
}

}  // namespace

int main() {
  using gpu = glake::shared_gpu_stitching_allocator;  // RMM's resource is shared: a mutex_lock
  glake::config cfg;
  cfg.memory_limit = 1ull << 30;  // 1 GiB, so that the spill below happens
  auto glake_mr = glake::make_rmm_resource<gpu>(glake::cuda_provider(0), glake::cuda_reserver(0), cfg);

  std::vector<rmm::device_buffer> spillable;
  spill_state state{&spillable};
  rmm::mr::statistics_resource_adaptor stats(glake_mr);
  rmm::mr::failure_callback_resource_adaptor<> on_oom(stats, spill, &state);

  auto previous = rmm::mr::set_current_device_resource(on_oom);  // the one line
  bool ok = false;
  {
    rmm::cuda_stream stream;
    rmm::device_uvector<float> v(std::size_t{32} << 20, cuda::stream_ref{stream});  // 128 MiB
    for (int i = 0; i < 3; ++i) spillable.emplace_back(std::size_t{256} << 20, cuda::stream_ref{stream});  // 768 MiB
    rmm::device_buffer big(std::size_t{256} << 20, cuda::stream_ref{stream});  // over the 1 GiB limit: spills one
    stream.synchronize();
    const glake::statistics s = glake_mr.allocator().stats();
    std::printf("spill calls %d; RMM statistics: %lld bytes live; glake: reserved %s, active %s, %llu stitches\n",
                state.calls, static_cast<long long>(stats.get_bytes_counter().value),
                glake::format_bytes(s.reserved_bytes).c_str(), glake::format_bytes(s.active_bytes).c_str(),
                static_cast<unsigned long long>(s.stitches));
    ok = state.calls == 1 && spillable.size() == 2 &&
         static_cast<std::size_t>(stats.get_bytes_counter().value) == s.active_bytes;
  }
  rmm::mr::set_current_device_resource(previous);
  return ok ? 0 : 1;
}
