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
  void fetch_l2(int until, int of) {
    for (const int stop = n * until / of; done < stop; ++done) prefetch_l2(rows[done], row_bytes);
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

// ---- prefill: small GEMMs -----------------------------------------------------------------
// A varlen item of many rows (one kv head: its query heads x up to kPrefillRows / group query
// tokens) is computed as two small GEMMs per tile of N keys (N = prefill_keys: 32, or 16 for
// rows over 512 bytes), with the online softmax between them:
//   K, V rows    float caches' rows used where they are; other dtypes converted once per tile
//                into contiguous float rows (kt, vt)
//   S^T = K Q^T  in register tiles of kSK keys x kSR vectors of rows: each K element is
//                broadcast, Q^T is loaded (packed once per item: per block of kRowBlock rows,
//                [D][kRowBlock], contiguous), no horizontal sums
//   softmax      down the keys, on whole vectors of rows: max, exp and sum are vertical
//   O += P V     in register tiles of kPR rows x kPD vectors of columns, each p broadcast,
//                O rescaled by the row's correction as it is loaded into registers
// Rows are padded to Mp, a multiple of kSR * W, with zero queries (computed, never written).
// With AVX512_BF16 (kDotPairs), bfloat16 caches take the same GEMMs on bfloat16 pairs
// (dot_pairs: vdpbf16ps): Q^T as pairs of head dimensions ([D / 2][kRowBlock] per block), K
// rows as they are, P rounded to bfloat16 as pairs of keys ([N / 2][Mp]) and V as pairs of
// rows ([N / 2][D]).

#if PKV_ISA >= 2
constexpr int kSK = 8, kSR = 3, kPR = 12, kPD = 2;  // 32 registers: 24 accumulators each
#else
constexpr int kSK = 4, kSR = 3, kPR = 6, kPD = 2;  // 16 registers: 12 accumulators each
#endif
constexpr int kRowBlock = kSR * W;  // Mp is a multiple: 24 (8 lanes) or 48 (16 lanes)
static_assert(kRowBlock % kPR == 0 && kPrefillRowAlign % kRowBlock == 0);
// The bf16 pair path: AVX512_BF16's; PKV_DOT_PAIRS=1 forces it on any set, with dot_pairs as
// two FMAs (a check of its arithmetic where vdpbf16ps is missing, not a build of the library).
#ifndef PKV_DOT_PAIRS
#define PKV_DOT_PAIRS (PKV_ISA == 3)
#endif
constexpr bool kDotPairs = PKV_DOT_PAIRS;

// Keys per tile: a tile's float K (or V) rows stay at 16 KB.
constexpr int prefill_keys(int D, int elem) {
  return D * elem > 512 ? kPrefillKeys / 2 : kPrefillKeys;
}
static_assert(kPrefillKeys % (4 * kSK) == 0);

struct PrefillScratch {
  float *qt, *o, *st, *kt, *vt, *m, *l, *corr, *slope;
  int32_t *qpos, *lo;
};

// Layout of scratch_floats(rows, D) floats for an item of Mp padded rows (see attention_work.h).
inline PrefillScratch carve_prefill(float* base, int Mp, int N, int D) {
  PrefillScratch s;
  s.qt = base;            // [Mp / kRowBlock][D][kRowBlock] floats, or [..][D / 2][..] pairs
  s.o = s.qt + D * Mp;    // [Mp][D]
  s.st = s.o + Mp * D;    // [N][Mp]: S^T, then P^T; P^T as pairs after it ([N / 2][Mp])
  s.kt = s.st + 2 * N * Mp;  // [N][D] floats, or bf16 rows
  s.vt = s.kt + N * D;       // [N][D] floats, or [N / 2][D] pairs
  s.m = s.vt + N * D;
  s.l = s.m + Mp;
  s.corr = s.l + Mp;
  s.slope = s.corr + Mp;
  s.qpos = reinterpret_cast<int32_t*>(s.slope + Mp);
  s.lo = s.qpos + Mp;
  return s;
}

inline uint32_t load_u32(const void* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  return x;
}

// The two arithmetics of the GEMMs: float numbers and FMAs, or bfloat16 pairs (kDotPairs) and
// dot_pairs. Scalar: an element of Q^T, P^T and V as the GEMMs read them (a float, or a pair of
// bfloat16 numbers in 32 bits); KRow: a K row (floats, or bfloat16 numbers read a pair at a
// time); steps: the GEMM's inner dimension in Scalars (D, or D / 2).
struct FloatMath {
  using Scalar = float;
  using Vec = vf;
  using KRow = const float*;
  static vf broadcast(float x) { return splat(x); }
  static vf key(KRow row, int i) { return splat(row[i]); }
  static vf lanes(const float* x) { return load(x); }
  static vf madd(vf acc, vf a, vf b) { return fmadd(a, b, acc); }
};
struct PairMath {
  using Scalar = uint32_t;
  using Vec = vu;
  using KRow = const uint16_t*;
  static vu broadcast(uint32_t x) { return splat_u32(x); }
  static vu key(KRow row, int i) { return splat_u32(load_u32(row + 2 * i)); }
  static vu lanes(const uint32_t* x) { return load_raw<vu>(x); }
  static vf madd(vf acc, vu a, vu b) { return dot_pairs(acc, a, b); }
};

// st[t * Mp + r] = k_t . q_r for KB keys (rows k[t]) and RV * W rows (a block of Q^T,
// [steps][kRowBlock]).
template <int KB, int RV, typename Math>
[[gnu::always_inline]] inline void st_block(const typename Math::Scalar* qt, int Mp,
                                            const typename Math::KRow* k, int steps, float* st) {
  typename Math::KRow kr[KB];
#pragma GCC unroll 8
  for (int t = 0; t < KB; ++t) kr[t] = k[t];
  vf acc[KB * RV];
#pragma GCC unroll 24
  for (int i = 0; i < KB * RV; ++i) acc[i] = splat(0.f);
  for (int d = 0; d < steps; ++d) {
    typename Math::Vec q[RV];
#pragma GCC unroll 4
    for (int j = 0; j < RV; ++j) {
      q[j] = Math::lanes(qt + d * kRowBlock + j * W);
      in_register(q[j]);
    }
#pragma GCC unroll 8
    for (int t = 0; t < KB; ++t) {
      const typename Math::Vec kv = Math::key(kr[t], d);
#pragma GCC unroll 4
      for (int j = 0; j < RV; ++j) acc[t * RV + j] = Math::madd(acc[t * RV + j], kv, q[j]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < KB; ++t)
#pragma GCC unroll 4
    for (int j = 0; j < RV; ++j) store(st + t * Mp + j * W, acc[t * RV + j]);
}

// o[r][0, DV * W) = o[r][..] * corr[r] + sum_t p[t * Mp + r] v_t[d0, d0 + DV * W) for RB rows
// (o row stride D) over n rows of P^T and V (rows v[t]).
template <int RB, int DV, typename Math>
[[gnu::always_inline]] inline void pv_block(const typename Math::Scalar* pt, int Mp,
                                            const float* corr,
                                            const typename Math::Scalar* const* v, int d0, int n,
                                            int D, float* o) {
  vf acc[RB * DV];
#pragma GCC unroll 12
  for (int r = 0; r < RB; ++r) {
    const vf c = splat(corr[r]);
#pragma GCC unroll 4
    for (int j = 0; j < DV; ++j) acc[r * DV + j] = load(o + r * D + j * W) * c;
  }
  for (int t = 0; t < n; ++t) {
    typename Math::Vec vv[DV];
    const typename Math::Scalar* row = v[t] + d0;
#pragma GCC unroll 4
    for (int j = 0; j < DV; ++j) {
      vv[j] = Math::lanes(row + j * W);
      in_register(vv[j]);
    }
#pragma GCC unroll 12
    for (int r = 0; r < RB; ++r) {
      const typename Math::Vec pr = Math::broadcast(pt[t * Mp + r]);
#pragma GCC unroll 4
      for (int j = 0; j < DV; ++j) acc[r * DV + j] = Math::madd(acc[r * DV + j], pr, vv[j]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < DV; ++j) store(o + r * D + j * W, acc[r * DV + j]);
}

// The online softmax of a tile for W rows from r0, down its n keys from key position key0:
// S^T (times mul, then soft cap, ALiBi and the mask where they apply) becomes P^T in place;
// the rows' max, sum and the correction of their accumulators (corr) are updated.
inline void softmax_rows(const PagedAttentionParams& p, const PrefillScratch& sc, int Mp,
                         int r0, int64_t key0, int n, bool masked, float mul) {
  float* st = sc.st + r0;
  const vf m_old = load(sc.m + r0);
  vf mx = m_old;
  const float cap = p.soft_cap;
  const bool alibi = p.alibi_slopes != nullptr;
  if (!masked && cap == 0.f && !alibi && mul == 1.f) {
    for (int t = 0; t < n; ++t) mx = vmax(mx, load(st + t * Mp));
  } else {
    const float inv_cap = cap > 0.f ? 1.f / cap : 0.f;
    const vf slope = load(sc.slope + r0);
    const vi qpos = load_raw<vi>(sc.qpos + r0), lo = load_raw<vi>(sc.lo + r0);
    for (int t = 0; t < n; ++t) {
      vf x = load(st + t * Mp) * mul;
      if (cap > 0.f) x = cap * vtanh(x * inv_cap);
      const vi key = vi{} + static_cast<int32_t>(key0 + t);
      if (alibi) x = fmadd(slope, __builtin_convertvector(key - qpos, vf), x);
      if (masked) x = (key >= lo) & (key <= qpos) ? x : splat(kNegInf);
      store(st + t * Mp, x);
      mx = vmax(mx, x);
    }
  }
  // Rows that see nothing yet keep m = -inf: their shift is 0, so that exp gives 0, not NaN.
  const vf shift = mx == kNegInf ? splat(0.f) : mx;
  const vf corr = vexp_nonpositive(m_old - shift);
  vf sum = splat(0.f);
  for (int t = 0; t < n; ++t) {
    const vf e = vexp_nonpositive(load(st + t * Mp) - shift);
    store(st + t * Mp, e);
    sum += e;
  }
  store(sc.corr + r0, corr);
  store(sc.l + r0, fmadd(load(sc.l + r0), corr, sum));
  store(sc.m + r0, mx);
}

template <typename C>
void attend_prefill(const PagedAttentionParams& p, const WorkItem& w, float* scratch,
                    const Partials& partials) {
  constexpr bool kPairsHere = kDotPairs && std::is_same_v<C, bf16_t>;
  using Math = std::conditional_t<kPairsHere, PairMath, FloatMath>;
  const ItemShape shape = item_shape(p, w);
  const int D = p.head_size, M = shape.rows;
  const int Mp = (M + kRowBlock - 1) / kRowBlock * kRowBlock;
  const int N = prefill_keys(D, sizeof(C));
  const PrefillScratch sc = carve_prefill(scratch, Mp, N, D);
  const float k_mul = cache_factor<C>() * (p.k_scale ? *p.k_scale : 1.f);
  const float v_mul = cache_factor<C>() * (p.v_scale ? *p.v_scale : 1.f);
  // With pairs, Q stays bfloat16 (the query's own numbers) and S is scaled in the softmax.
  const float s_mul = kPairsHere ? p.scale * k_mul : 1.f;
  for (int r = 0; r < Mp; ++r) {
    // Row r's place in Q^T: block r / kRowBlock, column r % kRowBlock.
    float* const qt_r = sc.qt + r / kRowBlock * kRowBlock * D + r % kRowBlock;
    uint32_t* const qp_r = reinterpret_cast<uint32_t*>(qt_r);
    if (r >= M) {
      for (int d = 0; d < D; ++d) qt_r[d * kRowBlock] = 0.f;  // pairs: 0 too, D / 2 of them
      sc.qpos[r] = std::numeric_limits<int32_t>::max() / 2;   // padding rows see every key
      sc.lo[r] = std::numeric_limits<int32_t>::min() / 2;
      sc.slope[r] = 0.f;
    } else {
      const int64_t token = shape.token0 + shape.query(r);
      const int32_t head = shape.head(r);
      const char* src = static_cast<const char*>(p.query) +
                        (token * p.q_token_stride + head * p.q_head_stride) * elem_bytes(p.dtype);
      if constexpr (kPairsHere) {
        const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);  // dtype is bfloat16
        for (int d = 0; d < D; d += 2)
          qp_r[d / 2 * kRowBlock] = bits[d] | uint32_t{bits[d + 1]} << 16;
      } else {
        float* row = sc.o + r * D;  // a row of o as room to convert into
        load_row(p.dtype, src, D, p.scale * k_mul, row);
        for (int d = 0; d < D; ++d) qt_r[d * kRowBlock] = row[d];
      }
      sc.qpos[r] = shape.qpos0 + shape.query(r);
      sc.lo[r] = p.sliding_window > 0 ? sc.qpos[r] - p.sliding_window + 1
                                      : std::numeric_limits<int32_t>::min() / 2;
      sc.slope[r] = p.alibi_slopes ? p.alibi_slopes[head] : 0.f;
    }
    sc.m[r] = kNegInf;
    sc.l[r] = 0.f;
  }
  std::memset(sc.o, 0, sizeof(float) * Mp * D);
  const int32_t qpos_first = shape.qpos0, qpos_last = shape.qpos0 + w.q_count - 1;
  const int64_t lo_last = p.sliding_window > 0 ? int64_t{qpos_last} - p.sliding_window + 1 : 0;

  const int32_t* table = p.block_tables + w.seq * p.block_table_stride;
  RowCursor k_cursor(p.key_cache, table, w.key_begin);
  RowCursor v_cursor(p.value_cache, table, w.key_begin);
  int64_t k_off[2][kPrefillKeys], v_off[2][kPrefillKeys];  // of this tile and the next one
  const auto keys_from = [&](int64_t key0) {
    return static_cast<int>(std::clamp<int64_t>(w.key_end - key0, 0, N));
  };
  const C* k_head = p.key_cache.as<const C>().head(w.kv_head).data;
  const C* v_head = p.value_cache.as<const C>().head(w.kv_head).data;
  const int row_bytes = D * static_cast<int>(sizeof(C));
  uint16_t* const kt16 = reinterpret_cast<uint16_t*>(sc.kt);
  uint32_t* const vp = reinterpret_cast<uint32_t*>(sc.vt);
  uint32_t* const pp = reinterpret_cast<uint32_t*>(sc.st + N * Mp);
  // The GEMMs' operands: Q^T and P^T (S^T in place, or pp), and the tile's K rows and V rows:
  // floats, the cache's own (float caches) or kt's and vt's; or kt16's rows and vp's pairs of
  // rows (v_rows[i]: pair i).
  const typename Math::Scalar *qt, *pt;
  typename Math::KRow k_rows[kPrefillKeys];
  const typename Math::Scalar* v_rows[kPrefillKeys];
  if constexpr (kPairsHere) {
    qt = reinterpret_cast<const uint32_t*>(sc.qt);
    pt = pp;
    for (int t = 0; t < N; ++t) k_rows[t] = kt16 + t * D;
    for (int i = 0; 2 * i < N; ++i) v_rows[i] = vp + i * D;
  } else {
    qt = sc.qt;
    pt = sc.st;
    for (int t = 0; t < N; ++t) {
      k_rows[t] = sc.kt + t * D;
      v_rows[t] = sc.vt + t * D;
    }
  }
  const int steps = kPairsHere ? D / 2 : D;  // of S^T's inner dimension, in Scalars
  int cur = 0;
  k_cursor.take(keys_from(w.key_begin), k_off[cur]);
  v_cursor.take(keys_from(w.key_begin), v_off[cur]);
  for (int64_t key0 = w.key_begin; key0 < w.key_end; key0 += N, cur ^= 1) {
    const int n = keys_from(key0);
    const int n_next = keys_from(key0 + N);
    k_cursor.take(n_next, k_off[cur ^ 1]);
    v_cursor.take(n_next, v_off[cur ^ 1]);
    // The tile's K and V rows, converted once; the next tile's rows asked for.
    if constexpr (kPairsHere) {
      for (int t = 0; t < n; ++t)
        std::memcpy(kt16 + t * D, k_head + k_off[cur][t], sizeof(uint16_t) * D);
      for (int t = 0; t < n; t += 2) {
        const uint16_t* a = reinterpret_cast<const uint16_t*>(v_head + v_off[cur][t]);
        const uint16_t* b =
            t + 1 < n ? reinterpret_cast<const uint16_t*>(v_head + v_off[cur][t + 1]) : nullptr;
        uint32_t* dst = vp + t / 2 * D;
        for (int d = 0; d < D; d += W) {
          const vu lo = __builtin_convertvector(load_raw<vh>(a + d), vu);
          const vu hi = b ? __builtin_convertvector(load_raw<vh>(b + d), vu) << 16 : vu{};
          const vu pair = lo | hi;
          std::memcpy(dst + d, &pair, sizeof pair);
        }
      }
    } else if constexpr (std::is_same_v<C, float>) {  // float rows are used where they are
      for (int t = 0; t < n; ++t) {
        k_rows[t] = k_head + k_off[cur][t];
        v_rows[t] = v_head + v_off[cur][t];
      }
    } else {
      for (int t = 0; t < n; ++t) {
        const C* krow = k_head + k_off[cur][t];
        const C* vrow = v_head + v_off[cur][t];
        for (int d = 0; d < D; d += W) {
          store(sc.kt + t * D + d, load_float(krow + d));
          store(sc.vt + t * D + d, load_float(vrow + d));
        }
      }
    }
    for (int t = n; t < N; ++t) k_rows[t] = k_rows[n - 1];  // computed, never read
    // The next tile's rows into L2 and this tile's float V rows into L1 while S^T is computed,
    // the next tile's float K rows into L1 while O += P V is: a few rows per register block,
    // so that the requests spread over the work.
    const C *next_k[kPrefillKeys], *next_v[kPrefillKeys];
    for (int t = 0; t < n_next; ++t) {
      next_k[t] = k_head + k_off[cur ^ 1][t];
      next_v[t] = v_head + v_off[cur ^ 1][t];
    }
    Ahead<C> k_l2{next_k, n_next, row_bytes}, v_l2{next_v, n_next, row_bytes};
    Ahead<typename Math::Scalar> v_l1{v_rows, std::is_same_v<C, float> ? n : 0, row_bytes};
    const int st_blocks = Mp / kRowBlock * ((n + kSK - 1) / kSK);
    int st_done = 0;
    // S^T = K Q^T: keys past n (to a whole register tile) are computed and never read.
    for (int r0 = 0; r0 < Mp; r0 += kRowBlock) {
      for (int t0 = 0; t0 < n; t0 += kSK) {
        st_block<kSK, kSR, Math>(qt + r0 * D, Mp, k_rows + t0, steps, sc.st + t0 * Mp + r0);
        ++st_done;
        k_l2.fetch_l2(st_done, st_blocks);
        v_l2.fetch_l2(st_done, st_blocks);
        v_l1.fetch(st_done, st_blocks);
      }
    }
    // Some row misses some key of the tile: causal (a key past the first query) or window.
    const bool masked = key0 + n - 1 > qpos_first || (p.sliding_window > 0 && key0 < lo_last);
    for (int r0 = 0; r0 < Mp; r0 += W) softmax_rows(p, sc, Mp, r0, key0, n, masked, s_mul);
    Ahead<C> k_l1{next_k, std::is_same_v<C, float> ? n_next : 0, row_bytes};
    if constexpr (kPairsHere) {  // P^T rounded to bfloat16, as pairs of keys (an odd last: 0)
      for (int tp = 0; 2 * tp < n; ++tp) {
        const float* a = sc.st + 2 * tp * Mp;
        for (int r0 = 0; r0 < Mp; r0 += W) {
          const vf hi = 2 * tp + 1 < n ? load(a + Mp + r0) : splat(0.f);
          const vu pair = round_pairs(load(a + r0), hi);
          std::memcpy(pp + tp * Mp + r0, &pair, sizeof pair);
        }
      }
    }
    // O += P V over the tile's n keys, or its (n + 1) / 2 pairs of keys.
    const int pv_n = kPairsHere ? (n + 1) / 2 : n;
    for (int r0 = 0; r0 < Mp; r0 += kPR) {
      int d = 0;
      for (; d + kPD * W <= D; d += kPD * W)
        pv_block<kPR, kPD, Math>(pt + r0, Mp, sc.corr + r0, v_rows, d, pv_n, D, sc.o + r0 * D + d);
      for (; d < D; d += W)
        pv_block<kPR, 1, Math>(pt + r0, Mp, sc.corr + r0, v_rows, d, pv_n, D, sc.o + r0 * D + d);
      k_l1.fetch(r0 + kPR, Mp);
    }
  }
  for (int r = 0; r < M; ++r) {
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

// ---- the peak probe -------------------------------------------------------------------------

// iters rounds of 12 independent chains of float FMAs (kPeakFma) or bfloat16 pair dot products
// (kPeakBf16Dot, kDotPairs only); returns the floating-point operations done (0: not here).
inline int64_t peak_loop(int kind, int64_t iters) {
  if (kind == kPeakBf16Dot && !kDotPairs) return 0;
  vf acc[12];
#pragma GCC unroll 12
  for (int i = 0; i < 12; ++i) acc[i] = splat(0.01f * static_cast<float>(i));
  if constexpr (kDotPairs) {
    if (kind == kPeakBf16Dot) {
      const vu a = splat_u32(0x3F803F80u), b = splat_u32(0x3A833A83u);  // pairs of 1, ~0.001
      for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; ++i) acc[i] = dot_pairs(acc[i], a, b);
      }
    }
  }
  if (kind == kPeakFma) {
    const vf a = splat(0.999f), b = splat(1e-3f);
    for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) acc[i] = fmadd(acc[i], a, b);
    }
  }
  vf sum = splat(0.f);
  for (int i = 0; i < 12; ++i) sum += acc[i];
  volatile float sink = hsum(sum);
  (void)sink;
  return iters * 12 * W * (kind == kPeakBf16Dot ? 4 : 2);
}

// ---- dispatch -------------------------------------------------------------------------------

// Varlen items of at least half a register tile of rows take the prefill path.
template <typename C>
void attend_item(const PagedAttentionParams& p, const WorkItem& w, float* scratch,
                 const Partials& partials) {
  const int32_t rows = p.num_heads / p.num_kv_heads * w.q_count * w.kv_heads;
  if (w.kv_heads == 1 && w.q_count > 1 && 2 * rows >= kRowBlock)
    return attend_prefill<C>(p, w, scratch, partials);
  return attend_typed<C>(p, w, scratch, partials);
}

inline void attend(const PagedAttentionParams& p, const WorkItem& w, float* scratch,
                   const Partials& partials) {
  switch (p.cache_dtype) {
    case DType::kFloat16: return attend_item<f16_t>(p, w, scratch, partials);
    case DType::kBFloat16: return attend_item<bf16_t>(p, w, scratch, partials);
    case DType::kFp8E4M3: return attend_item<e4m3_t>(p, w, scratch, partials);
    case DType::kFp8E5M2: return attend_item<e5m2_t>(p, w, scratch, partials);
    default: return attend_item<float>(p, w, scratch, partials);
  }
}

#include "cpu/attention_merge.h"
