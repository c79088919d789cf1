// Paged attention on tensor cores, FlashAttention-2 style: mma.sync m16n8k16 (fp32 accumulate)
// for float16 / bfloat16 queries and caches of the same dtype, fp8 with per-tensor scales, or
// int8 / int4 / fp8 e4m3 with a scale per (token, head) row, sm_80+. The host side (dispatch
// rule, plan) is attention_tc_launch.h; docs/cuda_attention.md describes both kernels.
//
// A thread block computes a tile of BM = 16 * WM rows of one (sequence, kv head, context
// partition); a row is one (query token, query head of the kv head's group) pair, row r being
// token r / group, head r % group, so a decode GQA group fills the M dimension of the MMA and a
// prefill chunk fills it completely. WM warps take 16 rows each; WN warps split each key tile
// of BN keys (BN / WN keys each) and merge their softmax states through shared memory at the end.
// Configurations: "prefill" WM = 4, WN = 1; "decode" WM = 1, WN = 4 (2 for head 256).
//
// Per key tile: K and V rows are copied from the paged caches into a double buffer in shared
// memory, the next tile's copies in flight while this one is computed (attention_tc_tile.cuh).
// S = Q K^T from ldmatrix fragments (Q's in registers for heads up to 128; rows padded by 16
// bytes so that the 8 rows of an 8x8 matrix fall in different banks); online softmax per row (a
// row's values live in the 4 lanes of a quad: max by two shuffles); P rounded to the query dtype
// and used as the A operand of O += P V straight from the S fragments (V through ldmatrix.trans).
// Two loops: the key tiles every row of the tile sees whole, with soft cap and ALiBi off, run an
// unmasked body (the scale inside the exponent, no per-score code); the others a masked body
// (scale, soft cap, ALiBi, causal / window / partition masks per score). Two row sums: of P in
// fp32 for the lse (as exact as the CUDA-core kernel's) and of P as rounded, by one more MMA (P
// x ones), to normalize the output, which is then a convex combination of the V rows with the
// weights the MMA used.
//
// Caches quantized per (token, head) (C = RowScaled<E>): the codes are staged as T exactly, a
// key's K scale multiplies its column of S (fp32, before anything else touches the score) and
// its V scale its column of P before P is rounded to T; the output's normalizer is the sum of P
// as rounded divided by the V scales (fp32, one FMA a score, in place of the ones-MMA), so that
// the output stays a convex combination of the dequantized V rows with the weights the MMA used.
// A V scale of 0 has no such weight (P times 0 as rounded is 0): a block whose keys hold one
// normalizes by the fp32 sum of P instead. A V scale of NaN makes the rows NaN, as a NaN V
// element does its column.
//
// Split-K: with several partitions each block writes its normalized partial output and lse to
// the workspace and paged_attention_reduce_kernel (attention_merge.cuh) merges them, as for the
// CUDA-core kernel.
//
// Templates only: csrc/cuda/attention_tc_*.cu (nvcc) and csrc/simt_backend/attention_tc_*.cpp
// (emulator) instantiate them per query dtype (PAGEDKV_INSTANTIATE_ATTENTION_TC).
#pragma once
#include "kernels/compat.cuh"
#include "kernels/attention_chunks.cuh"
#include "kernels/attention_merge.cuh"
#include "kernels/attention_tc_launch.h"
#include "kernels/attention_tc_tile.cuh"
#include "kernels/attention_tile.cuh"
#include "kernels/dtypes.cuh"
#include "kernels/memory.cuh"
#include "kernels/tensor_core.cuh"

