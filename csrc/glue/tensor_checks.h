// Argument checks shared by the ops (csrc/ops/), and so by every backend. Each failure names the
// op, the argument and what was expected, and happens before anything is written.
#pragma once
#include <ATen/ATen.h>

#include <cstdlib>
#include <limits>
#include <string>
#include <unordered_set>

#include "kernels/cache_params.h"

namespace pagedkv {

inline bool is_fp8(at::ScalarType t) {
  return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

inline DType dtype_of(const at::Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat8_e4m3fn: return DType::kFp8E4M3;
    case at::kFloat8_e5m2: return DType::kFp8E5M2;
    default:
      TORCH_CHECK(false, op, ": ", name,
                  " must be float32, float16, bfloat16, float8_e4m3fn or float8_e5m2, got ",
                  t.scalar_type());
  }
}

// A cache's dtype: dtype_of's, or int8 (kInt8) and uint8 (kInt4: two 4-bit elements a byte),
// the per-(token, head) quantized formats.
inline DType cache_dtype_of(const at::Tensor& t, const char* op, const char* name) {
  if (t.scalar_type() == at::kChar) return DType::kInt8;
  if (t.scalar_type() == at::kByte) return DType::kInt4;
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf ||
                  t.scalar_type() == at::kBFloat16 || is_fp8(t.scalar_type()),
              op, ": ", name, " must be float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, "
              "int8 or uint8 (int4, two a byte), got ", t.scalar_type());
  return dtype_of(t, op, name);
}

inline bool is_int_cache(DType t) { return t == DType::kInt8 || t == DType::kInt4; }

// Elements of a cache row of `dim` stored units (an int4 byte holds two).
inline int64_t row_elements(DType t, int64_t dim) { return t == DType::kInt4 ? 2 * dim : dim; }

inline void check_dim(const at::Tensor& t, int64_t dim, const char* op, const char* name,
                      const char* shape) {
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must be ", dim, "-D ", shape, ", got shape ",
              t.sizes());
}

inline void check_device(const at::Tensor& t, const at::Tensor& ref, const char* op,
                         const char* name, const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on ", ref_name, "'s device ",
              ref.device(), ", got ", t.device());
}

inline void check_index(const at::Tensor& t, at::ScalarType dtype, const char* op,
                        const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// A per-layer cache [num_blocks, num_kv_heads, block_size, head_size], last dim contiguous.
inline void check_cache(const at::Tensor& cache, const char* op, const char* name) {
  check_dim(cache, 4, op, name, "[num_blocks, num_kv_heads, block_size, head_size]");
  cache_dtype_of(cache, op, name);
  TORCH_CHECK(cache.stride(3) == 1, op, ": ", name,
              " must have a contiguous last (head_size) dim, got strides ", cache.strides());
}

inline void check_cache_pair(const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const char* op) {
  check_cache(key_cache, op, "key_cache");
  check_cache(value_cache, op, "value_cache");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), op,
              ": key_cache and value_cache must have the same shape, got ", key_cache.sizes(),
              " and ", value_cache.sizes());
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), op,
              ": key_cache and value_cache must have the same dtype, got ",
              key_cache.scalar_type(), " and ", value_cache.scalar_type());
  check_device(value_cache, key_cache, op, "value_cache", "key_cache");
}

inline CacheStrides strides_of(const at::Tensor& cache, int64_t unit = 1) {
  return {cache.stride(0) * unit, cache.stride(1) * unit, cache.stride(2) * unit};
}

// The kernels' view of a cache checked by check_cache (strides in elements).
inline PagedKVView paged_kv_of(const at::Tensor& cache) {
  return {cache.data_ptr(), strides_of(cache), static_cast<int32_t>(cache.size(2))};
}

// Index ranges are checked wherever reading the indices costs nothing: CPU tensors always; device
// tensors only in the opt-in checked mode (PAGEDKV_CHECK_INDICES=1), which synchronizes.
inline bool index_checks_enabled(const at::Tensor& index) {
  static const bool forced = [] {
    const char* v = std::getenv("PAGEDKV_CHECK_INDICES");
    return v != nullptr && std::string(v) == "1";
  }();
  return index.is_cpu() || forced;
}

