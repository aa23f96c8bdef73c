// The PyTorch plug-in's settings: the composition glake-replay replays as "glake", then whatever
// the environment says (GMLake's variables, then GLAKE_ALLOC_CONF).
#pragma once

#include <cstdlib>
#include <cstring>
#include <utility>

#include "glake/config.hpp"

namespace glake::torch_plugin {

/// glake-replay's "glake" settings (tools/replay/configurations.hpp, glake_config()): stitch any
/// request no free block serves, grow only the shortfall, reuse cached stitches up to 2x, keep
/// cached stitches mapped (auto_gc stays at its default). A trace recorded by the plug-in therefore replays under the same rules.
/// They are GMLake knobs, so they are supplied as GMLake's variables when the process does not
/// set those: a variable the process sets wins, and GLAKE_ALLOC_CONF wins over both.
inline constexpr std::pair<const char*, const char*> default_variables[] = {
    {"fragLimit", "2097152"},  // frag_limit:2MiB
    {"reAlloc", "1"},          // grow_stitch:true
    {"reuseLimit", "2"},       // reuse_limit:2
};

/// The plug-in's settings read through `getenv(name)` (null when unset); throws config_error
/// naming the variable and setting that is wrong.
template <class Getenv>
config settings_from(Getenv getenv) {
  return config::from_env([&](const char* name) -> const char* {
    if (const char* value = getenv(name); value != nullptr && *value != '\0') return value;
    for (const auto& [variable, value] : default_variables) {
      if (std::strcmp(name, variable) == 0) return value;
    }
    return nullptr;
  });
}

inline config settings_from_env() {
  return settings_from([](const char* name) -> const char* { return std::getenv(name); });
}

}  // namespace glake::torch_plugin