namespace pagedkv {
namespace PAGEDKV_KERNEL_NS {
namespace attn_tc {

using attn::AttentionTile;
using attn::counts;
using attn::kFullMask;
using attn::kLn2;
using attn::kLog2e;
using attn::OutRow;
using attn::safe_max;

// grid: (row_tiles * num_parts, num_seqs, num_kv_heads), block: TcConfig::kThreads,
// dynamic smem: TcConfig::kBytes. T: the query and out dtype (16-bit); C: the cache's, T, an
// fp8 type (dequantized to T while staged) or RowScaled<E> (E int8_t, int4x2 or fp8_e4m3, per-row
// scales); p.head_size <= HEAD.
template <typename T, typename C, int HEAD, int WM, int WN, int BN>
__global__ void __launch_bounds__(32 * WM * WN, 1)
    paged_attention_tc_kernel(const PagedAttentionParams p, const AttentionPlan plan) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // no mma.sync m16n8k16 / cp.async: the dispatch rule never launches it here
#else
  using Cfg = TcConfig<HEAD, WM, WN, BN>;
  constexpr int kStride = Cfg::kStride;
  constexpr int KW = Cfg::kWarpKeys;
  PAGEDKV_DYNAMIC_SMEM(T, tc_smem);
  constexpr bool kRowScaled = cache_elem<C>::kRowScaled;
  __shared__ RowOffsets row_off[2][BN];  // 16-bit caches: K/V row offsets of two tiles
  // row-scaled: [2 tiles][K scale, V scale, 1 / V scale][BN]
  __shared__ __align__(16) float tc_scale[kRowScaled ? 6 * BN : 1];
  T* q_smem = tc_smem;                     // [kBM][kStride]
  T* k_smem = q_smem + Cfg::kQElems;       // [2][BN][kStride]
  T* v_smem = k_smem + 2 * Cfg::kKVElems;  // [2][BN][kStride]

  const AttentionTile tile(p, plan, Cfg::kBM);
  const int rows = tile.rows;
  if (rows <= 0) return;  // the whole block: no barrier skipped
  const int part_end = tile.part_end, window = tile.window;

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int warp_m = warp % WM, warp_n = warp / WM;
  const int head_size = p.head_size;
  constexpr bool kFp8 = is_fp8<C>::value;  // per-tensor scales (RowScaled<fp8> is not)
  float qk_scale = p.scale;
  float v_scale = 1.f;
  if constexpr (kFp8) {
    qk_scale *= *p.k_scale;
    v_scale = *p.v_scale;
  }

  stage_query<T, Cfg::kBM, Cfg::kChunks, kStride, Cfg::kThreads>(p, tile, head_size, q_smem);

  TcCopy<T, C, Cfg, BN> copy(p, tile, k_smem, row_off, tc_scale);

  // This thread's two rows of the warp's 16 (lane / 4 and lane / 4 + 8): query position (-1:
  // no row, everything masked) and ALiBi slope.
  int pos[2];
  float slope[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp_m * 16 + lane / 4 + 8 * h;
    const bool in = r < rows;
    pos[h] = in ? tile.pos(r) : -1;
    slope[h] = in && p.alibi_slopes != nullptr ? p.alibi_slopes[tile.head(r)] : 0.f;
  }
  const bool alibi = p.alibi_slopes != nullptr;
  const float soft_cap = p.soft_cap;
  const float qk_scale_log2 = qk_scale * kLog2e;
  const int d_tiles = head_size / 8;  // n8 tiles of O that hold output dims

