// Element types and conversions used by the kernels, identical under nvcc and simt.
#pragma once
#include "kernels/cache_params.h"
#include "kernels/compat.cuh"

namespace pagedkv {

// fp8 cache elements are raw bytes; the tag type picks the encoding.
struct fp8_e4m3 { __nv_fp8_storage_t bits; };
struct fp8_e5m2 { __nv_fp8_storage_t bits; };

template <typename T> struct is_fp8 { static constexpr bool value = false; };
template <> struct is_fp8<fp8_e4m3> { static constexpr bool value = true; };
template <> struct is_fp8<fp8_e5m2> { static constexpr bool value = true; };

// Integer cache elements, quantized with a scale per (token, head) row (cache_params.h): int8 as
// itself; int4 as a byte holding two elements, 2i in the low nibble and 2i + 1 in the high one
// (a cache row of head_size / 2 of them, its strides counted in bytes).
struct int4x2 { uint8_t bits; };

template <typename T> struct is_int_quant { static constexpr bool value = false; };
template <> struct is_int_quant<int8_t> { static constexpr bool value = true; };
template <> struct is_int_quant<int4x2> { static constexpr bool value = true; };

// A cache of E elements read with a scale per (token, head) row (PagedAttentionParams::
// key_scales / value_scales) where a kernel's cache type argument must tell it from a cache of
// the same elements with per-tensor scales (the tensor-core kernel's fp8): E, then whether the
// rows are scaled, from either form.
template <typename E> struct RowScaled {};
template <typename C> struct cache_elem { using type = C; static constexpr bool kRowScaled = false; };
template <typename E> struct cache_elem<RowScaled<E>> {
  using type = E;
  static constexpr bool kRowScaled = true;
};

// The DType of a per-(token, head) quantized element type (quant_max's argument).
template <typename T> inline constexpr DType kQuantDType = DType::kFp8E4M3;
template <> inline constexpr DType kQuantDType<int8_t> = DType::kInt8;
template <> inline constexpr DType kQuantDType<int4x2> = DType::kInt4;
template <> inline constexpr DType kQuantDType<fp8_e5m2> = DType::kFp8E5M2;

// Returns f.template operator()<C>() for C the element type of a cache of cache_dtype beside
// data of type T: an fp8 tag type, or T itself (the cache holds T's dtype).
template <typename T, typename F>
auto with_cache_type(DType cache_dtype, F&& f) {
  switch (cache_dtype) {
    case DType::kFp8E4M3: return f.template operator()<fp8_e4m3>();
    case DType::kFp8E5M2: return f.template operator()<fp8_e5m2>();
    default: return f.template operator()<T>();
  }
}

// Returns f.template operator()<C>() for C the element type of a cache of cache_dtype quantized
// per (token, head): int8_t, int4x2 or an fp8 tag type; cudaErrorInvalidValue for the others.
template <typename F>
auto with_token_scaled_type(DType cache_dtype, F&& f) {
  switch (cache_dtype) {
    case DType::kInt8: return f.template operator()<int8_t>();
    case DType::kInt4: return f.template operator()<int4x2>();
    case DType::kFp8E4M3: return f.template operator()<fp8_e4m3>();
    case DType::kFp8E5M2: return f.template operator()<fp8_e5m2>();
    default: return cudaErrorInvalidValue;
  }
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(fp8_e4m3 x) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(x.bits, __NV_E4M3)));
}
__device__ __forceinline__ float to_float(fp8_e5m2 x) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(x.bits, __NV_E5M2)));
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
// Saturating round-to-nearest-even, as the reference's clamp-then-cast.
template <> __device__ __forceinline__ fp8_e4m3 from_float<fp8_e4m3>(float x) {
  return {__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)};
}
template <> __device__ __forceinline__ fp8_e5m2 from_float<fp8_e5m2>(float x) {
  return {__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2)};
}

// N elements loaded and stored as one aligned unit (16 bytes for the widest vectors).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

}  // namespace pagedkv
