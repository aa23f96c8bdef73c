// Tests of glake::config: validation rules, the key:value parser, to_string and from_env.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <glake/config.hpp>
#include <glake/config_io.hpp>
#include <limits>
#include <map>
#include <string>
#include <string_view>

namespace {

using glake::config;
using glake::config_error;
using glake::GiB;
using glake::KiB;
using glake::MiB;

// The message of the config_error that `action` throws; a sentinel no check matches when it
// throws nothing, so a missing throw fails every substring check made on the result.
std::string config_error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const config_error& error) {
    return error.what();
  }
  return "<no config_error thrown>";
}

bool contains(const std::string& text, std::string_view part) {
  return text.find(part) != std::string::npos;
}

config applied(const char* text) {
  config c;
  c.apply(text);
  return c;
}

std::string apply_error(const char* text) {
  return config_error_of([&] { applied(text); });
}

// A stand-in for std::getenv over a fixed map, so tests never touch the process environment.
struct fake_environment {
  std::map<std::string, std::string> variables;
  const char* operator()(const char* name) const {
    const auto found = variables.find(name);
    return found == variables.end() ? nullptr : found->second.c_str();
  }
};

config from(std::map<std::string, std::string> variables) {
  return config::from_env(fake_environment{std::move(variables)});
}

std::string env_error(std::map<std::string, std::string> variables) {
  return config_error_of([&] { from(std::move(variables)); });
}

}  // namespace

TEST_CASE("config: the defaults are valid and follow GMLake") {
  const config c;
  CHECK_NOTHROW(c.validate());
  CHECK(c.stitching);
  CHECK(c.frag_limit == 512 * MiB);
  CHECK(c.reuse_limit == 10.0);
  CHECK(c.auto_gc == 1000 * GiB);
  CHECK_FALSE(c.grow_stitch);
  CHECK(c.stitch_reserve == 2.0);
  CHECK(c.event_interval_us == 1000);
  CHECK_FALSE(c.stream_join);
}

TEST_CASE("config: validate names the first broken rule and the value") {
  struct rule_case {
    const char* name;
    std::function<void(config&)> break_it;
    std::string_view setting;
    std::string_view why;
  };
  const rule_case cases[] = {
      {"reuse_limit below 1", [](config& c) { c.reuse_limit = 0.5; }, "reuse_limit",
       "must be >= 1 (got 0.5)"},
      {"reuse_limit NaN", [](config& c) { c.reuse_limit = std::nan(""); }, "reuse_limit",
       "must be >= 1"},
      {"reuse_limit infinite", [](config& c) { c.reuse_limit = HUGE_VAL; }, "reuse_limit",
       "must be finite"},
      {"stitch_reserve below 1", [](config& c) { c.stitch_reserve = 0.9; }, "stitch_reserve",
       "must be from 1 to 64 (got 0.9)"},
      {"stitch_reserve NaN", [](config& c) { c.stitch_reserve = std::nan(""); }, "stitch_reserve",
       "must be from 1 to 64"},
      {"stitch_reserve above 64", [](config& c) { c.stitch_reserve = 65; }, "stitch_reserve",
       "(got 65)"},
      {"defrag_level negative", [](config& c) { c.defrag_level = -1; }, "defrag_level",
       "must be 0, 1 or 2 (got -1)"},
      {"defrag_level 3", [](config& c) { c.defrag_level = 3; }, "defrag_level", "(got 3)"},
      {"auto_gc zero", [](config& c) { c.auto_gc = 0; }, "auto_gc", "must be > 0"},
      {"round_to zero", [](config& c) { c.round_to = 0; }, "round_to", "power of two"},
      {"round_to not a power of two", [](config& c) { c.round_to = 768; }, "round_to", "(got 768)"},
      {"round_to above 2 MiB", [](config& c) { c.round_to = 4 * MiB; }, "round_to", "power of two"},
      {"round_to below 256", [](config& c) { c.round_to = 128; }, "round_to", "from 256 to 2097152"},
      {"round_to 1", [](config& c) { c.round_to = 1; }, "round_to", "256-byte aligned"},
      {"small_segment zero", [](config& c) { c.small_segment = 0; }, "small_segment",
       "must be > 0"},
      {"small_segment not a power of two", [](config& c) { c.small_segment = 3 * MiB; }, "small_segment",
       "must be a power of two, a whole number of chunks (got 3145728)"},
      {"small_segment below round_to",
       [](config& c) { c.small_segment = 256; }, "small_segment",
       "multiple of round_to = 512"},
      {"small_limit below round_to", [](config& c) { c.small_limit = 256; }, "small_limit",
       ">= round_to = 512 (got 256)"},
      {"small_limit above small_segment", [](config& c) { c.small_limit = 4 * MiB; }, "small_limit",
       "must be <= small_segment = 2097152"},
      {"chunk_size not a page multiple", [](config& c) { c.chunk_size = 1000; }, "chunk_size",
       "power of two from 4096 (got 1000)"},
      {"chunk_size not a power of two", [](config& c) { c.chunk_size = 6 * MiB; }, "chunk_size",
       "power of two from 4096 (got 6291456)"},
      {"chunk_size above small_segment", [](config& c) { c.chunk_size = 4 * MiB; }, "chunk_size",
       "must be at most small_segment = 2097152"},
      {"max_handle not a page multiple", [](config& c) { c.max_handle = 5000; }, "max_handle",
       "multiple of 4096 (got 5000)"},
      {"min_handles zero", [](config& c) { c.min_handles = 0; }, "min_handles", "must be >= 1 (got 0)"},
      {"event_interval_us negative", [](config& c) { c.event_interval_us = -1; }, "event_interval_us",
       "must be from 0 to 1000000 (got -1)"},
      {"event_interval_us above a second", [](config& c) { c.event_interval_us = 1'000'001; }, "event_interval_us",
       "(got 1000001)"},
      {"memory_limit below small_segment", [](config& c) { c.memory_limit = 1 * MiB; },
       "memory_limit", "small_segment = 2097152"},
  };
  for (const auto& rule : cases) {
    CAPTURE(rule.name);
    config c;
    rule.break_it(c);
    CHECK_THROWS_AS(c.validate(), config_error);
    const auto message = config_error_of([&] { c.validate(); });
    CAPTURE(message);
    CHECK(message.starts_with("glake config: "));
    CHECK(contains(message, rule.setting));
    CHECK(contains(message, rule.why));
  }
}

