// Weight-only quantized GEMM for CPU: y[M, N] = x[M, K] (bf16) . W^T, W held as int4 (the 64-row CPU int4 pack) or
// int8 (one scale per output row), the packed form being the only copy of the weight. The integer weights enter
// AVX512-BF16 dot products as exact bf16 values and the scales are applied to float32 sums, so w is not rounded to
// bf16 (torch's packed ops do not round it either).
// Batch invariant (the default, `invariant`): a row's result is the same bits whatever rows share the call. int4
// reads the pack up to 6 rows of x at a time against each 64-column block with the same chain of sums at every row
// count; int8 runs every output as one chain of 32-input dot products (int8_gemm_inv: up to 12 rows the weight
// converted where it lies, more in 4 x 4 tiles against weights converted once, where K <= 4096). The arithmetic is
// compiled in a fixed order.
// Otherwise (batch_invariant=False): int4 from 128 rows and int8 from 5 lay 64 output columns out as bf16 pairs in
// each thread's cache (a panel; int4 panels hold w rounded to bf16) and run every row block against it, int8 up
// to 4 rows as float dots along the weight's rows: faster where measured, with results that depend on the rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "avx512_util.h"
#include "checks.h"
#include "quant_blocks.h"
#include "w4a8.h"

#ifdef EMBER_AVX512_BF16
EMBER_FIXED_ORDER_BEGIN
namespace {

using namespace ember_quant;

constexpr int64_t INT8_ROWS_MAX = 4;  // int8 with at most this many rows: row-wise dot products, no panel

// int8 [N, K] row-major, 16 rows at a time: 64 bytes of each row are loaded (each row read front to back, the
// cache lines two loads ahead asked for), a 16 x 16 transpose of 32-bit words puts bytes k..k+3 of the 16 rows in
// one vector, and its two (k, k+1) pairs go in as exact bf16 integers; the row scales are applied to the sums. The
// 49152x576 LM head, 2 threads: gathering a pair from 16 rows at a time cost 6.2 ms whatever the rows (9.1 ms at 48
// rows); this fill 2.0 ms at 5 rows, 5.0 at 48 (distances 256 and 512 bytes were slower).
inline __m512i int8_pair_bf16(__m512i v) {  // bytes 0, 1 of each lane -> the bf16 pair (k low, k + 1 high)
  const __m512 a = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24));
  const __m512 b = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24));
  // integers below 256 are exact in bf16: truncation is the conversion
  const __m512i pa = _mm512_srli_epi32(_mm512_castps_si512(a), 16);
  const __m512i pb = _mm512_and_si512(_mm512_castps_si512(b), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm512_or_si512(pa, pb);
}

void dequant_int8(const int8_t* w, int64_t nb, int64_t K, uint32_t* panel) {
  for (int64_t j = 0; j < 4; ++j) {
    const int8_t* base = w + (nb * NB + 16 * j) * K;
    for (int64_t k0 = 0; k0 < K; k0 += 64) {
      const int64_t left = ember_fixed::min<int64_t>(64, K - k0);
      const __mmask64 mask = left == 64 ? ~__mmask64(0) : (__mmask64(1) << left) - 1;
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(base + i * K + k0 + 128), _MM_HINT_T0);
        r[i] = _mm512_maskz_loadu_epi8(mask, base + i * K + k0);
      }
      ember_avx512::transpose16(r);
      for (int64_t v = 0; v < 16 && 4 * v < left; ++v) {
        const int64_t kp = (k0 + 4 * v) / 2;
        _mm512_storeu_si512(panel + kp * NB + 16 * j, int8_pair_bf16(r[v]));
        if (4 * v + 2 < left)
          _mm512_storeu_si512(panel + (kp + 1) * NB + 16 * j, int8_pair_bf16(_mm512_srli_epi32(r[v], 16)));
      }
    }
  }
}

// A few rows against an int8 [N, K] weight, as it lies (no panel, no gather): each pass widens B adjacent weight
// rows to float32 16 values at a time and dots them with every x row (B * M <= 16 sums in registers; one
// transposing add tree reduces them), while the rows B * PF ahead are prefetched: the hardware prefetchers alone
// left the stream short of memory speed. 2 threads, AMD Zen 5, 2026-11-25, interleaved medians over five shapes of
// the two models (the 151936 x 896 and 49152 x 576 LM heads, 9728 x 896, 896 x 4864, 1536 x 576): 1 row 66-73 GB/s
// against 42-50 for one weight row a pass without prefetch (30 at K = 4864), 4 rows 34-42 against 12-21.
template <int M>
void int8_rows(const c10::BFloat16* x, int64_t K, const int8_t* w, const float* scales, int64_t N, c10::BFloat16* y) {
  using namespace ember_avx512;
  constexpr int B = M == 1 ? 8 : 4, PF = 2;
  const int64_t K16 = K / 16 * 16;
  std::vector<float> xf(M * K);
  for (int m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xf[m * K + k] = ember_fixed::bf16_bits_to_float(x[m * K + k].x);
  at::parallel_for(0, (N + B - 1) / B, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * B;
      if (n0 + B > N) {  // the last, partial block: one row at a time
        for (int64_t n = n0; n < N; ++n)
          for (int m = 0; m < M; ++m) {
            float sum = 0.f;
            for (int64_t k = 0; k < K; ++k) sum += static_cast<float>(w[n * K + k]) * xf[m * K + k];
            y[m * N + n] = static_cast<c10::BFloat16>(sum * scales[n]);
          }
        continue;
      }
      const int8_t* wb = w + n0 * K;
      __m512 acc[16];
      for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
      for (int64_t k = 0; k < K16; k += 16) {
        for (int j = 0; j < B; ++j) {
          if (k % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(wb + (PF * B + j) * K + k), _MM_HINT_T0);
          const __m512 wv =
              _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wb + j * K + k))));
          for (int m = 0; m < M; ++m)
            acc[m * B + j] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xf.data() + m * K + k), acc[m * B + j]);
        }
      }
      alignas(64) float sums[16];
      _mm512_store_ps(sums, reduce16(acc));
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < B; ++j) {
          float sum = sums[m * B + j];
          for (int64_t k = K16; k < K; ++k) sum += static_cast<float>(wb[j * K + k]) * xf[m * K + k];
          y[m * N + n0 + j] = static_cast<c10::BFloat16>(sum * scales[n0 + j]);
        }
    }
  });
}

// int4: rows k and k + 1 of a 64-column block are 64 adjacent bytes of the pack, read once a block; two byte
// permutations put each column's (k, k + 1) bytes in one 32-bit lane and a mask with an OR makes the nibbles bf16
// pairs: 0x4300 | q is the bf16 of 128 + q, exact, so no integer-to-float conversion. The 128 leaves with the
// offsets: w = (q - 8) * s + zero = (128 + q) * s + (zero - 136 * s). Up to 6 rows a pass (batch invariant; 3
// otherwise: 3 x 4 group sums + 3 x 4 totals stay in registers); further rows run over the same block while it is
// in cache. 2 threads, 2026-11-25, against torch's packed op: 3072x576 at 1 row 10 vs 25 us, 64 rows 0.28 vs 0.65
// ms, 512 rows 2.2 vs 5.2 ms; it also beat the panel layout the int8 path uses, at every row count up to 2048 (64
// rows: 0.28 vs 0.33 ms).
struct Int4Consts {
  __m512i ilo, ihi, nib, magic, top, sixteen;
  Int4Consts() {
    alignas(64) uint8_t lo[64], hi[64];  // lane c: byte 0 <- row k byte c, byte 2 <- row k + 1 byte c
    for (int c = 0; c < 16; ++c) {
      lo[4 * c] = lo[4 * c + 1] = c;
      lo[4 * c + 2] = lo[4 * c + 3] = 32 + c;
      hi[4 * c] = hi[4 * c + 1] = 16 + c;
      hi[4 * c + 2] = hi[4 * c + 3] = 48 + c;
    }
    ilo = _mm512_load_si512(lo);
    ihi = _mm512_load_si512(hi);
    nib = _mm512_set1_epi32(0x000F000F);
    magic = _mm512_set1_epi32(0x43004300);
    top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    sixteen = _mm512_set1_epi32(0x00100010);
  }
};

// 16 columns' (scale, zero) bf16 pairs at p -> the scale s and the offset zero - 136 s that goes with the 128 + q
// values int4_unpack makes: w = (q - 8) s + zero = (128 + q) s + (zero - 136 s).
inline void int4_scale_offset(const Int4Consts& c, const c10::BFloat16* p, __m512& sc, __m512& off) {
  const __m512i sv = _mm512_loadu_si512(p);
  sc = _mm512_castsi512_ps(_mm512_slli_epi32(sv, 16));
  off = _mm512_fnmadd_ps(_mm512_set1_ps(136.f), sc, _mm512_castsi512_ps(_mm512_and_si512(sv, c.top)));
}

// A block's group scales, in one of the two layouts int4_gemm takes; scale(g, j) is s for columns 16j..16j+15 of
// group g, scale_offset also the offset that goes with the 128 + q values. PairScales: bf16 (scale, zero) pairs
// [groups, 64, 2] (block_scale_zeros), any group size, 5 bits a weight with the values at groups of 32.
struct PairScales {
  const c10::BFloat16* p;  // the block's pairs
  EMBER_INLINE __m512 scale(int64_t g, int j) const {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(p + (g * NB + 16 * j) * 2), 16));
  }
  EMBER_INLINE void scale_offset(const Int4Consts& c, int64_t g, int j, __m512& sc, __m512& off) const {
    int4_scale_offset(c, p + (g * NB + 16 * j) * 2, sc, off);
  }
};

