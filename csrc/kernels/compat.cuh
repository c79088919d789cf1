// One kernel text, two compilers.
//
// Under nvcc the kernels are ordinary CUDA. Under g++ (the simt backend) this header first pulls in
// the emulator, which defines the CUDA keywords and builtins and then includes the same CUDA headers.
// Kernel files include this header before anything else and use only the macros below for the
// few places where the two worlds differ.
#pragma once

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#define PAGEDKV_KERNEL_NS cuda
// PAGEDKV_LAUNCH(kernel, grid, block, smem, stream)(args...)
#define PAGEDKV_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>
#define PAGEDKV_DYNAMIC_SMEM(type, name) extern __shared__ __align__(16) type name[]
#else
#include "simt/simt.h"
#define PAGEDKV_KERNEL_NS simt
#define PAGEDKV_LAUNCH(kernel, grid, block, smem, stream) \
  ::simt::Launcher(kernel, grid, block, smem, stream)
#define PAGEDKV_DYNAMIC_SMEM(type, name) type* name = ::simt::dynamic_shared<type>()
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>
