// W-wide float vectors for the CPU attention kernels, written with GCC/clang vector extensions;
// the few operations that need an instruction set's intrinsics (FMA, half conversion, an 8-way
// horizontal sum) take them from PKV_ISA: 0 portable, 1 AVX2 + FMA + F16C, 2 AVX-512F, 3 AVX-512F
// with AVX512_BF16 (the vectors of 2; its bf16 dot products: dot_pairs).
//
// No include guard: included once per instruction set, by cpu/attention_kernels.inc, inside
// namespace pagedkv::cpu::<isa> and under that set's target pragma (see attention_isa.inc).

#if PKV_ISA >= 2
constexpr int W = 16;
#else
constexpr int W = 8;
#endif

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));
typedef uint8_t vb __attribute__((vector_size(W)));

[[gnu::always_inline]] inline vu splat_u32(uint32_t x) {
#if PKV_ISA >= 2
  return (vu)_mm512_set1_epi32(static_cast<int>(x));
#elif PKV_ISA == 1
  return (vu)_mm256_set1_epi32(static_cast<int>(x));
#else
  vu v;
  for (int i = 0; i < W; ++i) v[i] = x;
  return v;
#endif
}

// Cache and query element types other than float, as raw bits.
struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };
struct e4m3_t { uint8_t bits; };
struct e5m2_t { uint8_t bits; };
struct i4x2_t { uint8_t bits; };  // two signed 4-bit elements (DType::kInt4): 2i low, 2i + 1 high

template <typename V, typename T>
inline V load_raw(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf load(const float* p) { return load_raw<vf>(p); }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) {
#if PKV_ISA >= 2
  return _mm512_set1_ps(x);
#elif PKV_ISA == 1
  return _mm256_set1_ps(x);
#else
  vf v;
  for (int i = 0; i < W; ++i) v[i] = x;
  return v;
#endif
}
// Keeps v in a register: the compiler would otherwise fold its load into every instruction
// that uses it (one load per use).
template <typename V>
[[gnu::always_inline]] inline void in_register(V& v) {
#if PKV_ISA >= 1
  __asm__("" : "+x"(v));  // ("+v", any of AVX-512's 32 registers: int4 decode 1.05x slower)
#else
  (void)v;
#endif
}
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf vabs(vf x) { return (vf)((vu)x & 0x7FFFFFFFu); }

// Asks for the cache lines of [p, p + bytes) ahead of their use, into L1 (or, prefetch_l2,
// into L2 only: for more lines than L1 holds beside the work at hand; prefetcht1, which Zen 3
// fills into L1 all the same, and Zen 4 and Intel into L2).
// The lines of `bytes` (> 0) from p: the first outright, the loop from the second, so that a row
// of one line (int4 at head size 128) takes no loop (a loop from the first, over a size known
// at run time, cost int8 and bf16 decode about 3% on a Zen 5).
inline void prefetch(const void* p, int bytes) {
  const char* at = static_cast<const char*>(p);
  __builtin_prefetch(at, 0, 3);
  for (int i = 64; i < bytes; i += 64) __builtin_prefetch(at + i, 0, 3);
}
inline void prefetch_l2(const void* p, int bytes) {
  const char* at = static_cast<const char*>(p);
  __builtin_prefetch(at, 0, 2);
  for (int i = 64; i < bytes; i += 64) __builtin_prefetch(at + i, 0, 2);
}

inline vi iota() {
  vi v;
  for (int i = 0; i < W; ++i) v[i] = i;
  return v;
}

inline vf fmadd(vf a, vf b, vf c) {
#if PKV_ISA >= 2
  return _mm512_fmadd_ps(a, b, c);
#elif PKV_ISA == 1
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

// The horizontal sums of eight vectors, as one vector of 8 floats.
typedef float vf8 __attribute__((vector_size(32)));
#if PKV_ISA >= 2
inline __m256 fold8(vf a) {  // the sum of a's two halves
  return _mm256_add_ps(_mm512_castps512_ps256(a),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
#elif PKV_ISA == 1
inline __m256 fold8(vf a) { return a; }
#endif
inline float hsum(vf v) {
#if PKV_ISA >= 1
  __m256 x = fold8(v);
  __m128 y = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  y = _mm_add_ps(y, _mm_movehl_ps(y, y));
  return _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)));
#else
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
#endif
}