// KQuantScales: GGUF Q4_K / Q5_K's scales as the file stores them, w = d sc q + e m with d and e (-dmin) f16 a
// super-block of 256 inputs and sc, m a byte a group of 32 (6 bits used in Q4_K; pack_k_scales): per super-block, the 64
// columns' d, then their e (f16), then per group the columns' sc, then their m (a byte each). 4.625 bits a
// weight with the values where the pairs take 5, and s = d sc, e m exact in float32 (the pairs round them to bf16).
// A group's (s, off = e m - 128 s) come from the bytes (group_scales, d and e in registers a super-block), or,
// where a block serves several row passes, from KQuantFloats, the same values laid out once (kq_floats).
constexpr int64_t KQ_GROUPS = 8;                          // groups of 32 a super-block
constexpr int64_t KQ_BYTES = 4 * NB + 2 * KQ_GROUPS * NB;  // a block's super-block: 1280 bytes
struct KQuantScales {
  const uint8_t* p;  // the block's super-blocks
  struct Super {
    __m512 d[4], e[4];
  };
  EMBER_INLINE static __m512 f16(const uint8_t* s) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
  }
  EMBER_INLINE static __m512 u8(const uint8_t* s) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))));
  }
  EMBER_INLINE Super super_at(int64_t g0) const {
    const uint8_t* sp = p + g0 / KQ_GROUPS * KQ_BYTES;
    Super su;
    for (int j = 0; j < 4; ++j) su.d[j] = f16(sp + 32 * j), su.e[j] = f16(sp + 2 * NB + 32 * j);
    return su;
  }
  EMBER_INLINE void group_scales(const Super& su, int64_t g, int j, __m512& sc, __m512& off) const {
    const uint8_t* gs = p + g / KQ_GROUPS * KQ_BYTES + 4 * NB + g % KQ_GROUPS * 2 * NB;
    sc = _mm512_mul_ps(su.d[j], u8(gs + 16 * j));
    off = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), sc, _mm512_mul_ps(su.e[j], u8(gs + NB + 16 * j)));
  }
  EMBER_INLINE void scale_offset(const Int4Consts&, int64_t g, int j, __m512& sc, __m512& off) const {
    group_scales(super_at(g / KQ_GROUPS * KQ_GROUPS), g, j, sc, off);
  }
};

// A block's K-quant (s, off) as float32 [groups][2][64] (s, then off): what group_scales gives, read back.
struct KQuantFloats {
  const float* p;
  struct Super {};
  EMBER_INLINE Super super_at(int64_t) const { return {}; }
  EMBER_INLINE void group_scales(const Super&, int64_t g, int j, __m512& sc, __m512& off) const {
    sc = _mm512_loadu_ps(p + g * 2 * NB + 16 * j);
    off = _mm512_loadu_ps(p + g * 2 * NB + NB + 16 * j);
  }
};

inline void kq_floats(const KQuantScales& ks, int64_t groups, float* out) {
  for (int64_t g0 = 0; g0 < groups; g0 += KQ_GROUPS) {
    const KQuantScales::Super su = ks.super_at(g0);
    for (int64_t g = g0; g < g0 + KQ_GROUPS; ++g)
      for (int j = 0; j < 4; ++j) {
        __m512 sc, off;
        ks.group_scales(su, g, j, sc, off);
        _mm512_storeu_ps(out + g * 2 * NB + 16 * j, sc);
        _mm512_storeu_ps(out + g * 2 * NB + NB + 16 * j, off);
      }
  }
}

template <typename S>
constexpr bool k_quant_scales = std::is_same_v<S, KQuantScales> || std::is_same_v<S, KQuantFloats>;

// Rows k, k + 1 of a block (64 bytes at p) -> b[j]: columns 16j..16j+15 as bf16 pairs (128 + q_k, 128 + q_k+1).
inline void int4_unpack(const Int4Consts& c, const uint8_t* p, __m512i b[4]) {
#ifdef EMBER_AVX512_VBMI
  const __m512i v = _mm512_loadu_si512(p);
  const __m512i lo = _mm512_permutexvar_epi8(c.ilo, v), hi = _mm512_permutexvar_epi8(c.ihi, v);
#else  // four widening loads: about 10% slower than the permutations at every size measured
  const __m512i lo = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)),
                                     _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 32))), 16));
  const __m512i hi = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))),
                                     _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 48))), 16));
#endif
  // (a & b) | c is ternary-logic table 0xEA
  b[0] = _mm512_ternarylogic_epi32(lo, c.nib, c.magic, 0xEA);
  b[1] = _mm512_ternarylogic_epi32(hi, c.nib, c.magic, 0xEA);
  b[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(lo, 4), c.nib, c.magic, 0xEA);
  b[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(hi, 4), c.nib, c.magic, 0xEA);
}

// 5-bit values (Q5_0, Q5_1, Q5_K) are the int4 pack of their low four bits plus a plane of the fifth: per row pair
// kp of a block, four 32-bit masks (hi[4 kp + j], bit 2c + h: column 16j + c, row k + h), the element order of b[j].
// 128 + q stays exact in bf16 for q up to 127, so the fifth bit is an add of 16 to the pairs it is set in: one
// masked add a vector. 6 bits a weight read instead of int8's 8.
inline void int5_high(const Int4Consts& c, const uint32_t* hi, __m512i b[4]) {
  for (int j = 0; j < 4; ++j) b[j] = _mm512_mask_add_epi16(b[j], static_cast<__mmask32>(hi[j]), b[j], c.sixteen);
}

// Row pair kp of a block into R rows' partial sums part[r][j] (xw: the rows' inputs as bf16 pairs, kw a row).
template <int R, bool HI>
EMBER_INLINE void int4_pair_step(const Int4Consts& c, const int32_t* xw, int64_t kw, int64_t kp, const uint8_t* blk,
                                 const uint32_t* hib, __m512 part[R][4]) {
  __m512i b[4];
  _mm_prefetch(reinterpret_cast<const char*>(blk + kp * 64 + INT4_PREFETCH), _MM_HINT_T0);
  int4_unpack(c, blk + kp * 64, b);
  if constexpr (HI) int5_high(c, hib + kp * 4, b);
  for (int r = 0; r < R; ++r) {
    const __m512bh a = (__m512bh)_mm512_set1_epi32(xw[r * kw + kp]);
    for (int j = 0; j < 4; ++j) part[r][j] = _mm512_dpbf16_ps(part[r][j], a, (__m512bh)b[j]);
  }
}

// y[0 : R, 0 : 64] of one block (blk: its K x 32 bytes; szb: the block's (scale, zero) pairs, [groups, 64, 2]). U
// interleaved chains of group sums (one row through the 120 int4 weights of the default model's shapes, 66 MB, 2
// threads: U = 1 2.08-2.20 ms, U = 2 1.89-1.98 ms when first measured; within noise of each other on an AMD
// Zen 5, 2026-11-28). A row's result depends on U, not on R: the batch-invariant kernel runs U = 1 at every row count.
template <int R, int U, bool HI, typename S>
inline void int4_block_rows(const Int4Consts& c, const int32_t* xw, int64_t kw, const float* xsum, int64_t groups,
                            int64_t gw, const uint8_t* blk, const uint32_t* hib, const S& szb, int64_t N,
                            c10::BFloat16* y) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[U][R][4];
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) part[u][r][j] = _mm512_setzero_ps();
    for (int64_t kp0 = g * gw; kp0 < (g + 1) * gw; kp0 += U)  // gw is a multiple of U (groups of 32 or more)
      for (int u = 0; u < U; ++u) {
        const int64_t kp = kp0 + u;
        int4_pair_step<R, HI>(c, xw, kw, kp, blk, hib, part[u]);
      }
    for (int u = 1; u < U; ++u)
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) part[0][r][j] = _mm512_add_ps(part[0][r][j], part[u][r][j]);
    for (int j = 0; j < 4; ++j) {
      const __m512 sc = szb.scale(g, j);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(part[0][r][j], sc, acc[r][j]);
    }
  }
  for (int64_t g = 0; g < groups; ++g)
    for (int j = 0; j < 4; ++j) {
      __m512 sc, off;
      szb.scale_offset(c, g, j, sc, off);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * groups + g]), off, acc[r][j]);
    }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_si256((__m256i*)(y + r * N + 16 * j), (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
}

// int4_block_rows for K-quant scales: per group, s and off (shared by the rows; from the bytes or laid out once),
// then acc += part s + xsum off, the offsets' term folded into the same pass over the groups.
template <int R, bool HI, typename S>
inline void int4_block_rows_kq(const Int4Consts& c, const int32_t* xw, int64_t kw, const float* xsum,
                               int64_t groups, const uint8_t* blk, const uint32_t* hib, const S& ks, int64_t N,
                               c10::BFloat16* y) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < groups; g0 += KQ_GROUPS) {
    const typename S::Super su = ks.super_at(g0);
    for (int64_t g = g0; g < g0 + KQ_GROUPS; ++g) {
      __m512 part[R][4];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) part[r][j] = _mm512_setzero_ps();
      for (int64_t kp = g * 16; kp < (g + 1) * 16; ++kp) int4_pair_step<R, HI>(c, xw, kw, kp, blk, hib, part);
      for (int j = 0; j < 4; ++j) {
        __m512 sc, off;
        ks.group_scales(su, g, j, sc, off);
        for (int r = 0; r < R; ++r)
          acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * groups + g]), off,
                                      _mm512_fmadd_ps(part[r][j], sc, acc[r][j]));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_si256((__m256i*)(y + r * N + 16 * j), (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
}

// one pass of R rows over a block: the K-quant kernel where the scales are such, else int4_block_rows
template <int R, int U, bool HI, typename S>
EMBER_INLINE void int4_pass(const Int4Consts& c, const int32_t* xw, int64_t kw, const float* xsum, int64_t groups,
                            int64_t gw, const uint8_t* blk, const uint32_t* hib, const S& szb, int64_t N,
                            c10::BFloat16* y) {
  if constexpr (k_quant_scales<S>)
    int4_block_rows_kq<R, HI, S>(c, xw, kw, xsum, groups, blk, hib, szb, N, y);
  else
    int4_block_rows<R, U, HI, S>(c, xw, kw, xsum, groups, gw, blk, hib, szb, N, y);
}

template <typename S>
void int4_panel(const Int4Consts& c, const uint8_t* blk, const uint32_t* hib, const S& szb, int64_t K, int64_t group,
                uint32_t* panel) {
  const PanelStore store;
  const int64_t gw = group / 2;
  for (int64_t g = 0; g < K / group; ++g) {
    __m512 sc[4], off[4];
    for (int j = 0; j < 4; ++j) szb.scale_offset(c, g, j, sc[j], off[j]);
    for (int64_t kp = g * gw; kp < (g + 1) * gw; ++kp) {
      __m512i b[4];
      int4_unpack(c, blk + kp * 64, b);
      if (hib != nullptr) int5_high(c, hib + kp * 4, b);
      store(b, sc, off, panel + kp * NB);
    }
  }
}

constexpr int U1 = 2, U2 = 2;  // chains at 1 and 2 rows (3 rows: 12 independent sums already)

// batch invariant: one chain a group (U = 1) at every row count, in passes of up to INV_PASS rows
template <bool HI, typename S>
void int4_span_invariant(const Int4Consts& c, const int32_t* xw, int64_t kw, const float* xsum, int64_t groups,
                         int64_t gw, const uint8_t* blk, const uint32_t* hib, const S& szb, int64_t N,
                         c10::BFloat16* y, int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; m += INV_PASS) {
    const int32_t* xr = xw + m * kw;
    const float* sr = xsum + m * groups;
    c10::BFloat16* yr = y + m * N;
    switch (ember_fixed::min<int64_t>(INV_PASS, m1 - m)) {
      case 1: int4_pass<1, 1, HI, S>(c, xr, kw, sr, groups, gw, blk, hib, szb, N, yr); break;
      case 2: int4_pass<2, 1, HI, S>(c, xr, kw, sr, groups, gw, blk, hib, szb, N, yr); break;
      case 3: int4_pass<3, 1, HI, S>(c, xr, kw, sr, groups, gw, blk, hib, szb, N, yr); break;
      case 4: int4_pass<4, 1, HI, S>(c, xr, kw, sr, groups, gw, blk, hib, szb, N, yr); break;
      case 5: int4_pass<5, 1, HI, S>(c, xr, kw, sr, groups, gw, blk, hib, szb, N, yr); break;
      default: int4_pass<6, 1, HI, S>(c, xr, kw, sr, groups, gw, blk, hib, szb, N, yr); break;
    }
  }
}

