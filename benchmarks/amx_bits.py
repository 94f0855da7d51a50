"""Do AMX's bf16 tile products round as AVX512-BF16's vdpbf16ps does? A batch-invariant kernel may take AMX for
prefill only if a row's result is the same bits as the one-row (decode) path's. This builds two tiny kernels inline
(AMX TDPBF16PS over 16-pair K tiles; one vdpbf16ps chain per row over the same pairs, also with each pair's halves
swapped) and compares them, and compares AMX rows computed in tiles of 1, 2 and 5 rows against 16. Needs an AMX CPU
(Linux, a compiler with -mamx-bf16).

    python benchmarks/amx_bits.py
"""

from __future__ import annotations

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
struct alignas(64) TileCfg { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
// a: [rows, 32 G] bf16; b: [16 G, 16, 2] bf16 (K pairs x 16 columns); C [rows, 16] summed over the G K tiles
torch::Tensor amx_mm(torch::Tensor a, torch::Tensor b) {
  TORCH_CHECK(syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0, "no AMX");
  const int64_t rows = a.size(0), G = a.size(1) / 32;
  TileCfg cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 3; ++t) { cfg.rows[t] = t == 2 ? 16 : rows; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
  auto c = torch::zeros({rows, 16}, torch::kFloat32);
  _tile_zero(0);
  for (int64_t g = 0; g < G; ++g) {
    _tile_loadd(1, (const char*)a.data_ptr() + g * 64, a.size(1) * 2);
    _tile_loadd(2, (const char*)b.data_ptr() + g * 16 * 64, 64);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, c.data_ptr(), 64);
  _tile_release();
  return c;
}
torch::Tensor avx_mm(torch::Tensor a, torch::Tensor b, bool swap) {
  const int64_t rows = a.size(0), kw = a.size(1) / 2;
  auto c = torch::zeros({rows, 16}, torch::kFloat32);
  const uint32_t* aw = (const uint32_t*)a.data_ptr();
  const uint32_t* bw = (const uint32_t*)b.data_ptr();
  for (int64_t m = 0; m < rows; ++m) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < kw; ++kp) {
      uint32_t x = aw[m * kw + kp];
      __m512i bv = _mm512_loadu_si512(bw + kp * 16);
      if (swap) {
        x = (x >> 16) | (x << 16);
        bv = _mm512_or_si512(_mm512_srli_epi32(bv, 16), _mm512_slli_epi32(bv, 16));
      }
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(x), (__m512bh)bv);
    }
    _mm512_storeu_ps(c.data_ptr<float>() + m * 16, acc);
  }
  return c;
}
"""


def main() -> None:
    mod = load_inline("ember_amx_bits", cpp_sources=SOURCE, functions=["amx_mm", "avx_mm"],
                      extra_cflags=["-O2", "-march=native", "-mamx-tile", "-mamx-bf16"])
    torch.manual_seed(0)
    for groups in (1, 48):  # one K tile; 1,536 inputs
        a = torch.randn(16, 32 * groups).bfloat16()
        b = torch.randn(16 * groups, 16, 2).bfloat16()
        exact = torch.einsum("mkp,knp->mn", a.double().view(16, -1, 2), b.double())
        amx, avx, swapped = mod.amx_mm(a, b), mod.avx_mm(a, b, False), mod.avx_mm(a, b, True)
        same = (amx == avx).float().mean().item(), (amx == swapped).float().mean().item()
        print(f"K = {32 * groups}: AMX equals vdpbf16ps in {same[0]:.0%} of outputs ({same[1]:.0%} with pairs "
              f"swapped); max error against float64: AMX {(amx.double() - exact).abs().max():.2e}, "
              f"vdpbf16ps {(avx.double() - exact).abs().max():.2e}")
        full = mod.amx_mm(a, b)
        alone = all(torch.equal(mod.amx_mm(a[i:i + r].contiguous(), b), full[i:i + r])
                    for i in range(0, 16, 3) for r in (1, 2, 5) if i + r <= 16)
        print(f"  AMX rows in tiles of 1, 2, 5 rows equal the 16-row tile's: {alone}")


if __name__ == "__main__":
    main()