TEST_CASE("config: validate blames round_to before the sizes that depend on it") {
  config c;
  c.round_to = 3;  // makes small_segment "not a multiple" too; the root cause is round_to
  const auto message = config_error_of([&] { c.validate(); });
  CHECK(contains(message, "round_to must be a power of two"));
}

TEST_CASE("config: validate accepts every boundary value") {
  config c;
  c.reuse_limit = 1.0;
  c.defrag_level = 2;
  c.min_handles = 1;
  c.event_interval_us = 0;
  c.frag_limit = 0;
  c.auto_gc = 1;
  c.chunk_size = 4 * KiB;
  c.memory_limit = c.small_segment;
  c.small_limit = c.small_segment;
  CHECK_NOTHROW(c.validate());

  config finest_rounding;
  finest_rounding.round_to = 256;
  finest_rounding.small_limit = 256;
  finest_rounding.small_segment = 256;
  finest_rounding.memory_limit = 0;
  CHECK_NOTHROW(finest_rounding.validate());

  config page_rounding;
  page_rounding.round_to = 2 * MiB;
  page_rounding.small_limit = 2 * MiB;
  page_rounding.small_segment = 4 * MiB;
  CHECK_NOTHROW(page_rounding.validate());
}

TEST_CASE("config: apply sets every kind of setting") {
  const config c = applied(
      "stitching:false, frag_limit:64MiB, reuse_limit:2.5, defrag_level:2, auto_gc:8GiB,"
      "grow_stitch:true, small_limit:512KiB, small_segment:4MiB, round_to:1024, chunk_size:2MiB,"
      "memory_limit:70GiB, min_handles:2, event_interval_us:5000, stream_join:1");
  CHECK_FALSE(c.stitching);
  CHECK(c.frag_limit == 64 * MiB);
  CHECK(c.reuse_limit == 2.5);
  CHECK(c.defrag_level == 2);
  CHECK(c.auto_gc == 8 * GiB);
  CHECK(c.grow_stitch);
  CHECK(c.small_limit == 512 * KiB);
  CHECK(c.small_segment == 4 * MiB);
  CHECK(c.round_to == 1024);
  CHECK(c.chunk_size == 2 * MiB);
  CHECK(c.memory_limit == 70 * GiB);
  CHECK(c.min_handles == 2);
  CHECK(c.event_interval_us == 5000);
  CHECK(c.stream_join);
}