// batch_invariant=False: 3-row passes, two chains at 1 and 2 rows
template <bool HI, typename S>
void int4_span(const Int4Consts& c, const int32_t* xw, int64_t kw, const float* xsum, int64_t groups, int64_t gw,
               const uint8_t* blk, const uint32_t* hib, const S& szb, int64_t N, c10::BFloat16* y,
               int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; m += 3) {
    const int32_t* xr = xw + m * kw;
    const float* sr = xsum + m * groups;
    c10::BFloat16* yr = y + m * N;
    switch (ember_fixed::min<int64_t>(3, m1 - m)) {
      case 1: int4_pass<1, U1, HI, S>(c, xr, kw, sr, groups, gw, blk, hib, szb, N, yr); break;
      case 2: int4_pass<2, U2, HI, S>(c, xr, kw, sr, groups, gw, blk, hib, szb, N, yr); break;
      default: int4_pass<3, 1, HI, S>(c, xr, kw, sr, groups, gw, blk, hib, szb, N, yr); break;
    }
  }
}

// invariant: int4_span_invariant (the same bits whatever rows are beside it); otherwise int4_span. Every pass
// unpacks the block again, from L1: laying its unpacked pairs out once in a per-thread copy for the other passes
// to read (as the kernel did from 12 rows) took 1.9x as long at 12 to 512 rows (2 threads, AMD Zen 5, 2026-11-28,
// SmolLM2's four int4 shapes; a batch-32 decode step 44-46 -> 32-35 ms, a 512-token prefill 338-341 -> 195-214 ms;
// the same bits).
// sz(nb): block nb's scales (PairScales or KQuantScales)
template <typename Scales>
void int4_rows(const c10::BFloat16* x, int64_t M, int64_t K, const uint8_t* w, const uint32_t* hi, Scales sz,
               int64_t N, int64_t group, c10::BFloat16* y, bool invariant) {
  const int64_t groups = K / group, kw = K / 2, gw = group / 2;
  const std::vector<float> xsum = group_sums(x, M, K, group);
  const int32_t* xw = reinterpret_cast<const int32_t*>(x);
  block_spans<Int4Consts>(N, M, [&](const Int4Consts& c, int64_t nb, int64_t m0, int64_t m1) {
    const uint8_t* blk = w + nb * K * 32;
    const uint32_t* hib = hi == nullptr ? nullptr : hi + nb * K * 2;  // K / 2 pairs of 4 masks
    c10::BFloat16* yb = y + nb * NB;
    auto spans = [&](const auto& szb) {
      if (invariant && hib)
        int4_span_invariant<true>(c, xw, kw, xsum.data(), groups, gw, blk, hib, szb, N, yb, m0, m1);
      else if (invariant)
        int4_span_invariant<false>(c, xw, kw, xsum.data(), groups, gw, blk, hib, szb, N, yb, m0, m1);
      else if (hib)
        int4_span<true>(c, xw, kw, xsum.data(), groups, gw, blk, hib, szb, N, yb, m0, m1);
      else
        int4_span<false>(c, xw, kw, xsum.data(), groups, gw, blk, hib, szb, N, yb, m0, m1);
    };
    const auto szb = sz(nb);
    if constexpr (std::is_same_v<std::decay_t<decltype(szb)>, KQuantScales>) {
      // more than one pass over the block: its (s, off) made once (the same values, so the same bits), then read
      // by each pass (a 512-token prefill of Qwen2.5-Coder-1.5B: see docs/quantization.md)
      if (m1 - m0 > (invariant ? INV_PASS : 3)) {
        thread_local std::vector<float> floats;
        floats.resize(groups * 2 * NB);
        kq_floats(szb, groups, floats.data());
        spans(KQuantFloats{floats.data()});
        return;
      }
    }
    spans(szb);
  });
}

#ifdef EMBER_AMX
// int4 on AMX, every row count: a row's tile product does not depend on the other rows in the tile
// (benchmarks/amx_bits.py), so this path is batch invariant by itself, and faster than vdpbf16ps where rows share a
// block. Per 64-column block and group: the group's pairs as int4_unpack makes them (128 + q, bf16) go to a
// 16-pair x 64-column buffer; four tile products (16 columns each) of up to 16 x rows by the group's 32 inputs
// give the group sums, scaled into float32 accumulators as the AVX512 path scales its own; the offsets follow
// from each row's group sums of x, as there. AMX rounds otherwise than vdpbf16ps (more exactly), so a machine
// runs one or the other for a weight, never both.
constexpr int AMX_ROWS = 16;

// the first 64-byte aligned element of a buffer allocated a line longer
template <typename T>
T* line_aligned(T* p) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

// tiles 0-3: the group sums of columns 16J..16J+15 (C), 4: rows x 32 inputs of x (A), 5-7: 16 pairs x 16 columns
// of the group's weights (B; three, so a product need not wait for the one before it to free its B). GCC's tile
// intrinsics take literal tile numbers, hence a macro.
#define EMBER_AMX_GROUP_SUMS()                                                 \
  do {                                                                         \
    _tile_zero(0);                                                             \
    _tile_zero(1);                                                             \
    _tile_zero(2);                                                             \
    _tile_zero(3);                                                             \
    for (int64_t t = 0; t < ktiles; ++t) {                                     \
      const uint32_t* bt = pb + t * 16 * 64;                                   \
      _tile_loadd(4, xa + t * 32, K * 2);                                      \
      _tile_loadd(5, bt, 256);                                                 \
      _tile_dpbf16ps(0, 4, 5);                                                 \
      _tile_loadd(6, bt + 16, 256);                                            \
      _tile_dpbf16ps(1, 4, 6);                                                 \
      _tile_loadd(7, bt + 32, 256);                                            \
      _tile_dpbf16ps(2, 4, 7);                                                 \
      _tile_loadd(5, bt + 48, 256);                                            \
      _tile_dpbf16ps(3, 4, 5);                                                 \
    }                                                                          \
    _tile_stored(0, cb, 64);                                                   \
    _tile_stored(1, cb + AMX_ROWS * 16, 64);                                   \
    _tile_stored(2, cb + 2 * AMX_ROWS * 16, 64);                               \
    _tile_stored(3, cb + 3 * AMX_ROWS * 16, 64);                               \
  } while (0)

constexpr int AMX_TILES = 4;  // row tiles a work item: a group is unpacked once for up to 64 rows

// acc[r, 0:64] += sums[r, :] * scale for a row tile's group sums (cbuf: 4 tiles of AMX_ROWS x 16)
EMBER_INLINE void amx_scale_into(const float* cb, const c10::BFloat16* szg, int rows, float* acc) {
  for (int j = 0; j < 4; ++j) {
    const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(szg + 16 * j * 2), 16));
    for (int r = 0; r < rows; ++r) {
      float* a = acc + r * 64 + 16 * j;
      _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_load_ps(cb + (j * AMX_ROWS + r) * 16), sc, _mm512_load_ps(a)));
    }
  }
}

