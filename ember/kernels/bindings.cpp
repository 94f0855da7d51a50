#include <torch/extension.h>

#include "avx512_util.h"

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, int64_t window,
                                     double scale, bool invariant);
bool has_avx512_bf16();
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_table, int64_t context_len, int64_t window, double scale);
torch::Tensor int4_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor scale_zeros, int64_t group, bool invariant,
                        bool amx, const c10::optional<torch::Tensor>& high, bool int8_x);
bool has_w4a8();
bool has_amx();
torch::Tensor int6_gemm(torch::Tensor x, torch::Tensor w, bool invariant, bool float_out);
bool has_int6();
torch::Tensor int8_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor scales, bool invariant, bool float_out);
torch::Tensor int8_x8_gemm(torch::Tensor x, torch::Tensor wv, torch::Tensor negcorr, torch::Tensor scales);
torch::Tensor int8_exact_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor row_sums, torch::Tensor scales,
                              bool float_out);
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor w_scales);
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
void write_kv_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slots);
#ifdef EMBER_AVX512_BF16
torch::Tensor silu_and_mul_bf16(torch::Tensor gate_up);
torch::Tensor dense_gemm(torch::Tensor x, torch::Tensor w, bool float_out);
torch::Tensor grouped_dense_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor offsets);
#endif
void add_rms_norm_(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention over the block pool (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("window"), py::arg("scale"), py::arg("invariant") = true);
  m.def("has_avx512_bf16", &has_avx512_bf16, "whether the AVX512-BF16 kernels were built (int4/int8 GEMM, prefill)");
  m.def("paged_prefill_attention", &paged_prefill_attention, "a chunk's causal attention over its paged context");
  m.def("int4_gemm", &int4_gemm, "bf16 x [M, K] . int4 W^T (the 64-row CPU int4 pack) -> bf16 [M, N]", py::arg("x"),
        py::arg("w"), py::arg("scale_zeros"), py::arg("group"), py::arg("invariant") = true, py::arg("amx") = false,
        py::arg("high") = py::none(), py::arg("int8_x") = false);
  m.def("has_w4a8", &has_w4a8, "whether int4_gemm takes int8_x=True here (AVX512-BF16 with VNNI and VBMI)");
  m.def("int6_gemm", &int6_gemm, "bf16 x [M, K] . int6 W^T (GGUF Q6_K's values, ember's 64-row int6 pack) -> bf16 "
        "[M, N] (float32 with float_out: logits)", py::arg("x"), py::arg("w"), py::arg("invariant") = true,
        py::arg("float_out") = false);
  m.def("has_int6", &has_int6, "whether int6_gemm was built (AVX512-BF16 with AVX512-VBMI)");
  m.def("has_amx", &has_amx,
        "whether the int4 kernel and int8_exact_gemm may use AMX tiles here (built with them, granted by the OS)");
  m.def("int8_gemm", &int8_gemm, "bf16 x [M, K] . int8 W^T * row scales -> bf16 [M, N] (float32 with float_out: "
        "logits)", py::arg("x"), py::arg("w"), py::arg("scales"), py::arg("invariant") = true,
        py::arg("float_out") = false);
  m.def("int8_x8_gemm", &int8_x8_gemm, "bf16 x [M, K] quantized per block of 32 to int8 . int8 W^T (pack_x8's "
        "layout) * row scales -> bf16 [M, N] (VNNI)", py::arg("x"), py::arg("wv"), py::arg("negcorr"),
        py::arg("scales"));
  m.def("int8_exact_gemm", &int8_exact_gemm, "bf16 x [M, K] in exact integer parts . int8 W^T on AMX -> bf16 [M, N] "
        "(float32 with float_out: logits)", py::arg("x"), py::arg("w"), py::arg("row_sums"), py::arg("scales"),
        py::arg("float_out") = false);
  m.def("w8a8_linear", &w8a8_linear, "x [M, K] quantized per row to int8 . int8 W^T (VNNI via _int_mm) * scales");
  m.def("write_kv_", &write_kv_, "in place: k/v rows into the pools at their slots");
#ifdef EMBER_AVX512_BF16
  m.def("silu_and_mul_bf16", &silu_and_mul_bf16, "silu(gate) * up of a bf16 [rows, 2I] projection (AVX512)");
  m.def("dense_gemm", &dense_gemm, "x [M, K] . w [N, K]^T, both float32 or both bf16, each output one fixed-order "
        "chain whatever M is (AVX512)", py::arg("x"), py::arg("w"),
        py::arg("float_out") = false);
  m.def("grouped_dense_gemm", &grouped_dense_gemm, "a Mixture-of-Experts projection: rows of x grouped by expert "
        "(offsets [E + 1]) . w [E, N, K]^T, each row dense_gemm's bits against its expert (AVX512)", py::arg("x"),
        py::arg("w"), py::arg("offsets"));
#endif
  m.def("rotary_", &rotary_, "in place: rotate-half RoPE of x [T, H, D] by cos/sin [T, D]");
  m.def("add_rms_norm_", &add_rms_norm_, "in place: residual += x (if given); x = rms_norm(residual or x) * w");
}
