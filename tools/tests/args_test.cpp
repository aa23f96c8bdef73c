// tools/args.hpp: declarations parsed in command-line order, the help generated from them, and
// errors that name the option.
#include <doctest/doctest.h>

#include <optional>
#include <string>
#include <vector>

#include "../args.hpp"

namespace {

using glake::tools::arg_parser;
using glake::tools::usage_error;

struct command_line {
  std::vector<std::string> words;
  std::vector<const char*> argv() const {
    std::vector<const char*> out{"tool"};
    for (const auto& w : words) out.push_back(w.c_str());
    return out;
  }
};

struct parsed {
  bool quiet = false;
  std::string socket;
  std::optional<std::string> group;
  std::vector<std::string> files;
  std::vector<std::string> order;
};

arg_parser make_parser(parsed& p) {
  arg_parser a("tool", "1.2.3", "tool [options] FILE...", "Does things to files.");
  a.flag("-q, --quiet", "no progress", p.quiet)
      .option("--socket", "PATH", "the socket", p.socket)
      .option("--group", "NAME", "also admit this group\nand say so", p.group)
      .option("-n, --count", "N", "how many", [&p](const std::string& v) {
        if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos) {
          throw usage_error("'" + v + "' is not a number");
        }
        p.order.push_back("count=" + v);
      })
      .positional("FILE", "files to read", [&p](const std::string& v) { p.files.push_back(v); },
                  arg_parser::occurs::one_or_more);
  return a;
}

arg_parser::outcome parse(parsed& p, const std::vector<std::string>& words) {
  arg_parser a = make_parser(p);
  const command_line c{words};
  const auto argv = c.argv();
  return a.parse(static_cast<int>(argv.size()), argv.data());
}

std::string error_of(const std::vector<std::string>& words) {
  parsed p;
  try {
    parse(p, words);
  } catch (const usage_error& e) {
    return e.what();
  }
  return "(accepted)";
}

}  // namespace

TEST_CASE("args: flags, options with a value (separate or after =) and repeated positionals") {
  parsed p;
  CHECK(parse(p, {"a.txt", "--socket", "/tmp/s", "-q", "--group=wheel", "-n", "3", "b.txt", "--count=4"}) ==
        arg_parser::outcome::run);
  CHECK(p.quiet);
  CHECK(p.socket == "/tmp/s");
  REQUIRE(p.group.has_value());
  CHECK(*p.group == "wheel");
  CHECK(p.files == std::vector<std::string>{"a.txt", "b.txt"});
  CHECK(p.order == std::vector<std::string>{"count=3", "count=4"});  // in command-line order
}

TEST_CASE("args: -- ends the options, and a lone - is an argument") {
  parsed p;
  CHECK(parse(p, {"--", "--quiet", "-"}) == arg_parser::outcome::run);
  CHECK_FALSE(p.quiet);
  CHECK(p.files == std::vector<std::string>{"--quiet", "-"});
}

TEST_CASE("args: -h, --help and --version are outcomes, whatever follows") {
  parsed p;
  CHECK(parse(p, {"-h"}) == arg_parser::outcome::help);
  CHECK(parse(p, {"--help", "--bogus"}) == arg_parser::outcome::help);
  CHECK(parse(p, {"--version"}) == arg_parser::outcome::version);
  CHECK(make_parser(p).version_line() == "tool 1.2.3");
}

TEST_CASE("args: errors name the option or the argument") {
  CHECK(error_of({"--bogus", "a"}) == "unknown option '--bogus' (see --help)");
  CHECK(error_of({"--bogus=1", "a"}) == "unknown option '--bogus' (see --help)");
  CHECK(error_of({"a", "--socket"}) == "--socket needs a value (--socket PATH)");
  CHECK(error_of({"a", "-n", "x"}) == "-n: 'x' is not a number");
  CHECK(error_of({"a", "--count=-1"}) == "--count: '-1' is not a number");
  CHECK(error_of({"a", "--quiet=yes"}) == "--quiet takes no value");
  CHECK(error_of({"-q"}) == "no FILE given");
  CHECK(error_of({"a"}) == "(accepted)");
}

TEST_CASE("args: a surplus positional argument is refused, an optional one may be missing") {
  std::string first;
  arg_parser a("tool", "1", "tool [NAME]", "");
  a.positional("NAME", "", [&first](const std::string& v) { first = v; }, arg_parser::occurs::optional);
  const char* none[] = {"tool"};
  CHECK(a.parse(1, none) == arg_parser::outcome::run);
  CHECK(first.empty());
  const char* two[] = {"tool", "x", "y"};
  try {
    a.parse(3, two);
    FAIL("accepted two arguments");
  } catch (const usage_error& e) {
    CHECK(std::string(e.what()) == "unexpected argument 'y'");
  }
  CHECK(first == "x");
}

TEST_CASE("args: the help lists every declaration with its help, aligned") {
  parsed p;
  const std::string help = make_parser(p).help();
  CHECK(help ==
        "usage: tool [options] FILE...\n"
        "Does things to files.\n"
        "\n"
        "arguments:\n"
        "  FILE               files to read\n"
        "\n"
        "options:\n"
        "  -q, --quiet        no progress\n"
        "      --socket PATH  the socket\n"
        "      --group NAME   also admit this group\n"
        "                     and say so\n"
        "  -n, --count N      how many\n"
        "  -h, --help         this text\n"
        "      --version      print the version and exit\n");
}

TEST_CASE("args: a long option's help starts on the next line, synopsis lines are indented") {
  arg_parser a("tool", "1", "tool --socket PATH\ntool --stats", "");
  a.option("--max-client-bytes", "SIZE", "at most SIZE bytes", [](const std::string&) {});
  const std::string help = a.help();
  CHECK(help.find("usage: tool --socket PATH\n       tool --stats\n") == 0);
  CHECK(help.find("      --max-client-bytes SIZE\n" + std::string(17, ' ') + "at most SIZE bytes\n") !=
        std::string::npos);
}

TEST_CASE("args: a declaration that is not an option name is a programming error") {
  arg_parser a("tool", "1", "tool", "");
  CHECK_THROWS_AS(a.flag("quiet", "", [] {}), std::logic_error);
  CHECK_THROWS_AS(a.flag("-quiet", "", [] {}), std::logic_error);
  a.positional("FILES", "", [](const std::string&) {}, arg_parser::occurs::one_or_more);
  CHECK_THROWS_AS(a.positional("MORE", "", [](const std::string&) {}), std::logic_error);
}
