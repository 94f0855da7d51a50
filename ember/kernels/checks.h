// Entry checks of the kernels: a call with a tensor of the wrong device, dtype, rank, size or layout, or index data
// pointing outside the pool, raises (c10::Error, a RuntimeError in Python) before any pointer is read. Each message
// names the kernel, the argument, the value it got and what is allowed.
#pragma once
#include <torch/extension.h>

#include <initializer_list>

namespace ember_check {

inline void cpu(const char* fn, const char* name, const torch::Tensor& t) {
  TORCH_CHECK(t.defined(), fn, ": ", name, " is undefined (None)");
  TORCH_CHECK(t.device().is_cpu(), fn, ": ", name, " must be a CPU tensor, got one on ", t.device());
}

inline void dtype(const char* fn, const char* name, const torch::Tensor& t, at::ScalarType want) {
  TORCH_CHECK(t.scalar_type() == want, fn, ": ", name, " must be ", want, ", got ", t.scalar_type());
}

inline void dtype_in(const char* fn, const char* name, const torch::Tensor& t,
                     std::initializer_list<at::ScalarType> allowed) {
  for (auto a : allowed)
    if (t.scalar_type() == a) return;
  std::string names;
  for (auto a : allowed) names += std::string(names.empty() ? "" : ", ") + c10::toString(a);
  TORCH_CHECK(false, fn, ": ", name, " must be one of ", names, ", got ", t.scalar_type());
}

inline void same_dtype(const char* fn, const char* name, const torch::Tensor& t, const char* ref_name,
                       const torch::Tensor& ref) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), fn, ": ", name, " must have ", ref_name, "'s dtype ",
              ref.scalar_type(), ", got ", t.scalar_type());
}

inline void dims(const char* fn, const char* name, const torch::Tensor& t, int64_t want, const char* shape) {
  TORCH_CHECK(t.dim() == want, fn, ": ", name, " must be ", shape, " (", want, " dims), got shape ", t.sizes());
}

inline void contiguous(const char* fn, const char* name, const torch::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), fn, ": ", name, " must be contiguous, got strides ", t.strides(), " for shape ",
              t.sizes());
}

inline void size(const char* fn, const char* name, const torch::Tensor& t, int64_t d, int64_t want,
                 const char* what) {
  TORCH_CHECK(t.size(d) == want, fn, ": ", name, ".size(", d, ") must be ", want, " (", what, "), got ", t.size(d),
              " (shape ", t.sizes(), ")");
}

// x [M, K] of one of x_types, w int8 [N, K], a float32 scale a weight row (scales_name: the kernel's own name for
// them), all on the CPU: what every int8-weight kernel (int8_gemm, int8_exact_gemm, w8a8_linear) reads.
inline void int8_weight_args(const char* fn, const torch::Tensor& x, std::initializer_list<at::ScalarType> x_types,
                             const torch::Tensor& w, const char* scales_name, const torch::Tensor& scales) {
  cpu(fn, "x", x);
  cpu(fn, "w", w);
  cpu(fn, scales_name, scales);
  if (x_types.size() == 1)
    dtype(fn, "x", x, *x_types.begin());
  else
    dtype_in(fn, "x", x, x_types);
  dtype(fn, "w", w, at::kChar);
  dtype(fn, scales_name, scales, at::kFloat);
  dims(fn, "x", x, 2, "[M, K]");
  dims(fn, "w", w, 2, "[N, K]");
  size(fn, "w", w, 1, x.size(1), "x's K");
  TORCH_CHECK(scales.numel() == w.size(0), fn, ": ", scales_name, " must hold one scale a weight row, ", w.size(0),
              ", got shape ", scales.sizes());
}

inline void positive(const char* fn, const char* name, int64_t v) {
  TORCH_CHECK(v > 0, fn, ": ", name, " must be at least 1, got ", v);
}

}  // namespace ember_check
