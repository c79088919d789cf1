// Self-test kernels of the tensor-core instructions (kernels/tensor_core.cuh), correct ones and
// ones that use them wrongly on purpose (see selftest.h for shapes).
#include "kernels/tensor_core.cuh"
#include "selftest.h"

namespace simt_selftest {

namespace tc = pagedkv::simt::tc;

// One warp. Row l of m (matrix l / 8, row l % 8) is stored at a scattered row of a shared tile,
// and lane l passes that row's address; lanes from 8 * num on pass nullptr (never read).
__global__ void ldmatrix_kernel(const uint16_t* __restrict__ m,  // [32, 8]
                                uint32_t* __restrict__ out,      // [32, 4]
                                int num, bool trans) {
  __shared__ __align__(16) uint16_t tile[32][16];  // 32-byte rows, half of each unused
  const int l = threadIdx.x, slot = (l * 13 + 5) % 32;
  for (int e = 0; e < 8; ++e) tile[slot][e] = m[l * 8 + e];
  __syncthreads();
  const void* row = l < 8 * num ? &tile[slot][0] : nullptr;
  uint32_t r1[1], r2[2], r4[4];
  if (num == 1) trans ? tc::ldmatrix_x1_trans(r1, row) : tc::ldmatrix_x1(r1, row);
  if (num == 2) trans ? tc::ldmatrix_x2_trans(r2, row) : tc::ldmatrix_x2(r2, row);
  if (num == 4) trans ? tc::ldmatrix_x4_trans(r4, row) : tc::ldmatrix_x4(r4, row);
  const uint32_t* r = num == 1 ? r1 : num == 2 ? r2 : r4;
  for (int i = 0; i < num; ++i) out[l * 4 + i] = r[i];
}

// One warp: every lane passes its registers as given and writes its result registers.
// permute != 0 is a kernel with a wrong fragment mapping: 1 swaps a[1] and a[2] (rows 8-15 for
// columns 8-15), 2 takes every register of lane (l + 4) % 32 (the next row group).
template <typename T>
__global__ void mma_kernel(const uint32_t* __restrict__ a,  // [32, 4]
                           const uint32_t* __restrict__ b,  // [32, 2]
                           const float* __restrict__ c,     // [32, 4]
                           float* __restrict__ d,           // [32, 4]
                           int permute) {
  const int l = threadIdx.x, src = permute == 2 ? (l + 4) % 32 : l;
  uint32_t ra[4], rb[2];
  float acc[4];
  for (int i = 0; i < 4; ++i) ra[i] = a[src * 4 + i];
  for (int i = 0; i < 2; ++i) rb[i] = b[src * 2 + i];
  for (int i = 0; i < 4; ++i) acc[i] = c[src * 4 + i];
  if (permute == 1) {
    const uint32_t t = ra[1];
    ra[1] = ra[2];
    ra[2] = t;
  }
  tc::mma_m16n8k16<T>(acc, ra, rb, acc);  // d aliases c, as kernels accumulate
  for (int i = 0; i < 4; ++i) d[l * 4 + i] = acc[i];
}

// C = A B on tensor cores, FlashAttention-style staging: 4 warps, a block tile of 64 rows x 16
// columns, k in steps of 16 through two shared-memory stages filled by cp.async (rows past M
// zero-filled), A by ldmatrix.x4, B by ldmatrix.x4 from [N, K] or ldmatrix.x4.trans from [K, N].
// wait_after_use is the bug of computing on a stage before its cp.async.wait_group.
constexpr int kTileM = 64, kTileN = 16, kTileK = 16, kTcThreads = 128;

template <typename T>
__global__ void tile_matmul_kernel(const T* __restrict__ a,  // [m, k]
                                   const T* __restrict__ b,  // [n, k], or [k, n] if b_kn
                                   float* __restrict__ c,    // [m, n]
                                   int m, int n, int k, bool b_kn, bool wait_after_use) {
  PAGEDKV_DYNAMIC_SMEM(T, smem);  // per stage: A [64][16], then B [16][16] ([n][k] or [k][n])
  constexpr int kStage = (kTileM + kTileN) * kTileK;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int row0 = blockIdx.x * kTileM, col0 = blockIdx.y * kTileN, steps = k / kTileK;

  const auto load = [&](int stage, int step) {  // one 16-byte chunk of A per thread, B: 32
    T* sa = smem + stage * kStage;
    const int r = tid / 2, half = tid % 2, row = row0 + r;
    const T* src = a + int64_t(row < m ? row : 0) * k + step * kTileK + half * 8;
    tc::cp_async_16(sa + r * kTileK + half * 8, src, row < m ? 16 : 0);
    if (tid < 32) {
      T* sb = sa + kTileM * kTileK;
      const int br = tid / 2;
      const T* bsrc = b_kn ? b + int64_t(step * kTileK + br) * n + col0 + half * 8
                           : b + int64_t(col0 + br) * k + step * kTileK + half * 8;
      tc::cp_async_16(sb + br * 16 + half * 8, bsrc);
    }
    tc::cp_async_commit();
  };

  float acc[2][4] = {};
  load(0, 0);
  for (int step = 0; step < steps; ++step) {
    if (step + 1 < steps) load((step + 1) % 2, step + 1);
    if (!wait_after_use) {
      if (step + 1 < steps) tc::cp_async_wait<1>(); else tc::cp_async_wait<0>();
    }
    __syncthreads();
    const T* sa = smem + (step % 2) * kStage;
    const T* sb = sa + kTileM * kTileK;
    const int q = lane / 8, r = lane % 8;
    uint32_t fa[4], fb[4];
    tc::ldmatrix_x4(fa, sa + (warp * 16 + r + 8 * (q % 2)) * kTileK + 8 * (q / 2));
    if (b_kn) {  // matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15)
      tc::ldmatrix_x4_trans(fb, sb + (r + 8 * (q % 2)) * 16 + 8 * (q / 2));
    } else {     // matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
      tc::ldmatrix_x4(fb, sb + (r + 8 * (q / 2)) * 16 + 8 * (q % 2));
    }
    for (int j = 0; j < 2; ++j) {
      const uint32_t bj[2] = {fb[2 * j], fb[2 * j + 1]};
      tc::mma_m16n8k16<T>(acc[j], fa, bj, acc[j]);
    }
    if (wait_after_use) {
      if (step + 1 < steps) tc::cp_async_wait<1>(); else tc::cp_async_wait<0>();
    }
    __syncthreads();  // the next step's cp.async overwrites this stage
  }
  const int g = lane / 4, t = lane % 4;
  for (int j = 0; j < 2; ++j) {
    for (int i = 0; i < 4; ++i) {
      const int row = row0 + warp * 16 + g + 8 * (i / 2), col = col0 + 8 * j + 2 * t + i % 2;
      if (row < m) c[int64_t(row) * n + col] = acc[j][i];
    }
  }
}

// One warp: each lane's four 16-byte chunks through cp.async, snapshots of the destination
// around each wait (see selftest.h).
__global__ void cp_async_groups_kernel(const uint4* __restrict__ src,  // [32, 4]
                                       uint4* __restrict__ out) {      // [32, 7]
  PAGEDKV_DYNAMIC_SMEM(uint4, s);  // [32, 4]
  const int l = threadIdx.x;
  uint4* mine = s + l * 4;
  uint4* o = out + l * 7;
  tc::cp_async_16(mine + 0, src + l * 4 + 0);
  tc::cp_async_commit();
  tc::cp_async_16(mine + 1, src + l * 4 + 1);
  tc::cp_async_commit();
  tc::cp_async_16(mine + 2, src + l * 4 + 2, 0);
  tc::cp_async_commit();
  tc::cp_async_16(mine + 3, src + l * 4 + 3, 8);  // left in the open group
  o[0] = mine[0];  // read before any wait
  tc::cp_async_wait<2>();
  o[1] = mine[0];
  o[2] = mine[1];
  tc::cp_async_wait<1>();
  o[3] = mine[1];
  tc::cp_async_wait<0>();
  o[4] = mine[2];
  o[5] = mine[3];  // its group was never committed
  tc::cp_async_commit();
  tc::cp_async_wait<0>();
  o[6] = mine[3];
}

void ldmatrix_fragments(const uint16_t* m, uint32_t* out, int num, bool trans) {
  if (num != 1 && num != 2 && num != 4) {
    throw simt::Error("ldmatrix_fragments: num must be 1, 2 or 4, got " + std::to_string(num));
  }
  PAGEDKV_LAUNCH(ldmatrix_kernel, 1, 32, 0, nullptr)(m, out, num, trans);
}

void mma_fragments(const uint32_t* a, const uint32_t* b, const float* c, float* d, bool bf16,
                   int permute) {
  if (bf16) {
    PAGEDKV_LAUNCH(mma_kernel<__nv_bfloat16>, 1, 32, 0, nullptr)(a, b, c, d, permute);
  } else {
    PAGEDKV_LAUNCH(mma_kernel<__half>, 1, 32, 0, nullptr)(a, b, c, d, permute);
  }
}

void tile_matmul(const void* a, const void* b, float* c, int m, int n, int k, bool bf16,
                 bool b_kn, bool wait_after_use) {
  if (m < 1 || n % kTileN != 0 || k % kTileK != 0 || n < 1 || k < 1) {
    throw simt::Error("tile_matmul: m >= 1, n and k positive multiples of 16 expected, got " +
                      std::to_string(m) + ", " + std::to_string(n) + ", " + std::to_string(k));
  }
  const dim3 grid((m + kTileM - 1) / kTileM, n / kTileN);
  const size_t smem = 2 * (kTileM + kTileN) * kTileK * 2;
  if (bf16) {
    using T = __nv_bfloat16;
    PAGEDKV_LAUNCH(tile_matmul_kernel<T>, grid, kTcThreads, smem, nullptr)(
        static_cast<const T*>(a), static_cast<const T*>(b), c, m, n, k, b_kn, wait_after_use);
  } else {
    using T = __half;
    PAGEDKV_LAUNCH(tile_matmul_kernel<T>, grid, kTcThreads, smem, nullptr)(
        static_cast<const T*>(a), static_cast<const T*>(b), c, m, n, k, b_kn, wait_after_use);
  }
}

void cp_async_groups(const void* src, void* out) {
  PAGEDKV_LAUNCH(cp_async_groups_kernel, 1, 32, 32 * 4 * sizeof(uint4), nullptr)(
      static_cast<const uint4*>(src), static_cast<uint4*>(out));
}

}  // namespace simt_selftest
