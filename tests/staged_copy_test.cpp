// staged_copier and staging_ring over the host model (host_dma_backend: streams are threads,
// "device memory" is ordinary memory named so by a range_classifier): bytes of every size both
// ways, the return and ordering rules, errors, a driver failure at every call, and threads.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "glake/backends/host_dma.hpp"
#include "glake/movers/staged_copy.hpp"
#include "glake/movers/staging_ring.hpp"
#include "support/faulty_copy_backend.hpp"

namespace {

using namespace glake;
using namespace std::chrono_literals;
using host_copier = staged_copier<host_dma_backend, range_classifier>;
using faulty_copier = staged_copier<testing::faulty_copy_backend, range_classifier>;
static_assert(byte_copier<host_copier>);
static_assert(byte_copier<faulty_copier>);

constexpr std::size_t chunk = 4096;

// Small chunks and a short ring, so that a few KiB exercise every stage of the pipeline.
staged_copy_options small_options(unsigned threads = 3, std::size_t chunks = 3) {
  staged_copy_options o;
  o.chunk_bytes = chunk;
  o.chunks = chunks;
  o.threads = threads;
  o.min_slice = 256;
  return o;
}

std::vector<unsigned char> pattern(std::size_t bytes, unsigned seed) {
  std::vector<unsigned char> v(bytes);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

// "Device memory" of device 0: a buffer the classifier calls so, with `guard` bytes either side
// that no copy may touch.
struct device_region {
  static constexpr std::size_t guard = 64;
  device_region(range_classifier& c, std::size_t bytes, int device = 0) : storage(bytes + 2 * guard, 0x5A) {
    c.add(data(), bytes, memory_kind::device, device);
  }
  unsigned char* data() { return storage.data() + guard; }
  std::size_t size() const { return storage.size() - 2 * guard; }
  bool guards_intact() const {
    for (std::size_t i = 0; i < guard; ++i) {
      if (storage[i] != 0x5A || storage[storage.size() - 1 - i] != 0x5A) return false;
    }
    return true;
  }
  std::vector<unsigned char> storage;
};

struct rig {
  explicit rig(staged_copy_options o = small_options(), std::chrono::microseconds delay = 0us,
               std::size_t device_bytes = 64 * chunk)
      : backend(0, delay), device(classifier, device_bytes), copier(backend, classifier, o) {}
  host_dma_backend backend;
  range_classifier classifier;
  device_region device;
  host_copier copier;
};

// Each chunk's device copy, a delay: a copier that rewrote a buffer before its copy ran, or read
// a destination before the copy into it ran, is caught.
constexpr auto slow_dma = 300us;

// 1 byte, odd sizes, the slice size (256) and around it, around one chunk, the ring (3 chunks)
// and around it, many chunks with and without a partial last one.
const std::size_t sizes[] = {1,     7,         63,        64,         255,           256,
                             257,   1000,      chunk - 1, chunk,      chunk + 1,     3 * chunk,
                             3 * chunk + 1, 7 * chunk + 123, 13 * chunk, 40 * chunk + 77};

}  // namespace

TEST_CASE("staged_copier copies pageable memory to the device and back, for every size") {
  for (const staged_copy_options& o : {small_options(3, 3), small_options(0, 2), small_options(1, 1),
                                       small_options(4, 5)}) {
    CAPTURE(o.threads);
    CAPTURE(o.chunks);
    rig r(o, slow_dma / 10);
    for (const std::size_t n : sizes) {
      CAPTURE(n);
      for (const std::size_t offset : {std::size_t{0}, std::size_t{3}}) {
        const std::vector<unsigned char> expected = pattern(n, static_cast<unsigned>(n + offset));
        std::vector<unsigned char> source = expected;
        unsigned char* const dev = r.device.data() + offset;
        const stream_ref stream{std::uintptr_t{7}};
        r.copier.copy(dev, source.data(), n, stream);
        // The source was read when copy returned: the caller may reuse it at once.
        std::memset(source.data(), 0xEE, n);
        r.backend.wait_stream(stream);
        CHECK(std::memcmp(dev, expected.data(), n) == 0);

        // Back to pageable memory: the data is there when copy returns, without a wait.
        std::vector<unsigned char> back(n, 0xEE);
        r.copier.copy(back.data(), dev, n, stream);
        CHECK(back == expected);
        CHECK(r.device.guards_intact());
      }
    }
    CHECK(r.backend.source_changes() == 0);
    const staged_copy_statistics s = r.copier.stats();
    CHECK(s.staged_copies == 2 * 2 * std::size(sizes));
    CHECK(s.direct_copies == 0);
    CHECK(s.staging_bytes <= o.chunks * chunk);
    CHECK(s.staging_bytes == r.backend.live_staging() * chunk);
    CHECK(r.backend.live_staging() <= o.chunks);
    // release_staging gives every pinned buffer back, and the statistics say so.
    r.copier.release_staging();
    CHECK(r.copier.stats().staging_bytes == 0);
    CHECK(r.backend.live_staging() == 0);
  }
}

TEST_CASE("staged_copier reuses a staging buffer only after its device copy completed") {
  // Slow device copies, a ring of 2 and many chunks: each buffer is refilled while the copy of
  // the chunk before is queued behind a 300 us delay, unless the copier waits for its event.
  rig r(small_options(3, 2), slow_dma);
  const std::size_t n = 12 * chunk + 5;
  const std::vector<unsigned char> a = pattern(n, 1);
  const std::vector<unsigned char> b = pattern(n, 2);
  // Two streams: the second copy's buffers were last used by copies on the first stream.
  const stream_ref one{std::uintptr_t{1}}, two{std::uintptr_t{2}};
  r.copier.copy(r.device.data(), a.data(), n, one);
  r.copier.copy(r.device.data() + 20 * chunk, b.data(), n, two);
  r.backend.wait_stream(one);
  r.backend.wait_stream(two);
  CHECK(r.backend.source_changes() == 0);
  CHECK(std::memcmp(r.device.data(), a.data(), n) == 0);
  CHECK(std::memcmp(r.device.data() + 20 * chunk, b.data(), n) == 0);
  CHECK(r.copier.stats().chunk_copies == 2 * 13);
}

TEST_CASE("staged_copier returns from a host-to-device copy with its last device copies still queued") {
  rig r(small_options(2, 4), 20ms);
  const std::size_t n = 4 * chunk;
  const std::vector<unsigned char> a = pattern(n, 3);
  const stream_ref stream{std::uintptr_t{3}};
  r.copier.copy(r.device.data(), a.data(), n, stream);
  // Four chunks fit the ring: nothing waited for a device copy, each of which takes 20 ms.
  const auto event = r.backend.record_event(stream);
  CHECK_FALSE(r.backend.event_done(event));
  r.backend.wait_event(event);
  r.backend.recycle_event(event);
  CHECK(std::memcmp(r.device.data(), a.data(), n) == 0);
}

TEST_CASE("staged_copier queues pinned, device and host copies as they are") {
  rig r;
  std::vector<unsigned char> pinned = pattern(5 * chunk, 4);
  r.classifier.add(pinned.data(), pinned.size(), memory_kind::pinned);
  device_region other(r.classifier, 5 * chunk);
  const stream_ref stream{std::uintptr_t{4}};
  const std::uint64_t queued = r.backend.queued_items();

  r.copier.copy(r.device.data(), pinned.data(), pinned.size(), stream);         // pinned to device
  r.copier.copy(other.data(), r.device.data(), pinned.size(), stream);          // device to device
  std::vector<unsigned char> back(pinned.size());
  r.classifier.add(back.data(), back.size(), memory_kind::pinned);
  r.copier.copy(back.data(), other.data(), back.size(), stream);                // device to pinned
  // Each is one copy on the stream; no staging memory was made.
  CHECK(r.backend.queued_items() == queued + 3);
  CHECK(r.backend.live_staging() == 0);
  r.backend.wait_stream(stream);
  CHECK(back == pinned);
  const staged_copy_statistics s = r.copier.stats();
  CHECK(s.direct_copies == 3);
  CHECK(s.direct_bytes == 3 * pinned.size());
  CHECK(s.staged_copies == 0);
  CHECK(s.staging_bytes == 0);

  // A host range that is pinned at its start but not at its end is staged.
  std::vector<unsigned char> half = pattern(4 * chunk, 5);
  r.classifier.add(half.data(), 2 * chunk, memory_kind::pinned);
  r.copier.copy(r.device.data(), half.data(), half.size(), stream);
  CHECK(r.copier.stats().staged_copies == 1);
  r.backend.wait_stream(stream);
  CHECK(std::memcmp(r.device.data(), half.data(), half.size()) == 0);
}

TEST_CASE("staged_copier orders its copies after the work queued before them on the stream") {
  rig r(small_options(), slow_dma / 10);
  const stream_ref stream{std::uintptr_t{5}};
  const std::size_t n = 9 * chunk + 11;
  unsigned char* const dev = r.device.data();

  SUBCASE("host to device: a slow kernel writing the target first does not overwrite the copy") {
    r.backend.launch(stream, [dev, n] {
      std::this_thread::sleep_for(30ms);
      std::memset(dev, 0xAB, n);
    });
    const std::vector<unsigned char> a = pattern(n, 6);
    r.copier.copy(dev, a.data(), n, stream);
    r.backend.wait_stream(stream);
    CHECK(std::memcmp(dev, a.data(), n) == 0);
  }
  SUBCASE("device to host: the copy reads what a slow kernel queued before it wrote") {
    std::memset(dev, 0x11, n);
    r.backend.launch(stream, [dev, n] {
      std::this_thread::sleep_for(30ms);
      std::memset(dev, 0xCD, n);
    });
    std::vector<unsigned char> back(n, 0);
    r.copier.copy(back.data(), dev, n, stream);
    CHECK(back == std::vector<unsigned char>(n, 0xCD));
  }
}

TEST_CASE("staged_copier waits for nothing but its own stream") {
  rig r;
  const stream_ref mine{std::uintptr_t{10}}, busy{std::uintptr_t{11}};
  // The other stream stays busy until the copy is done; a copier that waited for the whole
  // device would wait here until the timeout.
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  bool timed_out = false;
  r.backend.launch(busy, [released, &timed_out] { timed_out = released.wait_for(10s) == std::future_status::timeout; });
  const std::size_t n = 6 * chunk;
  std::memset(r.device.data(), 0x42, n);
  std::vector<unsigned char> back(n);
  const auto start = std::chrono::steady_clock::now();
  r.copier.copy(back.data(), r.device.data(), n, mine);
  CHECK(std::chrono::steady_clock::now() - start < 5s);
  CHECK(back == std::vector<unsigned char>(n, 0x42));
  release.set_value();
  r.backend.wait_stream(busy);
  CHECK_FALSE(timed_out);
}

TEST_CASE("staged_copier refuses misuse before copying anything") {
  rig r;
  device_region foreign(r.classifier, 4 * chunk, 1);  // device 1's memory
  std::vector<unsigned char> host = pattern(8 * chunk, 7);
  const std::vector<unsigned char> host_before = host;
  std::memset(r.device.data(), 0x33, r.device.size());
  const std::uint64_t queued = r.backend.queued_items();
  const auto refused = [&](void* dst, const void* src, std::size_t n, const char* words) {
    CAPTURE(words);
    try {
      r.copier.copy(dst, src, n);
      FAIL("no usage_error");
    } catch (const usage_error& e) {
      CHECK(e.which() == usage_error::kind::bad_argument);
      CHECK(std::string(e.what()).find(words) != std::string::npos);
    }
  };
  refused(nullptr, host.data(), 10, "destination is a null pointer");
  refused(r.device.data(), nullptr, 10, "source is a null pointer");
  refused(reinterpret_cast<void*>(~std::uintptr_t{0} - 10), host.data(), 100, "past the end of the address space");
  refused(r.device.data(), reinterpret_cast<const void*>(~std::uintptr_t{0} - 10), 100,
          "past the end of the address space");
  refused(r.device.data() + 10, r.device.data(), 100, "overlap");
  refused(host.data(), host.data() + 99, 100, "overlap");
  refused(foreign.data(), host.data(), 100, "device memory of device 1");
  refused(host.data(), foreign.data(), 100, "device memory of device 1");
  refused(r.device.data() + r.device.size() - 10, host.data(), 100, "begins in device memory");
  CHECK(r.backend.queued_items() == queued);
  CHECK(host == host_before);
  CHECK(std::all_of(r.device.data(), r.device.data() + r.device.size(), [](unsigned char b) { return b == 0x33; }));
  CHECK(r.copier.stats().staged_copies + r.copier.stats().direct_copies == 0);

  // Zero bytes: nothing at all, not even a look at the pointers.
  const std::uint64_t lookups = r.classifier.lookups();
  r.copier.copy(nullptr, nullptr, 0);
  r.copier.copy(r.device.data(), host.data(), 0);
  CHECK(r.classifier.lookups() == lookups);
  CHECK(r.backend.queued_items() == queued);

  staged_copy_options bad = small_options();
  bad.chunk_bytes = 0;
  CHECK_THROWS_AS(host_copier(r.backend, r.classifier, bad), config_error);
  bad = small_options();
  bad.chunks = 0;
  CHECK_THROWS_AS(host_copier(r.backend, r.classifier, bad), config_error);
  bad = small_options();
  bad.min_slice = 0;
  CHECK_THROWS_AS(host_copier(r.backend, r.classifier, bad), config_error);
  bad = small_options();
  bad.chunks = 3;
  bad.chunk_bytes = ~std::size_t{0} / 2;
  CHECK_THROWS_AS(host_copier(r.backend, r.classifier, bad), config_error);
}

TEST_CASE("staged_copier survives a driver failure at every call, losing no staging buffer") {
  // The nth fallible call (staging allocation, copy, event record or query) fails, for n = 1, 2,
  // ... until a round completes with no fault: each call of a round was failed once.
  host_dma_backend backend(0, slow_dma / 10);
  range_classifier classifier;
  device_region device(classifier, 64 * chunk);
  auto faults = std::make_shared<testing::copy_faults>();
  const std::size_t n = 9 * chunk + 100;  // 10 chunks through a ring of 3, both ways
  const std::vector<unsigned char> a = pattern(n, 8);
  const std::vector<unsigned char> b = pattern(n, 9);
  const stream_ref stream{std::uintptr_t{12}};
  std::uint64_t failures = 0;
  for (std::uint64_t k = 1;; ++k) {
    CAPTURE(k);
    bool faulted = false;
    {
      faulty_copier copier(testing::faulty_copy_backend(backend, faults), classifier, small_options(3, 3));
      // A round that fills the ring first, so that later calls find buffers with events pending.
      copier.copy(device.data() + 32 * chunk, b.data(), n, stream);
      faults->fail_nth_call(k);
      try {
        copier.copy(device.data(), a.data(), n, stream);
        std::vector<unsigned char> back(n);
        copier.copy(back.data(), device.data(), n, stream);
        backend.wait_stream(stream);
        CHECK(back == a);
      } catch (const driver_error& e) {
        faulted = true;
        CHECK(std::string(e.what()).find("injected") != std::string::npos);
      } catch (const out_of_memory& e) {
        faulted = true;
        CHECK(std::string(e.what()).find("pinned staging buffer") != std::string::npos);
      }
      faults->never_fail();
      // No buffer lost, no event forgotten: at most one buffer and one event a slot.
      CHECK(backend.live_staging() <= 3);
      CHECK(backend.live_events() <= 3);
      // Still usable: both directions, the bytes right.
      copier.copy(device.data(), b.data(), n, stream);
      std::vector<unsigned char> back(n);
      copier.copy(back.data(), device.data(), n, stream);
      CHECK(back == b);
    }
    CHECK(backend.live_staging() == 0);
    CHECK(backend.live_events() == 0);
    CHECK(backend.source_changes() == 0);
    if (!faulted) break;
    ++failures;
    REQUIRE(k < 1000);
  }
  CHECK(failures == faults->faults());
  CHECK(failures >= 20);  // 10 chunks each way: many calls to fail
}

TEST_CASE("staged_copier loads a file range into device memory") {
  char path[] = "/tmp/glake_staged_copy_XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  ::unlink(path);
  const std::size_t file_bytes = 20 * chunk + 321;
  const std::vector<unsigned char> contents = pattern(file_bytes, 10);
  REQUIRE(::write(fd, contents.data(), file_bytes) == static_cast<ssize_t>(file_bytes));
  rig r(small_options(3, 3), slow_dma / 10);
  const stream_ref stream{std::uintptr_t{13}};
  for (const std::size_t offset : {std::size_t{0}, std::size_t{1}, chunk, std::size_t{5000}}) {
    for (const std::size_t n : {std::size_t{1}, std::size_t{300}, chunk, 3 * chunk + 1, file_bytes - offset}) {
      CAPTURE(offset);
      CAPTURE(n);
      std::memset(r.device.data(), 0, r.device.size());
      r.copier.copy_from_file(r.device.data(), fd, offset, n, stream);
      r.backend.wait_stream(stream);
      CHECK(std::memcmp(r.device.data(), contents.data() + offset, n) == 0);
      CHECK(r.device.guards_intact());
    }
  }
  CHECK(r.copier.stats().file_reads == 20);

  // Past the end of the file: refused midway, then usable again.
  CHECK_THROWS_AS(r.copier.copy_from_file(r.device.data(), fd, 7 * chunk, 14 * chunk, stream), usage_error);
  r.copier.copy_from_file(r.device.data(), fd, 0, 10 * chunk, stream);
  r.backend.wait_stream(stream);
  CHECK(std::memcmp(r.device.data(), contents.data(), 10 * chunk) == 0);
  std::vector<unsigned char> host(100);
  CHECK_THROWS_AS(r.copier.copy_from_file(host.data(), fd, 0, 100, stream), usage_error);
  CHECK_THROWS_AS(r.copier.copy_from_file(r.device.data(), -1, 0, 100, stream), usage_error);
  CHECK_THROWS_AS(r.copier.copy_from_file(r.device.data(), fd, ~std::uint64_t{0} - 5, 100, stream), usage_error);
  // A read error names pread and errno (a write-only descriptor: EBADF).
  const int write_only = ::open("/dev/null", O_WRONLY);
  REQUIRE(write_only >= 0);
  try {
    r.copier.copy_from_file(r.device.data(), write_only, 0, 10 * chunk, stream);
    FAIL("no driver_error");
  } catch (const driver_error& e) {
    CHECK(e.call() == "pread");
    CHECK(e.code() == EBADF);
  }
  ::close(write_only);
  ::close(fd);
  r.backend.wait_stream(stream);
  CHECK(r.backend.live_staging() <= 3);
}

TEST_CASE("threads: several threads copy through one staged_copier at once") {
  rig r(small_options(3, 3), slow_dma / 20, 4 * 64 * chunk);
  std::vector<unsigned char> pinned = pattern(4 * chunk, 11);
  r.classifier.add(pinned.data(), pinned.size(), memory_kind::pinned);
  constexpr int threads = 4;
  std::vector<int> bad(threads, 0);
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      const stream_ref stream{static_cast<std::uintptr_t>(100 + t)};
      unsigned char* const dev = r.device.data() + static_cast<std::size_t>(t) * 64 * chunk;
      std::mt19937 rng(static_cast<unsigned>(t));
      for (int round = 0; round < 12; ++round) {
        const std::size_t n = 1 + rng() % (30 * chunk);
        const std::vector<unsigned char> a = pattern(n, static_cast<unsigned>(1000 * t + round));
        r.copier.copy(dev, a.data(), n, stream);
        std::vector<unsigned char> back(n);
        r.copier.copy(back.data(), dev, n, stream);
        if (back != a) ++bad[t];
        // A direct copy between them, which does not wait for the staged ones.
        r.copier.copy(dev + 32 * chunk, pinned.data(), pinned.size(), stream);
        r.backend.wait_stream(stream);
        if (std::memcmp(dev + 32 * chunk, pinned.data(), pinned.size()) != 0) ++bad[t];
      }
    });
  }
  for (std::thread& w : workers) w.join();
  for (int t = 0; t < threads; ++t) CHECK(bad[t] == 0);
  const staged_copy_statistics s = r.copier.stats();
  CHECK(s.staged_copies == 2 * threads * 12);
  CHECK(s.direct_copies == threads * 12);
  CHECK(r.backend.source_changes() == 0);
  CHECK(r.backend.live_staging() <= 3);
}