inline float hmax(vf v) {
#if PKV_ISA >= 1
#if PKV_ISA >= 2
  const __m256 x = _mm256_max_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
#else
  const __m256 x = v;
#endif
  __m128 y = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  y = _mm_max_ps(y, _mm_movehl_ps(y, y));
  return _mm_cvtss_f32(_mm_max_ss(y, _mm_movehdup_ps(y)));
#else
  float m = v[0];
  for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
#endif
}

// Always inlined: a 32-byte vector returned by a real call warns (-Wpsabi) in the base build.
[[gnu::always_inline]] inline vf8 hsum8(vf a0, vf a1, vf a2, vf a3, vf a4, vf a5, vf a6,
                                        vf a7) {
#if PKV_ISA >= 1
  // After two rounds of hadd, lane j of h0 (h1) holds half of the sum of a_j (a_4+j).
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(fold8(a0), fold8(a1)),
                                   _mm256_hadd_ps(fold8(a2), fold8(a3)));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(fold8(a4), fold8(a5)),
                                   _mm256_hadd_ps(fold8(a6), fold8(a7)));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20),
                       _mm256_permute2f128_ps(h0, h1, 0x31));
#else
  return vf8{hsum(a0), hsum(a1), hsum(a2), hsum(a3), hsum(a4), hsum(a5), hsum(a6), hsum(a7)};
#endif
}

// The horizontal sums of four vectors.
typedef float vf4 __attribute__((vector_size(16)));
inline vf4 hsum4(vf a0, vf a1, vf a2, vf a3) {
#if PKV_ISA >= 1
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(fold8(a0), fold8(a1)),
                                  _mm256_hadd_ps(fold8(a2), fold8(a3)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
#else
  return vf4{hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
#endif
}

// hsum8 and hsum4 over int32 vectors (the integer dot products' sums): added in int32, exactly,
// then converted once, where converting each vector first cost a conversion a vector.
#if PKV_ISA >= 1
inline __m256i fold8(vi a) {  // the sum of a's two halves
#if PKV_ISA >= 2
  return _mm256_add_epi32(_mm512_castsi512_si256((__m512i)a),
                          _mm512_extracti64x4_epi64((__m512i)a, 1));
#else
  return (__m256i)a;
#endif
}
#endif
[[gnu::always_inline]] inline vf8 hsum8(vi a0, vi a1, vi a2, vi a3, vi a4, vi a5, vi a6,
                                        vi a7) {
#if PKV_ISA >= 1
  const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(fold8(a0), fold8(a1)),
                                       _mm256_hadd_epi32(fold8(a2), fold8(a3)));
  const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(fold8(a4), fold8(a5)),
                                       _mm256_hadd_epi32(fold8(a6), fold8(a7)));
  return (vf8)_mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20),
                                                  _mm256_permute2x128_si256(h0, h1, 0x31)));
#else
  const auto sum = [](vi v) {
    int32_t x = 0;
    for (int i = 0; i < W; ++i) x += v[i];
    return static_cast<float>(x);
  };
  return vf8{sum(a0), sum(a1), sum(a2), sum(a3), sum(a4), sum(a5), sum(a6), sum(a7)};
#endif
}
inline vf4 hsum4(vi a0, vi a1, vi a2, vi a3) {
#if PKV_ISA >= 1
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(fold8(a0), fold8(a1)),
                                      _mm256_hadd_epi32(fold8(a2), fold8(a3)));
  return (vf4)_mm_cvtepi32_ps(
      _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
#else
  const vf8 x = hsum8(a0, a1, a2, a3, vi{}, vi{}, vi{}, vi{});
  return vf4{x[0], x[1], x[2], x[3]};
#endif
}

