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

