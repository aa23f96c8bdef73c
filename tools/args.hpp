// The command lines of glake's tools: options with values, flags and positional arguments declared
// once, from which the parser, the -h/--help text and --version follow.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "glake/detail/printable.hpp"

namespace glake::tools {

/// A command line the tool cannot run: what is wrong, naming the option or argument.
class usage_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A tool's command line. Declare flags (`--quiet`), options with a value (`--socket PATH`, also
/// written `--socket=PATH`) and positional arguments, each with its help line; parse() then calls
/// each declaration's action in command-line order. `-h/--help` and `--version` are declared by
/// the parser itself; `--` ends the options. An action rejects a value by throwing usage_error
/// with the reason, and parse() throws a usage_error that names the option. Help text: a
/// declaration's help may hold '\n'; its further lines are indented to the help column.
/// Not thread-safe; one parser per command line.
class arg_parser {
 public:
  /// What parse() found: run the tool, or print help() / the version and exit 0.
  enum class outcome { run, help, version };

  /// `synopsis` is the text after "usage: " (lines after the first indented to match it);
  /// `description` the paragraph after it.
  arg_parser(std::string program, std::string version, std::string synopsis, std::string description)
      : program_(std::move(program)),
        version_(std::move(version)),
        synopsis_(std::move(synopsis)),
        description_(std::move(description)) {}

  /// A flag: `names` such as "-q, --quiet" (comma-separated); `set` runs each time it is given.
  arg_parser& flag(std::string_view names, std::string help, std::function<void()> set) {
    options_.push_back({split_names(names), {}, std::move(help), std::move(set), {}});
    return *this;
  }
  arg_parser& flag(std::string_view names, std::string help, bool& target) {
    return flag(names, std::move(help), [&target] { target = true; });
  }

  /// An option with a value, shown as `metavar` in the help; `take(value)` runs each time it is
  /// given and throws usage_error when the value is not one it accepts.
  arg_parser& option(std::string_view names, std::string metavar, std::string help,
                     std::function<void(const std::string&)> take) {
    options_.push_back({split_names(names), std::move(metavar), std::move(help), {}, std::move(take)});
    return *this;
  }
  arg_parser& option(std::string_view names, std::string metavar, std::string help, std::string& target) {
    return option(names, std::move(metavar), std::move(help), [&target](const std::string& v) { target = v; });
  }
  arg_parser& option(std::string_view names, std::string metavar, std::string help,
                     std::optional<std::string>& target) {
    return option(names, std::move(metavar), std::move(help), [&target](const std::string& v) { target = v; });
  }

  /// How often a positional argument occurs: `one_or_more` takes every argument left, so it comes
  /// last; parse() fails when a `once` or `one_or_more` one is missing.
  enum class occurs { once, optional, one_or_more };

  /// A positional argument, in declaration order.
  arg_parser& positional(std::string metavar, std::string help, std::function<void(const std::string&)> take,
                         occurs how = occurs::once) {
    if (!positionals_.empty() && positionals_.back().repeated) {
      throw std::logic_error("arg_parser: a positional argument after one that takes every argument left");
    }
    positionals_.push_back({std::move(metavar), std::move(help), std::move(take), how != occurs::optional,
                            how == occurs::one_or_more});
    return *this;
  }

  /// Reads argv[1..argc). Throws usage_error for an unknown option, a missing or unwanted value,
  /// a value an action refused, a missing or surplus positional argument.
  outcome parse(int argc, const char* const* argv) {
    std::size_t next_positional = 0, repeats = 0;
    bool options_end = false;
    const auto take_positional = [&](const std::string& value) {
      if (next_positional >= positionals_.size()) throw usage_error("unexpected argument '" + value + "'");
      positional_spec& p = positionals_[next_positional];
      run_action(p.metavar, [&] { p.take(value); });
      if (p.repeated) {
        ++repeats;
      } else {
        ++next_positional;
      }
    };
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      if (options_end || arg.size() < 2 || arg[0] != '-') {
        take_positional(arg);
        continue;
      }
      if (arg == "--") {
        options_end = true;
        continue;
      }
      if (arg == "-h" || arg == "--help") return outcome::help;
      if (arg == "--version") return outcome::version;
      const std::size_t equals = arg.rfind("--", 0) == 0 ? arg.find('=') : std::string::npos;
      const std::string name = arg.substr(0, equals);
      option_spec* o = find(name);
      if (o == nullptr) throw usage_error("unknown option '" + name + "' (see --help)");
      if (o->set) {
        if (equals != std::string::npos) throw usage_error(name + " takes no value");
        o->set();
        continue;
      }
      std::string value;
      if (equals != std::string::npos) {
        value = arg.substr(equals + 1);
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        throw usage_error(name + " needs a value (" + name + " " + o->metavar + ")");
      }
      run_action(name, [&] { o->take(value); });
    }
    if (repeats > 0) ++next_positional;
    for (std::size_t k = next_positional; k < positionals_.size(); ++k) {
      if (positionals_[k].required) throw usage_error("no " + positionals_[k].metavar + " given");
    }
    return outcome::run;
  }

