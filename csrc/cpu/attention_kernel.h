// CPU paged attention, one work item at a time (cpu/attention_work.h), written once and compiled
// per instruction set. For each chunk of kKeysPerChunk keys of the item's range:
//   K, V <- the chunk's rows gathered through the block table, as float    (read once)
//   S = Q K^T for all R rows of the item (the kv head's query heads x query tokens)
//   S <- soft cap, ALiBi, causal / window mask;  m' = max(m, rowmax S)
//   P = exp(S - m'),  l = l e^(m - m') + rowsum P,  O = O e^(m - m') + P V     (online softmax)
// and at the end out = O / l, lse = m + log l. Q is pre-multiplied by scale * k_scale and O by
// v_scale, so dequantization costs nothing per element.
//
// No include guard: included once per instruction set inside namespace pagedkv::cpu::<isa>,
// after <algorithm>, <cmath>, <cstring>, <limits>, <type_traits> and cpu/attention_work.h.

#include "cpu/attention_simd.h"

constexpr int TC = kKeysPerChunk;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- rows in and out ----------------------------------------------------------------------

template <typename T>
void load_row(const T* src, int D, float mul, float* dst) {
  for (int d = 0; d < D; d += W) store(dst + d, load_float(src + d) * mul);
}

inline void load_row(DType dtype, const void* src, int D, float mul, float* dst) {
  switch (dtype) {
    case DType::kFloat16: return load_row(static_cast<const f16_t*>(src), D, mul, dst);
    case DType::kBFloat16: return load_row(static_cast<const bf16_t*>(src), D, mul, dst);
    default: return load_row(static_cast<const float*>(src), D, mul, dst);
  }
}

inline void store_row(DType dtype, const float* src, int D, void* dst) {
  switch (dtype) {
    case DType::kFloat16:
      for (int d = 0; d < D; ++d) static_cast<uint16_t*>(dst)[d] = float_to_half_bits(src[d]);
      return;
    case DType::kBFloat16:
      for (int d = 0; d < D; ++d) static_cast<uint16_t*>(dst)[d] = float_to_bf16_bits(src[d]);
      return;
    default: std::memcpy(dst, src, D * sizeof(float));
  }
}

inline int64_t elem_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// Writes one final row (token, head) of out and lse_out.
inline void write_output(const PagedAttentionParams& p, int64_t token, int32_t head,
                         const float* row, float lse) {
  char* dst = static_cast<char*>(p.out) +
              (token * p.out_token_stride + head * p.out_head_stride) * elem_bytes(p.dtype);
  store_row(p.dtype, row, p.head_size, dst);
  if (p.lse_out) p.lse_out[token * p.lse_token_stride + head * p.lse_head_stride] = lse;
}

// ---- the item's geometry ------------------------------------------------------------------

struct ItemShape {
  int32_t group;       // query heads per kv head
  int32_t head0;       // the kv head's first query head
  int32_t rows;        // group * q_count; row r = query token r / group, head r % group
  int64_t token0;      // token of the item's first query
  int32_t qpos0;       // position of the item's first query
};

inline ItemShape item_shape(const PagedAttentionParams& p, const WorkItem& w) {
  const int32_t L = p.seq_lens[w.seq];
  const int32_t first = p.query_start_loc ? p.query_start_loc[w.seq] : w.seq;
  const int32_t q_len = p.query_start_loc ? p.query_start_loc[w.seq + 1] - first : 1;
  ItemShape s;
  s.group = p.num_heads / p.num_kv_heads;
  s.head0 = w.kv_head * s.group;
  s.rows = s.group * w.q_count;
  s.token0 = static_cast<int64_t>(first) + w.q_begin;
  s.qpos0 = L - q_len + w.q_begin;
  return s;
}

// ---- K/V gather ---------------------------------------------------------------------------

// dst[i] = row of key position key0 + i (i < n) of one kv head, as float.
template <typename C>
void gather(const C* cache, const CacheStrides& s, const int32_t* table, int32_t block_size,
            int64_t key0, int n, int D, float* dst) {
  int64_t b = key0 / block_size;
  int32_t off = static_cast<int32_t>(key0 % block_size);
  for (int i = 0; i < n; ++i) {
    const C* src = cache + static_cast<int64_t>(table[b]) * s.block + off * s.token;
    for (int d = 0; d < D; d += W) store(dst + i * D + d, load_float(src + d));
    if (++off == block_size) {
      off = 0;
      ++b;
    }
  }
}

