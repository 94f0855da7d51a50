// Weight-only quantized GEMM for CPU: y[M, N] = x[M, K] (bf16) . W^T, W held as int4 (torch's CPU int4 pack) or
// int8 (one scale per output row). torch's packed ops cost about the same per row whatever M (3072x576 int4: 29 us
// at 1 row, 707 us at 64), so from a few rows on this kernel takes over: each thread unpacks a panel of 64
// output columns once into exact integers as bf16 pairs (the layout vdpbf16ps reads) in its cache, then runs every
// row block of x against it with 3x4 register-blocked AVX512-BF16 dot products whose group sums are scaled in
// float32. The weight stays packed in memory; the panel is the only unpacked copy, 128*K bytes a thread.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "avx512_util.h"

#ifdef EMBER_AVX512_BF16
namespace {

constexpr int64_t NB = 64;  // output columns a panel: four vectors of 16
constexpr int64_t INT8_ROWS_MAX = 4;  // int8 with at most this many rows: row-wise dot products, no panel

// panel[kp * 64 + c] = bf16 pair (W[n0 + c, 2kp], W[n0 + c, 2kp + 1]) as one 32-bit word
using Panel = std::vector<uint32_t>;

// Two float vectors (k and k+1 for 16 columns) -> 16 bf16 pairs, k in the low half of each 32-bit lane.
inline __m512i pair_bf16(__m512 wk, __m512 wk1) {
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(wk1, wk);  // [wk as 16 bf16 | wk1 as 16 bf16]
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                       23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, both);
}

// torch's CPU int4 pack: bytes [N/64, K, 32]; column c of a 64-column block is byte c % 32 of row k, low nibble
// for c < 32. The panel gets q itself (0..15, exact in bf16); scale_zeros bf16 [K/g, N, 2] (w = (q - 8) * scale +
// zero) become float scales s and offsets z = zero - 8 * scale per group and column, applied to the float sums of
// each group, so w is never rounded to bf16 (torch's packed op does not round it either).
void unpack_int4(const uint8_t* w, const c10::BFloat16* sz, int64_t nb, int64_t K, int64_t N, int64_t group,
                 uint32_t* panel, float* gs, float* gz) {
  const uint8_t* blk = w + nb * K * 32;
  const __m512i lo4 = _mm512_set1_epi32(0xF);
  for (int64_t g = 0; g < K / group; ++g)
    for (int64_t j = 0; j < 4; ++j) {
      // 16 (scale, zero) bf16 pairs as 32-bit lanes: scale in the low half
      const __m512i p = _mm512_loadu_si512(sz + (g * N + nb * NB + 16 * j) * 2);
      const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(p, 16));
      const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(p, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
      _mm512_storeu_ps(gs + g * NB + 16 * j, sc);
      _mm512_storeu_ps(gz + g * NB + 16 * j, _mm512_fnmadd_ps(_mm512_set1_ps(8.f), sc, zero));
    }
  for (int64_t k = 0; k < K; k += 2) {
    const __m512i r0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + k * 32)));
    const __m512i r1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + k * 32 + 16)));
    const __m512i s0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + (k + 1) * 32)));
    const __m512i s1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + (k + 1) * 32 + 16)));
    const __m512i qk[4] = {_mm512_and_si512(r0, lo4), _mm512_and_si512(r1, lo4), _mm512_srli_epi32(r0, 4),
                           _mm512_srli_epi32(r1, 4)};
    const __m512i qk1[4] = {_mm512_and_si512(s0, lo4), _mm512_and_si512(s1, lo4), _mm512_srli_epi32(s0, 4),
                            _mm512_srli_epi32(s1, 4)};
    uint32_t* out = panel + (k / 2) * NB;
    for (int64_t j = 0; j < 4; ++j)
      _mm512_storeu_si512(out + 16 * j, pair_bf16(_mm512_cvtepi32_ps(qk[j]), _mm512_cvtepi32_ps(qk1[j])));
  }
}

