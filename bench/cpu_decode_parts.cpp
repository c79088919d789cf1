// The three parts of an int4 decode step of the avx512bf16 kernels, alone, in a loop: S = Q K^T
// in quads (qk_rows over qk_lanes_i4, on int8 queries), the quad's softmax (softmax_quad) and
// O += P V (pv_rows_int), on one query group of 4 rows x 32 keys, head size 128, the kernels' own
// functions (csrc/cpu/attention_kernels.inc compiled here). Built and run by
// bench/cpu_decode_parts.sh. What it is for: in place a part also pays for its rows' memory,
// the step's frame and the other parts around it; alone, from L1 or L2, it shows what the part's
// own instructions cost, and a change to one part can be measured in seconds.
//
//   cpu_decode_parts [ROWS] [PARTS] [STEPS]
//
// ROWS: distinct K and V rows the steps draw from at random (64: L1; 4096: L2; 262144: 16 MiB
// each), PARTS: any of S, M (softmax) and P, or "all" (the three in order, as a step runs them),
// STEPS: steps timed (200000). Prints ns and cycles a key (cycles at the clock a dependent add
// chain measures just before).
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

#define PKV_X86 0  // no AMX unit here: the attention_amx.inc part stays out
#define PKV_ISA 3
#define PKV_DOT_PAIRS 1
#define PKV_INT_DOTS 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx512vnni,avx2,fma,f16c")
namespace pagedkv::cpu::parts {
#include "cpu/attention_kernels.inc"

constexpr int kD = 128, kKeys = 32;

// Each part in a function of its own, as in the library (where each is called, not inlined).
[[gnu::noinline]] void part_s(const int16_t* q, Rows<i4x2_t> k, float* s) {
  Ahead<i4x2_t, Rows<i4x2_t>> none{k, 0, kD / 2};
  qk_rows<4, 3, Layout::kQuads>(q, kD, k, kKeys, kD, s, &none);
}
[[gnu::noinline]] void part_m(float* s, const float* ks, const float* vs, const float* qs,
                              float* o, float* m, float* l, int16_t* pq, float* ps) {
  softmax_quad<kKeys>(kKeys, s, ks, vs, qs, o, kD, m, l, pq, ps);
}
[[gnu::noinline]] void part_p(const int16_t* pq, const float* ps, Rows<i4x2_t> v, float* o) {
  Ahead<i4x2_t, Rows<i4x2_t>> none{v, 0, kD / 2};
  pv_rows_int<4, Layout::kQuads>(pq, ps, v, kKeys, kD, o, &none);
}
}  // namespace pagedkv::cpu::parts
#pragma GCC pop_options

int main(int argc, char** argv) {
  using namespace pagedkv::cpu::parts;
  using Clock = std::chrono::steady_clock;
  if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512vnni")) {
    std::printf("needs AVX512_BF16 and AVX512_VNNI (the avx512bf16 kernels)\n");
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
  const size_t row_bytes = kD / 2;
  std::vector<uint8_t> kbuf(rows * row_bytes), vbuf(rows * row_bytes);
  for (auto& b : kbuf) b = static_cast<uint8_t>(rng());
  for (auto& b : vbuf) b = static_cast<uint8_t>(rng());
  const auto* k_base = reinterpret_cast<const i4x2_t*>(kbuf.data());
  const auto* v_base = reinterpret_cast<const i4x2_t*>(vbuf.data());
  // 256 tiles of random rows (the tile's keys past 32: copies, as decode pads them)
  constexpr int kTiles = 256;
  std::vector<int64_t> k_off(kTiles * (TS + 8)), v_off(kTiles * (TS + 8));
  for (int i = 0; i < kTiles * (TS + 8); ++i) {
    k_off[i] = static_cast<int64_t>(rng() % rows) * row_bytes;
    v_off[i] = static_cast<int64_t>(rng() % rows) * row_bytes;
  }
  alignas(64) int16_t q[4 * kD], pq[4 * TS] = {};  // 4 rows as lanes_query writes them
  std::normal_distribution<float> normal;
  alignas(64) float s[4 * TS], o[4 * kD] = {}, ks[TS], vs[TS], qs[4], m[4], l[4], ps[4];
  for (int r = 0; r < 4; ++r) {
    alignas(64) float row[kD];
    for (float& x : row) x = normal(rng);
    lanes_query(row, kD, q + r * kD);
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
      const Rows<i4x2_t> k{k_base, k_off.data() + tile * (TS + 8)};
      const Rows<i4x2_t> v{v_base, v_off.data() + tile * (TS + 8)};
      if (do_s) part_s(q, k, s);
      if (do_m) part_m(s, ks, vs, qs, o, m, l, pq, ps);
      if (do_p) part_p(pq, ps, v, o);
      asm volatile("" : : : "memory");
    }
  };
  run(steps / 10 + 1);  // warm

  // the clock: a chain of dependent adds, one a cycle
  const auto c0 = Clock::now();
  int64_t chain = 0;
  for (int64_t i = 0; i < 200000000; ++i) asm volatile("add $1, %0" : "+r"(chain));
  const double ghz = 2e8 / std::chrono::duration<double>(Clock::now() - c0).count() / 1e9;

  const auto t0 = Clock::now();
  run(steps);
  const double ns = std::chrono::duration<double>(Clock::now() - t0).count() * 1e9 /
                    (double(steps) * kKeys);
  float check = 0.f;
  for (float x : o) check += x;
  std::printf("%s, %d rows: %.2f ns a key, %.1f cycles at %.2f GHz (o sums to %g)\n",
              parts.c_str(), rows, ns, ns * ghz, ghz, check);
  return 0;
}
