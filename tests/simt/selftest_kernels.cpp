// Correct self-test kernels, written as CUDA source with the project's compat macros
// (see selftest.h for shapes).
#include "kernels/compat.cuh"
#include "kernels/memory.cuh"
#include "selftest.h"

// Kernels have external linkage so that messages can name them (dladdr).
namespace simt_selftest {

constexpr unsigned kFull = 0xffffffffu;

// A launch the configuration check rejected runs nothing and leaves its error for
// cudaGetLastError, as on a GPU: the entry points raise it.
void raise_launch_error() {
  if (cudaGetLastError() != cudaSuccess) throw simt::Error(simt::last_error_message());
}

template <int kThreads>
__global__ void block_sum_kernel(const float* __restrict__ x,  // [blocks, n]
                                 float* __restrict__ out,      // [blocks]
                                 int n) {
  const float* row = x + int64_t(blockIdx.x) * n;
  float s = 0.0f;
  for (int i = threadIdx.x; i < n; i += kThreads) s += row[i];
  for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(kFull, s, off);
  __shared__ float warp_sums[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < kThreads / 32 ? warp_sums[lane] : 0.0f;
    for (int off = 16; off > 0; off /= 2) s += __shfl_down_sync(kFull, s, off);
    if (lane == 0) out[blockIdx.x] = s;
  }
}

constexpr int kWarps = 4, kGroup = 8;

__global__ void warp_loop_kernel(const float* __restrict__ x,    // [nblocks, 32]
                                 float* __restrict__ group_sums, // [nblocks, 4]
                                 float* __restrict__ max_sum,    // [1]
                                 int nblocks) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float warp_max = -INFINITY;
  for (int b = warp; b < nblocks; b += kWarps) {  // warps loop a different number of times
    float v = x[b * 32 + lane];
    for (int off = kGroup / 2; off > 0; off /= 2) v += __shfl_xor_sync(kFull, v, off, kGroup);
    const float leader = __shfl_sync(kFull, v, 0, kGroup);
    if (lane % kGroup == 0) group_sums[b * (32 / kGroup) + lane / kGroup] = leader;
    float m = leader;
    for (int off = 16; off >= kGroup; off /= 2) m = fmaxf(m, __shfl_xor_sync(kFull, m, off));
    warp_max = fmaxf(warp_max, m);
  }
  __shared__ float red[kWarps];
  if (lane == 0) red[warp] = warp_max;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = red[0];
    for (int w = 1; w < kWarps; ++w) m = fmaxf(m, red[w]);
    *max_sum = m;
  }
}

constexpr int kTile = 32, kTileRows = 8;

__global__ void transpose_kernel(const float* __restrict__ in,  // [rows, cols]
                                 float* __restrict__ out,       // [cols, rows]
                                 int rows, int cols) {
  __shared__ float tile[kTile][kTile + 1];
  int x = blockIdx.x * kTile + threadIdx.x, y = blockIdx.y * kTile + threadIdx.y;
  for (int j = 0; j < kTile; j += kTileRows) {
    if (x < cols && y + j < rows) tile[threadIdx.y + j][threadIdx.x] = in[(y + j) * cols + x];
  }
  __syncthreads();
  x = blockIdx.y * kTile + threadIdx.x;
  y = blockIdx.x * kTile + threadIdx.y;
  for (int j = 0; j < kTile; j += kTileRows) {
    if (x < rows && y + j < cols) out[(y + j) * rows + x] = tile[threadIdx.x][threadIdx.y + j];
  }
}

__global__ void reverse_kernel(const float* __restrict__ in,  // [blocks, n]
                               float* __restrict__ out) {     // [blocks, n]
  PAGEDKV_DYNAMIC_SMEM(float, s);  // [n]
  const int n = blockDim.x, t = threadIdx.x;
  const int64_t base = int64_t(blockIdx.x) * n;
  s[t] = in[base + t];
  __syncthreads();
  out[base + t] = s[n - 1 - t];
}

__global__ void read_poison_kernel(uint32_t* __restrict__ out) {  // [blocks, n]
  PAGEDKV_DYNAMIC_SMEM(uint32_t, s);  // [n]
  const int t = threadIdx.x;
  out[int64_t(blockIdx.x) * blockDim.x + t] = s[t];
  s[t] = t;  // the next block must not see this
}

template <typename T, typename T2>
__global__ void vector_fma_kernel(const T* __restrict__ x,  // [n_vec * 8]
                                  T* __restrict__ y,        // [n_vec * 8]
                                  float* __restrict__ sums, // [n_vec]
                                  int n_vec) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n_vec) return;
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(x) + i);
  const T2* pairs = reinterpret_cast<const T2*>(&raw);
  uint4 packed;
  T2* out = reinterpret_cast<T2*>(&packed);
  float s = 0.0f;
  for (int k = 0; k < 4; ++k) {
    out[k] = __hfma2(pairs[k], pairs[k], pairs[k]);
    s += __low2float(pairs[k]) + __high2float(pairs[k]);
  }
  reinterpret_cast<uint4*>(y)[i] = packed;
  sums[i] = s;
}

