// CPU paged attention, one work item at a time (cpu/attention_work.h), written once and compiled
// per instruction set. For each chunk of kKeysPerChunk keys of the item's range:
//   K, V <- the chunk's row addresses, through the block table (rows kPrefetchChunks ahead
//           are prefetched meanwhile); elements are converted to float in registers
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
constexpr int kPrefetchChunks = 2;  // rows are prefetched this many chunks ahead of their use
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

// Row r of an item: kv head r / rows_per_head of the item, query token (r % rows_per_head) /
// group of the tile, query head r % group of the kv head's group.
struct ItemShape {
  int32_t group;          // query heads per kv head
  int32_t head0;          // the item's first query head
  int32_t rows_per_head;  // group * q_count
  int32_t rows;           // kv_heads * rows_per_head
  int64_t token0;         // token of the item's first query
  int32_t qpos0;          // position of the item's first query

  int32_t query(int r) const { return (r % rows_per_head) / group; }
  int32_t head(int r) const { return head0 + r / rows_per_head * group + r % group; }
};

inline ItemShape item_shape(const PagedAttentionParams& p, const WorkItem& w) {
  const int32_t L = p.seq_lens[w.seq];
  const int32_t first = p.query_start_loc ? p.query_start_loc[w.seq] : w.seq;
  const int32_t q_len = p.query_start_loc ? p.query_start_loc[w.seq + 1] - first : 1;
  ItemShape s;
  s.group = p.num_heads / p.num_kv_heads;
  s.head0 = w.kv_head * s.group;
  s.rows_per_head = s.group * w.q_count;
  s.rows = s.rows_per_head * w.kv_heads;
  s.token0 = static_cast<int64_t>(first) + w.q_begin;
  s.qpos0 = L - q_len + w.q_begin;
  return s;
}

// ---- K/V rows -----------------------------------------------------------------------------

// Key position -> element offset of its row in a cache (kv head 0), walking the block table.
struct RowCursor {
  const CacheStrides* s;
  const int32_t* table;
  int32_t block_size;
  int64_t block;
  int32_t offset;

  RowCursor(const CacheStrides& st, const int32_t* t, int32_t bs, int64_t pos)
      : s(&st), table(t), block_size(bs), block(pos / bs),
        offset(static_cast<int32_t>(pos % bs)) {}

  // offsets[i] = offset of the next n positions' rows; the cursor moves past them.
  void take(int n, int64_t* offsets) {
    for (int i = 0; i < n; ++i) {
      offsets[i] = static_cast<int64_t>(table[block]) * s->block + offset * s->token;
      if (++offset == block_size) {
        offset = 0;
        ++block;
      }
    }
  }
};

// ---- S = Q K^T ----------------------------------------------------------------------------
// K rows are read straight from the cache and converted in registers: each K element is loaded
// once per 4 query rows (once in all for decode with a group of up to 4 heads).

// s[r * TC + t] = q_r . k_t for RB rows of q (row stride D) and TB keys.
template <int RB, int TB, typename C>
inline void qk_tile(const float* q, const C* const* k, int D, float* s) {
  vf acc[RB][TB] = {};
  for (int d = 0; d < D; d += W) {
    vf kv[TB];
#pragma GCC unroll 16
    for (int t = 0; t < TB; ++t) kv[t] = load_float(k[t] + d);
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      const vf qv = load(q + r * D + d);
#pragma GCC unroll 16
      for (int t = 0; t < TB; ++t) acc[r][t] = fmadd(qv, kv[t], acc[r][t]);
    }
  }
  if constexpr (RB * TB >= 8) {
    float sums[RB * TB];
    hsum8(&acc[0][0], sums);
    if constexpr (RB * TB >= 16) hsum8(&acc[0][0] + 8, sums + 8);
    for (int i = (RB * TB) / 8 * 8; i < RB * TB; ++i) sums[i] = hsum((&acc[0][0])[i]);
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < TB; ++t) s[r * TC + t] = sums[r * TB + t];
  } else {
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < TB; ++t) s[r * TC + t] = hsum(acc[r][t]);
  }
}

