// libFuzzer target: glake's settings parsers (include/glake/config.hpp) on arbitrary text:
// config::apply (GLAKE_ALLOC_CONF's "key:value,..." syntax) and config::from_env over GMLake's
// variables, read through a callable rather than the process environment.
//
// The first byte picks the entry point; the rest is the text (for from_env, values for
// vmmDefragment, fragLimit, reuseLimit, defragLevel, autoGC, reAlloc and GLAKE_ALLOC_CONF,
// separated by '\n'). A config that parses must validate and survive the to_string round trip;
// text that does not parse must be refused with config_error, leaving apply's object unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "glake/config.hpp"
#include "glake/config_io.hpp"

namespace {

[[noreturn]] void fail(const char* what, const std::string& text) {
  std::fprintf(stderr, "config_fuzzer: check failed: %s (text '%s')\n", what, text.c_str());
  std::abort();
}
#define GLAKE_FUZZ_CHECK(cond, text) \
  do {                               \
    if (!(cond)) fail(#cond, text);  \
  } while (0)

void check_valid(const glake::config& c, const std::string& input) {
  try {
    c.validate();
  } catch (const glake::config_error&) {
    fail("a parsed config validates", input);
  }
  const std::string text = c.to_string();
  glake::config back;
  try {
    back.apply(text.c_str());
  } catch (const glake::config_error& e) {
    fail(("to_string's text parses back: " + text + ": " + e.what()).c_str(), input);
  }
  GLAKE_FUZZ_CHECK(back == c, input + " -> " + text);
  GLAKE_FUZZ_CHECK(back.to_string() == text, input);
}

void fuzz_apply(const std::string& text) {
  glake::config c;
  c.stitching = false;  // a non-default base, so "unchanged" is not "defaults"
  c.round_to = 4096;
  const glake::config before = c;
  try {
    c.apply(text.c_str());
  } catch (const glake::config_error& e) {
    GLAKE_FUZZ_CHECK(c == before, text);
    GLAKE_FUZZ_CHECK(std::string_view(e.what()).rfind("glake config: ", 0) == 0, text);
    return;
  }
  check_valid(c, text);
}

void fuzz_from_env(const std::string& text) {
  static constexpr const char* names[] = {"vmmDefragment", "fragLimit", "reuseLimit", "defragLevel",
                                          "autoGC", "reAlloc", "GLAKE_ALLOC_CONF"};
  std::vector<std::string> values;
  std::size_t start = 0;
  for (std::size_t i = 0; i < std::size(names); ++i) {
    const std::size_t end = text.find('\n', start);
    if (start > text.size()) {
      values.emplace_back();
    } else {
      values.push_back(text.substr(start, end == std::string::npos ? std::string::npos : end - start));
    }
    start = end == std::string::npos ? text.size() + 1 : end + 1;
  }
  const auto getenv = [&](const char* name) -> const char* {
    for (std::size_t i = 0; i < std::size(names); ++i) {
      // An empty slot stands for an unset variable, so both paths run.
      if (std::strcmp(name, names[i]) == 0) return values[i].empty() ? nullptr : values[i].c_str();
    }
    fail("from_env reads only the documented variables", text);
  };
  glake::config c;
  try {
    c = glake::config::from_env(getenv);
  } catch (const glake::config_error& e) {
    GLAKE_FUZZ_CHECK(std::string_view(e.what()).rfind("glake config: ", 0) == 0, text);
    return;
  }
  check_valid(c, text);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  // apply takes a C string, so the text ends at the first NUL, as it would from getenv.
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  const std::string c_text(text.c_str());
  if (data[0] & 1) {
    fuzz_from_env(c_text);
  } else {
    fuzz_apply(c_text);
  }
  return 0;
}