  /// parse(), and for help or --version prints it on stdout and exits 0; for a usage_error prints
  /// "<program>: <what>" and a pointer to --help on stderr and exits 2.
  void parse_or_exit(int argc, const char* const* argv) {
    outcome o = outcome::run;
    try {
      o = parse(argc, argv);
    } catch (const usage_error& e) {
      fail(e.what());
    }
    if (o == outcome::help) {
      std::fputs(help().c_str(), stdout);
      std::exit(0);
    }
    if (o == outcome::version) {
      std::printf("%s\n", version_line().c_str());
      std::exit(0);
    }
  }

  /// A command line found wrong after parsing (a missing option, two that exclude each other):
  /// said as parse_or_exit says a usage_error (control characters escaped: the message quotes the
  /// command line), exit status 2.
  [[noreturn]] void fail(const std::string& message) const {
    std::fprintf(stderr, "%s: %s\nTry '%s --help' for more information.\n", program_.c_str(),
                 glake::detail::printable(message).c_str(), program_.c_str());
    std::exit(2);
  }

  /// "<program> <version>".
  std::string version_line() const { return program_ + " " + version_; }

  /// The usage, the description, then one line per argument and option, -h and --version last.
  std::string help() const {
    std::vector<std::pair<std::string, std::string>> rows;  // left column, help
    // -h is always there, so long-only names line up under the long names.
    for (const auto& o : options_) rows.emplace_back(left_column(o), o.help);
    rows.emplace_back("-h, --help", "this text");
    rows.emplace_back("    --version", "print the version and exit");
    std::size_t column = 0;
    for (const auto& p : positionals_)
      if (!p.help.empty()) column = std::max(column, p.metavar.size());
    for (const auto& r : rows)
      if (r.first.size() <= max_column) column = std::max(column, r.first.size());
    column += 4;  // the indent and two spaces

    std::string text = "usage: " + indented(synopsis_, std::string(7, ' ')) + "\n";
    if (!description_.empty()) text += description_ + "\n";
    bool any_positional_help = false;
    for (const auto& p : positionals_) any_positional_help |= !p.help.empty();
    if (any_positional_help) {
      text += "\narguments:\n";
      for (const auto& p : positionals_) text += row(std::string(indent) + p.metavar, p.help, column);
    }
    text += "\noptions:\n";
    for (const auto& r : rows) text += row(indent + r.first, r.second, column);
    return text;
  }

 private:
  struct option_spec {
    std::vector<std::string> names;
    std::string metavar;
    std::string help;
    std::function<void()> set;                       // a flag
    std::function<void(const std::string&)> take;    // an option with a value
  };
  struct positional_spec {
    std::string metavar;
    std::string help;
    std::function<void(const std::string&)> take;
    bool required;
    bool repeated;
  };
  static constexpr std::size_t max_column = 22;  // a longer left column puts the help on the next line
  static constexpr const char* indent = "  ";

  static std::vector<std::string> split_names(std::string_view names) {
    std::vector<std::string> out;
    while (!names.empty()) {
      const std::size_t comma = names.find(',');
      std::string_view name = names.substr(0, comma);
      while (!name.empty() && name.front() == ' ') name.remove_prefix(1);
      while (!name.empty() && name.back() == ' ') name.remove_suffix(1);
      if (name.size() < 2 || name[0] != '-' || (name.size() > 2 && name[1] != '-') || name == "--") {
        throw std::logic_error("arg_parser: '" + std::string(name) + "' is not an option name (-x or --name)");
      }
      out.emplace_back(name);
      if (comma == std::string_view::npos) break;
      names.remove_prefix(comma + 1);
    }
    if (out.empty()) throw std::logic_error("arg_parser: an option without a name");
    return out;
  }

  option_spec* find(const std::string& name) {
    for (auto& o : options_)
      for (const auto& n : o.names)
        if (n == name) return &o;
    return nullptr;
  }

  // An action's usage_error, said with the option or argument it is about.
  template <class Action>
  static void run_action(const std::string& what, Action&& action) {
    try {
      action();
    } catch (const usage_error& e) {
      throw usage_error(what + ": " + e.what());
    }
  }

  static std::string left_column(const option_spec& o) {
    std::string left;
    for (const auto& n : o.names) left += (left.empty() ? "" : ", ") + n;
    if (o.names.front().size() > 2) left = "    " + left;
    if (!o.metavar.empty()) left += " " + o.metavar;
    return left;
  }

  static std::string indented(const std::string& text, const std::string& by) {
    std::string out;
    for (char c : text) {
      out += c;
      if (c == '\n') out += by;
    }
    return out;
  }

  static std::string row(const std::string& left, const std::string& help, std::size_t column) {
    if (help.empty()) return left + "\n";
    const std::string pad(column, ' ');
    std::string out = left;
    if (left.size() + 2 > column) {
      out += "\n" + pad;
    } else {
      out += std::string(column - left.size(), ' ');
    }
    return out + indented(help, pad) + "\n";
  }

  std::string program_, version_, synopsis_, description_;
  std::vector<option_spec> options_;
  std::vector<positional_spec> positionals_;
};

}  // namespace glake::tools