// y[m0 : m0+R, n0 : n0+64] = sum over groups of (x . q) * s, then + sum over groups of xsum * z: the integer dot
// products of a group accumulate apart and are scaled in float32. The offsets go in after the last group, once
// the group sums' registers are free: added inside the group loop they needed three more live registers, which
// spilled the accumulators in the inner loop (3072x576 at 2040 rows, the micro-kernel alone: 12.9 -> 8.7 ms).
template <int R>
inline void micro_grouped(const c10::BFloat16* x, int64_t K, int64_t group, const uint32_t* panel, const float* gs,
                       const float* gz, const float* xsum, int64_t groups, c10::BFloat16* y, int64_t ldy) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const int32_t* xw = reinterpret_cast<const int32_t*>(x);
  const int64_t kw = K / 2, gw = group / 2;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) part[r][j] = _mm512_setzero_ps();
    for (int64_t kp = g * gw; kp < (g + 1) * gw; ++kp) {
      const uint32_t* p = panel + kp * NB;
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(p), b1 = (__m512bh)_mm512_loadu_si512(p + 16);
      const __m512bh b2 = (__m512bh)_mm512_loadu_si512(p + 32), b3 = (__m512bh)_mm512_loadu_si512(p + 48);
      for (int r = 0; r < R; ++r) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(xw[r * kw + kp]);
        part[r][0] = _mm512_dpbf16_ps(part[r][0], a, b0);
        part[r][1] = _mm512_dpbf16_ps(part[r][1], a, b1);
        part[r][2] = _mm512_dpbf16_ps(part[r][2], a, b2);
        part[r][3] = _mm512_dpbf16_ps(part[r][3], a, b3);
      }
    }
    for (int j = 0; j < 4; ++j) {
      const __m512 sv = _mm512_loadu_ps(gs + g * NB + 16 * j);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(part[r][j], sv, acc[r][j]);
    }
  }
  for (int64_t g = 0; g < groups; ++g)
    for (int j = 0; j < 4; ++j) {
      const __m512 zv = _mm512_loadu_ps(gz + g * NB + 16 * j);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * groups + g]), zv, acc[r][j]);
    }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_si256((__m256i*)(y + r * ldy + 16 * j), (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
}

// The panel driver for both weight kinds: fill(nb, panel, gs, gz) lays out 64 columns as exact integers with their
// float scales s and offsets z per group (int8: one group of K, z = 0).
template <typename Fill>
torch::Tensor grouped_panel_gemm(const torch::Tensor& x, int64_t N, int64_t group, Fill fill) {
  constexpr int R = 3;  // 3 x 4 group sums + 3 x 4 totals stay in registers
  const int64_t M = x.size(0), K = x.size(1), groups = K / group;
  auto y = torch::empty({M, N}, x.options());
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  // each row's sum over each group, from the bf16 values (a division per element made this loop ~20% of the
  // kernel at 2048 rows)
  std::vector<float> xsum(M * groups);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        const c10::BFloat16* xg = xp + m * K + g * group;
        float sum = 0.f;
        for (int64_t k = 0; k < group; ++k) sum += static_cast<float>(xg[k]);
        xsum[m * groups + g] = sum;
      }
  });
  at::parallel_for(0, N / NB, 1, [&](int64_t begin, int64_t end) {
    Panel panel(K / 2 * NB);
    std::vector<float> gs(groups * NB), gz(groups * NB);
    for (int64_t nb = begin; nb < end; ++nb) {
      fill(nb, panel.data(), gs.data(), gz.data());
      int64_t m = 0;
      for (; m + R <= M; m += R)
        micro_grouped<R>(xp + m * K, K, group, panel.data(), gs.data(), gz.data(), xsum.data() + m * groups, groups,
                      yp + m * N + nb * NB, N);
      const int64_t rest = M - m;
      if (rest == 2)
        micro_grouped<2>(xp + m * K, K, group, panel.data(), gs.data(), gz.data(), xsum.data() + m * groups, groups,
                      yp + m * N + nb * NB, N);
      else if (rest == 1)
        micro_grouped<1>(xp + m * K, K, group, panel.data(), gs.data(), gz.data(), xsum.data() + m * groups, groups,
                      yp + m * N + nb * NB, N);
    }
  });
  return y;
}

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

// r[i] = 16 words of row i -> r[v] = word v of rows 0..15
inline void transpose16(__m512i r[16]) {
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

void dequant_int8(const int8_t* w, int64_t nb, int64_t K, uint32_t* panel) {
  for (int64_t j = 0; j < 4; ++j) {
    const int8_t* base = w + (nb * NB + 16 * j) * K;
    for (int64_t k0 = 0; k0 < K; k0 += 64) {
      const int64_t left = std::min<int64_t>(64, K - k0);
      const __mmask64 mask = left == 64 ? ~__mmask64(0) : (__mmask64(1) << left) - 1;
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(base + i * K + k0 + 128), _MM_HINT_T0);
        r[i] = _mm512_maskz_loadu_epi8(mask, base + i * K + k0);
      }
      transpose16(r);
      for (int64_t v = 0; v < 16 && 4 * v < left; ++v) {
        const int64_t kp = (k0 + 4 * v) / 2;
        _mm512_storeu_si512(panel + kp * NB + 16 * j, int8_pair_bf16(r[v]));
        if (4 * v + 2 < left)
          _mm512_storeu_si512(panel + (kp + 1) * NB + 16 * j, int8_pair_bf16(_mm512_srli_epi32(r[v], 16)));
      }
    }
  }
}

