// mla_attention: absorbed multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged
// latent cache. Its schema, its kernel parameters from tensors (the checks every backend shares)
// and the op every backend registers, mla_attention_op<Run>.
//
// With W_UK absorbed into the query, every head attends the same cached rows: a multi-query
// attention whose key is the whole [kv_c, k_pe] row (kv_lora_rank + rope_dim elements) and whose
// value is its first kv_lora_rank elements, read from the same row. The parameters are
// paged_attention's with one kv head, head_size = the row's width, head_size_v = kv_lora_rank and
// value_cache aliasing key_cache: the kernels read each latent row once for both.
#pragma once
#include <ATen/ATen.h>

#include <cmath>

#include "glue/tensor_checks.h"
#include "kernels/attention_params.h"
#include "ops/mla_cache.h"
#include "ops/paged_attention.h"

namespace pagedkv {

// The widest latent row (kv_lora_rank + rope_dim) the attention kernels take.
constexpr int32_t kMaxMlaRowSize = 1024;

inline constexpr char kMlaAttentionSchema[] =
    "mla_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, "
    "Tensor seq_lens, Tensor? query_start_loc, int max_seq_len, int max_query_len, float scale, "
    "Tensor? kv_scale=None, Tensor(b!)? lse_out=None) -> ()";

inline PagedAttentionParams mla_attention_params(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const c10::optional<at::Tensor>& query_start_loc, int64_t max_seq_len, int64_t max_query_len,
    double scale, const c10::optional<at::Tensor>& kv_scale,
    const c10::optional<at::Tensor>& lse_out) {
  constexpr const char* op = "mla_attention";
  const DType dtype = check_rows(query, op, "query");
  check_rows(out, op, "out");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1);
  const int64_t width = query.size(2), rank = out.size(2);
  TORCH_CHECK(out.size(0) == num_tokens && out.size(1) == num_heads, op,
              ": out must be [num_tokens, num_heads, kv_lora_rank] with query's num_tokens = ",
              num_tokens, " and num_heads = ", num_heads, ", got ", out.sizes());
  // query's dtype, or float32 under a 16-bit query (its rows unrounded, to be merged)
  const bool float_out = out.scalar_type() == at::kFloat && dtype != DType::kFloat32;
  TORCH_CHECK(out.scalar_type() == query.scalar_type() || float_out, op,
              ": out must have query's dtype ", query.scalar_type(),
              dtype != DType::kFloat32 ? " or be float32" : "", ", got ", out.scalar_type());
  check_device(out, query, op, "out", "query");
  TORCH_CHECK(rank >= 8 && rank % 8 == 0 && rank <= kMaxAttentionHeadSize, op,
              ": kv_lora_rank (out.size(2)) must be a multiple of 8 in [8, ",
              kMaxAttentionHeadSize, "], got ", rank);
  TORCH_CHECK(width > rank && width % 8 == 0 && width <= kMaxMlaRowSize, op,
              ": query must be [num_tokens, num_heads, kv_lora_rank + rope_dim] with a rope_dim "
              "> 0 and a width that is a multiple of 8 up to ", kMaxMlaRowSize,
              "; got kv_lora_rank ", rank, " (out) and width ", width, " (query)");
  const PagedKVView cache = check_mla_cache(kv_cache, op);
  check_device(kv_cache, query, op, "kv_cache", "query");
  TORCH_CHECK(kv_cache.size(2) == width, op,
              ": kv_cache must be as wide as query's rows (kv_lora_rank + rope_dim = ", rank,
              " + ", width - rank, " = ", width, "), got ", kv_cache.size(2));
  TORCH_CHECK(cache.block_size >= 1 && cache.block_size <= kMaxAttentionBlockSize, op,
              ": block_size (kv_cache.size(1)) must be in [1, ", kMaxAttentionBlockSize, "], got ",
              cache.block_size);
  TORCH_CHECK(is_fp8(kv_cache.scalar_type()) || kv_cache.scalar_type() == query.scalar_type(),
              op, ": kv_cache must have query's dtype ", query.scalar_type(), " or be fp8, got ",
              kv_cache.scalar_type());
  const float* scale_data = scale_ptr(kv_scale, kv_cache, op, "kv_scale");
  TORCH_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  if (lse_out) check_lse(*lse_out, num_tokens, num_heads, out, op, "lse_out");

  PagedAttentionParams p{};
  p.num_tokens = num_tokens;
  set_attention_indices(p, query, block_tables, seq_lens, query_start_loc, max_seq_len,
                        max_query_len, op);
  set_attention_rows(p, out, query);
  p.key_cache = cache;
  p.value_cache = cache;
  p.k_scale = scale_data;
  p.v_scale = scale_data;
  p.lse_out = lse_out ? lse_out->data_ptr<float>() : nullptr;
  p.lse_token_stride = lse_out ? lse_out->stride(0) : 0;
  p.lse_head_stride = lse_out ? lse_out->stride(1) : 0;
  p.num_heads = to_int32(num_heads, op, "num_heads");
  p.num_kv_heads = 1;
  p.head_size = static_cast<int32_t>(width);
  p.head_size_v = static_cast<int32_t>(rank);
  p.num_blocks = to_int32(kv_cache.size(0), op, "num_blocks");
  p.sliding_window = -1;
  p.scale = static_cast<float>(scale);
  p.dtype = dtype;
  p.float_out = float_out;
  p.cache_dtype = dtype_of(kv_cache, op, "kv_cache");
  check_attention_indices(p, block_tables, seq_lens, query_start_loc, op);
  return p;
}

// The op with the schema's signature; each backend registers mla_attention_op<its_run> with its
// paged_attention run (the kernels take head_size_v < head_size as MLA).
template <PagedAttentionRun Run>
void mla_attention_op(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens,
                      const c10::optional<at::Tensor>& query_start_loc, int64_t max_seq_len,
                      int64_t max_query_len, double scale,
                      const c10::optional<at::Tensor>& kv_scale,
                      const c10::optional<at::Tensor>& lse_out) {
  Run(mla_attention_params(out, query, kv_cache, block_tables, seq_lens, query_start_loc,
                           max_seq_len, max_query_len, scale, kv_scale, lse_out),
      query);
}

}  // namespace pagedkv
