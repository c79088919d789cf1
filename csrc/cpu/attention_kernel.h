// CPU paged attention, one work item at a time (cpu/attention_work.h), written once and compiled
// per instruction set. For each chunk of tc keys of the item's range (tc = chunk_keys(): 16 or
// 32) and each kv head of the item (a step):
//   K, V <- the step's row addresses, through the block table; elements are converted to
//           float in registers
//   S = Q K^T for the kv head's rows (its query heads x the item's query tokens)
//   S <- soft cap, ALiBi, causal / window mask;  m' = max(m, rowmax S)
//   P = exp(S - m'),  l = l e^(m - m') + rowsum P,  O = O e^(m - m') + P V     (online softmax)
// and at the end out = O / l, lse = m + log l. Q is pre-multiplied by scale * k_scale and O by
// v_scale, so dequantization costs nothing per element.
//
// No include guard: included once per instruction set inside namespace pagedkv::cpu::<isa>,
// after <algorithm>, <cmath>, <cstring>, <limits>, <type_traits> and cpu/attention_work.h.

#include "cpu/attention_simd.h"

constexpr int TS = kKeysPerChunk;  // the row stride of S: the most keys in a chunk
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
  const PagedKVView* cache;
  const int32_t* table;
  PagedKVSlot at;  // the next position: logical block (a table index) and offset

  RowCursor(const PagedKVView& c, const int32_t* t, int64_t pos)
      : cache(&c), table(t), at(c.locate(pos)) {}

  // offsets[i] = offset of the next n positions' rows; the cursor moves past them.
  void take(int n, int64_t* offsets) {
    for (int i = 0; i < n; ++i) {
      offsets[i] = cache->offset(table[at.block], at.offset);
      if (++at.offset == cache->block_size) {
        at.offset = 0;
        ++at.block;
      }
    }
  }
};

// ---- S = Q K^T ----------------------------------------------------------------------------
// S is stored per kv head as R rows of TS floats (kRows: s[r * TS + t]) or, in plain decode with
// whole groups of 4 query heads, as quads of 4 rows interleaved key by key (kQuads: quad q's
// s[q * 4 * TS + t * 4 + i] is row 4q + i): a tile's 12 dot products are then stored as two
// vectors, and the softmax of 4 rows runs on whole vectors.
enum class Layout { kRows, kQuads };

// K rows are read straight from the cache and converted in registers. A tile is RB query rows
// x TB keys with RB * TB = 8 accumulators (8 independent FMA chains, and every K element loaded
// once per RB rows); its 8 dot products are reduced together by one hsum8. Every loop over a
// tile's registers is unrolled, so that the accumulators live in registers.

// s[r * TS + t] = q_r . k_t for RB rows of q (row stride D) and TB keys; RB * TB is 8 or 12.
// With kQuads (RB = 4), s points at key t's 4 floats.
template <int RB, int TB, Layout L, typename C>
[[gnu::always_inline]] inline void qk_tile(const float* q, const C* const* k, int D, float* s) {
  constexpr int N = RB * TB;
  static_assert(N == 8 || N == 12);
  static_assert(L == Layout::kRows || RB == 4);
  // The accumulator of (row r, key t): key-major for quads, so the sums come out in S's order.
  constexpr auto at = [](int r, int t) { return L == Layout::kQuads ? t * RB + r : r * TB + t; };
  vf acc[N];
#pragma GCC unroll 12
  for (int i = 0; i < N; ++i) acc[i] = splat(0.f);
  for (int d = 0; d < D; d += W) {
    vf kv[TB];
#pragma GCC unroll 8
    for (int t = 0; t < TB; ++t) kv[t] = load_float(k[t] + d);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      vf qv = load(q + r * D + d);
      if constexpr (TB > 1) in_register(qv);  // one load for TB FMAs, not one each
#pragma GCC unroll 8
      for (int t = 0; t < TB; ++t) acc[at(r, t)] = fmadd(qv, kv[t], acc[at(r, t)]);
    }
  }
  if constexpr (L == Layout::kQuads) {
    const vf8 lo = hsum8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]);
    std::memcpy(s, &lo, sizeof lo);
    if constexpr (N == 12) {
      const vf4 hi = hsum4(acc[8], acc[9], acc[10], acc[11]);
      std::memcpy(s + 8, &hi, sizeof hi);
    }
    return;
  }
  float sums[N];
  const vf8 lo = hsum8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]);
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) sums[i] = lo[i];
  if constexpr (N == 12) {
    const vf4 hi = hsum4(acc[8], acc[9], acc[10], acc[11]);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) sums[8 + i] = hi[i];
  }
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < TB; ++t) s[r * TS + t] = sums[r * TB + t];
}

