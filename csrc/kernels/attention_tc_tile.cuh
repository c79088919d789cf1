// The tensor-core attention kernel's tile (attention_tc.cuh): its configuration and shared
// memory, the operand packing, and the K/V copies from the paged caches into shared memory.
//
// Copies: thread tid copies chunk tid % kChunks (8 elements) of rows tid / kChunks + pass *
// kRowsPerPass of a key tile. 16-bit caches go by cp.async, one tile ahead of the math (stage),
// from row offsets that one thread per key found two tiles ahead (locate_rows: the block-table
// entry read once per key and tile, not per chunk; MagicDiv, no division in the loop); fp8
// caches by 8-byte loads into registers one tile ahead (fetch), dequantized into shared memory
// after the current tile's math (store), or for head 256, which has no registers for a tile in
// flight, both at the tile's start (load_store). Caches quantized per (token, head)
// (RowScaled<E>: int8, int4, fp8) take the fp8 route (int4: 4-byte loads), their codes staged
// as T exactly, and thread t < BN carries key t's K and V scales along into shared memory,
// which the kernel applies to S's columns and P's.
#pragma once
#include "kernels/compat.cuh"
#include "kernels/attention_tile.cuh"
#include "kernels/dtypes.cuh"
#include "kernels/memory.cuh"
#include "kernels/tensor_core.cuh"

#include <type_traits>

