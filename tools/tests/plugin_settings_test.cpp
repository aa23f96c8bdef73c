// The PyTorch plug-in's default settings are the ones glake-replay replays as "glake", so that a
// trace recorded on the GPU replays under the rules it ran with (its peak within 2% of the GPU's).
#include <doctest/doctest.h>

#include <map>
#include <string>

#include "../../integrations/torch/settings.hpp"
#include "configurations.hpp"

using namespace glake;

TEST_CASE("plug-in settings: the defaults are glake-replay's glake configuration and the environment wins") {
  std::map<std::string, std::string> env;
  const auto getenv = [&](const char* name) -> const char* {
    const auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  CHECK(torch_plugin::settings_from(getenv) == replay::glake_config());
  CHECK(torch_plugin::settings_from(getenv) != config{});  // not just the library's defaults
  CHECK(torch_plugin::settings_from(getenv).max_handle == 8 * MiB);  // glake's own default
  CHECK(torch_plugin::settings_from(getenv).event_interval_us == 200);  // and the events'
  CHECK(torch_plugin::settings_from(getenv).stream_join);                // and joins
  CHECK(torch_plugin::settings_from(getenv).small_limit == 256 * KiB);   // and the small pool's

  env["GLAKE_ALLOC_CONF"] = "max_handle:0";  // 2 MiB handles only, as the library's default
  CHECK(torch_plugin::settings_from(getenv).max_handle == 0);
  CHECK(torch_plugin::settings_from(getenv).stream_join);  // the rest stay
  env["GLAKE_ALLOC_CONF"] = "stream_join:0,event_interval_us:20000";  // the earlier behaviour
  CHECK_FALSE(torch_plugin::settings_from(getenv).stream_join);
  CHECK(torch_plugin::settings_from(getenv).event_interval_us == 20'000);
  CHECK(torch_plugin::settings_from(getenv).max_handle == 8 * MiB);  // the rest stay
  env["GLAKE_ALLOC_CONF"] = "small_limit:1MiB";  // PyTorch's small pool, the library's default
  CHECK(torch_plugin::settings_from(getenv).small_limit == MiB);
  env["GLAKE_ALLOC_CONF"] = "max_handle:5000";  // and a bad value is still refused
  CHECK_THROWS_WITH_AS(torch_plugin::settings_from(getenv), doctest::Contains("max_handle"), config_error);
  env.erase("GLAKE_ALLOC_CONF");

  env["fragLimit"] = "1048576";  // a GMLake variable the process sets wins over the default
  CHECK(torch_plugin::settings_from(getenv).frag_limit == MiB);
  env["GLAKE_ALLOC_CONF"] = "frag_limit:4MiB,max_handle:64MiB";  // and GLAKE_ALLOC_CONF over both
  const config c = torch_plugin::settings_from(getenv);
  CHECK(c.frag_limit == 4 * MiB);
  CHECK(c.max_handle == 64 * MiB);
  CHECK(c.grow_stitch);  // untouched defaults stay
  CHECK(c.reuse_limit == 2.0);
  env["GLAKE_ALLOC_CONF"] = "reuse_limit:0.5";
  CHECK_THROWS_AS(torch_plugin::settings_from(getenv), config_error);
}