TEST_CASE("config: apply tolerates whitespace, empty entries and repeats") {
  CHECK(applied("  frag_limit :\t1MiB  ").frag_limit == 1 * MiB);
  CHECK(applied("frag_limit:1MiB,").frag_limit == 1 * MiB);
  CHECK(applied(",,frag_limit:1MiB,,").frag_limit == 1 * MiB);
  CHECK(applied("defrag_level:1,defrag_level:2").defrag_level == 2);  // last wins
}

TEST_CASE("config: apply of null or empty text changes nothing") {
  config c;
  c.defrag_level = 9;  // invalid on purpose: an empty apply must not even validate
  CHECK_NOTHROW(c.apply(nullptr));
  CHECK_NOTHROW(c.apply(""));
  CHECK_NOTHROW(c.apply("  , "));
  CHECK(c.defrag_level == 9);
  CHECK(&c.apply("") == &c);
}

TEST_CASE("config: apply reads every boolean spelling") {
  for (const char* yes : {"true", "1", "yes", "on", "TRUE", "On"}) {
    CAPTURE(yes);
    config c;
    c.grow_stitch = false;
    c.apply((std::string("grow_stitch:") + yes).c_str());
    CHECK(c.grow_stitch);
  }
  for (const char* no : {"false", "0", "no", "off", "False", "OFF"}) {
    CAPTURE(no);
    config c;
    c.stitching = true;
    c.apply((std::string("stitching:") + no).c_str());
    CHECK_FALSE(c.stitching);
  }
  const auto message = apply_error("stitching:maybe");
  CHECK(contains(message, "stitching='maybe' is not a boolean"));
}

TEST_CASE("config: sizes accept every suffix as a power of 1024") {
  struct size_case {
    const char* text;
    std::size_t bytes;
  };
  const size_case cases[] = {
      {"4096", 4096},         {"4096B", 4096},
      {"4096b", 4096},        {"3K", 3 * KiB},
      {"3KB", 3 * KiB},       {"3kib", 3 * KiB},
      {"3M", 3 * MiB},        {"3mb", 3 * MiB},
      {"3MiB", 3 * MiB},      {"3G", 3 * GiB},
      {"3GB", 3 * GiB},       {"3gIb", 3 * GiB},
      {"2T", 2048 * GiB},     {"2TB", 2048 * GiB},
      {"2TiB", 2048 * GiB},   {"1.5GiB", 3 * GiB / 2},
      {".5MiB", MiB / 2},     {"2.MiB", 2 * MiB},
      {"0.1KiB", 102},        {"1.5", 1},
      {"3 MiB", 3 * MiB},     {"0", 0},
      {"0.0009765625KiB", 1}, {"16777215TiB", std::size_t{16777215} << 40},
  };
  for (const auto& size : cases) {
    CAPTURE(size.text);
    CHECK(applied((std::string("frag_limit:") + size.text).c_str()).frag_limit == size.bytes);
  }
}

TEST_CASE("config: malformed and overflowing sizes name the key") {
  for (const char* bad : {"abc", "-1", "1e3", "1XiB", "GiB", "1.2.3", "0x10", "1 2", "+5"}) {
    CAPTURE(bad);
    const auto message = apply_error((std::string("frag_limit:") + bad).c_str());
    CAPTURE(message);
    CHECK(contains(message, std::string("frag_limit='") + bad + "' is not a byte count"));
  }
  for (const char* huge : {"16777216TiB", "18446744073709551616", "99999999999999999999999GiB"}) {
    CAPTURE(huge);
    const auto message = apply_error((std::string("memory_limit:") + huge).c_str());
    CAPTURE(message);
    CHECK(contains(message, "memory_limit="));
    CHECK(contains(message, "overflows"));
  }
}

TEST_CASE("config: malformed numbers name the key") {
  CHECK(contains(apply_error("defrag_level:one"), "defrag_level='one' is not an integer"));
  CHECK(contains(apply_error("defrag_level:1.0"), "defrag_level='1.0' is not an integer"));
  CHECK(contains(apply_error("defrag_level:99999999999"),
                 "defrag_level='99999999999' is out of range for int"));
  CHECK(contains(apply_error("reuse_limit:ten"), "reuse_limit='ten' is not a number"));
  CHECK(contains(apply_error("reuse_limit:2x"), "reuse_limit='2x' is not a number"));
  CHECK(contains(apply_error("reuse_limit:inf"), "reuse_limit='inf' is not a number"));
  CHECK(applied("reuse_limit:1.5e1").reuse_limit == 15.0);
}