// y[m0 : m0 + tiles x tile_rows, block] for one 64-column block (blk: its K x 32 bytes; szb: its [groups, 64, 2]
// pairs), tiles <= AMX_TILES row tiles of tile_rows rows (the configured tile height). Pipelined a group deep: the
// pairs and the tile sums alternate between two buffers, and group g - 1's sums are scaled after group g's tile
// products are issued, so that neither the tile loads nor the vector loads wait on the stores just before them.
void int4_amx_block(const Int4Consts& c, const c10::BFloat16* x, int64_t K, int64_t m0, int tiles, int tile_rows,
                    const float* xsum, int64_t group, const uint8_t* blk, const c10::BFloat16* szb, int64_t N,
                    c10::BFloat16* y, uint32_t* pairs, float* cbuf, float* acc) {
  const int64_t groups = K / group, gw = group / 2, ktiles = group / 32, rows = int64_t(tiles) * tile_rows;
  std::memset(acc, 0, rows * 64 * sizeof(float));
  for (int64_t g = 0; g <= groups; ++g) {
    if (g < groups) {
      uint32_t* pb = pairs + (g % 2) * 64 * 64;
      for (int64_t kp = 0; kp < gw; ++kp) {
        __m512i b[4];
        _mm_prefetch(reinterpret_cast<const char*>(blk + (g * gw + kp) * 64 + INT4_PREFETCH), _MM_HINT_T0);
        int4_unpack(c, blk + (g * gw + kp) * 64, b);
        for (int j = 0; j < 4; ++j) _mm512_store_si512(pb + kp * 64 + 16 * j, b[j]);
      }
      for (int tile = 0; tile < tiles; ++tile) {
        const c10::BFloat16* xa = x + (m0 + tile * tile_rows) * K + g * group;
        float* cb = cbuf + ((g % 2) * AMX_TILES + tile) * 4 * AMX_ROWS * 16;
        EMBER_AMX_GROUP_SUMS();
      }
    }
    if (g > 0)
      for (int tile = 0; tile < tiles; ++tile)
        amx_scale_into(cbuf + (((g - 1) % 2) * AMX_TILES + tile) * 4 * AMX_ROWS * 16, szb + (g - 1) * NB * 2,
                       tile_rows, acc + tile * tile_rows * 64);
  }
  for (int64_t g = 0; g < groups; ++g)
    for (int j = 0; j < 4; ++j) {
      __m512 sc, off;
      int4_scale_offset(c, szb + (g * NB + 16 * j) * 2, sc, off);
      for (int64_t r = 0; r < rows; ++r) {
        float* a = acc + r * 64 + 16 * j;
        _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(xsum[(m0 + r) * groups + g]), off, _mm512_load_ps(a)));
      }
    }
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_si256((__m256i*)(y + (m0 + r) * N + 16 * j),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc + r * 64 + 16 * j)));
}

void int4_amx_rows(const c10::BFloat16* x, int64_t M, int64_t K, const uint8_t* w, const c10::BFloat16* sz,
                   int64_t N, int64_t group, c10::BFloat16* y) {
  const int64_t groups = K / group;
  const std::vector<float> xsum = group_sums(x, M, K, group);
  constexpr int64_t SPAN = AMX_TILES * AMX_ROWS;
  const int64_t blocks = N / NB, spans = (M + SPAN - 1) / SPAN;
  at::parallel_for(0, blocks * spans, 1, [&](int64_t begin, int64_t end) {
    const Int4Consts c;
    // a group of up to 128 inputs (64 pairs x 64 columns) twice; the sums of AMX_TILES row tiles twice; the rows'
    // accumulators: 64-byte aligned in vectors padded by a line
    std::vector<uint32_t> pairs(2 * 64 * 64 + 16);
    std::vector<float> cbuf(2 * AMX_TILES * 4 * AMX_ROWS * 16 + 16), acc(SPAN * 64 + 16);
    uint32_t* pb = line_aligned(pairs.data());
    float *cb = line_aligned(cbuf.data()), *ab = line_aligned(acc.data());
    int configured = 0;
    const auto configure = [&](int rows) {  // tiles 0-3: C (rows x 16 floats), 4: A (rows x 32 bf16), 5-7: B
      if (rows == configured) return;
      const uint8_t r[8] = {uint8_t(rows), uint8_t(rows), uint8_t(rows), uint8_t(rows), uint8_t(rows), 16, 16, 16};
      const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
      ember_amx::configure(r, colsb, 8);
      configured = rows;
    };
    for (int64_t item = begin; item < end; ++item) {
      const int64_t nb = item / spans, m0 = item % spans * SPAN, rows = ember_fixed::min<int64_t>(SPAN, M - m0);
      const uint8_t* blk = w + nb * K * 32;
      const c10::BFloat16* szb = sz + nb * groups * NB * 2;
      if (const int full = static_cast<int>(rows / AMX_ROWS); full > 0) {
        configure(AMX_ROWS);
        int4_amx_block(c, x, K, m0, full, AMX_ROWS, xsum.data(), group, blk, szb, N, y + nb * NB, pb, cb, ab);
      }
      if (const int rest = static_cast<int>(rows % AMX_ROWS); rest > 0) {
        configure(rest);
        int4_amx_block(c, x, K, m0 + rows - rest, 1, rest, xsum.data(), group, blk, szb, N, y + nb * NB, pb, cb,
                       ab);
      }
    }
    if (configured) _tile_release();
  });
}
#endif

// --- int8, batch invariant: every output is the same chain whatever the row count ---
// y[m, n] = bf16(reduce16(acc) * scale[n]), acc's lane l summing, chunk after chunk of 32 inputs, the vdpbf16ps
// products of inputs 2l, 2l + 1 (x as it is, w's integers as exact bf16); reduce16 is the same tree for every
// slot. One row reads the weight rows one after another (int8_row_in_turn); up to 12 rows each weight chunk is
// converted where it lies and dotted with every row; more run 4 x 4 tiles against a tile of weight rows converted
// once into a per-thread buffer (int8_groups_inv; rows longer than INT8_TILE_MAX_K: int8_pairs_inv).
constexpr int64_t KC = 32;  // inputs a chunk

// 32 int8 at p -> their 32 exact bf16, in order
EMBER_INLINE __m512i int8_chunk_bf16(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

#ifdef EMBER_AMX
// int8 on AMX with x in exact integer parts, every row count. Each row of x is written as
//   x[m, k] = 2^(e_m) * (u[m, k] - 2^23),  u in [0, 2^24): three unsigned bytes (limbs) u0 + 2^8 u1 + 2^16 u2,
// e_m from the row's largest |x| (a value under 2^-15 of the largest may lie off that grid and is rounded to it,
// an error under 2^-23 of the largest). The int8 weight multiplies each limb as it lies in memory (the A operand
// of TDPBSUD: 16 weight rows x 64 inputs, signed; the limbs in pairs of four inputs the B operand, unsigned) into
// exact int32 sums, so sum_k w[n, k] x[m, k] = 2^(e_m) * (S0 + 2^8 S1 + 2^16 S2 - 2^23 sum_k w[n, k]) exactly in
// int64, then one rounding to double with the row scale (x 2^(e_m) is exact) and one to float. No weight is widened
// to bf16 (the cost of the bf16 paths at one row), and a row's bits depend on nothing but that row: integer sums
// have no order.
constexpr int64_t XT = 64;  // inputs a k tile: 64 bytes of a weight row

// the int64 sum and the float output of 16 columns of one row: s0..s2 the limb sums, ws the weights' row sums,
// sc the row scales, p2 = 2^(e_m)
EMBER_INLINE __m256 exact_half(__m256i s0, __m256i s1, __m256i s2, __m256i ws, __m256 sc, __m512d p2) {
  __m512i t = _mm512_cvtepi32_epi64(s0);
  t = _mm512_add_epi64(t, _mm512_slli_epi64(_mm512_cvtepi32_epi64(s1), 8));
  t = _mm512_add_epi64(t, _mm512_slli_epi64(_mm512_cvtepi32_epi64(s2), 16));
  t = _mm512_sub_epi64(t, _mm512_slli_epi64(_mm512_cvtepi32_epi64(ws), 23));
  return _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_mul_pd(_mm512_cvtepi64_pd(t), _mm512_cvtps_pd(sc)), p2));
}

EMBER_INLINE __m512 exact_out16(__m512i s0, __m512i s1, __m512i s2, __m512i ws, __m512 sc, double p2) {
  const __m512d p = _mm512_set1_pd(p2);
  const __m256 lo = exact_half(_mm512_castsi512_si256(s0), _mm512_castsi512_si256(s1), _mm512_castsi512_si256(s2),
                               _mm512_castsi512_si256(ws), _mm512_castps512_ps256(sc), p);
  const __m256 hi = exact_half(_mm512_extracti64x4_epi64(s0, 1), _mm512_extracti64x4_epi64(s1, 1),
                               _mm512_extracti64x4_epi64(s2, 1), _mm512_extracti64x4_epi64(ws, 1),
                               _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sc), 1)), p);
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

