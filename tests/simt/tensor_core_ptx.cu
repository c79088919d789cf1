// Every wrapper of kernels/tensor_core.cuh through nvcc (CMakeLists.txt compiles this for the
// extension's archs, sm_80 and sm_90): the inline PTX assembles, whichever wrappers the project's
// kernels use. The kernel is never launched; `cuobjdump -sass` of the object shows HMMA.16816,
// LDSM.16.M88 / MT88 and LDGSTS.
#include "kernels/tensor_core.cuh"

namespace tc = pagedkv::cuda::tc;

template <typename T>
__global__ void tensor_core_ptx_kernel(const uint4* __restrict__ g,  // [64]
                                       float* __restrict__ out) {    // [32, 4]
  __shared__ __align__(16) uint16_t s[2][32][8];
  const int l = threadIdx.x;
  tc::cp_async_16(&s[0][l][0], g + l);
  tc::cp_async_16(&s[1][l][0], g + 32 + l, l < 16 ? 16 : 0);
  tc::cp_async_commit();
  tc::cp_async_wait<1>();
  tc::cp_async_wait<0>();
  __syncthreads();
  uint32_t a[4], at[4], b[2], bt[2], x1[1], x1t[1];
  tc::ldmatrix_x4(a, &s[0][l][0]);
  tc::ldmatrix_x4_trans(at, &s[1][l][0]);
  tc::ldmatrix_x2(b, &s[1][l % 16][0]);
  tc::ldmatrix_x2_trans(bt, &s[0][l % 16][0]);
  tc::ldmatrix_x1(x1, &s[1][l % 8][0]);
  tc::ldmatrix_x1_trans(x1t, &s[0][l % 8][0]);
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  tc::mma_m16n8k16<T>(acc, a, b, acc);
  const uint32_t b2[2] = {bt[0] ^ x1[0], bt[1] ^ x1t[0]};
  tc::mma_m16n8k16<T>(acc, at, b2, acc);
  for (int i = 0; i < 4; ++i) out[l * 4 + i] = acc[i];
}

template __global__ void tensor_core_ptx_kernel<__half>(const uint4*, float*);
template __global__ void tensor_core_ptx_kernel<__nv_bfloat16>(const uint4*, float*);