  // Per row: running max m (log2 domain), row sum of P in fp32 (l, for the lse; per lane until
  // the end) and of P as rounded for the MMA (the output's normalizer): an accumulator fragment
  // of P x ones, whose columns all hold the row sums (lr[0] row g, lr[2] row g + 8).
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  [[maybe_unused]] float lq[2] = {0.f, 0.f};  // row-scaled: sum of P as rounded / V scale
  float lr[4] = {0.f, 0.f, 0.f, 0.f};
  const uint32_t ones[2] = {pack2<T>(from_float<T>(1.f), from_float<T>(1.f)),
                            pack2<T>(from_float<T>(1.f), from_float<T>(1.f))};
  float o[HEAD / 8][4];
#pragma unroll
  for (int j = 0; j < HEAD / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;

  const int part_begin = tile.part_begin;
  const int n_tiles = part_end > part_begin ? (part_end - part_begin + BN - 1) / BN : 0;
  if (n_tiles > 0) copy.prologue(part_begin);
  __syncthreads();  // Q (and the first tiles' row offsets) in shared memory
  if (n_tiles > 0) copy.start(part_begin);
  // Q as A operands, one per k16 step, in registers for the whole loop where they fit (head
  // <= 128: 32 registers); head 256 reloads them from shared memory per key tile.
  constexpr bool kQRegs = HEAD <= 128;
  const T* qs = q_smem + warp_m * 16 * kStride;
  uint32_t qf[kQRegs ? HEAD / 16 : 1][4];
  if constexpr (kQRegs) {
#pragma unroll
    for (int kk = 0; kk < HEAD / 16; ++kk) {
      tc::ldmatrix_x4(qf[kk], qs + (lane % 16) * kStride + kk * 16 + (lane / 16) * 8);
    }
  }

  // The math of one key tile (buffer buf, keys from key0). kMasked: the general body (soft cap,
  // ALiBi, the causal / window / partition masks, per score); otherwise every key of the tile
  // is valid for every row and no feature is on: scores are scaled into the exponent (one FFMA
  // each) and none of that code is compiled in.
  auto tile_math = [&]<bool kMasked>(int buf, int key0) {
    const T* ks = k_smem + buf * Cfg::kKVElems + warp_n * KW * kStride;
    const T* vs = v_smem + buf * Cfg::kKVElems + warp_n * KW * kStride;
    // Row-scaled: this lane's keys' scales, at column 2 * (lane % 4) of each n8 tile.
    [[maybe_unused]] const float* k_sc = tc_scale + 3 * buf * BN + warp_n * KW + 2 * (lane % 4);
    [[maybe_unused]] const float* v_sc = k_sc + BN;
    [[maybe_unused]] const float* v_inv = k_sc + 2 * BN;
    // S = Q K^T: [16][KW] per warp (dims past head_size are zeros in Q and K).
    float s[KW / 8][4];
#pragma unroll
    for (int j = 0; j < KW / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HEAD / 16; ++kk) {
      uint32_t a[4];
      if constexpr (kQRegs) {
        a[0] = qf[kk][0], a[1] = qf[kk][1], a[2] = qf[kk][2], a[3] = qf[kk][3];
      } else {
        tc::ldmatrix_x4(a, qs + (lane % 16) * kStride + kk * 16 + (lane / 16) * 8);
      }
#pragma unroll
      for (int j = 0; j < KW / 8; j += 2) {
        uint32_t b[4];
        tc::ldmatrix_x4(b, ks + (j * 8 + (lane / 16) * 8 + lane % 8) * kStride + kk * 16 +
                               ((lane / 8) % 2) * 8);
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        tc::mma_m16n8k16<T>(s[j], a, b0, s[j]);
        tc::mma_m16n8k16<T>(s[j + 1], a, b1, s[j + 1]);
      }
    }

    if constexpr (kRowScaled) {  // the keys' K scales, first
#pragma unroll
      for (int j = 0; j < KW / 8; ++j) {
        const float2 ks = *reinterpret_cast<const float2*>(k_sc + j * 8);
        s[j][0] *= ks.x, s[j][1] *= ks.y, s[j][2] *= ks.x, s[j][3] *= ks.y;
      }
    }

    // Masked: scale, soft cap, ALiBi, masks into the log2 domain (exponent scale 1); unmasked:
    // the raw scores, scaled in the exponent.
    float mul = qk_scale_log2;
    if constexpr (kMasked) {
      mul = 1.f;
      const int wkey0 = key0 + warp_n * KW;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int j = 0; j < KW / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int t = wkey0 + j * 8 + 2 * (lane % 4) + e;
            float x = s[j][2 * h + e] * qk_scale;
            if (soft_cap > 0.f) x = soft_cap * tanhf(x / soft_cap);
            if (alibi) x += slope[h] * static_cast<float>(t - pos[h]);
            const bool valid = t < part_end && t <= pos[h] && (window <= 0 || t > pos[h] - window);
            s[j][2 * h + e] = valid ? x * kLog2e : -INFINITY;
          }
        }
      }
    }