// the 16 outputs v of one row where mask says, as T (bf16, or float32 for logits)
template <typename T>
EMBER_INLINE void store16(T* y, __mmask16 mask, __m512 v) {
  if constexpr (std::is_same_v<T, float>)
    _mm512_mask_storeu_ps(y, mask, v);
  else
    _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// x's limbs as B tiles (where xb is not null): xb[((s * 3 + l) * kt + t) * 256 + q * 16 + m] = limb l of inputs
// 64 t + 4 q .. + 3 of row 16 s + m (four bytes, one 32-bit word), zero past M and K; p2[m] = 2^(e_m), NaN for a
// row with a NaN or infinity
// xr (where not null): the limbs row by row, xr[(m * 3 + l) * 64 kt + k], for the few-row path
void exact_x_limbs(const c10::BFloat16* x, int64_t M, int64_t K, int64_t kt, uint32_t* xb, uint8_t* xr,
                   double* p2) {
  const int64_t spans = (M + 15) / 16;
  at::parallel_for(0, spans, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint32_t rows[3][16][16];
    for (int64_t s = begin; s < end; ++s) {
      float mul[16];
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t m = s * 16 + i;
        mul[i] = 0.f;
        if (m >= M) continue;
        __m512 vmax = _mm512_setzero_ps();  // |x| as bits: the largest magnitude, NaN above infinity
        for (int64_t k = 0; k < K; k += 16) {
          const __mmask16 in = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
          const __m512i raw = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, x + m * K + k));
          vmax = _mm512_castsi512_ps(_mm512_max_epu32(_mm512_castps_si512(vmax),
                                                      _mm512_and_si512(_mm512_slli_epi32(raw, 16),
                                                                       _mm512_set1_epi32(0x7FFFFFFF))));
        }
        float amax;
        {
          const uint32_t bits = static_cast<uint32_t>(_mm512_reduce_max_epu32(_mm512_castps_si512(vmax)));
          std::memcpy(&amax, &bits, 4);
        }
        if (!std::isfinite(amax)) {
          p2[m] = std::numeric_limits<double>::quiet_NaN();
          continue;
        }
        int e = 0;
        if (amax > 0.f) std::frexp(amax, &e);  // amax < 2^e
        p2[m] = std::ldexp(1.0, e - 23);
        // |x| * mul < 2^23; a row whose values all lie under 2^-100 (mul would overflow a float) counts as zeros
        mul[i] = e > -100 ? std::ldexp(1.f, 23 - e) : 0.f;
      }
      for (int64_t t = 0; t < kt; ++t) {
        const int64_t left = ember_fixed::min<int64_t>(XT, K - t * XT);
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t m = s * 16 + i;
          for (int v = 0; v < 4; ++v) {  // 16 inputs a vector
            const int64_t n = ember_fixed::min<int64_t>(16, ember_fixed::max<int64_t>(0, left - 16 * v));
            __m512i u = _mm512_setzero_si512();
            if (m < M && n > 0 && mul[i] != 0.f) {
              const __m256i raw = _mm256_maskz_loadu_epi16(__mmask16((1u << n) - 1), x + m * K + t * XT + 16 * v);
              const __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
              u = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(f, _mm512_set1_ps(mul[i]))),
                                   _mm512_set1_epi32(1 << 23));
              u = _mm512_maskz_mov_epi32(__mmask16((1u << n) - 1), u);  // inputs past K: 0, not 2^23
            } else if (m < M && n > 0) {  // a zero row: u = 2^23 where the inputs are
              u = _mm512_maskz_mov_epi32(__mmask16((1u << n) - 1), _mm512_set1_epi32(1 << 23));
            }
            for (int l = 0; l < 3; ++l)
              _mm_store_si128(reinterpret_cast<__m128i*>(&rows[l][i][4 * v]),
                              _mm512_cvtepi32_epi8(_mm512_srli_epi32(u, 8 * l)));
          }
        }
        for (int64_t i = 0; xr && i < 16 && s * 16 + i < M; ++i)
          for (int l = 0; l < 3; ++l)
            _mm512_storeu_si512(xr + ((s * 16 + i) * 3 + l) * kt * XT + t * XT, _mm512_load_si512(rows[l][i]));
        for (int l = 0; xb && l < 3; ++l) {
          __m512i r[16];
          for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(rows[l][i]);
          ember_avx512::transpose16(r);  // r[q] = word q of the 16 rows
          uint32_t* dst = xb + ((s * 3 + l) * kt + t) * 256;
          for (int q = 0; q < 16; ++q) _mm512_store_si512(dst + q * 16, r[q]);
        }
      }
    }
  });
}

// The same exact sums for a few rows with AVX512-VNNI, the weight read in place: vpdpbusd multiplies 64 limb bytes
// (unsigned) by 64 weight bytes (signed) into 16 int32 lanes; R weight rows x 3 limbs x M rows of accumulators,
// reduced by one transposing add tree. Integer sums have no order, so these are the tile path's bits; from
// registers, they keep one row near memory speed where the tile loads did not. One row through the 1.5B's
// 151936 x 1536 LM head, 2 threads: 13.0 ms against 18.7 on tiles and 15.2 with the AVX512-BF16 path; Gemma 3's
// 262144 x 640: 7.7 against 11.2 and 10.4.
template <int M, typename T>
void int8_exact_rows(const uint8_t* xr, int64_t kt, int64_t K, const int8_t* w, const int32_t* wsum,
                     const float* scales, const double* p2, int64_t N, T* y) {
  constexpr int R = M <= 2 ? 4 / M : 1;  // weight rows a pass: R * 3 M <= 12 accumulators
  const int64_t blocks = (N + 15) / 16;
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t sums[3][M][16];
    alignas(64) int32_t red[16];
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n0 = nb * 16, rows = ember_fixed::min<int64_t>(16, N - n0);
      for (int64_t j0 = 0; j0 < rows; j0 += R) {
        __m512i acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_si512();
        for (int64_t t = 0; t < kt; ++t) {
          const int64_t left = ember_fixed::min<int64_t>(XT, K - t * XT);
          const __mmask64 in = left == XT ? ~__mmask64(0) : (__mmask64(1) << left) - 1;
          __m512i xl[M][3];
          for (int m = 0; m < M; ++m)
            for (int l = 0; l < 3; ++l) xl[m][l] = _mm512_loadu_si512(xr + (m * 3 + l) * kt * XT + t * XT);
          for (int r = 0; r < R; ++r) {
            if (j0 + r >= rows) break;
            const int8_t* src = w + (n0 + j0 + r) * K + t * XT;
            if (n0 + 16 + j0 + r < N) _mm_prefetch(reinterpret_cast<const char*>(src + 16 * K), _MM_HINT_T0);
            const __m512i wv = _mm512_maskz_loadu_epi8(in, src);
            for (int m = 0; m < M; ++m)
              for (int l = 0; l < 3; ++l)
                acc[(r * M + m) * 3 + l] = _mm512_dpbusd_epi32(acc[(r * M + m) * 3 + l], xl[m][l], wv);
          }
        }
        _mm512_store_si512(red, ember_avx512::reduce16_epi32(acc));
        for (int r = 0; r < R && j0 + r < 16; ++r)
          for (int m = 0; m < M; ++m)
            for (int l = 0; l < 3; ++l) sums[l][m][j0 + r] = red[(r * M + m) * 3 + l];
      }
      const __mmask16 mask = rows == 16 ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
      const __m512i ws = _mm512_maskz_loadu_epi32(mask, wsum + n0);
      const __m512 sc = _mm512_maskz_loadu_ps(mask, scales + n0);
      for (int m = 0; m < M; ++m)
        store16(y + m * N + n0, mask,
                exact_out16(_mm512_maskz_load_epi32(mask, sums[0][m]), _mm512_maskz_load_epi32(mask, sums[1][m]),
                            _mm512_maskz_load_epi32(mask, sums[2][m]), ws, sc, p2[m]));
    }
  });
}

// tiles 0-2: C (the limb sums of 16 weight rows x up to 16 rows of x), 3 and 7: A (16 weight rows x 64 inputs, in
// turn), 4-6: B (each limb's 16 input quads x up to 16 rows of x)
#define EMBER_AMX_EXACT_KTILE(a, t)                                    \
  do {                                                                 \
    if (ahead)                                                         \
      for (int64_t l = 0; l < lines; ++l)                              \
        _mm_prefetch(ahead + ((t) * lines + l) * 64, _MM_HINT_T0);     \
    _tile_loadd(a, wa + (t) * XT, lda);                                \
    _tile_loadd(4, xs + (0 * kt + (t)) * 256, 64);                     \
    _tile_dpbsud(0, a, 4);                                             \
    _tile_loadd(5, xs + (1 * kt + (t)) * 256, 64);                     \
    _tile_dpbsud(1, a, 5);                                             \
    _tile_loadd(6, xs + (2 * kt + (t)) * 256, 64);                     \
    _tile_dpbsud(2, a, 6);                                             \
  } while (0)

template <typename T>
void int8_exact_amx(const c10::BFloat16* x, int64_t M, int64_t K, const int8_t* w, const int32_t* wsum,
                    const float* scales, int64_t N, T* y) {
  const int64_t kt = (K + XT - 1) / XT, kpad = kt * XT, spans = (M + 15) / 16, blocks = (N + 15) / 16;
  std::vector<double> p2(M);
  // the few-row path where it is faster (2 threads: up to 2 rows always; 3-4 rows on a weight of 4 MB or more,
  // which streams from memory: 151936 x 1536 at 4 rows 14.5 against 18.8 ms on tiles; a small weight, from cache,
  // is faster on tiles: 1536 x 576 at 4 rows 0.055 against 0.027 ms)
  if (M <= 2 || (M <= 4 && N * K >= (int64_t(4) << 20))) {
    std::vector<uint8_t> xr(M * 3 * kpad);
    exact_x_limbs(x, M, K, kt, nullptr, xr.data(), p2.data());
    switch (M) {
      case 1: int8_exact_rows<1>(xr.data(), kt, K, w, wsum, scales, p2.data(), N, y); break;
      case 2: int8_exact_rows<2>(xr.data(), kt, K, w, wsum, scales, p2.data(), N, y); break;
      case 3: int8_exact_rows<3>(xr.data(), kt, K, w, wsum, scales, p2.data(), N, y); break;
      default: int8_exact_rows<4>(xr.data(), kt, K, w, wsum, scales, p2.data(), N, y); break;
    }
    return;
  }
  std::vector<uint32_t> xbv(spans * 3 * kt * 256 + 16);
  uint32_t* xb = line_aligned(xbv.data());
  exact_x_limbs(x, M, K, kt, xb, nullptr, p2.data());
  const int cols = static_cast<int>(ember_fixed::min<int64_t>(16, M));  // B and C: columns of x rows
  const int64_t lines = (16 * K / 64 + kt - 1) / kt;  // cache lines of a block a k tile
  at::parallel_for(0, blocks * spans, 1, [&](int64_t begin, int64_t end) {
    {
      const uint16_t cb4 = static_cast<uint16_t>(4 * cols);
      const uint8_t r[8] = {16, 16, 16, 16, 16, 16, 16, 16};
      const uint16_t colsb[8] = {cb4, cb4, cb4, 64, cb4, cb4, cb4, 64};
      ember_amx::configure(r, colsb, 8);
    }
    std::vector<int8_t> padv;  // a block whose rows or inputs the tiles would read past: copied, zero-padded
    std::vector<int32_t> cbv(3 * 256 + 16);
    int32_t* cb = line_aligned(cbv.data());
    int64_t padded = -1;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t nb = item / spans, s = item % spans, n0 = nb * 16;
      const int64_t rows = ember_fixed::min<int64_t>(16, N - n0), mr = ember_fixed::min<int64_t>(16, M - s * 16);
      const int8_t* wa = w + n0 * K;
      int64_t lda = K;
      if (rows < 16 || K % XT) {
        if (padv.empty()) padv.resize(16 * kpad + 64);
        int8_t* pad = line_aligned(padv.data());
        if (padded != nb) {
          std::memset(pad, 0, 16 * kpad);
          for (int64_t j = 0; j < rows; ++j) std::memcpy(pad + j * kpad, w + (n0 + j) * K, K);
          padded = nb;
        }
        wa = pad;
        lda = kpad;
      }
      const uint32_t* xs = xb + s * 3 * kt * 256;
      // the next block (16 rows after these, contiguous) asked for in step with this one's k tiles: the tile
      // loads alone left one row short of memory speed (Gemma 3's 262144 x 640 LM head, 2 threads: 13.2 -> 10.2 ms,
      // the AVX512 path 10.3)
      const char* ahead = s == 0 && n0 + 32 <= N ? reinterpret_cast<const char*>(w + (n0 + 16) * K) : nullptr;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      int64_t t = 0;
      for (; t + 1 < kt; t += 2) {  // two A tiles in turn, so that a load need not wait for the products before it
        EMBER_AMX_EXACT_KTILE(3, t);
        EMBER_AMX_EXACT_KTILE(7, t + 1);
      }
      if (t < kt) EMBER_AMX_EXACT_KTILE(3, t);
      _tile_stored(0, cb, 64);
      _tile_stored(1, cb + 256, 64);
      _tile_stored(2, cb + 512, 64);
      const __mmask16 mask = rows == 16 ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
      const __m512i ws = _mm512_maskz_loadu_epi32(mask, wsum + n0);
      const __m512 sc = _mm512_maskz_loadu_ps(mask, scales + n0);
      // cb[l * 256 + n * 16 + m]: column m is row m's sums with the block's 16 weight rows
      __m512i c[3][16];
      for (int l = 0; l < 3; ++l) {
        for (int n = 0; n < 16; ++n) c[l][n] = _mm512_load_si512(cb + l * 256 + n * 16);
        ember_avx512::transpose16(c[l]);  // c[l][m]: row m's sums
      }
      for (int64_t m = 0; m < mr; ++m)
        store16(y + (s * 16 + m) * N + n0, mask, exact_out16(c[0][m], c[1][m], c[2][m], ws, sc, p2[s * 16 + m]));
    }
    _tile_release();
  });
}
#undef EMBER_AMX_EXACT_KTILE
#endif

