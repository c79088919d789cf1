// The three parts of a quantized decode step, alone, in a loop: S = Q K^T in quads (qk_rows),
// the quad's softmax (softmax_quad) and O += P V (pv_rows_int), on one query group of 4 rows x
// 32 keys, head size 128, the kernels' own functions (csrc/cpu/attention_kernels.inc compiled
// here) for one instruction set (PKV_PARTS_ISA: 1 avx2, 3 avx512bf16) and cache format
// (PKV_PARTS_INT4: 1 int4 rows, S on int8 queries (lanes_query); 0 int8 rows, S on int16
// queries). Built and run by bench/cpu_decode_parts.sh. What it is for: in place a part also
// pays for its rows' memory, the step's frame and the other parts around it; alone, from L1 or
// L2, it shows what the part's own instructions cost, and a change to one part can be measured in
// seconds.
//
//   cpu_decode_parts [ROWS] [PARTS] [STEPS]
//
// ROWS: distinct K and V rows the steps draw from at random (64: L1; 4096: L2; 262144: 16 MiB
// each), PARTS: any of S, M (softmax) and P, or "all" (the three in order, as a step runs them),
// STEPS: steps timed (200000, in 20 slices). Prints the fastest slice's ns a key, and cycles at
// the fastest clock a dependent add chain measured between the slices.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu/attention_work.h"

#ifndef __clang__  // GCC 12 reports its own _mm512_undefined_* placeholders as uninitialized
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#ifndef PKV_PARTS_ISA
#define PKV_PARTS_ISA 3
#endif
#ifndef PKV_PARTS_INT4
#define PKV_PARTS_INT4 1
#endif
#define PKV_X86 0  // no AMX unit here: the attention_amx.inc part stays out
#define PKV_ISA PKV_PARTS_ISA
#define PKV_INT_DOTS 1
#pragma GCC push_options
#if PKV_ISA == 3
#define PKV_DOT_PAIRS 1
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx512vnni,avx2,fma,f16c")
#define PKV_PARTS_HAS __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni")
#define PKV_PARTS_NAME "avx512bf16"
#elif PKV_ISA == 1
#pragma GCC target("avx2,fma,f16c")
#define PKV_PARTS_HAS __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
#define PKV_PARTS_NAME "avx2"
#else
#error "PKV_PARTS_ISA: 1 (avx2) or 3 (avx512bf16)"
#endif
namespace pagedkv::cpu::parts {
#include "cpu/attention_kernels.inc"

constexpr int kD = 128, kKeys = 32;
using C = std::conditional_t<PKV_PARTS_INT4, i4x2_t, int8_t>;
constexpr int kRowBytes = PKV_PARTS_INT4 ? kD / 2 : kD;
constexpr int kQRow = PKV_PARTS_INT4 ? i4_query_row(kD) : kD;  // as attend_decode's q_row
static_assert(!PKV_PARTS_INT4 || i4_lanes(kD));

// Each part in a function of its own, as in the library (where each is called, not inlined).
[[gnu::noinline]] void part_s(const int16_t* q, Rows<C> k, float* s) {
  Ahead<C, Rows<C>> none{k, 0, kRowBytes};
  qk_rows<4, 3, Layout::kQuads>(q, kQRow, k, kKeys, kD, s, &none);
}
[[gnu::noinline]] void part_m(float* s, const float* ks, const float* vs, const float* qs,
                              float* o, float* m, float* l, int16_t* pq, float* ps) {
  softmax_quad<kKeys>(kKeys, s, ks, vs, qs, o, kD, m, l, pq, ps);
}
[[gnu::noinline]] void part_p(const int16_t* pq, const float* ps, Rows<C> v, float* o) {
  Ahead<C, Rows<C>> none{v, 0, kRowBytes};
  pv_rows_int<4, Layout::kQuads>(pq, ps, v, kKeys, kD, o, &none);
}
// A query row as attend_decode prepares it for S.
float query_row(const float* row, int16_t* out) {
  if constexpr (PKV_PARTS_INT4) {
    return lanes_query(row, kD, out);
  } else {
    return quantize_query(row, kD, out);
  }
}
}  // namespace pagedkv::cpu::parts
#pragma GCC pop_options