// ---- S = Q K^T ----------------------------------------------------------------------------

// s[r * TC + t] = q_r . k_t for RB rows of q and TB keys of k (row stride D).
template <int RB, int TB>
inline void qk_tile(const float* q, const float* k, int D, float* s) {
  vf acc[RB][TB] = {};
  for (int d = 0; d < D; d += W) {
    vf kv[TB];
#pragma GCC unroll 8
    for (int t = 0; t < TB; ++t) kv[t] = load(k + t * D + d);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const vf qv = load(q + r * D + d);
#pragma GCC unroll 8
      for (int t = 0; t < TB; ++t) acc[r][t] = fmadd(qv, kv[t], acc[r][t]);
    }
  }
  if constexpr (RB * TB == 8) {
    float sums[8];
    hsum8(&acc[0][0], sums);
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < TB; ++t) s[r * TC + t] = sums[r * TB + t];
  } else {
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < TB; ++t) s[r * TC + t] = hsum(acc[r][t]);
  }
}

template <int RB, int TB>
void qk_rows(const float* q, const float* k, int n, int D, float* s) {
  int t = 0;
  for (; t + TB <= n; t += TB) qk_tile<RB, TB>(q, k + t * D, D, s + t);
  for (; t < n; ++t) qk_tile<RB, 1>(q, k + t * D, D, s + t);
}

inline void qk(const float* q, int R, const float* k, int n, int D, float* s) {
  int r = 0;
  for (; r + 4 <= R; r += 4) qk_rows<4, 2>(q + r * D, k, n, D, s + r * TC);
  if (R - r >= 2) {
    qk_rows<2, 4>(q + r * D, k, n, D, s + r * TC);
    r += 2;
  }
  if (R - r == 1) qk_rows<1, 8>(q + r * D, k, n, D, s + r * TC);
}

// ---- O += P V -----------------------------------------------------------------------------