// The rows of a later chunk, prefetched while this chunk is computed: K rows during S = Q K^T,
// V rows during O += P V, a few at a time so that the requests spread over the work.
template <typename C>
struct Ahead {
  const C* k;  // the kv head's caches
  const C* v;
  const int64_t* k_offsets;  // of the rows to prefetch
  const int64_t* v_offsets;
  int n;
  int row_bytes;
  int k_done = 0, v_done = 0;

  void fetch_k(int until) {
    for (; k_done < std::min(until, n); ++k_done) prefetch(k + k_offsets[k_done], row_bytes);
  }
  void fetch_v(int until) {
    for (; v_done < std::min(until, n); ++v_done) prefetch(v + v_offsets[v_done], row_bytes);
  }
};

// Tiles of RB rows x TB keys with 12 independent FMA chains (enough to hide the FMA latency,
// few enough for 16 AVX2 registers), then 2 and 1 keys for the chunk's tail.
template <int RB, typename C>
void qk_rows(const float* q, const C* const* k, int n, int D, float* s, Ahead<C>* ahead) {
  constexpr int TB = 12 / RB;
  int t = 0;
  for (; t + TB <= n; t += TB) {
    if (ahead) ahead->fetch_k(t + TB);
    qk_tile<RB, TB>(q, k + t, D, s + t);
  }
  for (; t + 2 <= n; t += 2) qk_tile<RB, 2>(q, k + t, D, s + t);
  if (t < n) qk_tile<RB, 1>(q, k + t, D, s + t);
  if (ahead) ahead->fetch_k(TC);
}

template <typename C>
void qk(const float* q, int R, const C* const* k, int n, int D, float* s, Ahead<C>& ahead) {
  int r = 0;
  Ahead<C>* fetch = &ahead;  // prefetch once, with the first rows
  for (; r + 4 <= R; r += 4, fetch = nullptr) qk_rows<4>(q + r * D, k, n, D, s + r * TC, fetch);
  if (R - r >= 2) {
    qk_rows<2>(q + r * D, k, n, D, s + r * TC, fetch);
    r += 2;
    fetch = nullptr;
  }
  if (R - r == 1) qk_rows<1>(q + r * D, k, n, D, s + r * TC, fetch);
}

// ---- O += P V -----------------------------------------------------------------------------

// o[r][d0, d0 + NV * W) += sum_t p[r * TC + t] v_t[d0, ..) for RB rows (o row stride D).
template <int RB, int NV, typename C>
inline void pv_tile(const float* p, const C* const* v, int n, int d0, int D, float* o) {
  vf acc[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = load(o + r * D + d0 + j * W);
  for (int t = 0; t < n; ++t) {
    const C* vt = v[t] + d0;
    vf vv[NV];
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) vv[j] = load_float(vt + j * W);
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      const vf pr = splat(p[r * TC + t]);
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) acc[r][j] = fmadd(pr, vv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NV; ++j) store(o + r * D + d0 + j * W, acc[r][j]);
}

// Column chunks of 3 vectors for 4 rows (12 FMA chains), then 2 and 1 for the rest of D.
template <int RB, typename C>
void pv_rows(const float* p, const C* const* v, int n, int D, float* o, Ahead<C>* ahead) {
  constexpr int NV = 12 / RB;
  int d = 0;
  for (; d + NV * W <= D; d += NV * W) {
    if (ahead) ahead->fetch_v((d + NV * W) * TC / D);
    pv_tile<RB, NV>(p, v, n, d, D, o);
  }
  if (d + 2 * W <= D) {
    pv_tile<RB, 2>(p, v, n, d, D, o);
    d += 2 * W;
  }
  for (; d < D; d += W) pv_tile<RB, 1>(p, v, n, d, D, o);
  if (ahead) ahead->fetch_v(TC);
}

template <typename C>
void pv(const float* p, int R, const C* const* v, int n, int D, float* o, Ahead<C>& ahead) {
  int r = 0;
  Ahead<C>* fetch = &ahead;
  for (; r + 4 <= R; r += 4, fetch = nullptr) pv_rows<4>(p + r * TC, v, n, D, o + r * D, fetch);
  if (R - r >= 2) {
    pv_rows<2>(p + r * TC, v, n, D, o + r * D, fetch);
    r += 2;
    fetch = nullptr;
  }
  if (R - r == 1) pv_rows<1>(p + r * TC, v, n, D, o + r * D, fetch);
}

