// Half and bfloat16 math that cuda_fp16.h / cuda_bf16.h declare only for the device:
// computed in float and rounded once to the 16-bit type.
#pragma once

#include <cmath>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define SIMT_HALF_MATH(H, H2, TO_FLOAT, FROM_FLOAT)                                              \
  inline H __hfma(H a, H b, H c) {                                                              \
    return FROM_FLOAT(std::fma(TO_FLOAT(a), TO_FLOAT(b), TO_FLOAT(c)));                         \
  }                                                                                             \
  inline H2 __hfma2(H2 a, H2 b, H2 c) { return H2(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)); } \
  inline H hexp(H x) { return FROM_FLOAT(std::exp(TO_FLOAT(x))); }                              \
  inline H hexp2(H x) { return FROM_FLOAT(std::exp2(TO_FLOAT(x))); }                            \
  inline H hlog(H x) { return FROM_FLOAT(std::log(TO_FLOAT(x))); }                              \
  inline H hsqrt(H x) { return FROM_FLOAT(std::sqrt(TO_FLOAT(x))); }                            \
  inline H hrsqrt(H x) { return FROM_FLOAT(1.0f / std::sqrt(TO_FLOAT(x))); }                    \
  inline H hrcp(H x) { return FROM_FLOAT(1.0f / TO_FLOAT(x)); }                                 \
  inline H htanh(H x) { return FROM_FLOAT(std::tanh(TO_FLOAT(x))); }                            \
  inline H2 h2exp(H2 x) { return H2(hexp(x.x), hexp(x.y)); }                                    \
  inline H2 h2exp2(H2 x) { return H2(hexp2(x.x), hexp2(x.y)); }                                 \
  inline H2 h2log(H2 x) { return H2(hlog(x.x), hlog(x.y)); }                                    \
  inline H2 h2sqrt(H2 x) { return H2(hsqrt(x.x), hsqrt(x.y)); }                                 \
  inline H2 h2rsqrt(H2 x) { return H2(hrsqrt(x.x), hrsqrt(x.y)); }
SIMT_HALF_MATH(__half, __half2, __half2float, __float2half)
SIMT_HALF_MATH(__nv_bfloat16, __nv_bfloat162, __bfloat162float, __float2bfloat16)
#undef SIMT_HALF_MATH

inline int __half2int_rn(__half x) { return int(std::nearbyint(__half2float(x))); }
inline int __bfloat162int_rn(__nv_bfloat16 x) { return int(std::nearbyint(__bfloat162float(x))); }
