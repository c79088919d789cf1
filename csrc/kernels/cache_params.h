// Plain parameter structs shared by the CPU kernels, the CUDA kernels and the torch glue.
// No torch and no CUDA here: the structs travel by value into kernels.
#pragma once
#include <stdint.h>

#include "kernels/paged_kv.h"

namespace pagedkv {

// kInt8: signed int8 (-127..127); kInt4: signed 4-bit (-7..7), two per byte (element 2i in the
// low nibble of byte i, 2i + 1 in the high one), a uint8 tensor of head_size / 2 per row. Both are
// cache formats with one scale per (token, head) only (docs/quantized_kv.md).
enum class DType : int32_t { kFloat32, kFloat16, kBFloat16, kFp8E4M3, kFp8E5M2, kInt8, kInt4 };

// The largest magnitude a per-(token, head) quantized element stores: a row's scale is its
// absmax / this, and element x is stored as round(x / scale) (fp8: its rounding, saturating).
#if defined(__CUDACC__)
__host__ __device__
#endif
inline constexpr float quant_max(DType t) {
  return t == DType::kInt8 ? 127.f : t == DType::kInt4 ? 7.f : t == DType::kFp8E4M3 ? 448.f
                                                                                    : 57344.f;
}

struct ReshapeAndCacheParams {
  const void* key;          // [num_tokens, num_kv_heads, head_size]
  const void* value;        // [num_tokens, num_kv_heads, head_size]
  int64_t key_token_stride, key_head_stride;
  int64_t value_token_stride, value_head_stride;
  PagedKVView key_cache;    // [num_blocks, num_kv_heads, block_size, head_size], cache_dtype
  PagedKVView value_cache;  // [num_blocks, num_kv_heads, block_size, head_size], cache_dtype
  const int64_t* slot_mapping;  // [num_tokens]; block_id * block_size + offset, < 0 = padding
  const float* k_scale;     // [1], fp8 caches only (else nullptr): cache = sat(key / k_scale)
  const float* v_scale;     // [1], fp8 caches only
  // Per-(token, head) scales, float32 [num_blocks, num_kv_heads, block_size] in the views'
  // strides (block, head, token; block_size as the caches'): written beside each row, scale =
  // absmax(row) / quant_max(cache_dtype), 0 for a row of zeros (stored as zeros). Set (data not
  // null) for int8 and int4 caches and for fp8 caches without k_scale / v_scale.
  PagedKVView key_scales, value_scales;
  int64_t num_tokens;
  int32_t num_kv_heads, head_size;  // head_size in elements (an int4 row holds head_size / 2 bytes)
  DType src_dtype, cache_dtype;
};

// An MLA (latent) cache is one row per token, [num_blocks, block_size, kv_lora_rank + rope_dim]:
// a PagedKVView of one head (head stride 0).
struct ConcatAndCacheMlaParams {
  const void* kv_c;         // [num_tokens, kv_lora_rank], src_dtype
  const void* k_pe;         // [num_tokens, rope_dim], src_dtype
  int64_t kv_c_stride, k_pe_stride;  // token strides, in elements
  PagedKVView cache;        // cache_dtype; row = [kv_c, k_pe]
  const int64_t* slot_mapping;  // [num_tokens]; block_id * block_size + offset, < 0 = padding
  const float* scale;       // [1], fp8 caches only (else nullptr): cache = sat(x / scale)
  int64_t num_tokens;
  int32_t kv_lora_rank, rope_dim;
  DType src_dtype, cache_dtype;
};

struct GatherCacheParams {
  PagedKVView cache;         // [num_blocks, block_size, width], cache_dtype
  void* out;                 // [total_tokens, width], out_dtype
  int64_t out_stride;        // token stride, in elements
  const int32_t* block_table;  // [batch, max_blocks]
  int64_t block_table_stride;
  int32_t max_blocks;
  const int32_t* cu_seq_lens;  // [batch + 1]: sequence b fills out rows [cu[b], cu[b + 1])
  const int32_t* seq_starts;   // [batch], its first position (nullptr: 0)
  const float* scale;        // [1]: fp8 cache into a float out (else nullptr: same dtypes)
  int32_t batch, width;
  DType cache_dtype, out_dtype;
};

// copy_blocks moves bytes, so its view of a cache is dtype-free: each layer's cache is a
// PagedKV<char> of its pointer, the byte strides and block_size.
constexpr int kMaxLayersPerLaunch = 128;

struct CopyBlocksParams {
  char* key_caches[kMaxLayersPerLaunch];    // per layer [num_blocks, num_kv_heads, block_size, head_size]
  char* value_caches[kMaxLayersPerLaunch];
  CacheStrides k_strides_bytes, v_strides_bytes;  // of every layer
  const int64_t* block_mapping;  // [num_pairs, 2] (src, dst), on the caches' device
  int64_t num_pairs;
  int32_t num_layers;            // <= kMaxLayersPerLaunch; the glue launches once per chunk
  int32_t num_kv_heads, block_size;
  int32_t row_bytes;             // head_size * element size

  PAGEDKV_HOST_DEVICE PagedKV<char> key_cache(int32_t layer) const {
    return {key_caches[layer], k_strides_bytes, block_size};
  }
  PAGEDKV_HOST_DEVICE PagedKV<char> value_cache(int32_t layer) const {
    return {value_caches[layer], v_strides_bytes, block_size};
  }
};

// swap_blocks copies whole blocks; both caches must hold each block densely with the same
// inner layout (true for HND, NHD views and K/V views of a combined tensor).
struct SwapBlocksParams {
  const char* src;
  char* dst;
  int64_t src_block_stride_bytes, dst_block_stride_bytes;
  int64_t block_bytes;
  const int64_t* block_mapping;  // [num_pairs, 2] (src, dst), host memory
  int64_t num_pairs;
};

}  // namespace pagedkv
