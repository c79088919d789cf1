// Faulty self-test kernels: each breaks one rule the emulator diagnoses (see selftest.h).
#include <map>

#include "kernels/compat.cuh"
#include "kernels/tensor_core.cuh"
#include "selftest.h"

namespace simt_selftest {

namespace tc = pagedkv::simt::tc;

constexpr unsigned kFull = 0xffffffffu;

// block 128: threads 64-127 return before a __syncthreads the others reach.
__global__ void barrier_after_exit_kernel(float* buf) {
  if (threadIdx.x >= 64) return;
  __syncthreads();
  buf[threadIdx.x] = 1.0f;
}

// block 32: lanes 16-31 exit; lanes 0-15 shuffle with them.
__global__ void shuffle_exited_lane_kernel(float* buf) {
  const int t = threadIdx.x;
  if (t >= 16) return;
  buf[t] = __shfl_xor_sync(kFull, buf[t], 16);
}

// block 48: warp 1 has 16 lanes, its full mask names 16 absent ones.
__global__ void absent_lane_kernel(float* buf) {
  buf[threadIdx.x] = __shfl_sync(kFull, buf[threadIdx.x], 0);
}

// block 32: half the warp calls __shfl_xor_sync, the other half __shfl_down_sync.
__global__ void disagree_op_kernel(float* buf) {
  const int t = threadIdx.x;
  float v = buf[t];
  if (t < 16) {
    v = __shfl_xor_sync(kFull, v, 1);
  } else {
    v = __shfl_down_sync(kFull, v, 1);
  }
  buf[t] = v;
}

// block 32: lanes 16-31 pass a mask that differs from the one lanes 0-15 pass.
__global__ void disagree_mask_kernel(float* buf) {
  const int t = threadIdx.x;
  buf[t] = __shfl_xor_sync(t < 16 ? kFull : 0xffff0001u, buf[t], 1);
}

// block 32: lanes 0-15 wait in a shuffle for lanes that wait in __syncthreads.
__global__ void deadlock_kernel(float* buf) {
  const int t = threadIdx.x;
  if (t < 16) {
    buf[t] = __shfl_sync(kFull, buf[t], 0);
  } else {
    __syncthreads();
  }
}

// block 32: each lane's mask is lane 0 only.
__global__ void mask_excludes_caller_kernel(float* buf) {
  buf[threadIdx.x] = __shfl_sync(0x1u, buf[threadIdx.x], 0);
}

// grid 2, block 32: thread 5 of block 1 traps.
__global__ void trap_kernel(float* buf) {
  if (blockIdx.x == 1 && threadIdx.x == 5) __trap();
  buf[blockIdx.x * blockDim.x + threadIdx.x] = 1.0f;
}

// block 32: an assert fails in thread 7.
__global__ void assert_kernel(float* buf) {
  assert(threadIdx.x != 7);
  buf[threadIdx.x] = 1.0f;
}

// block of 2048 threads: more than a GPU allows.
__global__ void oversized_block_kernel(float* buf) { buf[threadIdx.x] = 1.0f; }

// block 48: an mma in a block whose warp 1 has 16 lanes.
__global__ void mma_partial_warp_kernel(float* buf) {
  const uint32_t a[4] = {}, b[2] = {};
  float acc[4] = {};
  tc::mma_m16n8k16<__nv_bfloat16>(acc, a, b, acc);
  buf[threadIdx.x] = acc[0];
}

// block 32: lanes 16-31 exit; lanes 0-15 wait in an mma for them.
__global__ void mma_divergent_kernel(float* buf) {
  if (threadIdx.x >= 16) return;
  const uint32_t a[4] = {}, b[2] = {};
  float acc[4] = {};
  tc::mma_m16n8k16<__half>(acc, a, b, acc);
  buf[threadIdx.x] = acc[0];
}

// block 32: lanes 0-15 run the bf16 mma, lanes 16-31 the f16 one.
__global__ void mma_disagree_kernel(float* buf) {
  const uint32_t a[4] = {}, b[2] = {};
  float acc[4] = {};
  if (threadIdx.x < 16) {
    tc::mma_m16n8k16<__nv_bfloat16>(acc, a, b, acc);
  } else {
    tc::mma_m16n8k16<__half>(acc, a, b, acc);
  }
  buf[threadIdx.x] = acc[0];
}

// block 32: each thread leaves one committed and one uncommitted cp.async behind at exit.
__global__ void cp_async_pending_at_exit_kernel(float* buf) {
  __shared__ __align__(16) float s[32][4];
  const int t = threadIdx.x;
  tc::cp_async_16(&s[t][0], buf + 4 * t);
  tc::cp_async_commit();
  tc::cp_async_16(&s[t][0], buf + 4 * t);
}

// block 32: a global address 4 bytes past 16-byte alignment.
__global__ void cp_async_misaligned_kernel(float* buf) {
  __shared__ __align__(16) float s[32][4];
  const int t = threadIdx.x;
  tc::cp_async_16(&s[t][0], buf + 4 * t + 1);
  tc::cp_async_wait<0>();
}

// block 32: row addresses 8 bytes past 16-byte alignment.
__global__ void ldmatrix_misaligned_kernel(float* buf) {
  __shared__ __align__(16) uint16_t s[32][16];
  uint32_t r[4];
  tc::ldmatrix_x4(r, &s[threadIdx.x][4]);
  buf[threadIdx.x] = float(r[0]);
}

// block 32: ldmatrix from a local array (thread stack), not shared memory.
__global__ void ldmatrix_local_kernel(float* buf) {
  alignas(16) uint16_t local[8] = {};
  uint32_t r[2];
  tc::ldmatrix_x2_trans(r, local);
  buf[threadIdx.x] = float(r[0]);
}

// block 32, 248 bytes of dynamic shared memory: lane 15 reads a row at offset 240 (to 256).
__global__ void ldmatrix_past_dynamic_smem_kernel(float* buf) {
  PAGEDKV_DYNAMIC_SMEM(uint16_t, s);
  uint32_t r[2];
  tc::ldmatrix_x2(r, s + 8 * (threadIdx.x % 16));
  buf[threadIdx.x] = float(r[0]);
}

// n threads: out[t] = x[t + 1], reading x[n] in the last thread.
__global__ void read_past_end_kernel(const float* x, float* out) {
  out[threadIdx.x] = x[threadIdx.x + 1];
}

// 1 thread: a 16-byte load from x + 1 half (needs 16-byte alignment on a GPU).
__global__ void misaligned_vector_load_kernel(const __half* x, float* out) {
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(x + 1));
  out[0] = __int_as_float(int(v.x));
}

