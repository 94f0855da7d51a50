// Dense GEMM in a fixed order, for the float weights of a batch-invariant engine on AVX-512 CPUs:
// y[M, N] = x[M, K] . w[N, K]^T, float32 (x, w, y) or bf16 (x, w, y; float32 sums). oneDNN's linear and F.linear
// round a row differently with the rows beside it on AVX-512 CPUs (docs/batch_invariance.md); here a row's result
// is the same bits at every row count.
// Every output is one chain over K, chunk after chunk, then one add tree: float32: lane l of an accumulator sums
// x[16c + l] * w[16c + l] by FMA over chunks of 16 inputs; bf16: lane l sums the vdpbf16ps products of inputs
// 32c + 2l, 32c + 2l + 1 over chunks of 32 (the int8 kernel's chain, int8_gemm_inv, with w as it lies); then
// reduce16's transposing tree over the 16 lanes (the same tree for every slot), and bf16 outputs are rounded once,
// at the end. A partial last chunk is read with masked loads, zeros past K. The blocking below decides only which
// outputs share registers and which thread computes them, never the order within an output; the work is split over
// N only, K never.
// Up to 4 rows every block of weight rows is read once, as it lies, and dotted with every row (16 / M weight rows a
// block, the rows a few blocks ahead prefetched); from 5 rows, 4 x 4 tiles: each thread takes a range of 4-row weight
// blocks and runs every 4-row tile of a panel of x (about 256 KiB, kept in L2) against each block (in L1).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "avx512_util.h"
#include "checks.h"

#ifdef EMBER_AVX512_BF16
EMBER_FIXED_ORDER_BEGIN
namespace {

// float32: chunks of 16 inputs, one FMA a chunk and output
struct F32 {
  using T = float;
  using O = float;  // the output's element
  using V = __m512;
  static constexpr int64_t KC = 16;
  static EMBER_INLINE V load(const T* p) { return _mm512_loadu_ps(p); }
  static EMBER_INLINE V load_tail(const T* p, int64_t n) {  // the first n < 16 inputs, zeros after
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
  }
  static EMBER_INLINE __m512 step(__m512 acc, V x, V w) { return _mm512_fmadd_ps(x, w, acc); }
  static EMBER_INLINE void store16(const __m512 sums, O* out) { _mm512_storeu_ps(out, sums); }
};

// bf16: chunks of 32 inputs, one vdpbf16ps (two products a lane, each exact in float32) a chunk and output
struct BF16 {
  using T = c10::BFloat16;
  using O = c10::BFloat16;
  using V = __m512i;
  static constexpr int64_t KC = 32;
  static EMBER_INLINE V load(const T* p) { return _mm512_loadu_si512(p); }
  static EMBER_INLINE V load_tail(const T* p, int64_t n) {  // the first n < 32 inputs, zeros after
    return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1u << n) - 1), p);
  }
  static EMBER_INLINE __m512 step(__m512 acc, V x, V w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
  static EMBER_INLINE void store16(const __m512 sums, O* out) {  // rounded to nearest even, once
    _mm256_storeu_si256((__m256i*)out, (__m256i)_mm512_cvtneps_pbh(sums));
  }
};

// bf16 inputs, float32 outputs (logits): BF16's chains, the sums not rounded
struct BF16F : BF16 {
  using O = float;
  static EMBER_INLINE void store16(const __m512 sums, O* out) { _mm512_storeu_ps(out, sums); }
};

constexpr int64_t PF = 2;  // rows kernel: prefetch the weight rows this many blocks ahead
constexpr int TILE = 4;  // from 5 rows: x rows and weight rows of a tile (16 sums)
constexpr int64_t PANEL_BYTES = 256 * 1024;  // from 5 rows: x rows a thread runs against each of its weight blocks

