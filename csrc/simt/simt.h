// simt: runs CUDA kernel source as host C++, each CUDA thread a fiber (design: docs/simt.md).
//
// Include this instead of the CUDA runtime when compiling kernel text with a host compiler.
// It defines the CUDA keywords before any CUDA header (crt/host_defines.h keeps definitions it
// finds), includes the host-usable CUDA headers (half, bfloat16, fp8, vector types, runtime API
// types), then provides what only nvcc would: threadIdx & co, barriers, warp collectives,
// atomics, __ldg, fast-math and bit intrinsics, the half math missing on the host, and the
// tensor-core instructions that kernels reach through kernels/tensor_core.cuh.
#pragma once

#ifdef __CUDACC__
#error "simt/simt.h is for host compilers; nvcc uses the CUDA runtime"
#endif

#define __global__
#define __device__
#define __host__
#define __constant__
#define __launch_bounds__(...)
#define __shared__ static thread_local

#include <cuda_runtime_api.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <vector_types.h>
#include <vector_functions.h>

#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstdio>

#include "simt/device_functions.h"
#include "simt/half_math.h"
#include "simt/runtime.h"
#include "simt/tensor_core.h"

// A failed assert in a kernel raises simt::Error (glibc's assert would abort the process).
// A header that includes <cassert> after this one brings back the aborting version.
#undef assert
#define assert(e) ((e) ? void(0) : ::simt::detail::assert_fail(#e, __FILE__, __LINE__))

#define warpSize 32
#define threadIdx (::simt::detail::current_thread->idx)
#define blockIdx (::simt::detail::current_block->idx)
#define blockDim (::simt::detail::current_block->dim)
#define gridDim (::simt::detail::current_block->grid)

// Runtime calls made by kernel launchers: synchronous host versions, errors are exceptions.
#define cudaGetLastError ::simt::get_last_error
#define cudaPeekAtLastError ::simt::peek_at_last_error
#define cudaGetErrorString ::simt::get_error_string
#define cudaGetDevice ::simt::get_device
#define cudaDeviceGetAttribute ::simt::device_get_attribute
#define cudaFuncSetAttribute ::simt::func_set_attribute
#define cudaMemcpyAsync ::simt::memcpy_async
#define cudaMemsetAsync ::simt::memset_async