// x [M, K] bf16 with each row zero-padded to whole chunks (a copy only when K % 32 != 0)
struct PaddedRows {
  std::vector<c10::BFloat16> copy;
  const c10::BFloat16* p;
  int64_t stride;
  PaddedRows(const c10::BFloat16* x, int64_t M, int64_t K) : p(x), stride(K) {
    if (K % KC == 0) return;
    stride = (K + KC - 1) / KC * KC;
    copy.assign(M * stride, c10::BFloat16(0.f));
    for (int64_t m = 0; m < M; ++m) std::memcpy(copy.data() + m * stride, x + m * K, K * sizeof(c10::BFloat16));
    p = copy.data();
  }
};

// sums[m * B + j] (slots of reduce16) times the row scales -> y rows (T: bf16, or float32 for logits)
template <int M, int B, typename T>
inline void store_sums(const __m512 sums, const float* scales, int64_t n0, int64_t rows, int64_t N, T* y,
                       int64_t ldy) {
  static_assert(M * B <= 16 && 16 % B == 0, "one slot a sum");
  // slot m * B + j takes scale j: the rows' scales (zeros past the last row) repeated, built in registers (filled
  // slot by slot in memory, the vector load waited on the 16 stores: int8_groups_inv's 4 x 4 tiles before their
  // prefetch, 64 rows of the 49152 x 576 LM head, went from 1.26x dense_gemm's time to 1.17x; AMD Zen 4, 2 threads,
  // 2026-11-29)
  const __m512i lane = _mm512_set_epi32(15 % B, 14 % B, 13 % B, 12 % B, 11 % B, 10 % B, 9 % B, 8 % B, 7 % B, 6 % B,
                                        5 % B, 4 % B, 3 % B, 2 % B, 1 % B, 0);
  const __m512 s = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << rows) - 1), scales + n0);
  alignas(64) T out[16];
  const __m512 scaled = _mm512_mul_ps(sums, _mm512_permutexvar_ps(lane, s));
  if constexpr (std::is_same_v<T, float>)
    _mm512_store_ps(out, scaled);
  else
    _mm256_store_si256((__m256i*)out, (__m256i)_mm512_cvtneps_pbh(scaled));
  if (rows == B)
    for (int m = 0; m < M; ++m) std::memcpy(y + m * ldy + n0, out + m * B, B * sizeof(T));
  else
    for (int m = 0; m < M; ++m) std::memcpy(y + m * ldy + n0, out + m * B, rows * sizeof(T));
}

// Chunk c of weight row n (chunks = full + a partial last one): in place, or its zero-padded copy in int8_tails'.
EMBER_INLINE const int8_t* int8_chunk_at(const int8_t* w, const int8_t* tails, int64_t K, int64_t n, int64_t c) {
  return c < K / KC ? w + n * K + c * KC : tails + n * KC;
}

// Rows m0 .. m0 + M - 1 of x against weight rows n0 .. n0 + B - 1 (B <= N - n0 of them real, the rest zeros): each
// weight chunk is converted where it lies (int8_rows_inv), or comes converted already with CONV (conv[c * B + j]:
// chunk c of weight row n0 + j, int8_convert_rows; int8_groups_inv), then dot with every row; M * B <= 24 sums stay
// in registers, reduced 16 at a time by the one transposing add tree.
template <int M, int B, bool CONV = false, typename T>
EMBER_INLINE void int8_block_inv(const PaddedRows& x, int64_t m0, int64_t K, const int8_t* w, const int8_t* tails,
                                 const float* scales, int64_t N, int64_t n0, bool prefetch, T* y,
                                 const __m512i* conv = nullptr) {
  static_assert(M * B <= 24 && (M * B <= 16 || B == 2), "24 sums at most; rows 8 on in the second tree");
  constexpr int PF = 2;
  alignas(64) static const int8_t zeros[KC] = {};  // the rows past N of the last block
  const int64_t chunks = (K + KC - 1) / KC, full = K / KC, rows = ember_fixed::min<int64_t>(B, N - n0);
  __m512 acc[M * B > 16 ? 32 : 16];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const c10::BFloat16* xr = x.p + m0 * x.stride;
  for (int64_t c = 0; c < chunks; ++c) {
    __m512bh wv[B];
    for (int j = 0; j < B && CONV; ++j) wv[j] = (__m512bh)_mm512_load_si512(conv + c * B + j);
    for (int j = 0; j < B && !CONV; ++j) {
      const int64_t n = n0 + j;
      const int8_t* src = n >= N ? zeros : int8_chunk_at(w, tails, K, n, c);
      if (prefetch && c < full && c % 2 == 0 && n + PF * B < N)
        _mm_prefetch(reinterpret_cast<const char*>(src + PF * B * K), _MM_HINT_T0);
      wv[j] = (__m512bh)int8_chunk_bf16(src);
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + m * x.stride + c * KC);
      for (int j = 0; j < B; ++j) acc[m * B + j] = _mm512_dpbf16_ps(acc[m * B + j], xv, wv[j]);
    }
  }
  if constexpr (M * B <= 16) {
    store_sums<M, B>(ember_avx512::reduce16(acc), scales, n0, rows, N, y + m0 * N, N);
  } else {
    store_sums<8, B>(ember_avx512::reduce16(acc), scales, n0, rows, N, y + m0 * N, N);
    store_sums<M - 8, B>(ember_avx512::reduce16(acc + 16), scales, n0, rows, N, y + (m0 + 8) * N, N);
  }
}

// each row's last, partial chunk, zero-padded (none when K is whole chunks)
std::vector<int8_t> int8_tails(const int8_t* w, int64_t N, int64_t K) {
  const int64_t full = K / KC;
  std::vector<int8_t> tails(K % KC ? N * KC : 0, 0);
  for (int64_t n = 0; n < N && K % KC; ++n) std::memcpy(tails.data() + n * KC, w + n * K + full * KC, K % KC);
  return tails;
}

// One row of x against the 16 weight rows from n0, each read front to back in turn: one stream (the rows are
// contiguous), where int8_block_inv<1, 8> reads 8 rows side by side, chunk by chunk. Each output is the same chain
// (its chunks in order into one accumulator, the same reduce16 slot), so the bits are int8_block_inv's. 2 threads,
// AMD Zen 4 (2026-11-29, a stand-alone loop of the same instructions, weights from memory): 8 rows side by side
// 18-22 GB/s, one at a time 30-34 on the 151936 x 1536, 262144 x 640 and 49152 x 576 LM heads and 4864 x 896.
template <typename T>
EMBER_INLINE void int8_row_in_turn(const PaddedRows& x, int64_t K, const int8_t* w, const int8_t* tails,
                                   const float* scales, int64_t N, int64_t n0, T* y) {
  constexpr int B = 16, PF = 2;  // weight rows a call; rows ahead each row asks for
  const int64_t chunks = (K + KC - 1) / KC, full = K / KC, rows = ember_fixed::min<int64_t>(B, N - n0);
  __m512 acc[B];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t j = 0; j < rows; ++j) {
    const int64_t n = n0 + j;
    __m512 a = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const int8_t* src = int8_chunk_at(w, tails, K, n, c);
      if (c < full && c % 2 == 0 && n + PF < N) _mm_prefetch(reinterpret_cast<const char*>(src + PF * K), _MM_HINT_T0);
      a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(x.p + c * KC), (__m512bh)int8_chunk_bf16(src));
    }
    acc[j] = a;
  }
  store_sums<1, B>(ember_avx512::reduce16(acc), scales, n0, rows, N, y, N);
}