// IEEE half bits to float, exact (subnormals, inf and NaN included).
inline vf half_to_float(vh h) {
#if PKV_ISA >= 2
  return _mm512_cvtph_ps((__m256i)h);
#elif PKV_ISA == 1
  return _mm256_cvtph_ps((__m128i)h);
#else
  // Maratyszcza's branch-free conversion (FP16 library, fp16_ieee_to_fp32_value).
  const vu w = __builtin_convertvector(h, vu) << 16;
  const vu sign = w & 0x80000000u;
  const vu two_w = w + w;
  const vf normalized = (vf)((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const vf denormalized = (vf)((two_w >> 17) | (126u << 23)) - 0.5f;
  const vu bits = two_w < (1u << 27) ? (vu)denormalized : (vu)normalized;
  return (vf)(sign | bits);
#endif
}

// W elements of a cache or query row as floats.
inline vf load_float(const float* p) { return load(p); }
inline vf load_float(const bf16_t* p) {
#if PKV_ISA >= 2
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(load_raw<__m256i>(p)), 16);
#elif PKV_ISA == 1
  return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(load_raw<__m128i>(p)), 16);
#else
  return (vf)(__builtin_convertvector(load_raw<vh>(p), vu) << 16);
#endif
}
// 2W bfloat16 elements: the even ones in even, the odd ones in odd (one load, a shift and a
// mask: cheaper than two widening loads).
inline void load_pairs(const bf16_t* p, vf& even, vf& odd) {
  const vu x = load_raw<vu>(p);
  even = (vf)(x << 16);
  odd = (vf)(x & 0xFFFF0000u);
}
inline vf load_float(const f16_t* p) { return half_to_float(load_raw<vh>(p)); }

// bfloat16 pairs: each 32-bit lane holds two bfloat16 numbers, the first in its low half (as
// two consecutive elements of a bf16 row sit in memory). dot_pairs(acc, a, b) adds to each lane
// a.lo * b.lo + a.hi * b.hi: one vdpbf16ps with AVX512_BF16 (its products are exact, its sums
// rounded to nearest even, denormals flushed), two FMAs elsewhere.
[[gnu::always_inline]] inline vf dot_pairs(vf acc, vu a, vu b) {
#if PKV_ISA == 3
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
  acc = fmadd((vf)(a << 16), (vf)(b << 16), acc);
  return fmadd((vf)(a & 0xFFFF0000u), (vf)(b & 0xFFFF0000u), acc);
#endif
}
// Rounds lo and hi (finite) to bfloat16, nearest even, as pairs.
[[gnu::always_inline]] inline vu round_pairs(vf lo, vf hi) {
  const vu a = (vu)lo, b = (vu)hi;
  const vu ra = (a + 0x7FFFu + ((a >> 16) & 1u)) >> 16;
  const vu rb = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  return ra | rb;
}

