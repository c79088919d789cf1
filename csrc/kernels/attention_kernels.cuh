// Paged attention: the GQA-aware decode / varlen kernel with split-K and its launchers (the
// split-K reduce and merge_attn_states are in attention_merge.cuh, cache chunk loads in
// attention_chunks.cuh).
//
// One thread block per (row tile, context partition, sequence, kv head). A row is one (query token,
// query head) pair of the kv head's group; a tile holds up to kRows rows, so in decode one block
// computes every query head of the group and each K/V element is read from memory once. The block
// streams its partition's tokens: each token row is split into 8-element chunks, one per lane of a
// lane group; K and V chunks arrive as 16-byte loads (8 bytes for fp8 and int8, 4 for int4),
// S = QK^T is reduced across the group with shuffles, and every lane group keeps its own online
// softmax state (m, l, acc) in fp32, merged across groups and warps at the end (the math of
// merge_attn_states). Caches quantized per (token, head) take each row's scale beside it
// (kRowScales).
//
// With several partitions each block writes a normalized partial output and its log-sum-exp to a
// workspace and the reduce kernel merges them.
//
// Templates only: csrc/cuda/attention_*.cu (nvcc) and csrc/simt_backend/attention_*.cpp (emulator)
// instantiate them with PAGEDKV_INSTANTIATE_ATTENTION, one query dtype per translation unit so that
// the instantiations compile in parallel; attention_dispatch.cuh picks among them at run time.
#pragma once
#include "kernels/compat.cuh"
#include "kernels/attention_chunks.cuh"
#include "kernels/attention_launch.h"
#include "kernels/attention_merge.cuh"
#include "kernels/attention_tile.cuh"
#include "kernels/dtypes.cuh"