// y[m, n0 + j] for m < MR, j < nr (<= B): slot m * B + j of acc, each one chain over K, then the add tree.
// xr[m]: row m of x; wr[j]: weight row n0 + j (a row past N points at a valid row; its output is dropped).
// pf: elements ahead of each weight chunk to prefetch (0: none).
template <class E, int MR, int B>
EMBER_INLINE void block(const typename E::T* const* xr, const typename E::T* const* wr, int64_t K, int64_t pf,
                        int64_t nr, typename E::O* y, int64_t ldy) {
  static_assert(MR * B <= 16, "16 sums at most");
  using V = typename E::V;
  const int64_t full = K / E::KC, rem = K % E::KC;
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < full; ++c) {
    V xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = E::load(xr[m] + c * E::KC);
    for (int j = 0; j < B; ++j) {
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(wr[j] + c * E::KC + pf), _MM_HINT_T0);
      const V wv = E::load(wr[j] + c * E::KC);
      for (int m = 0; m < MR; ++m) acc[m * B + j] = E::step(acc[m * B + j], xv[m], wv);
    }
  }
  if (rem) {
    V xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = E::load_tail(xr[m] + full * E::KC, rem);
    for (int j = 0; j < B; ++j) {
      const V wv = E::load_tail(wr[j] + full * E::KC, rem);
      for (int m = 0; m < MR; ++m) acc[m * B + j] = E::step(acc[m * B + j], xv[m], wv);
    }
  }
  alignas(64) typename E::O out[16];
  E::store16(ember_avx512::reduce16(acc), out);
  for (int m = 0; m < MR; ++m) std::memcpy(y + m * ldy, out + m * B, nr * sizeof(typename E::O));
}

// y[:, n0:n1] for M <= 4 rows: the weight read once, front to back, B = 16 / M weight rows a block (a row past N
// points at the last row; its output is dropped), the rows a few blocks ahead prefetched
template <class E, int M>
EMBER_INLINE void rows_range(const typename E::T* x, int64_t K, const typename E::T* w, int64_t N, int64_t n0,
                             int64_t n1, typename E::O* y) {
  constexpr int B = 16 / M;
  const typename E::T* xr[M];
  for (int m = 0; m < M; ++m) xr[m] = x + m * K;
  for (int64_t r = n0; r < n1; r += B) {
    const typename E::T* wr[B];
    for (int j = 0; j < B; ++j) wr[j] = w + ember_fixed::min<int64_t>(r + j, N - 1) * K;
    const int64_t pf = r + (PF + 1) * B <= N ? PF * B * K : 0;  // only rows that exist
    block<E, M, B>(xr, wr, K, pf, ember_fixed::min<int64_t>(B, n1 - r), y + r, N);
  }
}

// y[:, n0:n1] from 5 rows: 4 x 4 tiles, a panel of x rows (about 256 KiB) against each block of 4 weight rows
template <class E>
void tiles_range(const typename E::T* x, int64_t M, int64_t K, const typename E::T* w, int64_t N, int64_t n0,
                 int64_t n1, typename E::O* y) {
  const int64_t panel = ember_fixed::max<int64_t>(TILE, PANEL_BYTES / (K * sizeof(typename E::T)) / TILE * TILE);
  for (int64_t p0 = 0; p0 < M; p0 += panel) {
    const int64_t p1 = ember_fixed::min<int64_t>(M, p0 + panel);
    for (int64_t r = n0; r < n1; r += TILE) {
      const typename E::T* wr[TILE];
      for (int j = 0; j < TILE; ++j) wr[j] = w + ember_fixed::min<int64_t>(r + j, N - 1) * K;
      const int64_t nr = ember_fixed::min<int64_t>(TILE, n1 - r);
      for (int64_t m0 = p0; m0 < p1; m0 += TILE) {
        const typename E::T* xr[TILE];
        for (int m = 0; m < TILE; ++m) xr[m] = x + ember_fixed::min<int64_t>(m0 + m, M - 1) * K;
        typename E::O* yt = y + m0 * N + r;
        switch (ember_fixed::min<int64_t>(TILE, p1 - m0)) {
          case 1: block<E, 1, TILE>(xr, wr, K, 0, nr, yt, N); break;
          case 2: block<E, 2, TILE>(xr, wr, K, 0, nr, yt, N); break;
          case 3: block<E, 3, TILE>(xr, wr, K, 0, nr, yt, N); break;
          default: block<E, TILE, TILE>(xr, wr, K, 0, nr, yt, N); break;
        }
      }
    }
  }
}