// float8_e5m2 is a half's high byte: the byte moved up (with AVX2 one vpunpcklbw with zero; GCC
// widened the 8-byte vector in two halves and shifted it).
inline vf load_float(const e5m2_t* p) {
#if PKV_ISA == 1
  return _mm256_cvtph_ps(
      _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  return half_to_float(__builtin_convertvector(load_raw<vb>(p), vh) << 8);
#endif
}
typedef int8_t vsb __attribute__((vector_size(W)));
// W bytes sign-extended to int32 lanes: vpmovsxbd (GCC builds the conversion of a vector of 8
// bytes element by element).
inline vi widen_i8(const void* p) {
#if PKV_ISA >= 2
  return (vi)_mm512_cvtepi8_epi32(load_raw<__m128i>(static_cast<const char*>(p)));
#elif PKV_ISA == 1
  return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
#else
  return __builtin_convertvector(load_raw<vsb>(static_cast<const char*>(p)), vi);
#endif
}
inline vf load_float(const int8_t* p) { return __builtin_convertvector(widen_i8(p), vf); }

// float8_e4m3fn S.EEEE.MMM: the byte sign-extended and shifted left by 20 puts S in bits 31-27
// and EEEE.MMM in 26-20; clearing 30-27 leaves the float 2^-120 times the number, normal or
// subnormal as the number is (exponent field EEEE), which one multiply by 2^120 makes exact.
// S.1111.111 is NaN. (Through a half and vcvtph2ps, as e5m2, took about twice the instructions.)
// x: the bytes sign-extended (widen_i8); NaN read as 480.
[[gnu::always_inline]] inline vf e4m3_finite(vi x) {
  return (vf)(((vu)x << 20) & 0x87F00000u) * 0x1p120f;
}
inline vf load_float(const e4m3_t* p) {
  const vi x = widen_i8(p);
  return (x & 0x7F) == 0x7F ? splat(__builtin_nanf("")) : e4m3_finite(x);
}

// An element of e4m3 rows known to hold no NaN (float8_e4m3fn has no infinity: all finite):
// load_float(e4m3_t) without its NaN compare and blend, 4 instructions per W elements where
// that takes 7 on AVX2. Decode reads a step's rows so when e4m3_nan finds none.
struct e4m3f_t { uint8_t bits; };
inline vf load_float(const e4m3f_t* p) { return e4m3_finite(widen_i8(p)); }

#if PKV_ISA == 3
// The 128 nibbles of 64 bytes of an int4 row as bytes (their codes, 0..15), in element order:
// out[0] elements 0-63, out[1] 64-127. For unpack_int4 and the prefill's bfloat16 rows.
[[gnu::always_inline]] inline void i4_codes(__m512i x, __m512i* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i lo = _mm512_and_si512(x, low4);
  const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), low4);
  // per 128-bit lane: elements 0-31 of its 16 bytes in a, b; put back in lane order
  const __m512i a = _mm512_unpacklo_epi8(lo, hi), b = _mm512_unpackhi_epi8(lo, hi);
  out[0] = _mm512_permutex2var_epi64(a, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), b);
  out[1] = _mm512_permutex2var_epi64(a, _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15), b);
}
#endif

// The 2n signed 4-bit elements of n bytes of an int4 row as int8, in element order: each half
// of a byte through a 16-entry table (vpshufb: nibble -> its signed value), the two halves
// interleaved, 64 bytes at a time with AVX-512BW, 32 with AVX2; SSE2's 16 by masks and shifts.
inline void unpack_int4(const i4x2_t* src, int n, int8_t* dst) {
  int i = 0;
#if PKV_ISA >= 1
  const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
#if PKV_ISA == 3
  {
    const __m512i lut = _mm512_broadcast_i32x4(table);
    for (; i + 64 <= n; i += 64) {
      __m512i e[2];
      i4_codes(load_raw<__m512i>(src + i), e);
      _mm512_storeu_si512(dst + 2 * i, _mm512_shuffle_epi8(lut, e[0]));
      _mm512_storeu_si512(dst + 2 * i + 64, _mm512_shuffle_epi8(lut, e[1]));
    }
  }
#endif
  {
    const __m256i lut = _mm256_broadcastsi128_si256(table), low4 = _mm256_set1_epi8(0x0F);
    for (; i + 32 <= n; i += 32) {
      const __m256i x = load_raw<__m256i>(src + i);
      const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(x, low4));
      const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(x, 4), low4));
      const __m256i a = _mm256_unpacklo_epi8(lo, hi), b = _mm256_unpackhi_epi8(lo, hi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * i),
                          _mm256_permute2x128_si256(a, b, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * i + 32),
                          _mm256_permute2x128_si256(a, b, 0x31));
    }
  }
#endif
#if defined(__SSE2__)
  const __m128i low4 = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
  for (; i + 16 <= n; i += 16) {
    const __m128i x = load_raw<__m128i>(src + i);
    // nibbles as 0..15, then sign-extended: (v ^ 8) - 8
    const __m128i lo = _mm_sub_epi8(_mm_xor_si128(_mm_and_si128(x, low4), eight), eight);
    const __m128i hi = _mm_sub_epi8(
        _mm_xor_si128(_mm_and_si128(_mm_srli_epi16(x, 4), low4), eight), eight);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i), _mm_unpacklo_epi8(lo, hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i + 16), _mm_unpackhi_epi8(lo, hi));
  }
#endif
  for (; i < n; ++i) {
    const int8_t x = static_cast<int8_t>(src[i].bits);
    dst[2 * i] = static_cast<int8_t>(static_cast<int8_t>(x << 4) >> 4);
    dst[2 * i + 1] = static_cast<int8_t>(x >> 4);
  }
}