namespace {

struct Fault {
  void (*kernel)(float*);
  unsigned grid, block;
  size_t smem = 0;
};

const std::map<std::string, Fault>& faults() {
  static const std::map<std::string, Fault> table = {
      {"barrier_after_exit", {barrier_after_exit_kernel, 1, 128}},
      {"shuffle_exited_lane", {shuffle_exited_lane_kernel, 1, 32}},
      {"absent_lane", {absent_lane_kernel, 1, 48}},
      {"disagree_op", {disagree_op_kernel, 1, 32}},
      {"disagree_mask", {disagree_mask_kernel, 1, 32}},
      {"deadlock", {deadlock_kernel, 1, 32}},
      {"mask_excludes_caller", {mask_excludes_caller_kernel, 1, 32}},
      {"trap", {trap_kernel, 2, 32}},
      {"assert", {assert_kernel, 1, 32}},
      {"oversized_block", {oversized_block_kernel, 1, 2048}},
      {"mma_partial_warp", {mma_partial_warp_kernel, 1, 48}},
      {"mma_divergent", {mma_divergent_kernel, 1, 32}},
      {"mma_disagree", {mma_disagree_kernel, 1, 32}},
      {"cp_async_pending_at_exit", {cp_async_pending_at_exit_kernel, 1, 32}},
      {"cp_async_misaligned", {cp_async_misaligned_kernel, 1, 32}},
      {"ldmatrix_misaligned", {ldmatrix_misaligned_kernel, 1, 32}},
      {"ldmatrix_local", {ldmatrix_local_kernel, 1, 32}},
      {"ldmatrix_past_dynamic_smem", {ldmatrix_past_dynamic_smem_kernel, 1, 32, 248}},
  };
  return table;
}

}  // namespace

void run_fault(const std::string& name) {
  const auto it = faults().find(name);
  if (it == faults().end()) throw simt::Error("run_fault: no fault kernel named '" + name + "'");
  std::vector<float> buf(2048, 1.0f);
  const Fault& f = it->second;
  PAGEDKV_LAUNCH(f.kernel, f.grid, f.block, f.smem, nullptr)(buf.data());
  // A configuration fault (oversized_block) runs nothing: the launch's error says why.
  if (cudaGetLastError() != cudaSuccess) throw simt::Error(simt::last_error_message());
}

void read_past_end(const float* x, float* out, int n) {
  PAGEDKV_LAUNCH(read_past_end_kernel, 1, n, 0, nullptr)(x, out);
}

void misaligned_vector_load(const void* x, float* out) {
  auto k = misaligned_vector_load_kernel;
  PAGEDKV_LAUNCH(k, 1, 1, 0, nullptr)(static_cast<const __half*>(x), out);
}

std::vector<std::string> fault_names() {
  std::vector<std::string> names;
  for (const auto& entry : faults()) names.push_back(entry.first);
  return names;
}

}  // namespace simt_selftest