TEST_CASE("config: structural errors in the text say what is wrong") {
  const auto unknown = apply_error("frag_limt:1MiB");
  CHECK(contains(unknown, "unknown key 'frag_limt'"));
  // The list of valid keys names every setting.
  for (const char* key :
       {"stitching", "frag_limit", "reuse_limit", "defrag_level", "auto_gc", "grow_stitch",
        "small_limit", "small_segment", "round_to", "chunk_size", "max_handle", "min_handles",
        "memory_limit", "stitch_reserve", "event_interval_us", "stream_join"}) {
    CAPTURE(key);
    CHECK(contains(unknown, key));
  }
  CHECK(contains(apply_error("Frag_Limit:1"),
                 "unknown key 'Frag_Limit'"));  // keys are case-sensitive
  CHECK(contains(apply_error("frag_limit=1MiB"), "'frag_limit=1MiB' has no ':'"));
  CHECK(contains(apply_error("frag_limit:"), "frag_limit has an empty value"));
  CHECK(contains(apply_error("frag_limit:  ,defrag_level:1"), "frag_limit has an empty value"));
  CHECK(contains(apply_error(":5"), "unknown key ''"));
}

TEST_CASE("config: apply validates the result") {
  CHECK(contains(apply_error("reuse_limit:0.5"), "reuse_limit must be >= 1 (got 0.5)"));
  CHECK(contains(apply_error("small_limit:4MiB"), "small_limit must be <= small_segment"));
  // Settings that are only valid together are accepted in one apply, in any order.
  const config c = applied("small_limit:4MiB,small_segment:8MiB");
  CHECK(c.small_limit == 4 * MiB);
  CHECK(c.small_segment == 8 * MiB);
}

TEST_CASE("config: a throwing apply leaves the object unchanged") {
  config c;
  c.apply("frag_limit:3MiB,defrag_level:1,reuse_limit:4");
  const config before = c;
  // Each text changes some settings before the error shows up.
  for (const char* text :
       {"frag_limit:1GiB,bogus:1", "frag_limit:1GiB,defrag_level:7",
        "reuse_limit:2,stitching:false,small_limit:x", "defrag_level:2,frag_limit"}) {
    CAPTURE(text);
    CHECK_THROWS_AS(c.apply(text), config_error);
    CHECK(c == before);
  }
  CHECK(c.frag_limit == 3 * MiB);
}

TEST_CASE("config: to_string parses back to an equal config") {
  const config defaults;
  CHECK(applied(defaults.to_string().c_str()) == defaults);
  CHECK(contains(defaults.to_string(), "frag_limit:512MiB"));
  CHECK(contains(defaults.to_string(), "reuse_limit:10,"));

  config c;
  c.stitching = false;
  c.frag_limit = 12345;
  c.reuse_limit = 1.0 + 1.0 / 3.0;  // needs all 17 digits
  c.defrag_level = 1;
  c.auto_gc = 3 * GiB + 4 * KiB;
  c.grow_stitch = true;
  c.small_limit = 3 * MiB;
  c.small_segment = 8 * MiB;
  c.round_to = 2 * KiB;
  c.chunk_size = 2 * MiB;
  c.memory_limit = (std::size_t{5} << 40) + 4096;
  c.stitch_reserve = 1.25;
  c.event_interval_us = 250;
  c.stream_join = true;
  c.validate();
  const auto text = c.to_string();
  CAPTURE(text);
  CHECK(applied(text.c_str()) == c);
  CHECK(contains(text, "stream_join:true"));
  CHECK(contains(text, "auto_gc:3145732KiB"));
  CHECK(contains(text, "frag_limit:12345,"));

  for (double reuse : {1.1, 1e20, 123456.789, 1.0 + std::numeric_limits<double>::epsilon()}) {
    CAPTURE(reuse);
    config r;
    r.reuse_limit = reuse;
    CHECK(applied(r.to_string().c_str()).reuse_limit == reuse);
  }
}

TEST_CASE("config: from_env with nothing set gives the defaults") {
  CHECK(from({}) == config{});
  CHECK(from({{"fragLimit", ""}, {"GLAKE_ALLOC_CONF", "  "}}) ==
        config{});  // empty counts as unset
}