// int16 pairs, for the integer dot products of int8 and int4 rows (kIntDots): each 32-bit lane
// holds two int16 numbers, the first in its low half. dot_i16(acc, a, b) adds to each lane
// a.lo * b.lo + a.hi * b.hi, exactly (no saturation): one vpdpwssd with AVX512_VNNI, vpmaddwd +
// vpaddd with AVX2, shifts and multiplies elsewhere.
[[gnu::always_inline]] inline vi dot_i16(vi acc, vi a, vi b) {
#if PKV_ISA == 3
  return (vi)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)a, (__m512i)b);
#elif PKV_ISA == 1
  return acc + (vi)_mm256_madd_epi16((__m256i)a, (__m256i)b);
#else
  return acc + ((a << 16) >> 16) * ((b << 16) >> 16) + (a >> 16) * (b >> 16);
#endif
}
// 2W int8 elements widened to W int16 pairs (lane i: elements 2i and 2i + 1); load_i16_half
// widens W elements into the low W / 2 lanes, the others 0.
typedef int8_t vsb2 __attribute__((vector_size(2 * W)));
typedef int16_t vs16 __attribute__((vector_size(4 * W)));
[[gnu::always_inline]] inline vi load_i16_pairs(const int8_t* p) {
#if PKV_ISA == 3
  return (vi)_mm512_cvtepi8_epi16(load_raw<__m256i>(p));
#elif PKV_ISA == 1
  return (vi)_mm256_cvtepi8_epi16(load_raw<__m128i>(p));
#else
  return (vi)__builtin_convertvector(load_raw<vsb2>(p), vs16);
#endif
}
[[gnu::always_inline]] inline vi load_i16_half(const int8_t* p) {
#if PKV_ISA == 3
  return (vi)_mm512_zextsi256_si512(_mm256_cvtepi8_epi16(load_raw<__m128i>(p)));
#elif PKV_ISA == 1
  return (vi)_mm256_zextsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vsb2 x = {};
  std::memcpy(&x, p, W);
  return (vi)__builtin_convertvector(x, vs16);
#endif
}

// Columns [c, c + 2W) of two int8 rows a and b as int16 pairs (a[j], b[j]), one column a lane,
// in two vectors: with AVX-512 (in-lane byte interleaves) lo holds columns 0-7 and 16-23 of the
// 32, hi 8-15 and 24-31 (kIntPairOrder); elsewhere lo holds the first W columns, hi the next W.
// load_v_pairs_half: W columns, in order.
constexpr bool kIntPairOrder = PKV_ISA == 3;
[[gnu::always_inline]] inline void load_v_pairs(const int8_t* a, const int8_t* b, vi& lo,
                                                vi& hi) {
#if PKV_ISA == 3
  const __m256i x = load_raw<__m256i>(a), y = load_raw<__m256i>(b);
  lo = (vi)_mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(x, y));
  hi = (vi)_mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(x, y));
#elif PKV_ISA == 1
  const __m128i x = load_raw<__m128i>(a), y = load_raw<__m128i>(b);
  lo = (vi)_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(x, y));
  hi = (vi)_mm256_cvtepi8_epi16(_mm_unpackhi_epi8(x, y));
#else
  vs16 l, h;
  for (int j = 0; j < W; ++j) {
    l[2 * j] = a[j];
    l[2 * j + 1] = b[j];
    h[2 * j] = a[W + j];
    h[2 * j + 1] = b[W + j];
  }
  lo = (vi)l;
  hi = (vi)h;
#endif
}
[[gnu::always_inline]] inline vi load_v_pairs_half(const int8_t* a, const int8_t* b) {
#if PKV_ISA == 3
  const __m128i x = load_raw<__m128i>(a), y = load_raw<__m128i>(b);
  return (vi)_mm512_cvtepi8_epi16(
      _mm256_setr_m128i(_mm_unpacklo_epi8(x, y), _mm_unpackhi_epi8(x, y)));
#elif PKV_ISA == 1
  const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a));
  const __m128i y = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b));
  return (vi)_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(x, y));
