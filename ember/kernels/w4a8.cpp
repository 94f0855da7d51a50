// int4 weights against int8 activations (w4a8) for CPU: y[M, N] = x[M, K] . W^T with W in ember's 64-row int4 pack
// as it lies and x quantized on the fly, per row and block of 32 inputs, to int8 (llama.cpp's Q8_0 blocks: scale =
// max|x| / 127, q = round-half-even(x / scale)). The products are VNNI's vpdpbusd (64 byte products an instruction,
// twice vdpbf16ps' 32): the int4 values (0..15) as the unsigned bytes, x's as the signed ones, each block's sums
// exact in int32. In float32, per row and column, in this order: for each block b of group g, acc += (sum_b *
// scale_x[b]) * scale_w[g]; after a group's last block, acc += xsum_g * (zero_g - 8 scale_w[g]), xsum_g the sum over
// g's blocks of scale_x[b] * (the block's sum of q), as llama.cpp's Q8_1 blocks carry it. That is, y is exactly the
// quantized x times the weight: the offsets take x's rounding too, which cancels the part of the products' error
// that the unsigned values' mean (~7.5 scale) carries. With the bf16 x's own sums there instead, the default model's
// projections were 1.5-2.4% (relative) from that product against 0.17% for the bf16 kernel, and its log-probabilities
// 0.134 (mean |change|) from the float32 model's against llama.cpp's 0.060 on the same file. Nothing in a row's
// arithmetic depends on the rows beside it, so the kernel is batch invariant by construction at every row count.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "avx512_util.h"
#include "quant_blocks.h"
#include "w4a8.h"

#if defined(EMBER_AVX512_BF16) && defined(EMBER_AVX512_VNNI) && defined(EMBER_AVX512_VBMI)
EMBER_FIXED_ORDER_BEGIN
namespace {

using namespace ember_quant;

constexpr int64_t QB = W4A8_BLOCK;  // inputs an activation block
constexpr int PASS = 6;             // rows a pass over a weight block (w4a8_pass: half its columns from 3 rows)

struct W4A8Consts {
  __m512i ilo, ihi, low;
  W4A8Consts() {
    // lane c, byte t <- row k + t of column c (ilo) or 16 + c (ihi): rows k, k + 1 are bytes c and 32 + c of the
    // first 64-byte pair step, rows k + 2, k + 3 the same bytes of the second (index 64 up)
    alignas(64) uint8_t lo[64], hi[64];
    for (int c = 0; c < 16; ++c)
      for (int t = 0; t < 4; ++t) {
        lo[4 * c + t] = static_cast<uint8_t>(64 * (t / 2) + 32 * (t % 2) + c);
        hi[4 * c + t] = static_cast<uint8_t>(lo[4 * c + t] + 16);
      }
    ilo = _mm512_load_si512(lo);
    ihi = _mm512_load_si512(hi);
    low = _mm512_set1_epi8(0x0F);
  }
};

}  // namespace

// Per row and block of QB inputs: q = round-half-even(x / s), s = max(max|x| / 127, 1e-10), and (bsum given) s times
// the block's sum of q (exact in int32, one rounding), whose sums over a weight group give the offsets' factor. One
// pass over x: the sums as a scalar loop of their own cost a 512-token prefill of the default model 7% (120 calls).
void quantize_x8_blocks(const c10::BFloat16* x, int64_t M, int64_t K, int8_t* q, float* d, float* bsum,
                        bool plus128) {
  const int64_t blocks = K / QB;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    const __m512i bias = _mm512_set1_epi32(plus128 ? 128 : 0);  // q + 128: its low byte is the uint8 (vpmovdb)
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < blocks; ++b) {
        const c10::BFloat16* xb = x + m * K + b * QB;
        const __m512 v0 = ember_avx512::load_bf16_ps(xb), v1 = ember_avx512::load_bf16_ps(xb + 16);
        const float s = ember_fixed::max(
            _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1))) / 127.f, 1e-10f);
        d[m * blocks + b] = s;
        const __m512 sv = _mm512_set1_ps(s);
        const __m512 v[2] = {v0, v1};
        __m512i qs[2];
        for (int h = 0; h < 2; ++h) {  // cvtps_epi32 rounds half to even (the default MXCSR mode)
          qs[h] = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_div_ps(v[h], sv)), lo), hi);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q + m * K + b * QB + 16 * h),
                           _mm512_cvtepi32_epi8(_mm512_add_epi32(qs[h], bias)));
        }
        if (bsum != nullptr)
          bsum[m * blocks + b] = s * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qs[0], qs[1])));
      }
  });
}