    // Online softmax per row (a row lives in the 4 lanes of a quad: max by two shuffles).
    uint32_t pa[KW / 16][4];  // P as A operands, one per k16 step of P V
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = s[0][2 * h];
#pragma unroll
      for (int j = 0; j < KW / 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
      // Unmasked, every score is finite: so is the running max.
      const float m_new = fmaxf(m[h], mx * mul);
      const float base = kMasked ? safe_max(m_new) : m_new;
      const float alpha = attn::fast_exp2(m[h] - base);
      m[h] = m_new;
      l[h] *= alpha;
      lr[2 * h] *= alpha;
      if constexpr (kRowScaled) lq[h] *= alpha;
#pragma unroll
      for (int d = 0; d < HEAD / 8; ++d) {
        o[d][2 * h] *= alpha;
        o[d][2 * h + 1] *= alpha;
      }
#pragma unroll
      for (int j = 0; j < KW / 8; ++j) {
        const float e0 = attn::fast_exp2(fmaf(s[j][2 * h], mul, -base));
        const float e1 = attn::fast_exp2(fmaf(s[j][2 * h + 1], mul, -base));
        l[h] += e0 + e1;
        T p0, p1;
        if constexpr (kRowScaled) {  // times the keys' V scales
          const float2 vsc = *reinterpret_cast<const float2*>(v_sc + j * 8);
          const float2 inv = *reinterpret_cast<const float2*>(v_inv + j * 8);
          p0 = from_float<T>(e0 * vsc.x), p1 = from_float<T>(e1 * vsc.y);
          lq[h] = fmaf(to_float(p0), inv.x, fmaf(to_float(p1), inv.y, lq[h]));
        } else {
          p0 = from_float<T>(e0), p1 = from_float<T>(e1);
        }
        // A fragment of k16 step j / 2: a0 (row, keys 0..7) a1 (row + 8, keys 0..7),
        // a2 (row, keys 8..15), a3 (row + 8, keys 8..15).
        pa[j / 2][(j % 2) * 2 + h] = pack2<T>(p0, p1);
      }
    }

    // O += P V (dims past head_size: zero V columns, never written).
#pragma unroll
    for (int kk = 0; kk < KW / 16; ++kk) {
      if constexpr (!kRowScaled) tc::mma_m16n8k16<T>(lr, pa[kk], ones, lr);
#pragma unroll
      for (int d = 0; d < HEAD / 8; d += 2) {
        uint32_t b[4];
        tc::ldmatrix_x4_trans(b, vs + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * kStride +
                                     d * 8 + (lane / 16) * 8);
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        tc::mma_m16n8k16<T>(o[d], pa[kk], b0, o[d]);
        tc::mma_m16n8k16<T>(o[d + 1], pa[kk], b1, o[d + 1]);
      }
    }
  };

  // Masked tiles: a warp none of whose rows sees any of its keys (all before the window of its
  // first row, past its last row's position or the partition's end; a warp without rows) skips
  // the math, whose scores would all be -inf and change nothing.
  const int warp_first = min(warp_m * 16, rows - 1);
  const int warp_last = min(warp_m * 16 + 15, rows - 1);
  const bool warp_rows = warp_m * 16 < rows;
  auto warp_sees = [&](int wkey0) {
    return warp_rows && wkey0 < part_end && wkey0 <= tile.pos(warp_last) &&
           (window <= 0 || wkey0 + KW - 1 > tile.pos(warp_first) - window);
  };
  auto key_tile = [&]<bool kMasked>(int it) {
    const int key0 = part_begin + it * BN;
    copy.before_tile(it, key0, n_tiles);
    __syncthreads();
    copy.after_barrier(it, key0, n_tiles);
    if (!kMasked || warp_sees(key0 + warp_n * KW)) {
      tile_math.template operator()<kMasked>(it & 1, key0);
    }
    copy.after_tile(it, n_tiles);
  };

  // Tiles whose keys every row sees, with no feature on, run unmasked: [it_lo, it_hi); the
  // others (window start, causal diagonal, partition end; all of them with soft cap or ALiBi)
  // masked.
  int it_lo = n_tiles, it_hi = n_tiles;
  if (soft_cap <= 0.f && !alibi && qk_scale > 0.f) {  // max(s) * scale is then the scaled max
    const int lo = tile.unmasked_begin() - part_begin, hi = tile.unmasked_end() - part_begin;
    it_lo = min(n_tiles, max(0, (lo + BN - 1) / BN));
    it_hi = max(it_lo, min(n_tiles, hi / BN));
  }
  for (int it = 0; it < n_tiles;) {
    if (it >= it_lo && it < it_hi) {
      for (; it < it_hi; ++it) key_tile.template operator()<false>(it);
    } else {
      key_tile.template operator()<true>(it++);
    }
  }

