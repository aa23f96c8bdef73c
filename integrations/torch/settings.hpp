// The PyTorch plug-in's settings: the composition glake-replay replays as "glake", then whatever
// the environment says (GMLake's variables, then GLAKE_ALLOC_CONF).
#pragma once

#include <cstdlib>
#include <cstring>
#include <utility>

#include "glake/config.hpp"
#include "glake/config_io.hpp"

namespace glake::torch_plugin {

/// glake-replay's "glake" settings (tools/replay/configurations.hpp, glake_config()): stitch any
/// request no free block serves, grow only the shortfall, reuse cached stitches up to 2x, keep
/// cached stitches mapped (auto_gc stays at its default), new memory in handles of up to 8 MiB.
/// A trace recorded by the plug-in therefore replays under the same rules.
/// The GMLake knobs among them are supplied as GMLake's variables when the process does not set
/// those, so a variable the process sets wins; glake's own (default_base()) are the base the
/// variables apply over. GLAKE_ALLOC_CONF wins over all of them.
inline constexpr std::pair<const char*, const char*> default_variables[] = {
    {"fragLimit", "2097152"},  // frag_limit:2MiB
    {"reAlloc", "1"},          // grow_stitch:true
    {"reuseLimit", "2"},       // reuse_limit:2
};

/// The defaults of glake's own settings (no GMLake variable names them): handles of up to 8 MiB
/// for new memory. Every mapped handle costs ~21 us of cuMemSetAccess whatever its size (and
/// ~18 us to unmap), so a stitch of a 1 GiB logits tensor costs ~11 ms from 2 MiB handles and
/// ~3 ms from 8 MiB ones. Handles partly in use cannot be stitched, which costs a little
/// utilization (0.983-0.995 over the nine replayed traces against 0.987-0.997 with 2 MiB only;
/// 16 MiB falls to 0.978, below the 0.98 glake keeps). Cached stitches are repaired by free
/// handles of the same size and grow by whole handles. docs/handles.md and bench/results/replay.md
/// ("Key findings") have the measurements; `max_handle:0` restores 2 MiB handles.
/// Streams join (stream_join) and their events come at most every 200 us: a request takes another
/// stream's free block whose work is still queued by making its stream wait for that work on the
/// device, so what a rank holds no longer depends on how far the GPU lags. Under FSDP2 on four
/// H200s per-rank utilization went from 0.902-0.994 to 0.983-0.990, every rank within 1% of its
/// trace's replay, for 410-860 events (2-4 ms of host time) a step; with events every 1 ms
/// (~250 a step) some ranks stayed at 0.93-0.95 (docs/streams.md, bench/results/finetune.md).
/// `stream_join:false,event_interval_us:20000` restores the earlier behaviour.
/// Segments grow in place (segment_reserve, clamped to the device's memory, as
/// expandable_segments reserves): the tail of a block's last handle starts the next request;
/// T5-base's replayed peak 13.74 to 13.37 GB (bench/results/replay.md). `segment_reserve:0`
/// restores separate segments.
/// Requests up to 256 KiB go to the small pool (small_limit; the library's 1 MiB mirrors
/// PyTorch's small pool): a 2 MiB small segment then holds at least eight of them. Larger ones
/// pack end to end in the large pool's growing segments, where a 2 MiB small segment lent out of
/// an 8 MiB handle kept the rest of that handle from being stitched: a BART-large shape's peak
/// 8.586 to 8.426 GB (utilization 0.979 to 0.997) on the GPU as in its replay, llama3.2-1b-GS
/// 0.979 to 0.981, at most 0.8% higher on two bundled traces (docs/stitching.md, "Small
/// requests"). `small_limit:1MiB` restores PyTorch's limit.
inline config default_base() {
  config c;
  c.small_limit = 256 * KiB;
  c.max_handle = 8 * MiB;
  c.segment_reserve = 256 * GiB;
  c.stream_join = true;
  c.event_interval_us = 200;
  return c;
}

/// The plug-in's settings read through `getenv(name)` (null when unset); throws config_error
/// naming the variable and setting that is wrong.
template <class Getenv>
config settings_from(Getenv getenv) {
  return config::from_env(
      [&](const char* name) -> const char* {
        if (const char* value = getenv(name); value != nullptr && *value != '\0') return value;
        for (const auto& [variable, value] : default_variables) {
          if (std::strcmp(name, variable) == 0) return value;
        }
        return nullptr;
      },
      default_base());
}

inline config settings_from_env() {
  return settings_from([](const char* name) -> const char* { return std::getenv(name); });
}

}  // namespace glake::torch_plugin
