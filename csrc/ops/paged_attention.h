// paged_attention: its schema, its kernel parameters from tensors (the checks every backend
// shares, so cpu, cuda and simt accept and reject exactly the same inputs before anything is
// written) and the op every backend registers, paged_attention_op<Run>.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "glue/tensor_checks.h"
#include "kernels/attention_params.h"

namespace pagedkv {

// Attention of each query token over its sequence's paged K/V: decode, or varlen queries with
// query_start_loc, causal or (causal=False, a cascade's shared prefix) all seeing every key.
inline constexpr char kPagedAttentionSchema[] =
    "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
    "Tensor block_tables, Tensor seq_lens, Tensor? query_start_loc, int max_seq_len, "
    "int max_query_len, float scale, Tensor? alibi_slopes, int sliding_window, float soft_cap, "
    "Tensor? k_scale, Tensor? v_scale, Tensor(b!)? lse_out, Tensor? sinks=None, "
    "Tensor? key_cache_scales=None, Tensor? value_cache_scales=None, bool causal=True) -> ()";

// Index contents (lengths, query_start_loc, block ids), checked when readable for free.
inline void check_attention_indices(const PagedAttentionParams& p, const at::Tensor& block_tables,
                                    const at::Tensor& seq_lens,
                                    const c10::optional<at::Tensor>& query_start_loc,
                                    const char* op) {
  if (!index_checks_enabled(seq_lens)) return;
  const at::Tensor lens = seq_lens.cpu();
  const at::Tensor table = block_tables.cpu();
  const at::Tensor starts = query_start_loc ? query_start_loc->cpu() : at::Tensor();
  const int32_t* L = lens.data_ptr<int32_t>();
  const int32_t* qsl = starts.defined() ? starts.data_ptr<int32_t>() : nullptr;
  if (qsl) {
    TORCH_CHECK(qsl[0] == 0, op, ": query_start_loc[0] must be 0, got ", qsl[0]);
    TORCH_CHECK(qsl[p.num_seqs] == p.num_tokens, op, ": query_start_loc[-1] must be num_tokens = ",
                p.num_tokens, ", got ", qsl[p.num_seqs]);
  }
  const int64_t block_size = p.key_cache.block_size;
  for (int32_t s = 0; s < p.num_seqs; ++s) {
    TORCH_CHECK(L[s] >= 0 && L[s] <= p.max_seq_len, op, ": seq_lens[", s, "] = ", L[s],
                " is outside [0, max_seq_len = ", p.max_seq_len, "]");
    int64_t q_len = 1;
    if (qsl) {
      q_len = static_cast<int64_t>(qsl[s + 1]) - qsl[s];
      TORCH_CHECK(q_len >= 0, op, ": query_start_loc must be non-decreasing, got ", qsl[s],
                  " then ", qsl[s + 1], " at ", s);
      // Causal queries are the sequence's last positions; others all sit at its end.
      TORCH_CHECK(!p.causal || q_len <= L[s], op, ": sequence ", s, " has ", q_len,
                  " query tokens (query_start_loc) but seq_lens[", s, "] = ", L[s]);
      TORCH_CHECK(q_len <= p.max_query_len, op, ": sequence ", s, " has ", q_len,
                  " query tokens, more than max_query_len = ", p.max_query_len);
    }
    if (L[s] == 0 || q_len == 0) continue;
    const int64_t num_blocks_needed = (L[s] + block_size - 1) / block_size;
    TORCH_CHECK(num_blocks_needed <= p.max_blocks_per_seq, op, ": seq_lens[", s, "] = ", L[s],
                " needs ", num_blocks_needed, " blocks, block_tables has ", p.max_blocks_per_seq,
                " per sequence");
    int64_t first_key = 0;
    const int64_t first_query_pos = p.causal ? L[s] - q_len : L[s] - 1;
    if (p.sliding_window > 0) {
      first_key = std::max<int64_t>(0, first_query_pos - p.sliding_window + 1);
    }
    const int32_t* row = table.data_ptr<int32_t>() + s * p.block_table_stride;
    for (int64_t b = first_key / block_size; b < num_blocks_needed; ++b) {
      TORCH_CHECK(row[b] >= 0 && row[b] < p.num_blocks, op, ": block_tables[", s, ", ", b,
                  "] = ", row[b], " is out of range for a cache of ", p.num_blocks, " blocks");
    }
  }
}

// The sequences' index tensors and bounds (shapes, dtypes, devices), set into p: block_tables,
// seq_lens, query_start_loc, max_seq_len, max_query_len; p.num_tokens must be set. The contents
// are checked after the caches (check_attention_indices).
inline void set_attention_indices(PagedAttentionParams& p, const at::Tensor& query,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  const c10::optional<at::Tensor>& query_start_loc,
                                  int64_t max_seq_len, int64_t max_query_len, const char* op) {
  check_device(block_tables, query, op, "block_tables", "query");
  check_index(block_tables, at::kInt, op, "block_tables");
  check_dim(block_tables, 2, op, "block_tables", "[num_seqs, max_blocks_per_seq]");
  const int64_t num_seqs = block_tables.size(0);
  check_device(seq_lens, query, op, "seq_lens", "query");
  check_index(seq_lens, at::kInt, op, "seq_lens");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == num_seqs, op,
              ": seq_lens must be [num_seqs] = [", num_seqs, "] (block_tables rows), got ",
              seq_lens.sizes());
  if (query_start_loc) {
    check_device(*query_start_loc, query, op, "query_start_loc", "query");
    check_index(*query_start_loc, at::kInt, op, "query_start_loc");
    TORCH_CHECK(query_start_loc->dim() == 1 && query_start_loc->size(0) == num_seqs + 1, op,
                ": query_start_loc must be [num_seqs + 1] = [", num_seqs + 1, "], got ",
                query_start_loc->sizes());
  } else {
    TORCH_CHECK(p.num_tokens == num_seqs, op,
                ": without query_start_loc (decode) query must have one token per sequence: ",
                num_seqs, " sequences, got ", p.num_tokens, " tokens");
  }
  TORCH_CHECK(max_query_len >= 1 || p.num_tokens == 0, op, ": max_query_len must be >= 1, got ",
              max_query_len);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.block_table_stride = block_tables.stride(0);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.query_start_loc = query_start_loc ? query_start_loc->data_ptr<int32_t>() : nullptr;
  p.num_seqs = to_int32(num_seqs, op, "num_seqs");
  p.max_blocks_per_seq = to_int32(block_tables.size(1), op, "max_blocks_per_seq");
  p.max_seq_len = to_int32(max_seq_len, op, "max_seq_len");
  p.max_query_len = to_int32(max_query_len, op, "max_query_len");
}