#else
  vs16 l;
  for (int j = 0; j < W; ++j) {
    l[2 * j] = a[j];
    l[2 * j + 1] = b[j];
  }
  return (vi)l;
#endif
}
#if PKV_ISA == 1
// AVX2: half H of the 4W columns [c, c + 4W) of two int8 rows as int16 pairs in two vectors,
// by in-lane instructions only: the rows' bytes interleaved, then each byte widened beside its
// sign (vpcmpgtb against 0); lo holds columns c + 8H + {0-3, 16-19}, hi c + 8H + {4-7, 20-23}
// (lane_columns puts them in order). vpmovsxbw from a register (load_v_pairs) crosses lanes, and
// on a Zen 3 it takes a multiply pipe from vpmaddwd.
template <int H>
[[gnu::always_inline]] inline void load_v_pairs_lanes(const int8_t* a, const int8_t* b, vi& lo,
                                                      vi& hi) {
  const __m256i x = load_raw<__m256i>(a), y = load_raw<__m256i>(b);
  const __m256i z = H ? _mm256_unpackhi_epi8(x, y) : _mm256_unpacklo_epi8(x, y);
  const __m256i sign = _mm256_cmpgt_epi8(_mm256_setzero_si256(), z);
  lo = (vi)_mm256_unpacklo_epi8(z, sign);
  hi = (vi)_mm256_unpackhi_epi8(z, sign);
}
// Two vectors in load_v_pairs_lanes' order put in column order: lo the first W columns
// (c + 8H + 0-7), hi the W after 2W (c + 8H + 16-23).
[[gnu::always_inline]] inline void lane_columns(vf& lo, vf& hi) {
  const vf first = _mm256_permute2f128_ps(lo, hi, 0x20);
  hi = _mm256_permute2f128_ps(lo, hi, 0x31);
  lo = first;
}
#endif

// int4 rows in registers (kIntDots, head sizes a multiple of 4W): nibbles sign-extended to
// int16 by shifts, with no int8 copy of the row.
//
// For S: 4W bytes of a K row (8W elements) as 2W int16 words, word m holding elements 4m to
// 4m + 3 (a nibble each, element 4m in the low one): i4_nibbles<i> gives element 4m + i in
// word m, a vector of W int16 pairs for dot_i16. The query is permuted to match (permute_i4).
// load_i4_words_half reads 2W bytes into the low W words, the others 0.
[[gnu::always_inline]] inline vs16 load_i4_words(const i4x2_t* p) { return load_raw<vs16>(p); }
[[gnu::always_inline]] inline vs16 load_i4_words_half(const i4x2_t* p) {
#if PKV_ISA >= 2
  return (vs16)_mm512_zextsi256_si512(load_raw<__m256i>(p));
#elif PKV_ISA == 1
  return (vs16)_mm256_zextsi128_si256(load_raw<__m128i>(p));
#else
  vs16 w = {};
  std::memcpy(&w, p, 2 * W);
  return w;
#endif
}
template <int I>
[[gnu::always_inline]] inline vi i4_nibbles(vs16 w) {
  if constexpr (I == 3) {
    return (vi)(w >> 12);
  } else {
    return (vi)((vs16)(w << (12 - 4 * I)) >> 12);
  }
}

// Columns [c, c + 4W) of two int4 rows a and b (2W bytes each, from byte c / 2) as int16 pairs
// (a's element, b's), one column a lane, in four vectors: vector j's lane l holds column
// c + i4_pair_column(j, l) (the order of in-lane byte interleaves, restored by unpair_i4).
constexpr int i4_pair_column(int j, int l) {
  return 2 * ((j >= 2 ? 8 : 0) + (l < 8 ? l : l + 8)) + (j & 1);
}
[[gnu::always_inline]] inline void load_v_pairs_i4(const i4x2_t* a, const i4x2_t* b, vi* out) {
  // bytes (a's, b's) of a column pair, sign-extended to int16: the low nibble by << 12 >> 12,
  // the high one by >> 4
  vs16 lo, hi;
#if PKV_ISA == 3
  const __m256i x = load_raw<__m256i>(a), y = load_raw<__m256i>(b);
  lo = (vs16)_mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(x, y));
  hi = (vs16)_mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(x, y));
