// Absorbed MLA attention (mla_attention: DeepSeek-V2/V3, Kimi-K2) on tensor cores, mma.sync
// m16n8k16 with fp32 accumulate, float16 / bfloat16 queries, sm_80+, on the tensor-core
// kernel's frame (attention_tc.cuh: AttentionTile, the query staging, cp.async double buffer,
// row offsets located two tiles ahead, fp8 dequantization, online softmax in the log2 domain,
// the two row sums, OutRow and the split-K reduce). The host side is attention_mla_launch.h;
// docs/cuda_attention.md ("MLA kernel") describes it.
//
// Rows: every head attends the same latent rows (one kv head), so a block's rows are (query
// token, head) pairs of one sequence, row r = token r / heads, head r % heads: the heads fill the
// MMA's M. A key's latent row [kv_c, k_pe] (DK = DV + 64 padded elements) is staged once per key
// tile of BN = 32 keys into shared memory and serves both products: S = Q K^T over all DK
// columns, O += P V over its first DV (V is the same shared tile): each latent byte is read from
// global memory once per row tile.
//
// Register plan: a 16-row slice's O of DV = 512 fp32 columns would be 256 registers a thread. Two
// warps share each slice (FlashMLA's split across warp groups): warp `side` computes S for keys
// [16 side, 16 side + 16) of the tile, the pair exchanges its row maxima through shared memory
// (both warps then hold the same running max), each writes its P (rounded to T) to a shared
// [rows][BN] tile, and each accumulates O for its own DV / 2 columns over all BN keys from that
// P: 128 registers of O at DV = 512. The fp32 row sums of the two key halves are added at the
// end; the rounded row sum (P x ones, one MMA per k16 step) is computed by both warps from the
// whole P. WM slices of 16 rows: WM = 1 (decode up to 16 rows, 2 warps) or 4 (64 rows, 8 warps).
//
// Templates only: csrc/cuda/attention_mla_*.cu (nvcc) and csrc/simt_backend/attention_mla_*.cpp
// (emulator) instantiate them per query dtype (PAGEDKV_INSTANTIATE_MLA_ATTENTION).
#pragma once
#include "kernels/compat.cuh"
#include "kernels/attention_merge.cuh"
#include "kernels/attention_mla_launch.h"
#include "kernels/attention_tc_tile.cuh"
#include "kernels/attention_tile.cuh"
#include "kernels/dtypes.cuh"
#include "kernels/memory.cuh"
#include "kernels/tensor_core.cuh"

namespace pagedkv {
namespace PAGEDKV_KERNEL_NS {
namespace attn_mla {

using attn::AttentionTile;
using attn::counts;
using attn::kFullMask;
using attn::kLn2;
using attn::kLog2e;
using attn::OutRow;
using attn::safe_max;
using attn_tc::dequantize8;
using attn_tc::pack2;

template <int DV, int WM>
struct MlaConfig {
  static constexpr int kBN = kMlaKeys;                // keys per tile
  static constexpr int kWidth = DV + kMlaPaddedRope;  // padded row: S's k dimension
  static constexpr int kWarps = 2 * WM;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBM = 16 * WM;           // rows per block
  static constexpr int kHalfKeys = kBN / 2;     // S keys per warp
  static constexpr int kHalfCols = DV / 2;      // O columns per warp
  static constexpr int kStride = kWidth + 8;    // shared row stride in elements (+16 bytes)
  static constexpr int kChunks = kWidth / 8;    // 16-byte chunks per row
  static constexpr int kCopies = kBN * kChunks / kThreads;  // chunks per thread and tile
  static constexpr int kPStride = kBN + 8;
  static constexpr int kQElems = kBM * kStride;
  static constexpr int kTileElems = kBN * kStride;
  static constexpr int kPElems = kBM * kPStride;
  static constexpr size_t kBytes = (kQElems + 2 * kTileElems + kPElems) * 2 + 2 * kBM * 4;
  static_assert(kBN * kChunks % kThreads == 0, "whole copy passes");
  static_assert(kHalfKeys == 16 && kHalfCols % 16 == 0, "one k16 step of S keys, x4 V loads");
  static_assert(kBN <= kThreads, "one thread locates each key's row");
  static_assert(kBytes == mla_smem_bytes(DV, kBM), "the host's figure (attention_mla_launch.h)");
};

// The latent copies of one thread: chunk (tid + i * kThreads) of the tile's kBN x kChunks, i <
// kCopies. 16-bit caches by cp.async one tile ahead of the math; fp8 by 8-byte loads dequantized
// into shared memory at the tile's start (no registers for a tile in flight beside O). Row offsets
// are located two tiles ahead, one thread per key (the block-table entry read once per key).
template <typename T, typename C, typename Cfg>
struct MlaCopy {
  static constexpr int kBN = Cfg::kBN;
  static constexpr bool kFp8 = is_fp8<C>::value;
  T* tiles;
  uint64_t (*row_off)[kBN];
  attn::KVRows<C, attn::MagicDiv> kv;
  int part_end, width;