TEST_CASE("config: from_env reads GMLake's variables in GMLake's units") {
  const config c = from({{"vmmDefragment", "0"},
                         {"fragLimit", "1048576"},
                         {"reuseLimit", "2.5"},
                         {"defragLevel", "2"},
                         {"autoGC", "16"},
                         {"reAlloc", "1"}});
  CHECK_FALSE(c.stitching);
  CHECK(c.frag_limit == 1 * MiB);
  CHECK(c.reuse_limit == 2.5);
  CHECK(c.defrag_level == 2);
  CHECK(c.auto_gc == 16 * GiB);
  CHECK(c.grow_stitch);

  CHECK(from({{"vmmDefragment", "2"}}).stitching);
  CHECK_FALSE(from({{"vmmDefragment", "-1"}}).stitching);
  CHECK_FALSE(from({{"reAlloc", "0"}}).grow_stitch);
}

TEST_CASE("config: GLAKE_ALLOC_CONF beats GMLake's variables") {
  const config c = from(
      {{"fragLimit", "1048576"}, {"defragLevel", "1"}, {"GLAKE_ALLOC_CONF", "frag_limit:2GiB"}});
  CHECK(c.frag_limit == 2 * GiB);
  CHECK(c.defrag_level == 1);  // untouched by GLAKE_ALLOC_CONF, so GMLake's value stands

  // Validation runs once at the end, so GLAKE_ALLOC_CONF can correct an out-of-range variable.
  CHECK(from({{"defragLevel", "5"}, {"GLAKE_ALLOC_CONF", "defrag_level:0"}}).defrag_level == 0);
}

TEST_CASE("config: far_unmapped is a switch of GLAKE_ALLOC_CONF, off by default") {
  CHECK_FALSE(config{}.far_unmapped);
  CHECK(from({{"GLAKE_ALLOC_CONF", "far_unmapped:true"}}).far_unmapped);
  CHECK_FALSE(from({{"GLAKE_ALLOC_CONF", "far_unmapped:0"}}).far_unmapped);
}

TEST_CASE("config: malformed environment variables are named") {
  CHECK(contains(env_error({{"fragLimit", "abc"}}),
                 "glake config: environment variable fragLimit='abc' is not a byte count"));
  CHECK(contains(env_error({{"fragLimit", "1MiB"}}),
                 "fragLimit='1MiB' is not a byte count"));  // GMLake: bytes
  CHECK(contains(env_error({{"fragLimit", "-5"}}), "fragLimit='-5'"));
  CHECK(contains(env_error({{"vmmDefragment", "yes"}}), "vmmDefragment='yes' is not an integer"));
  CHECK(contains(env_error({{"reAlloc", "1.0"}}), "reAlloc='1.0' is not an integer"));
  CHECK(contains(env_error({{"defragLevel", "99999999999"}}),
                 "defragLevel='99999999999' is out of range"));
  CHECK(contains(env_error({{"reuseLimit", "lots"}}), "reuseLimit='lots' is not a number"));
  CHECK(contains(env_error({{"autoGC", "1.5"}}), "autoGC='1.5' is not a whole number of GiB"));
  CHECK(contains(env_error({{"autoGC", "99999999999999999"}}), "autoGC='99999999999999999'"));

  const auto conf = env_error({{"GLAKE_ALLOC_CONF", "frag_limit:lots"}});
  CHECK(contains(conf,
                 "glake config: environment variable GLAKE_ALLOC_CONF: frag_limit='lots' is not a "
                 "byte count"));
}

TEST_CASE("config: from_env applies the variables over an embedder's base, and validates the result") {
  config base;
  base.max_handle = 16 * MiB;
  base.frag_limit = 4 * MiB;
  const auto none = [](const char*) -> const char* { return nullptr; };
  CHECK(config::from_env(none, base) == base);
  const auto gmlake = [](const char* name) -> const char* {
    return std::string_view(name) == "fragLimit" ? "1048576" : nullptr;
  };
  const config c = config::from_env(gmlake, base);
  CHECK(c.frag_limit == MiB);          // a variable wins over the base
  CHECK(c.max_handle == 16 * MiB);     // what no variable names stays the base's
  base.reuse_limit = 0.5;              // a base out of range is refused like any setting
  CHECK_THROWS_WITH_AS(config::from_env(none, base), doctest::Contains("reuse_limit"), config_error);
}

