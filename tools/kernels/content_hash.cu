// The device content hash of cuda_device_hasher (include/glake/sharing/cuda_device_hasher.hpp),
// whose header embeds this kernel's PTX: regenerate it with embed_ptx.sh after any change here.
//
// glake_content_hash(words, n, out): out[0..3] += four 64-bit lanes over the n 8-byte words.
// Each word is mixed with its index (splitmix64's finaliser), so equal words at other places
// give other terms; the lanes combine the terms by sums and an exclusive or, which do not
// depend on the order the threads run in, so the digest is the same in every run and process.
// The caller zeroes `out` first. Digests are lookup keys only: the dedup broker compares bytes.

namespace {
__device__ __forceinline__ unsigned long long mix(unsigned long long x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}
__device__ __forceinline__ unsigned long long rotl(unsigned long long x, int r) { return (x << r) | (x >> (64 - r)); }
}  // namespace

extern "C" __global__ void glake_content_hash(const unsigned long long* __restrict__ words, unsigned long long n,
                                              unsigned long long* out) {
  unsigned long long a = 0, b = 0, c = 0, d = 0;
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  for (unsigned long long i = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const unsigned long long w = words[i];
    const unsigned long long x = mix(w ^ (i * 0x9E3779B97F4A7C15ull));
    a += x;
    b ^= rotl(x, 23) + i;
    c += x * (2 * i + 1);
    d += mix(w + 0xD1B54A32D192ED03ull * (i + 1));
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    a += __shfl_down_sync(0xffffffffu, a, offset);
    b ^= __shfl_down_sync(0xffffffffu, b, offset);
    c += __shfl_down_sync(0xffffffffu, c, offset);
    d += __shfl_down_sync(0xffffffffu, d, offset);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(out + 0, a);
    atomicXor(out + 1, b);
    atomicAdd(out + 2, c);
    atomicAdd(out + 3, d);
  }
}
