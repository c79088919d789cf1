// Tensor-core instructions for the kernels, one text for both compilers: inline PTX under nvcc
// (sm_80 and newer), the emulator's implementation under a host compiler (csrc/simt/
// tensor_core.h; semantics and limits in docs/simt.md).
//
// mma and ldmatrix are warp-collective and .aligned: every lane of the warp calls them together,
// convergent. Fragments are exactly the PTX ISA's "Matrix Fragments for mma.m16n8k16" (f16 /
// bf16): with g = lane / 4 and t = lane % 4, each 32-bit register holds two 16-bit elements, the
// lower column (or row) index in the lower half:
//   a[0] = A[g][2t, 2t+1]   a[1] = A[g+8][2t, 2t+1]   a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][..]
//   b[0] = B[2t, 2t+1][g]   b[1] = B[2t+8, 2t+9][g]
//   c/d[0..3] = C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]
#pragma once

#include "kernels/compat.cuh"

#include <type_traits>

namespace pagedkv {
namespace PAGEDKV_KERNEL_NS {
namespace tc {

// The instructions need sm_80; an older target gets a trap (the kernels are dispatched on
// sm_80+ only).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define PAGEDKV_TC_UNSUPPORTED 1
#endif

// D = A x B + C, m16n8k16: A row-major 16x16, B column-major 16x8 (T each), fp32 accumulators.
// d may be c.
template <typename T>  // __half or __nv_bfloat16
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2], const float (&c)[4]) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>,
                "mma_m16n8k16: T must be __half or __nv_bfloat16");
#if defined(PAGEDKV_TC_UNSUPPORTED)
  __trap();
#elif defined(__CUDACC__)
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
  }
#else
  ::simt::ptx::mma_m16n8k16<T>(d, a, b, c);
#endif
}

#if defined(__CUDACC__)
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#endif

// ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16: lane l passes the address of row l % 8
// of matrix l / 8 (16 bytes, 16-byte aligned; lanes from 8 * count on are ignored). r[i] gets
// matrix i's row l / 4, elements 2 * (l % 4) and 2 * (l % 4) + 1; with .trans, the transposed
// matrix's (column l / 4, rows 2 * (l % 4) and 2 * (l % 4) + 1).
#if defined(PAGEDKV_TC_UNSUPPORTED)
#define PAGEDKV_TC_LDMATRIX(NAME, N, TRANS, PTX, OUTS, ...)                                \
  __device__ __forceinline__ void NAME(uint32_t (&r)[N], const void* smem_row) {          \
    (void)r, (void)smem_row;                                                               \
    __trap();                                                                              \
  }
#elif defined(__CUDACC__)
#define PAGEDKV_TC_LDMATRIX(NAME, N, TRANS, PTX, OUTS, ...)                                \
  __device__ __forceinline__ void NAME(uint32_t (&r)[N], const void* smem_row) {          \
    asm volatile(PTX " " OUTS ", [%" #N "];"                                               \
                 : __VA_ARGS__                                                             \
                 : "r"(shared_address(smem_row))                                           \
                 : "memory");                                                              \
  }
#else
#define PAGEDKV_TC_LDMATRIX(NAME, N, TRANS, PTX, OUTS, ...)                                \
  __device__ __forceinline__ void NAME(uint32_t (&r)[N], const void* smem_row) {          \
    ::simt::ptx::ldmatrix(r, smem_row, N, TRANS);                                          \
  }
#endif
PAGEDKV_TC_LDMATRIX(ldmatrix_x1, 1, false, "ldmatrix.sync.aligned.m8n8.x1.shared.b16", "{%0}",
                    "=r"(r[0]))
PAGEDKV_TC_LDMATRIX(ldmatrix_x2, 2, false, "ldmatrix.sync.aligned.m8n8.x2.shared.b16",
                    "{%0, %1}", "=r"(r[0]), "=r"(r[1]))
PAGEDKV_TC_LDMATRIX(ldmatrix_x4, 4, false, "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                    "{%0, %1, %2, %3}", "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]))
PAGEDKV_TC_LDMATRIX(ldmatrix_x1_trans, 1, true, "ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16",
                    "{%0}", "=r"(r[0]))
PAGEDKV_TC_LDMATRIX(ldmatrix_x2_trans, 2, true, "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16",
                    "{%0, %1}", "=r"(r[0]), "=r"(r[1]))
PAGEDKV_TC_LDMATRIX(ldmatrix_x4_trans, 4, true, "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                    "{%0, %1, %2, %3}", "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]))
#undef PAGEDKV_TC_LDMATRIX

// cp.async.cg.shared.global [smem], [gmem], 16: per thread, not collective. src_bytes 16 copies,
// 0 writes 16 zero bytes without reading gmem (the ignore-src predicate: one LDGSTS.ZFILL, no
// address arithmetic). Both addresses 16-byte aligned. The copy is asynchronous: it is complete
// only after the cp_async_wait that retires its group.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes = 16) {
#if defined(PAGEDKV_TC_UNSUPPORTED)
  (void)smem, (void)gmem, (void)src_bytes;
  __trap();
#elif defined(__CUDACC__)
  asm volatile(
      "{\n .reg .pred skip;\n setp.eq.s32 skip, %2, 0;\n"
      " cp.async.cg.shared.global [%0], [%1], 16, skip;\n}"
      :
      : "r"(shared_address(smem)), "l"(gmem), "r"(src_bytes)
      : "memory");
#else
  ::simt::ptx::cp_async_16(smem, gmem, src_bytes);
#endif
}

// cp.async.commit_group: the thread's copies issued since the last commit form a group.
__device__ __forceinline__ void cp_async_commit() {
#if defined(PAGEDKV_TC_UNSUPPORTED)
  __trap();
#elif defined(__CUDACC__)
  asm volatile("cp.async.commit_group;" ::: "memory");
#else
  ::simt::ptx::cp_async_commit();
#endif
}

// cp.async.wait_group N: waits until at most the newest N committed groups are pending (all
// older ones complete). Other threads see the data only after a barrier that follows.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  static_assert(N >= 0, "cp_async_wait: N must be >= 0");
#if defined(PAGEDKV_TC_UNSUPPORTED)
  __trap();
#elif defined(__CUDACC__)
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#else
  ::simt::ptx::cp_async_wait(N);
#endif
}

#undef PAGEDKV_TC_UNSUPPORTED

}  // namespace tc
}  // namespace PAGEDKV_KERNEL_NS
}  // namespace pagedkv
