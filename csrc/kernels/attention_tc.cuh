// Paged attention on tensor cores, FlashAttention-2 style: mma.sync m16n8k16 (fp32 accumulate)
// for float16 / bfloat16 queries and caches of the same dtype, sm_80+. The host side (dispatch
// rule, plan) is attention_tc_launch.h; docs/cuda_attention.md describes both kernels.
//
// A thread block computes a tile of BM = 16 * WM rows of one (sequence, kv head, context
// partition); a row is one (query token, query head of the kv head's group) pair, row r being
// token r / group, head r % group, so a decode GQA group fills the M dimension of the MMA and a
// prefill chunk fills it completely. WM warps take 16 rows each; WN warps split each key tile
// of BN keys (BN / WN keys each) and merge their softmax states through shared memory at the end.
// Configurations: "prefill" WM = 4, WN = 1; "decode" WM = 1, WN = 4 (2 for head 256).
//
// Per key tile: K and V rows are gathered through the block table with cp.async (16 bytes per
// thread and copy; rows past the partition and dims past head_size are zero-filled) into a
// double buffer in shared memory, the next tile's copies in flight while this one is computed.
// S = Q K^T from ldmatrix fragments (Q and K row-major, rows padded by 16 bytes so that the 8 rows
// of an 8x8 matrix fall in different banks); scale, soft cap, ALiBi and the causal / window masks
// on the accumulator fragments; online softmax per row (a row's values live in the 4 lanes of a
// quad: max by two shuffles, the sum kept per lane until the end); P rounded to the query dtype
// and used as the A operand of O += P V straight from the S fragments (V through ldmatrix.trans).
// Two row sums: of P in fp32 for the lse (as exact as the CUDA-core kernel's) and of P as rounded
// for the MMA to normalize the output, which is then a convex combination of the V rows with
// the weights the MMA used.
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
#include "kernels/attention_tile.cuh"
#include "kernels/dtypes.cuh"
#include "kernels/memory.cuh"
#include "kernels/tensor_core.cuh"

#include <type_traits>

