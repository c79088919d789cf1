// CPU kernels of the cache ops (the MLA cache's too): multi-threaded with ATen's pool, rows moved
// with memcpy, fp8 quantized with the same saturating round-to-nearest-even as the CUDA kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu/stream_copy.h"
#include "ops/copy_blocks.h"
#include "ops/mla_cache.h"
#include "ops/reshape_and_cache.h"
#include "ops/swap_blocks.h"

namespace pagedkv {
namespace {

// Bytes a parallel task should move before splitting further.
constexpr int64_t kTaskBytes = 64 * 1024;

int64_t grain_for(int64_t bytes_per_item) {
  return std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, bytes_per_item));
}

template <typename Fp8>
Fp8 quantize(float x) {
  const float max = static_cast<float>(std::numeric_limits<Fp8>::max());
  return Fp8(x > max ? max : (x < -max ? -max : x));  // NaN passes through
}

template <typename Src, typename Cache>
void write_row(const Src* src, Cache* dst, int64_t n, float scale, bool streaming) {
  if constexpr (std::is_same_v<Src, Cache>) {
    cpu::copy_bytes(dst, src, n * sizeof(Src), streaming);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = quantize<Cache>(static_cast<float>(src[i]) / scale);
  }
}

// Per-(token, head) quantization (ReshapeAndCacheParams' key_scales): a row of n elements into
// its cache row (int8_t; uint8_t: int4 pairs, n / 2 bytes; fp8) with the scale of its own,
// returned. Written as torch computes pagedkv.reference.quantize_rows: float32 absmax (NaN
// propagates), scale = absmax / qmax, x / scale (a division, not a reciprocal's product)
// rounded half to even, saturated.
template <typename Cache>
constexpr DType kTokenScaled = std::is_same_v<Cache, int8_t>    ? DType::kInt8
                               : std::is_same_v<Cache, uint8_t> ? DType::kInt4
                               : std::is_same_v<Cache, c10::Float8_e4m3fn> ? DType::kFp8E4M3
                                                                           : DType::kFp8E5M2;

// Four elements at a time, in the vectors of the baseline instruction set (SSE2 on x86-64;
// GCC's vector extensions elsewhere), so that this unit needs no dispatch by instruction set.
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));
typedef uint32_t v4u __attribute__((vector_size(16)));
typedef uint16_t v4h __attribute__((vector_size(8)));

template <typename Src>
inline v4f load4(const Src* p) {
  if constexpr (std::is_same_v<Src, float>) {
    v4f x;
    std::memcpy(&x, p, sizeof x);
    return x;
  } else if constexpr (std::is_same_v<Src, c10::BFloat16>) {  // the bits moved up: exact
    v4h bits;
    std::memcpy(&bits, p, sizeof bits);
    return (v4f)(__builtin_convertvector(bits, v4u) << 16);
  } else {
    return v4f{static_cast<float>(p[0]), static_cast<float>(p[1]), static_cast<float>(p[2]),
               static_cast<float>(p[3])};
  }
}

// x rounded half to even and saturated to +-qmax (integers), NaN (a row of zeros: 0 / 0) to 0:
// clamped first (the same as after, qmax being an integer), then rounded by adding and
// subtracting 1.5 * 2^23, exact for |x| < 2^22 in the default rounding mode.
inline v4i round4(v4f x, float qmax) {
  const v4f zero = {}, hi = zero + qmax, lo = zero - qmax, magic = zero + 12582912.f;
  x = x == x ? x : zero;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  return __builtin_convertvector((x + magic) - magic, v4i);
}

// The row's float32 absmax; NaN if any element is NaN (as torch's amax).
template <typename Src>
float row_absmax(const Src* src, int64_t n) {
  const v4f zero = {};
  v4f amax = zero;
  v4i nan = {};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    v4f a = load4(src + i);
    a = a < zero ? -a : a;
    amax = a > amax ? a : amax;
    nan |= a != a;
  }
  float m = std::max(std::max(amax[0], amax[1]), std::max(amax[2], amax[3]));
  bool any_nan = nan[0] | nan[1] | nan[2] | nan[3];
  for (; i < n; ++i) {
    const float a = std::fabs(static_cast<float>(src[i]));
    m = a > m ? a : m;
    any_nan |= a != a;
  }
  return any_nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