// M <= 4 rows: each thread a range of B-row weight blocks
template <class E, int M>
void gemm_rows(const typename E::T* x, int64_t K, const typename E::T* w, int64_t N, typename E::O* y) {
  constexpr int B = 16 / M;
  at::parallel_for(0, (N + B - 1) / B, 4, [&](int64_t begin, int64_t end) {
    rows_range<E, M>(x, K, w, N, begin * B, ember_fixed::min<int64_t>(N, end * B), y);
  });
}

// from 5 rows: each thread a range of 4-row weight blocks, every panel of x against them
template <class E>
void gemm_tiles(const typename E::T* x, int64_t M, int64_t K, const typename E::T* w, int64_t N, typename E::O* y) {
  at::parallel_for(0, (N + TILE - 1) / TILE, 4, [&](int64_t begin, int64_t end) {
    tiles_range<E>(x, M, K, w, N, begin * TILE, ember_fixed::min<int64_t>(N, end * TILE), y);
  });
}

template <class E>
void gemm(const typename E::T* x, int64_t M, int64_t K, const typename E::T* w, int64_t N, typename E::O* y) {
  switch (M) {
    case 1: gemm_rows<E, 1>(x, K, w, N, y); break;
    case 2: gemm_rows<E, 2>(x, K, w, N, y); break;
    case 3: gemm_rows<E, 3>(x, K, w, N, y); break;
    case 4: gemm_rows<E, 4>(x, K, w, N, y); break;
    default: gemm_tiles<E>(x, M, K, w, N, y); break;
  }
}

// A Mixture-of-Experts projection: expert e's rows of x are rows off[e] .. off[e + 1], its weight w + e * N * K.
// The work is cut into (expert, range of CH weight rows) tasks over every expert hit, so one parallel region covers
// all of them (a decode token's 8 experts are 8 x N / CH tasks, not 8 calls); within a task the blocking is
// gemm_rows' (up to 4 rows) or gemm_tiles' (from 5), and every output the same chain as dense_gemm's.
constexpr int64_t CH = 64;  // weight rows a task

template <class E>
void grouped_gemm(const typename E::T* x, const int64_t* off, int64_t experts, int64_t K, const typename E::T* w,
                  int64_t N, typename E::O* y) {
  std::vector<int64_t> task_expert, task_row;  // (expert, first weight row) of each task
  for (int64_t e = 0; e < experts; ++e) {
    if (off[e + 1] == off[e]) continue;
    for (int64_t r = 0; r < N; r += CH) {
      task_expert.push_back(e);
      task_row.push_back(r);
    }
  }
  at::parallel_for(0, static_cast<int64_t>(task_expert.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t e = task_expert[t], n0 = task_row[t], n1 = ember_fixed::min<int64_t>(N, n0 + CH);
      const int64_t m = off[e + 1] - off[e];
      const typename E::T* xe = x + off[e] * K;
      const typename E::T* we = w + e * N * K;
      typename E::O* ye = y + off[e] * N;
      switch (m) {
        case 1: rows_range<E, 1>(xe, K, we, N, n0, n1, ye); break;
        case 2: rows_range<E, 2>(xe, K, we, N, n0, n1, ye); break;
        case 3: rows_range<E, 3>(xe, K, we, N, n0, n1, ye); break;
        case 4: rows_range<E, 4>(xe, K, we, N, n0, n1, ye); break;
        default: tiles_range<E>(xe, m, K, we, N, n0, n1, ye); break;
      }
    }
  });
}

}  // namespace
EMBER_FIXED_ORDER_END

