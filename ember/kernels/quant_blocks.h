// What the weight-only quantized GEMMs share (quant_gemm.cpp: int4 / int5 / int8; int6_gemm.cpp): the 64-column bf16
// panel and its micro-kernel, the sizes of the row passes over a block, the prefetch distance, and each row's group
// sums of x. Inline, in a fixed floating-point order as the kernels that use them.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "avx512_util.h"

#ifdef EMBER_AVX512_BF16
EMBER_FIXED_ORDER_BEGIN
namespace ember_quant {

constexpr int64_t NB = 64;  // output columns a panel: four vectors of 16

// panel[kp * 64 + c] = bf16 pair (W[n0 + c, 2kp], W[n0 + c, 2kp + 1]) as one 32-bit word
using Panel = std::vector<uint32_t>;

constexpr int MR = 6;  // rows a micro-kernel pass: 6 x 4 sums + the 4 panel vectors stay in registers

// y[0 : R, 0 : 64] = (x . panel) * cs (cs: a float per column, nullptr for none). The panel's four vectors of a
// pair step are loaded once for the R rows, each row's pair goes in as a broadcast.
template <int R>
inline void micro(const int32_t* xw, int64_t kw, const uint32_t* panel, const float* cs, c10::BFloat16* y,
                  int64_t ldy) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kw; ++kp) {
    __m512bh b[4];
    for (int j = 0; j < 4; ++j) b[j] = (__m512bh)_mm512_loadu_si512(panel + kp * NB + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(xw[r * kw + kp]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
    }
  }
  if (cs != nullptr)
    for (int j = 0; j < 4; ++j) {
      const __m512 sv = _mm512_loadu_ps(cs + 16 * j);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_mul_ps(acc[r][j], sv);
    }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_si256((__m256i*)(y + r * ldy + 16 * j), (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
}

// The panel driver: fill(nb, panel) lays 64 output columns out as bf16 pairs, scales(nb) gives their column scales
// (or nullptr), then every row block of x runs against the panel while it is in cache. Work items are (block, row
// span): a layer with few blocks (576 outputs are 9) splits its rows so that every thread gets a share.
template <typename Fill, typename Scales>
torch::Tensor panel_gemm(const torch::Tensor& x, int64_t N, Fill fill, Scales scales) {
  const int64_t M = x.size(0), K = x.size(1), kw = K / 2, blocks = N / NB;
  auto y = torch::empty({M, N}, x.options());
  const int32_t* xw = reinterpret_cast<const int32_t*>(x.data_ptr<c10::BFloat16>());
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t nt = at::get_num_threads();
  const int64_t spans =
      blocks % nt == 0 || blocks >= 8 * nt
          ? 1 : ember_fixed::max<int64_t>(1, ember_fixed::min<int64_t>(nt, M / (8 * MR)));
  const int64_t span = (M + spans - 1) / spans;
  at::parallel_for(0, blocks * spans, 1, [&](int64_t begin, int64_t end) {
    Panel panel(kw * NB);
    int64_t filled = -1;  // the block the panel holds (a thread may get several spans of one block)
    for (int64_t item = begin; item < end; ++item) {
      const int64_t nb = item / spans, m0 = item % spans * span, m1 = ember_fixed::min(M, m0 + span);
      if (nb != filled) {
        fill(nb, panel.data());
        filled = nb;
      }
      const float* cs = scales(nb);
      for (int64_t m = m0; m < m1; m += MR) {
        const int32_t* xr = xw + m * kw;
        c10::BFloat16* yr = yp + m * N + nb * NB;
        switch (ember_fixed::min<int64_t>(MR, m1 - m)) {
          case 1: micro<1>(xr, kw, panel.data(), cs, yr, N); break;
          case 2: micro<2>(xr, kw, panel.data(), cs, yr, N); break;
          case 3: micro<3>(xr, kw, panel.data(), cs, yr, N); break;
          case 4: micro<4>(xr, kw, panel.data(), cs, yr, N); break;
          case 5: micro<5>(xr, kw, panel.data(), cs, yr, N); break;
          default: micro<MR>(xr, kw, panel.data(), cs, yr, N); break;
        }
      }
    }
  });
  return y;
}

// bytes ahead of the pack's read that each step prefetches (past a block's end: the next block, which the thread
// usually reads next). The hardware prefetchers alone left one row short of memory speed: 2 threads, Xeon (AMX),
// 2026-11-27, one row through 28 cold 17920 x 1536 weights (Qwen2.5-Coder-1.5B's gate/up), interleaved runs:
// 1.30-1.32 ms a weight without, 1.05-1.10 at 1-2 KB ahead, 1.19 at 3 KB.
constexpr int64_t INT4_PREFETCH = 2048;

// From INT4_PANEL_MIN_ROWS rows on (prefill chunks) the block is laid out once as a panel of bf16 weights,
// w = (q - 8) s + zero rounded to bf16 as torch's dense path rounds it, and runs through the panel micro-kernel (6
// rows a pass instead of 3, no group sums to scale): 2 threads, 2026-11-25, the default model's four shapes at
// 2048 rows 18.4 -> 14.6 ms (oneDNN bf16 on the dequantized weights 15.1), 128 rows 1.19 -> 1.00 ms; at 32 rows
// both 0.33 ms. The rounding moves the relative error to the float32 product from 1.7e-3 to 2.2e-3.
constexpr int64_t INT4_PANEL_MIN_ROWS = 128;

constexpr int64_t ROW_SPAN = 48;  // a multiple of 3 and of INV_PASS

// batch invariant: one chain a group (U = 1) at every row count, in passes of up to INV_PASS rows (24 sums in
// registers), so that a weight block streamed from memory serves up to 6 rows at once. Against 3-row passes of two
// chains (2 threads, AMD Zen 5, 2026-11-28, the default model's 120 int4 weights, interleaved in one process): 1
// row 0.97-1.00x the time, 4 rows 0.82-0.84x, 5 0.82x, 6 0.76x, 9 0.86x, 12-48 0.90x.
constexpr int INV_PASS = 6;

// fn(std::integral_constant<int, R>{}) with R = min(n, MAX) for n >= 1: a pass over R rows, R fixed at compile time
// so that the pass's sums stay in registers (the int8-activation kernels' row passes)
template <int MAX, typename Fn>
EMBER_INLINE void rows_pass(int64_t n, Fn fn) {
  if constexpr (MAX > 1) {
    if (n < MAX) return rows_pass<MAX - 1>(n, fn);
  }
  fn(std::integral_constant<int, MAX>{});
}

// each row's sum over each group of x [M, K], summed in a fixed order: the offsets' factor (int4's paths, int6's).
// Groups of a multiple of 16: 16 lanes along the group, then _mm512_reduce_add_ps' tree; as one scalar chain they
// took 7% of a 512-token prefill of the default model (a float add's latency an input).
inline std::vector<float> group_sums(const c10::BFloat16* x, int64_t M, int64_t K, int64_t group) {
  const int64_t groups = K / group;
  std::vector<float> xsum(M * groups);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        const c10::BFloat16* xg = x + m * K + g * group;
        float sum = 0.f;
        if (group % 16 == 0) {
          __m512 v = ember_avx512::load_bf16_ps(xg);
          for (int64_t k = 16; k < group; k += 16) v = _mm512_add_ps(v, ember_avx512::load_bf16_ps(xg + k));
          sum = _mm512_reduce_add_ps(v);
        } else {
          for (int64_t k = 0; k < group; ++k) sum += ember_fixed::bf16_bits_to_float(xg[k].x);
        }
        xsum[m * groups + g] = sum;
      }
  });
  return xsum;
}