  __device__ __forceinline__ MlaCopy(const PagedAttentionParams& p, const AttentionTile& tile,
                                     T* tiles_, uint64_t (*offsets)[kBN])
      : tiles(tiles_), row_off(offsets), kv(p, tile.seq, 0, 0), part_end(tile.part_end),
        width(p.head_size) {}

  __device__ __forceinline__ void locate_rows(int buf, int key0) const {
    if (threadIdx.x < kBN) {
      const int t = key0 + static_cast<int>(threadIdx.x);
      uint64_t x = 0;
      if (t < part_end) {
        uint32_t blk, off;
        kv.locate(t, blk, off);
        x = kv.k_offset(blk, off);
      }
      row_off[buf][threadIdx.x] = x;
    }
  }
  // The tile at key0 (located into buffer buf) into buffer buf: rows past the partition and
  // chunks past the row's width zero-filled.
  __device__ __forceinline__ void copy(int buf, int key0) const {
    T* dst = tiles + buf * Cfg::kTileElems;
    const int left = part_end - key0;
    // Unrolled by up to 9 copies (a 64-row tile's whole share): the 36 of a 16-row tile at rank
    // 512, all unrolled, held their addresses in registers beside O and spilled.
#pragma unroll(Cfg::kCopies < 9 ? Cfg::kCopies : 9)
    for (int i = 0; i < Cfg::kCopies; ++i) {
      const int idx = static_cast<int>(threadIdx.x) + i * Cfg::kThreads;
      const int r = idx / Cfg::kChunks, c = idx % Cfg::kChunks;
      const bool in = r < left && c * 8 < width;
      const C* src = kv.k_row(row_off[buf][r]) + c * 8;
      T* to = dst + r * Cfg::kStride + c * 8;
      if constexpr (kFp8) {
        uint2 raw = make_uint2(0, 0);
        if (in) raw = load_ro(reinterpret_cast<const uint2*>(src), "kv");
        *reinterpret_cast<uint4*>(to) = dequantize8<T, C>(raw);
      } else {
        note_read(src, in ? 16 : 0, "kv");
        tc::cp_async_16(to, src, in ? 16 : 0);
      }
    }
  }
  // The pipeline, as TcCopy's: the first two tiles located before the first barrier, tile 0
  // staged after it; before tile it's barrier the next one staged (16-bit) or this one loaded
  // (fp8); after it, tile it + 2 located into the offsets tile it's copy read.
  __device__ __forceinline__ void prologue(int part_begin) const {
    locate_rows(0, part_begin);
    locate_rows(1, part_begin + kBN);
  }
  __device__ __forceinline__ void start(int part_begin) const {
    if constexpr (!kFp8) {
      copy(0, part_begin);
      tc::cp_async_commit();
    }
  }
  __device__ __forceinline__ void before_tile(int it, int key0, int n) const {
    if constexpr (kFp8) {
      copy(it & 1, key0);
    } else if (it + 1 < n) {
      copy((it + 1) & 1, key0 + kBN);
      tc::cp_async_commit();
      tc::cp_async_wait<1>();
    } else {
      tc::cp_async_wait<0>();
    }
  }
  __device__ __forceinline__ void after_barrier(int it, int key0, int n) const {
    if (it + 2 < n) locate_rows(it & 1, key0 + 2 * kBN);
  }
};

// grid: (row_tiles * num_parts, num_seqs, 1), block: MlaConfig::kThreads, dynamic smem:
// MlaConfig::kBytes. T: the query and out dtype (16-bit); C: the cache's, T or fp8;
// p.head_size_v <= DV, p.head_size <= DV + kMlaPaddedRope.
template <typename T, typename C, int DV, int WM>
__global__ void __launch_bounds__(64 * WM, 1)
    mla_attention_tc_kernel(const PagedAttentionParams p, const AttentionPlan plan) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // no mma.sync m16n8k16 / cp.async: the glue never launches it here
#else
  using Cfg = MlaConfig<DV, WM>;
  constexpr int kBN = Cfg::kBN, kStride = Cfg::kStride, kBM = Cfg::kBM;
  PAGEDKV_DYNAMIC_SMEM(T, mla_smem);
  __shared__ uint64_t row_off[2][kBN];
  static_assert(sizeof(row_off) == kMlaStaticSmem, "the host's figure");
  T* q_smem = mla_smem;                          // [kBM][kStride]
  T* kv_smem = q_smem + Cfg::kQElems;            // [2][kBN][kStride]
  T* p_smem = kv_smem + 2 * Cfg::kTileElems;     // [kBM][kPStride]
  float* red = reinterpret_cast<float*>(p_smem + Cfg::kPElems);  // [2][kBM]