namespace pagedkv {
namespace PAGEDKV_KERNEL_NS {
namespace attn_tc {

// Byte offsets of one key's K and V rows from the kv head's first row (KVRows).
struct alignas(16) RowOffsets {
  uint64_t k, v;
};

template <int HEAD, int WM, int WN, int BN>
struct TcConfig {
  static constexpr int kHead = HEAD;
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
  static_assert(BN <= kThreads, "one thread locates each key's rows");
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

// An integer code x (|x| <= 127) given as x + bias, 0 <= x + bias < 2^8, as float, exactly: 2^23
// + (x + bias) is a float whose low mantissa bits are x + bias.
template <int kBias>
__device__ __forceinline__ float code_float(uint32_t biased) {
  return __uint_as_float(0x4B000000u | biased) - static_cast<float>((1 << 23) + kBias);
}

// 8 int8 codes (raw, little-endian) -> 8 T, exactly; their scale is applied to S and P. Byte
// k of a word, biased, becomes the low byte of 2^23's bits by one byte permute (PRMT).
template <typename T>
__device__ __forceinline__ uint4 dequantize8_int8(uint2 raw) {
  constexpr float kBase = static_cast<float>((1 << 23) + 128);
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t word = (i < 2 ? raw.x : raw.y) ^ 0x80808080u;  // x + 128 per byte
    const uint32_t k = 2 * (i % 2);
    const float lo = __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7440u + k)) - kBase;
    const float hi = __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7441u + k)) - kBase;
    w[i] = pack2<T>(from_float<T>(lo), from_float<T>(hi));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// 8 int4 codes (4 bytes, element 2i in byte i's low nibble) -> 8 T, exactly.
template <typename T>
__device__ __forceinline__ uint4 dequantize8_int4(uint32_t raw) {
  const uint32_t biased = raw ^ 0x88888888u;  // x + 8 per nibble
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = pack2<T>(from_float<T>(code_float<8>((biased >> (8 * i)) & 0xfu)),
                    from_float<T>(code_float<8>((biased >> (8 * i + 4)) & 0xfu)));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// 8 elements of a quantized cache (E: fp8, int8; int4 in raw.x) as T, exactly.
template <typename T, typename E>
__device__ __forceinline__ uint4 dequantize_chunk(uint2 raw) {
  if constexpr (std::is_same_v<E, int8_t>) {
    return dequantize8_int8<T>(raw);
  } else if constexpr (std::is_same_v<E, int4x2>) {
    return dequantize8_int4<T>(raw.x);
  } else {
    return dequantize8<T, E>(raw);
  }
}

// The tile's queries -> shared memory, rows of kStride elements: row r is the query of tile row
// r (tile.token, tile.head), its first `width` elements (16-byte loads where the query allows);
// rows past tile.rows and elements past `width`, up to kChunks * 8, zeros.
template <typename T, int kRows, int kChunks, int kStride, int kThreads>
__device__ __forceinline__ void stage_query(const PagedAttentionParams& p,
                                            const attn::AttentionTile& tile, int width,
                                            T* q_smem) {
  const T* query = static_cast<const T*>(p.query);
  const bool q_vec = reinterpret_cast<uintptr_t>(query) % 16 == 0 && p.q_token_stride % 8 == 0 &&
                     p.q_head_stride % 8 == 0;
  for (int i = threadIdx.x; i < kRows * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (r < tile.rows && c * 8 < width) {
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

// The K/V copies of one thread (see the top of the file). Buffers: tile index % 2. C: the
// cache's element type, or RowScaled<E> (its rows' scales go to `scales`).
template <typename T, typename C, typename Cfg, int BN>
struct TcCopy {
  using E = typename cache_elem<C>::type;  // what the cache holds
  static constexpr bool kRowScaled = cache_elem<C>::kRowScaled;
  static constexpr int kPasses = BN / Cfg::kRowsPerPass;
  static constexpr int kR = Cfg::kRowsPerPass;
  static constexpr bool kFp8 = is_fp8<E>::value;
  static constexpr bool kRegs = kFp8 || kRowScaled;  // staged through registers, dequantized
  static constexpr bool kPrefetch = kRegs && Cfg::kHead <= 128;
  // load_store's passes unrolled: all of them, but 4 at a time for row-scaled caches (ptxas,
  // sm_90, head 256 prefill: int8 spills fully unrolled, per-tensor fp8 4 at a time).
  static constexpr int kLoadStoreUnroll = kRowScaled ? 4 : kPasses;
  T* kd;  // this thread's chunk of its first row in K buffer 0; V's, Cfg::kKVElems * 2 further
  RowOffsets (*row_off)[BN];
  // Row-scaled: [buffer][K scale, V scale, 1 / V scale][BN] in shared memory (kernel:
  // tc_scale). A V scale of 0 has the inverse 0: its row's weight then leaves the sum of P as
  // rounded / V scale, so the kernel normalizes by the fp32 sum of P where a thread saw one
  // (zero_v; a row of zeros has it, and a caller's scales may pair it with codes that are not).
  float* scales;
  mutable bool zero_v = false;
  attn::KVRows<E, attn::MagicDiv> kv;
  attn::RowScales row_scales;
  int tid, my_row, part_end;
  bool chunk_in;
  uint2 k_next[kPrefetch ? kPasses : 1], v_next[kPrefetch ? kPasses : 1];
  float ks_next = 0.f, vs_next = 0.f;  // key tid's scales of the tile in flight

  __device__ __forceinline__ TcCopy(const PagedAttentionParams& p, const attn::AttentionTile& tile,
                                    T* k_smem, RowOffsets (*offsets)[BN], float* scale_smem)
      : kd(k_smem + (threadIdx.x / Cfg::kChunks) * Cfg::kStride + (threadIdx.x % Cfg::kChunks) * 8),
        row_off(offsets),
        scales(scale_smem),
        kv(p, tile.seq, tile.kv_head, (threadIdx.x % Cfg::kChunks) * 8),
        row_scales(p, tile.kv_head),
        tid(threadIdx.x),
        my_row(threadIdx.x / Cfg::kChunks),
        part_end(tile.part_end),
        chunk_in(static_cast<int>(threadIdx.x % Cfg::kChunks) * 8 < p.head_size) {}

  __device__ __forceinline__ T* k_dst(int buf, int pass) const {
    return kd + buf * Cfg::kKVElems + pass * kR * Cfg::kStride;
  }
  __device__ __forceinline__ T* v_dst(int buf, int pass) const {
    return k_dst(buf, pass) + 2 * Cfg::kKVElems;
  }
  // Quantized caches: this thread's K and V chunks of key t (zeros past the partition or the
  // head): 8 bytes, or 4 of int4 (in .x).
  __device__ __forceinline__ void load(int t, uint2& k, uint2& v) const {
    k = v = make_uint2(0, 0);
    if (t < part_end && chunk_in) {
      uint32_t blk, off;
      kv.locate(t, blk, off);
      const E* ks = kv.k_row(kv.k_offset(blk, off));
      const E* vs = kv.v_row(kv.v_offset(blk, off));
      if constexpr (std::is_same_v<E, int4x2>) {
        k.x = load_ro(reinterpret_cast<const uint32_t*>(ks), "kv");
        v.x = load_ro(reinterpret_cast<const uint32_t*>(vs), "kv");
      } else {
        k = load_ro(reinterpret_cast<const uint2*>(ks), "kv");
        v = load_ro(reinterpret_cast<const uint2*>(vs), "kv");
      }
    }
  }
  // Row-scaled caches: key key0 + tid's K and V scales (0 and 1 past the partition), threads
  // < BN.
  __device__ __forceinline__ void load_scales(int key0, float& ks, float& vs) const {
    ks = 0.f;
    vs = 1.f;
    const int t = key0 + tid;
    if (tid < BN && t < part_end) {
      uint32_t blk, off;
      kv.locate(t, blk, off);
      ks = row_scales.key(blk, off);
      vs = row_scales.value(blk, off);
    }
  }
  __device__ __forceinline__ void store_scales(int buf, float ks, float vs) const {
    if (tid < BN) {
      zero_v |= vs == 0.f;
      scales[(3 * buf) * BN + tid] = ks;
      scales[(3 * buf + 1) * BN + tid] = vs;
      scales[(3 * buf + 2) * BN + tid] = vs != 0.f ? 1.f / vs : 0.f;
    }
  }
  __device__ __forceinline__ void fetch(int key0) {
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      load(key0 + my_row + pass * kR, k_next[pass], v_next[pass]);
    }
    if constexpr (kRowScaled) load_scales(key0, ks_next, vs_next);
  }
  __device__ __forceinline__ void store(int buf) const {
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      *reinterpret_cast<uint4*>(k_dst(buf, pass)) = dequantize_chunk<T, E>(k_next[pass]);
      *reinterpret_cast<uint4*>(v_dst(buf, pass)) = dequantize_chunk<T, E>(v_next[pass]);
    }
    if constexpr (kRowScaled) store_scales(buf, ks_next, vs_next);
  }
  __device__ __forceinline__ void load_store(int buf, int key0) const {  // one pass at a time
#pragma unroll(kLoadStoreUnroll)
    for (int pass = 0; pass < kPasses; ++pass) {
      uint2 k, v;
      load(key0 + my_row + pass * kR, k, v);
      *reinterpret_cast<uint4*>(k_dst(buf, pass)) = dequantize_chunk<T, E>(k);
      *reinterpret_cast<uint4*>(v_dst(buf, pass)) = dequantize_chunk<T, E>(v);
    }
    if constexpr (kRowScaled) {
      float ks, vs;
      load_scales(key0, ks, vs);
      store_scales(buf, ks, vs);
    }
  }
  // 16-bit caches: the K and V row offsets of keys key0 .. key0 + BN - 1, one key per thread.
  __device__ __forceinline__ void locate_rows(int buf, int key0) const {
    if (tid < BN) {
      const int t = key0 + tid;
      RowOffsets x{0, 0};
      if (t < part_end) {
        uint32_t blk, off;
        kv.locate(t, blk, off);
        x = {kv.k_offset(blk, off), kv.v_offset(blk, off)};
      }
      row_off[buf][tid] = x;
    }
  }
  // 16-bit caches: cp.async of this thread's chunks of the tile at key0 (located into buffer buf).
  __device__ __forceinline__ void stage(int buf, int key0) const {
    const int left = chunk_in ? part_end - key0 - my_row : 0;  // rows of mine: pass * kR < left
    RowOffsets x[kPasses];  // all offsets first: no shared load waits between the copies
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) x[pass] = row_off[buf][my_row + pass * kR];
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int bytes = pass * kR < left ? 16 : 0;
      const E* ks = kv.k_row(x[pass].k);
      const E* vs = kv.v_row(x[pass].v);
      note_read(ks, bytes, "kv");
      tc::cp_async_16(k_dst(buf, pass), ks, bytes);
      note_read(vs, bytes, "kv");
      tc::cp_async_16(v_dst(buf, pass), vs, bytes);
    }
  }

  // The pipeline. Before the first barrier: the first tile (quantized) or the first two tiles' row
  // offsets; after it, start() stages tile 0 (16-bit).
  __device__ __forceinline__ void prologue(int part_begin) {
    if constexpr (kPrefetch) {
      fetch(part_begin);
      store(0);
    } else if constexpr (!kRegs) {
      locate_rows(0, part_begin);
      locate_rows(1, part_begin + BN);
    }
  }
  __device__ __forceinline__ void start(int part_begin) const {
    if constexpr (!kRegs) {
      stage(0, part_begin);
      tc::cp_async_commit();
    }
  }
  // Tile it (keys from key0) of n: before its barrier, the next tile's copies issued and this
  // one's complete; after the barrier, the row offsets of tile it + 2 (read at tile it + 1's top);
  // after its math, the quantized tile in flight stored, or the barrier that frees this buffer.
  __device__ __forceinline__ void before_tile(int it, int key0, int n) {
    if constexpr (kPrefetch) {
      if (it + 1 < n) fetch(key0 + BN);  // in flight during this tile's math
    } else if constexpr (kRegs) {
      load_store(it & 1, key0);  // the buffer was last read two tiles ago, before the last barrier
    } else if (it + 1 < n) {
      stage((it + 1) & 1, key0 + BN);
      tc::cp_async_commit();
      tc::cp_async_wait<1>();
    } else {
      tc::cp_async_wait<0>();
    }
  }
  __device__ __forceinline__ void after_barrier(int it, int key0, int n) const {
    if constexpr (!kRegs) {
      if (it + 2 < n) locate_rows(it & 1, key0 + 2 * BN);
    }
  }
  __device__ __forceinline__ void after_tile(int it, int n) const {
    if constexpr (kPrefetch) {
      // The other buffer was last read in the previous tile, before this tile's barrier.
      if (it + 1 < n) store((it + 1) & 1);
    } else if constexpr (!kRegs) {
      __syncthreads();  // this buffer is staged again two tiles on
    }
  }
};

}  // namespace attn_tc
}  // namespace PAGEDKV_KERNEL_NS
}  // namespace pagedkv