// The out and query rows (their pointers and token / head strides), set into p.
inline void set_attention_rows(PagedAttentionParams& p, const at::Tensor& out,
                               const at::Tensor& query) {
  p.out = out.data_ptr();
  p.query = query.data_ptr();
  p.out_token_stride = out.stride(0);
  p.out_head_stride = out.stride(1);
  p.q_token_stride = query.stride(0);
  p.q_head_stride = query.stride(1);
}

inline PagedAttentionParams paged_attention_params(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const c10::optional<at::Tensor>& query_start_loc, int64_t max_seq_len, int64_t max_query_len,
    double scale, const c10::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
    double soft_cap, const c10::optional<at::Tensor>& k_scale,
    const c10::optional<at::Tensor>& v_scale, const c10::optional<at::Tensor>& lse_out,
    const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& key_cache_scales,
    const c10::optional<at::Tensor>& value_cache_scales, bool causal) {
  constexpr const char* op = "paged_attention";
  const DType dtype = check_rows(query, op, "query");
  // out: query's dtype, or float32 under a 16-bit query (its rows unrounded, to be merged)
  const bool float_out = out.scalar_type() == at::kFloat && dtype != DType::kFloat32;
  check_like(out, query, op, "out", "query", /*float_ok=*/true);
  TORCH_CHECK(out.stride(2) == 1 || out.size(2) <= 1, op,
              ": out must have a contiguous last (head_size) dim, got strides ", out.strides());
  check_cache_pair(key_cache, value_cache, op);
  check_device(key_cache, query, op, "key_cache", "query");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1);
  const int64_t head_size = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  const DType cache_dtype = cache_dtype_of(key_cache, op, "key_cache");
  TORCH_CHECK(row_elements(cache_dtype, key_cache.size(3)) == head_size, op,
              ": key_cache head_size ", row_elements(cache_dtype, key_cache.size(3)),
              cache_dtype == DType::kInt4 ? " (int4: two a byte)" : "",
              " must match query's head_size ", head_size);
  TORCH_CHECK(head_size >= 8 && head_size <= kMaxAttentionHeadSize && head_size % 8 == 0, op,
              ": head_size must be a multiple of 8 in [8, ", kMaxAttentionHeadSize, "], got ", head_size);
  TORCH_CHECK(block_size >= 1 && block_size <= kMaxAttentionBlockSize, op,
              ": block_size (key_cache.size(2)) must be in [1, ", kMaxAttentionBlockSize, "], got ",
              block_size);
  TORCH_CHECK(num_kv_heads >= 1 && num_heads % num_kv_heads == 0, op, ": num_heads ", num_heads,
              " must be a multiple of num_kv_heads ", num_kv_heads);
  TORCH_CHECK(is_fp8(key_cache.scalar_type()) || is_int_cache(cache_dtype) ||
                  key_cache.scalar_type() == query.scalar_type(),
              op, ": key_cache must have query's dtype ", query.scalar_type(),
              " or be fp8, int8 or uint8 (int4), got ", key_cache.scalar_type());
  const CacheScales scales = cache_scales_of(key_cache, value_cache, cache_dtype, k_scale, v_scale,
                                             key_cache_scales, value_cache_scales, op);

  TORCH_CHECK(sliding_window == -1 || sliding_window > 0, op,
              ": sliding_window must be -1 (off) or > 0, got ", sliding_window);
  TORCH_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  TORCH_CHECK(std::isfinite(soft_cap) && soft_cap >= 0, op,
              ": soft_cap must be 0 (off) or > 0, got ", soft_cap);
  if (alibi_slopes) {
    check_device(*alibi_slopes, query, op, "alibi_slopes", "query");
    check_index(*alibi_slopes, at::kFloat, op, "alibi_slopes");
    TORCH_CHECK(alibi_slopes->dim() == 1 && alibi_slopes->size(0) == num_heads, op,
                ": alibi_slopes must be [num_heads] = [", num_heads, "], got ",
                alibi_slopes->sizes());
  }
  if (lse_out) check_lse(*lse_out, num_tokens, num_heads, out, op, "lse_out");
  if (sinks) {
    check_device(*sinks, query, op, "sinks", "query");
    check_index(*sinks, at::kFloat, op, "sinks");
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == num_heads, op,
                ": sinks must be [num_heads] = [", num_heads, "], got ", sinks->sizes());
  }

  PagedAttentionParams p{};
  p.num_tokens = num_tokens;
  set_attention_indices(p, query, block_tables, seq_lens, query_start_loc, max_seq_len,
                        max_query_len, op);
  set_attention_rows(p, out, query);
  p.key_cache = paged_kv_of(key_cache);
  p.value_cache = paged_kv_of(value_cache);
  p.alibi_slopes = alibi_slopes ? alibi_slopes->data_ptr<float>() : nullptr;
  p.k_scale = scales.k_scale;
  p.v_scale = scales.v_scale;
  p.key_scales = scales.key_scales;
  p.value_scales = scales.value_scales;
  p.lse_out = lse_out ? lse_out->data_ptr<float>() : nullptr;
  p.lse_token_stride = lse_out ? lse_out->stride(0) : 0;
  p.lse_head_stride = lse_out ? lse_out->stride(1) : 0;
  p.sinks = sinks ? sinks->data_ptr<float>() : nullptr;
  p.num_heads = to_int32(num_heads, op, "num_heads");
  p.num_kv_heads = to_int32(num_kv_heads, op, "num_kv_heads");
  p.head_size = static_cast<int32_t>(head_size);
  p.head_size_v = p.head_size;
  p.num_blocks = to_int32(key_cache.size(0), op, "num_blocks");
  p.sliding_window = static_cast<int32_t>(std::min<int64_t>(sliding_window, INT32_MAX));
  p.scale = static_cast<float>(scale);
  p.soft_cap = static_cast<float>(soft_cap);
  p.dtype = dtype;
  p.cache_dtype = cache_dtype;
  p.float_out = float_out;
  p.causal = causal;
  check_attention_indices(p, block_tables, seq_lens, query_start_loc, op);
  return p;
}

// The backend's part: Run(params, query) after the checks; query places the work (device).
using PagedAttentionRun = void (*)(const PagedAttentionParams&, const at::Tensor& query);

// The op with the schema's signature; each backend registers paged_attention_op<its_run>.
template <PagedAttentionRun Run>
void paged_attention_op(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens,
                        const c10::optional<at::Tensor>& query_start_loc, int64_t max_seq_len,
                        int64_t max_query_len, double scale,
                        const c10::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                        double soft_cap, const c10::optional<at::Tensor>& k_scale,
                        const c10::optional<at::Tensor>& v_scale,
                        const c10::optional<at::Tensor>& lse_out,
                        const c10::optional<at::Tensor>& sinks,
                        const c10::optional<at::Tensor>& key_cache_scales,
                        const c10::optional<at::Tensor>& value_cache_scales, bool causal) {
  Run(paged_attention_params(out, query, key_cache, value_cache, block_tables, seq_lens,
                             query_start_loc, max_seq_len, max_query_len, scale, alibi_slopes,
                             sliding_window, soft_cap, k_scale, v_scale, lse_out, sinks,
                             key_cache_scales, value_cache_scales, causal),
      query);
}

}  // namespace pagedkv
