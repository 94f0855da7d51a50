// Paged decode attention for CPU: one query token per sequence against its K/V read in place from the block pool.
// The torch fallback gathers every sequence's blocks into a padded copy each step; this reads each cached K/V
// row exactly once, so a decode step costs what the cache weighs, not three times that plus padding.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <limits>
#include <vector>

#include "avx512_util.h"

namespace {

// Row to float32. bf16 is the top half of a float32: a shift the compiler vectorises (c10's scalar conversion
// it does not).
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void to_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(raw[i]) << 16;
}

template <>
inline void to_float<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

// The next block of the table is somewhere else in the pool: ask for it while this one is being used.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
}

// exp for the softmax (arguments <= 0 after the max is subtracted), Cephes' expf polynomial: within 2 ulp of
// std::exp, and unlike the libm call the compiler vectorises it; std::exp was most of the kernel's time.
inline float softmax_exp(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(float));
  return y * scale;
}

// HEAD_DIM > 0 fixes the head size at compile time (fully unrolled dot products); 0 reads it at run time.
template <typename T, int64_t HEAD_DIM>
void decode_kernel(const T* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* lens, T* out,
                   int64_t nd, int64_t hq, int64_t hkv, int64_t head_dim, int64_t bs, int64_t max_blocks,
                   int64_t window, float scale) {
  const int64_t d = HEAD_DIM > 0 ? HEAD_DIM : head_dim;
  const int64_t g = hq / hkv;
  // A task is one sequence with all its KV heads, so each cached token row (all heads) is read front to back:
  // splitting a sequence by head made each thread read a third of every row and ran 2.6x slower (measured
  // batch 1, 600 tokens, 3 KV heads), even with a second thread.
  at::parallel_for(0, nd, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(hq * d), acc(hq * d), scores, row(hkv * d);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t rows = hq;
      const int64_t len = lens[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      if (n <= 0) continue;
      scores.assign(rows * n, 0.f);
      to_float(q + s * hq * d, qf.data(), rows * d);
      for (int64_t i = 0; i < rows * d; ++i) qf[i] *= scale;
      const int64_t* table = tables + s * max_blocks;
      const int64_t block_bytes = bs * hkv * d * static_cast<int64_t>(sizeof(T));
      for (int64_t t = first; t < len; ++t) {
        if (t % bs == 0 && t + bs < len) prefetch(kc + table[t / bs + 1] * bs * hkv * d, block_bytes);
        to_float(kc + ((table[t / bs] * bs + t % bs) * hkv) * d, row.data(), hkv * d);
        for (int64_t r = 0; r < rows; ++r) {
          const float* qr = qf.data() + r * d;
          const float* kr = row.data() + (r / g) * d;
          float dot = 0.f;
          for (int64_t x = 0; x < d; ++x) dot += qr[x] * kr[x];
          scores[r * n + (t - first)] = dot;
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* sc = scores.data() + r * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sc[i]);
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) { sc[i] = softmax_exp(sc[i] - mx); sum += sc[i]; }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < n; ++i) sc[i] *= inv;
      }
      std::fill(acc.begin(), acc.begin() + rows * d, 0.f);
      for (int64_t t = first; t < len; ++t) {
        if (t % bs == 0 && t + bs < len) prefetch(vc + table[t / bs + 1] * bs * hkv * d, block_bytes);
        to_float(vc + ((table[t / bs] * bs + t % bs) * hkv) * d, row.data(), hkv * d);
        for (int64_t r = 0; r < rows; ++r) {
          const float p = scores[r * n + (t - first)];
          const float* vr = row.data() + (r / g) * d;
          float* ar = acc.data() + r * d;
          for (int64_t x = 0; x < d; ++x) ar[x] += p * vr[x];
        }
      }
      T* o = out + s * hq * d;
      for (int64_t i = 0; i < rows * d; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
}

#ifdef EMBER_AVX512_BF16
// acc (NR heads' running P.V sums, rescaled by corr first) += P.V over a tile of T tokens of one KV head. NR is a
// template parameter so the 2 * NV * NR accumulators stay in registers (with a run-time count they lived on the
// stack: 40% slower over 30 layers read from memory).
template <int64_t D, int NR>
inline void pv_heads(const c10::BFloat16* vt, int64_t row_stride, int64_t T, const uint32_t* pp, const float* corr,
                     float* acc_store) {
  constexpr int64_t NV = D / 32;
  __m512 acc[NR][2 * NV];
  for (int i = 0; i < NR; ++i) {
    const __m512 cv = _mm512_set1_ps(corr[i]);
    for (int64_t j = 0; j < 2 * NV; ++j) acc[i][j] = _mm512_mul_ps(_mm512_loadu_ps(acc_store + (i * 2 * NV + j) * 16), cv);
  }
  for (int64_t t = 0; t < T; t += 2) {
    const c10::BFloat16* va = vt + t * row_stride;
    __m512bh lo[NV], hi[NV];
    for (int64_t j = 0; j < NV; ++j) {
      const __m512i x = _mm512_loadu_si512(va + 32 * j);
      const __m512i y = t + 1 < T ? _mm512_loadu_si512(va + row_stride + 32 * j) : _mm512_setzero_si512();
      lo[j] = (__m512bh)_mm512_unpacklo_epi16(x, y);
      hi[j] = (__m512bh)_mm512_unpackhi_epi16(x, y);
    }
    for (int i = 0; i < NR; ++i) {
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[i * 8 + t / 2]));
      for (int64_t j = 0; j < NV; ++j) {
        acc[i][2 * j] = _mm512_dpbf16_ps(acc[i][2 * j], lo[j], pv);
        acc[i][2 * j + 1] = _mm512_dpbf16_ps(acc[i][2 * j + 1], hi[j], pv);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int64_t j = 0; j < 2 * NV; ++j) _mm512_storeu_ps(acc_store + (i * 2 * NV + j) * 16, acc[i][j]);
}

// bf16 with AVX512-BF16, D = 64 or 128: the cache is read in tiles of up to 16 tokens of one block; for each query
// head of a KV head the tile's 16 scores come from vdpbf16ps dot products (one transposing add tree instead of 16
// horizontal sums), an online softmax keeps a running max and sum, and P.V runs as vdpbf16ps over token pairs with
// P rounded to bf16 (as FlashAttention does). The tile stays in L1 while every query head of its KV head uses it,
// and P.V runs for up to RB of those heads together, each V token pair loaded and interleaved once for all of them
// (64 sequences of 450 tokens, 9 query / 3 KV heads, 2 threads, one layer's cache reused: 0.46-0.49 -> 0.32-0.37 ms;
// 30 layers of 48 x 400 tokens read from memory are bandwidth-bound and stay level, 15.1-15.6 vs 15.2-15.9 ms).
template <int64_t D>
void decode_kernel_bf16(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc,
                        const int64_t* tables, const int64_t* lens, c10::BFloat16* out, int64_t nd, int64_t hq,
                        int64_t hkv, int64_t bs, int64_t max_blocks, int64_t window, float scale) {
  using namespace ember_avx512;
  constexpr int64_t NV = D / 32;  // bf16 vectors of 32 in a row, and fp32 accumulators of 16 for each pair half
  constexpr int64_t RB = 8 / NV;  // query heads whose P.V accumulators stay in registers together (16 of them)
  const int64_t g = hq / hkv;
  const int64_t row_stride = hkv * D;
  at::parallel_for(0, nd, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc_store(hq * 2 * NV * 16), m_store(hq), l_store(hq), corr(hq);
    std::vector<uint32_t> pp(hq * 8);  // each head's tile probabilities as bf16 pairs (token t in pair t / 2)
    for (int64_t s = begin; s < end; ++s) {
      const int64_t len = lens[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      if (len - first <= 0) continue;
      std::fill(acc_store.begin(), acc_store.end(), 0.f);
      std::fill(m_store.begin(), m_store.end(), -std::numeric_limits<float>::infinity());
      std::fill(l_store.begin(), l_store.end(), 0.f);
      const int64_t* table = tables + s * max_blocks;
      const c10::BFloat16* qs = q + s * hq * D;
      for (int64_t t0 = first; t0 < len;) {
        const int64_t blk = table[t0 / bs];
        const int64_t in_blk = t0 % bs;
        const int64_t T = std::min<int64_t>({16, bs - in_blk, len - t0});
        const int64_t base = (blk * bs + in_blk) * row_stride;
        // The block read next lies elsewhere in the pool (this sequence's next block, or after its last tile the next
        // sequence's first): its K and V are prefetched a slice per query head while this tile computes. Issued
        // all at once, the 192 prefetches of a 6 KB block overran the core's miss buffers and most were lost: 30
        // layers of 48 x 400 tokens in scattered blocks took 21.1 ms that way, 13.5 ms spread (11.5 ms to read
        // the same bytes and compute nothing); blocks in pool order 14.6 -> 11.1 ms.
        const char* pk = nullptr;
        const char* pv = nullptr;
        if (in_blk + T == bs && t0 + T < len) {
          const int64_t nxt = table[(t0 + T) / bs] * bs * row_stride;
          pk = reinterpret_cast<const char*>(kc + nxt);
          pv = reinterpret_cast<const char*>(vc + nxt);
        } else if (t0 + T >= len && s + 1 < end) {
          const int64_t next_len = lens[s + 1];
          const int64_t next_first = window > 0 ? std::max<int64_t>(0, next_len - window) : 0;
          if (next_len > next_first) {
            const int64_t nxt = tables[(s + 1) * max_blocks + next_first / bs] * bs * row_stride;
            pk = reinterpret_cast<const char*>(kc + nxt);
            pv = reinterpret_cast<const char*>(vc + nxt);
          }
        }
        const int64_t blk_bytes = bs * row_stride * 2;
        const int64_t slice = ((blk_bytes / 64 + hq - 1) / hq) * 64;  // bytes of each pool prefetched per query head
        const __mmask16 valid = static_cast<__mmask16>((1u << T) - 1);
        for (int64_t h = 0; h < hkv; ++h) {
          const c10::BFloat16* kt = kc + base + h * D;
          const c10::BFloat16* vt = vc + base + h * D;
          for (int64_t r = h * g; r < (h + 1) * g; ++r) {
            if (pk != nullptr && r * slice < blk_bytes) {
              prefetch(pk + r * slice, std::min(slice, blk_bytes - r * slice));
              prefetch(pv + r * slice, std::min(slice, blk_bytes - r * slice));
            }
            __m512bh qv[NV];
            for (int64_t j = 0; j < NV; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(qs + r * D + 32 * j);
            __m512 part[16];
            for (int64_t t = 0; t < 16; ++t) {
              __m512 a = _mm512_setzero_ps();
              if (t < T) {
                const c10::BFloat16* kr = kt + t * row_stride;
                for (int64_t j = 0; j < NV; ++j) a = _mm512_dpbf16_ps(a, qv[j], (__m512bh)_mm512_loadu_si512(kr + 32 * j));
              }
              part[t] = a;
            }
            __m512 sc = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid,
                                           _mm512_mul_ps(reduce16(part), _mm512_set1_ps(scale)));
            const float m_old = m_store[r];
            const float m_new = std::max(m_old, _mm512_reduce_max_ps(sc));
            corr[r] = m_old == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m_old - m_new);
            __m512 p = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(sc, _mm512_set1_ps(m_new))));
            m_store[r] = m_new;
            l_store[r] = l_store[r] * corr[r] + _mm512_reduce_add_ps(p);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp.data() + r * 8), (__m256i)_mm512_cvtneps_pbh(p));
          }
          for (int64_t r0 = h * g; r0 < (h + 1) * g; r0 += RB) {
            float* ar = acc_store.data() + r0 * 2 * NV * 16;
            const uint32_t* pr = pp.data() + r0 * 8;
            const float* cr = corr.data() + r0;
            switch (std::min<int64_t>(RB, (h + 1) * g - r0)) {
              case 1: pv_heads<D, 1>(vt, row_stride, T, pr, cr, ar); break;
              case 2: pv_heads<D, 2>(vt, row_stride, T, pr, cr, ar); break;
              case 3: if constexpr (RB >= 3) pv_heads<D, 3>(vt, row_stride, T, pr, cr, ar); break;
              default: if constexpr (RB >= 4) pv_heads<D, 4>(vt, row_stride, T, pr, cr, ar); break;
            }
          }
        }
        t0 += T;
      }
      // acc[2j] lane 4c+i holds dimension 32j + 8c + i, acc[2j+1] lane 4c+i dimension 32j + 8c + 4 + i
      // (unpacklo/hi interleave within 128-bit quarters)
      for (int64_t r = 0; r < hq; ++r) {
        const float inv = 1.f / l_store[r];
        const float* ar = acc_store.data() + r * 2 * NV * 16;
        c10::BFloat16* o = out + (s * hq + r) * D;
        for (int64_t j = 0; j < NV; ++j)
          for (int64_t c = 0; c < 4; ++c)
            for (int64_t i = 0; i < 4; ++i) {
              o[32 * j + 8 * c + i] = static_cast<c10::BFloat16>(ar[16 * (2 * j) + 4 * c + i] * inv);
              o[32 * j + 8 * c + 4 + i] = static_cast<c10::BFloat16>(ar[16 * (2 * j + 1) + 4 * c + i] * inv);
            }
      }
    }
  });
}
#endif

}  // namespace

// q [nd, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [nd, max_blocks] int64;
// context_lens [nd] int64; window <= 0: full attention. Returns [nd, Hq, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, int64_t window,
                                     double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(), "dtype mismatch");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong, "int64 index");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "head_dim mismatch");
  q = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t nd = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t bs = k_cache.size(1), hkv = k_cache.size(2);
  TORCH_CHECK(hq % hkv == 0, "query heads must be a multiple of KV heads");
#ifdef EMBER_AVX512_BF16
  if (q.scalar_type() == at::kBFloat16 && (d == 64 || d == 128)) {
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<c10::BFloat16>(), k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(),
             tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<c10::BFloat16>(), nd, hq, hkv, bs,
             tables.size(1), window, static_cast<float>(scale));
    };
    if (d == 64) run(decode_kernel_bf16<64>);
    else run(decode_kernel_bf16<128>);
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
             tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), nd, hq, hkv, d, bs,
             tables.size(1), window, static_cast<float>(scale));
    };
    if (d == 64) run(decode_kernel<scalar_t, 64>);
    else if (d == 128) run(decode_kernel<scalar_t, 128>);
    else run(decode_kernel<scalar_t, 0>);
  });
  return out;
}