TEST_CASE("staging_ring makes slots on first use and reuses one only after its event") {
  host_dma_backend backend(0, 20ms);
  auto faults = std::make_shared<testing::copy_faults>();
  {
    staging_ring<testing::faulty_copy_backend> ring(testing::faulty_copy_backend(backend, faults), 2, 1000);
    CHECK(ring.allocated_bytes() == 0);
    CHECK(ring.data(0) == nullptr);
    void* const first = ring.acquire(0);
    CHECK(first != nullptr);
    CHECK(ring.allocated_bytes() == 1000);
    CHECK(backend.live_staging() == 1);

    // A copy out of slot 0 queued behind 20 ms: the slot is not ready, and acquire waits for it.
    std::vector<unsigned char> target(1000);
    std::memset(first, 0x77, 1000);
    const stream_ref stream{std::uintptr_t{20}};
    ring.backend().enqueue_copy(target.data(), first, 1000, stream);
    ring.release_after(0, stream);
    CHECK_FALSE(ring.ready(0));
    CHECK(ring.acquire(0) == first);
    CHECK(target == std::vector<unsigned char>(1000, 0x77));
    CHECK(ring.ready(0));

    // Out of pinned memory: out_of_memory, the slot stays unmade and can be made later.
    faults->fail_nth_call(1);
    CHECK_THROWS_AS(ring.acquire(1), out_of_memory);
    CHECK(ring.data(1) == nullptr);
    CHECK(ring.acquire(1) != nullptr);

    // An event that cannot be recorded: the stream is waited for, the slot is free.
    ring.backend().enqueue_copy(target.data(), first, 1000, stream);
    faults->fail_nth_call(1);
    CHECK_THROWS_AS(ring.release_after(0, stream), driver_error);
    CHECK(ring.ready(0));
    CHECK(backend.live_events() == 0);

    CHECK(ring.slot(0) == 0);
    ring.advance(3);
    CHECK(ring.slot(0) == 1);
    CHECK(ring.slot(1) == 0);
    ring.trim();
    CHECK(backend.live_staging() == 0);
    CHECK(ring.allocated_bytes() == 0);
    CHECK(ring.acquire(0) != nullptr);
  }
  CHECK(backend.live_staging() == 0);
  CHECK_THROWS_AS(staging_ring<host_dma_backend>(backend, 0, 10), usage_error);
}
