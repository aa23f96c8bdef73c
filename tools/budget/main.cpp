// glake-budget: the coordinator that lets processes on one GPU share one device budget
// (include/glake/scheduling/budget_coordinator.hpp, docs/scheduling.md), and a query of a
// running one.
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <string_view>

#include "glake/config.hpp"
#include "glake/config_io.hpp"
#include "glake/detail/printable.hpp"
#include "glake/errors.hpp"
#include "glake/scheduling/budget_coordinator.hpp"
#include "glake/scheduling/coordinated_budget.hpp"
#include "../args.hpp"
#include "../json.hpp"
#include "../service.hpp"

namespace {

// "40G", "512M", "1.5T", "1048576" (powers of 1024, as config strings read them); nullopt when
// not a positive size.
std::optional<std::size_t> parse_bytes(const std::string& text) {
  std::size_t n = 0;
  if (glake::detail::parse_size(text, n) != glake::detail::parse_status::ok || n == 0) return std::nullopt;
  return n;
}

int print_stats(const std::string& path, bool json) {
  std::string why;
  const auto s = glake::query_budget_coordinator(path, why);
  if (!s) {
    std::fprintf(stderr, "glake-budget: no coordinator answers at %s (%s)\n", path.c_str(), why.c_str());
    return 1;
  }
  if (json) {
    std::printf("{\"budget\":%" PRIu64 ",\"used\":%" PRIu64 ",\"workloads\":%" PRIu32 ",\"lines\":[", s->budget,
                s->used, s->workloads);
    bool first = true;
    for (const auto& w : s->lines) {
      std::printf("%s{\"id\":%" PRIu32 ",\"name\":\"%s\",\"held\":%zu,\"pinned\":%zu,\"predicted\":%zu}",
                  first ? "" : ",", w.id, glake::tools::json_escape(glake::detail::printable(w.name)).c_str(), w.held,
                  w.pinned, w.predicted);
      first = false;
    }
    std::printf("]}\n");
    return 0;
  }
  std::printf("budget %" PRIu64 "\nused %" PRIu64 "\nworkloads %" PRIu32 "\n", s->budget, s->used, s->workloads);
  for (const auto& w : s->lines) {
    std::printf("workload %" PRIu32 " %s held %zu pinned %zu predicted %zu\n", w.id, glake::detail::printable(w.name).c_str(), w.held, w.pinned,
                w.predicted);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string path, budget_text;
  std::optional<std::string> group_name;
  std::optional<std::size_t> device_bytes;
  glake::budget_coordinator_options options;
  bool stats = false, json = false, quiet = false;
  glake::tools::arg_parser args(
      "glake-budget", GLAKE_TOOLS_VERSION,
      "glake-budget --socket PATH --budget SIZE|FRACTION [--device-bytes N] [--group NAME] [--quiet]\n"
      "glake-budget --socket PATH --stats [--json]",
      "Holds one device budget for the workloads of several processes on one GPU, on the Unix\n"
      "socket PATH, until SIGTERM or SIGINT. Only processes of this user connect (socket mode\n"
      "0600), and members of the group NAME when given (mode 0660, the socket given to that\n"
      "group). A second coordinator on the same PATH exits at once with status 0 and says so.");
  args.option("--socket", "PATH", "the socket (PATH.lock beside it marks the coordinator that owns it)", path)
      .option("--budget", "SIZE|FRACTION",
              "bytes, with an optional K, M, G or T suffix (powers of 1024): 40G;\n"
              "or a fraction in (0, 1] of the device, which --device-bytes gives: 0.8",
              budget_text)
      .option("--device-bytes", "N", "the device's memory in bytes (suffixes as above)",
              [&](const std::string& text) {
                device_bytes = parse_bytes(text);
                if (!device_bytes) throw glake::tools::usage_error("takes a positive size, not '" + text + "'");
              })
      .option("--group", "NAME", "also admit the members of this group", group_name)
      .flag("--stats", "print a running coordinator's ledger and exit", stats)
      .flag("--json", "with --stats: the ledger as one JSON object", json)
      .flag("--quiet", "no start and stop lines on stderr", quiet);
  args.parse_or_exit(argc, argv);
  if (path.empty()) args.fail("--socket PATH is required");
  if (json && !stats) args.fail("--json goes with --stats");
  return glake::tools::serve("glake-budget", quiet, [&]() -> int {
    if (stats) return print_stats(path, json);
    if (budget_text.empty()) args.fail("--budget is required");
    std::optional<glake::budget_ledger> ledger;
    // A fraction is a plain decimal number with a point ("0.8"); "1.5T" is a size.
    const bool fractional = budget_text.find('.') != std::string::npos &&
                            budget_text.find_first_not_of("0123456789.") == std::string::npos;
    if (fractional) {
      char* end = nullptr;
      const double fraction = std::strtod(budget_text.c_str(), &end);
      if (end == budget_text.c_str() || *end != '\0' || !(fraction > 0.0 && fraction <= 1.0)) {
        args.fail("--budget " + budget_text + " is not a size nor a fraction in (0, 1]");
      }
      if (!device_bytes) args.fail("a fractional --budget needs --device-bytes");
      ledger.emplace(glake::budget_ledger::fraction_of(*device_bytes, fraction));
    } else {
      const auto bytes = parse_bytes(budget_text);
      if (!bytes) args.fail("--budget takes a positive size or a fraction, not '" + budget_text + "'");
      ledger.emplace(*bytes);
    }
    if (group_name) {
      options.group = glake::tools::group_id("glake-budget", *group_name);
      if (!options.group) return 2;
    }
    glake::tools::raise_descriptor_limit();
    const int stop = glake::tools::stop_on_signals();
    glake::budget_coordinator coordinator(path, std::move(*ledger), options);
    if (!quiet) {
      std::fprintf(stderr, "glake-budget: serving %s with a budget of %zu bytes (%s) (pid %d)\n", path.c_str(),
                   coordinator.budget(), glake::format_bytes(coordinator.budget()).c_str(), static_cast<int>(::getpid()));
    }
    coordinator.run(stop);
    if (!quiet) {
      const auto s = coordinator.stats();
      std::fprintf(stderr,
                   "glake-budget: stopped; %" PRIu64 " grants, %" PRIu64 " waits, %" PRIu64 " timeouts, %" PRIu64
                   " reclaims\n",
                   s.grants, s.waits, s.timeouts, s.reclaims);
    }
    return 0;
  });
}
