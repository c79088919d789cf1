// reshape_and_cache: its schema, its kernel parameters from tensors (the checks every backend
// shares, so cpu, cuda and simt accept and reject exactly the same inputs before anything is
// written) and the op every backend registers, reshape_and_cache_op<Run>.
#pragma once
#include <ATen/ATen.h>

#include "glue/tensor_checks.h"
#include "kernels/cache_params.h"

namespace pagedkv {

// Write new tokens' K/V into their cache slots (slot = block_id * block_size + offset; a negative
// slot is padding). fp8 caches quantize with the per-tensor scales, or compute a scale per
// (token, head) into key_cache_scales / value_cache_scales, as int8 and int4 caches always do.
inline constexpr char kReshapeAndCacheSchema[] =
    "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_mapping, Tensor? k_scale=None, Tensor? v_scale=None, "
    "Tensor(c!)? key_cache_scales=None, Tensor(d!)? value_cache_scales=None) -> ()";

inline ReshapeAndCacheParams reshape_and_cache_params(
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& slot_mapping,
    const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
    const c10::optional<at::Tensor>& key_cache_scales,
    const c10::optional<at::Tensor>& value_cache_scales) {
  constexpr const char* op = "reshape_and_cache";
  check_cache_pair(key_cache, value_cache, op);
  check_dim(key, 3, op, "key", "[num_tokens, num_kv_heads, head_size]");
  TORCH_CHECK(key.sizes() == value.sizes(), op, ": value must have key's shape ", key.sizes(),
              ", got ", value.sizes());
  const int64_t num_tokens = key.size(0);
  const DType cache_dtype = cache_dtype_of(key_cache, op, "key_cache");
  const int64_t head_size = row_elements(cache_dtype, key_cache.size(3));
  TORCH_CHECK(key.size(1) == key_cache.size(1) && key.size(2) == head_size, op,
              ": key must be [num_tokens, ", key_cache.size(1), ", ", head_size,
              "] to match key_cache", cache_dtype == DType::kInt4 ? " (int4: two a byte)" : "",
              ", got ", key.sizes());
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, op,
              ": key and value must have a contiguous last dim, got strides ", key.strides(),
              " and ", value.strides());
  const DType src = dtype_of(key, op, "key");
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), op, ": value must have key's dtype ",
              key.scalar_type(), ", got ", value.scalar_type());
  if (is_fp8(key_cache.scalar_type()) || is_int_cache(cache_dtype)) {
    TORCH_CHECK(!is_fp8(key.scalar_type()), op,
                ": key must be float32, float16 or bfloat16 for a quantized cache, got ",
                key.scalar_type());
  } else {
    TORCH_CHECK(key.scalar_type() == key_cache.scalar_type(), op,
                ": key must have the cache dtype ", key_cache.scalar_type(), ", got ",
                key.scalar_type());
  }
  check_device(key, key_cache, op, "key", "key_cache");
  check_device(value, key_cache, op, "value", "key_cache");
  const CacheScales scales = cache_scales_of(key_cache, value_cache, cache_dtype, k_scale, v_scale,
                                             key_cache_scales, value_cache_scales, op);
  check_slot_mapping(slot_mapping, num_tokens, key_cache, key_cache.size(0), key_cache.size(2),
                     op);
  ReshapeAndCacheParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.key_token_stride = key.stride(0);
  p.key_head_stride = key.stride(1);
  p.value_token_stride = value.stride(0);
  p.value_head_stride = value.stride(1);
  p.key_cache = paged_kv_of(key_cache);
  p.value_cache = paged_kv_of(value_cache);
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.k_scale = scales.k_scale;
  p.v_scale = scales.v_scale;
  p.key_scales = scales.key_scales;
  p.value_scales = scales.value_scales;
  p.num_tokens = num_tokens;
  p.num_kv_heads = static_cast<int32_t>(key_cache.size(1));
  p.head_size = static_cast<int32_t>(head_size);
  p.src_dtype = src;
  p.cache_dtype = cache_dtype;
  return p;
}

// The backend's part: Run(params, key_cache) after the checks; key_cache places the work.
using ReshapeAndCacheRun = void (*)(const ReshapeAndCacheParams&, const at::Tensor& key_cache);

// The op with the schema's signature; each backend registers reshape_and_cache_op<its_run>.
template <ReshapeAndCacheRun Run>
void reshape_and_cache_op(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                          at::Tensor& value_cache, const at::Tensor& slot_mapping,
                          const c10::optional<at::Tensor>& k_scale,
                          const c10::optional<at::Tensor>& v_scale,
                          const c10::optional<at::Tensor>& key_cache_scales,
                          const c10::optional<at::Tensor>& value_cache_scales) {
  Run(reshape_and_cache_params(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                               key_cache_scales, value_cache_scales),
      key_cache);
}

}  // namespace pagedkv