template <int M, typename T>
void int8_rows_inv(const PaddedRows& x, int64_t K, const int8_t* w, const float* scales, int64_t N, T* y) {
  // up to 12 rows (a row verifying up to 11 drafted tokens) each weight row is converted once for every x row; 4 x 4
  // tiles of weights converted into a buffer first were slower from 5 rows (a version converting them for every tile
  // of x rows; int8_groups_inv's at 13 rows 3.3-3.6 ms against 12 rows here 2.6-2.9, AMD Zen 4). The 49152 x 576 LM
  // head (AMD Zen 5, 2 threads): 5 rows 1.59 -> 0.93-1.04 ms, 8 rows 2.27 -> 1.08-1.17 (4 rows: 0.61-0.67); from 9
  // rows two weight rows a pass (up to 24 sums) instead of one: 9 rows 1.8 -> 1.5 ms, 12 rows 2.4 -> 1.7
  constexpr int B = M == 1 ? 16 : M <= 4 ? 4 : 2;
  const std::vector<int8_t> tails = int8_tails(w, N, K);
  at::parallel_for(0, (N + B - 1) / B, M == 1 ? 8 : 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if constexpr (M == 1)
        int8_row_in_turn(x, K, w, tails.data(), scales, N, b * B, y);
      else
        int8_block_inv<M, B>(x, 0, K, w, tails.data(), scales, N, b * B, true, y);
    }
  });
}

// f(std::integral_constant<int, m>{}) for a row count m in 1 .. 12: the row kernels take theirs as a template
// argument (their sums live in registers)
template <typename F>
void with_rows(int64_t m, F&& f) {
  switch (m) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 9: f(std::integral_constant<int, 9>{}); break;
    case 10: f(std::integral_constant<int, 10>{}); break;
    case 11: f(std::integral_constant<int, 11>{}); break;
    default: f(std::integral_constant<int, 12>{}); break;
  }
}

// The chunks of weight rows n0 .. n0 + B - 1 as exact bf16 into conv[c * B + j] (a row past N as zeros), each row
// read front to back: the layout int8_block_inv<., B, true> reads.
template <int B>
EMBER_INLINE void int8_convert_rows(const int8_t* w, const int8_t* tails, int64_t N, int64_t K, int64_t n0,
                                    __m512i* conv) {
  const int64_t chunks = (K + KC - 1) / KC;
  for (int64_t j = 0; j < B; ++j) {
    const int64_t n = n0 + j;
    for (int64_t c = 0; c < chunks; ++c)
      conv[c * B + j] = n >= N ? _mm512_setzero_si512() : int8_chunk_bf16(int8_chunk_at(w, tails, K, n, c));
  }
}

// more than 12 rows, long weight rows (K > INT8_TILE_MAX_K): a tile of 16 pairs of weight rows runs each group of
// up to 12 rows over its pairs in turn, each pair converted where it lies, once a group (48 rows of the 49152 x 576 LM
// head 8.4-9.2 -> 7.1-7.2 ms against a pair at a time for all groups, AMD Zen 5, 2026-11-28). Against the tiles
// below (AMD Zen 4, 2 threads, 2026-11-29, two rounds): K = 8960 at 512 rows 37.6-43.1 against 47.1-49.2 ms, at 64
// rows level; K = 3072 and 4864 level; K = 2048 at 64 rows 6.9-7.1 against 4.3, K = 1536 5.6-5.8 against 4.4-4.6.
constexpr int64_t INT8_TILE_MAX_K = 4096;
constexpr int64_t INT8_TILE_PAIRS = 16;
template <typename T>
void int8_pairs_inv(const PaddedRows& x, int64_t M, int64_t K, const int8_t* w, const float* scales, int64_t N,
                    T* y) {
  const std::vector<int8_t> tails = int8_tails(w, N, K);
  const int64_t pairs = (N + 1) / 2;
  at::parallel_for(0, (pairs + INT8_TILE_PAIRS - 1) / INT8_TILE_PAIRS, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = t * INT8_TILE_PAIRS, b1 = ember_fixed::min(pairs, b0 + INT8_TILE_PAIRS);
      for (int64_t m0 = 0; m0 < M; m0 += 12)
        for (int64_t b = b0; b < b1; ++b)
          with_rows(ember_fixed::min<int64_t>(12, M - m0), [&](auto rows) {  // rows m0 .. against pair b
            int8_block_inv<decltype(rows)::value, 2>(x, m0, K, w, tails.data(), scales, N, b * 2, m0 == 0, y);
          });
    }
  });
}

// more than 12 rows, K up to INT8_TILE_MAX_K: 4 x 4 tiles, as dense_gemm's. Each thread converts a tile of weight
// rows to bf16 once, into a buffer of about 16 kB (from K = 2048 one block of 4 rows: 8 K bytes), and runs every 4
// rows of x (from L2) against each of its blocks of 4 weight rows, while the next tile's rows are prefetched into L2.
// Before (int8_pairs_inv at every K), each group of up to 12 rows converted a pair of weight rows where it lay, once a
// group (Zen 4's 512-bit conversions share the pipes with vdpbf16ps), and kept 24 sums.
// 2 threads, AMD Zen 4, 2026-11-29, the builds in turn (with store_sums' scales built in registers): the 49152 x 576
// LM head at 16 rows 5.2-6.3 -> 3.8-4.1 ms, 48 rows 11.9-12.6 -> 9.6-10.2, 64 rows 16.1-16.8 -> 12.6-13.1
// (dense_gemm's bf16: 11.8-12.2), the 262144 x 640 one at 64 rows 105-117 -> 84-90. (On the Zen 5 of 2026-11-28 the
// pairs had beaten an earlier 4 x 4 version that converted the weights again for every tile of x rows.) The same
// chains and trees: the same bits.
constexpr int INT8_TB = 4;  // weight rows (and x rows) of a tile
template <typename T>
void int8_groups_inv(const PaddedRows& x, int64_t M, int64_t K, const int8_t* w, const float* scales, int64_t N,
                     T* y) {
  const std::vector<int8_t> tails = int8_tails(w, N, K);
  const int64_t blocks = (N + INT8_TB - 1) / INT8_TB, chunks = (K + KC - 1) / KC, per = INT8_TB * chunks;
  const int64_t tile = ember_fixed::max<int64_t>(1, 16384 / (ember_fixed::max<int64_t>(per, 1) * 64));  // blocks
  at::parallel_for(0, (blocks + tile - 1) / tile, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512i> conv(tile * per);  // [block][chunk][INT8_TB]
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = t * tile, b1 = ember_fixed::min(blocks, b0 + tile);
      for (int64_t b = b0; b < b1; ++b)
        int8_convert_rows<INT8_TB>(w, tails.data(), N, K, b * INT8_TB, conv.data() + (b - b0) * per);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t next = b + tile;  // the same block of this thread's next tile: into L2 while this one runs
        if (t + 1 < end && next < blocks) {
          const char* p = reinterpret_cast<const char*>(w + next * INT8_TB * K);
          const int64_t bytes = (ember_fixed::min(N, (next + 1) * INT8_TB) - next * INT8_TB) * K;
          for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T1);
        }
        for (int64_t m0 = 0; m0 < M; m0 += INT8_TB)
          with_rows(ember_fixed::min<int64_t>(INT8_TB, M - m0), [&](auto r) {  // rows m0 .. against block b
            if constexpr (decltype(r)::value <= INT8_TB)
              int8_block_inv<decltype(r)::value, INT8_TB, true>(x, m0, K, w, tails.data(), scales, N, b * INT8_TB,
                                                                false, y, conv.data() + (b - b0) * per);
          });
      }
    }
  });
}

template <typename T>
void int8_gemm_inv(const c10::BFloat16* xp, int64_t M, int64_t K, const int8_t* w, const float* scales, int64_t N,
                   T* y) {
  const PaddedRows x(xp, M, K);
  if (M < 1) return;
  if (M > 12 && K > INT8_TILE_MAX_K)
    int8_pairs_inv(x, M, K, w, scales, N, y);
  else if (M > 12)
    int8_groups_inv(x, M, K, w, scales, N, y);
  else
    with_rows(M, [&](auto rows) { int8_rows_inv<decltype(rows)::value>(x, K, w, scales, N, y); });
}

}  // namespace
EMBER_FIXED_ORDER_END
#endif

// x bf16 [M, K], w int8 [N, K], scales float32 [N], all on the CPU: what both int8 GEMMs read.
[[maybe_unused]] static void check_int8_args(const char* fn, const torch::Tensor& x, const torch::Tensor& w,
                                             const torch::Tensor& scales) {
  ember_check::int8_weight_args(fn, x, {at::kBFloat16}, w, "scales", scales);
}

bool has_amx() {
#ifdef EMBER_AMX
  return ember_amx::granted();
#else
  return false;
#endif
}

bool has_avx512_bf16() {
#ifdef EMBER_AVX512_BF16
  return true;
#else
  return false;
#endif
}

