// Cache rows as the attention kernel reads them: 8-element chunks loaded as 16-byte (fp8, int8:
// 8-byte; int4: 4-byte) vectors when the cache is aligned for it, byte by byte otherwise,
// converted to float (unscaled); and the block-table division by the block size.
#pragma once
#include "kernels/compat.cuh"
#include "kernels/dtypes.cuh"
#include "kernels/memory.cuh"

#include <type_traits>

namespace pagedkv {
namespace PAGEDKV_KERNEL_NS {
namespace attn {

constexpr int kChunkElems = 8;  // head dims per lane and token

// Elements of one stored unit of C: two for int4 (a byte holds a pair), one otherwise. A lane's
// offset of `dim` elements into a row is dim / kUnitElems<C> units.
template <typename C>
constexpr int kUnitElems = std::is_same_v<C, int4x2> ? 2 : 1;

// 8 cache elements as raw 32-bit words (1 for int4, 2 for fp8 and int8, 4 for 16-bit, 8 for
// fp32).
template <typename C>
struct Chunk {
  static constexpr int kWords = static_cast<int>(sizeof(C)) * kChunkElems / kUnitElems<C> / 4;
  uint32_t w[kWords];
};

// kVec: the caches are aligned for vector loads (AttentionPlan::vectorized); a template
// parameter, so that a loop of aligned loads holds no byte path.
template <bool kVec, typename C>
__device__ __forceinline__ Chunk<C> load_chunk(const C* ptr) {
  Chunk<C> c;
  if constexpr (kVec) {
    if constexpr (Chunk<C>::kWords == 1) {
      c.w[0] = load_ro(reinterpret_cast<const uint32_t*>(ptr), "kv");
    } else if constexpr (Chunk<C>::kWords == 2) {
      const uint2 x = load_ro(reinterpret_cast<const uint2*>(ptr), "kv");
      c.w[0] = x.x, c.w[1] = x.y;
    } else {
#pragma unroll
      for (int i = 0; i < Chunk<C>::kWords; i += 4) {
        const uint4 x = load_ro(reinterpret_cast<const uint4*>(ptr) + i / 4, "kv");
        c.w[i] = x.x, c.w[i + 1] = x.y, c.w[i + 2] = x.z, c.w[i + 3] = x.w;
      }
    }
  } else {  // caches whose rows are not chunk-aligned: bytes, assembled little-endian
    const unsigned char* bytes = reinterpret_cast<const unsigned char*>(ptr);
#pragma unroll
    for (int i = 0; i < Chunk<C>::kWords; ++i) {
      uint32_t word = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) word |= static_cast<uint32_t>(load_ro(bytes + 4 * i + b, "kv")) << (8 * b);
      c.w[i] = word;
    }
  }
  return c;
}

template <typename C>
__device__ __forceinline__ Chunk<C> zero_chunk() {
  Chunk<C> c;
#pragma unroll
  for (int i = 0; i < Chunk<C>::kWords; ++i) c.w[i] = 0;
  return c;
}

// Chunk -> 8 floats (unscaled).
__device__ __forceinline__ void to_floats(const Chunk<float>& c, float (&f)[kChunkElems]) {
#pragma unroll
  for (int i = 0; i < kChunkElems; ++i) f[i] = __uint_as_float(c.w[i]);
}
__device__ __forceinline__ void to_floats(const Chunk<__nv_bfloat16>& c, float (&f)[kChunkElems]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(c.w[i] << 16);
    f[2 * i + 1] = __uint_as_float(c.w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void to_floats(const Chunk<__half>& c, float (&f)[kChunkElems]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2_raw raw;
    raw.x = static_cast<unsigned short>(c.w[i] & 0xffffu);
    raw.y = static_cast<unsigned short>(c.w[i] >> 16);
    const float2 x = __half22float2(__half2(raw));
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}
// fp8: two elements per conversion (fp8x2 -> half2, one instruction on sm_89+), then half2 ->
// float2.
template <__nv_fp8_interpretation_t kInterp, typename Fp8>
__device__ __forceinline__ void fp8_to_floats(const Chunk<Fp8>& c, float (&f)[kChunkElems]) {
#pragma unroll
  for (int i = 0; i < kChunkElems / 2; ++i) {
    const auto pair = static_cast<__nv_fp8x2_storage_t>((c.w[i / 2] >> (16 * (i % 2))) & 0xffffu);
    const float2 x = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, kInterp)));
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}
__device__ __forceinline__ void to_floats(const Chunk<fp8_e4m3>& c, float (&f)[kChunkElems]) {
  fp8_to_floats<__NV_E4M3>(c, f);
}
__device__ __forceinline__ void to_floats(const Chunk<fp8_e5m2>& c, float (&f)[kChunkElems]) {
  fp8_to_floats<__NV_E5M2>(c, f);
}

// int8: x + 128 as the low mantissa byte of 2^23 (one byte permute), less 2^23 + 128 (one add):
// exact, and cheaper than an integer-to-float conversion.
__device__ __forceinline__ void to_floats(const Chunk<int8_t>& c, float (&f)[kChunkElems]) {
#pragma unroll
  for (int i = 0; i < kChunkElems; ++i) {
    const uint32_t biased = __byte_perm(c.w[i / 4] ^ 0x80808080u, 0x4B000000u, 0x7440u | (i % 4));
    f[i] = __uint_as_float(biased) - 8388736.f;
  }
}
// int4 (element i in nibble i of the word): likewise x + 8 as the low mantissa bits of 2^23.
__device__ __forceinline__ void to_floats(const Chunk<int4x2>& c, float (&f)[kChunkElems]) {
  const uint32_t biased = c.w[0] ^ 0x88888888u;
#pragma unroll
  for (int i = 0; i < kChunkElems; ++i) {
    f[i] = __uint_as_float(0x4B000000u | ((biased >> (4 * i)) & 0xFu)) - 8388616.f;
  }
}

// 2^x for the online softmax: ex2.approx.ftz under nvcc (one MUFU.EX2, no denormal handling;
// 2^-inf = 0), the host's exp2f under simt.
__device__ __forceinline__ float fast_exp2(float x) {
#if defined(__CUDACC__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

// x / d and x % d for a runtime divisor, by shifts when it is a power of two.
struct FastDiv {
  int d, shift;  // shift < 0: not a power of two
  __device__ __forceinline__ explicit FastDiv(int divisor) : d(divisor), shift(-1) {
    if ((divisor & (divisor - 1)) == 0) shift = __ffs(divisor) - 1;
  }
  __device__ __forceinline__ void divmod(int x, int& q, int& r) const {
    if (shift >= 0) {
      q = x >> shift;
      r = x & (d - 1);
    } else {
      q = x / d;
      r = x - q * d;
    }
  }
};

}  // namespace attn
}  // namespace PAGEDKV_KERNEL_NS
}  // namespace pagedkv