// Rows needed half a step later, prefetched a few per tile so that the requests spread over
// the work: during S = Q K^T the step's V rows, during O += P V the next step's K rows. (Half a
// step ahead, not more: the step's rows and the prefetched ones then fit in L1D together.)
template <typename C>
struct Ahead {
  const C* const* rows;
  int n;                 // rows to prefetch
  int row_bytes;
  int done = 0;

  // Prefetches rows until `until` of every `of` are done.
  void fetch(int until, int of) {
    for (const int stop = n * until / of; done < stop; ++done) prefetch(rows[done], row_bytes);
  }
};

// RB rows x tc keys: tiles of TB keys, then one of 8 / RB keys for the rest (tc is a multiple
// of 16; k holds tc + 8 / RB rows).
template <int RB, int TB, Layout L, typename C>
void qk_rows(const float* q, const C* const* k, int tc, int D, float* s, Ahead<C>* ahead) {
  constexpr int key_stride = L == Layout::kQuads ? 4 : 1;
  int t = 0;
  for (; t + TB <= tc; t += TB) {
    qk_tile<RB, TB, L>(q, k + t, D, s + t * key_stride);
    if (ahead) ahead->fetch(t + TB, tc);
  }
  if (t < tc) qk_tile<RB, 8 / RB, L>(q, k + t, D, s + t * key_stride);
}

// All R rows x tc keys. The rows of k past the chunk's keys are copies of valid rows; their
// logits are masked by softmax_row.
template <Layout L, typename C>
void qk(const float* q, int R, const C* const* k, int tc, int D, float* s, Ahead<C>& ahead) {
  int r = 0;
  Ahead<C>* fetch = &ahead;  // prefetch with the first rows
  for (; r + 4 <= R; r += 4, fetch = nullptr)
    qk_rows<4, 3, L>(q + r * D, k, tc, D, s + r * TS, fetch);
  if constexpr (L == Layout::kRows) {
    if (R - r >= 2) {
      qk_rows<2, 4, L>(q + r * D, k, tc, D, s + r * TS, fetch);
      r += 2;
      fetch = nullptr;
    }
    if (R - r == 1) qk_rows<1, 8, L>(q + r * D, k, tc, D, s + r * TS, fetch);
  }
  ahead.fetch(1, 1);
}

// ---- O += P V -----------------------------------------------------------------------------

// bfloat16 V rows are read 2W elements at a time (see load_pairs), so the columns of the O
// accumulators are in pair order: each group of 2W columns holds its W even columns, then its
// W odd ones; the last D % 2W columns keep their order. unpair() restores the order at the end.
template <typename C>
constexpr bool kPairs = std::is_same_v<C, bf16_t>;

// NV vectors of row x from column d0 on, in pair order for bfloat16 when NV is even.
template <int NV, typename C>
[[gnu::always_inline]] inline void load_columns(const C* x, vf* out) {
  if constexpr (kPairs<C> && NV % 2 == 0) {
#pragma GCC unroll 8
    for (int j = 0; j < NV; j += 2) load_pairs(x + j * W, out[j], out[j + 1]);
  } else {
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) out[j] = load_float(x + j * W);
  }
}

// Puts a row of D floats accumulated in pair order back in column order.
template <typename C>
void unpair(float* row, int D) {
  if constexpr (kPairs<C>) {
    float tmp[2 * W];
    for (int d = 0; d + 2 * W <= D; d += 2 * W) {
      for (int i = 0; i < W; ++i) {
        tmp[2 * i] = row[d + i];
        tmp[2 * i + 1] = row[d + W + i];
      }
      std::memcpy(row + d, tmp, sizeof tmp);
    }
  }
}