int main(int argc, char** argv) {
  using namespace pagedkv::cpu::parts;
  using Clock = std::chrono::steady_clock;
  if (!(PKV_PARTS_HAS)) {
    std::printf("this processor lacks the " PKV_PARTS_NAME " kernels' instructions\n");
    return 2;
  }
  const int rows = argc > 1 ? std::atoi(argv[1]) : 64;
  const std::string parts = argc > 2 ? argv[2] : "all";
  const int steps = argc > 3 ? std::atoi(argv[3]) : 200000;
  const bool all = parts == "all";
  const bool do_s = all || parts.find('S') != std::string::npos;
  const bool do_m = all || parts.find('M') != std::string::npos;
  const bool do_p = all || parts.find('P') != std::string::npos;
  if (rows < 1 || steps < 1) {
    std::printf("ROWS and STEPS must be positive\n");
    return 2;
  }

  std::mt19937 rng(1);
  const size_t row_bytes = kRowBytes;
  std::vector<uint8_t> kbuf(rows * row_bytes), vbuf(rows * row_bytes);
  for (auto& b : kbuf) b = static_cast<uint8_t>(rng());
  for (auto& b : vbuf) b = static_cast<uint8_t>(rng());
  const auto* k_base = reinterpret_cast<const C*>(kbuf.data());
  const auto* v_base = reinterpret_cast<const C*>(vbuf.data());
  // 256 tiles of random rows (the tile's keys past 32: copies, as decode pads them)
  constexpr int kTiles = 256;
  std::vector<int64_t> k_off(kTiles * (TS + 8)), v_off(kTiles * (TS + 8));
  for (int i = 0; i < kTiles * (TS + 8); ++i) {
    k_off[i] = static_cast<int64_t>(rng() % rows) * row_bytes;
    v_off[i] = static_cast<int64_t>(rng() % rows) * row_bytes;
  }
  alignas(64) int16_t q[4 * kQRow] = {}, pq[4 * TS] = {};  // 4 rows as S reads them
  std::normal_distribution<float> normal;
  alignas(64) float s[4 * TS], o[4 * kD] = {}, ks[TS], vs[TS], qs[4], m[4], l[4], ps[4];
  for (int r = 0; r < 4; ++r) {
    alignas(64) float row[kD];
    for (float& x : row) x = normal(rng);
    query_row(row, q + r * kQRow);
  }
  for (int t = 0; t < TS; ++t) {
    ks[t] = 0.05f + 0.01f * (t % 7);
    vs[t] = 0.1f + 0.02f * (t % 5);
  }
  for (int r = 0; r < 4; ++r) {
    qs[r] = 1e-4f;
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
    ps[r] = 1e-5f;
  }
  for (int i = 0; i < 4 * TS; ++i) s[i] = normal(rng);

  const auto run = [&](int n) {
    for (int st = 0; st < n; ++st) {
      const int tile = st % kTiles;
      const Rows<C> k{k_base, k_off.data() + tile * (TS + 8)};
      const Rows<C> v{v_base, v_off.data() + tile * (TS + 8)};
      if (do_s) part_s(q, k, s);
      if (do_m) part_m(s, ks, vs, qs, o, m, l, pq, ps);
      if (do_p) part_p(pq, ps, v, o);
      asm volatile("" : : : "memory");
    }
  };
  run(steps / 10 + 1);  // warm

  // Timed in 20 slices, each after a measure of the clock (a chain of dependent adds, one a
  // cycle): the fastest slice counts, at the fastest clock measured (a shared host's stalls and
  // slower clocks fall into some slices, and only slow either measure down).
  const auto seconds = [](auto&& fn) {
    const auto t0 = Clock::now();
    fn();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  const int slice = std::max(1, steps / 20);
  double ns = 1e30, ghz = 0.;
  for (int i = 0; i < 20; ++i) {
    ghz = std::max(ghz, 4e6 / seconds([] {
                          int64_t chain = 0;  // 10 adds an iteration: the loop's cost hidden
                          for (int64_t j = 0; j < 400000; ++j)
                            asm volatile(".rept 10\n\tadd $1, %0\n\t.endr" : "+r"(chain));
                        }) / 1e9);
    ns = std::min(ns, seconds([&] { run(slice); }) * 1e9 / (double(slice) * kKeys));
  }
  const double cycles = ns * ghz;
  float check = 0.f;
  for (float x : o) check += x;
  std::printf("%s %s, %s, %d rows: %.2f ns a key, %.1f cycles at %.2f GHz (o sums to %g)\n",
              PKV_PARTS_NAME, PKV_PARTS_INT4 ? "int4" : "int8", parts.c_str(), rows, ns, cycles,
              ghz, check);
  return 0;
}