  const AttentionTile tile(p, plan, kBM);
  const int rows = tile.rows;
  if (rows <= 0) return;  // the whole block: no barrier skipped
  const int part_begin = tile.part_begin, part_end = tile.part_end;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int warp_m = warp % WM, side = warp / WM;  // side: the pair's key half and O half
  float qk_scale = p.scale, v_scale = 1.f;
  if constexpr (is_fp8<C>::value) {
    qk_scale *= *p.k_scale;
    v_scale = *p.v_scale;
  }
  const float qk_scale_log2 = qk_scale * kLog2e;

  attn_tc::stage_query<T, kBM, Cfg::kChunks, kStride, Cfg::kThreads>(p, tile, p.head_size,
                                                                      q_smem);
  MlaCopy<T, C, Cfg> copy(p, tile, kv_smem, row_off);

  // This thread's two rows of its slice (lane / 4 and lane / 4 + 8 of 16): index in the block
  // and query position (-1: no row, everything masked).
  int row[2], pos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row[h] = warp_m * 16 + lane / 4 + 8 * h;
    pos[h] = row[h] < rows ? tile.pos(row[h]) : -1;
  }
  // Running max (log2 domain, the same in both warps of a slice), fp32 row sum of this warp's
  // keys, rounded row sums of all keys (P x ones: lr[0] row 0, lr[2] row 1), O of its columns.
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float lr[4] = {0.f, 0.f, 0.f, 0.f};
  const uint32_t one2 = pack2<T>(from_float<T>(1.f), from_float<T>(1.f));
  const uint32_t ones[2] = {one2, one2};
  float o[Cfg::kHalfCols / 8][4];
#pragma unroll
  for (int j = 0; j < Cfg::kHalfCols / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;

  const int n_tiles = part_end > part_begin ? (part_end - part_begin + kBN - 1) / kBN : 0;
  if (n_tiles > 0) copy.prologue(part_begin);
  __syncthreads();  // Q and the first tiles' row offsets in shared memory
  if (n_tiles > 0) copy.start(part_begin);
  const T* qs = q_smem + warp_m * 16 * kStride;

  // One key tile's math (buffer buf, keys from key0); kMasked: causal and partition masks per
  // score, else every key is valid for every row and the scale goes into the exponent.
  auto tile_math = [&]<bool kMasked>(int buf, int key0) {
    const T* lat = kv_smem + buf * Cfg::kTileElems;
    const T* ks = lat + side * Cfg::kHalfKeys * kStride;
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < Cfg::kWidth / 16; ++kk) {
      uint32_t a[4], b[4];
      tc::ldmatrix_x4(a, qs + (lane % 16) * kStride + kk * 16 + (lane / 16) * 8);
      tc::ldmatrix_x4(b, ks + ((lane / 16) * 8 + lane % 8) * kStride + kk * 16 +
                             ((lane / 8) % 2) * 8);
      const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      tc::mma_m16n8k16<T>(s[0], a, b0, s[0]);
      tc::mma_m16n8k16<T>(s[1], a, b1, s[1]);
    }
    float mul = qk_scale_log2;
    if constexpr (kMasked) {
      mul = 1.f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int t = key0 + side * Cfg::kHalfKeys + j * 8 + 2 * (lane % 4) + e;
            const bool valid = t < part_end && t <= pos[h];
            s[j][2 * h + e] = valid ? s[j][2 * h + e] * qk_scale_log2 : -INFINITY;
          }
        }
      }
    }
    // Row maxima of this warp's keys to the pair, then the common running max.
    float mx[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(fmaxf(s[0][2 * h], s[0][2 * h + 1]), fmaxf(s[1][2 * h], s[1][2 * h + 1]));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(kFullMask, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(kFullMask, mx[h], 2));
      if (lane % 4 == 0) red[side * kBM + row[h]] = mx[h];
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // Unmasked, every score is finite: so is the running max.
      const float m_new = fmaxf(m[h], fmaxf(mx[h], red[(1 - side) * kBM + row[h]]) * mul);
      const float base = kMasked ? safe_max(m_new) : m_new;
      const float alpha = attn::fast_exp2(m[h] - base);
      m[h] = m_new;
      l[h] *= alpha;
      lr[2 * h] *= alpha;
#pragma unroll
      for (int d = 0; d < Cfg::kHalfCols / 8; ++d) {
        o[d][2 * h] *= alpha;
        o[d][2 * h + 1] *= alpha;
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float e0 = attn::fast_exp2(fmaf(s[j][2 * h], mul, -base));
        const float e1 = attn::fast_exp2(fmaf(s[j][2 * h + 1], mul, -base));
        l[h] += e0 + e1;
        const int col = side * Cfg::kHalfKeys + j * 8 + 2 * (lane % 4);
        *reinterpret_cast<uint32_t*>(p_smem + row[h] * Cfg::kPStride + col) =
            pack2<T>(from_float<T>(e0), from_float<T>(e1));
      }
    }
    __syncthreads();  // the slice's whole P in shared memory
    // O += P V over this warp's columns, V the tile's first DV columns.
    const T* vs = lat + side * Cfg::kHalfCols;
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      uint32_t pa[4];
      tc::ldmatrix_x4(pa, p_smem + (warp_m * 16 + lane % 16) * Cfg::kPStride + kk * 16 +
                              (lane / 16) * 8);
      tc::mma_m16n8k16<T>(lr, pa, ones, lr);