// o[r][d0, d0 + NV * W) += sum_t p[r * TS + t] v_t[d0, ..) for RB rows (o row stride D), with
// RB * NV <= 8 accumulators.
template <int RB, int NV, Layout L, typename C>
[[gnu::always_inline]] inline void pv_tile(const float* p, const C* const* v, int n, int d0,
                                           int D, float* o) {
  static_assert(RB * NV <= 8);
  vf acc[8];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[r * NV + j] = load(o + r * D + d0 + j * W);
  for (int t = 0; t < n; ++t) {
    vf vv[NV];
    load_columns<NV>(v[t] + d0, vv);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const vf pr = splat(L == Layout::kQuads ? p[t * 4 + r] : p[r * TS + t]);
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) acc[r * NV + j] = fmadd(pr, vv[j], acc[r * NV + j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) store(o + r * D + d0 + j * W, acc[r * NV + j]);
}

// RB rows over all D columns: NV = 8 / RB vectors at a time, then 2 (keeping the pair order
// of every whole group of 2W columns), then 1.
template <int RB, Layout L, typename C>
void pv_rows(const float* p, const C* const* v, int n, int D, float* o, Ahead<C>* ahead) {
  constexpr int NV = 8 / RB;
  int d = 0;
  for (; d + NV * W <= D; d += NV * W) {
    pv_tile<RB, NV, L>(p, v, n, d, D, o);
    if (ahead) ahead->fetch(d + NV * W, D);
  }
  if constexpr (NV > 2) {
    for (; d + 2 * W <= D; d += 2 * W) pv_tile<RB, 2, L>(p, v, n, d, D, o);
  }
  for (; d < D; d += W) pv_tile<RB, 1, L>(p, v, n, d, D, o);
}

template <Layout L, typename C>
void pv(const float* p, int R, const C* const* v, int n, int D, float* o, Ahead<C>& ahead) {
  int r = 0;
  Ahead<C>* fetch = &ahead;  // prefetch with the first rows
  for (; r + 4 <= R; r += 4, fetch = nullptr)
    pv_rows<4, L>(p + r * TS, v, n, D, o + r * D, fetch);
  if (R - r >= 2) {
    pv_rows<2, L>(p + r * TS, v, n, D, o + r * D, fetch);
    r += 2;
    fetch = nullptr;
  }
  if (R - r == 1) pv_rows<1, L>(p + r * TS, v, n, D, o + r * D, fetch);
  ahead.fetch(1, 1);
}

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
  sc.m = sc.s + R * TS;
  sc.l = sc.m + r16;
  return sc;
}

// ---- online softmax -----------------------------------------------------------------------

// The keys [a, b) of a chunk that a query sees (a >= b: none).
struct Visible {
  int a, b;
};

// For the query at position qpos and the n keys key0.. of a chunk.
inline Visible visible(const PagedAttentionParams& p, int32_t qpos, int64_t key0, int n) {
  const int64_t lo = p.sliding_window > 0 ? int64_t{qpos} - p.sliding_window + 1 : 0;
  return {static_cast<int>(std::clamp<int64_t>(lo - key0, 0, n)),
          static_cast<int>(std::clamp<int64_t>(int64_t{qpos} + 1 - key0, 0, n))};
}

// A row's running max m grows to m_new (> m): its sum l and accumulator o (D floats) are
// rescaled by e^(m - m_new) (0 while nothing is accumulated, m = -inf).
inline void raise_max(float m_new, float& m, float& l, float* o, int D) {
  const float correction = std::exp(m - m_new);
  l *= correction;
  for (int d = 0; d < D; d += W) store(o + d, load(o + d) * correction);
  m = m_new;
}

