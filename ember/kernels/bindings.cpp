#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, int64_t window,
                                     double scale);
void add_rms_norm_(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention over the block pool (CPU)");
  m.def("add_rms_norm_", &add_rms_norm_, "in place: residual += x (if given); x = rms_norm(residual or x) * w");
}