namespace pagedkv {
namespace PAGEDKV_KERNEL_NS {
namespace attn {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = kAttnRowsPerBlock;  // (query token, query head) rows per block

// How a warp covers token rows of up to HEAD dims (HEAD = 64, 128, 256 or 512: every head size
// is run by the smallest of these that holds it): kLanes lanes per token, kChunks 8-element
// chunks each, side by side (chunks past head_size / 8 idle), kGroups tokens side by side per
// load. Up to 256 a lane has one chunk; at 512 the warp is one token, two chunks a lane.
template <int HEAD>
struct Layout {
  static constexpr int kLanes = HEAD / kChunkElems <= 8 ? 8 : std::min(HEAD / kChunkElems, 32);
  static constexpr int kChunks = HEAD / kChunkElems / kLanes < 1 ? 1 : HEAD / kChunkElems / kLanes;
  static constexpr int kLaneElems = kChunks * kChunkElems;  // head dims of one lane
  static constexpr int kGroups = 32 / kLanes;
  static_assert(HEAD == 64 || HEAD == 128 || HEAD == 256 || HEAD == 512, "padded head size");
};

// Tokens each lane group loads per iteration: 4 (8 loads of K+V in flight per lane, 16 bytes
// each), 8 for fp8 (16 loads of 8 bytes: the per-iteration work spread over as many bytes), 2 for
// fp32, divided by the lane's chunks (so the loads in flight stay the same; fp8 at 512 by twice
// that, or ptxas spills its conversions); and the resident
// blocks per SM the register budget is cut for: 3 (168 registers), which keeps each K/V chunk
// converted once (at 128 the compiler converts V again for every row) and still holds ~48 KB of
// loads in flight per SM.
template <typename C, int HEAD>
struct TokensPerGroup {
  static constexpr int value = std::max(
      1, (sizeof(C) == 4 ? 2 : (sizeof(C) == 1 ? 8 : 4)) / Layout<HEAD>::kChunks /
             (sizeof(C) == 1 && Layout<HEAD>::kChunks > 1 ? 2 : 1));  // fp8 at 512: 2, no spill
  static constexpr int kMinBlocksPerSm = 3;
};

// Online softmax state of one row, log2 domain: m = running max, l = running sum.
// Merges (m_o, l_o, acc_o) into (m, l, acc); returns the two rescale factors.
__device__ __forceinline__ void merge_scales(float& m, float& l, float m_o, float l_o, float& a,
                                             float& b) {
  const float m_new = fmaxf(m, m_o);
  const float base = safe_max(m_new);
  a = exp2f(m - base);
  b = exp2f(m_o - base);
  l = l * a + l_o * b;
  m = m_new;
}

// Shared memory of the decode kernel: scaled queries, then (reused) the per-warp partial outputs.
template <int HEAD>
struct DecodeSmem {
  static constexpr int kQueryFloats = kRows * HEAD;
  static constexpr int kWarpFloats = kWarps * kRows * HEAD;
  static constexpr int kFloats = kWarpFloats + 2 * kWarps * kRows;
  static constexpr size_t kBytes = kFloats * sizeof(float);
  static_assert(kQueryFloats <= kWarpFloats, "query tile must fit the reduction buffer");
};

// grid: (row_tiles * num_parts, num_seqs, num_kv_heads), block: kThreads,
// dynamic smem: DecodeSmem<HEAD>::kBytes. p.head_size <= HEAD.
// kRowScales: a cache quantized per (token, head) (int8, int4, fp8 with p.key_scales): each key's
// scale multiplies its score after the dot product, each value's its probability in P V (the
// softmax's sum l stays unscaled); T is then AnyQuery.
template <typename T, typename C, int HEAD, bool kRowScales = false>
__global__ void __launch_bounds__(kThreads, TokensPerGroup<C, HEAD>::kMinBlocksPerSm)
    paged_attention_kernel(const PagedAttentionParams p, const AttentionPlan plan) {
  using L = Layout<HEAD>;
  constexpr int U = TokensPerGroup<C, HEAD>::value;
  constexpr int NC = L::kChunks, LE = L::kLaneElems;
  PAGEDKV_DYNAMIC_SMEM(float, smem);
  float* q_smem = smem;                               // [kRows][HEAD], reused below
  float* acc_smem = smem;                             // [kWarps][kRows][HEAD]
  float* m_smem = smem + DecodeSmem<HEAD>::kWarpFloats;  // [kWarps][kRows]
  float* l_smem = m_smem + kWarps * kRows;               // [kWarps][kRows]
  // Per row: query token and head, exclusive causal key bound (query position + 1), ALiBi slope.
  __shared__ int row_token[kRows], row_head[kRows], row_end[kRows];
  __shared__ float row_slope[kRows];

  const AttentionTile tile(p, plan, kRows);
  const int rows = tile.rows;
  if (rows <= 0) return;  // the whole block: no barrier skipped
  const int part_begin = tile.part_begin, part_end = tile.part_end;
  const int kv_head = tile.kv_head;

  const int tid = threadIdx.x;
  const int head_size = p.head_size;
  float qk_scale = p.scale * kLog2e;  // scores in the log2 domain straight from the dot product
  float v_scale = 1.f;
  if constexpr (is_fp8<C>::value && !kRowScales) {  // per-tensor scales
    qk_scale *= *p.k_scale;
    v_scale = *p.v_scale;
  }
  if (tid < kRows) {
    row_token[tid] = tile.token(tid);
    row_head[tid] = tile.head(tid);
    row_end[tid] = tid < rows ? tile.pos(tid) + 1 : 0;
    row_slope[tid] = p.alibi_slopes != nullptr && tid < rows ? p.alibi_slopes[row_head[tid]] : 0.f;
  }
  for (int i = tid; i < kRows * HEAD; i += kThreads) {
    const int r = i / HEAD, d = i % HEAD;
    float x = 0.f;
    if (r < rows && d < head_size) x = query_elem<T>(p, tile.token(r), tile.head(r), d) * qk_scale;
    q_smem[i] = x;
  }
  __syncthreads();

  const int warp = tid / 32, lane = tid % 32;
  const int group = lane / L::kLanes;
  const int chunk = lane % L::kLanes;
  // Chunk c of the lane holds dims dim0 + 8c ..; it is read when within head_size.
  const bool lane_active = chunk * NC < head_size / kChunkElems;
  const int dim0 = lane_active ? chunk * LE : 0;
  bool chunk_active[NC];
#pragma unroll
  for (int c = 0; c < NC; ++c) chunk_active[c] = dim0 + c * kChunkElems < head_size && lane_active;

  const bool alibi = p.alibi_slopes != nullptr;
  const int window = p.sliding_window;
  // Soft cap in the log2 domain: cap' * tanh(x / cap') with cap' = cap * log2(e), by a
  // reciprocal computed once; ALiBi slopes likewise times log2(e).
  const float soft_cap = p.soft_cap * kLog2e;
  const float inv_soft_cap = soft_cap > 0.f ? 1.f / soft_cap : 0.f;

  float m[kRows], l[kRows], acc[kRows][LE];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int d = 0; d < LE; ++d) acc[r][d] = 0.f;
  }

