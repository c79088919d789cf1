// Cache kernels: reshape_and_cache (write new K/V into their slots), copy_blocks (copy-on-write,
// every layer in one launch), swap_blocks (whole blocks between devices), and the MLA cache's
// concat_and_cache_mla (write latent rows) and gather_cache (read sequences' rows back).
//
// Include from exactly one translation unit per backend (csrc/cuda/cache_kernels.cu for nvcc,
// csrc/simt_backend/cache_kernels.cpp for the emulator): it defines the launchers of cache_launch.h.
#pragma once
#include "kernels/compat.cuh"

#include <algorithm>
#include <type_traits>

#include "kernels/cache_launch.h"
#include "kernels/dtypes.cuh"
#include "kernels/memory.cuh"

namespace pagedkv {
namespace PAGEDKV_KERNEL_NS {

namespace {

bool aligned_to(const void* ptr, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(bytes) == 0;
}

bool strides_divisible(const CacheStrides& s, int64_t n) {
  return s.block % n == 0 && s.head % n == 0 && s.token % n == 0;
}

int threads_for(int64_t work) {
  const int64_t warps = (work + 31) / 32;
  return static_cast<int>(warps > 16 ? 512 : (warps < 1 ? 32 : warps * 32));
}

template <typename Cache, typename Src, int VEC>
__device__ __forceinline__ Vec<Cache, VEC> to_cache(const Vec<Src, VEC>& in, float scale) {
  Vec<Cache, VEC> out;
#pragma unroll
  for (int i = 0; i < VEC; ++i) out.v[i] = from_float<Cache>(to_float(in.v[i]) / scale);
  return out;
}

template <typename Src, int VEC>
__device__ __forceinline__ Vec<Src, VEC> to_cache_same(const Vec<Src, VEC>& in) { return in; }

}  // namespace

// One thread block per token; each thread moves VEC elements of one head of K and of V.
// grid: (num_tokens), block: up to 512 threads.
template <typename Src, typename Cache, int VEC>
__global__ void reshape_and_cache_kernel(const ReshapeAndCacheParams p) {
  using SrcVec = Vec<Src, VEC>;
  using CacheVec = Vec<Cache, VEC>;
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;
  const PagedKV<Cache> k_cache = p.key_cache.as<Cache>();
  const PagedKV<Cache> v_cache = p.value_cache.as<Cache>();
  const PagedKVSlot at = k_cache.locate(slot);
  const int vecs_per_head = p.head_size / VEC;
  const int work = p.num_kv_heads * vecs_per_head;
  float k_scale = 1.f, v_scale = 1.f;
  if constexpr (is_fp8<Cache>::value) {
    k_scale = *p.k_scale;
    v_scale = *p.v_scale;
  }
  const Src* key = static_cast<const Src*>(p.key) + token * p.key_token_stride;
  const Src* value = static_cast<const Src*>(p.value) + token * p.value_token_stride;
  Cache* key_row = k_cache.row(at);
  Cache* value_row = v_cache.row(at);
  for (int i = threadIdx.x; i < work; i += blockDim.x) {
    const int head = i / vecs_per_head;
    const int d = (i % vecs_per_head) * VEC;
    const SrcVec k = load(reinterpret_cast<const SrcVec*>(key + head * p.key_head_stride + d), "src");
    const SrcVec v =
        load(reinterpret_cast<const SrcVec*>(value + head * p.value_head_stride + d), "src");
    // Strides read from p, not from the typed copies, whose fields would stay in registers.
    CacheVec* k_dst = reinterpret_cast<CacheVec*>(key_row + head * p.key_cache.strides.head + d);
    CacheVec* v_dst =
        reinterpret_cast<CacheVec*>(value_row + head * p.value_cache.strides.head + d);
    if constexpr (is_fp8<Cache>::value) {
      store(k_dst, to_cache<Cache>(k, k_scale), "kv");
      store(v_dst, to_cache<Cache>(v, v_scale), "kv");
    } else {
      store(k_dst, to_cache_same(k), "kv");
      store(v_dst, to_cache_same(v), "kv");
    }
  }
}

template <typename Src, typename Cache>
cudaError_t reshape_and_cache_typed(const ReshapeAndCacheParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(Src);
  const bool vectorized =
      p.head_size % kVec == 0 && p.key_token_stride % kVec == 0 && p.key_head_stride % kVec == 0 &&
      p.value_token_stride % kVec == 0 && p.value_head_stride % kVec == 0 &&
      strides_divisible(p.key_cache.strides, kVec) &&
      strides_divisible(p.value_cache.strides, kVec) && aligned_to(p.key, 16) &&
      aligned_to(p.value, 16) && aligned_to(p.key_cache.data, kVec * sizeof(Cache)) &&
      aligned_to(p.value_cache.data, kVec * sizeof(Cache));
  const dim3 grid(static_cast<unsigned>(p.num_tokens));
  if (vectorized) {
    auto kernel = reshape_and_cache_kernel<Src, Cache, kVec>;
    PAGEDKV_LAUNCH(kernel, grid, threads_for(p.num_kv_heads * (p.head_size / kVec)), 0, stream)(p);
  } else {
    auto kernel = reshape_and_cache_kernel<Src, Cache, 1>;
    PAGEDKV_LAUNCH(kernel, grid, threads_for(p.num_kv_heads * p.head_size), 0, stream)(p);
  }
  return cudaGetLastError();
}

// The absmax of two partial ones, NaN propagating (as torch's amax): a NaN on either side wins.
__device__ __forceinline__ float nan_max(float a, float b) { return b > a || b != b ? b : a; }

// Element x of a row of scale `scale` (> 0) as a cache element: round half to even of x / scale
// (an IEEE division, as the CPU kernel and the reference compute it, never a reciprocal's
// product), clamped to +-qmax; NaN stores 0. fp8: the saturating conversion of x / scale.
template <typename Cache>
__device__ __forceinline__ int quantize_int(float x, float scale) {
  constexpr float qmax = quant_max(kQuantDType<Cache>);
  const float r = rintf(__fdiv_rn(x, scale));
  return r != r ? 0 : static_cast<int>(fminf(fmaxf(r, -qmax), qmax));
}

// Per-(token, head) quantization (ReshapeAndCacheParams' key_scales): one warp per row, each a
// K or V row of one head of the block's token. The row's absmax (float32, NaN propagating) is
// reduced across the warp; scale = absmax / quant_max, written beside the row; its elements
// quantize_int'ed (fp8: converted, saturating), zeros when the scale is 0. The source row is read
// twice (the second time from L1): rows of any head_size, no registers held across the passes.
// Bit-exact with the CPU kernel and pagedkv.reference.quantize_rows.
// grid: (num_tokens), block: up to 16 warps, striding over the 2 * num_kv_heads rows.
template <typename Src, typename Cache>
__global__ void reshape_and_cache_scaled_kernel(const ReshapeAndCacheParams p) {
  constexpr unsigned kFull = 0xffffffffu;
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warps = blockDim.x / 32;
  const int n = p.head_size;
  for (int r = warp; r < 2 * p.num_kv_heads; r += warps) {  // warp-uniform: full-mask shuffles
    const bool is_v = r >= p.num_kv_heads;
    const int head = is_v ? r - p.num_kv_heads : r;
    const Src* src = static_cast<const Src*>(is_v ? p.value : p.key) +
                     token * (is_v ? p.value_token_stride : p.key_token_stride) +
                     head * (is_v ? p.value_head_stride : p.key_head_stride);
    const PagedKVView& cache = is_v ? p.value_cache : p.key_cache;
    const PagedKVView& scales = is_v ? p.value_scales : p.key_scales;
    const PagedKVSlot at = cache.locate(slot);
    Cache* dst = cache.as<Cache>().row(at) + head * cache.strides.head;
    float* scale_dst = scales.as<float>().row(at) + head * scales.strides.head;

    float amax = 0.f;
    for (int i = lane; i < n; i += 32) amax = nan_max(amax, fabsf(to_float(load(src + i, "src"))));
#pragma unroll
    for (int o = 16; o > 0; o /= 2) amax = nan_max(amax, __shfl_xor_sync(kFull, amax, o));
    const float scale = __fdiv_rn(amax, quant_max(kQuantDType<Cache>));
    const bool zero = scale == 0.f;
    if constexpr (std::is_same_v<Cache, int4x2>) {
      for (int i = lane; i < n / 2; i += 32) {
        const int lo = zero ? 0 : quantize_int<Cache>(to_float(load(src + 2 * i, "src")), scale);
        const int hi =
            zero ? 0 : quantize_int<Cache>(to_float(load(src + 2 * i + 1, "src")), scale);
        store(dst + i, int4x2{static_cast<uint8_t>((lo & 0xF) | ((hi & 0xF) << 4))}, "kv");
      }
    } else {
      for (int i = lane; i < n; i += 32) {
        const float x = to_float(load(src + i, "src"));
        if constexpr (std::is_same_v<Cache, int8_t>) {
          store(dst + i, static_cast<int8_t>(zero ? 0 : quantize_int<Cache>(x, scale)), "kv");
        } else {
          store(dst + i, zero ? Cache{0} : from_float<Cache>(__fdiv_rn(x, scale)), "kv");
        }
      }
    }
    if (lane == 0) store(scale_dst, scale, "kv_scales");
  }
}

template <typename Src>
cudaError_t reshape_and_cache_src(const ReshapeAndCacheParams& p, cudaStream_t stream) {
  if (p.key_scales.data != nullptr) {  // int8, int4, fp8 with a scale per (token, head)
    return with_token_scaled_type(p.cache_dtype, [&]<typename Cache>() {
      const int warps = std::min(16, 2 * p.num_kv_heads);
      auto kernel = reshape_and_cache_scaled_kernel<Src, Cache>;
      PAGEDKV_LAUNCH(kernel, dim3(static_cast<unsigned>(p.num_tokens)), 32 * warps, 0, stream)(p);
      return cudaGetLastError();
    });
  }
  return with_cache_type<Src>(p.cache_dtype, [&]<typename Cache>() {
    return reshape_and_cache_typed<Src, Cache>(p, stream);
  });
}

cudaError_t reshape_and_cache(const ReshapeAndCacheParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  switch (p.src_dtype) {
    case DType::kFloat32: return reshape_and_cache_src<float>(p, stream);
    case DType::kFloat16: return reshape_and_cache_src<__half>(p, stream);
    case DType::kBFloat16: return reshape_and_cache_src<__nv_bfloat16>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

// One thread block per (pair, layer); threads stride over the Chunk-sized pieces of the block's
// rows (one row = one token of one head), for K and V.
// grid: (num_pairs, num_layers), block: up to 512 threads.
template <typename Chunk>
__global__ void copy_blocks_kernel(const CopyBlocksParams p) {
  const int64_t pair = blockIdx.x;
  const int layer = blockIdx.y;
  const int64_t src = p.block_mapping[2 * pair];
  const int64_t dst = p.block_mapping[2 * pair + 1];
  const int chunks_per_row = p.row_bytes / static_cast<int>(sizeof(Chunk));
  const int work = p.num_kv_heads * p.block_size * chunks_per_row;
  const PagedKV<char> k_cache = p.key_cache(layer);
  const PagedKV<char> v_cache = p.value_cache(layer);
  for (int i = threadIdx.x; i < work; i += blockDim.x) {
    const int row = i / chunks_per_row;
    const int64_t byte = static_cast<int64_t>(i % chunks_per_row) * sizeof(Chunk);
    const int head = row / p.block_size;
    const int token = row % p.block_size;
    const int64_t k_off = k_cache.in_block(head, token) + byte;
    const int64_t v_off = v_cache.in_block(head, token) + byte;
    store(reinterpret_cast<Chunk*>(k_cache.block(dst) + k_off),
          load(reinterpret_cast<const Chunk*>(k_cache.block(src) + k_off), "kv"), "kv");
    store(reinterpret_cast<Chunk*>(v_cache.block(dst) + v_off),
          load(reinterpret_cast<const Chunk*>(v_cache.block(src) + v_off), "kv"), "kv");
  }
}

template <typename Chunk>
cudaError_t copy_blocks_chunked(const CopyBlocksParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.num_pairs), static_cast<unsigned>(p.num_layers));
  const int work = p.num_kv_heads * p.block_size * (p.row_bytes / static_cast<int>(sizeof(Chunk)));
  auto kernel = copy_blocks_kernel<Chunk>;
  PAGEDKV_LAUNCH(kernel, grid, threads_for(work), 0, stream)(p);
  return cudaGetLastError();
}

// The widest chunk that divides every row start: 16 bytes for any cache whose rows are 16-byte
// aligned, down to single bytes for odd fp8 head sizes.
int chunk_bytes(const CopyBlocksParams& p) {
  int64_t g = p.row_bytes | p.k_strides_bytes.block | p.k_strides_bytes.head |
              p.k_strides_bytes.token | p.v_strides_bytes.block | p.v_strides_bytes.head |
              p.v_strides_bytes.token;
  for (int l = 0; l < p.num_layers; ++l) {
    g |= static_cast<int64_t>(reinterpret_cast<uintptr_t>(p.key_caches[l]));
    g |= static_cast<int64_t>(reinterpret_cast<uintptr_t>(p.value_caches[l]));
  }
  for (int bytes = 16; bytes > 1; bytes /= 2) {
    if (g % bytes == 0) return bytes;
  }
  return 1;
}

cudaError_t copy_blocks(const CopyBlocksParams& p, cudaStream_t stream) {
  if (p.num_pairs == 0 || p.num_layers == 0) return cudaSuccess;
  switch (chunk_bytes(p)) {
    case 16: return copy_blocks_chunked<uint4>(p, stream);
    case 8: return copy_blocks_chunked<uint2>(p, stream);
    case 4: return copy_blocks_chunked<uint32_t>(p, stream);
    case 2: return copy_blocks_chunked<uint16_t>(p, stream);
    default: return copy_blocks_chunked<uint8_t>(p, stream);
  }
}

// One asynchronous copy per block on the given stream; block_mapping is host memory.
cudaError_t swap_blocks(const SwapBlocksParams& p, cudaMemcpyKind kind, cudaStream_t stream) {
  for (int64_t i = 0; i < p.num_pairs; ++i) {
    const char* src = p.src + p.block_mapping[2 * i] * p.src_block_stride_bytes;
    char* dst = p.dst + p.block_mapping[2 * i + 1] * p.dst_block_stride_bytes;
    const cudaError_t err = cudaMemcpyAsync(dst, src, p.block_bytes, kind, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// One thread block per token; threads stride over its row, kv_c then k_pe (a few hundred
// elements: one pass of the block).
// grid: (num_tokens), block: up to 512 threads.
template <typename Src, typename Cache>
__global__ void concat_and_cache_mla_kernel(const ConcatAndCacheMlaParams p) {
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;
  const PagedKV<Cache> cache = p.cache.as<Cache>();
  Cache* row = cache.row(cache.locate(slot));
  float scale = 1.f;
  if constexpr (is_fp8<Cache>::value) scale = *p.scale;
  const Src* kv_c = static_cast<const Src*>(p.kv_c) + token * p.kv_c_stride;
  const Src* k_pe = static_cast<const Src*>(p.k_pe) + token * p.k_pe_stride - p.kv_lora_rank;
  const int width = p.kv_lora_rank + p.rope_dim;
  for (int i = threadIdx.x; i < width; i += blockDim.x) {
    const Src x = load(i < p.kv_lora_rank ? kv_c + i : k_pe + i, "src");
    if constexpr (is_fp8<Cache>::value) {
      store(row + i, from_float<Cache>(to_float(x) / scale), "kv");
    } else {
      store(row + i, x, "kv");
    }
  }
}

template <typename Src>
cudaError_t concat_and_cache_mla_src(const ConcatAndCacheMlaParams& p, cudaStream_t stream) {
  return with_cache_type<Src>(p.cache_dtype, [&]<typename Cache>() {
    auto kernel = concat_and_cache_mla_kernel<Src, Cache>;
    PAGEDKV_LAUNCH(kernel, dim3(static_cast<unsigned>(p.num_tokens)),
                   threads_for(p.kv_lora_rank + p.rope_dim), 0, stream)(p);
    return cudaGetLastError();
  });
}

cudaError_t concat_and_cache_mla(const ConcatAndCacheMlaParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  switch (p.src_dtype) {
    case DType::kFloat32: return concat_and_cache_mla_src<float>(p, stream);
    case DType::kFloat16: return concat_and_cache_mla_src<__half>(p, stream);
    case DType::kBFloat16: return concat_and_cache_mla_src<__nv_bfloat16>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

// Block (b, y) copies sequence b's rows held by its block-table entries y, y + gridDim.y, ...;
// threads stride over those rows' elements. Out rows of the cache's type are copied as stored,
// fp8 rows into a float out dequantized (x * scale).
// grid: (batch, splits), block: up to 512 threads.
template <typename Cache, typename Out>
__global__ void gather_cache_kernel(const GatherCacheParams p) {
  const int b = blockIdx.x;
  const int32_t first = load(p.cu_seq_lens + b, "seq_lens");
  const int32_t len = load(p.cu_seq_lens + b + 1, "seq_lens") - first;
  if (len <= 0) return;
  const int32_t start = p.seq_starts != nullptr ? load(p.seq_starts + b, "seq_lens") : 0;
  const PagedKV<Cache> cache = p.cache.as<Cache>();
  const int32_t block_size = cache.block_size;
  float scale = 1.f;
  if constexpr (!std::is_same_v<Cache, Out>) scale = *p.scale;
  Out* out = static_cast<Out*>(p.out) + static_cast<int64_t>(first) * p.out_stride;
  const int32_t* table = p.block_table + b * p.block_table_stride;
  const int last_entry = (start + len - 1) / block_size;
  for (int e = start / block_size + blockIdx.y; e <= last_entry; e += gridDim.y) {
    const int64_t block = load(table + e, "block_table");
    const int begin = max(e * block_size, start);
    const int count = (min((e + 1) * block_size, start + len) - begin) * p.width;
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
      const int pos = begin + i / p.width, d = i % p.width;
      const Cache x = load(cache.row({block, pos - e * block_size}) + d, "kv");
      Out* dst = out + static_cast<int64_t>(pos - start) * p.out_stride + d;
      if constexpr (std::is_same_v<Cache, Out>) {
        store(dst, x, "out");
      } else {
        store(dst, from_float<Out>(to_float(x) * scale), "out");
      }
    }
  }
}

template <typename Cache, typename Out>
cudaError_t gather_cache_typed(const GatherCacheParams& p, cudaStream_t stream) {
  const unsigned splits = static_cast<unsigned>(std::min(p.max_blocks, 32));
  const dim3 grid(static_cast<unsigned>(p.batch), splits);
  auto kernel = gather_cache_kernel<Cache, Out>;
  PAGEDKV_LAUNCH(kernel, grid, threads_for(static_cast<int64_t>(p.width) * p.cache.block_size), 0,
                 stream)(p);
  return cudaGetLastError();
}

// out's dtype is the cache's, or float for an fp8 cache (the ops' checks).
template <typename Out>
cudaError_t gather_cache_out(const GatherCacheParams& p, cudaStream_t stream) {
  return with_cache_type<Out>(p.cache_dtype, [&]<typename Cache>() {
    return gather_cache_typed<Cache, Out>(p, stream);
  });
}

cudaError_t gather_cache(const GatherCacheParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.max_blocks == 0) return cudaSuccess;
  switch (p.out_dtype) {
    case DType::kFloat32: return gather_cache_out<float>(p, stream);
    case DType::kFloat16: return gather_cache_out<__half>(p, stream);
    case DType::kBFloat16: return gather_cache_out<__nv_bfloat16>(p, stream);
    case DType::kFp8E4M3: return gather_cache_typed<fp8_e4m3, fp8_e4m3>(p, stream);
    case DType::kFp8E5M2: return gather_cache_typed<fp8_e5m2, fp8_e5m2>(p, stream);
    default: break;  // no gather of quantized caches (the MLA cache has none)
  }
  return cudaErrorInvalidValue;
}

}  // namespace PAGEDKV_KERNEL_NS
}  // namespace pagedkv
