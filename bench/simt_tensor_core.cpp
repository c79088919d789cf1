// What the emulated tensor-core instructions cost on the simt emulator (csrc/simt, compiled with
// the flags setup.py gives pagedkv._simt): CPU time per warp instruction of mma.sync m16n8k16,
// ldmatrix.x4 and, for scale, __syncwarp and __shfl_xor_sync (plain warp collectives); per
// thread for cp.async 16 bytes with its commit_group and wait_group. One block of 4 warps, each
// looping over the instruction, on one worker. Built and run by bench/simt_tensor_core.sh.
//
//   simt_tensor_core [ITERATIONS]
#include <time.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/tensor_core.cuh"

namespace tc = pagedkv::simt::tc;

constexpr int kThreads = 128, kWarps = kThreads / 32;

__global__ void mma_loop(float* out, int iterations) {
  const uint32_t a[4] = {0x3f803f80u, 1, 2, 3}, b[2] = {0x3f803f80u, 5};
  float acc[4] = {};
  for (int i = 0; i < iterations; ++i) tc::mma_m16n8k16<__nv_bfloat16>(acc, a, b, acc);
  out[threadIdx.x] = acc[0];
}

__global__ void ldmatrix_loop(float* out, int iterations) {
  __shared__ __align__(16) uint16_t tile[kThreads][8];
  for (int e = 0; e < 8; ++e) tile[threadIdx.x][e] = uint16_t(e);
  __syncthreads();
  uint32_t r[4], sum = 0;
  for (int i = 0; i < iterations; ++i) {
    tc::ldmatrix_x4(r, &tile[threadIdx.x][0]);
    sum += r[0];
  }
  out[threadIdx.x] = float(sum);
}

__global__ void syncwarp_loop(float* out, int iterations) {
  for (int i = 0; i < iterations; ++i) __syncwarp();
  out[threadIdx.x] = 1.0f;
}

__global__ void shuffle_loop(float* out, int iterations) {
  float v = float(threadIdx.x);
  for (int i = 0; i < iterations; ++i) v += __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}

__global__ void cp_async_loop(const float* src, float* out, int iterations) {
  __shared__ __align__(16) float s[kThreads][4];
  for (int i = 0; i < iterations; ++i) {
    tc::cp_async_16(&s[threadIdx.x][0], src + 4 * threadIdx.x);
    tc::cp_async_commit();
    tc::cp_async_wait<0>();
  }
  out[threadIdx.x] = s[threadIdx.x][0];
}

template <typename F>
double cpu_seconds(F run) {
  timespec a, b;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);  // the launching thread is the one worker
  run();
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
  return double(b.tv_sec - a.tv_sec) + double(b.tv_nsec - a.tv_nsec) * 1e-9;
}

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 2000;
  simt::set_workers(1);
  std::vector<float> out(kThreads), src(4 * kThreads, 1.0f);
  float* o = out.data();
  const double per_warp = 1e6 / (double(iterations) * kWarps);
  struct Row {
    const char* name;
    void (*kernel)(float*, int);
  };
  for (const Row& row : {Row{"mma.sync m16n8k16 bf16", mma_loop},
                         Row{"ldmatrix.x4", ldmatrix_loop}, Row{"__syncwarp", syncwarp_loop},
                         Row{"__shfl_xor_sync", shuffle_loop}}) {
    const double s = cpu_seconds([&] {
      PAGEDKV_LAUNCH(row.kernel, 1, kThreads, 0, nullptr)(o, iterations);
    });
    std::printf("%-24s %7.2f us per warp instruction\n", row.name, s * per_warp);
  }
  const double s = cpu_seconds([&] {
    PAGEDKV_LAUNCH(cp_async_loop, 1, kThreads, 0, nullptr)(src.data(), o, iterations);
  });
  std::printf("%-24s %7.3f us per thread (with commit_group and wait_group)\n", "cp.async 16 B",
              s * 1e6 / (double(iterations) * kThreads));
}
