// Argument checks shared by every backend's glue. Each failure names the op, the argument and
// what was expected, and happens before anything is written.
#pragma once
#include <ATen/ATen.h>

#include <cstdlib>
#include <string>

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
  dtype_of(cache, op, name);
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

// Index ranges are checked wherever reading the indices costs nothing: CPU tensors always; device
// tensors only in the opt-in checked mode (PAGEDKV_CHECK_INDICES=1), which synchronizes.
inline bool index_checks_enabled(const at::Tensor& index) {
  static const bool forced = [] {
    const char* v = std::getenv("PAGEDKV_CHECK_INDICES");
    return v != nullptr && std::string(v) == "1";
  }();
  return index.is_cpu() || forced;
}

// A scale argument of fp8 caches: float32, one element, on the cache's device.
inline const float* scale_ptr(const c10::optional<at::Tensor>& scale, const at::Tensor& cache,
                              const char* op, const char* name) {
  if (!is_fp8(cache.scalar_type())) {
    TORCH_CHECK(!scale.has_value(), op, ": ", name, " is only used with fp8 caches, got a ",
                cache.scalar_type(), " cache");
    return nullptr;
  }
  TORCH_CHECK(scale.has_value(), op, ": ", name, " is required with an ", cache.scalar_type(),
              " cache");
  TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->numel() == 1, op, ": ", name,
              " must be a float32 tensor of one element, got ", scale->scalar_type(), " of shape ",
              scale->sizes());
  check_device(*scale, cache, op, name, "the cache");
  return scale->data_ptr<float>();
}

}  // namespace pagedkv
