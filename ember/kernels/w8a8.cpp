// w8a8 linear for CPU: y = x . W^T with x quantized per row to int8 on the fly and W int8 per output channel.
// The int8 products run in oneDNN's VNNI GEMM (torch's _int_mm), which does twice the bf16 matmul's work a cycle
// here; the two passes around it are fused in this file because in eager torch they cost as much as the GEMM (a
// fresh float32 temporary a step, each first-touched). 2 threads, 2026-11-25, bf16 x, medians of interleaved runs:
// 2048 x 896 -> 9728 in 63-75 ms against 108 for the bf16 matmul and 162 for the eager w8a8 ops; 256 rows 7-9 against
// 12.7 ms. The arithmetic is that of ember.quantization.kernels._w8a8 (scale = max|x| / 127, q = round-half-even(x /
// scale), y = acc * x_scale * w_scale in float32): the two agree to the bit. Up to 4 rows (decode at small batches)
// the products are VNNI dot products along the weight's rows instead of a GEMM call (rows_vnni).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "avx512_util.h"
#include "checks.h"

namespace {

// int32 products a GEMM call may leave (32 MB): oneDNN's rate grows with the rows of a call (896 x 9728: 64 rows
// 628 GOP/s, 256 rows 746, 2048 rows 887), so chunks are as tall as this allows
constexpr int64_t CHUNK_BYTES = int64_t(32) << 20;

// The products' buffer, kept between calls: a fresh one each call cost more in page faults than its rescale.
// One per thread: the engine calls from its one worker thread. Made outside inference mode whatever the caller's
// mode (calibration scores a w8a8 model under it), so that a later call outside inference mode may write it.
torch::Tensor& scratch(int64_t numel) {
  thread_local torch::Tensor buf;
  if (!buf.defined() || buf.numel() < numel) {
    c10::InferenceMode normal(false);
    buf = torch::empty({numel}, torch::dtype(at::kInt));
  }
  return buf;
}

#ifdef EMBER_AVX512_BF16
inline __m512 load16(const c10::BFloat16* p) { return ember_avx512::load_bf16_ps(p); }
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline void store16(c10::BFloat16* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v)); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
#endif

// q = round-half-even(x / s), s = max(max|x| / 127, 1e-10), per row
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* q, float* scales) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* xr = x + m * K;
      int8_t* qr = q + m * K;
      int64_t k = 0;
      float amax = 0.f;
#ifdef EMBER_AVX512_BF16
      __m512 vmax = _mm512_setzero_ps();
      for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(xr + k)));
      amax = _mm512_reduce_max_ps(vmax);
#endif
      for (int64_t kk = k; kk < K; ++kk) amax = std::max(amax, std::fabs(static_cast<float>(xr[kk])));
      const float s = std::max(amax / 127.f, 1e-10f);
      scales[m] = s;
      k = 0;
#ifdef EMBER_AVX512_BF16
      const __m512 sv = _mm512_set1_ps(s);
      const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
      for (; k + 16 <= K; k += 16) {  // cvtps_epi32 rounds half to even (the default MXCSR mode)
        const __m512i v = _mm512_cvtps_epi32(_mm512_div_ps(load16(xr + k), sv));
        _mm_storeu_si128((__m128i*)(qr + k), _mm512_cvtepi32_epi8(_mm512_min_epi32(_mm512_max_epi32(v, lo), hi)));
      }
#endif
      for (; k < K; ++k)
        qr[k] = static_cast<int8_t>(std::clamp(std::nearbyint(static_cast<float>(xr[k]) / s), -127.f, 127.f));
    }
  });
}

// y = (acc * x_scale) * w_scale in float32, then x's dtype. Compiled without reassociation (the library is built
// with -fassociative-math), so the product is that of torch, not acc * (x_scale * w_scale).
#pragma GCC push_options
#pragma GCC optimize("no-associative-math")
template <typename T>
void rescale_rows(const int32_t* acc, const float* xs, const float* ws, int64_t M, int64_t N, T* y) {
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float s = xs[m];
      const int32_t* ar = acc + m * N;
      T* yr = y + m * N;
      int64_t n = 0;
#ifdef EMBER_AVX512_BF16
      const __m512 sv = _mm512_set1_ps(s);
      for (; n + 16 <= N; n += 16) {
        const __m512 a = _mm512_cvtepi32_ps(_mm512_loadu_si512(ar + n));
        store16(yr + n, _mm512_mul_ps(_mm512_mul_ps(a, sv), _mm512_loadu_ps(ws + n)));
      }
#endif
      for (; n < N; ++n) yr[n] = static_cast<T>(static_cast<float>(ar[n]) * s * ws[n]);
    }
  });
}
#pragma GCC pop_options

