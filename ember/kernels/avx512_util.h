// AVX512 helpers shared by the bf16 kernels. Only compiled where the build machine has AVX512-BF16
// (-march=native); every user keeps a portable fallback for other machines.
#pragma once
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define EMBER_AVX512_BF16 1
#include <immintrin.h>
#include <cstdint>

namespace ember_avx512 {

// exp(x) for x <= 0 (softmax after the max is subtracted): Cephes' expf polynomial, 2**n applied by scalef.
inline __m512 exp_ps(__m512 x) {
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
inline __m512 reduce16(const __m512* v) {
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
inline __m512i reduce16_epi32(const __m512i* v) {
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
inline __m512 load_bf16_ps(const void* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// 16 bf16 held in a register -> 16 float32
inline __m512 load_bf16_ps_from(__m256bh v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)v), 16));
}

// 16 float32 rounded to bf16 (to nearest even, as c10's conversion and eager's bf16 ops) and widened back
inline __m512 round_bf16_ps(__m512 v) { return load_bf16_ps_from(_mm512_cvtneps_pbh(v)); }

}  // namespace ember_avx512
#endif