#pragma unroll
      for (int d = 0; d < Cfg::kHalfCols / 8; d += 2) {
        uint32_t b[4];
        tc::ldmatrix_x4_trans(b, vs + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * kStride +
                                     d * 8 + (lane / 16) * 8);
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        tc::mma_m16n8k16<T>(o[d], pa, b0, o[d]);
        tc::mma_m16n8k16<T>(o[d + 1], pa, b1, o[d + 1]);
      }
    }
  };

  auto key_tile = [&]<bool kMasked>(int it) {
    const int key0 = part_begin + it * kBN;
    copy.before_tile(it, key0, n_tiles);
    __syncthreads();
    copy.after_barrier(it, key0, n_tiles);
    tile_math.template operator()<kMasked>(it & 1, key0);
    __syncthreads();  // this buffer is copied into again two tiles on; P and red are rewritten
  };

  // Tiles every row sees whole run unmasked: [it_lo, it_hi); the causal diagonal and the
  // partition's end masked.
  int it_lo = n_tiles, it_hi = n_tiles;
  if (qk_scale > 0.f) {  // max(s) * scale is then the scaled max
    const int lo = tile.unmasked_begin() - part_begin, hi = tile.unmasked_end() - part_begin;
    it_lo = min(n_tiles, max(0, (lo + kBN - 1) / kBN));
    it_hi = max(it_lo, min(n_tiles, hi / kBN));
  }
  for (int it = 0; it < n_tiles;) {
    if (it >= it_lo && it < it_hi) {
      for (; it < it_hi; ++it) key_tile.template operator()<false>(it);
    } else {
      key_tile.template operator()<true>(it++);
    }
  }

  // fp32 row sums: across the quad, then the pair's two key halves.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(kFullMask, l[h], 1);
    l[h] += __shfl_xor_sync(kFullMask, l[h], 2);
    if (lane % 4 == 0) red[side * kBM + row[h]] = l[h];
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (row[h] >= rows) continue;
    const float sum = l[h] + red[(1 - side) * kBM + row[h]];
    const float inv = (counts(lr[2 * h]) ? __frcp_rn(lr[2 * h]) : 0.f) * v_scale;
    const float lse = counts(sum) ? (m[h] + log2f(sum)) * kLn2 : -INFINITY;
    const OutRow<T> dst(p, plan, tile.token(row[h]), tile.head(row[h]), tile.part, lse);
