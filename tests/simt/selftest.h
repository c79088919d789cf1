// Emulator self-test kernels (torch-free): host entry points taking host pointers.
// Used by the pagedkv_simt_selftest torch ops (selftest_ops.cpp) and the ctest executable
// (tests/simt/selftest_main.cpp). Each runs one launch and throws simt::Error on failure,
// also when the launch is rejected (a bad configuration, reported by cudaGetLastError).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <driver_types.h>

namespace simt_selftest {

// Two-level reduction (warp shuffles, then shared memory): out[b] = sum(x[b, :]).
// x [blocks, n], out [blocks]; threads in {32, 64, ..., 1024}.
void block_sum(const float* x, float* out, int blocks, int n, int threads);

// Paged-attention loop: warp w handles cache blocks w, w + 4, ...; 8-lane groups reduce with
// shuffles. x [nblocks, 32] -> group_sums [nblocks, 4] and max_sum [1] (max of group sums).
void warp_loop(const float* x, float* group_sums, float* max_sum, int nblocks);

// Tiled transpose through a 32 x 33 static shared tile: in [rows, cols] -> out [cols, rows].
void transpose(const float* in, float* out, int rows, int cols);

// Per-block reversal through dynamic shared memory: in, out [blocks, n], n threads a block.
void reverse_blocks(const float* in, float* out, int blocks, int n);

// Reads dynamic shared memory before writing it: out [blocks, n] gets the poison bits.
void read_poison(uint32_t* out, int blocks, int n);

// 16-byte vector loads of 8 halves (bf16 = false) or bfloat16s (bf16 = true), n = 8 * n_vec
// 16-bit values: y = x * x + x (__hfma2), sums [n_vec] = sum of each vector's 8 values.
void vector_fma(const void* x, void* y, float* sums, int n_vec, bool bf16);

// 3D grid and block: out [gz, gy, gx, bz, by, bx, 4] = (blockIdx x/y/z, threadIdx x/y/z,
// gridDim x/y/z, blockDim x/y/z), each triple packed as x + 16 * y + 256 * z.
void grid3d(int32_t* out, const int grid[3], const int block[3]);

// Votes in a block of `threads` (multiple of 32): pred [threads] -> out [threads, 6] =
// (ballot, any, all, __syncthreads_count, _and, _or).
void votes(const int32_t* pred, uint32_t* out, int threads);

// Atomics from every thread of blocks x threads: counters [4] = (atomicAdd int count,
// atomicMax of global thread id, atomicAdd float count, atomicCAS-increment count).
void atomics(int32_t* counters, int blocks, int threads);

// Warp sums in a block of n threads (n need not be a multiple of 32): each warp reduces with
// __shfl_down_sync over the mask of its existing lanes, discarding reads past its last lane.
// x [n] -> out [ceil(n / 32)]. Also out_of_mask [16]: lanes 0-15 shuffle down by 1 within mask
// 0xffff, so lane 15 reads lane 16, outside the mask: undefined, all ones in the emulator.
void partial_warp_sums(const float* x, float* out, int n);
void shuffle_outside_mask(const float* x, float* out_of_mask);

// Missing __syncthreads between a dynamic shared memory write and a neighbour's read:
// out[t] = in[min(t + 1, n - 1)] when the fibers happen to run in a kind order.
void missing_barrier(const float* in, float* out, int n);

// Memory faults a GPU would hit and only a sanitizer build of the emulator reports:
// the last thread reads x[n] (one past the end); a uint4 load from a 2-byte aligned address.
void read_past_end(const float* x, float* out, int n);
void misaligned_vector_load(const void* x, float* out);

// Tensor-core instructions (kernels/tensor_core.cuh), one warp unless said otherwise.
// ldmatrix .x{num}[.trans] of the matrices m [32, 8] (matrix i is rows 8i..8i+7) staged at
// scattered shared rows: out [32, 4] = each lane's registers (the first num of each row).
void ldmatrix_fragments(const uint16_t* m, uint32_t* out, int num, bool trans);
// mma.m16n8k16 (bf16 or f16) on registers as given: a [32, 4], b [32, 2] (packed pairs),
// c [32, 4] -> d [32, 4], each lane's. permute 1 and 2 are kernels with a wrong fragment mapping.
void mma_fragments(const uint32_t* a, const uint32_t* b, const float* c, float* d, bool bf16,
                   int permute);
// c [m, n] float = a [m, k] x b (bf16 or f16; b [n, k], or [k, n] with b_kn) with cp.async
// double buffering, ldmatrix and mma; n, k multiples of 16. wait_after_use: the kernel computes
// on a stage before its cp.async.wait_group (reads the poison).
void tile_matmul(const void* a, const void* b, float* c, int m, int n, int k, bool bf16,
                 bool b_kn, bool wait_after_use);
// cp.async groups: src [32, 4] 16-byte chunks; each lane copies its 4 to shared memory (chunk 2
// with src_bytes 0, chunk 3 with 8 and left uncommitted) and snapshots them: out [32, 7] =
// chunk 0 before any wait, 0 and 1 after wait_group 2, 1 after 1, 2 and 3 after 0, 3 after a
// commit and wait_group 0.
void cp_async_groups(const void* src, void* out);
// A launch of a kernel that fills `smem` bytes of dynamic shared memory, with this grid and
// block, after cudaFuncSetAttribute(MaxDynamicSharedMemorySize, opt_in) when opt_in > 0:
// returns what cudaGetLastError reported (and checks that it cleared it), the blocks that ran
// in ran[0] (ran [2]) and the emulator's reason in message. Does not throw on a launch error.
cudaError_t launch_config(const int grid[3], const int block[3], size_t smem, int opt_in,
                          int32_t* ran, std::string* message);

// Traffic counters' test kernels: y = x (n floats) by `blocks` blocks of 128 threads, each
// copying all of it, coalesced or wastefully (stride-n/32 lanes; see selftest_kernels.cpp).
void copy(const float* x, float* y, int n, int blocks, bool wasteful);

// Launches the faulty kernel `name` (see fault_names()); always throws simt::Error.
void run_fault(const std::string& name);
std::vector<std::string> fault_names();

}  // namespace simt_selftest