template <typename Src, typename Cache>
float write_scaled_row(const Src* src, Cache* dst, int64_t n) {
  constexpr float qmax = quant_max(kTokenScaled<Cache>);
  const float scale = row_absmax(src, n) / qmax;
  if constexpr (std::is_same_v<Cache, int8_t> || std::is_same_v<Cache, uint8_t>) {
    const v4f div = v4f{} + scale;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
      const v4i q = round4(load4(src + i) / div, qmax);
      if constexpr (std::is_same_v<Cache, int8_t>) {
        for (int j = 0; j < 4; ++j) dst[i + j] = static_cast<int8_t>(q[j]);
      } else {
        dst[i / 2] = static_cast<uint8_t>((q[0] & 0xF) | ((q[1] & 0xF) << 4));
        dst[i / 2 + 1] = static_cast<uint8_t>((q[2] & 0xF) | ((q[3] & 0xF) << 4));
      }
    }
    for (; i < n; i += 2) {  // n is even for int4
      const v4f x = {static_cast<float>(src[i]),
                     i + 1 < n ? static_cast<float>(src[i + 1]) : 0.f, 0.f, 0.f};
      const v4i q = round4(x / div, qmax);
      if constexpr (std::is_same_v<Cache, int8_t>) {
        dst[i] = static_cast<int8_t>(q[0]);
        if (i + 1 < n) dst[i + 1] = static_cast<int8_t>(q[1]);
      } else {
        dst[i / 2] = static_cast<uint8_t>((q[0] & 0xF) | ((q[1] & 0xF) << 4));
      }
    }
  } else {
    const bool zero = scale == 0.f;
    for (int64_t i = 0; i < n; ++i)
      dst[i] = zero ? Cache(0.f) : quantize<Cache>(static_cast<float>(src[i]) / scale);
  }
  return scale;
}

template <typename Src, typename Cache>
void reshape_and_cache_scaled(const ReshapeAndCacheParams& p) {
  const int64_t token_bytes = 2 * p.num_kv_heads * p.head_size * sizeof(Src);
  const PagedKV<Cache> k_cache = p.key_cache.as<Cache>();
  const PagedKV<Cache> v_cache = p.value_cache.as<Cache>();
  const PagedKV<float> k_scales = p.key_scales.as<float>();
  const PagedKV<float> v_scales = p.value_scales.as<float>();
  at::parallel_for(0, p.num_tokens, grain_for(token_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = p.slot_mapping[t];
      if (slot < 0) continue;
      const PagedKVSlot at = k_cache.locate(slot);
      const Src* key = static_cast<const Src*>(p.key) + t * p.key_token_stride;
      const Src* value = static_cast<const Src*>(p.value) + t * p.value_token_stride;
      for (int32_t h = 0; h < p.num_kv_heads; ++h) {
        k_scales.row(at)[h * k_scales.strides.head] = write_scaled_row(
            key + h * p.key_head_stride, k_cache.row(at) + h * k_cache.strides.head, p.head_size);
        v_scales.row(at)[h * v_scales.strides.head] =
            write_scaled_row(value + h * p.value_head_stride,
                             v_cache.row(at) + h * v_cache.strides.head, p.head_size);
      }
    }
  });
}

template <typename Src, typename Cache>
void reshape_and_cache_typed(const ReshapeAndCacheParams& p) {
  const float k_scale = p.k_scale ? *p.k_scale : 1.f;
  const float v_scale = p.v_scale ? *p.v_scale : 1.f;
  const int64_t token_bytes = 2 * p.num_kv_heads * p.head_size * sizeof(Src);
  const bool streaming = p.num_tokens * token_bytes >= cpu::kStreamingBytes;
  const PagedKV<Cache> k_cache = p.key_cache.as<Cache>();
  const PagedKV<Cache> v_cache = p.value_cache.as<Cache>();
  at::parallel_for(0, p.num_tokens, grain_for(token_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = p.slot_mapping[t];
      if (slot < 0) continue;
      const PagedKVSlot at = k_cache.locate(slot);
      const Src* key = static_cast<const Src*>(p.key) + t * p.key_token_stride;
      const Src* value = static_cast<const Src*>(p.value) + t * p.value_token_stride;
      Cache* key_row = k_cache.row(at);
      Cache* value_row = v_cache.row(at);
      for (int32_t h = 0; h < p.num_kv_heads; ++h) {
        write_row(key + h * p.key_head_stride, key_row + h * k_cache.strides.head, p.head_size,
                  k_scale, streaming);
        write_row(value + h * p.value_head_stride, value_row + h * v_cache.strides.head,
                  p.head_size, v_scale, streaming);
      }
    }
    if (streaming) cpu::stream_fence();
  });
}