__device__ int pack(unsigned x, unsigned y, unsigned z) { return int(x + 16 * y + 256 * z); }

__global__ void grid3d_kernel(int32_t* __restrict__ out) {  // [gz, gy, gx, bz, by, bx, 4]
  const int64_t block = (int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const int64_t thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  int32_t* o = out + (block * blockDim.x * blockDim.y * blockDim.z + thread) * 4;
  o[0] = pack(blockIdx.x, blockIdx.y, blockIdx.z);
  o[1] = pack(threadIdx.x, threadIdx.y, threadIdx.z);
  o[2] = pack(gridDim.x, gridDim.y, gridDim.z);
  o[3] = pack(blockDim.x, blockDim.y, blockDim.z);
}

__global__ void votes_kernel(const int32_t* __restrict__ pred,  // [threads]
                             uint32_t* __restrict__ out) {      // [threads, 6]
  const int t = threadIdx.x;
  const int p = pred[t];
  uint32_t* o = out + t * 6;
  o[0] = __ballot_sync(kFull, p);
  o[1] = __any_sync(kFull, p);
  o[2] = __all_sync(kFull, p);
  o[3] = __syncthreads_count(p);
  o[4] = __syncthreads_and(p);
  o[5] = __syncthreads_or(p);
}

__global__ void atomics_kernel(int32_t* __restrict__ counters) {  // [4]
  const int id = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(&counters[0], 1);
  atomicMax(&counters[1], id);
  atomicAdd(reinterpret_cast<float*>(&counters[2]), 1.0f);
  int old = atomicOr(&counters[3], 0), seen;
  while ((seen = atomicCAS(&counters[3], old, old + 1)) != old) old = seen;
}

__global__ void partial_warp_sums_kernel(const float* __restrict__ x,  // [n]
                                         float* __restrict__ out,       // [ceil(n / 32)]
                                         int n) {
  const int t = threadIdx.x, lane = t % 32, lanes = min(32, n - (t - lane));
  const unsigned mask = lanes == 32 ? kFull : (1u << lanes) - 1;
  float v = x[t];
  for (int off = 16; off > 0; off /= 2) {
    const float other = __shfl_down_sync(mask, v, off);
    if (lane + off < lanes) v += other;
  }
  if (lane == 0) out[t / 32] = v;
}

__global__ void shuffle_outside_mask_kernel(const float* __restrict__ x,  // [16]
                                            float* __restrict__ out) {    // [16]
  out[threadIdx.x] = __shfl_down_sync(0x0000ffffu, x[threadIdx.x], 1);
}

__global__ void missing_barrier_kernel(const float* __restrict__ in,  // [n]
                                       float* __restrict__ out) {     // [n]
  PAGEDKV_DYNAMIC_SMEM(float, s);  // [n]
  const int n = blockDim.x, t = threadIdx.x;
  s[t] = in[t];
  // A __syncthreads() belongs here: the read below races with the neighbour's write.
  out[t] = s[t + 1 < n ? t + 1 : t];
}

// Writes its dynamic shared memory (every byte of it) and counts the blocks that ran.
__global__ void smem_fill_kernel(int32_t* __restrict__ ran) {
  PAGEDKV_DYNAMIC_SMEM(unsigned char, s);
  const dim3 b = blockDim;
  const unsigned bytes = unsigned(ran[1]), t = threadIdx.x + b.x * (threadIdx.y + b.y * threadIdx.z);
  for (unsigned i = t; i < bytes; i += b.x * b.y * b.z) s[i] = 1;
  __syncthreads();
  if (t == 0) atomicAdd(&ran[0], 1);
}

// Traffic: y = x (n floats), every block the whole of it, through the counted accesses.
// Coalesced: thread t of the block reads x[t], x[t + threads], ...
__global__ void coalesced_copy_kernel(const float* __restrict__ x, float* __restrict__ y, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    pagedkv::simt::store(y + i, pagedkv::simt::load(x + i, "data"), "data");
  }
}

// Wasteful: the same copy walking x column-wise as [32, n / 32]: the 32 lanes of a warp read
// 4 bytes each at a stride of n / 32 floats, one 32-byte sector per lane (1/8 of it used), and
// every block reads all of x (re-read once per block). n: a multiple of 32 * blockDim.x.
__global__ void wasteful_copy_kernel(const float* __restrict__ x, float* __restrict__ y, int n) {
  const int cols = n / 32;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int j = (i % 32) * cols + i / 32;
    pagedkv::simt::store(y + j, pagedkv::simt::load(x + j, "data"), "data");
  }
}

void block_sum(const float* x, float* out, int blocks, int n, int threads) {
  switch (threads) {
#define SELFTEST_CASE(T) \
  case T: PAGEDKV_LAUNCH(block_sum_kernel<T>, blocks, T, 0, nullptr)(x, out, n); \
    raise_launch_error(); return;
    SELFTEST_CASE(32) SELFTEST_CASE(64) SELFTEST_CASE(128) SELFTEST_CASE(256)
    SELFTEST_CASE(512) SELFTEST_CASE(1024)
#undef SELFTEST_CASE
  }
  throw simt::Error("block_sum: threads must be 32, 64, ..., 1024, got " + std::to_string(threads));
}