  // Row sums across the quad.
  [[maybe_unused]] bool zero_v = false;  // row-scaled: a key with a V scale of 0 (TcCopy)
  if constexpr (kRowScaled) zero_v = __syncthreads_or(copy.zero_v);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(kFullMask, l[h], 1);
    l[h] += __shfl_xor_sync(kFullMask, l[h], 2);
    if constexpr (kRowScaled) {  // P as rounded holds the V scales
      lq[h] += __shfl_xor_sync(kFullMask, lq[h], 1);
      lq[h] += __shfl_xor_sync(kFullMask, lq[h], 2);
      lr[2 * h] = zero_v ? l[h] : lq[h];
    }
  }

  if constexpr (WN == 1) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp_m * 16 + lane / 4 + 8 * h;
      if (r < rows) {
        const float inv = counts(lr[2 * h]) ? __frcp_rn(lr[2 * h]) : 0.f;
        const float lse = counts(l[h]) ? (m[h] + log2f(l[h])) * kLn2 : -INFINITY;
        const OutRow<T> dst(p, plan, tile.token(r), tile.head(r), tile.part, lse);
#pragma unroll
        for (int d = 0; d < HEAD / 8; ++d) {
          if (d < d_tiles) {
            dst.put(d * 8 + 2 * (lane % 4), o[d][2 * h] * inv * v_scale);
            dst.put(d * 8 + 2 * (lane % 4) + 1, o[d][2 * h + 1] * inv * v_scale);
          }
        }
        if (lane % 4 == 0) dst.put_lse();
      }
    }
  } else {
    // Merge the WN warps' states of the same 16 rows (the math of merge_attn_states).
    __syncthreads();  // every warp is done with Q / K / V in shared memory
    float* o_smem = reinterpret_cast<float*>(tc_smem);  // [kWarps][16][HEAD]
    float* m_smem = o_smem + Cfg::kWarps * 16 * HEAD;   // [kWarps][16]
    float* l_smem = m_smem + Cfg::kWarps * 16;          // [kWarps][16]
    float* lr_smem = l_smem + Cfg::kWarps * 16;         // [kWarps][16]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = lane / 4 + 8 * h;
#pragma unroll
      for (int d = 0; d < HEAD / 8; ++d) {
        if (d < d_tiles) {
          float* dst = o_smem + (warp * 16 + r) * HEAD + d * 8 + 2 * (lane % 4);
          dst[0] = o[d][2 * h];
          dst[1] = o[d][2 * h + 1];
        }
      }
      if (lane % 4 == 0) {
        m_smem[warp * 16 + r] = m[h];
        l_smem[warp * 16 + r] = l[h];
        lr_smem[warp * 16 + r] = lr[2 * h];
      }
    }
    __syncthreads();
    for (int i = tid; i < rows * (head_size / 2); i += Cfg::kThreads) {
      const int r = i / (head_size / 2), d = 2 * (i % (head_size / 2));
      float m_all = -INFINITY;
#pragma unroll
      for (int w = 0; w < WN; ++w) m_all = fmaxf(m_all, m_smem[w * 16 + r]);
      const float base = safe_max(m_all);
      float o0 = 0.f, o1 = 0.f, sum = 0.f, sum_r = 0.f;
#pragma unroll
      for (int w = 0; w < WN; ++w) {
        const float wt = exp2f(m_smem[w * 16 + r] - base);
        o0 += wt * o_smem[(w * 16 + r) * HEAD + d];
        o1 += wt * o_smem[(w * 16 + r) * HEAD + d + 1];
        sum += wt * l_smem[w * 16 + r];
        sum_r += wt * lr_smem[w * 16 + r];
      }
      const float inv = (counts(sum_r) ? __frcp_rn(sum_r) : 0.f) * v_scale;
      const float lse = counts(sum) ? (m_all + log2f(sum)) * kLn2 : -INFINITY;
      const OutRow<T> dst(p, plan, tile.token(r), tile.head(r), tile.part, lse);
      dst.put(d, o0 * inv);
      dst.put(d + 1, o1 * inv);
      if (d == 0) dst.put_lse();
    }
  }