template <typename Src>
void reshape_and_cache_src(const ReshapeAndCacheParams& p) {
  if (p.key_scales.data != nullptr) {
    switch (p.cache_dtype) {
      case DType::kInt8: return reshape_and_cache_scaled<Src, int8_t>(p);
      case DType::kInt4: return reshape_and_cache_scaled<Src, uint8_t>(p);
      case DType::kFp8E4M3: return reshape_and_cache_scaled<Src, c10::Float8_e4m3fn>(p);
      default: return reshape_and_cache_scaled<Src, c10::Float8_e5m2>(p);
    }
  }
  switch (p.cache_dtype) {
    case DType::kFp8E4M3: return reshape_and_cache_typed<Src, c10::Float8_e4m3fn>(p);
    case DType::kFp8E5M2: return reshape_and_cache_typed<Src, c10::Float8_e5m2>(p);
    default: return reshape_and_cache_typed<Src, Src>(p);
  }
}

void reshape_and_cache(const ReshapeAndCacheParams& p, const at::Tensor&) {
  switch (p.src_dtype) {
    case DType::kFloat32: return reshape_and_cache_src<float>(p);
    case DType::kFloat16: return reshape_and_cache_src<c10::Half>(p);
    default: return reshape_and_cache_src<c10::BFloat16>(p);
  }
}

// Copies one block of one cache row by row (a row is one token of one head), or in one piece
// when the block is stored contiguously in HND order.
void copy_block(const PagedKV<char>& cache, int64_t src, int64_t dst, int32_t heads,
                int32_t row_bytes, bool streaming) {
  const char* from = cache.block(src);
  char* to = cache.block(dst);
  if (cache.dense_block(row_bytes)) {
    cpu::copy_bytes(to, from, static_cast<size_t>(heads) * cache.block_size * row_bytes,
                    streaming);
    return;
  }
  for (int32_t h = 0; h < heads; ++h) {
    for (int32_t t = 0; t < cache.block_size; ++t) {
      const int64_t off = cache.in_block(h, t);
      cpu::copy_bytes(to + off, from + off, row_bytes, streaming);
    }
  }
}

void copy_blocks(const CopyBlocksParams& p, const at::Tensor&) {
  const int64_t block_bytes = 2LL * p.num_kv_heads * p.block_size * p.row_bytes;
  const int64_t items = p.num_pairs * p.num_layers;
  const bool streaming = items * block_bytes >= cpu::kStreamingBytes;
  at::parallel_for(0, items, grain_for(block_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t pair = i / p.num_layers;
      const int32_t layer = static_cast<int32_t>(i % p.num_layers);
      const int64_t src = p.block_mapping[2 * pair];
      const int64_t dst = p.block_mapping[2 * pair + 1];
      copy_block(p.key_cache(layer), src, dst, p.num_kv_heads, p.row_bytes, streaming);
      copy_block(p.value_cache(layer), src, dst, p.num_kv_heads, p.row_bytes, streaming);
    }
    if (streaming) cpu::stream_fence();
  });
}

void swap_blocks(const SwapBlocksParams& p, const at::Tensor&, const at::Tensor&) {
  const bool streaming = p.num_pairs * p.block_bytes >= cpu::kStreamingBytes;
  at::parallel_for(0, p.num_pairs, grain_for(p.block_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      cpu::copy_bytes(p.dst + p.block_mapping[2 * i + 1] * p.dst_block_stride_bytes,
                      p.src + p.block_mapping[2 * i] * p.src_block_stride_bytes, p.block_bytes,
                      streaming);
    }
    if (streaming) cpu::stream_fence();
  });
}

template <typename Src, typename Cache>
void concat_and_cache_mla_typed(const ConcatAndCacheMlaParams& p) {
  const float scale = p.scale ? *p.scale : 1.f;
  const PagedKV<Cache> cache = p.cache.as<Cache>();
  const int64_t row_bytes = (p.kv_lora_rank + p.rope_dim) * sizeof(Src);
  const bool streaming = p.num_tokens * row_bytes >= cpu::kStreamingBytes;
  at::parallel_for(0, p.num_tokens, grain_for(row_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = p.slot_mapping[t];
      if (slot < 0) continue;
      Cache* row = cache.row(cache.locate(slot));
      write_row(static_cast<const Src*>(p.kv_c) + t * p.kv_c_stride, row, p.kv_lora_rank, scale,
                streaming);
      write_row(static_cast<const Src*>(p.k_pe) + t * p.k_pe_stride, row + p.kv_lora_rank,
                p.rope_dim, scale, streaming);
    }
    if (streaming) cpu::stream_fence();
  });
}

template <typename Src>
void concat_and_cache_mla_src(const ConcatAndCacheMlaParams& p) {
  switch (p.cache_dtype) {
    case DType::kFp8E4M3: return concat_and_cache_mla_typed<Src, c10::Float8_e4m3fn>(p);
    case DType::kFp8E5M2: return concat_and_cache_mla_typed<Src, c10::Float8_e5m2>(p);
    default: return concat_and_cache_mla_typed<Src, Src>(p);
  }
}

