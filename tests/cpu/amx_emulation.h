// AMX-BF16 tiles in software, for tests/cpu/bf16_pairs_set.cpp: the eight tile registers of
// cpu/attention_amx.inc's configuration (16 rows x 64 bytes each) as thread-local memory, and
// the intrinsics it uses as functions over them, after Intel's pseudocode for tileloadd,
// tilestored, tilezero and tdpbf16ps (bfloat16 pairs multiplied as floats with denormal inputs
// taken as zero, accumulated in float, pair by pair). Lets the AMX prefill run, against the
// double-precision reference, on processors without AMX.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include <cmath>
#include <cstring>

namespace pagedkv::cpu::amx_emulation {

struct Tiles {
  alignas(64) uint8_t reg[8][16][64];
};
inline thread_local Tiles tiles;

inline void load(int t, const void* base, long stride) {
  for (int r = 0; r < 16; ++r)
    std::memcpy(tiles.reg[t][r], static_cast<const char*>(base) + r * stride, 64);
}
inline void store(int t, void* base, long stride) {
  for (int r = 0; r < 16; ++r)
    std::memcpy(static_cast<char*>(base) + r * stride, tiles.reg[t][r], 64);
}
inline void zero(int t) { std::memset(tiles.reg[t], 0, sizeof tiles.reg[t]); }

inline float bf16_daz(uint16_t h) {  // denormals (exponent 0) as signed zero
  const uint32_t bits = (h & 0x7F80u) == 0 ? uint32_t(h & 0x8000u) << 16 : uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// C[m][n] += sum_k A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1], m, n, k < 16.
inline void dpbf16ps(int c, int a, int b) {
  for (int m = 0; m < 16; ++m) {
    float* crow = reinterpret_cast<float*>(tiles.reg[c][m]);
    const uint16_t* arow = reinterpret_cast<const uint16_t*>(tiles.reg[a][m]);
    for (int k = 0; k < 16; ++k) {
      const uint16_t* brow = reinterpret_cast<const uint16_t*>(tiles.reg[b][k]);
      const float a0 = bf16_daz(arow[2 * k]), a1 = bf16_daz(arow[2 * k + 1]);
      for (int n = 0; n < 16; ++n) {
        crow[n] = std::fma(a0, bf16_daz(brow[2 * n]), crow[n]);
        crow[n] = std::fma(a1, bf16_daz(brow[2 * n + 1]), crow[n]);
      }
    }
  }
}

}  // namespace pagedkv::cpu::amx_emulation

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#undef _tile_release
#define _tile_loadd(t, base, stride) ::pagedkv::cpu::amx_emulation::load(t, base, stride)
#define _tile_stored(t, base, stride) ::pagedkv::cpu::amx_emulation::store(t, base, stride)
#define _tile_zero(t) ::pagedkv::cpu::amx_emulation::zero(t)
#define _tile_dpbf16ps(c, a, b) ::pagedkv::cpu::amx_emulation::dpbf16ps(c, a, b)
#define _tile_loadconfig(config) ((void)(config))
#define _tile_release() ((void)0)
#define PKV_AMX_EMULATE 1