// Turns a row's tc logits s (of the keys from key position - query position = rel0 on) into
// probabilities relative to the running max m (updated): keys outside vis get 0. Adds their sum
// to l and rescales the row's accumulator o (D floats) when the max grows.
inline void softmax_row(const PagedAttentionParams& p, Visible vis, float slope, float rel0,
                        int tc, float* s, float* o, float& m, float& l) {
  if (vis.a >= vis.b) {
    for (int t = 0; t < tc; t += W) store(s + t, splat(0.f));
    return;
  }
  const float cap = p.soft_cap;
  vf mx = splat(kNegInf);
  if (cap == 0.f && slope == 0.f && vis.a == 0 && vis.b == tc) {  // the common case
    for (int t = 0; t < tc; t += W) mx = vmax(mx, load(s + t));
  } else {
    const float inv_cap = cap > 0.f ? 1.f / cap : 0.f;
    for (int t = 0; t < tc; t += W) {
      vf x = load(s + t);
      if (cap > 0.f) x = cap * vtanh(x * inv_cap);
      if (slope != 0.f) x = fmadd(splat(slope), __builtin_convertvector(iota() + t, vf) + rel0, x);
      const vi idx = iota() + t;
      x = (idx >= vis.a) & (idx < vis.b) ? x : splat(kNegInf);
      store(s + t, x);
      mx = vmax(mx, x);
    }
  }
  const float row_max = hmax(mx);
  if (row_max > m) raise_max(row_max, m, l, o, p.head_size);
  const vf shift = splat(m);
  vf sum = splat(0.f);
  for (int t = 0; t < tc; t += W) {
    const vf e = vexp_nonpositive(load(s + t) - shift);
    store(s + t, e);
    sum += e;
  }
  l += hsum(sum);
}

// softmax_row for a quad (4 rows, key-interleaved; see Layout) of tc logits each, in plain
// decode: no soft cap, no ALiBi, keys [0, n) visible.
inline void softmax_quad(int n, int tc, float* s, float* o, int D, float* m, float* l) {
  vf mx = splat(kNegInf);
  for (int j = 0; j < 4 * tc; j += W) {
    vf x = load(s + j);
    if (n < tc) {  // the last chunk: keys past n masked
      x = (iota() + j) >> 2 < n ? x : splat(kNegInf);
      store(s + j, x);
    }
    mx = vmax(mx, x);
  }
  vf shift;  // lane j: row j % 4's new max
  for (int i = 0; i < 4; ++i) {
    float row_max = mx[i];
    for (int j = i + 4; j < W; j += 4) row_max = std::max(row_max, mx[j]);
    if (row_max > m[i]) raise_max(row_max, m[i], l[i], o + i * D, D);
    for (int j = i; j < W; j += 4) shift[j] = m[i];
  }
  vf sum = splat(0.f);
  for (int j = 0; j < 4 * tc; j += W) {
    const vf e = vexp_nonpositive(load(s + j) - shift);
    store(s + j, e);
    sum += e;
  }
  for (int i = 0; i < 4; ++i) {
    float row_sum = 0.f;
    for (int j = i; j < W; j += 4) row_sum += sum[j];
    l[i] += row_sum;
  }
}

// Softmax of the rows of kv head h (of the item) for the chunk of n <= tc keys from key0.
template <Layout L>
inline void softmax_head(const PagedAttentionParams& p, const ItemShape& shape,
                         const WorkItem& w, int h, int64_t key0, int n, int tc,
                         const Scratch& sc) {
  const int D = p.head_size;
  int r = h * shape.rows_per_head;
  if constexpr (L == Layout::kQuads) {
    for (const int end = r + shape.rows_per_head; r < end; r += 4)
      softmax_quad(n, tc, sc.s + r * TS, sc.o + r * D, D, sc.m + r, sc.l + r);
    return;
  }
  for (int qi = 0; qi < w.q_count; ++qi) {
    const int32_t qpos = shape.qpos0 + qi;
    const Visible vis = visible(p, qpos, key0, n);
    const float rel0 = static_cast<float>(key0 - qpos);
    const int32_t head = shape.head0 + h * shape.group;
    for (int g = 0; g < shape.group; ++g, ++r) {
      const float slope = p.alibi_slopes ? p.alibi_slopes[head + g] : 0.f;
      softmax_row(p, vis, slope, rel0, tc, sc.s + r * TS, sc.o + r * D, sc.m[r], sc.l[r]);
    }
  }
}

// ---- one work item ------------------------------------------------------------------------

