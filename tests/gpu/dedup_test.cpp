// The CUDA models of the sharing contracts on a real GPU: a broker (cuda_content_verifier) on a
// thread of this process and two clients (cuda_shareable_backend, cuda_device_hasher) publishing
// regions of equal device memory; kernels check every word through the unchanged pointers, and
// cudaMemGetInfo sees the second copy given back. The device hasher's digests equal the host's
// arithmetic on the same bytes, wherever they lie.
#include <doctest/doctest.h>

#include <cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "glake/backends/cuda.hpp"
#include "glake/sharing/cuda_sharing.hpp"
#include "glake/sharing/dedup_broker.hpp"
#include "glake/sharing/dedup_client.hpp"
#include "gpu_checks.hpp"
#include "kernels.hpp"

// Every member of both, instantiated over the CUDA models.
template class glake::basic_dedup_broker<glake::cuda_content_verifier>;
template class glake::dedup_client<glake::cuda_shareable_backend, glake::cuda_staged_hasher>;
template class glake::dedup_client<glake::cuda_shareable_backend, glake::cuda_device_hasher>;

static_assert(glake::content_hasher<glake::cuda_staged_hasher>);
static_assert(glake::content_hasher<glake::cuda_device_hasher>);
static_assert(glake::shareable_backend<glake::cuda_shareable_backend>);
static_assert(glake::sliced_content_verifier<glake::cuda_content_verifier>);

