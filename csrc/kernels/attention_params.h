// Plain parameter structs of the attention ops, shared by the CPU kernels, the CUDA kernels and
// the torch glue (csrc/ops/paged_attention.h and merge_attn_states.h build and validate them).
// No torch, no CUDA.
//
// Semantics every backend implements (docs/architecture.md has the op contract):
// - Sequence i has seq_len L_i keys at positions 0..L_i-1 and q_len Q_i queries at positions
//   L_i-Q_i .. L_i-1 (decode: Q_i = 1, token i; varlen: tokens query_start_loc[i] ..
//   query_start_loc[i+1]-1). Query at position qp attends keys kp with kp <= qp and, with a
//   sliding window w > 0, qp - kp < w. Not causal (a cascade's shared prefix: every query comes
//   after the keys), every query of sequence i sits at position L_i-1 and so sees every key.
// - logit = scale * q.k (k dequantized: x * k_scale for fp8); soft cap: cap * tanh(logit / cap);
//   ALiBi: + slope[head] * (kp - qp); out = softmax(logits) . v; lse = log(sum(exp(logits))).
// - Per-(token, head) quantized caches (int8, int4, fp8 with key_scales / value_scales): k and v
//   are the stored elements times their row's scale (key_scales / value_scales at the row's
//   block, head and token), k_scale / v_scale absent.
// - Sinks (gpt-oss, vLLM's s_aux): sinks[head] is the logit of one more, virtual key whose value
//   is 0. It enters the softmax's denominator once (never once per split-K partition) and the
//   lse: out = sum_k e^(l_k) v_k / (e^s + sum_k e^(l_k)), lse = log(e^s + sum_k e^(l_k)). A row
//   with no key then has out 0 and lse s. sink_row() applies it to a finished row.
// - A decode sequence with L_i = 0 has no keys: its output row is 0 and its lse -inf.
// - Block table entries are read only for blocks holding a key some query attends:
//   blocks [first_key / block_size, ceil(L_i / block_size)), where first_key is 0, or with a
//   window max(0, qp_0 - w + 1) for the first query's position qp_0. Other entries (padding,
//   freed blocks) may hold anything.
#pragma once
#include <math.h>
#include <stdint.h>

#include "kernels/cache_params.h"

namespace pagedkv {

constexpr int32_t kMaxAttentionHeadSize = 512;   // head sizes: multiples of 8 up to this
constexpr int32_t kMaxAttentionBlockSize = 256;

struct PagedAttentionParams {
  void* out;                       // [num_tokens, num_heads, head_size_v], dtype (or float32:
                                   // float_out)
  const void* query;               // [num_tokens, num_heads, head_size], dtype
  int64_t out_token_stride, out_head_stride;  // elements; head_size dim contiguous
  int64_t q_token_stride, q_head_stride;
  PagedKVView key_cache;           // [num_blocks, num_kv_heads, block_size, head_size], cache_dtype
  PagedKVView value_cache;         // [num_blocks, num_kv_heads, block_size, head_size], read only
  const int32_t* block_tables;     // [num_seqs, max_blocks_per_seq]
  int64_t block_table_stride;      // elements between rows
  const int32_t* seq_lens;         // [num_seqs]
  const int32_t* query_start_loc;  // [num_seqs + 1], or nullptr for decode (token i = seq i)
  const float* alibi_slopes;       // [num_heads], or nullptr
  const float* k_scale;            // [1], fp8 caches only, else nullptr
  const float* v_scale;            // [1], fp8 caches only, else nullptr
  PagedKVView key_scales;          // float32 [num_blocks, num_kv_heads, block_size]: a scale per
  PagedKVView value_scales;        // row of a per-(token, head) quantized cache; data null else
  float* lse_out;                  // [num_tokens, num_heads] float32, or nullptr
  int64_t lse_token_stride, lse_head_stride;
  const float* sinks;              // [num_heads] float32 logits, or nullptr
  int64_t num_tokens;
  int32_t num_seqs, num_heads, num_kv_heads, head_size;
  int32_t head_size_v;             // of V and out: head_size, or fewer for MLA (V = the first
                                   // head_size_v elements of the key row: value_cache aliases it)
  int32_t num_blocks, max_blocks_per_seq;
  int32_t max_seq_len, max_query_len;  // upper bounds of seq_lens and of the q_len_i
  int32_t sliding_window;          // > 0, or -1 = off
  float scale;
  float soft_cap;                  // > 0, or 0 = off
  DType dtype;                     // of query and out: kFloat32, kFloat16 or kBFloat16
  DType cache_dtype;               // dtype, or kFp8E4M3 / kFp8E5M2 with k_scale and v_scale or
                                   // with key_scales and value_scales, or kInt8 / kInt4 with
                                   // key_scales and value_scales
  bool causal = true;              // false: every query at position seq_len - 1 (see above)
  bool float_out = false;          // out is float32 under a 16-bit dtype: its rows unrounded,
                                   // parts for merge_attn_states (a cascade's two levels)

  // Position of query qi (0-based within its sequence's q_len queries).
#if defined(__CUDACC__)
  __host__ __device__
#endif
  int32_t query_pos(int32_t seq_len, int32_t q_len, int32_t qi) const {
    return causal ? seq_len - q_len + qi : seq_len - 1;
  }
};

// A finished row's sink (see above): its lse over the keys becomes log(e^lse + e^sink) and its
// output is multiplied by `keep` = e^lse / (e^lse + e^sink), computed without overflow. A row
// with no key (lse -inf) keeps nothing and takes the sink's lse; a sink of -inf changes nothing.
struct SinkedRow {
  float keep, lse;
};
#if defined(__CUDACC__)
__host__ __device__
#endif
inline SinkedRow sink_row(float lse, float sink) {
  const float m = fmaxf(lse, sink);
  if (m == -INFINITY) return {0.f, -INFINITY};
  const float a = expf(lse - m), b = expf(sink - m);
  return {a / (a + b), m + logf(a + b)};
}

// out = (exp(lse_p) * prefix_out + exp(lse_s) * suffix_out) / (exp(lse_p) + exp(lse_s)),
// out_lse = log(exp(lse_p) + exp(lse_s)), computed stably. An lse of -inf marks an empty part
// (its rows are ignored); both empty: out = 0, out_lse = -inf.
struct MergeAttnParams {
  void* out;                       // [num_tokens, num_heads, head_size], dtype
  float* out_lse;                  // [num_tokens, num_heads] float32, or nullptr
  const void* prefix_out;          // [num_tokens, num_heads, head_size], state_dtype
  const float* prefix_lse;         // [num_tokens, num_heads] float32
  const void* suffix_out;          // [num_tokens, num_heads, head_size], state_dtype
  const float* suffix_lse;         // [num_tokens, num_heads] float32
  int64_t out_token_stride, out_head_stride;  // elements; head_size dim contiguous
  int64_t prefix_token_stride, prefix_head_stride;
  int64_t suffix_token_stride, suffix_head_stride;
  int64_t out_lse_token_stride, out_lse_head_stride;
  int64_t prefix_lse_token_stride, prefix_lse_head_stride;
  int64_t suffix_lse_token_stride, suffix_lse_head_stride;
  int64_t num_tokens;
  int32_t num_heads, head_size;
  DType dtype;
  DType state_dtype;               // of prefix_out and suffix_out: dtype, or kFloat32
};

}  // namespace pagedkv
