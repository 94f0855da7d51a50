// int8 weights (one scale a row: int8 layers, the LM head) against int8 activations per row and block of 32 inputs
// (EngineConfig.int8_activations, as w4a8.cpp for int4): x quantized as there (Q8_0 blocks), then stored as q + 128
// (unsigned) for vpdpbusd against the signed weight; each block's sum is exact in int32 once 128 * (the weight's
// block sum) is taken off. In float32, per row and column, in this order: for each block b, acc += sum_b *
// scale_x[b]; then y = acc * scale_w. w8a8.cpp quantizes a row with one scale (oneDNN's GEMM); on the default model's
// LM head alone that moved the log-probabilities about 0.026 (mean |change|), blocks of 32 about 0.002.
// The weight is held as the products read it (pack_x8 in quantization/kernels.py: per 16 rows, each step of 4 inputs
// one 64-byte vector, lane c the 4 inputs of row n0 + c), with each block's -128 * (weight sum) beside it; laid out
// per thread at each call instead, one row ran at half the bf16 kernel's speed (the LM head 1.6 vs 0.76 ms). A row's
// result is the same bits at every row count (exact integer sums, then the same float steps).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "avx512_util.h"
#include "checks.h"
#include "quant_blocks.h"
#include "w4a8.h"

#if defined(EMBER_AVX512_BF16) && defined(EMBER_AVX512_VNNI) && defined(EMBER_AVX512_VBMI)
EMBER_FIXED_ORDER_BEGIN
namespace {

constexpr int64_t QB = W4A8_BLOCK;
constexpr int64_t NC = 16;       // weight rows (output columns) a panel: one vector
constexpr int PASS = 12;         // x rows a pass: 12 int32 sums and 12 float32 totals in registers
constexpr int64_t SPAN = 48;     // x rows a work item (one panel)

// y[0 : R, n0 : n0 + cols] from a panel of the pack (xu: R rows of q + 128; d: their block scales)
template <int R>
EMBER_INLINE void panel_rows(const uint8_t* xu, const float* d, int64_t K, const __m512i* panel,
                             const __m512i* negcorr, __m512 ws, int64_t cols, c10::BFloat16* y, int64_t N) {
  const int64_t blocks = K / QB;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i s[R];
    const __m512i start = _mm512_loadu_si512(negcorr + b);
    for (int r = 0; r < R; ++r) s[r] = start;
    for (int t = 0; t < QB / 4; ++t) {
      const __m512i wv = _mm512_loadu_si512(panel + b * 8 + t);
      for (int r = 0; r < R; ++r) {
        int32_t xq;
        std::memcpy(&xq, xu + r * K + b * QB + 4 * t, sizeof(xq));
        s[r] = _mm512_dpbusd_epi32(s[r], _mm512_set1_epi32(xq), wv);
      }
    }
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_set1_ps(d[r * blocks + b]), acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) c10::BFloat16 out[NC];
    _mm256_store_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r], ws)));
    std::memcpy(y + r * N, out, sizeof(c10::BFloat16) * cols);
  }
}

}  // namespace