  // The caches seen from this kv head and this lane's chunk: rows are then one offset away,
  // computed once per token for K and V when their strides agree.
  const KVRows<C> kv(p, tile.seq, kv_head, dim0);
  [[maybe_unused]] const RowScales row_scales(p, kv_head);
  const bool vec = plan.vectorized;
  const bool kv_same = kv.same_strides();
  // Token of load u of this lane group in the iteration starting at `base`.
  auto token_of = [&](int base, int u) { return base + (warp * U + u) * L::kGroups + group; };
  constexpr int kStep = kWarps * L::kGroups * U;  // tokens per block iteration

  int phys[U], slot[U];  // physical block (-1: nothing to load) and offset in it of each token
  auto locate = [&](int base) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = token_of(base, u);
      int blk, off;
      kv.div.divmod(t, blk, off);
      phys[u] = t < part_end && lane_active ? load_ro(kv.table + blk, "table") : -1;  // predicated
      slot[u] = off;
    }
  };
  locate(part_begin);
  // kRowScales: lane `chunk` < U of each lane group holds the K and V scales of the group's token
  // `chunk` of the iteration, located by itself (so also in lanes past head_size), and shuffles
  // them to its group where they are used: two scale registers a lane instead of 2U.
  static_assert(!kRowScales || U <= L::kLanes, "a lane group holds a scale per token");
  [[maybe_unused]] int scale_phys = -1, scale_slot = 0;
  auto locate_scales = [&](int base) {
    if constexpr (kRowScales) {
      const int t = token_of(base, chunk);
      int blk, off;
      kv.div.divmod(t, blk, off);
      scale_phys = chunk < U && t < part_end ? load_ro(kv.table + blk, "table") : -1;
      scale_slot = off;
    }
  };
  locate_scales(part_begin);

  // One block iteration: U tokens per lane group. kMasked: the general body (soft cap, ALiBi,
  // the causal / window / partition masks); otherwise every token of the iteration is valid for
  // every row and no feature is on, and none of that code runs.
  auto iteration = [&]<bool kMasked>(int base) {
    Chunk<C> kc[U][NC], vc[U][NC];
    [[maybe_unused]] float k_scale = 0.f, v_scale_row = 0.f;  // kRowScales: of this lane's token
    // Aligned caches take the vector loads, others the byte loads; K and V share the offset when
    // their strides agree: one uniform branch per iteration. Offsets in bytes, unsigned (phys >= 0):
    // one 32 x 32 -> 64-bit multiply-add per row.
    auto load_all = [&]<bool kVec, bool kSame>() {
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          kc[u][c] = zero_chunk<C>();
          vc[u][c] = zero_chunk<C>();
        }
        if (phys[u] >= 0) {
          const uint32_t blk = static_cast<uint32_t>(phys[u]), off = static_cast<uint32_t>(slot[u]);
          const uint64_t k_off = kv.k_offset(blk, off);
          const uint64_t v_off = kSame ? k_off : kv.v_offset(blk, off);
#pragma unroll
          for (int c = 0; c < NC; ++c) {
            if (c == 0 || chunk_active[c]) {
              kc[u][c] = load_chunk<kVec>(kv.k_row(k_off) + c * (kChunkElems / kUnitElems<C>));
              vc[u][c] = load_chunk<kVec>(kv.v_row(v_off) + c * (kChunkElems / kUnitElems<C>));
            }
          }
        }
      }
    };
    if (vec && kv_same) {
      load_all.template operator()<true, true>();
    } else if (vec) {
      load_all.template operator()<true, false>();
    } else {
      load_all.template operator()<false, false>();
    }
    if constexpr (kRowScales) {
      if (scale_phys >= 0) {
        const uint32_t blk = static_cast<uint32_t>(scale_phys);
        const uint32_t off = static_cast<uint32_t>(scale_slot);
        k_scale = row_scales.key(blk, off);
        v_scale_row = row_scales.value(blk, off);
      }
    }
    locate(base + kStep);  // next iteration's block table entries, while K/V are in flight
    locate_scales(base + kStep);

    // S = Q K^T for this group's U tokens: each K chunk converted once, for every row; q read
    // from shared memory per row (registers hold one row's 8 dims at a time).
    float s[U][kRows];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        float kf[kChunkElems];
        to_floats(kc[u][c], kf);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r == 0 || r < rows) {  // row 0 always exists: kf is converted there, once
            const float* q = q_smem + r * HEAD + dim0 + c * kChunkElems;
            const float4 qa = *reinterpret_cast<const float4*>(q);
            const float4 qb = *reinterpret_cast<const float4*>(q + 4);
            float dot = c == 0 ? qa.x * kf[0] : fmaf(qa.x, kf[0], s[u][r]);
            dot = fmaf(qa.y, kf[1], dot);
            dot = fmaf(qa.z, kf[2], dot);
            dot = fmaf(qa.w, kf[3], dot);
            dot = fmaf(qb.x, kf[4], dot);
            dot = fmaf(qb.y, kf[5], dot);
            dot = fmaf(qb.z, kf[6], dot);
            dot = fmaf(qb.w, kf[7], dot);
            s[u][r] = dot;
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r == 0 || r < rows) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
          for (int o = L::kLanes / 2; o > 0; o /= 2) s[u][r] += __shfl_xor_sync(kFullMask, s[u][r], o);
        }
      }
    }
    // Each token's score times its K row's scale (the dequantized key's dot product).
    if constexpr (kRowScales) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float scale = __shfl_sync(kFullMask, k_scale, u, L::kLanes);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r == 0 || r < rows) s[u][r] *= scale;
        }
      }
    }

    // Online softmax: the scores become probabilities in s.
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r == 0 || r < rows) {
        float m_new = m[r];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          float x = s[u][r];
          if constexpr (kMasked) {
            const int t = token_of(base, u);
            const int hi = row_end[r];
            if (soft_cap > 0.f) x = soft_cap * tanhf(x * inv_soft_cap);
            if (alibi) x += row_slope[r] * kLog2e * static_cast<float>(t - (hi - 1));
            const bool valid = t < part_end && t < hi && (window <= 0 || t >= hi - window);
            x = valid ? x : -INFINITY;
          }
          s[u][r] = x;
          m_new = fmaxf(m_new, x);
        }
        // Unmasked, every score is finite: so is the running max.
        const float base_m = kMasked ? safe_max(m_new) : m_new;
        const float alpha = fast_exp2(m[r] - base_m);
        m[r] = m_new;
        l[r] *= alpha;
