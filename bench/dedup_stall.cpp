// How long one large publish holds up the dedup broker's other connections: a broker on a
// thread, one connection publishing an object of --bytes whose equal is indexed already (the
// broker compares the two byte for byte), and another asking for the broker's counters in a loop
// meanwhile, each answer timed: how many were answered while the publish waited for its answer,
// and how long they took (the longest: the stall). Host memory (sealed memfds), no GPU.
//
//   bench_dedup_stall [--bytes SIZE] [--slice SIZE] [--rounds N]
//
// --slice sets dedup_broker_options::compare_slice_bytes where the broker has it (this file also
// compiles against a broker that compares whole, which ignores it). Results:
// bench/results/dedup.md.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "glake/config_io.hpp"
#include "glake/sharing/dedup_broker.hpp"
#include "glake/sharing/dedup_protocol.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
namespace dd = glake::dedup;

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

// A sealed memfd of `bytes` bytes of one pattern, written 1 MiB at a time.
glake::detail::unique_fd sealed_object(std::size_t bytes) {
  glake::detail::unique_fd fd(::memfd_create("bench", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd || ::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) std::exit(1);
  std::vector<unsigned char> chunk(std::size_t{1} << 20);
  for (std::size_t i = 0; i < chunk.size(); ++i) chunk[i] = static_cast<unsigned char>(i * 131 + 7);
  for (std::size_t at = 0; at < bytes; at += chunk.size()) {
    const std::size_t n = std::min(chunk.size(), bytes - at);
    if (::pwrite(fd.get(), chunk.data(), n, static_cast<off_t>(at)) != static_cast<ssize_t>(n)) std::exit(1);
  }
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) != 0) std::exit(1);
  return fd;
}

// One request and its reply on a blocking connection; the reply's descriptor, if any, closed.
bool ask(int socket, const std::vector<std::byte>& request, int fd = -1) {
  const int sent = fd >= 0 ? glake::detail::send_message(socket, request, std::span<const int>(&fd, 1))
                           : glake::detail::send_message(socket, request);
  if (sent != 0) return false;
  std::byte buffer[dd::max_message_bytes];
  glake::detail::received_message m = glake::detail::receive_message(socket, buffer, 1);
  return m.error == 0 && m.size > 0;
}

std::size_t size_argument(const char* text) {
  std::size_t n = 0;
  if (glake::detail::parse_size(text, n) != glake::detail::parse_status::ok || n == 0) {
    std::fprintf(stderr, "bench_dedup_stall: not a size: '%s'\n", text);
    std::exit(2);
  }
  return n;
}

// Sets the broker's slice where it has one (slice 0: keeps its default); false where it has none.
template <class Options>
bool set_slice(Options& options, std::size_t& slice) {
  if constexpr (requires { options.compare_slice_bytes; }) {
    if (slice != 0) options.compare_slice_bytes = slice;
    slice = options.compare_slice_bytes;
    return true;
  } else {
    return false;
  }
}

double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(q * static_cast<double>(v.size() - 1))];
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t bytes = std::size_t{1} << 30, slice = 0;
  int rounds = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string arg = argv[i];
    if (arg == "--bytes") {
      bytes = size_argument(argv[i + 1]);
    } else if (arg == "--slice") {
      slice = size_argument(argv[i + 1]);
    } else if (arg == "--rounds") {
      rounds = std::atoi(argv[i + 1]);
    } else {
      std::fprintf(stderr, "usage: bench_dedup_stall [--bytes SIZE] [--slice SIZE] [--rounds N]\n");
      return 2;
    }
  }
  glake::dedup_broker_options options;
  options.max_object_bytes = bytes;
  const bool sliced = set_slice(options, slice);
  char directory[] = "/tmp/glake-bench-XXXXXX";
  if (::mkdtemp(directory) == nullptr) return 1;
  const std::string path = std::string(directory) + "/broker.sock";
  int stop[2];
  if (::pipe(stop) != 0) return 1;
  std::thread serving;
  {
    glake::dedup_broker broker(path, options);
    serving = std::thread([&] { broker.run(stop[0]); });

    glake::detail::unique_fd indexed = sealed_object(bytes);
    glake::detail::unique_fd publisher = glake::detail::connect_unix(path, 600000);
    glake::detail::unique_fd asker = glake::detail::connect_unix(path, 600000);
    if (!publisher || !asker) return 1;
    const dd::publish_request q{bytes, glake::content_digest{}};  // the digest is a key only
    if (!ask(publisher.get(), dd::encode(q, 1), indexed.get())) return 1;  // stored

    std::printf("object %.0f MiB, broker %s", static_cast<double>(bytes) / (1 << 20),
                sliced ? "comparing in slices of " : "comparing whole");
    if (sliced) std::printf("%.2f MiB", static_cast<double>(slice) / (1 << 20));
    std::printf("\nround  compare_s  answers  median_ms  p99_ms  max_ms  idle_median_ms\n");
    for (int round = 1; round <= rounds; ++round) {
      // The other connection's answers with nothing to compare, for reference.
      std::vector<double> idle;
      for (int i = 0; i < 200; ++i) {
        const auto t = clock_type::now();
        if (!ask(asker.get(), dd::encode(dd::stats_request{}, 2))) return 1;
        idle.push_back(seconds_since(t) * 1e3);
      }
      glake::detail::unique_fd again = sealed_object(bytes);
      // Asks from before the publish is sent until after it is answered; counted are those
      // whose wait overlaps the publish's.
      std::atomic<bool> comparing{true};
      std::vector<std::pair<clock_type::time_point, clock_type::time_point>> asks;
      std::thread asking([&] {
        while (comparing.load()) {
          const auto t = clock_type::now();
          if (!ask(asker.get(), dd::encode(dd::stats_request{}, 3))) return;
          asks.emplace_back(t, clock_type::now());
        }
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      const auto t = clock_type::now();
      const bool answered = ask(publisher.get(), dd::encode(q, 4), again.get());  // shared
      const auto t_end = clock_type::now();
      const double compare = std::chrono::duration<double>(t_end - t).count();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      comparing.store(false);
      asking.join();
      if (!answered) return 1;
      std::vector<double> during;
      for (const auto& [from, to] : asks) {
        if (to > t && from < t_end) during.push_back(std::chrono::duration<double>(to - from).count() * 1e3);
      }
      // The shared reference it got goes back, so that every round compares again.
      std::vector<std::byte> release = dd::encode(dd::release_request{1}, 5);  // the first object
      if (!ask(publisher.get(), release)) return 1;
      std::printf("%5d  %9.3f  %7zu  %9.3f  %6.3f  %6.1f  %14.3f\n", round, compare, during.size(),
                  quantile(during, 0.5), quantile(during, 0.99),
                  during.empty() ? 0.0 : *std::max_element(during.begin(), during.end()), quantile(idle, 0.5));
    }
    const char byte = 's';
    if (::write(stop[1], &byte, 1) != 1) return 1;
    serving.join();
  }
  ::rmdir(directory);
  return 0;
}
