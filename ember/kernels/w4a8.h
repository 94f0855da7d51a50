// int8 activations per row and block of W4A8_BLOCK inputs (EngineConfig.int8_activations): w4a8.cpp (int4 weights,
// called by int4_gemm in quant_gemm.cpp; the quantization of x) and w8a8_blocks.cpp (int8 weights, int8_x8_gemm).
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

// x [M, K] -> q (int8, round half to even of x / scale; plus128: stored as q + 128 in uint8), scale = max(max|x| /
// 127, 1e-10) and (bsum not null) scale * the sum of q (the quantized x's sum), per row and block of W4A8_BLOCK
// inputs ([M, K / W4A8_BLOCK] each); K a multiple of W4A8_BLOCK.
void quantize_x8_blocks(const c10::BFloat16* x, int64_t M, int64_t K, int8_t* q, float* d, float* bsum,
                        bool plus128);

// y[M, N] (bf16) = (x [M, K] . W^T) * scales, W int8 [N, K] with a float32 scale a row held as pack_x8 lays it
// out (wv: [ceil(N/16), K/4, 16, 4] bytes; negcorr: [ceil(N/16), K/W4A8_BLOCK, 16] int32, -128 * each block's sum
// of each row), x quantized as above. False (nothing written) without the kernel (as w4a8_rows) or where K is not a
// multiple of W4A8_BLOCK.
bool w8a8_block_rows(const c10::BFloat16* x, int64_t M, int64_t K, const int8_t* wv, const int32_t* negcorr,
                     const float* scales, int64_t N, c10::BFloat16* y);