namespace pagedkv {
namespace PAGEDKV_KERNEL_NS {
namespace attn_tc {

using attn::AttentionTile;
using attn::kFullMask;
using attn::kLn2;
using attn::kLog2e;
using attn::KVRows;
using attn::OutRow;
using attn::safe_max;

template <int HEAD, int WM, int WN, int BN>
struct TcConfig {
  static constexpr int kWarps = WM * WN;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBM = 16 * WM;           // rows per block
  static constexpr int kWarpKeys = BN / WN;     // keys per warp and tile
  static constexpr int kStride = HEAD + 8;      // shared row stride in elements (+16 bytes)
  static constexpr int kChunks = HEAD / 8;      // 16-byte chunks per row
  static constexpr int kRowsPerPass = kThreads / kChunks;  // K/V rows staged per copy pass
  static constexpr int kQElems = kBM * kStride;
  static constexpr int kKVElems = BN * kStride;  // one K or V buffer
  static constexpr size_t kStageBytes = (kQElems + 4 * kKVElems) * 2;
  // WN > 1: per warp O [16][HEAD], then m, l and lr [16], floats.
  static constexpr size_t kMergeBytes = WN > 1 ? (kWarps * 16 * (HEAD + 3)) * sizeof(float) : 0;
  static constexpr size_t kBytes = kStageBytes > kMergeBytes ? kStageBytes : kMergeBytes;
  static_assert(kWarpKeys % 16 == 0, "each warp takes whole k16 steps of P V");
  static_assert(kThreads % kChunks == 0 && BN % kRowsPerPass == 0, "copy passes");
  static_assert(HEAD == 64 || HEAD == 128 || HEAD == 256, "padded head size");
};

// Two floats rounded to T, packed as an MMA operand register (lower half = lower column).
template <typename T>
__device__ __forceinline__ uint32_t pack2(T lo, T hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(__half lo, __half hi) {
  const __half_raw a = lo, b = hi;
  return static_cast<uint32_t>(a.x) | (static_cast<uint32_t>(b.x) << 16);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  const __nv_bfloat16_raw a = lo, b = hi;
  return static_cast<uint32_t>(a.x) | (static_cast<uint32_t>(b.x) << 16);
}

// 8 fp8 cache elements (raw, little-endian) -> 8 T, exactly (every e4m3 / e5m2 value is a
// float16 and a bfloat16 value); the scales are applied to S and O, not here.
template <typename T, typename C>
__device__ __forceinline__ uint4 dequantize8(uint2 raw) {
  constexpr __nv_fp8_interpretation_t kind = std::is_same_v<C, fp8_e4m3> ? __NV_E4M3 : __NV_E5M2;
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t word = i < 2 ? raw.x : raw.y;
    const auto pair = static_cast<__nv_fp8x2_storage_t>((word >> (16 * (i % 2))) & 0xffffu);
    __half2_raw h;
    if constexpr (kind == __NV_E5M2) {  // an e5m2 byte is the high byte of its float16
      h.x = static_cast<unsigned short>((pair & 0xffu) << 8);
      h.y = static_cast<unsigned short>(pair & 0xff00u);
    } else {
      h = __nv_cvt_fp8x2_to_halfraw2(pair, kind);
    }
    if constexpr (std::is_same_v<T, __half>) {
      w[i] = static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
    } else {
      __half_raw lo, hi;
      lo.x = h.x, hi.x = h.y;
      w[i] = pack2<T>(from_float<T>(__half2float(__half(lo))),
                      from_float<T>(__half2float(__half(hi))));
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// grid: (row_tiles * num_parts, num_seqs, num_kv_heads), block: TcConfig::kThreads,
// dynamic smem: TcConfig::kBytes. T: the query and out dtype (16-bit); C: the cache's, T or an
// fp8 type (dequantized to T while staged); p.head_size <= HEAD.
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
  T* q_smem = tc_smem;                     // [kBM][kStride]
  T* k_smem = q_smem + Cfg::kQElems;       // [2][BN][kStride]
  T* v_smem = k_smem + 2 * Cfg::kKVElems;  // [2][BN][kStride]

  const AttentionTile tile(p, plan, Cfg::kBM);
  const int rows = tile.rows;
  if (rows <= 0) return;  // the whole block: no barrier skipped
  const int part_end = tile.part_end, window = tile.window, kv_head = tile.kv_head;

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int warp_m = warp % WM, warp_n = warp / WM;
  const int head_size = p.head_size;
  constexpr bool kFp8 = is_fp8<C>::value;
  float qk_scale = p.scale;
  float v_scale = 1.f;
  if constexpr (kFp8) {
    qk_scale *= *p.k_scale;
    v_scale = *p.v_scale;
  }

  // Q tile -> shared memory (rows past `rows` and dims past head_size: zeros).
  {
    const T* query = static_cast<const T*>(p.query);
    const bool q_vec = reinterpret_cast<uintptr_t>(query) % 16 == 0 && p.q_token_stride % 8 == 0 &&
                       p.q_head_stride % 8 == 0;
    for (int i = tid; i < Cfg::kBM * Cfg::kChunks; i += Cfg::kThreads) {
      const int r = i / Cfg::kChunks, c = i % Cfg::kChunks;
      uint4 x = make_uint4(0, 0, 0, 0);
      if (r < rows && c * 8 < head_size) {
        const T* src = query + static_cast<int64_t>(tile.token(r)) * p.q_token_stride +
                       static_cast<int64_t>(tile.head(r)) * p.q_head_stride + c * 8;
        if (q_vec) {
          x = *reinterpret_cast<const uint4*>(src);
        } else {
          uint16_t e[8];
          for (int j = 0; j < 8; ++j) e[j] = reinterpret_cast<const uint16_t*>(src)[j];
          x.x = e[0] | (uint32_t(e[1]) << 16), x.y = e[2] | (uint32_t(e[3]) << 16);
          x.z = e[4] | (uint32_t(e[5]) << 16), x.w = e[6] | (uint32_t(e[7]) << 16);
        }
      }
      *reinterpret_cast<uint4*>(q_smem + r * kStride + c * 8) = x;
    }
  }

  // K/V tile gather: thread tid copies chunk tid % kChunks (8 elements) of rows tid / kChunks +
  // pass * kRowsPerPass; both caches seen from this kv head and that chunk. 16-bit caches: by
  // cp.async (stage); fp8 caches: 8-byte loads into registers one tile ahead (fetch), dequantized
  // into shared memory after the current tile's math (store); head 256: at the tile's start.
  constexpr int kPasses = BN / Cfg::kRowsPerPass;
  // Head 256 has no registers left for a tile in flight: it loads and stores at the tile's start.
  constexpr bool kPrefetch = kFp8 && HEAD <= 128;
  const int my_chunk = tid % Cfg::kChunks;
  const int my_row = tid / Cfg::kChunks;
  const bool chunk_in = my_chunk * 8 < head_size;
  const KVRows<C> kv(p, tile.seq, kv_head, my_chunk * 8);
  uint2 k_next[kPrefetch ? kPasses : 1], v_next[kPrefetch ? kPasses : 1];
  auto fetch = [&](int key0) {
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int t = key0 + my_row + pass * Cfg::kRowsPerPass;
      k_next[pass] = v_next[pass] = make_uint2(0, 0);
      if (t < part_end && chunk_in) {
        uint32_t blk, off;
        kv.locate(t, blk, off);
        k_next[pass] = load_ro(reinterpret_cast<const uint2*>(kv.k_row(kv.k_offset(blk, off))), "kv");
        v_next[pass] = load_ro(reinterpret_cast<const uint2*>(kv.v_row(kv.v_offset(blk, off))), "kv");
      }
    }
  };
  auto store = [&](int buf) {
    T* kd = k_smem + buf * Cfg::kKVElems + my_row * kStride + my_chunk * 8;
    T* vd = v_smem + buf * Cfg::kKVElems + my_row * kStride + my_chunk * 8;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      *reinterpret_cast<uint4*>(kd + pass * Cfg::kRowsPerPass * kStride) =
          dequantize8<T, C>(k_next[pass]);
      *reinterpret_cast<uint4*>(vd + pass * Cfg::kRowsPerPass * kStride) =
          dequantize8<T, C>(v_next[pass]);
    }
  };
  auto load_store = [&](int buf, int key0) {  // fetch + store, one pass at a time
    T* kd = k_smem + buf * Cfg::kKVElems + my_row * kStride + my_chunk * 8;
    T* vd = v_smem + buf * Cfg::kKVElems + my_row * kStride + my_chunk * 8;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int t = key0 + my_row + pass * Cfg::kRowsPerPass;
      uint2 kr = make_uint2(0, 0), vr = make_uint2(0, 0);
      if (t < part_end && chunk_in) {
        uint32_t blk, off;
        kv.locate(t, blk, off);
        kr = load_ro(reinterpret_cast<const uint2*>(kv.k_row(kv.k_offset(blk, off))), "kv");
        vr = load_ro(reinterpret_cast<const uint2*>(kv.v_row(kv.v_offset(blk, off))), "kv");
      }
      *reinterpret_cast<uint4*>(kd + pass * Cfg::kRowsPerPass * kStride) = dequantize8<T, C>(kr);
      *reinterpret_cast<uint4*>(vd + pass * Cfg::kRowsPerPass * kStride) = dequantize8<T, C>(vr);
    }
  };
  auto stage = [&](int buf, int key0) {
    T* kd = k_smem + buf * Cfg::kKVElems + my_row * kStride + my_chunk * 8;
    T* vd = v_smem + buf * Cfg::kKVElems + my_row * kStride + my_chunk * 8;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int t = key0 + my_row + pass * Cfg::kRowsPerPass;
      const C* ks = kv.k_row(0);
      const C* vs = kv.v_row(0);
      int bytes = 0;
      if (t < part_end && chunk_in) {
        uint32_t blk, off;
        kv.locate(t, blk, off);
        ks = kv.k_row(kv.k_offset(blk, off));
        vs = kv.v_row(kv.v_offset(blk, off));
        bytes = 16;
      }
      note_read(ks, bytes, "kv");
      tc::cp_async_16(kd + pass * Cfg::kRowsPerPass * kStride, ks, bytes);
      note_read(vs, bytes, "kv");
      tc::cp_async_16(vd + pass * Cfg::kRowsPerPass * kStride, vs, bytes);
    }
  };

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
  const int k_steps = (head_size + 15) / 16;  // k16 steps of S = Q K^T
  const int d_tiles = head_size / 8;          // n8 tiles of O