#pragma unroll
        for (int d = 0; d < LE; ++d) acc[r][d] *= alpha;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          s[u][r] = fast_exp2(s[u][r] - base_m);
          l[r] += s[u][r];
        }
      }
    }
    // Each probability times its V row's scale, after l took it unscaled: P V over the
    // dequantized values.
    if constexpr (kRowScales) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float scale = __shfl_sync(kFullMask, v_scale_row, u, L::kLanes);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r == 0 || r < rows) s[u][r] *= scale;
        }
      }
    }
    // O += P V: each V chunk converted once, for every row.
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        float vf[kChunkElems];
        to_floats(vc[u][c], vf);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r == 0 || r < rows) {
#pragma unroll
            for (int d = 0; d < kChunkElems; ++d) {
              acc[r][c * kChunkElems + d] = fmaf(s[u][r], vf[d], acc[r][c * kChunkElems + d]);
            }
          }
        }
      }
    }
  };

  // Iterations whose tokens every row of the tile sees (below the first row's causal bound, at
  // or after the last row's window start) run without masks when no feature is on; the rest
  // (the last, partial iteration of a partition; all of them with soft cap or ALiBi) masked.
  int base = part_begin;
  const bool plain = p.soft_cap <= 0.f && !alibi;
  if (plain && base >= tile.unmasked_begin()) {
    const int plain_end = tile.unmasked_end();
    for (; base + kStep <= plain_end; base += kStep) iteration.template operator()<false>(base);
  }
  for (; base < part_end; base += kStep) iteration.template operator()<true>(base);

  // Merge the lane groups of each warp (lanes chunk, chunk + kLanes, ...).
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r < rows) {
#pragma unroll
      for (int o = L::kLanes; o < 32; o *= 2) {
        const float m_o = __shfl_xor_sync(kFullMask, m[r], o);
        const float l_o = __shfl_xor_sync(kFullMask, l[r], o);
        float a, b;
        merge_scales(m[r], l[r], m_o, l_o, a, b);
#pragma unroll
        for (int d = 0; d < LE; ++d) {
          const float acc_o = __shfl_xor_sync(kFullMask, acc[r][d], o);
          acc[r][d] = acc[r][d] * a + acc_o * b;
        }
      }
    }
  }
  __syncthreads();  // q_smem is dead: reuse it for the per-warp partials
  if (group == 0 && lane_active) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int d = 0; d < LE; ++d) {
        if (d < kChunkElems || chunk_active[d / kChunkElems])
          acc_smem[(warp * kRows + r) * HEAD + dim0 + d] = r < rows ? acc[r][d] : 0.f;
      }
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      m_smem[warp * kRows + r] = r < rows ? m[r] : -INFINITY;
      l_smem[warp * kRows + r] = r < rows ? l[r] : 0.f;
    }
  }
  __syncthreads();

  // Merge the warps; write the output (one partition) or the partial (several).
  for (int i = tid; i < rows * head_size; i += kThreads) {
    const int r = i / head_size, d = i % head_size;
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, m_smem[w * kRows + r]);
    const float base_m = safe_max(m_all);
    float o = 0.f, sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float wt = exp2f(m_smem[w * kRows + r] - base_m);
      o += wt * acc_smem[(w * kRows + r) * HEAD + d];
      sum += wt * l_smem[w * kRows + r];
    }
    o = counts(sum) ? o / sum * v_scale : 0.f;
    const float lse = counts(sum) ? (m_all + log2f(sum)) * kLn2 : -INFINITY;
    put_result<T>(p, plan, row_token[r], row_head[r], tile.part, lse, d, o);
  }
}