// A few rows against an int8 [N, K] weight, row by row (the weight's own layout: no panel, no gather): each weight
// row is read once, widened to float32 and dotted with every x row. For the 49152x576 LM head at one row this reads
// the 28 MB at memory speed where torch's packed op took 1.9-3.2 ms.
template <int M>
void int8_rows(const c10::BFloat16* x, int64_t K, const int8_t* w, const float* scales, int64_t N, c10::BFloat16* y) {
  using namespace ember_avx512;
  std::vector<float> xf(M * K);
  for (int m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xf[m * K + k] = static_cast<float>(x[m * K + k]);
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* wr = w + n * K;
      __m512 acc[M];
      for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) {
        const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wr + k))));
        for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xf.data() + m * K + k), acc[m]);
      }
      for (int m = 0; m < M; ++m) {
        float sum = _mm512_reduce_add_ps(acc[m]);
        for (int64_t kk = k; kk < K; ++kk) sum += static_cast<float>(wr[kk]) * xf[m * K + kk];
        y[m * N + n] = static_cast<c10::BFloat16>(sum * scales[n]);
      }
    }
  });
}

}  // namespace
#endif

bool has_avx512_bf16() {
#ifdef EMBER_AVX512_BF16
  return true;
#else
  return false;
#endif
}

// x bf16 [M, K]; w uint8 from _convert_weight_to_int4pack_for_cpu ([N, K/2], read as [N/64, K, 32]);
// scale_zeros bf16 [K/group, N, 2]. Returns bf16 [M, N].
torch::Tensor int4_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor scale_zeros, int64_t group) {
#ifdef EMBER_AVX512_BF16
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bf16 [M, K]");
  TORCH_CHECK(scale_zeros.scalar_type() == at::kBFloat16 && scale_zeros.dim() == 3, "scale_zeros bf16 [G, N, 2]");
  x = x.contiguous();
  const int64_t K = x.size(1), N = scale_zeros.size(1);
  TORCH_CHECK(N % NB == 0 && group % 2 == 0 && K % group == 0 && w.numel() == N * K / 2, "int4_gemm: bad shapes");
  auto wc = w.contiguous();
  auto szc = scale_zeros.contiguous();
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  const c10::BFloat16* sp = szc.data_ptr<c10::BFloat16>();
  return grouped_panel_gemm(x, N, group, [&](int64_t nb, uint32_t* panel, float* gs, float* gz) {
    unpack_int4(wp, sp, nb, K, N, group, panel, gs, gz);
  });
#else
  TORCH_CHECK(false, "int4_gemm needs AVX512-BF16");
#endif
}

// x bf16 [M, K]; w int8 [N, K]; scales float32 [N]. Returns bf16 [M, N].
torch::Tensor int8_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor scales) {
#ifdef EMBER_AVX512_BF16
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bf16 [M, K]");
  TORCH_CHECK(w.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat, "int8 weight, float32 scales");
  x = x.contiguous();
  const int64_t K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && scales.numel() == N, "int8_gemm: bad shapes");
  TORCH_CHECK(x.size(0) <= INT8_ROWS_MAX || (N % NB == 0 && K % 2 == 0), "int8_gemm: panels need N % 64, even K");
  auto wc = w.contiguous();
  auto sc = scales.contiguous();
  const int8_t* wp = wc.data_ptr<int8_t>();
  const int64_t M = x.size(0);
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
  return grouped_panel_gemm(x, N, K, [&](int64_t nb, uint32_t* panel, float* gs, float* gz) {
    dequant_int8(wp, nb, K, panel);
    std::memcpy(gs, sp + nb * NB, NB * sizeof(float));
    std::fill(gz, gz + NB, 0.f);
  });
#else
  TORCH_CHECK(false, "int8_gemm needs AVX512-BF16");
#endif
}
