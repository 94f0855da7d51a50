// Scalar stand-ins for the AVX-512 intrinsics ember's kernels use, so that the AVX512-BF16 code paths build and run
// on any x86-64 machine (EMBER_EMULATE_AVX512=1, a test build only: ten to a hundred times slower than the real
// instructions). A machine without AVX-512 can then check what those kernels compute: results against references,
// and that a row's result does not depend on the rows beside it. Each function follows Intel's description of the
// instruction; vdpbf16ps and vcvtneps2bf16 round to nearest even with denormals flushed, as the hardware does, but
// bit-equality with a real AVX-512 machine is not promised (horizontal reductions are library sequences there).
#pragma once
#include <immintrin.h>  // first: its declarations must not meet the macros below

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

EMBER_FIXED_ORDER_BEGIN  // the stand-ins compute exactly what they write (no fused or reordered arithmetic)
namespace ember_emu {

struct alignas(64) V512 {
  union {
    float f[16];
    int32_t i[16];
    uint32_t u[16];
    int16_t s16[32];
    uint16_t h[32];
    int8_t b[64];
    uint8_t ub[64];
    int64_t q[8];
  };
};
struct alignas(32) V256 {
  union {
    float f[8];
    int32_t i[8];
    uint16_t h[16];
    int8_t b[32];
    uint8_t ub[32];
  };
};
struct alignas(16) V128 {
  union {
    int32_t i[4];
    int8_t b[16];
    uint8_t ub[16];
    uint16_t h[8];
  };
};
using M16 = uint16_t;
using M32 = uint32_t;
using M64 = uint64_t;

#define EMU_MAP16(expr) \
  V512 r;               \
  for (int j = 0; j < 16; ++j) expr;  \
  return r

inline float f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float daz(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.f, x) : x; }
inline float bf16_to_f32(uint16_t h) { return daz(f32(static_cast<uint32_t>(h) << 16)); }
inline uint16_t f32_to_bf16(float x) {  // vcvtneps2bf16: round to nearest even, denormals to zero, NaN quieted
  x = daz(x);
  const uint32_t u = bits(x);
  if (std::isnan(x)) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

inline V512 zero() { V512 r; std::memset(&r, 0, 64); return r; }
inline V512 loadu(const void* p) { V512 r; std::memcpy(&r, p, 64); return r; }
inline void storeu(void* p, const V512& v) { std::memcpy(p, &v, 64); }
inline V256 loadu256(const void* p) { V256 r; std::memcpy(&r, p, 32); return r; }
inline void storeu256(void* p, const V256& v) { std::memcpy(p, &v, 32); }
inline V128 loadu128(const void* p) { V128 r; std::memcpy(&r, p, 16); return r; }
inline void storeu128(void* p, const V128& v) { std::memcpy(p, &v, 16); }

inline V512 set1_ps(float x) { EMU_MAP16(r.f[j] = x); }
inline V512 set1_epi32(int32_t x) { EMU_MAP16(r.i[j] = x); }
inline V512 set1_epi8(char x) { V512 r; std::memset(&r, x, 64); return r; }
inline V512 set_epi32(int e15, int e14, int e13, int e12, int e11, int e10, int e9, int e8, int e7, int e6, int e5,
                      int e4, int e3, int e2, int e1, int e0) {
  const int e[16] = {e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15};
  EMU_MAP16(r.i[j] = e[j]);
}

inline V512 add_ps(V512 a, V512 b) { EMU_MAP16(r.f[j] = a.f[j] + b.f[j]); }
inline V512 sub_ps(V512 a, V512 b) { EMU_MAP16(r.f[j] = a.f[j] - b.f[j]); }
inline V512 mul_ps(V512 a, V512 b) { EMU_MAP16(r.f[j] = a.f[j] * b.f[j]); }
inline V512 div_ps(V512 a, V512 b) { EMU_MAP16(r.f[j] = a.f[j] / b.f[j]); }
inline V512 max_ps(V512 a, V512 b) { EMU_MAP16(r.f[j] = a.f[j] > b.f[j] ? a.f[j] : b.f[j]); }
inline V512 abs_ps(V512 a) { EMU_MAP16(r.u[j] = a.u[j] & 0x7FFFFFFFu); }
inline V512 fmadd_ps(V512 a, V512 b, V512 c) { EMU_MAP16(r.f[j] = std::fma(a.f[j], b.f[j], c.f[j])); }
inline V512 fnmadd_ps(V512 a, V512 b, V512 c) { EMU_MAP16(r.f[j] = std::fma(-a.f[j], b.f[j], c.f[j])); }
inline V512 roundscale_ps(V512 a, int) { EMU_MAP16(r.f[j] = std::nearbyint(a.f[j])); }  // to an integer, RNE
inline V512 scalef_ps(V512 a, V512 b) { EMU_MAP16(r.f[j] = std::ldexp(a.f[j], static_cast<int>(std::floor(b.f[j])))); }

inline V512 add_epi32(V512 a, V512 b) { EMU_MAP16(r.u[j] = a.u[j] + b.u[j]); }
inline V512 sub_epi32(V512 a, V512 b) { EMU_MAP16(r.u[j] = a.u[j] - b.u[j]); }
inline V512 max_epi32(V512 a, V512 b) { EMU_MAP16(r.i[j] = std::max(a.i[j], b.i[j])); }
inline V512 min_epi32(V512 a, V512 b) { EMU_MAP16(r.i[j] = std::min(a.i[j], b.i[j])); }
inline V512 and_si512(V512 a, V512 b) { V512 r; for (int j = 0; j < 8; ++j) r.q[j] = a.q[j] & b.q[j]; return r; }
inline V512 or_si512(V512 a, V512 b) { V512 r; for (int j = 0; j < 8; ++j) r.q[j] = a.q[j] | b.q[j]; return r; }
inline V512 xor_si512(V512 a, V512 b) { V512 r; for (int j = 0; j < 8; ++j) r.q[j] = a.q[j] ^ b.q[j]; return r; }
inline V512 slli_epi32(V512 a, unsigned n) { EMU_MAP16(r.u[j] = n > 31 ? 0 : a.u[j] << n); }
inline V512 srli_epi32(V512 a, unsigned n) { EMU_MAP16(r.u[j] = n > 31 ? 0 : a.u[j] >> n); }
inline V512 srli_epi16(V512 a, unsigned n) {
  V512 r;
  for (int j = 0; j < 32; ++j) r.h[j] = n > 15 ? 0 : static_cast<uint16_t>(a.h[j] >> n);
  return r;
}
inline V512 srai_epi32(V512 a, unsigned n) { EMU_MAP16(r.i[j] = a.i[j] >> std::min(n, 31u)); }
inline V512 ternarylogic_epi32(V512 a, V512 b, V512 c, int imm) {
  V512 r;
  for (int j = 0; j < 16; ++j) {
    uint32_t out = 0;
    for (int bit = 0; bit < 32; ++bit) {
      const int idx = (((a.u[j] >> bit) & 1) << 2) | (((b.u[j] >> bit) & 1) << 1) | ((c.u[j] >> bit) & 1);
      out |= static_cast<uint32_t>((imm >> idx) & 1) << bit;
    }
    r.u[j] = out;
  }
  return r;
}

inline M16 cmp_ps_mask(V512 a, V512 b, int) {  // the _CMP_GE_OQ predicate, the only one used
  M16 m = 0;
  for (int j = 0; j < 16; ++j) m |= static_cast<M16>((a.f[j] >= b.f[j]) << j);
  return m;
}
inline M16 cmple_epi32_mask(V512 a, V512 b) {
  M16 m = 0;
  for (int j = 0; j < 16; ++j) m |= static_cast<M16>((a.i[j] <= b.i[j]) << j);
  return m;
}
inline M16 cmpge_epi32_mask(V512 a, V512 b) {
  M16 m = 0;
  for (int j = 0; j < 16; ++j) m |= static_cast<M16>((a.i[j] >= b.i[j]) << j);
  return m;
}
inline V512 mask_mov_ps(V512 src, M16 k, V512 a) { EMU_MAP16(r.f[j] = (k >> j) & 1 ? a.f[j] : src.f[j]); }
inline V512 maskz_mov_ps(M16 k, V512 a) { EMU_MAP16(r.u[j] = (k >> j) & 1 ? a.u[j] : 0u); }
inline V512 mask_blend_ps(M16 k, V512 a, V512 b) { EMU_MAP16(r.f[j] = (k >> j) & 1 ? b.f[j] : a.f[j]); }
// zero-masked loads of N elements of W bytes: reads only the elements the mask selects, zeros elsewhere
template <int W, int N, class M>
inline V512 maskz_loadu(M k, const void* p) {
  V512 r = zero();
  const uint8_t* s = static_cast<const uint8_t*>(p);
  for (int j = 0; j < N; ++j)
    if ((k >> j) & 1) std::memcpy(r.ub + W * j, s + W * j, W);
  return r;
}
inline V512 maskz_loadu_epi8(M64 k, const void* p) { return maskz_loadu<1, 64>(k, p); }
inline V512 maskz_loadu_epi16(M32 k, const void* p) { return maskz_loadu<2, 32>(k, p); }
inline V512 maskz_loadu_ps(M16 k, const void* p) { return maskz_loadu<4, 16>(k, p); }

inline V512 mask_add_epi16(V512 src, M32 k, V512 a, V512 b) {
  V512 r;
  for (int j = 0; j < 32; ++j) r.h[j] = (k >> j) & 1 ? static_cast<uint16_t>(a.h[j] + b.h[j]) : src.h[j];
  return r;
}
inline V512 cvtepi32_ps(V512 a) { EMU_MAP16(r.f[j] = static_cast<float>(a.i[j])); }
inline V512 cvtps_epi32(V512 a) {  // round to nearest even; out of range -> the integer indefinite
  EMU_MAP16(r.i[j] = std::isnan(a.f[j]) || std::fabs(a.f[j]) >= 2147483648.f
                         ? INT32_MIN : static_cast<int32_t>(std::nearbyint(a.f[j])));
}
inline V512 cvtepi8_epi32(V128 a) { EMU_MAP16(r.i[j] = a.b[j]); }
inline V512 cvtepu8_epi32(V128 a) { EMU_MAP16(r.i[j] = a.ub[j]); }
inline V512 cvtepu16_epi32(V256 a) { EMU_MAP16(r.i[j] = a.h[j]); }
inline float f16_to_f32(uint16_t h) {  // IEEE half -> float, exact (as vcvtph2ps; subnormal halves become normal)
  const uint32_t sign = static_cast<uint32_t>(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
  if (exp == 31) return f32(sign | 0x7F800000u | (man << 13));      // infinity, NaN
  if (exp == 0) return std::copysign(std::ldexp(static_cast<float>(man), -24), sign ? -1.f : 1.f);
  return f32(sign | ((exp + 112) << 23) | (man << 13));
}
inline V512 cvtph_ps(V256 a) { EMU_MAP16(r.f[j] = f16_to_f32(a.h[j])); }
inline V128 cvtepi32_epi8(V512 a) {  // truncation (vpmovdb)
  V128 r;
  for (int j = 0; j < 16; ++j) r.b[j] = static_cast<int8_t>(a.i[j]);
  return r;
}
inline V256 cvtneps_pbh(V512 a) {
  V256 r;
  for (int j = 0; j < 16; ++j) r.h[j] = f32_to_bf16(a.f[j]);
  return r;
}
inline V512 cvtne2ps_pbh(V512 a, V512 b) {  // low half from b, high half from a
  V512 r;
  for (int j = 0; j < 16; ++j) {
    r.h[j] = f32_to_bf16(b.f[j]);
    r.h[16 + j] = f32_to_bf16(a.f[j]);
  }
  return r;
}
// vdpbf16ps: src + a[2j + 1] * b[2j + 1], then + a[2j] * b[2j] (each product exact in float32)
inline V512 dpbf16_ps(V512 src, V512 a, V512 b) {
  V512 r;
  for (int j = 0; j < 16; ++j) {
    float acc = daz(src.f[j]) + bf16_to_f32(a.h[2 * j + 1]) * bf16_to_f32(b.h[2 * j + 1]);
    acc = daz(acc) + bf16_to_f32(a.h[2 * j]) * bf16_to_f32(b.h[2 * j]);
    r.f[j] = daz(acc);
  }
  return r;
}
inline V512 dpbusd_epi32(V512 src, V512 a, V512 b) {  // unsigned bytes of a times signed bytes of b
  V512 r;
  for (int j = 0; j < 16; ++j) {
    int32_t s = 0;
    for (int t = 0; t < 4; ++t) s += static_cast<int32_t>(a.ub[4 * j + t]) * b.b[4 * j + t];
    r.u[j] = src.u[j] + static_cast<uint32_t>(s);
  }
  return r;
}

inline V512 permutexvar_epi8(V512 idx, V512 a) {
  V512 r;
  for (int j = 0; j < 64; ++j) r.ub[j] = a.ub[idx.ub[j] & 63];
  return r;
}
// byte j: a's byte idx[j] & 63 where bit 6 of idx[j] is clear, else b's (vpermt2b)
inline V512 permutex2var_epi8(V512 a, V512 idx, V512 b) {
  V512 r;
  for (int j = 0; j < 64; ++j) r.ub[j] = (idx.ub[j] & 64 ? b : a).ub[idx.ub[j] & 63];
  return r;
}
// byte i of each 64-bit lane: the 8 bits of b's lane from bit ctrl.ub[i] & 63 on, wrapping (vpmultishiftqb)
inline V512 multishift_epi64_epi8(V512 ctrl, V512 b) {
  V512 r;
  for (int j = 0; j < 64; ++j) {
    const uint64_t lane = static_cast<uint64_t>(b.q[j / 8]);
    const int at = ctrl.ub[j] & 63;
    r.ub[j] = static_cast<uint8_t>((lane >> at | (at ? lane << (64 - at) : 0)) & 0xFF);
  }
  return r;
}
inline V512 permutexvar_ps(V512 idx, V512 a) { EMU_MAP16(r.u[j] = a.u[idx.i[j] & 15]); }
inline V512 permutexvar_epi16(V512 idx, V512 a) {
  V512 r;
  for (int j = 0; j < 32; ++j) r.h[j] = a.h[idx.h[j] & 31];
  return r;
}
// per 128-bit lane: the low (or high) halves of a and b interleaved, elements of `size` bytes
inline V512 unpack(const V512& a, const V512& b, int size, bool high) {
  V512 r;
  const int per = 16 / size, half = per / 2;
  for (int lane = 0; lane < 4; ++lane)
    for (int e = 0; e < half; ++e) {
      const int src = lane * 16 + (high ? half + e : e) * size;
      std::memcpy(r.ub + lane * 16 + 2 * e * size, a.ub + src, size);
      std::memcpy(r.ub + lane * 16 + (2 * e + 1) * size, b.ub + src, size);
    }
  return r;
}
inline V512 shuffle_ps(V512 a, V512 b, int imm) {
  V512 r;
  for (int lane = 0; lane < 4; ++lane) {
    r.f[4 * lane] = a.f[4 * lane + (imm & 3)];
    r.f[4 * lane + 1] = a.f[4 * lane + ((imm >> 2) & 3)];
    r.f[4 * lane + 2] = b.f[4 * lane + ((imm >> 4) & 3)];
    r.f[4 * lane + 3] = b.f[4 * lane + ((imm >> 6) & 3)];
  }
  return r;
}
inline V512 shuffle_x4(V512 a, V512 b, int imm) {
  V512 r;
  const V512* src[4] = {&a, &a, &b, &b};
  for (int lane = 0; lane < 4; ++lane)
    std::memcpy(r.ub + 16 * lane, src[lane]->ub + 16 * ((imm >> (2 * lane)) & 3), 16);
  return r;
}

// horizontal sums: pairwise halving (the tree GCC's _mm512_reduce_add_ps uses)
inline float reduce_add_ps(V512 a) {
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) a.f[j] = a.f[j] + a.f[j + w];
  return a.f[0];
}
inline int32_t reduce_add_epi32(V512 a) {  // wrapping, exact in any order
  uint32_t t = 0;
  for (int j = 0; j < 16; ++j) t += a.u[j];
  return static_cast<int32_t>(t);
}
inline float reduce_max_ps(V512 a) {
  float m = a.f[0];
  for (int j = 1; j < 16; ++j) m = a.f[j] > m ? a.f[j] : m;
  return m;
}

}  // namespace ember_emu
EMBER_FIXED_ORDER_END

