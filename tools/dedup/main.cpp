// glake-dedup: the broker that lets processes share identical read-only memory
// (include/glake/sharing/dedup_broker.hpp, docs/dedup.md), and a query of a running one.
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "glake/config.hpp"
#include "glake/config_io.hpp"
#include "glake/errors.hpp"
#include "glake/sharing/dedup_broker.hpp"
#include "glake/sharing/dedup_client.hpp"
#include "../args.hpp"
#include "../service.hpp"
#ifdef GLAKE_DEDUP_CUDA
#include "glake/sharing/cuda_sharing.hpp"
#endif

namespace {

int print_stats(const std::string& path, bool json) {
  glake::dedup_client_options options;
  options.report = [](std::string_view) {};
  glake::dedup_client<> client(path, options);
  std::string why;
  const auto s = client.broker_statistics(why);
  if (!s) {
    std::fprintf(stderr, "glake-dedup: no broker answers at %s (%s)\n", path.c_str(), why.c_str());
    return 1;
  }
  // The query's own connection is one of the clients.
  const std::uint64_t clients = s->clients - 1;
  if (json) {
    std::printf("{\"clients\":%" PRIu64 ",\"objects\":%" PRIu64 ",\"object_bytes\":%" PRIu64 ",\"references\":%" PRIu64
                ",\"publishes\":%" PRIu64 ",\"shared\":%" PRIu64 ",\"refused\":%" PRIu64 "}\n",
                clients, s->objects, s->object_bytes, s->references, s->publishes, s->shared, s->refused);
    return 0;
  }
  std::printf("clients %" PRIu64 "\nobjects %" PRIu64 "\nobject_bytes %" PRIu64 "\nreferences %" PRIu64
              "\npublishes %" PRIu64 "\nshared %" PRIu64 "\nrefused %" PRIu64 "\n",
              clients, s->objects, s->object_bytes, s->references, s->publishes, s->shared, s->refused);
  return 0;
}

template <class Verifier>
void serve_broker(const std::string& path, const glake::dedup_broker_options& options, bool quiet, int stop,
                  Verifier verifier) {
  glake::basic_dedup_broker<Verifier> broker(path, options, std::move(verifier));
  if (!quiet) std::fprintf(stderr, "glake-dedup: serving %s (pid %d)\n", path.c_str(), static_cast<int>(::getpid()));
  broker.run(stop);
  if (!quiet) {
    const auto s = broker.stats();
    std::fprintf(stderr, "glake-dedup: stopped; %" PRIu64 " publishes, %" PRIu64 " shared, %" PRIu64 " refused\n",
                 s.publishes, s.shared, s.refused);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string path;
  std::optional<std::string> group_name;
  glake::dedup_broker_options options;
  bool stats = false, json = false, quiet = false;
  std::optional<int> device;
  glake::tools::arg_parser args(
      "glake-dedup", GLAKE_TOOLS_VERSION,
      "glake-dedup --socket PATH [--device N] [--group NAME] [--max-objects N] [--max-client-bytes SIZE]\n"
      "            [--quiet]\n"
      "glake-dedup --socket PATH --stats [--json]",
      "Serves cross-process deduplication of read-only memory on the Unix socket PATH until\n"
      "SIGTERM or SIGINT. Only processes of this user connect (socket mode 0600), and members of\n"
      "the group NAME when given (mode 0660, the socket given to that group). A second broker on\n"
      "the same PATH exits at once with status 0 and says so.");
  args.option("--socket", "PATH", "the socket (PATH.lock beside it marks the broker that owns it)", path)
      .option("--device", "N",
              "share device memory of GPU N (CUDA allocations exported by the clients,\n"
              "such as glake_torch.share_weights) instead of host memory; needs the\n"
              "build with CUDA (glake-dedup-cuda)",
              [&](const std::string& text) {
                char* end = nullptr;
                errno = 0;
                const long n = std::strtol(text.c_str(), &end, 10);
                if (errno != 0 || end == text.c_str() || *end != '\0' || n < 0 || n > 1023) {
                  throw glake::tools::usage_error("takes a GPU ordinal, not '" + text + "'");
                }
                device = static_cast<int>(n);
              })
      .option("--group", "NAME", "also admit the members of this group", group_name)
      .option("--max-objects", "N", "index at most N distinct objects (each holds one descriptor)",
              [&](const std::string& text) {
                char* end = nullptr;
                errno = 0;
                const unsigned long long n = std::strtoull(text.c_str(), &end, 10);
                if (errno != 0 || end == text.c_str() || *end != '\0' || n == 0 || text[0] == '-') {
                  throw glake::tools::usage_error("takes a positive number, not '" + text + "'");
                }
                options.max_objects = static_cast<std::size_t>(n);
              })
      .option("--max-client-bytes", "SIZE",
              "each connection may have at most SIZE bytes (e.g. 16G) of objects it\n"
              "stored indexed; sharing what is indexed already is not counted",
              [&](const std::string& text) {
                std::size_t n = 0;
                if (glake::detail::parse_size(text, n) != glake::detail::parse_status::ok || n == 0) {
                  throw glake::tools::usage_error("takes a positive size (1048576, 512M, 16G), not '" + text + "'");
                }
                options.max_client_bytes = n;
              })
      .flag("--stats", "print a running broker's counters and exit", stats)
      .flag("--json", "with --stats: the counters as one JSON object", json)
      .flag("--quiet", "no start and stop lines on stderr", quiet);
  args.parse_or_exit(argc, argv);
  if (path.empty()) args.fail("--socket PATH is required");
  if (json && !stats) args.fail("--json goes with --stats");
  return glake::tools::serve("glake-dedup", quiet, [&]() -> int {
    if (stats) return print_stats(path, json);
    if (group_name) {
      options.group = glake::tools::group_id("glake-dedup", *group_name);
      if (!options.group) return 2;
    }
    glake::tools::raise_descriptor_limit();
    const int stop = glake::tools::stop_on_signals();
    if (device) {
#ifdef GLAKE_DEDUP_CUDA
      serve_broker(path, options, quiet, stop, glake::cuda_content_verifier(*device));
#else
      std::fprintf(stderr, "glake-dedup: --device needs the build with CUDA (glake-dedup-cuda)\n");
      return 2;
#endif
    } else {
      serve_broker(path, options, quiet, stop, glake::host_content_verifier());
    }
    return 0;
  });
}