bool w8a8_block_rows(const c10::BFloat16* x, int64_t M, int64_t K, const int8_t* wv, const int32_t* negcorr,
                     const float* scales, int64_t N, c10::BFloat16* y) {
  if (K % QB != 0) return false;
  const int64_t blocks = K / QB;
  std::unique_ptr<int8_t[]> q(new int8_t[M * K]);
  std::vector<float> d(M * blocks);
  quantize_x8_blocks(x, M, K, q.get(), d.data(), nullptr, true);  // q + 128
  const uint8_t* xu = reinterpret_cast<const uint8_t*>(q.get());
  const int64_t panels = (N + NC - 1) / NC, spans = (M + SPAN - 1) / SPAN;
  at::parallel_for(0, panels * spans, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item / spans, m0 = item % spans * SPAN, m1 = ember_fixed::min(M, m0 + SPAN);
      const int64_t n0 = p * NC, cols = ember_fixed::min<int64_t>(NC, N - n0);
      const __m512i* panel = reinterpret_cast<const __m512i*>(wv + p * NC * K);
      const __m512i* nc = reinterpret_cast<const __m512i*>(negcorr + p * NC * blocks);
      alignas(64) float wl[NC] = {};
      std::memcpy(wl, scales + n0, sizeof(float) * cols);
      const __m512 ws = _mm512_load_ps(wl);
      for (int64_t m = m0; m < m1; m += PASS) {
        const uint8_t* xm = xu + m * K;
        const float* dm = d.data() + m * blocks;
        c10::BFloat16* ym = y + m * N + n0;
        ember_quant::rows_pass<PASS>(m1 - m, [&](auto rows) {
          panel_rows<decltype(rows)::value>(xm, dm, K, panel, nc, ws, cols, ym, N);
        });
      }
    }
  });
  return true;
}
EMBER_FIXED_ORDER_END  // after the driver: the inlined passes take its options
#else
bool w8a8_block_rows(const c10::BFloat16*, int64_t, int64_t, const int8_t*, const int32_t*, const float*, int64_t,
                     c10::BFloat16*) {
  return false;
}
#endif

// x bf16 [M, K]; wv int8 [ceil(N/16), K/4, 16, 4] and negcorr int32 [ceil(N/16), K/32, 16] (pack_x8); scales float32
// [N]. Returns bf16 [M, N].
torch::Tensor int8_x8_gemm(torch::Tensor x, torch::Tensor wv, torch::Tensor negcorr, torch::Tensor scales) {
  using namespace ember_check;
  constexpr const char* fn = "int8_x8_gemm";
  cpu(fn, "x", x);
  cpu(fn, "wv", wv);
  cpu(fn, "negcorr", negcorr);
  cpu(fn, "scales", scales);
  dtype(fn, "x", x, at::kBFloat16);
  dtype(fn, "wv", wv, at::kChar);
  dtype(fn, "negcorr", negcorr, at::kInt);
  dtype(fn, "scales", scales, at::kFloat);
  dims(fn, "x", x, 2, "[M, K]");
  dims(fn, "wv", wv, 4, "[ceil(N/16), K/4, 16, 4]");
  dims(fn, "negcorr", negcorr, 3, "[ceil(N/16), K/32, 16]");
  dims(fn, "scales", scales, 1, "[N]");
  const int64_t M = x.size(0), K = x.size(1), N = scales.size(0), panels = (N + 15) / 16;
  TORCH_CHECK(K % W4A8_BLOCK == 0, fn, ": x's K must be a multiple of ", W4A8_BLOCK, ", got K = ", K);
  TORCH_CHECK(wv.size(0) == panels && wv.size(1) == K / 4 && wv.size(2) == 16 && wv.size(3) == 4, fn,
              ": wv must be [", panels, ", ", K / 4, ", 16, 4] (N = ", N, " from scales, K = ", K, " from x), got ",
              wv.sizes());
  TORCH_CHECK(negcorr.size(0) == panels && negcorr.size(1) == K / W4A8_BLOCK && negcorr.size(2) == 16, fn,
              ": negcorr must be [", panels, ", ", K / W4A8_BLOCK, ", 16], got ", negcorr.sizes());
  TORCH_CHECK(has_w4a8(), fn, ": needs the int8-activation kernels (AVX512-BF16 with VNNI and VBMI), not built here");
  x = x.contiguous();
  wv = wv.contiguous();
  negcorr = negcorr.contiguous();
  scales = scales.contiguous();
  auto y = torch::empty({M, N}, x.options());
  if (M > 0 && N > 0)
    TORCH_CHECK(w8a8_block_rows(x.data_ptr<c10::BFloat16>(), M, K, wv.data_ptr<int8_t>(),
                                negcorr.data_ptr<int32_t>(), scales.data_ptr<float>(), N, y.data_ptr<c10::BFloat16>()),
                fn, ": the kernel did not run (not built here)");
  return y;
}