#elif PKV_ISA == 1
  // In lanes (vpmovsxbw from a register crosses them, and on a Zen 3 takes a multiply pipe from
  // vpmaddwd): the rows' 16 bytes in both lanes, interleaved, then each byte pair's bytes
  // doubled, pairs 0-3 in the low lane and 4-7 in the high one (vpshufb), so that a word holds
  // a byte twice: << 12 >> 12 is its low nibble, >> 12 its high one.
  const __m256i x = _mm256_broadcastsi128_si256(load_raw<__m128i>(a));
  const __m256i y = _mm256_broadcastsi128_si256(load_raw<__m128i>(b));
  const __m256i twice = _mm256_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9,
                                         9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  lo = (vs16)_mm256_shuffle_epi8(_mm256_unpacklo_epi8(x, y), twice);
  hi = (vs16)_mm256_shuffle_epi8(_mm256_unpackhi_epi8(x, y), twice);
  out[0] = (vi)((vs16)(lo << 12) >> 12);
  out[1] = (vi)(lo >> 12);
  out[2] = (vi)((vs16)(hi << 12) >> 12);
  out[3] = (vi)(hi >> 12);
  return;
#else
  for (int l = 0; l < W; ++l) {
    const int byte_lo = i4_pair_column(0, l) / 2, byte_hi = i4_pair_column(2, l) / 2;
    lo[2 * l] = static_cast<int8_t>(a[byte_lo].bits);
    lo[2 * l + 1] = static_cast<int8_t>(b[byte_lo].bits);
    hi[2 * l] = static_cast<int8_t>(a[byte_hi].bits);
    hi[2 * l + 1] = static_cast<int8_t>(b[byte_hi].bits);
  }
#endif
  out[0] = (vi)((vs16)(lo << 12) >> 12);
  out[1] = (vi)(lo >> 4);
  out[2] = (vi)((vs16)(hi << 12) >> 12);
  out[3] = (vi)(hi >> 4);
}

// Rounds W floats (|x| < 2^22) to the nearest integer, ties to even, as int32.
[[gnu::always_inline]] inline vi round_int(vf x) {
  const vf magic = splat(12582912.f);  // 1.5 * 2^23
  return (vi)(x + magic) - (vi)magic;
}
// a * b (|a b| < 2^22) rounded once, to the nearest integer (ties to even), as int32: round_int
// with the product and the magic number in one FMA, whether or not the compiler would contract
// round_int(a * b) (the tests emulate this rounding of the int8 queries exactly).
[[gnu::always_inline]] inline vi round_int_product(vf a, vf b) {
  const vf magic = splat(12582912.f);
  return (vi)fmadd(a, b, magic) - (vi)magic;
}

// c0 x^k + c1 x^(k-1) + ... + ck by Horner's rule: one FMA a coefficient past the first.
template <typename... C>
[[gnu::always_inline]] inline vf horner(vf x, float c0, C... cs) {
  vf p = splat(c0);
  ((p = fmadd(p, x, splat(cs))), ...);
  return p;
}

// exp(xc) for xc in [-87, 88.7], relative error ~2 ulp (Cephes).
inline vf exp_in_range(vf xc) {
  const vf shift = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = fmadd(xc, splat(1.44269504088896341f), shift) - shift;
  vf r = fmadd(n, splat(-0.693359375f), xc);  // r = x - n ln2, in two parts
  r = fmadd(n, splat(2.12194440e-4f), r);
  vf poly = horner(r, 1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                   1.6666665459e-1f, 5.0000001201e-1f);
  poly = fmadd(poly, r * r, r) + 1.f;
  const vi two_n = (__builtin_convertvector(n, vi) + 127) << 23;
  return poly * (vf)two_n;
}

// exp(x): 0 below -87 (and for -inf), +inf above 88.7.
inline vf vexp(vf x) {
  const vf y = exp_in_range(x > 88.7f ? splat(88.7f) : (x < -87.f ? splat(-87.f) : x));
  return x < -87.f ? splat(0.f) : (x > 88.7f ? splat(__builtin_inff()) : y);
}