  // Per row: running max m (log2 domain), row sums of P in fp32 (l, for the lse) and of P as
  // rounded for the MMA (lr, the output's normalizer); per lane until the end.
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, lr[2] = {0.f, 0.f};
  float o[HEAD / 8][4];
#pragma unroll
  for (int j = 0; j < HEAD / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;

  const int part_begin = tile.part_begin;
  const int n_tiles = part_end > part_begin ? (part_end - part_begin + BN - 1) / BN : 0;
  if (n_tiles > 0) {
    if constexpr (kPrefetch) {
      fetch(part_begin);
      store(0);
    } else if constexpr (!kFp8) {
      stage(0, part_begin);
      tc::cp_async_commit();
    }
  }
  for (int it = 0; it < n_tiles; ++it) {
    const int key0 = part_begin + it * BN;
    if constexpr (kPrefetch) {
      if (it + 1 < n_tiles) fetch(key0 + BN);  // in flight during this tile's math
    } else if constexpr (kFp8) {
      load_store(it & 1, key0);  // the buffer was last read two tiles ago, before the last barrier
    } else if (it + 1 < n_tiles) {
      stage((it + 1) & 1, key0 + BN);
      tc::cp_async_commit();
      tc::cp_async_wait<1>();
    } else {
      tc::cp_async_wait<0>();
    }
    __syncthreads();

    const T* ks = k_smem + (it & 1) * Cfg::kKVElems + warp_n * KW * kStride;
    const T* vs = v_smem + (it & 1) * Cfg::kKVElems + warp_n * KW * kStride;
    const T* qs = q_smem + warp_m * 16 * kStride;
    const int wkey0 = key0 + warp_n * KW;

    // S = Q K^T: [16][KW] per warp.
    float s[KW / 8][4];
#pragma unroll
    for (int j = 0; j < KW / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HEAD / 16; ++kk) {
      if (kk < k_steps) {
        uint32_t a[4];
        tc::ldmatrix_x4(a, qs + (lane % 16) * kStride + kk * 16 + (lane / 16) * 8);
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
    }

    // Scale, soft cap, ALiBi, masks (log2 domain); online softmax per row.
    uint32_t pa[KW / 16][4];  // P as A operands, one per k16 step of P V
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < KW / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int t = wkey0 + j * 8 + 2 * (lane % 4) + e;
          float x = s[j][2 * h + e] * qk_scale;
          if (soft_cap > 0.f) x = soft_cap * tanhf(x / soft_cap);
          if (alibi) x += slope[h] * static_cast<float>(t - pos[h]);
          const bool valid = t < part_end && t <= pos[h] && (window <= 0 || t > pos[h] - window);
          x = valid ? x * kLog2e : -INFINITY;
          s[j][2 * h + e] = x;
          mx = fmaxf(mx, x);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
      const float m_new = fmaxf(m[h], mx);
      const float base = safe_max(m_new);
      const float alpha = exp2f(m[h] - base);
      m[h] = m_new;
      l[h] *= alpha;
      lr[h] *= alpha;
#pragma unroll
      for (int d = 0; d < HEAD / 8; ++d) {
        o[d][2 * h] *= alpha;
        o[d][2 * h + 1] *= alpha;
      }
#pragma unroll
      for (int j = 0; j < KW / 8; ++j) {
        const float e0 = exp2f(s[j][2 * h] - base), e1 = exp2f(s[j][2 * h + 1] - base);
        const T p0 = from_float<T>(e0), p1 = from_float<T>(e1);
        l[h] += e0 + e1;
        lr[h] += to_float(p0) + to_float(p1);
        // A fragment of k16 step j / 2: a0 (row, keys 0..7) a1 (row + 8, keys 0..7),
        // a2 (row, keys 8..15), a3 (row + 8, keys 8..15).
        pa[j / 2][(j % 2) * 2 + h] = pack2<T>(p0, p1);
      }
    }

    // O += P V.
#pragma unroll
    for (int kk = 0; kk < KW / 16; ++kk) {
#pragma unroll
      for (int d = 0; d < HEAD / 8; d += 2) {
        if (d < d_tiles) {
          uint32_t b[4];
          tc::ldmatrix_x4_trans(b, vs + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * kStride +
                                       d * 8 + (lane / 16) * 8);
          const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
          tc::mma_m16n8k16<T>(o[d], pa[kk], b0, o[d]);
          tc::mma_m16n8k16<T>(o[d + 1], pa[kk], b1, o[d + 1]);
        }
      }
    }
    if constexpr (kPrefetch) {
      // The other buffer was last read in the previous tile, before this tile's barrier.
      if (it + 1 < n_tiles) store((it + 1) & 1);
    } else if constexpr (!kFp8) {
      __syncthreads();  // this buffer is staged again two tiles on
    }
  }

  // Row sums across the quad.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(kFullMask, l[h], 1);
    l[h] += __shfl_xor_sync(kFullMask, l[h], 2);
    lr[h] += __shfl_xor_sync(kFullMask, lr[h], 1);
    lr[h] += __shfl_xor_sync(kFullMask, lr[h], 2);
  }