#pragma unroll
    for (int d = 0; d < Cfg::kHalfCols / 8; ++d) {
      const int col = side * Cfg::kHalfCols + d * 8 + 2 * (lane % 4);
      if (col < p.head_size_v) {
        dst.put(col, o[d][2 * h] * inv);
        dst.put(col + 1, o[d][2 * h + 1] * inv);
      }
    }
    if (side == 0 && lane % 4 == 0) dst.put_lse();
  }
#endif
}

template <typename T, typename C, int DV, int WM>
cudaError_t launch_mla_attention_tc(const PagedAttentionParams& p, const AttentionPlan& plan,
                                    cudaStream_t stream) {
  using Cfg = MlaConfig<DV, WM>;
  return attn::launch_attention<T>(mla_attention_tc_kernel<T, C, DV, WM>, Cfg::kThreads,
                                   Cfg::kBytes, p, plan, stream);
}

// Cache dtype, padded rank and configuration (the plan's rows per block) to template arguments.
template <typename T>
cudaError_t mla_attention_tc_typed(const PagedAttentionParams& p, const AttentionPlan& plan,
                                   cudaStream_t stream) {
  return with_cache_type<T>(p.cache_dtype, [&]<typename C>() -> cudaError_t {
    if (!is_fp8<C>::value && p.cache_dtype != p.dtype) return cudaErrorInvalidValue;
    auto with_rank = [&]<int DV>() {
      if (mla_plan_block_rows(p, plan) == kAttnTcPrefillRows) {
        return launch_mla_attention_tc<T, C, DV, kAttnTcPrefillRows / 16>(p, plan, stream);
      }
      return launch_mla_attention_tc<T, C, DV, kAttnTcDecodeRows / 16>(p, plan, stream);
    };
    switch (mla_padded_rank(p.head_size_v, p.head_size)) {
      case 64: return with_rank.template operator()<64>();
      case 512: return with_rank.template operator()<512>();
      default: return cudaErrorInvalidValue;
    }
  });
}

}  // namespace attn_mla
}  // namespace PAGEDKV_KERNEL_NS
}  // namespace pagedkv

// Explicit instantiation of the MLA kernels of query dtype T.
#define PAGEDKV_INSTANTIATE_MLA_ATTENTION(T)                                                  \
  namespace pagedkv::PAGEDKV_KERNEL_NS::attn_mla {                                            \
  template cudaError_t mla_attention_tc_typed<T>(const PagedAttentionParams&,                 \
                                                 const AttentionPlan&, cudaStream_t);         \
  }