namespace {

// y[0 : R, the columns of halves H0 .. H0 + NH - 1] of one block of the pack (blk: its K x 32 bytes; szb: its
// [groups, 64, 2] (scale, zero) pairs). Half 0 is columns 0-15 and 32-47 (the low and high nibbles of a pair step's
// bytes 0-15 and 32-47), half 1 columns 16-31 and 48-63. Per block of 32 inputs, 8 steps of 4: the two 64-byte pair
// steps of rows k..k+3 permuted so that lane c holds column c's four values (vpermt2b), the nibbles split into
// column vectors, and each row's 4 int8 values broadcast against them. From 3 rows a pass takes one half (2 x R
// int32 sums and 2 x R float32 totals in registers; all four column vectors at 6 rows spilled and ran at 0.8x the
// bf16 kernel's speed instead of 1.5x); up to 2 rows both, so that a row streamed from memory reads its block once.
template <int R, int NH>
EMBER_INLINE void w4a8_pass(const W4A8Consts& c, int H0, const int8_t* q, const float* d, const float* xsum,
                            int64_t K, int64_t group, const uint8_t* blk, const c10::BFloat16* szb, int64_t N,
                            c10::BFloat16* y) {
  constexpr int J = 2 * NH;  // column vectors: 2 h + 0 (low nibbles) and 2 h + 1 (high) of half H0 + h
  const int64_t blocks = K / QB, per = group / QB, groups = K / group;
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512i idx[NH];
  int col[J];
  for (int h = 0; h < NH; ++h) {
    idx[h] = H0 + h == 0 ? c.ilo : c.ihi;
    col[2 * h] = 16 * (H0 + h);
    col[2 * h + 1] = 16 * (H0 + h) + 32;
  }
  __m512 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i s[R][J];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) s[r][j] = _mm512_setzero_si512();
    const uint8_t* p = blk + b * QB * 32;
    for (int t = 0; t < QB / 4; ++t) {
      _mm_prefetch(reinterpret_cast<const char*>(p + 128 * t + INT4_PREFETCH), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + 128 * t + 64 + INT4_PREFETCH), _MM_HINT_T0);
      const __m512i v0 = _mm512_loadu_si512(p + 128 * t), v1 = _mm512_loadu_si512(p + 128 * t + 64);
      __m512i w[J];
      for (int h = 0; h < NH; ++h) {
        const __m512i v = _mm512_permutex2var_epi8(v0, idx[h], v1);
        w[2 * h] = _mm512_and_si512(v, c.low);
        w[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), c.low);
      }
      for (int r = 0; r < R; ++r) {
        int32_t xq;
        std::memcpy(&xq, q + r * K + b * QB + 4 * t, sizeof(xq));
        const __m512i a = _mm512_set1_epi32(xq);
        for (int j = 0; j < J; ++j) s[r][j] = _mm512_dpbusd_epi32(s[r][j], w[j], a);
      }
    }
    const int64_t g = b / per;
    const c10::BFloat16* sg = szb + g * NB * 2;
    for (int j = 0; j < J; ++j) {
      const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(sg + 2 * col[j]), 16));
      for (int r = 0; r < R; ++r)
        acc[r][j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s[r][j]), _mm512_set1_ps(d[r * blocks + b])),
                                    sc, acc[r][j]);
    }
    if ((b + 1) % per == 0)
      for (int j = 0; j < J; ++j) {
        const __m512i pair = _mm512_loadu_si512(sg + 2 * col[j]);
        const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
        const __m512 off = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), sc, _mm512_castsi512_ps(_mm512_and_si512(pair, top)));
        for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * groups + g]), off, acc[r][j]);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + col[j]), (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
}

template <int R>
EMBER_INLINE void w4a8_block_rows(const W4A8Consts& c, const int8_t* q, const float* d, const float* xsum, int64_t K,
                                  int64_t group, const uint8_t* blk, const c10::BFloat16* szb, int64_t N,
                                  c10::BFloat16* y) {
  if constexpr (R <= 2) {
    w4a8_pass<R, 2>(c, 0, q, d, xsum, K, group, blk, szb, N, y);
  } else {
    w4a8_pass<R, 1>(c, 0, q, d, xsum, K, group, blk, szb, N, y);
    w4a8_pass<R, 1>(c, 1, q, d, xsum, K, group, blk, szb, N, y);
  }
}

}  // namespace

bool w4a8_rows(const c10::BFloat16* x, int64_t M, int64_t K, const uint8_t* w, const c10::BFloat16* sz, int64_t N,
               int64_t group, c10::BFloat16* y) {
  if (group % QB != 0) return false;
  const int64_t blocks = K / QB, groups = K / group, per = group / QB;
  std::unique_ptr<int8_t[]> q(new int8_t[M * K]);  // written whole before it is read: no zeroing
  std::vector<float> d(M * blocks), bsum(M * blocks), xsum(M * groups);
  quantize_x8_blocks(x, M, K, q.get(), d.data(), bsum.data(), false);
  for (int64_t m = 0; m < M; ++m)  // a group's sum of the quantized x: its blocks' sums in order
    for (int64_t g = 0; g < groups; ++g) {
      float sum = bsum[m * blocks + g * per];
      for (int64_t b = 1; b < per; ++b) sum += bsum[m * blocks + g * per + b];
      xsum[m * groups + g] = sum;
    }
  block_spans<W4A8Consts>(N, M, [&](const W4A8Consts& c, int64_t nb, int64_t m0, int64_t m1) {
    const uint8_t* blk = w + nb * K * 32;
    const c10::BFloat16* szb = sz + nb * groups * NB * 2;
    for (int64_t m = m0; m < m1; m += PASS) {
      const int8_t* qm = q.get() + m * K;
      const float* dm = d.data() + m * blocks;
      const float* sm = xsum.data() + m * groups;
      c10::BFloat16* ym = y + m * N + nb * NB;
      rows_pass<PASS>(m1 - m, [&](auto rows) {
        w4a8_block_rows<decltype(rows)::value>(c, qm, dm, sm, K, group, blk, szb, N, ym);
      });
    }
  });
  return true;
}
EMBER_FIXED_ORDER_END  // after the driver: the inlined passes take its options

bool has_w4a8() { return true; }
#else
void quantize_x8_blocks(const c10::BFloat16*, int64_t, int64_t, int8_t*, float*, float*, bool) {
  TORCH_CHECK(false, "quantize_x8_blocks needs AVX512-BF16 with VNNI and VBMI");
}
bool w4a8_rows(const c10::BFloat16*, int64_t, int64_t, const uint8_t*, const c10::BFloat16*, int64_t, int64_t,
               c10::BFloat16*) {
  return false;
}
bool has_w4a8() { return false; }
#endif
