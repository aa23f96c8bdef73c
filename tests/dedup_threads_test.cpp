// The dedup client and broker under threads, in one process: a broker serving on its own thread,
// several threads publishing through one shared client and through clients of their own at once
// (the client's lock; the broker's serialisation of racing publishers).
#include <doctest/doctest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "glake/sharing/dedup_broker.hpp"
#include "glake/sharing/dedup_client.hpp"

namespace {

using namespace glake;

constexpr std::size_t piece = 64 * KiB;

struct anonymous_range {
  std::size_t bytes;
  std::uint32_t* words;
  anonymous_range(std::size_t n, std::uint32_t seed)
      : bytes(n),
        words(static_cast<std::uint32_t*>(::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0))) {
    REQUIRE(static_cast<void*>(words) != MAP_FAILED);
    for (std::size_t i = 0; i < n / 4; ++i) words[i] = seed * 2654435761u + static_cast<std::uint32_t>(i);
  }
  anonymous_range(const anonymous_range&) = delete;
  anonymous_range& operator=(const anonymous_range&) = delete;
  ~anonymous_range() { ::munmap(words, bytes); }
  bool holds(std::uint32_t seed) const {
    for (std::size_t i = 0; i < bytes / 4; ++i) {
      if (words[i] != seed * 2654435761u + static_cast<std::uint32_t>(i)) return false;
    }
    return true;
  }
};

TEST_CASE("threads: dedup publishers on several threads, through one client and their own, share one copy") {
  char name[] = "/tmp/glake-dedup-threads-XXXXXX";
  REQUIRE(::mkdtemp(name) != nullptr);
  const std::string dir = name;
  const std::string path = dir + "/broker.sock";
  int stop[2];
  REQUIRE(::pipe(stop) == 0);
  {
    dedup_broker broker(path);
    std::thread server([&] { broker.run(stop[0]); });
    dedup_client_options options;
    options.chunk_bytes = piece;
    options.report = [](std::string_view) {};
    dedup_client<> common(path, options);
    constexpr int threads = 4;
    std::atomic<int> ready{0}, published{0};
    std::vector<int> stored(2 * threads), shared(2 * threads), intact(2 * threads);
    std::vector<std::thread> workers;
    for (int t = 0; t < 2 * threads; ++t) {
      workers.emplace_back([&, t] {
        dedup_client<> own(path, options);
        dedup_client<>& client = t % 2 == 0 ? common : own;
        anonymous_range mine(4 * piece, 7);
        ++ready;
        while (ready.load() < 2 * threads) std::this_thread::yield();
        const publish_result r = client.publish(mine.words, mine.bytes);
        stored[static_cast<std::size_t>(t)] = static_cast<int>(r.stored);
        shared[static_cast<std::size_t>(t)] = static_cast<int>(r.shared);
        intact[static_cast<std::size_t>(t)] = mine.holds(7);
        ++published;  // every copy stays published until all threads published theirs
        while (published.load() < 2 * threads) std::this_thread::yield();
        client.make_private(mine.words, mine.bytes);  // before the range is unmapped
      });
    }
    for (auto& w : workers) w.join();
    int total_stored = 0, total_shared = 0;
    for (int t = 0; t < 2 * threads; ++t) {
      total_stored += stored[static_cast<std::size_t>(t)];
      total_shared += shared[static_cast<std::size_t>(t)];
      CHECK(intact[static_cast<std::size_t>(t)] == 1);
    }
    // Each of the 4 pieces was stored by exactly one thread; every other publish shared it.
    CHECK(total_stored == 4);
    CHECK(total_shared == 4 * (2 * threads - 1));
    const auto s = common.broker_statistics();
    REQUIRE(s);
    CHECK(s->references == 0);
    CHECK(s->objects == 0);
    CHECK(s->publishes == static_cast<std::uint64_t>(4 * 2 * threads));
    char c = 's';
    REQUIRE(::write(stop[1], &c, 1) == 1);
    server.join();
  }
  ::close(stop[0]);
  ::close(stop[1]);
  std::filesystem::remove_all(dir);
}

}  // namespace