// A per-tensor scale argument of fp8 caches: float32, one element, on the cache's device;
// refused for other caches and with per-(token, head) scales (token_scales).
inline const float* scale_ptr(const c10::optional<at::Tensor>& scale, const at::Tensor& cache,
                              const char* op, const char* name, bool token_scales = false) {
  if (!is_fp8(cache.scalar_type()) || token_scales) {
    TORCH_CHECK(!scale.has_value(), op, ": ", name, " is only used with fp8 caches of "
                "per-tensor scales, got a ", cache.scalar_type(), " cache",
                token_scales ? " with per-(token, head) scales" : "");
    return nullptr;
  }
  TORCH_CHECK(scale.has_value(), op, ": ", name, " is required with an ", cache.scalar_type(),
              " cache (or per-(token, head) scales instead of k_scale and v_scale)");
  TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->numel() == 1, op, ": ", name,
              " must be a float32 tensor of one element, got ", scale->scalar_type(), " of shape ",
              scale->sizes());
  check_device(*scale, cache, op, name, "the cache");
  return scale->data_ptr<float>();
}

// Whether a cache of `dtype` is read and written with per-(token, head) scales: int8 and int4
// always, fp8 when its per-(token, head) scales are given (else it takes per-tensor scales).
inline bool token_scaled(DType dtype, const c10::optional<at::Tensor>& token_scales) {
  return is_int_cache(dtype) ||
         ((dtype == DType::kFp8E4M3 || dtype == DType::kFp8E5M2) && token_scales.has_value());
}

// The per-(token, head) scales of a cache [num_blocks, num_kv_heads, block_size, ...] (checked),
// argument `name`: float32 [num_blocks, num_kv_heads, block_size] on its device, any strides.
// Required when the cache is token_scaled, refused otherwise. Returns the kernels' view (data
// null when absent).
inline PagedKVView scales_of(const c10::optional<at::Tensor>& scales, const at::Tensor& cache,
                             bool token_scales, const char* op, const char* name,
                             const char* cache_name) {
  const int32_t block_size = static_cast<int32_t>(cache.size(2));
  if (!token_scales) {
    TORCH_CHECK(!scales.has_value(), op, ": ", name, " is only used with int8, int4 (uint8) "
                "and per-(token, head) fp8 caches, got a ", cache.scalar_type(), " cache",
                is_fp8(cache.scalar_type()) ? " with per-tensor scales" : "");
    return {nullptr, {0, 0, 0}, block_size};
  }
  TORCH_CHECK(scales.has_value(), op, ": ", name, " is required with a ", cache.scalar_type(),
              " cache of per-(token, head) scales (float32 [num_blocks, num_kv_heads, "
              "block_size])");
  const at::Tensor& s = *scales;
  TORCH_CHECK(s.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
              s.scalar_type());
  TORCH_CHECK(s.dim() == 3 && s.size(0) == cache.size(0) && s.size(1) == cache.size(1) &&
                  s.size(2) == cache.size(2),
              op, ": ", name, " must be [num_blocks, num_kv_heads, block_size] = [", cache.size(0),
              ", ", cache.size(1), ", ", cache.size(2), "] to match ", cache_name, ", got ",
              s.sizes());
  check_device(s, cache, op, name, cache_name);
  return {s.data_ptr(), {s.stride(0), s.stride(1), s.stride(2)}, block_size};
}

// A K/V cache pair's scales, checked: per-tensor (fp8: k_scale, v_scale) or per (token, head)
// (key_cache_scales, value_cache_scales), whichever the cache's dtype and arguments say.
struct CacheScales {
  const float* k_scale;
  const float* v_scale;
  PagedKVView key_scales, value_scales;
};
inline CacheScales cache_scales_of(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                   DType cache_dtype, const c10::optional<at::Tensor>& k_scale,
                                   const c10::optional<at::Tensor>& v_scale,
                                   const c10::optional<at::Tensor>& key_cache_scales,
                                   const c10::optional<at::Tensor>& value_cache_scales,
                                   const char* op) {
  const bool token_scales = token_scaled(cache_dtype, key_cache_scales);
  CacheScales s;
  s.k_scale = scale_ptr(k_scale, key_cache, op, "k_scale", token_scales);
  s.v_scale = scale_ptr(v_scale, key_cache, op, "v_scale", token_scales);
  s.key_scales =
      scales_of(key_cache_scales, key_cache, token_scales, op, "key_cache_scales", "key_cache");
  s.value_scales = scales_of(value_cache_scales, value_cache, token_scales, op,
                             "value_cache_scales", "value_cache");
  return s;
}

// Query, out, partial outputs: [num_tokens, num_heads, head_size] in float32/16, bfloat16.
inline DType check_rows(const at::Tensor& t, const char* op, const char* name) {
  check_dim(t, 3, op, name, "[num_tokens, num_heads, head_size]");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf ||
                  t.scalar_type() == at::kBFloat16,
              op, ": ", name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.stride(2) == 1 || t.size(2) <= 1, op, ": ", name,
              " must have a contiguous last (head_size) dim, got strides ", t.strides());
  return dtype_of(t, op, name);
}