// o[r][0, NV * W) += sum_t p[r * TC + t] v[t][0, NV * W) for RB rows (o row stride D).
template <int RB, int NV>
inline void pv_tile(const float* p, const float* v, int n, int D, float* o) {
  vf acc[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = load(o + r * D + j * W);
  for (int t = 0; t < n; ++t) {
    vf vv[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) vv[j] = load(v + t * D + j * W);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const vf pr = splat(p[r * TC + t]);
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) acc[r][j] = fmadd(pr, vv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NV; ++j) store(o + r * D + j * W, acc[r][j]);
}

template <int RB, int NV>
void pv_rows(const float* p, const float* v, int n, int D, float* o) {
  int d = 0;
  for (; d + NV * W <= D; d += NV * W) pv_tile<RB, NV>(p, v + d, n, D, o + d);
  for (; d < D; d += W) pv_tile<RB, 1>(p, v + d, n, D, o + d);
}

inline void pv(const float* p, int R, const float* v, int n, int D, float* o) {
  int r = 0;
  for (; r + 4 <= R; r += 4) pv_rows<4, 2>(p + r * TC, v, n, D, o + r * D);
  if (R - r >= 2) {
    pv_rows<2, 4>(p + r * TC, v, n, D, o + r * D);
    r += 2;
  }
  if (R - r == 1) pv_rows<1, 8>(p + r * TC, v, n, D, o + r * D);
}

// ---- online softmax -----------------------------------------------------------------------

// Turns row r's logits s[0, n) for keys key0.. into probabilities relative to the running max
// m (updated), adds their sum to l and rescales the row's accumulator o.
inline void softmax_row(const PagedAttentionParams& p, const ItemShape& shape, int r,
                        int64_t key0, int n, float* s, float* o, float& m, float& l) {
  const int32_t qpos = shape.qpos0 + r / shape.group;
  const int64_t lo = p.sliding_window > 0 ? int64_t{qpos} - p.sliding_window + 1 : 0;
  const int a = static_cast<int>(std::max<int64_t>(0, lo - key0));
  const int b = static_cast<int>(std::min<int64_t>(n, int64_t{qpos} + 1 - key0));
  const int npad = (n + W - 1) / W * W;
  if (a >= b) {
    for (int t = 0; t < npad; ++t) s[t] = 0.f;
    return;
  }
  const float slope = p.alibi_slopes ? p.alibi_slopes[shape.head0 + r % shape.group] : 0.f;
  const float cap = p.soft_cap, inv_cap = cap > 0 ? 1.f / cap : 0.f;
  const float rel0 = static_cast<float>(key0 - qpos);  // key position - query position
  vf mx = splat(kNegInf);
  for (int t = 0; t < npad; t += W) {
    vf x = load(s + t);
    if (cap > 0) x = cap * vtanh(x * inv_cap);
    if (slope != 0.f) x = fmadd(splat(slope), __builtin_convertvector(iota() + t, vf) + rel0, x);
    const vi idx = iota() + t;
    x = (idx >= a) & (idx < b) ? x : splat(kNegInf);
    store(s + t, x);
    mx = vmax(mx, x);
  }
  const float m_new = std::max(m, hmax(mx));
  const float correction = std::exp(m - m_new);  // 0 for the first keys (m = -inf)
  vf sum = splat(0.f);
  for (int t = 0; t < npad; t += W) {
    const vf e = vexp(load(s + t) - m_new);
    store(s + t, e);
    sum += e;
  }
  l = l * correction + hsum(sum);
  m = m_new;
  if (correction != 1.f) {
    for (int d = 0; d < p.head_size; d += W) store(o + d, load(o + d) * correction);
  }
}

// ---- one work item ------------------------------------------------------------------------

struct Scratch {
  float *q, *o, *s, *m, *l, *k, *v;
};

// Layout of scratch_floats(rows, D) floats for an item of R <= rows rows.
inline Scratch carve(float* base, int R, int D) {
  const int r16 = (R + 15) / 16 * 16;
  Scratch sc;
  sc.q = base;
  sc.o = sc.q + R * D;
  sc.s = sc.o + R * D;
  sc.m = sc.s + R * TC;
  sc.l = sc.m + r16;
  sc.k = sc.l + r16;
  sc.v = sc.k + TC * D;
  return sc;
}

template <typename C>
void attend_typed(const PagedAttentionParams& p, const WorkItem& w, float* scratch,
                  const Partials& partials) {
  const ItemShape shape = item_shape(p, w);
  const int D = p.head_size, R = shape.rows;
  const Scratch sc = carve(scratch, R, D);
  const float k_mul = cache_factor<C>() * (p.k_scale ? *p.k_scale : 1.f);
  const float v_mul = cache_factor<C>() * (p.v_scale ? *p.v_scale : 1.f);
  for (int r = 0; r < R; ++r) {
    const int64_t token = shape.token0 + r / shape.group;
    const int32_t head = shape.head0 + r % shape.group;
    const char* src = static_cast<const char*>(p.query) +
                      (token * p.q_token_stride + head * p.q_head_stride) * elem_bytes(p.dtype);
    load_row(p.dtype, src, D, p.scale * k_mul, sc.q + r * D);
    std::memset(sc.o + r * D, 0, D * sizeof(float));
    sc.m[r] = kNegInf;
    sc.l[r] = 0.f;
  }
  const C* k_cache = static_cast<const C*>(p.key_cache) + w.kv_head * p.k_strides.head;
  const C* v_cache = static_cast<const C*>(p.value_cache) + w.kv_head * p.v_strides.head;
  const int32_t* table = p.block_tables + w.seq * p.block_table_stride;
  for (int64_t key0 = w.key_begin; key0 < w.key_end; key0 += TC) {
    const int n = static_cast<int>(std::min<int64_t>(TC, w.key_end - key0));
    gather(k_cache, p.k_strides, table, p.block_size, key0, n, D, sc.k);
    gather(v_cache, p.v_strides, table, p.block_size, key0, n, D, sc.v);
    qk(sc.q, R, sc.k, n, D, sc.s);
    for (int r = 0; r < R; ++r)
      softmax_row(p, shape, r, key0, n, sc.s + r * TC, sc.o + r * D, sc.m[r], sc.l[r]);
    pv(sc.s, R, sc.v, n, D, sc.o);
  }
  for (int r = 0; r < R; ++r) {
    const bool empty = sc.l[r] == 0.f;
    const float mul = empty ? 0.f : v_mul / sc.l[r];
    const float lse = empty ? kNegInf : sc.m[r] + std::log(sc.l[r]);
    float* o = sc.o + r * D;
    for (int d = 0; d < D; d += W) store(o + d, load(o + d) * mul);
    if (w.slot >= 0) {
      const int64_t row = w.slot * partials.rows_per_slot + r;
      std::memcpy(partials.out + row * D, o, D * sizeof(float));
      partials.lse[row] = lse;
    } else {
      write_output(p, shape.token0 + r / shape.group, shape.head0 + r % shape.group, o, lse);
    }
  }
}

inline void attend(const PagedAttentionParams& p, const WorkItem& w, float* scratch,
                   const Partials& partials) {
  switch (p.cache_dtype) {
    case DType::kFloat16: return attend_typed<f16_t>(p, w, scratch, partials);
    case DType::kBFloat16: return attend_typed<bf16_t>(p, w, scratch, partials);
    case DType::kFp8E4M3: return attend_typed<e4m3_t>(p, w, scratch, partials);
    case DType::kFp8E5M2: return attend_typed<e5m2_t>(p, w, scratch, partials);
    default: return attend_typed<float>(p, w, scratch, partials);
  }
}

// ---- merging by log-sum-exp ---------------------------------------------------------------

// dst = sum_i e^(lse_i - M) row_i / sum_i e^(lse_i - M) over count rows (row i at
// rows + i * row_stride, its lse at lses[i * lse_stride]), M = max lse_i; returns the merged lse.
// Rows with lse -inf (nothing attended) are skipped; all empty: dst = 0, lse -inf.
inline float merge_rows(const float* rows, int64_t row_stride, const float* lses,
                        int64_t lse_stride, int count, int D, float* dst) {
  float m = kNegInf;
  for (int i = 0; i < count; ++i) m = std::max(m, lses[i * lse_stride]);
  for (int d = 0; d < D; d += W) store(dst + d, splat(0.f));
  if (m == kNegInf) return kNegInf;
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
  const int D = p.head_size;
  const int64_t slot0 = items[group.first].slot;
  float merged[kMaxAttentionHeadSize];
  for (int r = 0; r < shape.rows; ++r) {
    const int64_t row0 = slot0 * partials.rows_per_slot + r;
    const float lse = merge_rows(partials.out + row0 * D, int64_t{partials.rows_per_slot} * D,
                                 partials.lse + row0, partials.rows_per_slot, group.count, D,
                                 merged);
    write_output(p, shape.token0 + r / shape.group, shape.head0 + r % shape.group, merged, lse);
  }
}

inline void merge_attn_states(const MergeAttnParams& p, int64_t row_begin, int64_t row_end) {
  const int D = p.head_size;
  const int64_t bytes = elem_bytes(p.dtype);
  float parts[2][kMaxAttentionHeadSize], merged[kMaxAttentionHeadSize];
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t t = row / p.num_heads, h = row % p.num_heads;
    const char* prefix = static_cast<const char*>(p.prefix_out) +
                         (t * p.prefix_token_stride + h * p.prefix_head_stride) * bytes;
    const char* suffix = static_cast<const char*>(p.suffix_out) +
                         (t * p.suffix_token_stride + h * p.suffix_head_stride) * bytes;
    load_row(p.dtype, prefix, D, 1.f, parts[0]);
    load_row(p.dtype, suffix, D, 1.f, parts[1]);
    const float lses[2] = {
        p.prefix_lse[t * p.prefix_lse_token_stride + h * p.prefix_lse_head_stride],
        p.suffix_lse[t * p.suffix_lse_token_stride + h * p.suffix_lse_head_stride]};
    const float lse = merge_rows(&parts[0][0], kMaxAttentionHeadSize, lses, 1, 2, D, merged);
    char* out = static_cast<char*>(p.out) + (t * p.out_token_stride + h * p.out_head_stride) * bytes;
    store_row(p.dtype, merged, D, out);
    if (p.out_lse) p.out_lse[t * p.out_lse_token_stride + h * p.out_lse_head_stride] = lse;
  }
}

inline const AttentionKernels& kernels(const char* name) {
  static const AttentionKernels k{name, &attend, &merge_partials, &merge_attn_states};
  return k;
}