// Keys per chunk for K/V rows of row_bytes: 32, or 16 for rows over 256 bytes (float32 at head
// size 128), so that a step's rows stay near 16 KB: the step's rows and the next ones being
// prefetched share L1D. A multiple of 16 (softmax_row works in whole vectors).
constexpr int chunk_keys(int row_bytes) { return row_bytes > 256 ? TS / 2 : TS; }
static_assert(TS % 32 == 0);

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
  // The item is a sequence of steps (chunk, kv head). Row offsets are taken a chunk ahead, so
  // that a step knows the rows of the next one (to prefetch).
  const int tc = chunk_keys(D * static_cast<int>(sizeof(C)));
  const int32_t* table = p.block_tables + w.seq * p.block_table_stride;
  RowCursor k_cursor(p.key_cache, table, w.key_begin);
  RowCursor v_cursor(p.value_cache, table, w.key_begin);
  int64_t k_off[2][TS + 8], v_off[2][TS];  // of this chunk and the next one
  const C *k_rows[TS + 8], *v_rows[TS], *k_next[TS];
  const auto keys_from = [&](int64_t key0) {
    return static_cast<int>(std::clamp<int64_t>(w.key_end - key0, 0, tc));
  };
  const PagedKV<const C> k_cache = p.key_cache.as<const C>();
  const PagedKV<const C> v_cache = p.value_cache.as<const C>();
  const auto head_k = [&](int h) { return k_cache.head(w.kv_head + h).data; };
  const auto head_v = [&](int h) { return v_cache.head(w.kv_head + h).data; };
  const int rph = shape.rows_per_head;
  const int row_bytes = D * static_cast<int>(sizeof(C));
  // Plain decode in whole groups of 4 query heads: S in quads (see Layout). (A window that
  // reaches back past the item's first key changes nothing.)
  const bool no_window =
      p.sliding_window <= 0 || int64_t{shape.qpos0} - p.sliding_window + 1 <= w.key_begin;
  const bool quads = w.q_count == 1 && rph % 4 == 0 && p.soft_cap == 0.f && !p.alibi_slopes &&
                     no_window;
  int cur = 0;
  k_cursor.take(keys_from(w.key_begin), k_off[cur]);
  v_cursor.take(keys_from(w.key_begin), v_off[cur]);
  for (int64_t key0 = w.key_begin; key0 < w.key_end; key0 += tc, cur ^= 1) {
    const int n = keys_from(key0);
    const int n_next = keys_from(key0 + tc);
    k_cursor.take(n_next, k_off[cur ^ 1]);
    v_cursor.take(n_next, v_off[cur ^ 1]);
    // S for the keys past n (up to the last tile's end): computed from copies, then masked.
    for (int t = n; t < tc + 8; ++t) k_off[cur][t] = k_off[cur][n - 1];
    for (int h = 0; h < w.kv_heads; ++h) {  // consecutive heads: each block read in one sweep
      const C* k = head_k(h);
      const C* v = head_v(h);
      for (int t = 0; t < tc + 8; ++t) k_rows[t] = k + k_off[cur][t];
      for (int t = 0; t < n; ++t) v_rows[t] = v + v_off[cur][t];
      // The next step: the next head of this chunk, or the first one of the next chunk.
      const bool last_head = h + 1 == w.kv_heads;
      const int n2 = last_head ? n_next : n;
      const int64_t* k_off2 = k_off[last_head ? cur ^ 1 : cur];
      const C* k2 = head_k(last_head ? 0 : h + 1);
      for (int t = 0; t < n2; ++t) k_next[t] = k2 + k_off2[t];
      Ahead<C> v_now{v_rows, n, row_bytes}, k_then{k_next, n2, row_bytes};
      const int r0 = h * rph;
      if (quads) {
        qk<Layout::kQuads>(sc.q + r0 * D, rph, k_rows, tc, D, sc.s + r0 * TS, v_now);
        softmax_head<Layout::kQuads>(p, shape, w, h, key0, n, tc, sc);
        pv<Layout::kQuads>(sc.s + r0 * TS, rph, v_rows, n, D, sc.o + r0 * D, k_then);
      } else {
        qk<Layout::kRows>(sc.q + r0 * D, rph, k_rows, tc, D, sc.s + r0 * TS, v_now);
        softmax_head<Layout::kRows>(p, shape, w, h, key0, n, tc, sc);
        pv<Layout::kRows>(sc.s + r0 * TS, rph, v_rows, n, D, sc.o + r0 * D, k_then);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const bool empty = sc.l[r] == 0.f;
    const float mul = empty ? 0.f : v_mul / sc.l[r];
    const float lse = empty ? kNegInf : sc.m[r] + std::log(sc.l[r]);
    float* o = sc.o + r * D;
    unpair<C>(o, D);
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
