// Tensor-core instructions on the emulator: mma.sync.aligned.m16n8k16 (f16 / bf16 in, f32
// accumulate), ldmatrix.sync.aligned.m8n8 (x1 / x2 / x4, .trans) and cp.async 16 bytes with
// commit_group / wait_group. Kernels reach them through kernels/tensor_core.cuh (inline PTX under
// nvcc); the semantics and limits are in docs/simt.md.
//
// mma and ldmatrix are warp collectives of the full warp (all 32 lanes, convergent): each lane
// leaves a record of its operands and waits once; the last lane to arrive computes the whole
// warp's results into the records (tensor_core.cpp). Fragments follow the PTX ISA layouts.
// cp.async fills its destination with 0xff at issue and copies at the wait_group that retires
// its group, so that reading the destination before the wait shows (NaN).
//
// Included by simt.h after the CUDA headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace simt::ptx {

// D = A x B + C: A [16, 16] row-major, B [16, 8] column-major, C and D [16, 8] float.
// Lane l (g = l / 4, t = l % 4) holds, low half first:
//   a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..2t+1], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..]
//   b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g]
//   c[0..3] = C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1] (d alike; d may alias c)
void mma_m16n8k16_f16(float* d, const uint32_t* a, const uint32_t* b, const float* c);
void mma_m16n8k16_bf16(float* d, const uint32_t* a, const uint32_t* b, const float* c);

template <typename T>  // __half or __nv_bfloat16
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                         const float (&c)[4]) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>,
                "mma_m16n8k16: T must be __half or __nv_bfloat16");
  if constexpr (std::is_same_v<T, __half>) {
    mma_m16n8k16_f16(d, a, b, c);
  } else {
    mma_m16n8k16_bf16(d, a, b, c);
  }
}

// ldmatrix .m8n8 .b16 of `num` (1, 2, 4) matrices: lane l gives row l % 8 of matrix l / 8
// (16 bytes, 16-byte aligned; only lanes below 8 * num are read). r[i] gets matrix i's row
// l / 4, elements 2 * (l % 4) and + 1; with `trans`, rows 2 * (l % 4) and + 1 of column l / 4.
void ldmatrix(uint32_t* r, const void* smem_row, int num, bool trans);

// cp.async.cg.shared.global, 16 bytes: src_bytes (0..16) copied, the rest zero-filled.
void cp_async_16(void* smem, const void* gmem, int src_bytes);
void cp_async_commit();
void cp_async_wait(int n);  // lands every group but the newest n committed ones

}  // namespace simt::ptx
