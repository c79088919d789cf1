// The CPU prefill kernel's two bfloat16 paths against a double-precision reference, for every
// instruction set the processor has, torch-free (ctest: cpu_bf16_pairs_<set>).
//
// With AVX512_BF16, bfloat16 caches take the prefill GEMMs on bfloat16 pairs (vdpbf16ps: Q^T and
// K as pairs of head dimensions, P rounded to bfloat16 and V as pairs of keys; see
// docs/cpu_attention.md). Few machines have the instruction, so the pair path is also compiled
// here into the base, AVX2 and AVX-512F kernels with PKV_DOT_PAIRS=1, where dot_pairs is two
// FMAs: its packing, its rounding of P and its odd last key then run on any x86-64 processor.
// Each set is compiled twice, float path and pair path (bf16_pairs_set.cpp, one unit per set),
// and both are checked on the same batch:
// odd sequence and query lengths, shuffled block tables, block sizes 7, 16 and 32, head sizes
// 64, 72, 128 and 256, GQA 1, 4 and 8, sliding window, soft cap and ALiBi, and an MLA case (one
// latent of 576 per token: K the whole row, V its first 512 elements, read from the same
// cache); outputs poisoned with NaN before the run. Cases with int8 and int4 caches (rows of
// bf16 numbers quantized with a scale per (token, head), as reshape_and_cache writes them) run
// the float path against the reference over their dequantized values, decode and prefill items,
// and the integer and pair paths (PKV_INT_DOTS=1: decode's S and P V on int16 queries and
// probabilities, vpdpwssd in avx512bf16, vpmaddwd in avx2, portable vectors elsewhere; with
// PKV_DOT_PAIRS=1, prefill on bfloat16 pairs of the rows' integers, the scales on S and P)
// under the pair path's bound, plus what decode's roundings of q and p (a relative 2^-16 of a
// row's largest element) may add. avx512bf16's and avx2's int4 decode round the query rows of
// whole groups of 4 to int8 instead (qk_lanes_i4 / qk_tile_i4_q8, head sizes a multiple of
// 128): each (token, head) on the integer path meets the bounds against the reference over the
// query as given or over the query so rounded (emulated exactly: ref8), whole.
//
// Bound per output element (row r, column d), with p_t the reference probabilities and
// B = sum_t p_t |v_t[d]|: the float path is within 2^-8 |ref| (rounding the output to bfloat16)
// + 1e-4 B; the pair path rounds each p_t to bfloat16 (relative error 2^-9) before P V, so it is
// allowed 2^-8 B more. lse (float32, either path) is within 1e-4 (1 + |ref|).
//
//   cpu_bf16_pairs SET    (SET: base, avx2, avx512 or avx512bf16; exit 77: the processor lacks it)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "bf16_pairs_set.h"

using namespace pagedkv;

