// AVX512 helpers shared by the bf16 kernels. Only compiled where the build machine has AVX512-BF16
// (-march=native), or under EMBER_EMULATE_AVX512 (avx512_emulation.h: scalar stand-ins, for tests on other
// machines); every user keeps a portable fallback for other machines.
// EMBER_AVX512_VNNI / EMBER_AVX512_VBMI: the extensions some kernels use beyond AVX512-BF16.
#pragma once
#include <cstdint>
// Kernels that promise batch invariance (a row's result the same bits whatever rows share the call) compile their
// arithmetic between these: no reassociation, no contraction of a * b + c, so the order written is the order run
// in every copy the compiler makes of the code. The AVX512 helpers below are always inlined, so they follow the
// caller's options.
#define EMBER_FIXED_ORDER_BEGIN \
  _Pragma("GCC push_options") _Pragma("GCC optimize(\"no-associative-math\", \"fp-contract=off\")")
#define EMBER_FIXED_ORDER_END _Pragma("GCC pop_options")
#define EMBER_INLINE inline __attribute__((always_inline))

// What those regions use in place of std::min / std::max and c10's bf16 conversion: a function compiled with other
// options is not inlined into them (GCC), and a call in an inner loop costs more than the work.
namespace ember_fixed {
template <typename T>
EMBER_INLINE T min(T a, T b) { return b < a ? b : a; }
template <typename T>
EMBER_INLINE T max(T a, T b) { return a < b ? b : a; }
EMBER_INLINE float bf16_bits_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, sizeof(f));
  return f;
}
}  // namespace ember_fixed

#if defined(EMBER_EMULATE_AVX512)
#include "avx512_emulation.h"
#define EMBER_AVX512_BF16 1
#define EMBER_AVX512_VNNI 1
#define EMBER_AVX512_VBMI 1
#elif defined(__AVX512F__) && defined(__AVX512BF16__)
#define EMBER_AVX512_BF16 1
#include <immintrin.h>
#ifdef __AVX512VNNI__
#define EMBER_AVX512_VNNI 1
#endif
#ifdef __AVX512VBMI__
#define EMBER_AVX512_VBMI 1
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__) && \
    defined(__AVX512DQ__) && defined(__linux__)
#define EMBER_AMX 1  // amx.h: tile products (bf16, int8), where the kernel asks for them and the OS grants them
#endif
#endif
#ifdef EMBER_AVX512_BF16
#include <cstdint>

namespace ember_avx512 {

// exp(x) for x <= 0 (softmax after the max is subtracted): Cephes' expf polynomial, 2**n applied by scalef.
EMBER_INLINE __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// 16 vectors -> one whose lane t is the sum of v[t]'s lanes (a transposing add tree: 45 ops instead of 16
// horizontal reductions of ~8 each).
EMBER_INLINE __m512 reduce16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  // a[i] per 128-bit quarter: [x0+x2, y0+y2, x1+x3, y1+y3] (x = v[2i], y = v[2i+1])
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  // b[i] per quarter: partial sums of v[4i..4i+3] over that quarter
  const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x44), _mm512_shuffle_f32x4(b[0], b[1], 0xEE));
  const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x44), _mm512_shuffle_f32x4(b[2], b[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xDD));
}

// The same tree on int32 lanes: lane t is the sum of v[t]'s lanes.
EMBER_INLINE __m512i reduce16_epi32(const __m512i* v) {
  __m512i a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                            _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]),
                            _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
  const __m512i u01 =
      _mm512_add_epi32(_mm512_shuffle_i32x4(b[0], b[1], 0x44), _mm512_shuffle_i32x4(b[0], b[1], 0xEE));
  const __m512i u23 =
      _mm512_add_epi32(_mm512_shuffle_i32x4(b[2], b[3], 0x44), _mm512_shuffle_i32x4(b[2], b[3], 0xEE));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(u01, u23, 0x88), _mm512_shuffle_i32x4(u01, u23, 0xDD));
}

// 16 bf16 -> 16 float32 (bf16 is the top half of a float32)
EMBER_INLINE __m512 load_bf16_ps(const void* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// 16 bf16 held in a register -> 16 float32
EMBER_INLINE __m512 load_bf16_ps_from(__m256bh v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)v), 16));
}

// 16 float32 rounded to bf16 (to nearest even, as c10's conversion and eager's bf16 ops) and widened back
EMBER_INLINE __m512 round_bf16_ps(__m512 v) { return load_bf16_ps_from(_mm512_cvtneps_pbh(v)); }

// r[i] = 16 words of row i -> r[v] = word v of rows 0..15
EMBER_INLINE void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

}  // namespace ember_avx512
#endif