namespace {

using namespace glake;
constexpr std::size_t piece = 2 * MiB;
using cuda_client = dedup_client<cuda_shareable_backend, cuda_device_hasher>;

// The digest cuda_device_hasher must give for the bytes at host address p: the kernel's
// arithmetic, done on the host.
content_digest host_reference(const unsigned char* p, std::size_t bytes) {
  std::uint64_t lanes[4] = {0, 0, 0, 0};
  detail::content_hash_lanes(p, 0, bytes / 8, lanes);
  return detail::content_digest_of(lanes, bytes, p + bytes / 8 * 8, bytes % 8);
}

// Device memory whose every 2 MiB piece is a handle of its own that only its mapping holds (as
// the PyTorch plug-in's shared regions are), so that remapping a piece gives its memory back.
struct region {
  CUdeviceptr base = 0;
  std::size_t bytes = 0;
  explicit region(std::size_t n) : bytes(n) {
    REQUIRE(cuMemAddressReserve(&base, n, 0, 0, 0) == CUDA_SUCCESS);
    const CUmemAllocationProp prop = detail::cuda_device_properties(0, false);
    for (std::size_t at = 0; at < n; at += piece) {
      CUmemGenericAllocationHandle h = 0;
      REQUIRE(cuMemCreate(&h, piece, &prop, 0) == CUDA_SUCCESS);
      REQUIRE(cuMemMap(base + at, piece, 0, h, 0) == CUDA_SUCCESS);
      REQUIRE(cuMemRelease(h) == CUDA_SUCCESS);
    }
    const CUmemAccessDesc access = detail::cuda_access(0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    REQUIRE(cuMemSetAccess(base, n, &access, 1) == CUDA_SUCCESS);
  }
  region(const region&) = delete;
  region& operator=(const region&) = delete;
  ~region() {
    for (std::size_t at = 0; at < bytes; at += piece) (void)cuMemUnmap(base + at, piece);
    (void)cuMemAddressFree(base, bytes);
  }
  void* data() const { return reinterpret_cast<void*>(base); }
  char* at(std::size_t offset) const { return static_cast<char*>(data()) + offset; }
};

// A broker serving on a thread until destroyed.
struct broker_thread {
  std::string socket;
  int stop[2] = {-1, -1};
  basic_dedup_broker<cuda_content_verifier> broker;
  std::thread thread;
  explicit broker_thread(std::string path, dedup_broker_options options = {})
      : socket(std::move(path)), broker(socket, std::move(options), cuda_content_verifier(0)) {
    REQUIRE(::pipe(stop) == 0);
    thread = std::thread([this] { broker.run(stop[0]); });
  }
  ~broker_thread() {
    const char c = 's';
    (void)!::write(stop[1], &c, 1);
    thread.join();
    ::close(stop[0]);
    ::close(stop[1]);
  }
};

std::string temp_socket() {
  char dir[] = "/tmp/glake-gpu-dedup-XXXXXX";
  REQUIRE(::mkdtemp(dir) != nullptr);
  return std::string(dir) + "/broker.sock";
}

}  // namespace

TEST_CASE("gpu: two clients publish equal device memory: the second maps the first's copy, read-only, and gives its own back") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  const std::string socket = temp_socket();
  constexpr std::size_t pieces = 32;
  constexpr std::size_t bytes = pieces * piece;
  dedup_broker_options broker_options;
  SUBCASE("compared in slices of 4 MiB, the default: a piece in one turn") {}
  SUBCASE("compared in slices of 512 KiB: a piece over four turns") { broker_options.compare_slice_bytes = 512 * KiB; }
  {
    broker_thread broker(socket, broker_options);
    region a(bytes), b(bytes);
    // Equal bytes, except b's last piece.
    REQUIRE(gpu_test::fill(a.data(), bytes, 5) == cudaSuccess);
    REQUIRE(gpu_test::fill(b.data(), bytes, 5) == cudaSuccess);
    REQUIRE(gpu_test::fill(b.at(bytes - piece), piece, 6) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);

    dedup_client_options options;
    options.chunk_bytes = piece;
    cuda_client first(socket, options, cuda_shareable_backend(0));
    cuda_client second(socket, options, cuda_shareable_backend(0));

    const publish_result ra = first.publish(a.data(), bytes);
    CHECK(ra.reason == "");
    CHECK(ra.pieces == pieces);
    CHECK(ra.stored == pieces);
    CHECK(ra.kept_private == 0);

    const std::size_t free_before = gpu_test::device_free_bytes();
    const publish_result rb = second.publish(b.data(), bytes);
    CHECK(rb.reason == "");
    CHECK(rb.shared == pieces - 1);
    CHECK(rb.stored == 1);
    CHECK(rb.shared_bytes == (pieces - 1) * piece);
    const std::size_t free_after = gpu_test::device_free_bytes();
    // The pieces b now shares went back to the driver (less one piece of slack for the scratch
    // copies' rounding).
    CHECK(free_after >= free_before + (pieces - 2) * piece);

    // Every word, through the unchanged pointers.
    CHECK(gpu_test::mismatches(a.data(), bytes, 5) == 0);
    CHECK(gpu_test::mismatches(b.data(), bytes - piece, 5) == 0);
    CHECK(gpu_test::mismatches(b.at(bytes - piece), piece, 6) == 0);
    // The mappings are read-only: the driver says so for both.
    CUmemAccessDesc probe{};
    probe.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    probe.location.id = 0;
    unsigned long long flags = 0;
    REQUIRE(cuMemGetAccess(&flags, &probe.location, a.base) == CUDA_SUCCESS);
    CHECK(flags == CU_MEM_ACCESS_FLAGS_PROT_READ);
    REQUIRE(cuMemGetAccess(&flags, &probe.location, b.base) == CUDA_SUCCESS);
    CHECK(flags == CU_MEM_ACCESS_FLAGS_PROT_READ);

    // make_private: b writable again with the same bytes; writing it leaves a untouched.
    second.make_private(b.data(), bytes);
    REQUIRE(cuMemGetAccess(&flags, &probe.location, b.base) == CUDA_SUCCESS);
    CHECK(flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    CHECK(gpu_test::mismatches(b.data(), bytes - piece, 5) == 0);
    REQUIRE(gpu_test::fill(b.data(), bytes, 9) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(gpu_test::mismatches(b.data(), bytes, 9) == 0);
    CHECK(gpu_test::mismatches(a.data(), bytes, 5) == 0);

    const auto stats = first.broker_statistics();
    REQUIRE(stats.has_value());
    CHECK(stats->shared == pieces - 1);
    CHECK(stats->refused == 0);
    first.release(a.data(), bytes);
  }
  std::filesystem::remove_all(std::filesystem::path(socket).parent_path());
}

TEST_CASE("gpu: cuda_content_verifier compares slices of exported device memory at their offsets") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  region a(piece), b(piece);
  REQUIRE(gpu_test::fill(a.data(), piece, 7) == cudaSuccess);
  REQUIRE(gpu_test::fill(b.data(), piece, 7) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  cuda_shareable_backend backend(0);
  detail::unique_fd ea = backend.export_copy(a.data(), piece), same = backend.export_copy(b.data(), piece);
  unsigned char last = 0;
  REQUIRE(cuMemcpyDtoH(&last, b.base + piece - 1, 1) == CUDA_SUCCESS);
  last ^= 1;
  REQUIRE(cuMemcpyHtoD(b.base + piece - 1, &last, 1) == CUDA_SUCCESS);  // b differs in its last byte
  detail::unique_fd eb = backend.export_copy(b.data(), piece);
  const cuda_content_verifier v(0);
  CHECK(v.check(ea.get(), piece) == nullptr);
  CHECK(v.equal(ea.get(), same.get(), piece) == 1);
  CHECK(v.equal(ea.get(), eb.get(), piece) == 0);
  CHECK(v.equal_slice(ea.get(), eb.get(), piece, 0, piece - 4096) == 1);
  CHECK(v.equal_slice(ea.get(), eb.get(), piece, 512 * KiB, 512 * KiB) == 1);
  CHECK(v.equal_slice(ea.get(), eb.get(), piece, piece - 4096, 4096) == 0);
  CHECK(v.equal_slice(ea.get(), eb.get(), piece, piece - 1, 1) == 0);
  CHECK(v.equal_slice(ea.get(), eb.get(), piece, 0, piece) == 0);
  CHECK(v.equal_slice(ea.get(), same.get(), piece, 3 * 512 * KiB, 512 * KiB) == 1);
  CHECK(v.equal_slice(ea.get(), eb.get(), piece, piece - 4096, 8192) == -1);  // past the end
  CHECK(v.equal_slice(ea.get(), eb.get(), 2 * piece, 0, 4096) == -1);         // larger than they are
}

TEST_CASE("gpu: cuda_device_hasher gives the host arithmetic's digest for equal bytes wherever they lie, another for other bytes") {
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  const std::size_t bytes = 6 * MiB + 5;  // whole words and a tail
  CUdeviceptr a = 0, b = 0;
  REQUIRE(cuMemAlloc(&a, bytes + 8) == CUDA_SUCCESS);
  REQUIRE(cuMemAlloc(&b, bytes + 8) == CUDA_SUCCESS);
  REQUIRE(gpu_test::fill(reinterpret_cast<void*>(a), bytes + 8, 91) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  REQUIRE(cuMemcpyDtoD(b + 1, a, bytes) == CUDA_SUCCESS);  // the same bytes, misaligned
  std::vector<unsigned char> host(bytes);
  REQUIRE(cuMemcpyDtoH(host.data(), a, bytes) == CUDA_SUCCESS);
  const cuda_device_hasher hash;
  const content_digest on_device = hash(reinterpret_cast<void*>(a), bytes);
  CHECK(on_device == host_reference(host.data(), bytes));
  CHECK(hash(reinterpret_cast<void*>(b + 1), bytes) == on_device);  // staged on the host, same digest
  CHECK(hash(reinterpret_cast<void*>(a), bytes) == on_device);      // the same again
  CHECK(hash(reinterpret_cast<void*>(a), bytes - 1) != on_device);  // a shorter range
  // One word changed, then one tail byte: other digests.
  const unsigned char one = host[4 * MiB] ^ 0x40;
  REQUIRE(cuMemcpyHtoD(a + 4 * MiB, &one, 1) == CUDA_SUCCESS);
  const content_digest changed = hash(reinterpret_cast<void*>(a), bytes);
  CHECK(changed != on_device);
  host[4 * MiB] = one;
  CHECK(changed == host_reference(host.data(), bytes));
  const unsigned char last = host[bytes - 1] ^ 1;
  REQUIRE(cuMemcpyHtoD(a + bytes - 1, &last, 1) == CUDA_SUCCESS);
  CHECK(hash(reinterpret_cast<void*>(a), bytes) != changed);
  // Two words swapped: the index mixed into each term tells them apart.
  std::uint64_t w[2];
  REQUIRE(cuMemcpyDtoH(w, a + 8 * 1000, 16) == CUDA_SUCCESS);
  if (w[0] != w[1]) {
    const content_digest before = hash(reinterpret_cast<void*>(a), bytes);
    const std::uint64_t swapped[2] = {w[1], w[0]};
    REQUIRE(cuMemcpyHtoD(a + 8 * 1000, swapped, 16) == CUDA_SUCCESS);
    CHECK(hash(reinterpret_cast<void*>(a), bytes) != before);
  }
  // Empty and tail-only ranges.
  CHECK(hash(reinterpret_cast<void*>(a), 0) == host_reference(host.data(), 0));
  CHECK(hash(reinterpret_cast<void*>(b + 1), 7) == host_reference(host.data(), 7));
  REQUIRE(cuMemFree(a) == CUDA_SUCCESS);
  REQUIRE(cuMemFree(b) == CUDA_SUCCESS);
}
