// Residual add + RMSNorm in one pass over the row, with transformers' rounding: the sum is rounded to the model
// dtype, the norm is computed in float32 from it and rounded, then multiplied by the weight in the model dtype.
// Eager torch spends ~9 small ops (and their dispatch) on this twice a layer.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

template <typename T>
void add_rms_norm_kernel(T* x, T* residual, const T* w, int64_t rows, int64_t dim, float eps, bool add) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * dim;
      T* rr = residual + r * dim;
      float ss = 0.f;
      for (int64_t i = 0; i < dim; ++i) {
        const T h = add ? static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i])) : xr[i];
        if (add) rr[i] = h;
        const float f = static_cast<float>(h);
        ss += f * f;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
      const T* src = add ? rr : xr;
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
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous tensors expected");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(-1), "weight mismatch");
  const bool add = residual.has_value();
  if (add) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                residual->scalar_type() == x.scalar_type(), "residual mismatch");
  }
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_", [&] {
    add_rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), add ? residual->data_ptr<scalar_t>() : nullptr,
                                  weight.data_ptr<scalar_t>(), rows, dim, static_cast<float>(eps), add);
  });
}
