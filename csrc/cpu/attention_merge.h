// Merging attention results by their log-sum-exp: the partial results of split-K items, and
// the merge_attn_states op.
//
// No include guard: part of cpu/attention_kernels.inc, included once per instruction set.

// dst = sum_i e^(lse_i - M) row_i / sum_i e^(lse_i - M) over count rows (row i at
// rows + i * row_stride, its lse at lses[i * lse_stride]), M = max lse_i; returns the merged lse.
// Rows with lse -inf (nothing attended) are skipped; all empty: dst = 0, lse -inf. An lse of NaN
// (a NaN logit in that part) makes dst and the lse NaN, also where every part's is.
inline float merge_rows(const float* rows, int64_t row_stride, const float* lses,
                        int64_t lse_stride, int count, int D, float* dst) {
  float m = kNegInf;
  bool nan = false;
  for (int i = 0; i < count; ++i) {
    const float lse = lses[i * lse_stride];
    m = std::max(m, lse);
    nan |= lse != lse;
  }
  for (int d = 0; d < D; d += W) store(dst + d, splat(0.f));
  if (m == kNegInf && !nan) return kNegInf;
  float total = 0.f;
  for (int i = 0; i < count; ++i) {
    const float lse = lses[i * lse_stride];
    if (lse == kNegInf) continue;
    const vf weight = splat(std::exp(lse - m));
    total += weight[0];
    const float* row = rows + i * row_stride;
    for (int d = 0; d < D; d += W) store(dst + d, fmadd(weight, load(row + d), load(dst + d)));
  }
  const float inv = 1.f / total;
  for (int d = 0; d < D; d += W) store(dst + d, load(dst + d) * inv);
  return m + std::log(total);
}

// The slots of a split group are consecutive (see plan_work in attention.cpp).
inline void merge_partials(const PagedAttentionParams& p, const WorkItem* items,
                           const SplitGroup& group, const Partials& partials) {
  const ItemShape shape = item_shape(p, items[group.first]);
  const int D = p.head_size_v;
  const int64_t slot0 = items[group.first].slot;
  float merged[kMaxAttentionHeadSize];
  for (int r = 0; r < shape.rows; ++r) {
    const int64_t row0 = slot0 * partials.rows_per_slot + r;
    const float lse = merge_rows(partials.out + row0 * D, int64_t{partials.rows_per_slot} * D,
                                 partials.lse + row0, partials.rows_per_slot, group.count, D,
                                 merged);
    write_output(p, shape.token0 + shape.query(r), shape.head(r), merged, lse);
  }
}

inline void merge_attn_states(const MergeAttnParams& p, int64_t row_begin, int64_t row_end) {
  const int D = p.head_size;
  const int64_t bytes = elem_bytes(p.state_dtype), out_bytes = elem_bytes(p.dtype);
  float parts[2][kMaxAttentionHeadSize], merged[kMaxAttentionHeadSize];
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t t = row / p.num_heads, h = row % p.num_heads;
    const char* prefix = static_cast<const char*>(p.prefix_out) +
                         (t * p.prefix_token_stride + h * p.prefix_head_stride) * bytes;
    const char* suffix = static_cast<const char*>(p.suffix_out) +
                         (t * p.suffix_token_stride + h * p.suffix_head_stride) * bytes;
    load_row(p.state_dtype, prefix, D, 1.f, parts[0]);
    load_row(p.state_dtype, suffix, D, 1.f, parts[1]);
    // An lse of +inf marks an empty part too (FlashAttention-3 and vLLM mark empty splits so):
    // it is read as -inf, like the CUDA kernel does.
    float lses[2] = {p.prefix_lse[t * p.prefix_lse_token_stride + h * p.prefix_lse_head_stride],
                     p.suffix_lse[t * p.suffix_lse_token_stride + h * p.suffix_lse_head_stride]};
    for (float& x : lses) {
      if (x == -kNegInf) x = kNegInf;
    }
    const float lse = merge_rows(&parts[0][0], kMaxAttentionHeadSize, lses, 1, 2, D, merged);
    char* out =
        static_cast<char*>(p.out) + (t * p.out_token_stride + h * p.out_head_stride) * out_bytes;
    store_row(p.dtype, merged, D, out);
    if (p.out_lse) p.out_lse[t * p.out_lse_token_stride + h * p.out_lse_head_stride] = lse;
  }
}