#if defined(EMBER_AVX512_BF16) && defined(EMBER_AVX512_VNNI)
#define EMBER_W8A8_ROWS 1
constexpr int64_t ROWS_MAX = 4;  // at most this many rows: VNNI dot products along the weight's rows, no GEMM call

// the 16 lanes of v as T (bf16: rounded to nearest even, as c10's conversion)
inline void store_lanes(c10::BFloat16* p, __m512 v) { _mm256_store_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v)); }
inline void store_lanes(float* p, __m512 v) { _mm512_store_ps(p, v); }

// acc[m * B + j] += (w row j + 128) . (x row m) over the 64 bytes at k (TAIL: those of mask), for B weight rows at
// wb, while the rows PF blocks ahead are prefetched; counts fixed at compile time keep the sums in registers
template <int M, int B, bool TAIL>
inline void dot_chunk(const int8_t* q, const int8_t* wb, int64_t K, int64_t k, __mmask64 mask, __m512i acc[16]) {
  constexpr int PF = M == 1 ? 1 : 2;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i xv[M];
  for (int m = 0; m < M; ++m)
    xv[m] = TAIL ? _mm512_maskz_loadu_epi8(mask, q + m * K + k) : _mm512_loadu_si512(q + m * K + k);
  for (int j = 0; j < B; ++j) {
    _mm_prefetch(reinterpret_cast<const char*>(wb + (PF * B + j) * K + k), _MM_HINT_T0);
    const int8_t* p = wb + j * K + k;
    const __m512i wv = _mm512_xor_si512(TAIL ? _mm512_maskz_loadu_epi8(mask, p) : _mm512_loadu_si512(p), flip);
    for (int m = 0; m < M; ++m) acc[m * B + j] = _mm512_dpbusd_epi32(acc[m * B + j], wv, xv[m]);
  }
}

template <int M, int B>
inline void dot_block(const int8_t* q, const int8_t* wb, int64_t K, __m512i acc[16]) {
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_si512();
  const int64_t full = K / 64 * 64;
  for (int64_t k = 0; k < full; k += 64) dot_chunk<M, B, false>(q, wb, K, k, 0, acc);
  if (full < K) dot_chunk<M, B, true>(q, wb, K, full, (__mmask64(1) << (K - full)) - 1, acc);
}

// A few rows against int8 W [N, K], as W lies: each pass dots B adjacent weight rows (8 at one row of x, else 4)
// with the M rows of x, sum m * B + j in accumulator m * B + j, and one transposing add tree turns the (up to) 16
// into one vector of sums. vpdpbusd multiplies unsigned by signed bytes, so the weight goes in as w ^ 0x80 = w + 128
// (unsigned) against the signed x, and 128 * sum(x) leaves after; the integer sums are exact, so the result is the
// GEMM's to the bit. The scaling and the conversion to T run on the sums at once, in the GEMM's order
// ((dot * x_scale) * w_scale, compiled without reassociation). The rows a block or two ahead are prefetched: without
// it, and with one weight row a pass and two horizontal sums an output, the kernel read the weight at 17-23 GB/s.
// 2 threads, AMD Zen 5, 2026-11-25, interleaved medians, Qwen2.5-Coder-0.5B's 9728 x 896, 896 x 4864 and 151936 x
// 896: 1 row 56-58 GB/s (before: 17-23), 4 rows 49-58 (before: 10-12); ember's weight-only int8 kernel 64-74 and
// 41-46 in the same runs.
#pragma GCC push_options
#pragma GCC optimize("no-associative-math")
template <int M, typename T>
void rows_vnni(const int8_t* q, int64_t K, const int8_t* w, const float* xs, const float* ws, int64_t N, T* y) {
  constexpr int B = M == 1 ? 8 : 4;
  alignas(64) int32_t corr_l[16] = {};
  alignas(64) float xs_l[16] = {};
  for (int m = 0; m < M; ++m) {
    int32_t sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += q[m * K + k];
    for (int j = 0; j < B; ++j) {
      corr_l[m * B + j] = 128 * sum;
      xs_l[m * B + j] = xs[m];
    }
  }
  const __m512i corr = _mm512_load_si512(corr_l);
  const __m512 xsv = _mm512_load_ps(xs_l);
  std::vector<int8_t> pad;  // the last, partial block's rows, zero-padded to B
  if (N % B) {
    pad.assign(B * K, 0);
    std::memcpy(pad.data(), w + (N - N % B) * K, (N % B) * K);
  }
  at::parallel_for(0, (N + B - 1) / B, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * B;
      const int rows = static_cast<int>(std::min<int64_t>(B, N - n0));
      __m512i acc[16];
      dot_block<M, B>(q, rows == B ? w + n0 * K : pad.data(), K, acc);
      const __m512i dot = _mm512_sub_epi32(ember_avx512::reduce16_epi32(acc), corr);
      alignas(64) float wl[16] = {};
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < rows; ++j) wl[m * B + j] = ws[n0 + j];
      alignas(64) T out[16];
      store_lanes(out, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), xsv), _mm512_load_ps(wl)));
      for (int m = 0; m < M; ++m) std::memcpy(y + m * N + n0, out + m * B, sizeof(T) * rows);
    }
  });
}
#pragma GCC pop_options
#endif