namespace {

struct Set {
  const char* name;
  bool (*has)();
  cpu::PairSet (*kernels)();
};

const Set kSets[] = {
    {"base", [] { return true; }, &cpu::pairs_set_base},
    {"avx2",
     [] {
       return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
              __builtin_cpu_supports("f16c");
     },
     &cpu::pairs_set_avx2},
#ifndef PKV_PAIRS_NO_AVX512
    {"avx512",
     [] { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
                 __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"); },
     &cpu::pairs_set_avx512},
    {"avx512bf16",
     [] {
       return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
              __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni") &&
              __builtin_cpu_supports("avx2") &&
              __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
     },
     &cpu::pairs_set_avx512bf16},
#endif
};

uint16_t to_bf16(float f) {  // round to nearest even (finite f)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t u = uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Case {
  const char* name;
  int heads, kv_heads, head_size, block_size;
  std::vector<int> seq_lens, q_lens;  // q_lens[s] <= seq_lens[s]
  int window = -1;
  float soft_cap = 0.f;
  bool alibi = false;
  int head_size_v = 0;  // of V and out: 0 = head_size
  bool latent = false;  // MLA: V is the first head_size_v elements of the K row (one cache)
  DType format = DType::kBFloat16;  // or kInt8 / kInt4: rows quantized with a scale each

  int dv() const { return head_size_v ? head_size_v : head_size; }
};

// A batch of bfloat16 queries and caches, and the reference of every (token, head).
struct Batch {
  const Case& c;
  int num_tokens = 0, max_blocks = 0, num_blocks = 0;
  std::vector<int> query_start;
  std::vector<uint16_t> query, key_cache, value_cache;
  std::vector<uint8_t> key_q, value_q;      // int8 / int4 rows (format), from the bf16 ones
  std::vector<float> key_scales, value_scales;  // [block][kv head][token]
  std::vector<int32_t> table;
  std::vector<float> slopes;
  std::vector<double> ref, bound, ref_lse;  // [token][head][d], [token][head]
  std::vector<double> int_bound;  // int8 / int4: what the integer path's roundings may add
  // int4: ref and ref_lse over the query as the int4 decode rounds it to int8 (rounded)
  std::vector<double> ref8, ref8_lse;

  Batch(const Case& cs, std::mt19937& rng) : c(cs) {
    const int S = static_cast<int>(c.seq_lens.size()), D = c.head_size;
    query_start.push_back(0);
    for (int s = 0; s < S; ++s) {
      query_start.push_back(query_start.back() + c.q_lens[s]);
      max_blocks = std::max(max_blocks, (c.seq_lens[s] + c.block_size - 1) / c.block_size);
    }
    num_tokens = query_start.back();
    num_blocks = S * max_blocks + 3;  // a few blocks no sequence uses
    std::normal_distribution<float> normal;
    const auto fill = [&](std::vector<uint16_t>& v, size_t n, float sigma) {
      v.resize(n);
      for (auto& x : v) x = to_bf16(sigma * normal(rng));
    };
    fill(query, size_t(num_tokens) * c.heads * D, 2.f);  // peaked enough to tell errors apart
    fill(key_cache, size_t(num_blocks) * c.kv_heads * c.block_size * D, 1.f);
    fill(value_cache, key_cache.size(), 1.f);
    std::vector<int32_t> ids(num_blocks);
    for (int i = 0; i < num_blocks; ++i) ids[i] = i;
    std::shuffle(ids.begin(), ids.end(), rng);
    table.assign(ids.begin(), ids.begin() + S * max_blocks);
    if (c.alibi)
      for (int h = 0; h < c.heads; ++h) slopes.push_back(std::exp2(-8.f * (h + 1) / c.heads));
    if (c.format != DType::kBFloat16) {
      quantize(key_cache, key_q, key_scales);
      quantize(value_cache, value_q, value_scales);
    }
    reference();
  }

  bool int4() const { return c.format == DType::kInt4; }

  // Each row of a bf16 cache quantized as reshape_and_cache writes int8 / int4: scale =
  // absmax / qmax, round(x / scale) half to even; int4 two a byte, element 2i low.
  void quantize(const std::vector<uint16_t>& cache, std::vector<uint8_t>& q,
                std::vector<float>& scales) const {
    const int D = c.head_size;
    const float qmax = quant_max(c.format);
    const size_t rows = cache.size() / D;
    q.assign(int4() ? rows * D / 2 : rows * D, 0);
    scales.assign(rows, 0.f);
    for (size_t r = 0; r < rows; ++r) {
      float amax = 0.f;
      for (int d = 0; d < D; ++d) amax = std::max(amax, std::fabs(from_bf16(cache[r * D + d])));
      const float scale = amax / qmax;
      scales[r] = scale;
      for (int d = 0; d < D; ++d) {
        const int v = scale == 0.f ? 0 : static_cast<int>(std::nearbyint(
            std::clamp(from_bf16(cache[r * D + d]) / scale, -qmax, qmax)));
        if (int4())
          q[r * D / 2 + d / 2] |= static_cast<uint8_t>((v & 0xF) << (d % 2 ? 4 : 0));
        else
          q[r * D + d] = static_cast<uint8_t>(static_cast<int8_t>(v));
      }
    }
  }

  float k(int s, int kv, int pos, int d) const { return element(key_cache, s, kv, pos, d); }
  float v(int s, int kv, int pos, int d) const {
    return element(c.latent ? key_cache : value_cache, s, kv, pos, d);
  }
  // The cache row (and scale) of sequence s's key at pos, kv head kv.
  int64_t row_of(int s, int kv, int pos) const {
    const int64_t block = table[s * max_blocks + pos / c.block_size];
    return (block * c.kv_heads + kv) * c.block_size + pos % c.block_size;
  }
  float element(const std::vector<uint16_t>& cache, int s, int kv, int pos, int d) const {
    const int64_t row = row_of(s, kv, pos);
    if (c.format == DType::kBFloat16) return from_bf16(cache[row * c.head_size + d]);
    const bool keys = &cache == &key_cache;
    const std::vector<uint8_t>& q = keys ? key_q : value_q;
    const float scale = (keys ? key_scales : value_scales)[row];
    int v;
    if (int4()) {
      const int byte = q[row * c.head_size / 2 + d / 2];
      v = (d % 2 ? byte >> 4 : byte) & 0xF;
      v -= (v & 8) << 1;
    } else {
      v = static_cast<int8_t>(q[row * c.head_size + d]);
    }
    return v * scale;
  }

  // Sequence s's keys and values of kv head kv as doubles, row after row (the reference reads
  // each element many times: once here through the block table and the format), and the
  // value scales of its rows (int8 / int4).
  struct Rows {
    std::vector<double> k, v, v_scale;
  };
  Rows rows_of(int s, int kv) const {
    const int L = c.seq_lens[s], D = c.head_size, Dv = c.dv();
    Rows r;
    r.k.resize(size_t(L) * D);
    r.v.resize(size_t(L) * Dv);
    for (int pos = 0; pos < L; ++pos) {
      for (int d = 0; d < D; ++d) r.k[size_t(pos) * D + d] = k(s, kv, pos, d);
      for (int d = 0; d < Dv; ++d) r.v[size_t(pos) * Dv + d] = v(s, kv, pos, d);
      if (c.format != DType::kBFloat16) r.v_scale.push_back(value_scales[row_of(s, kv, pos)]);
    }
    return r;
  }

  // The integer path (kIntDots) rounds the query row to int16 in steps of |q|_inf / 32767,
  // which moves every logit by at most delta = half a step times max |k|_1, and so an output by
  // at most delta sum_t p_t |v_t - out| <= 2 delta B; and it rounds p_t v_scale_t to int16 in
  // steps of its chunk's largest / 32767, which moves an output by at most half a step times
  // sum_t |v_t| / v_scale_t (the stored integers) per chunk: bounded with the row's largest
  // p_t v_scale_t for every chunk.
  void int_bounds(const Rows& r, const double* q, int token, int h, int lo, int qp,
                  const std::vector<double>& p, double l) {
    const int D = c.head_size, Dv = c.dv(), H = c.heads;
    double q_max = 0, k_l1 = 0, pv_max = 0;
    for (int d = 0; d < D; ++d) q_max = std::max(q_max, std::fabs(q[d]));
    for (int kp = lo; kp <= qp; ++kp) {
      double row = 0;
      for (int d = 0; d < D; ++d) row += std::fabs(r.k[size_t(kp) * D + d]);
      k_l1 = std::max(k_l1, row);
      pv_max = std::max(pv_max, p[kp - lo] / l * r.v_scale[kp]);
    }
    const double delta = q_max / std::sqrt(double(D)) / 32767 / 2 * k_l1;
    const double* b = &bound[(size_t(token) * H + h) * Dv];
    double* e = &int_bound[(size_t(token) * H + h) * Dv];
    for (int d = 0; d < Dv; ++d) {
      double stored = 0;  // sum_t |v_t[d]| / v_scale_t
      for (int kp = lo; kp <= qp; ++kp) {
        const double vs = r.v_scale[kp];
        if (vs > 0) stored += std::fabs(r.v[size_t(kp) * Dv + d]) / vs;
      }
      e[d] = 2 * delta * b[d] * (1 + delta) + pv_max / 65534 * stored;
    }
  }

  // A query row as the avx512bf16 and avx2 decode rounds it for int4 S (lanes_query): q times
  // the kernel's float scale, in steps of its largest |element| / 127, q / step rounded once
  // (one FMA), ties to even; returned in the reference's units (times 1 / scale).
  static void rounded(std::vector<double>& q, float scale_f, double scale) {
    std::vector<float> x(q.size());
    float amax = 0.f;
    for (size_t d = 0; d < q.size(); ++d) {
      x[d] = float(q[d]) * scale_f;
      amax = std::max(amax, std::fabs(x[d]));
    }
    if (!(amax > 0.f)) return;
    const float inv = 127.f / amax, step = amax / 127.f;
    for (size_t d = 0; d < q.size(); ++d)
      q[d] = std::nearbyint(double(x[d]) * double(inv)) * double(step) / scale;
  }

  void reference() {
    ref.assign(size_t(num_tokens) * c.heads * c.dv(), 0.0);
    bound.assign(ref.size(), 0.0);
    int_bound.assign(ref.size(), 0.0);
    ref_lse.assign(size_t(num_tokens) * c.heads, 0.0);
    reference_of(false, ref, ref_lse, true);
    if (int4()) {
      ref8.assign(ref.size(), 0.0);
      ref8_lse.assign(ref_lse.size(), 0.0);
      reference_of(true, ref8, ref8_lse, false);
    }
  }

  // out and lse of every (token, head), over the query as given or rounded; with bounds, the
  // bound and int_bound of each element too.
  void reference_of(bool round_query, std::vector<double>& out, std::vector<double>& out_lse,
                    bool bounds) {
    const int D = c.head_size, Dv = c.dv(), H = c.heads, group = c.heads / c.kv_heads;
    const double scale = 1.0 / std::sqrt(double(D));
    std::vector<double> q(D);
    for (int s = 0; s < static_cast<int>(c.seq_lens.size()); ++s) {
      const int L = c.seq_lens[s], Q = c.q_lens[s];
      for (int kv = 0; kv < c.kv_heads; ++kv) {
        const Rows r = rows_of(s, kv);
        for (int i = 0; i < Q; ++i) {
          const int qp = L - Q + i, token = query_start[s] + i;
          const int lo = c.window > 0 ? std::max(0, qp - c.window + 1) : 0;
          for (int h = kv * group; h < (kv + 1) * group; ++h) {
            for (int d = 0; d < D; ++d) q[d] = from_bf16(query[(size_t(token) * H + h) * D + d]);
            if (round_query) rounded(q, 1.f / std::sqrt(float(D)), scale);
            std::vector<double> logit(qp + 1 - lo);
            double mx = -std::numeric_limits<double>::infinity();
            for (int kp = lo; kp <= qp; ++kp) {
              const double* kr = &r.k[size_t(kp) * D];
              double x = 0;
              for (int d = 0; d < D; ++d) x += q[d] * kr[d];
              x *= scale;
              if (c.soft_cap > 0.f) x = c.soft_cap * std::tanh(x / c.soft_cap);
              if (c.alibi) x += double(slopes[h]) * (kp - qp);
              logit[kp - lo] = x;
              mx = std::max(mx, x);
            }
            double l = 0;
            for (double& x : logit) l += (x = std::exp(x - mx));
            double* o = &out[(size_t(token) * H + h) * Dv];
            double* b = &bound[(size_t(token) * H + h) * Dv];
            for (int kp = lo; kp <= qp; ++kp) {
              const double pr = logit[kp - lo] / l;
              const double* vr = &r.v[size_t(kp) * Dv];
              for (int d = 0; d < Dv; ++d) {
                o[d] += pr * vr[d];
                if (bounds) b[d] += pr * std::fabs(vr[d]);
              }
            }
            if (bounds && c.format != DType::kBFloat16)
              int_bounds(r, q.data(), token, h, lo, qp, logit, l);
            out_lse[size_t(token) * H + h] = mx + std::log(l);
          }
        }
      }
    }
  }
};

// Runs attend over the batch's items (per sequence, kv head and tile of 96 / group query
// tokens, as the planner makes them) and checks every output against the reference. Returns
// the number of elements out of bounds.
int check(const Batch& b, cpu::Attend attend, bool pairs, const char* label,
          bool int_dots = false) {
  const Case& c = b.c;
  const int D = c.head_size, Dv = c.dv(), H = c.heads, group = H / c.kv_heads;
  std::vector<uint16_t> out(size_t(b.num_tokens) * H * Dv, 0x7fc0);  // NaN
  std::vector<float> lse(size_t(b.num_tokens) * H, std::numeric_limits<float>::quiet_NaN());
  std::vector<int32_t> seq_lens(c.seq_lens.begin(), c.seq_lens.end());
  int max_q = 0, max_len = 0;
  for (size_t s = 0; s < c.seq_lens.size(); ++s) {
    max_q = std::max(max_q, c.q_lens[s]);
    max_len = std::max(max_len, c.seq_lens[s]);
  }

  PagedAttentionParams p{};
  p.out = out.data();
  p.query = b.query.data();
  p.q_token_stride = int64_t{H} * D;
  p.q_head_stride = D;
  p.out_token_stride = int64_t{H} * Dv;
  p.out_head_stride = Dv;
  const CacheStrides hnd{int64_t{c.kv_heads} * c.block_size * D, int64_t{c.block_size} * D, D};
  p.key_cache = PagedKVView{const_cast<uint16_t*>(b.key_cache.data()), hnd, c.block_size};
  p.value_cache = c.latent ? p.key_cache
                           : PagedKVView{const_cast<uint16_t*>(b.value_cache.data()), hnd,
                                         c.block_size};
  if (c.format != DType::kBFloat16) {  // rows of D (int8) or D / 2 (int4) bytes, and scales
    const int64_t row = b.int4() ? D / 2 : D;
    const CacheStrides bytes{int64_t{c.kv_heads} * c.block_size * row, c.block_size * row, row};
    const CacheStrides floats{int64_t{c.kv_heads} * c.block_size, c.block_size, 1};
    p.key_cache = PagedKVView{const_cast<uint8_t*>(b.key_q.data()), bytes, c.block_size};
    p.value_cache = PagedKVView{const_cast<uint8_t*>(b.value_q.data()), bytes, c.block_size};
    p.key_scales = PagedKVView{const_cast<float*>(b.key_scales.data()), floats, c.block_size};
    p.value_scales =
        PagedKVView{const_cast<float*>(b.value_scales.data()), floats, c.block_size};
  }
  p.block_tables = b.table.data();
  p.block_table_stride = b.max_blocks;
  p.seq_lens = seq_lens.data();
  p.query_start_loc = b.query_start.data();
  p.alibi_slopes = c.alibi ? b.slopes.data() : nullptr;
  p.lse_out = lse.data();
  p.lse_token_stride = H;
  p.lse_head_stride = 1;
  p.num_tokens = b.num_tokens;
  p.num_seqs = static_cast<int32_t>(c.seq_lens.size());
  p.num_heads = H;
  p.num_kv_heads = c.kv_heads;
  p.head_size = D;
  p.head_size_v = Dv;
  p.num_blocks = b.num_blocks;
  p.max_blocks_per_seq = b.max_blocks;
  p.max_seq_len = max_len;
  p.max_query_len = max_q;
  p.sliding_window = c.window;
  p.scale = 1.f / std::sqrt(float(D));
  p.soft_cap = c.soft_cap;
  p.dtype = DType::kBFloat16;
  p.cache_dtype = c.format;

  const int tile = std::max(1, cpu::kPrefillRows / group);
  std::vector<float> scratch(cpu::scratch_floats(std::max(H, cpu::kPrefillRows), D));
  const cpu::Partials partials{nullptr, nullptr, 0};
  for (int s = 0; s < p.num_seqs; ++s) {
    const int L = c.seq_lens[s], Q = c.q_lens[s];
    for (int h = 0; h < c.kv_heads; ++h) {
      for (int q0 = 0; q0 < Q; q0 += tile) {
        const int count = std::min(tile, Q - q0), first = L - Q + q0;
        const int key_begin = c.window > 0 ? std::max(0, first - c.window + 1) : 0;
        attend(p, cpu::WorkItem{s, h, 1, 0, group, q0, count, key_begin, first + count, -1},
               scratch.data(), partials);
      }
    }
  }

  // Each (token, head) against ref, or (int4 on the integer path: rows that avx512bf16's
  // decode runs on int8 queries) against ref8; a row must meet one of them whole.
  int bad = 0, bad_rows = 0;
  double worst = 0;  // the largest error over its bound
  const bool either = int_dots && !b.ref8.empty();
  const auto row_errors = [&](size_t row, const std::vector<double>& want,
                              const std::vector<double>& want_lse, double* ratio) {
    int n = 0;
    *ratio = 0;
    for (size_t i = row * Dv; i < (row + 1) * Dv; ++i) {
      const double tol = std::ldexp(std::fabs(want[i]), -8) +
                         (pairs ? std::ldexp(1.0, -8) : 1e-4) * b.bound[i] +
                         (int_dots ? b.int_bound[i] : 0.0);
      const double err = std::fabs(from_bf16(out[i]) - want[i]);
      if (!(err <= tol)) {  // NaN included: an element the kernel never wrote
        ++n;
      } else {
        *ratio = std::max(*ratio, err / tol);
      }
    }
    if (!(std::fabs(lse[row] - want_lse[row]) <= 1e-4 * (1 + std::fabs(want_lse[row])))) ++n;
    return n;
  };
  for (size_t row = 0; row < lse.size(); ++row) {
    double ratio = 0, ratio8 = 0;
    const int n = row_errors(row, b.ref, b.ref_lse, &ratio);
    if (n == 0 || (either && row_errors(row, b.ref8, b.ref8_lse, &ratio8) == 0)) {
      worst = std::max(worst, n == 0 ? ratio : ratio8);
      continue;
    }
    if (++bad_rows <= 5)
      std::printf("  %s: out[token %zu][head %zu]: %d elements (or its lse) out of bounds\n",
                  label, row / H, row % H, n);
    bad += n;
  }
  std::printf("  %-24s %s  largest error %.2f of its bound\n", label, bad ? "FAIL" : "ok  ",
              worst);
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  const Set* set = nullptr;
  for (const Set& s : kSets)
    if (argc == 2 && std::string(argv[1]) == s.name) set = &s;
  if (set == nullptr) {
    std::fprintf(stderr, "usage: %s SET (one of:", argv[0]);
    for (const Set& s : kSets) std::fprintf(stderr, " %s", s.name);
    std::fprintf(stderr, ")\n");
    return 2;
  }
  if (!set->has()) {
    std::printf("skipped: this processor lacks the %s instruction set\n", set->name);
    return 77;
  }
  const std::vector<Case> cases = {
      {"gqa4 d128 bs16", 32, 8, 128, 16, {301, 520, 64, 9, 1000}, {301, 77, 33, 9, 5}},
      {"gqa8 d72 bs7 window", 16, 2, 72, 7, {333, 150}, {97, 150}, 50},
      {"gqa1 d256 bs32 cap alibi", 4, 4, 256, 32, {211, 90}, {111, 61}, -1, 30.f, true},
      {"gqa4 d64 bs16 window alibi", 8, 2, 64, 16, {259, 47}, {203, 47}, 100, 0.f, true},
      {"mla 16 heads d576/512", 16, 1, 576, 16, {200, 37, 90}, {1, 37, 3}, -1, 0.f, false, 512,
       true},
      {"int8 gqa4 d128 bs16", 32, 8, 128, 16, {301, 64, 9, 1000}, {301, 1, 9, 1}, -1, 0.f,
       false, 0, false, DType::kInt8},
      {"int4 gqa4 d80 bs7 window", 8, 2, 80, 7, {333, 150, 1}, {97, 1, 1}, 50, 0.f, false, 0,
       false, DType::kInt4},
      {"int4 gqa8 d128 bs16 alibi", 16, 2, 128, 16, {259, 47}, {1, 47}, -1, 0.f, true, 0,
       false, DType::kInt4},
      // plain decode in quads, head sizes a multiple of 128: avx512bf16's S with a key a lane
      {"int4 gqa4 d128 bs16", 32, 8, 128, 16, {301, 64, 9, 1000}, {301, 1, 9, 1}, -1, 0.f,
       false, 0, false, DType::kInt4},
      {"int4 gqa4 d256 bs16", 8, 2, 256, 16, {259, 47}, {1, 1}, -1, 0.f, false, 0, false,
       DType::kInt4},
  };
  std::mt19937 rng(2026);
  int bad = 0;
  const cpu::PairSet kernels = set->kernels();
  std::printf("%s kernels, %d float lanes\n", set->name, kernels.lanes);
  for (const Case& c : cases) {
    if (c.head_size % kernels.lanes != 0) {  // the library takes another set for this head size
      std::printf("  %-24s skipped: head size not a multiple of %d\n", c.name, kernels.lanes);
      continue;
    }
    const Batch batch(c, rng);
    if (c.format != DType::kBFloat16) {
      const bool int8 = c.format == DType::kInt8;
      bad += check(batch, int8 ? kernels.int8_path : kernels.int4_path, false,
                   (std::string(c.name) + ", float").c_str());
      // (prefill items on pairs: P rounded to bfloat16, the pair path's bound)
      bad += check(batch, int8 ? kernels.int8_int_path : kernels.int4_int_path, true,
                   (std::string(c.name) + ", int").c_str(), true);
      continue;
    }
    bad += check(batch, kernels.float_path, false, (std::string(c.name) + ", float").c_str());
    bad += check(batch, kernels.pair_path, true, (std::string(c.name) + ", pairs").c_str());
    if (kernels.amx_path != nullptr)  // P rounded to bfloat16 as on the pair path: its bound
      bad += check(batch, kernels.amx_path, true, (std::string(c.name) + ", amx").c_str());
  }
  std::printf(bad ? "FAILED: %d elements out of bounds\n" : "passed\n", bad);
  return bad ? 1 : 0;
}