#define __m512 ember_emu::V512
#define __m512i ember_emu::V512
#define __m512bh ember_emu::V512
#define __m256i ember_emu::V256
#define __m256bh ember_emu::V256
#define __m128i ember_emu::V128
#define __mmask16 ember_emu::M16
#define __mmask32 ember_emu::M32
#define __mmask64 ember_emu::M64

#define _mm512_setzero_ps ember_emu::zero
#define _mm512_setzero_si512 ember_emu::zero
#define _mm512_loadu_ps ember_emu::loadu
#define _mm512_load_ps ember_emu::loadu
#define _mm512_loadu_si512 ember_emu::loadu
#define _mm512_load_si512 ember_emu::loadu
#define _mm512_storeu_ps ember_emu::storeu
#define _mm512_store_ps ember_emu::storeu
#define _mm512_storeu_si512 ember_emu::storeu
#define _mm512_store_si512 ember_emu::storeu
#define _mm256_loadu_si256 ember_emu::loadu256
#define _mm256_storeu_si256 ember_emu::storeu256
#define _mm256_store_si256 ember_emu::storeu256
#define _mm_loadu_si128 ember_emu::loadu128
#define _mm_storeu_si128 ember_emu::storeu128
#define _mm512_set1_ps ember_emu::set1_ps
#define _mm512_set1_epi32 ember_emu::set1_epi32
#define _mm512_set1_epi8 ember_emu::set1_epi8
#define _mm512_set_epi32 ember_emu::set_epi32
#define _mm512_add_ps ember_emu::add_ps
#define _mm512_sub_ps ember_emu::sub_ps
#define _mm512_mul_ps ember_emu::mul_ps
#define _mm512_div_ps ember_emu::div_ps
#define _mm512_max_ps ember_emu::max_ps
#define _mm512_abs_ps ember_emu::abs_ps
#define _mm512_fmadd_ps ember_emu::fmadd_ps
#define _mm512_fnmadd_ps ember_emu::fnmadd_ps
#define _mm512_roundscale_ps ember_emu::roundscale_ps
#define _mm512_scalef_ps ember_emu::scalef_ps
#define _mm512_add_epi32 ember_emu::add_epi32
#define _mm512_sub_epi32 ember_emu::sub_epi32
#define _mm512_max_epi32 ember_emu::max_epi32
#define _mm512_min_epi32 ember_emu::min_epi32
#define _mm512_and_si512 ember_emu::and_si512
#define _mm512_or_si512 ember_emu::or_si512
#define _mm512_xor_si512 ember_emu::xor_si512
#define _mm512_slli_epi32 ember_emu::slli_epi32
#define _mm512_srli_epi32 ember_emu::srli_epi32
#define _mm512_srli_epi16 ember_emu::srli_epi16
#define _mm512_srai_epi32 ember_emu::srai_epi32
#define _mm512_ternarylogic_epi32 ember_emu::ternarylogic_epi32
#define _mm512_castps_si512(v) (v)
#define _mm512_castsi512_ps(v) (v)
#define _mm512_cmp_ps_mask ember_emu::cmp_ps_mask
#define _mm512_cmple_epi32_mask ember_emu::cmple_epi32_mask
#define _mm512_cmpge_epi32_mask ember_emu::cmpge_epi32_mask
#define _mm512_mask_mov_ps ember_emu::mask_mov_ps
#define _mm512_maskz_mov_ps ember_emu::maskz_mov_ps
#define _mm512_mask_blend_ps ember_emu::mask_blend_ps
#define _mm512_maskz_loadu_epi8 ember_emu::maskz_loadu_epi8
#define _mm512_maskz_loadu_ps ember_emu::maskz_loadu_ps
#define _mm512_mask_add_epi16 ember_emu::mask_add_epi16
#define _mm512_maskz_loadu_epi16 ember_emu::maskz_loadu_epi16
#define _mm512_cvtepi32_ps ember_emu::cvtepi32_ps
#define _mm512_cvtps_epi32 ember_emu::cvtps_epi32
#define _mm512_cvtepi8_epi32 ember_emu::cvtepi8_epi32
#define _mm512_cvtepu8_epi32 ember_emu::cvtepu8_epi32
#define _mm512_cvtepu16_epi32 ember_emu::cvtepu16_epi32
#define _mm512_cvtph_ps ember_emu::cvtph_ps
#define _mm512_cvtepi32_epi8 ember_emu::cvtepi32_epi8
#define _mm512_cvtneps_pbh ember_emu::cvtneps_pbh
#define _mm512_cvtne2ps_pbh ember_emu::cvtne2ps_pbh
#define _mm512_dpbf16_ps ember_emu::dpbf16_ps
#define _mm512_dpbusd_epi32 ember_emu::dpbusd_epi32
#define _mm512_permutexvar_epi8 ember_emu::permutexvar_epi8
#define _mm512_permutex2var_epi8 ember_emu::permutex2var_epi8
#define _mm512_permutexvar_ps ember_emu::permutexvar_ps
#define _mm512_permutexvar_epi16 ember_emu::permutexvar_epi16
#define _mm512_multishift_epi64_epi8 ember_emu::multishift_epi64_epi8
#define _mm512_unpacklo_epi16(a, b) ember_emu::unpack(a, b, 2, false)
#define _mm512_unpackhi_epi16(a, b) ember_emu::unpack(a, b, 2, true)
#define _mm512_unpacklo_epi32(a, b) ember_emu::unpack(a, b, 4, false)
#define _mm512_unpackhi_epi32(a, b) ember_emu::unpack(a, b, 4, true)
#define _mm512_unpacklo_ps(a, b) ember_emu::unpack(a, b, 4, false)
#define _mm512_unpackhi_ps(a, b) ember_emu::unpack(a, b, 4, true)
#define _mm512_unpacklo_epi64(a, b) ember_emu::unpack(a, b, 8, false)
#define _mm512_unpackhi_epi64(a, b) ember_emu::unpack(a, b, 8, true)
#define _mm512_shuffle_ps ember_emu::shuffle_ps
#define _mm512_shuffle_f32x4 ember_emu::shuffle_x4
#define _mm512_shuffle_i32x4 ember_emu::shuffle_x4
#define _mm512_reduce_add_ps ember_emu::reduce_add_ps
#define _mm512_reduce_add_epi32 ember_emu::reduce_add_epi32
#define _mm512_reduce_max_ps ember_emu::reduce_max_ps
#undef _mm_prefetch
#define _mm_prefetch(p, hint) __builtin_prefetch(p)
