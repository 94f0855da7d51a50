// Residual add + RMSNorm in one pass over the row, with transformers' rounding: the sum is rounded to the model
// dtype, the norm is computed in float32 from it and rounded, then multiplied by the weight in the model dtype.
// Eager torch spends ~9 small ops (and their dispatch) on this twice a layer.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "avx512_util.h"
#include "checks.h"

namespace {

EMBER_INLINE float to_f32(float x) { return x; }
EMBER_INLINE float to_f32(c10::BFloat16 x) { return ember_fixed::bf16_bits_to_float(x.x); }
EMBER_INLINE float to_f32(c10::Half x) { return static_cast<float>(x); }

}  // namespace

// The sum of squares of a row in a fixed order (16 lanes, element i in lane i % 16, then a fixed tree), so a row's
// norm is the same bits whichever batch or offset it is in (batch invariance; the vectoriser may not reorder it).
EMBER_FIXED_ORDER_BEGIN
namespace {

template <typename T>
float sum_squares(const T* x, int64_t n) {
  float l[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) {
      const float f = to_f32(x[i + j]);
      l[j] += f * f;
    }
  for (int j = 0; i + j < n; ++j) {
    const float f = to_f32(x[i + j]);
    l[j] += f * f;
  }
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) l[j] += l[j + w];
  return l[0];
}

}  // namespace
EMBER_FIXED_ORDER_END

namespace {

template <typename T>
void add_rms_norm_kernel(T* x, T* residual, const T* w, int64_t rows, int64_t dim, float eps, bool add) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * dim;
      T* rr = residual + r * dim;
      if (add)
        for (int64_t i = 0; i < dim; ++i)
          rr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
      const T* src = add ? rr : xr;
      const float inv = 1.f / std::sqrt(sum_squares(src, dim) / static_cast<float>(dim) + eps);
      for (int64_t i = 0; i < dim; ++i) {
        const T normed = static_cast<T>(static_cast<float>(src[i]) * inv);
        xr[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(normed));
      }
    }
  });
}

}  // namespace

// x [rows, dim] (overwritten with the normed result); residual [rows, dim] or undefined: when given,
// residual <- x + residual first and the norm is taken of that sum.
void add_rms_norm_(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  using namespace ember_check;
  constexpr const char* fn = "add_rms_norm_";
  cpu(fn, "x", x);
  cpu(fn, "weight", weight);
  dtype_in(fn, "x", x, {at::kFloat, at::kBFloat16, at::kHalf});
  same_dtype(fn, "weight", weight, "x", x);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, fn, ": x must be [..., dim] with dim >= 1, got shape ", x.sizes());
  contiguous(fn, "x", x);
  contiguous(fn, "weight", weight);
  TORCH_CHECK(weight.numel() == x.size(-1), fn, ": weight must hold x's dim = ", x.size(-1), " values, got shape ",
              weight.sizes());
  const bool add = residual.has_value();
  if (add) {
    cpu(fn, "residual", *residual);
    same_dtype(fn, "residual", *residual, "x", x);
    TORCH_CHECK(residual->sizes() == x.sizes(), fn, ": residual must have x's shape ", x.sizes(), ", got ",
                residual->sizes());
    contiguous(fn, "residual", *residual);
  }
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_", [&] {
    add_rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), add ? residual->data_ptr<scalar_t>() : nullptr,
                                  weight.data_ptr<scalar_t>(), rows, dim, static_cast<float>(eps), add);
  });
}