// ---- online softmax -----------------------------------------------------------------------

// Turns row r's logits s[0, n) for keys key0.. into probabilities relative to the running max
// m (updated), adds their sum to l and rescales the row's accumulator o.
inline void softmax_row(const PagedAttentionParams& p, const ItemShape& shape, int r,
                        int64_t key0, int n, float* s, float* o, float& m, float& l) {
  const int32_t qpos = shape.qpos0 + shape.query(r);
  const int64_t lo = p.sliding_window > 0 ? int64_t{qpos} - p.sliding_window + 1 : 0;
  const int a = static_cast<int>(std::max<int64_t>(0, lo - key0));
  const int b = static_cast<int>(std::min<int64_t>(n, int64_t{qpos} + 1 - key0));
  const int npad = (n + W - 1) / W * W;
  if (a >= b) {
    for (int t = 0; t < npad; ++t) s[t] = 0.f;
    return;
  }
  const float slope = p.alibi_slopes ? p.alibi_slopes[shape.head(r)] : 0.f;
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
  float *q, *o, *s, *m, *l;
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
    const int64_t token = shape.token0 + shape.query(r);
    const char* src =
        static_cast<const char*>(p.query) +
        (token * p.q_token_stride + shape.head(r) * p.q_head_stride) * elem_bytes(p.dtype);
    load_row(p.dtype, src, D, p.scale * k_mul, sc.q + r * D);
    std::memset(sc.o + r * D, 0, D * sizeof(float));
    sc.m[r] = kNegInf;
    sc.l[r] = 0.f;
  }
  const int32_t* table = p.block_tables + w.seq * p.block_table_stride;
  RowCursor k_cursor(p.k_strides, table, p.block_size, w.key_begin);
  RowCursor v_cursor(p.v_strides, table, p.block_size, w.key_begin);
  const int64_t ahead_begin = w.key_begin + int64_t{kPrefetchChunks} * TC;
  RowCursor k_ahead(p.k_strides, table, p.block_size, ahead_begin);
  RowCursor v_ahead(p.v_strides, table, p.block_size, ahead_begin);
  int64_t k_off[TC], v_off[TC], k_ahead_off[TC], v_ahead_off[TC];
  const C* k_rows[TC];  // the chunk's rows of one kv head
  const C* v_rows[TC];
  const int rph = shape.rows_per_head;
  for (int64_t key0 = w.key_begin; key0 < w.key_end; key0 += TC) {
    const int n = static_cast<int>(std::min<int64_t>(TC, w.key_end - key0));
    const int n_ahead = static_cast<int>(
        std::clamp<int64_t>(w.key_end - key0 - int64_t{kPrefetchChunks} * TC, 0, TC));
    k_cursor.take(n, k_off);
    v_cursor.take(n, v_off);
    k_ahead.take(n_ahead, k_ahead_off);
    v_ahead.take(n_ahead, v_ahead_off);
    for (int h = 0; h < w.kv_heads; ++h) {  // consecutive heads: each block read in one sweep
      const C* k = static_cast<const C*>(p.key_cache) + (w.kv_head + h) * p.k_strides.head;
      const C* v = static_cast<const C*>(p.value_cache) + (w.kv_head + h) * p.v_strides.head;
      for (int t = 0; t < n; ++t) {
        k_rows[t] = k + k_off[t];
        v_rows[t] = v + v_off[t];
      }
      Ahead<C> ahead{k, v, k_ahead_off, v_ahead_off, n_ahead, D * static_cast<int>(sizeof(C))};
      const int r0 = h * rph;
      qk(sc.q + r0 * D, rph, k_rows, n, D, sc.s + r0 * TC, ahead);
      for (int r = r0; r < r0 + rph; ++r)
        softmax_row(p, shape, r, key0, n, sc.s + r * TC, sc.o + r * D, sc.m[r], sc.l[r]);
      pv(sc.s + r0 * TC, rph, v_rows, n, D, sc.o + r0 * D, ahead);
    }
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
      write_output(p, shape.token0 + shape.query(r), shape.head(r), o, lse);
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

#include "cpu/attention_merge.h"

inline const AttentionKernels& kernels(const char* name) {
  static const AttentionKernels k{name, &attend, &merge_partials, &merge_attn_states};
  return k;
}