// t has ref's shape, device and dtype; float_ok: or float32 (unrounded rows beside 16-bit ones).
inline void check_like(const at::Tensor& t, const at::Tensor& ref, const char* op,
                       const char* name, const char* ref_name, bool float_ok = false) {
  TORCH_CHECK(t.sizes() == ref.sizes(), op, ": ", name, " must have ", ref_name, "'s shape ",
              ref.sizes(), ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type() || (float_ok && t.scalar_type() == at::kFloat),
              op, ": ", name, " must have ", ref_name, "'s dtype ", ref.scalar_type(),
              float_ok && ref.scalar_type() != at::kFloat ? " or be float32" : "", ", got ",
              t.scalar_type());
  check_device(t, ref, op, name, ref_name);
}

// A log-sum-exp tensor: float32 [num_tokens, num_heads], any strides.
inline void check_lse(const at::Tensor& t, int64_t num_tokens, int64_t num_heads,
                      const at::Tensor& ref, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == num_tokens && t.size(1) == num_heads, op, ": ", name,
              " must be [num_tokens, num_heads] = [", num_tokens, ", ", num_heads, "], got ",
              t.sizes());
  check_device(t, ref, op, name, "out");
}

// A slot_mapping: int64 [num_tokens] on the cache's device; its largest slot (when readable for
// free, see index_checks_enabled) below num_blocks x block_size.
inline void check_slot_mapping(const at::Tensor& slot_mapping, int64_t num_tokens,
                               const at::Tensor& cache, int64_t num_blocks, int64_t block_size,
                               const char* op) {
  check_device(slot_mapping, cache, op, "slot_mapping", "the cache");
  check_index(slot_mapping, at::kLong, op, "slot_mapping");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == num_tokens, op,
              ": slot_mapping must be [num_tokens] = [", num_tokens, "], got ",
              slot_mapping.sizes());
  const int64_t num_slots = num_blocks * block_size;
  if (index_checks_enabled(slot_mapping) && num_tokens > 0) {
    const int64_t max_slot = slot_mapping.max().item<int64_t>();
    TORCH_CHECK(max_slot < num_slots, op, ": slot_mapping holds slot ", max_slot,
                ", out of range for a cache of ", num_blocks, " blocks of ", block_size,
                " tokens (", num_slots, " slots)");
  }
}

inline int32_t to_int32(int64_t v, const char* op, const char* name) {
  TORCH_CHECK(v >= 0 && v <= std::numeric_limits<int32_t>::max(), op, ": ", name,
              " must be in [0, 2^31), got ", v);
  return static_cast<int32_t>(v);
}

// A [num_pairs, 2] int64 (src, dst) block mapping. When the indices are readable for free (see
// index_checks_enabled), ids are checked against the block counts and, since pairs are applied
// concurrently, a destination may appear once and, within one cache, never as a source.
inline void check_block_mapping(const at::Tensor& mapping, int64_t src_blocks, int64_t dst_blocks,
                                bool same_cache, const char* op) {
  check_index(mapping, at::kLong, op, "block_mapping");
  TORCH_CHECK(mapping.dim() == 2 && mapping.size(1) == 2, op,
              ": block_mapping must be [num_pairs, 2] (src, dst), got shape ", mapping.sizes());
  if (!index_checks_enabled(mapping) || mapping.size(0) == 0) return;
  const at::Tensor host = mapping.cpu();
  const int64_t* ids = host.data_ptr<int64_t>();
  const int64_t num_pairs = host.size(0);
  for (int64_t i = 0; i < num_pairs; ++i) {
    TORCH_CHECK(ids[2 * i] >= 0 && ids[2 * i] < src_blocks, op, ": block_mapping[", i,
                "] has source block ", ids[2 * i], ", expected 0 <= id < ", src_blocks);
    TORCH_CHECK(ids[2 * i + 1] >= 0 && ids[2 * i + 1] < dst_blocks, op, ": block_mapping[", i,
                "] has destination block ", ids[2 * i + 1], ", expected 0 <= id < ", dst_blocks);
  }
  std::unordered_set<int64_t> sources, destinations;
  for (int64_t i = 0; i < num_pairs; ++i) sources.insert(ids[2 * i]);
  for (int64_t i = 0; i < num_pairs; ++i) {
    const int64_t dst = ids[2 * i + 1];
    TORCH_CHECK(destinations.insert(dst).second, op, ": block_mapping names destination block ",
                dst, " twice");
    TORCH_CHECK(!same_cache || !sources.count(dst), op, ": block_mapping uses block ", dst,
                " both as a source and as a destination");
  }
}

}  // namespace pagedkv