// x and w both float32 or both bf16 (the two instantiations of the kernels)
static void check_float_pair(const char* fn, const torch::Tensor& x, const torch::Tensor& w) {
  const auto t = x.scalar_type();
  TORCH_CHECK(t == w.scalar_type() && (t == at::kFloat || t == at::kBFloat16), fn,
              ": x and w must be both float32 or both bf16, got x ", t, " and w ", w.scalar_type());
}

// x [M, K] and w [N, K], both float32 or both bf16. Returns y [M, N] in their dtype (float32 with float_out:
// logits, bf16 sums not rounded), every output one fixed-order chain over K whatever M is (batch invariant).
torch::Tensor dense_gemm(torch::Tensor x, torch::Tensor w, bool float_out) {
  using namespace ember_check;
  constexpr const char* fn = "dense_gemm";
  cpu(fn, "x", x);
  cpu(fn, "w", w);
  check_float_pair(fn, x, w);
  dims(fn, "x", x, 2, "[M, K]");
  dims(fn, "w", w, 2, "[N, K]");
  size(fn, "w", w, 1, x.size(1), "x's K");
  x = x.contiguous();
  auto wc = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = wc.size(0);
  auto y = torch::empty({M, N}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  if (x.scalar_type() == at::kFloat)
    gemm<F32>(x.data_ptr<float>(), M, K, wc.data_ptr<float>(), N, y.data_ptr<float>());
  else if (float_out)
    gemm<BF16F>(x.data_ptr<c10::BFloat16>(), M, K, wc.data_ptr<c10::BFloat16>(), N, y.data_ptr<float>());
  else
    gemm<BF16>(x.data_ptr<c10::BFloat16>(), M, K, wc.data_ptr<c10::BFloat16>(), N, y.data_ptr<c10::BFloat16>());
  return y;
}

// x [P, K]: the rows routed to each expert, expert e's at rows offsets[e] .. offsets[e + 1] (offsets int64 [E + 1],
// from 0 to P, never decreasing); w [E, N, K]. Returns y [P, N], row p = x[p] . w[e]^T for its expert e, the same
// bits dense_gemm(x[p:p+1], w[e]) gives: a Mixture-of-Experts projection in one call for every expert hit.
torch::Tensor grouped_dense_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor offsets) {
  using namespace ember_check;
  constexpr const char* fn = "grouped_dense_gemm";
  cpu(fn, "x", x);
  cpu(fn, "w", w);
  cpu(fn, "offsets", offsets);
  check_float_pair(fn, x, w);
  dims(fn, "x", x, 2, "[P, K]");
  dims(fn, "w", w, 3, "[E, N, K]");
  size(fn, "w", w, 2, x.size(1), "x's K");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.size(0) == w.size(0) + 1, fn,
              ": offsets must be int64 [E + 1] = [", w.size(0) + 1, "], got ", offsets.scalar_type(), " of shape ",
              offsets.sizes());
  x = x.contiguous();
  auto wc = w.contiguous();
  auto off = offsets.contiguous();
  const int64_t P = x.size(0), K = x.size(1), E = wc.size(0), N = wc.size(1);
  const int64_t* o = off.data_ptr<int64_t>();
  TORCH_CHECK(o[0] == 0 && o[E] == P, fn, ": offsets must run from 0 to the ", P, " rows of x, got ", o[0], " to ",
              o[E]);
  for (int64_t e = 0; e < E; ++e)
    TORCH_CHECK(o[e + 1] >= o[e], fn, ": offsets must not decrease, got offsets[", e, "] = ", o[e], " > offsets[",
                e + 1, "] = ", o[e + 1]);
  auto y = torch::empty({P, N}, x.options());
  if (P == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  if (x.scalar_type() == at::kFloat)
    grouped_gemm<F32>(x.data_ptr<float>(), o, E, K, wc.data_ptr<float>(), N, y.data_ptr<float>());
  else
    grouped_gemm<BF16>(x.data_ptr<c10::BFloat16>(), o, E, K, wc.data_ptr<c10::BFloat16>(), N,
                       y.data_ptr<c10::BFloat16>());
  return y;
}
#endif