template <typename T, typename C, int HEAD>
cudaError_t launch_paged_attention(const PagedAttentionParams& p, const AttentionPlan& plan,
                                   cudaStream_t stream) {
  return launch_attention<T>(paged_attention_kernel<T, C, HEAD>, kThreads,
                             DecodeSmem<HEAD>::kBytes, p, plan, stream);
}

// A cache quantized per (token, head) of element type C (int8_t, int4x2, fp8 with row scales):
// the row-scaled kernel of each head size, one for every query dtype (AnyQuery), then the
// split-K reduce of p.dtype's.
template <typename C>
cudaError_t paged_attention_row_scaled_typed(const PagedAttentionParams& p,
                                             const AttentionPlan& plan, cudaStream_t stream) {
  return with_padded_head(p.head_size, [&]<int HEAD>() {
    auto kernel = paged_attention_kernel<AnyQuery, C, HEAD, true>;
    constexpr size_t smem = DecodeSmem<HEAD>::kBytes;
    switch (p.dtype) {
      case DType::kFloat32: return launch_attention<float>(kernel, kThreads, smem, p, plan, stream);
      case DType::kFloat16: return launch_attention<__half>(kernel, kThreads, smem, p, plan, stream);
      case DType::kBFloat16:
        return launch_attention<__nv_bfloat16>(kernel, kThreads, smem, p, plan, stream);
      default: return cudaErrorInvalidValue;
    }
  });
}

template <typename T>
cudaError_t launch_merge_attn_states(const MergeAttnParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(p.num_heads));
  auto kernel = merge_attn_states_kernel<T>;
  PAGEDKV_LAUNCH(kernel, grid, kMergeThreads, 0, stream)(p);
  return cudaGetLastError();
}

// Cache dtype and head size to template arguments; the query dtype T is fixed per translation
// unit (see PAGEDKV_INSTANTIATE_ATTENTION).
template <typename T>
cudaError_t paged_attention_typed(const PagedAttentionParams& p, const AttentionPlan& plan,
                                  cudaStream_t stream) {
  return with_cache_type<T>(p.cache_dtype, [&]<typename C>() {
    return with_padded_head(p.head_size, [&]<int HEAD>() {
      return launch_paged_attention<T, C, HEAD>(p, plan, stream);
    });
  });
}

}  // namespace attn
}  // namespace PAGEDKV_KERNEL_NS
}  // namespace pagedkv

// Explicit instantiation of every kernel of query dtype T, in namespace pagedkv::<backend>::attn.
#define PAGEDKV_INSTANTIATE_ATTENTION(T)                                                       \
  namespace pagedkv::PAGEDKV_KERNEL_NS::attn {                                                 \
  template cudaError_t paged_attention_typed<T>(const PagedAttentionParams&,                   \
                                                const AttentionPlan&, cudaStream_t);           \
  template cudaError_t launch_merge_attn_states<T>(const MergeAttnParams&, cudaStream_t);      \
  }

// Explicit instantiation of the row-scaled kernels of cache element type C (every query dtype).
#define PAGEDKV_INSTANTIATE_ATTENTION_ROW_SCALED(C)                                             \
  namespace pagedkv::PAGEDKV_KERNEL_NS::attn {                                                 \
  template cudaError_t paged_attention_row_scaled_typed<C>(const PagedAttentionParams&,        \
                                                           const AttentionPlan&, cudaStream_t); \
  }