void warp_loop(const float* x, float* group_sums, float* max_sum, int nblocks) {
  PAGEDKV_LAUNCH(warp_loop_kernel, 1, kWarps * 32, 0, nullptr)(x, group_sums, max_sum, nblocks);
  raise_launch_error();
}

void transpose(const float* in, float* out, int rows, int cols) {
  const dim3 grid((cols + kTile - 1) / kTile, (rows + kTile - 1) / kTile), block(kTile, kTileRows);
  PAGEDKV_LAUNCH(transpose_kernel, grid, block, 0, nullptr)(in, out, rows, cols);
  raise_launch_error();
}

void reverse_blocks(const float* in, float* out, int blocks, int n) {
  // What a launcher does before asking for more than 48 KiB of dynamic shared memory.
  int device = -1, optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess ||
      cudaFuncSetAttribute(reverse_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin) !=
          cudaSuccess) {
    throw simt::Error("reverse_blocks: device attribute shims failed");
  }
  PAGEDKV_LAUNCH(reverse_kernel, blocks, n, n * sizeof(float), nullptr)(in, out);
  raise_launch_error();
}

void read_poison(uint32_t* out, int blocks, int n) {
  PAGEDKV_LAUNCH(read_poison_kernel, blocks, n, n * sizeof(uint32_t), nullptr)(out);
  raise_launch_error();
}

void vector_fma(const void* x, void* y, float* sums, int n_vec, bool bf16) {
  const int threads = 64, blocks = (n_vec + threads - 1) / threads;
  if (bf16) {
    auto k = vector_fma_kernel<__nv_bfloat16, __nv_bfloat162>;
    PAGEDKV_LAUNCH(k, blocks, threads, 0, nullptr)(static_cast<const __nv_bfloat16*>(x),
                                                   static_cast<__nv_bfloat16*>(y), sums, n_vec);
  } else {
    auto k = vector_fma_kernel<__half, __half2>;
    PAGEDKV_LAUNCH(k, blocks, threads, 0, nullptr)(static_cast<const __half*>(x),
                                                   static_cast<__half*>(y), sums, n_vec);
  }
  raise_launch_error();
}

void grid3d(int32_t* out, const int grid[3], const int block[3]) {
  const dim3 g(grid[0], grid[1], grid[2]), b(block[0], block[1], block[2]);
  PAGEDKV_LAUNCH(grid3d_kernel, g, b, 0, nullptr)(out);
  raise_launch_error();
}

void votes(const int32_t* pred, uint32_t* out, int threads) {
  PAGEDKV_LAUNCH(votes_kernel, 1, threads, 0, nullptr)(pred, out);
  raise_launch_error();
}

void atomics(int32_t* counters, int blocks, int threads) {
  PAGEDKV_LAUNCH(atomics_kernel, blocks, threads, 0, nullptr)(counters);
  raise_launch_error();
}

void partial_warp_sums(const float* x, float* out, int n) {
  PAGEDKV_LAUNCH(partial_warp_sums_kernel, 1, n, 0, nullptr)(x, out, n);
  raise_launch_error();
}

void shuffle_outside_mask(const float* x, float* out_of_mask) {
  PAGEDKV_LAUNCH(shuffle_outside_mask_kernel, 1, 16, 0, nullptr)(x, out_of_mask);
  raise_launch_error();
}

void missing_barrier(const float* in, float* out, int n) {
  PAGEDKV_LAUNCH(missing_barrier_kernel, 1, n, n * sizeof(float), nullptr)(in, out);
  raise_launch_error();
}

cudaError_t launch_config(const int grid[3], const int block[3], size_t smem, int opt_in,
                          int32_t* ran, std::string* message) {
  if (opt_in > 0) {
    const cudaError_t err = cudaFuncSetAttribute(
        smem_fill_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, opt_in);
    if (err != cudaSuccess) {
      *message = "cudaFuncSetAttribute failed";
      return err;
    }
  }
  ran[0] = 0;
  ran[1] = int32_t(smem);
  const dim3 g(grid[0], grid[1], grid[2]), b(block[0], block[1], block[2]);
  PAGEDKV_LAUNCH(smem_fill_kernel, g, b, smem, nullptr)(ran);
  const cudaError_t peeked = cudaPeekAtLastError();
  const cudaError_t err = cudaGetLastError();
  *message = err == cudaSuccess ? "" : simt::last_error_message();
  if (peeked != err || cudaGetLastError() != cudaSuccess) {
    throw simt::Error("launch_config: cudaGetLastError did not report and clear the error");
  }
  return err;
}

void copy(const float* x, float* y, int n, int blocks, bool wasteful) {
  if (wasteful) {
    PAGEDKV_LAUNCH(wasteful_copy_kernel, blocks, 128, 0, nullptr)(x, y, n);
  } else {
    PAGEDKV_LAUNCH(coalesced_copy_kernel, blocks, 128, 0, nullptr)(x, y, n);
  }
  raise_launch_error();
}

}  // namespace simt_selftest