  if constexpr (WN == 1) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp_m * 16 + lane / 4 + 8 * h;
      if (r < rows) {
        const float inv = lr[h] > 0.f ? __frcp_rn(lr[h]) : 0.f;
        const OutRow<T> dst(p, plan, tile.token(r), tile.head(r), tile.part);
#pragma unroll
        for (int d = 0; d < HEAD / 8; ++d) {
          if (d < d_tiles) {
            dst.put(d * 8 + 2 * (lane % 4), o[d][2 * h] * inv * v_scale);
            dst.put(d * 8 + 2 * (lane % 4) + 1, o[d][2 * h + 1] * inv * v_scale);
          }
        }
        if (lane % 4 == 0) dst.put_lse(l[h] > 0.f ? (m[h] + log2f(l[h])) * kLn2 : -INFINITY);
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
        lr_smem[warp * 16 + r] = lr[h];
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
      const float inv = (sum_r > 0.f ? __frcp_rn(sum_r) : 0.f) * v_scale;
      const OutRow<T> dst(p, plan, tile.token(r), tile.head(r), tile.part);
      dst.put(d, o0 * inv);
      dst.put(d + 1, o1 * inv);
      if (d == 0) dst.put_lse(sum > 0.f ? (m_all + log2f(sum)) * kLn2 : -INFINITY);
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
    return with_padded_head(p.head_size, [&]<int HEAD>() {
      return paged_attention_tc_head<T, C, HEAD>(p, plan, stream);
    });
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