template <typename T>
torch::Tensor run(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& ws) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto q = torch::empty({M, K}, x.options().dtype(at::kChar));
  auto xs = torch::empty({M}, x.options().dtype(at::kFloat));
  quantize_rows(x.data_ptr<T>(), M, K, q.data_ptr<int8_t>(), xs.data_ptr<float>());
  auto y = torch::empty({M, N}, x.options());
#ifdef EMBER_W8A8_ROWS
  if (M <= ROWS_MAX) {
    const int8_t *qp = q.data_ptr<int8_t>(), *wp = w.data_ptr<int8_t>();
    const float *xp = xs.data_ptr<float>(), *sp = ws.data_ptr<float>();
    T* yp = y.data_ptr<T>();
    switch (M) {
      case 1: rows_vnni<1>(qp, K, wp, xp, sp, N, yp); break;
      case 2: rows_vnni<2>(qp, K, wp, xp, sp, N, yp); break;
      case 3: rows_vnni<3>(qp, K, wp, xp, sp, N, yp); break;
      default: rows_vnni<4>(qp, K, wp, xp, sp, N, yp); break;
    }
    return y;
  }
#endif
  const int64_t chunk = std::min(M, std::max<int64_t>(16, CHUNK_BYTES / (4 * N)));
  auto acc = scratch(chunk * N).narrow(0, 0, chunk * N).view({chunk, N});
  const auto wt = w.t();  // [K, N] view of the [N, K] weight: oneDNN reads it transposed at no cost
  for (int64_t r0 = 0; r0 < M; r0 += chunk) {
    const int64_t r = std::min(chunk, M - r0);
    auto a = acc.narrow(0, 0, r);
    at::_int_mm_out(a, q.narrow(0, r0, r), wt);
    rescale_rows(a.data_ptr<int32_t>(), xs.data_ptr<float>() + r0, ws.data_ptr<float>(), r, N,
                 y.data_ptr<T>() + r0 * N);
  }
  return y;
}

}  // namespace

// x bf16 or float32 [M, K]; w int8 [N, K]; w_scales float32 [N]. Returns [M, N] in x's dtype.
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor w_scales) {
  using namespace ember_check;
  constexpr const char* fn = "w8a8_linear";
  int8_weight_args(fn, x, {at::kBFloat16, at::kFloat}, w, "w_scales", w_scales);
  TORCH_CHECK(x.size(1) >= 2, fn, ": x's K must be at least 2 (torch._int_mm, which the GEMM calls, returns wrong "
              "products for K = 1 on CPU, torch 2.13), got K = ", x.size(1));
  if (x.size(0) == 0 || w.size(0) == 0) return torch::zeros({x.size(0), w.size(0)}, x.options());
  x = x.contiguous();
  w = w.contiguous();
  w_scales = w_scales.contiguous();
  if (x.scalar_type() == at::kBFloat16) return run<c10::BFloat16>(x, w, w_scales);
  return run<float>(x, w, w_scales);
}
