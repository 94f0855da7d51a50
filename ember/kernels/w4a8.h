// w4a8.cpp's entry, called by int4_gemm (quant_gemm.cpp) when asked for int8 activations.
#pragma once
#include <c10/util/BFloat16.h>

#include <cstdint>

constexpr int64_t W4A8_BLOCK = 32;  // inputs an activation block (one int8 scale each)

// y[M, N] (bf16) = x[M, K] (bf16) . W^T, W ember's 64-row int4 pack (w: its bytes; sz: [N/64, K/group, 64, 2]
// (scale, zero) pairs), x quantized per row and block of W4A8_BLOCK inputs to int8. False (nothing written) where
// the build has no w4a8 kernel (AVX512-BF16 with VNNI and VBMI) or the group is not a multiple of W4A8_BLOCK.
bool w4a8_rows(const c10::BFloat16* x, int64_t M, int64_t K, const uint8_t* w, const c10::BFloat16* sz, int64_t N,
               int64_t group, c10::BFloat16* y);

bool has_w4a8();