#endif
}

template <typename T, typename C, int HEAD, int WM, int WN, int BN>
cudaError_t launch_paged_attention_tc(const PagedAttentionParams& p, const AttentionPlan& plan,
                                      cudaStream_t stream) {
  using Cfg = TcConfig<HEAD, WM, WN, BN>;
  return attn::launch_attention<T>(paged_attention_tc_kernel<T, C, HEAD, WM, WN, BN>, Cfg::kThreads,
                                   Cfg::kBytes, p, plan, stream);
}

// Head size and configuration (from the rows per kv head, as the plan's row tiles) to template
// arguments.
template <typename T, typename C, int HEAD>
cudaError_t paged_attention_tc_head(const PagedAttentionParams& p, const AttentionPlan& plan,
                                    cudaStream_t stream) {
  constexpr int kPrefillKeys = HEAD <= 64 ? 64 : 32;
  if (attention_tc_block_rows(p) == kAttnTcPrefillRows) {
    return launch_paged_attention_tc<T, C, HEAD, kAttnTcPrefillRows / 16, 1, kPrefillKeys>(
        p, plan, stream);
  }
  static_assert(kAttnTcDecodeRows == 16, "the decode configuration is one MMA tile");
  if constexpr (HEAD == 256) {
    return launch_paged_attention_tc<T, C, HEAD, 1, 2, 32>(p, plan, stream);
  } else {
    return launch_paged_attention_tc<T, C, HEAD, 1, 4, 64>(p, plan, stream);
  }
}

// A 16-bit cache holds the queries' dtype (attention_tc_supported()).
template <typename T>
cudaError_t paged_attention_tc_typed(const PagedAttentionParams& p, const AttentionPlan& plan,
                                     cudaStream_t stream) {
  return with_cache_type<T>(p.cache_dtype, [&]<typename C>() {
    if (!is_fp8<C>::value && p.cache_dtype != p.dtype) return cudaErrorInvalidValue;
    return with_padded_head<kMaxTcAttentionHeadSize>(p.head_size, [&]<int HEAD>() {
      return paged_attention_tc_head<T, C, HEAD>(p, plan, stream);
    });
  });
}

// Caches quantized per (token, head) that the kernel reads (attention_tc_supported): int8, int4
// and fp8 e4m3.
template <typename T>
cudaError_t paged_attention_tc_row_scaled_typed(const PagedAttentionParams& p,
                                                const AttentionPlan& plan, cudaStream_t stream) {
  return with_token_scaled_type(p.cache_dtype, [&]<typename E>() {
    if constexpr (std::is_same_v<E, fp8_e5m2>) {
      return cudaErrorInvalidValue;
    } else {
      return with_padded_head<kMaxTcAttentionHeadSize>(p.head_size, [&]<int HEAD>() {
        return paged_attention_tc_head<T, RowScaled<E>, HEAD>(p, plan, stream);
      });
    }
  });
}

}  // namespace attn_tc
}  // namespace PAGEDKV_KERNEL_NS
}  // namespace pagedkv

// Explicit instantiation of the tensor-core kernels of query dtype T.
#define PAGEDKV_INSTANTIATE_ATTENTION_TC(T)                                                     \
  namespace pagedkv::PAGEDKV_KERNEL_NS::attn_tc {                                               \
  template cudaError_t paged_attention_tc_typed<T>(const PagedAttentionParams&,                 \
                                                   const AttentionPlan&, cudaStream_t);         \
  }

// Explicit instantiation of the tensor-core kernels of query dtype T over caches quantized per
// (token, head).
#define PAGEDKV_INSTANTIATE_ATTENTION_TC_ROW_SCALED(T)                                           \
  namespace pagedkv::PAGEDKV_KERNEL_NS::attn_tc {                                               \
  template cudaError_t paged_attention_tc_row_scaled_typed<T>(const PagedAttentionParams&,      \
                                                              const AttentionPlan&,             \
                                                              cudaStream_t);                    \
  }
