// Elementwise steps of a layer that eager torch runs as several ops with temporaries: rotate-half RoPE in place
// (mul, neg, cat, mul, add), the K/V write into the pools (two index_copy_), and SiLU-and-mul (chunk, silu, mul),
// each in one pass, rounding to the model dtype where eager rounds.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>

#include "avx512_util.h"
#include "checks.h"

namespace {

template <typename T>
inline T rnd(float x) { return static_cast<T>(x); }

}  // namespace

#ifdef EMBER_AVX512_BF16
// The bf16 case of rotary_, 16 lanes at a time with the same roundings (each product and the sum to bf16, round to
// nearest even as c10's conversion): bit-equal to the scalar loop, which spent 30 us a decode step's layer at 48
// tokens converting one element at a time.
static void rotary_bf16(c10::BFloat16* xp, const c10::BFloat16* cp, const c10::BFloat16* sp, int64_t T, int64_t H,
                        int64_t D, int64_t stride) {
  using namespace ember_avx512;
  const int64_t half = D / 2;
  const auto neg = [](__m512 v) {  // the sign bit flipped, as eager negates (0 becomes -0)
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)));
  };
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const c10::BFloat16* c = cp + t * D;
      const c10::BFloat16* s = sp + t * D;
      for (int64_t i = 0; i < half; i += 16) {
        const __m512 c0 = load_bf16_ps(c + i), c1 = load_bf16_ps(c + i + half);
        const __m512 s0 = load_bf16_ps(s + i), s1 = load_bf16_ps(s + i + half);
        for (int64_t h = 0; h < H; ++h) {
          c10::BFloat16* v = xp + t * stride + h * D;
          const __m512 a = load_bf16_ps(v + i), b = load_bf16_ps(v + i + half);
          const __m512 lo =
              _mm512_add_ps(round_bf16_ps(_mm512_mul_ps(a, c0)), round_bf16_ps(_mm512_mul_ps(neg(b), s0)));
          const __m512 hi = _mm512_add_ps(round_bf16_ps(_mm512_mul_ps(b, c1)), round_bf16_ps(_mm512_mul_ps(a, s1)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + i), (__m256i)_mm512_cvtneps_pbh(lo));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + i + half), (__m256i)_mm512_cvtneps_pbh(hi));
        }
      }
    }
  });
}
#endif

// x [T, H, D] (any row stride; heads and dims contiguous) rotated in place by rotate-half RoPE with cos/sin [T, D]:
// x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype (as eager).
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  using namespace ember_check;
  constexpr const char* fn = "rotary_";
  cpu(fn, "x", x);
  cpu(fn, "cos", cos);
  cpu(fn, "sin", sin);
  dtype_in(fn, "x", x, {at::kFloat, at::kBFloat16, at::kHalf});
  same_dtype(fn, "cos", cos, "x", x);
  same_dtype(fn, "sin", sin, "x", x);
  dims(fn, "x", x, 3, "[T, H, D]");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2) && x.stride(0) >= 0, fn,
              ": x's heads must be contiguous (strides [>= 0, D, 1]), got strides ", x.strides(), " for shape ",
              x.sizes());
  TORCH_CHECK(x.size(2) % 2 == 0, fn, ": x's head_dim must be even (rotate-half), got ", x.size(2));
  contiguous(fn, "cos", cos);
  contiguous(fn, "sin", sin);
  TORCH_CHECK(cos.numel() == x.size(0) * x.size(2), fn, ": cos must be [T, D] = [", x.size(0), ", ", x.size(2),
              "], got shape ", cos.sizes());
  TORCH_CHECK(sin.sizes() == cos.sizes(), fn, ": sin must have cos's shape ", cos.sizes(), ", got ", sin.sizes());
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2, stride = x.stride(0);
#ifdef EMBER_AVX512_BF16
  if (x.scalar_type() == at::kBFloat16 && half % 16 == 0) {
    rotary_bf16(x.data_ptr<c10::BFloat16>(), cos.data_ptr<c10::BFloat16>(), sin.data_ptr<c10::BFloat16>(), T, H, D,
                stride);
    return;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* c = cp + t * D;
        const scalar_t* s = sp + t * D;
        for (int64_t h = 0; h < H; ++h) {
          scalar_t* v = xp + t * stride + h * D;
          for (int64_t i = 0; i < half; ++i) {
            const float a = static_cast<float>(v[i]), b = static_cast<float>(v[i + half]);
            const float lo = static_cast<float>(rnd<scalar_t>(a * static_cast<float>(c[i]))) +
                             static_cast<float>(rnd<scalar_t>(-b * static_cast<float>(s[i])));
            const float hi = static_cast<float>(rnd<scalar_t>(b * static_cast<float>(c[i + half]))) +
                             static_cast<float>(rnd<scalar_t>(a * static_cast<float>(s[i + half])));
            v[i] = rnd<scalar_t>(lo);
            v[i + half] = rnd<scalar_t>(hi);
          }
        }
      }
    });
  });
}