TEST_CASE("config: from_env range errors name the variable that set the value") {
  CHECK(contains(
      env_error({{"defragLevel", "5"}}),
      "defrag_level must be 0, 1 or 2 (got 5) (set by environment variable defragLevel='5')"));
  CHECK(
      contains(env_error({{"reuseLimit", "0.5"}}), "set by environment variable reuseLimit='0.5'"));
  CHECK(contains(env_error({{"autoGC", "0"}}), "auto_gc must be > 0"));
  CHECK(contains(env_error({{"defragLevel", "1"}, {"GLAKE_ALLOC_CONF", "defrag_level:4"}}),
                 "(got 4) (set by GLAKE_ALLOC_CONF)"));
  CHECK(contains(env_error({{"GLAKE_ALLOC_CONF", "chunk_size:100"}}),
                 "chunk_size must be 0 (the backend's granularity) or a power of two from 4096"));
}

TEST_CASE("config: chunk_size and small_segment are refused when parsed, naming the key and the variable") {
  // Both used to pass from_env and fail later in the allocator's constructor, which cannot say
  // where the value came from.
  CHECK(contains(env_error({{"GLAKE_ALLOC_CONF", "chunk_size:3MiB"}}),
                 "glake config: chunk_size must be 0 (the backend's granularity) or a power of two from 4096 "
                 "(got 3145728) (set by GLAKE_ALLOC_CONF)"));
  CHECK(contains(env_error({{"GLAKE_ALLOC_CONF", "small_segment:3MiB"}}),
                 "glake config: small_segment must be a power of two, a whole number of chunks (got 3145728) "
                 "(set by GLAKE_ALLOC_CONF)"));
  // 6 MiB was blamed on small_segment, which nobody had set.
  const auto six = env_error({{"GLAKE_ALLOC_CONF", "chunk_size:6MiB"}});
  CHECK(contains(six, "glake config: chunk_size must be"));
  CHECK_FALSE(contains(six, "small_segment must"));
  CHECK(contains(env_error({{"GLAKE_ALLOC_CONF", "chunk_size:4MiB"}}),
                 "glake config: chunk_size must be at most small_segment = 2097152, since the small pool "
                 "borrows whole chunks (got 4194304); raise small_segment with it (set by GLAKE_ALLOC_CONF)"));
  CHECK(from({{"GLAKE_ALLOC_CONF", "chunk_size:4MiB,small_segment:4MiB"}}).chunk_size == 4 * MiB);
  // chunk_size from the embedder's base, small_segment from the variable: the variable is named.
  config base;
  base.chunk_size = 4 * MiB;
  base.small_segment = 4 * MiB;
  const auto variable = [](const char* name) -> const char* {
    return std::string_view(name) == "GLAKE_ALLOC_CONF" ? "small_segment:2MiB" : nullptr;
  };
  CHECK_THROWS_WITH_AS(config::from_env(variable, base),
                       doctest::Contains("(small_segment set by GLAKE_ALLOC_CONF)"), config_error);
  // The same words from code, without a variable to name.
  config c;
  c.chunk_size = 3 * MiB;
  CHECK(contains(config_error_of([&] { c.validate(); }), "chunk_size must be"));
}

TEST_CASE("config: values echoed in errors are cut to 64 characters and their control characters escaped") {
  const std::string garbage(MiB, 'x');
  const std::string text = "frag_limit:" + garbage;
  const auto message = apply_error(text.c_str());
  CAPTURE(message.substr(0, 200));
  CHECK(message.size() < 300);
  CHECK(contains(message, "frag_limit='" + std::string(64, 'x') + "...' is not a byte count"));

  const auto key = apply_error(("k" + garbage + ":1").c_str());
  CHECK(key.size() < 500);  // the valid keys are listed after it
  CHECK(contains(key, "unknown key 'k" + std::string(63, 'x') + "...'"));
  CHECK(apply_error(garbage.c_str()).size() < 300);  // an entry without ':'

  const auto forged = env_error({{"GLAKE_ALLOC_CONF", "frag_limit:1\nglake: all is well\x1b[0m\x7f"}});
  CAPTURE(forged);
  CHECK_FALSE(contains(forged, "\n"));
  CHECK_FALSE(contains(forged, "\x1b"));
  CHECK(contains(forged, "frag_limit='1\\nglake: all is well\\x1b[0m\\x7f' is not a byte count"));
  const auto gmlake = env_error({{"fragLimit", "1\t" + std::string(100, '9')}});
  CHECK(contains(gmlake, "fragLimit='1\\t" + std::string(62, '9') + "...' is not a byte count"));
}

TEST_CASE("config: small_limit 0 means no small pool and is valid") {
  glake::config c;
  c.small_limit = 0;
  CHECK_NOTHROW(c.validate());
  CHECK(glake::config{}.apply("small_limit:0,max_handle:1GiB").max_handle == glake::GiB);
}