// A pair step's unpacked vectors (bf16 128 + q, as int4_unpack and int6_unpack make them) into the panel: w =
// (128 + q) * scale + offset per column in float32, rounded once to bf16, (w[k][c], w[k + 1][c]) in word c.
struct PanelStore {
  __m512i inter, top;
  PanelStore() {
    alignas(64) uint16_t order[32];  // (w[k][c], w[k + 1][c]) of cvtne2ps' two halves into lane c
    for (int i = 0; i < 16; ++i) {
      order[2 * i] = i;
      order[2 * i + 1] = 16 + i;
    }
    inter = _mm512_load_si512(order);
    top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  }
  void operator()(const __m512i b[4], const __m512 scale[4], const __m512 off[4], uint32_t* dst) const {
    for (int j = 0; j < 4; ++j) {
      const __m512 wk = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(b[j], 16)), scale[j], off[j]);
      const __m512 wk1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(b[j], top)), scale[j], off[j]);
      _mm512_storeu_si512(dst + 16 * j, _mm512_permutexvar_epi16(inter, (__m512i)_mm512_cvtne2ps_pbh(wk1, wk)));
    }
  }
};

// The row passes' work items: a 64-column block and a span of up to ROW_SPAN rows, so that a few blocks still feed
// every thread at prefill sizes (576 outputs are 9 blocks); fn(consts, block, m0, m1) with one Consts a thread.
template <typename Consts, typename Fn>
void block_spans(int64_t N, int64_t M, Fn fn) {
  const int64_t blocks = N / NB, spans = (M + ROW_SPAN - 1) / ROW_SPAN;
  at::parallel_for(0, blocks * spans, 1, [&](int64_t begin, int64_t end) {
    const Consts c;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t m0 = item % spans * ROW_SPAN;
      fn(c, item / spans, m0, ember_fixed::min(M, m0 + ROW_SPAN));
    }
  });
}

}  // namespace ember_quant
EMBER_FIXED_ORDER_END
#endif