// Softmax's weights as powers of 2 (the prefill's and decode's online softmax): a row's shift
// (its running max) enters as c = -shift log2(e) (softmax_log2_shift, rounded once per row and
// tile), a logit x's weight is 2^(x log2(e) + c) (softmax_exp: one FMA, then softmax_exp2), and
// the correction of a row's earlier weights when its shift moves from c_old to c_new is
// 2^(c_new - c_old), the same rounded numbers, so that every weight of a row is 2^(x log2(e))
// times one factor (the rounding of c moves the lse by |shift| 2^-24, no weight against
// another). The product x log2(e) rounds t by |t| 2^-24 at most (a weight e^-20 by 3e-7 of
// itself).
//
// softmax_exp2(t), t <= 0: t = n + f, n an integer and |f| <= 1/2, 2^f by a degree-6 polynomial
// (a minimax fit for relative error: 1.6 ulp in float Horner) and 2^n into the exponent
// (AVX-512: vscalefps, which takes t below -149 to 0; elsewhere 0 below -126). -inf gives 0,
// NaN gives NaN (vmax returns its second operand when one is NaN). Its dependent chain is 11
// operations where exp_in_range's is 17, and the softmax passes are bound by that latency.
inline vf softmax_log2_shift(vf shift) {
  vf c = shift * -1.44269504088896341f;
  in_register(c);  // rounded here, never fused into a use's FMA (-ffp-contract=fast)
  return c;
}
// (always inlined: an out-of-line copy in the base set, without AVX, returned its vector
// through another ABI, which GCC warns of)
[[gnu::always_inline]] inline vf softmax_exp2(vf t) {
  t = vmax(splat(-200.f), t);
#if PKV_ISA >= 2
  const vf n = (vf)_mm512_roundscale_ps((__m512)t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif PKV_ISA == 1
  const vf n = (vf)_mm256_round_ps((__m256)t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const vf magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (t + magic) - magic;
#endif
  const vf f = t - n;
  const vf poly = horner(f, 1.53533620e-4f, 1.33988750e-3f, 9.61843692e-3f, 5.55033237e-2f,
                         2.40226477e-1f, 6.93147182e-1f, 1.f);
#if PKV_ISA >= 2
  return (vf)_mm512_scalef_ps((__m512)poly, (__m512)n);
#else
  const vi two_n = (__builtin_convertvector(vmax(splat(-126.f), n), vi) + 127) << 23;
  return n < -126.f ? splat(0.f) : poly * (vf)two_n;
#endif
}
[[gnu::always_inline]] inline vf softmax_exp(vf x, vf c) {
  return softmax_exp2(fmadd(x, splat(1.44269504088896341f), c));
}

// tanh(x): an odd polynomial near 0, (1 - e) / (1 + e) with e = exp(-2|x|) elsewhere (Cephes).
inline vf vtanh(vf x) {
  const vf ax = x < 0.f ? -x : x;
  const vf e = vexp(-2.f * ax);
  const vf large = (1.f - e) / (1.f + e);
  const vf z = x * x;
  const vf poly = horner(z, -5.70498872745e-3f, 2.06390887954e-2f, -5.37397155531e-2f,
                         1.33314422036e-1f, -3.33332819422e-1f);
  const vf small = fmadd(poly * z, x, x);
  const vf signed_large = x < 0.f ? -large : large;
  return ax < 0.625f ? small : signed_large;
}

// Scalar float to bfloat16 / half bits, round to nearest even.
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

inline uint16_t float_to_half_bits(float f) {
#if PKV_ISA >= 1
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
  // Maratyszcza's fp16_ieee_from_fp32_value.
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  uint32_t w;
  std::memcpy(&w, &f, 4);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  const uint32_t bias_bits = (bias >> 1) + 0x07800000u;
  float bias_f;
  std::memcpy(&bias_f, &bias_bits, 4);
  base = bias_f + base;
  uint32_t bits;
  std::memcpy(&bits, &base, 4);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
#endif
}