// x bf16 [M, K]; w uint8 in the 64-row int4 pack ([N, K/2], read as [N/64, K, 32]: row r of a block in byte r % 32,
// low nibble for r < 32; torch's AVX512 pack, ember.quantization.kernels.pack_cpu_int4); scale_zeros, in one of
// two layouts, each block's after each other so that a block's weights and its scales are two streams the
// prefetchers follow: bf16 [N/64, K/group, 64, 2] (scale, zero) pairs (block_scale_zeros), or uint8 [N/64, K/256,
// 1280], GGUF K-quant scales as stored (KQuantScales, pack_k_scales; groups of 32). Returns bf16 [M, N].
// invariant: a row's result does not depend on the other rows (no bf16 panel from 128 rows, one chain count at
// every row count). amx: tile products where the machine has them (groups of 32 to 128), at every row count
// (invariant by themselves). AMX and int8_x take the pairs only.
torch::Tensor int4_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor scale_zeros, int64_t group, bool invariant,
                        bool amx, const c10::optional<torch::Tensor>& high, bool int8_x) {
#ifdef EMBER_AVX512_BF16
  using namespace ember_check;
  constexpr const char* fn = "int4_gemm";
  cpu(fn, "x", x);
  cpu(fn, "w", w);
  cpu(fn, "scale_zeros", scale_zeros);
  dtype(fn, "x", x, at::kBFloat16);
  dtype(fn, "w", w, at::kByte);
  dtype_in(fn, "scale_zeros", scale_zeros, {at::kBFloat16, at::kByte});
  dims(fn, "x", x, 2, "[M, K]");
  x = x.contiguous();
  const int64_t K = x.size(1);
  TORCH_CHECK(group > 0 && group % 4 == 0 && K % group == 0, fn, ": group = ", group,
              " must be a positive multiple of 4 that divides x's K = ", K);
  const bool kq = scale_zeros.scalar_type() == at::kByte;
  if (kq) {
    dims(fn, "scale_zeros", scale_zeros, 3, "[N/64, K/256, 1280] (K-quant scales)");
    TORCH_CHECK(group == 32 && K % 256 == 0, fn, ": K-quant scales (uint8 scale_zeros) need groups of 32 and K a "
                "multiple of 256, got group = ", group, ", K = ", K);
    size(fn, "scale_zeros", scale_zeros, 1, K / 256, "K / 256 super-blocks");
    size(fn, "scale_zeros", scale_zeros, 2, KQ_BYTES, "a block's super-block of K-quant scales");
    TORCH_CHECK(!amx && !int8_x, fn, ": K-quant scales run on the AVX512-BF16 kernel only (amx and int8_x take "
                "bf16 (scale, zero) pairs)");
  } else {
    dims(fn, "scale_zeros", scale_zeros, 4, "[N/64, K/group, 64, 2]");
    size(fn, "scale_zeros", scale_zeros, 2, NB, "64 output rows a block");
    size(fn, "scale_zeros", scale_zeros, 3, 2, "a (scale, zero) pair");
    size(fn, "scale_zeros", scale_zeros, 1, K / group, "K / group");
  }
  const int64_t N = scale_zeros.size(0) * NB;
  TORCH_CHECK(w.numel() == N * K / 2, fn, ": w must hold N * K / 2 = ", N * K / 2, " bytes (N = ", N,
              " from scale_zeros, K = ", K, " from x), got shape ", w.sizes());
  auto wc = w.contiguous();
  auto szc = scale_zeros.contiguous();
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  torch::Tensor hc;  // 5-bit weights: the fifth bits (int5_high); AMX takes 4-bit weights only
  const uint32_t* hp = nullptr;
  if (high.has_value()) {
    cpu(fn, "high", *high);
    dtype(fn, "high", *high, at::kByte);
    TORCH_CHECK(high->numel() == N * K / 8, fn, ": high must hold N * K / 8 = ", N * K / 8,
                " bytes (a bit a weight), got shape ", high->sizes());
    TORCH_CHECK(!amx, fn, ": amx=True takes 4-bit weights only (high given)");
    hc = high->contiguous();
    hp = reinterpret_cast<const uint32_t*>(hc.data_ptr<uint8_t>());
  }
  if (x.size(0) == 0) return torch::empty({0, N}, x.options());
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  auto run = [&](auto sz) {  // sz(nb): block nb's scales
    if (!invariant && x.size(0) >= INT4_PANEL_MIN_ROWS) {
      const Int4Consts c;
      return panel_gemm(x, N, [&](int64_t nb, uint32_t* panel) {
        int4_panel(c, wp + nb * K * 32, hp == nullptr ? nullptr : hp + nb * K * 2, sz(nb), K, group, panel);
      }, [](int64_t) -> const float* { return nullptr; });
    }
    auto y = torch::empty({x.size(0), N}, x.options());
    int4_rows(xp, x.size(0), K, wp, hp, sz, N, group, y.data_ptr<c10::BFloat16>(), invariant);
    return y;
  };
  if (kq) {
    const uint8_t* kp = szc.data_ptr<uint8_t>();
    return run([kp, K](int64_t nb) { return KQuantScales{kp + nb * (K / 256) * KQ_BYTES}; });
  }
  const c10::BFloat16* sp = szc.data_ptr<c10::BFloat16>();
  if (int8_x) {  // w4a8.cpp: int8 activations against the 4-bit values, at every row count
    TORCH_CHECK(!high.has_value(), fn, ": int8_x=True takes 4-bit weights only (high given)");
    TORCH_CHECK(has_w4a8(), fn, ": int8_x=True needs the w4a8 kernel (AVX512-BF16 with VNNI and VBMI), not built "
                "here");
    TORCH_CHECK(group % W4A8_BLOCK == 0, fn, ": int8_x=True needs groups a multiple of ", W4A8_BLOCK, ", got ",
                group);
    auto y = torch::empty({x.size(0), N}, x.options());
    w4a8_rows(xp, x.size(0), K, wp, sp, N, group, y.data_ptr<c10::BFloat16>());
    return y;
  }
#ifdef EMBER_AMX
  if (amx && group % 32 == 0 && group <= 128 && ember_amx::granted()) {
    auto y = torch::empty({x.size(0), N}, x.options());
    int4_amx_rows(xp, x.size(0), K, wp, sp, N, group, y.data_ptr<c10::BFloat16>());
    return y;
  }
#endif
  const int64_t groups = K / group;
  return run([sp, groups](int64_t nb) { return PairScales{sp + nb * groups * NB * 2}; });
#else
  TORCH_CHECK(false, "int4_gemm needs AVX512-BF16");
#endif
}

// x bf16 [M, K]; w int8 [N, K]; scales float32 [N]. Returns bf16 [M, N], or float32 with float_out (logits: the
// sums rounded once, not to bf16; the invariant path writes them so, the others' bf16 is widened). invariant:
// every output the same chain at every row count (int8_gemm_inv); otherwise row-wise float dots up to 4 rows, bf16
// panels from 5 (which need N % 64 == 0 and an even K).
torch::Tensor int8_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor scales, bool invariant, bool float_out) {
#ifdef EMBER_AVX512_BF16
  using namespace ember_check;
  constexpr const char* fn = "int8_gemm";
  check_int8_args(fn, x, w, scales);
  x = x.contiguous();
  const int64_t K = x.size(1), N = w.size(0);
  TORCH_CHECK(invariant || x.size(0) <= INT8_ROWS_MAX || (N % NB == 0 && K % 2 == 0), fn,
              ": the panels (invariant=False, more than ", INT8_ROWS_MAX, " rows) need N % 64 == 0 and an even K, "
              "got N = ", N, ", K = ", K);
  auto wc = w.contiguous();
  auto sc = scales.contiguous();
  const int8_t* wp = wc.data_ptr<int8_t>();
  const int64_t M = x.size(0);
  if (invariant) {
    auto y = torch::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
    if (M > 0 && float_out)
      int8_gemm_inv(x.data_ptr<c10::BFloat16>(), M, K, wp, sc.data_ptr<float>(), N, y.data_ptr<float>());
    else if (M > 0)
      int8_gemm_inv(x.data_ptr<c10::BFloat16>(), M, K, wp, sc.data_ptr<float>(), N, y.data_ptr<c10::BFloat16>());
    return y;
  }
  if (float_out) return int8_gemm(x, w, scales, false, false).to(at::kFloat);
  if (M == 0) return torch::empty({M, N}, x.options());
  if (M <= INT8_ROWS_MAX) {
    auto y = torch::empty({M, N}, x.options());
    const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
    c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
    switch (M) {
      case 1: int8_rows<1>(xp, K, wp, sc.data_ptr<float>(), N, yp); break;
      case 2: int8_rows<2>(xp, K, wp, sc.data_ptr<float>(), N, yp); break;
      case 3: int8_rows<3>(xp, K, wp, sc.data_ptr<float>(), N, yp); break;
      default: int8_rows<4>(xp, K, wp, sc.data_ptr<float>(), N, yp); break;
    }
    return y;
  }
  const float* sp = sc.data_ptr<float>();
  return panel_gemm(x, N, [&](int64_t nb, uint32_t* panel) { dequant_int8(wp, nb, K, panel); },
                    [&](int64_t nb) { return sp + nb * NB; });
#else
  TORCH_CHECK(false, "int8_gemm needs AVX512-BF16");
#endif
}

// x bf16 [M, K]; w int8 [N, K]; row_sums int32 [N] (sum_k w[n, k]); scales float32 [N]. Returns bf16 [M, N], or
// float32 with float_out (logits): x in exact integer parts against the weight on AMX (int8_exact_amx), the same
// bits at every row count. Needs AMX granted (has_amx) and K < 65536 (the limb sums stay in int32).
torch::Tensor int8_exact_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor row_sums, torch::Tensor scales,
                              bool float_out) {
#ifdef EMBER_AMX
  TORCH_CHECK(ember_amx::granted(), "int8_exact_gemm needs AMX (has_amx())");
  constexpr const char* fn = "int8_exact_gemm";
  check_int8_args(fn, x, w, scales);
  ember_check::cpu(fn, "row_sums", row_sums);
  ember_check::dtype(fn, "row_sums", row_sums, at::kInt);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(row_sums.numel() == N, fn, ": row_sums must hold one sum a weight row, ", N, ", got shape ",
              row_sums.sizes());
  TORCH_CHECK(K > 0 && K < 65536, fn, ": K must be 1 to 65535 (the limb sums stay in int32), got ", K);
  auto wc = w.contiguous();
  auto rs = row_sums.contiguous();
  auto sc = scales.contiguous();
  auto y = torch::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M > 0 && N > 0 && float_out)
    int8_exact_amx(x.data_ptr<c10::BFloat16>(), M, K, wc.data_ptr<int8_t>(), rs.data_ptr<int32_t>(),
                   sc.data_ptr<float>(), N, y.data_ptr<float>());
  else if (M > 0 && N > 0)
    int8_exact_amx(x.data_ptr<c10::BFloat16>(), M, K, wc.data_ptr<int8_t>(), rs.data_ptr<int32_t>(),
                   sc.data_ptr<float>(), N, y.data_ptr<c10::BFloat16>());
  return y;
#else
  TORCH_CHECK(false, "int8_exact_gemm needs AMX");
#endif
}