void concat_and_cache_mla(const ConcatAndCacheMlaParams& p, const at::Tensor&) {
  switch (p.src_dtype) {
    case DType::kFloat32: return concat_and_cache_mla_src<float>(p);
    case DType::kFloat16: return concat_and_cache_mla_src<c10::Half>(p);
    default: return concat_and_cache_mla_src<c10::BFloat16>(p);
  }
}

// The float value of every fp8 bit pattern, computed once: the dequantizing gather's conversion
// (c10's arithmetic one cost about 5 ns an element, 1.7 GB/s for a bf16 gather).
template <typename Fp8>
const std::array<float, 256>& fp8_values() {
  static const std::array<float, 256> values = [] {
    std::array<float, 256> v{};
    for (int i = 0; i < 256; ++i) {
      v[i] = static_cast<float>(Fp8(static_cast<uint8_t>(i), Fp8::from_bits()));
    }
    return v;
  }();
  return values;
}

// Out rows in parallel: row r is position seq_starts[b] + r - cu[b] of the sequence b whose
// range [cu[b], cu[b + 1]) holds it. Rows of the cache's type are copied as stored, fp8 rows
// into a float out dequantized.
template <typename Cache, typename Out>
void gather_cache_typed(const GatherCacheParams& p) {
  const float scale = p.scale ? *p.scale : 1.f;
  const PagedKV<Cache> cache = p.cache.as<Cache>();
  const int32_t* cu = p.cu_seq_lens;
  const int64_t row_bytes = p.width * static_cast<int64_t>(sizeof(Out));
  const bool streaming = cu[p.batch] * row_bytes >= cpu::kStreamingBytes;
  at::parallel_for(0, cu[p.batch], grain_for(row_bytes), [&](int64_t begin, int64_t end) {
    int64_t b = std::upper_bound(cu, cu + p.batch + 1, begin) - cu - 1;
    for (int64_t r = begin; r < end; ++r) {
      while (r >= cu[b + 1]) ++b;
      const int64_t pos = (p.seq_starts ? p.seq_starts[b] : 0) + r - cu[b];
      const int64_t block = p.block_table[b * p.block_table_stride + pos / cache.block_size];
      const Cache* src = cache.row({block, pos % cache.block_size});
      Out* dst = static_cast<Out*>(p.out) + r * p.out_stride;
      if constexpr (std::is_same_v<Cache, Out>) {
        cpu::copy_bytes(dst, src, row_bytes, streaming);
      } else {
        const std::array<float, 256>& values = fp8_values<Cache>();
        const uint8_t* raw = reinterpret_cast<const uint8_t*>(src);
        for (int32_t d = 0; d < p.width; ++d) dst[d] = Out(values[raw[d]] * scale);
      }
    }
    if (streaming) cpu::stream_fence();
  });
}

template <typename Out>
void gather_cache_out(const GatherCacheParams& p) {
  switch (p.cache_dtype) {
    case DType::kFp8E4M3: return gather_cache_typed<c10::Float8_e4m3fn, Out>(p);
    case DType::kFp8E5M2: return gather_cache_typed<c10::Float8_e5m2, Out>(p);
    default: return gather_cache_typed<Out, Out>(p);
  }
}

void gather_cache(const GatherCacheParams& p, const at::Tensor&) {
  if (p.batch == 0) return;
  switch (p.out_dtype) {
    case DType::kFloat32: return gather_cache_out<float>(p);
    case DType::kFloat16: return gather_cache_out<c10::Half>(p);
    case DType::kBFloat16: return gather_cache_out<c10::BFloat16>(p);
    case DType::kFp8E4M3: return gather_cache_typed<c10::Float8_e4m3fn, c10::Float8_e4m3fn>(p);
    case DType::kFp8E5M2: return gather_cache_typed<c10::Float8_e5m2, c10::Float8_e5m2>(p);
    case DType::kInt8:
    case DType::kInt4: return;  // refused by gather_cache_params (no MLA cache is int8 or int4)
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("reshape_and_cache", &reshape_and_cache_op<&reshape_and_cache>);
  m.impl("copy_blocks", &copy_blocks_op<&copy_blocks>);
  m.impl("swap_blocks", &swap_blocks_op<&swap_blocks>);
  m.impl("concat_and_cache_mla", &concat_and_cache_mla_op<&concat_and_cache_mla>);
  m.impl("gather_cache", &gather_cache_op<&gather_cache>);
}

}  // namespace pagedkv