// k, v [T, Hkv, D] (rows may be strided: views into the QKV output) -> the pools [num_blocks * block_size, Hkv, D]
// at slots [T], both in one pass (eager torch runs two index_copy_ calls a layer).
void write_kv_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slots) {
  using namespace ember_check;
  constexpr const char* fn = "write_kv_";
  cpu(fn, "k_cache", k_cache);
  cpu(fn, "v_cache", v_cache);
  cpu(fn, "k", k);
  cpu(fn, "v", v);
  cpu(fn, "slots", slots);
  contiguous(fn, "k_cache", k_cache);
  contiguous(fn, "v_cache", v_cache);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), fn, ": v_cache must have k_cache's shape ", k_cache.sizes(),
              ", got ", v_cache.sizes());
  same_dtype(fn, "v_cache", v_cache, "k_cache", k_cache);
  same_dtype(fn, "k", k, "k_cache", k_cache);
  same_dtype(fn, "v", v, "k_cache", k_cache);
  dims(fn, "k", k, 3, "[T, kv_heads, head_dim]");
  TORCH_CHECK(v.sizes() == k.sizes(), fn, ": v must have k's shape ", k.sizes(), ", got ", v.sizes());
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2), fn,
              ": the heads of a k/v row must be contiguous (strides [any, D, 1]), got ", k.strides(), " and ",
              v.strides());
  TORCH_CHECK(k_cache.dim() >= 3 && k_cache.size(-2) == k.size(1) && k_cache.size(-1) == k.size(2), fn,
              ": k_cache must end in k's [kv_heads, head_dim] = [", k.size(1), ", ", k.size(2), "], got shape ",
              k_cache.sizes());
  dtype(fn, "slots", slots, torch::kLong);
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == k.size(0), fn, ": slots must be [", k.size(0),
              "] (one slot a row of k), got shape ", slots.sizes());
  const int64_t T = k.size(0), row = k.size(1) * k.size(2), elem = k.element_size();
  if (T == 0 || row == 0) return;
  auto sl = slots.contiguous();
  const int64_t* s = sl.data_ptr<int64_t>();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t rows = k_cache.numel() / row;
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(s[t] >= 0 && s[t] < rows, fn, ": slots[", t, "] = ", s[t], " is outside the pool's ", rows, " slots");
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      std::memcpy(kc + s[t] * row * elem, kp + t * k.stride(0) * elem, row * elem);
      std::memcpy(vc + s[t] * row * elem, vp + t * v.stride(0) * elem, row * elem);
    }
  });
}

#ifdef EMBER_AVX512_BF16
// gate_up [rows, 2I] bf16 -> silu(gate) * up [rows, I], 16 lanes at a time; silu is rounded to bf16 before the
// product as eager rounds it. The exp is Cephes' (within 2 ulp of float32's), so a result can differ from eager's
// in the last bf16 bit where the float32 silu lands on a rounding boundary.
torch::Tensor silu_and_mul_bf16(torch::Tensor gate_up) {
  using namespace ember_check;
  constexpr const char* fn = "silu_and_mul_bf16";
  cpu(fn, "gate_up", gate_up);
  dtype(fn, "gate_up", gate_up, at::kBFloat16);
  dims(fn, "gate_up", gate_up, 2, "[rows, 2I]");
  contiguous(fn, "gate_up", gate_up);
  TORCH_CHECK(gate_up.size(1) % 32 == 0, fn, ": gate_up's width 2I must be a multiple of 32 (I % 16 == 0), got ",
              gate_up.size(1));
  using namespace ember_avx512;
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inter}, gate_up.options());
  const c10::BFloat16* in = gate_up.data_ptr<c10::BFloat16>();
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, rows * (inter / 16), 64, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const int64_t r = c / (inter / 16), i = (c % (inter / 16)) * 16;
      const c10::BFloat16* g = in + r * 2 * inter + i;
      const __m512 x = load_bf16_ps(g), u = load_bf16_ps(g + inter);
      // x / (1 + exp(-x)): exp_ps takes x <= 0, so exp(-|x|) and the sign folded back
      const __m512 e_neg = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
      const __m512 one = _mm512_set1_ps(1.f);
      const __mmask16 pos = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
      // x >= 0: x / (1 + e^-x); x < 0: x * e^x / (1 + e^x)
      const __m512 den = _mm512_add_ps(one, e_neg);
      const __m512 silu = _mm512_mask_blend_ps(pos, _mm512_div_ps(_mm512_mul_ps(x, e_neg), den), _mm512_div_ps(x, den));
      const __m512 s_r = round_bf16_ps(silu);
      _mm256_storeu_si256((__m256i*)(o + r * inter + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s_r, u)));
    }
  });
  return out;
}
#endif
