"""GGUF Q4_K / Q5_K weights held with their scales as the file stores them (``pack_k_scales``: f16 d and -dmin a
super-block of 256, a byte sc and m a group of 32) instead of bf16 (scale, zero) pairs: each byte where the int4
kernel reads it, the product against float64 of the file's own values (the pairs round s and zero to bf16, these do
not), the same bits whatever rows share the call, and the pairs wherever the weight or the path cannot take them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf_writer import quantize_q4_k

from ember.kernels import cpu_kernels
from ember.quantization import QuantizedMatmul, QuantizedTensor
from ember.quantization.kernels import (_scale_zeros, block_scale_zeros, pack_cpu_int4, pack_cpu_int5_high,
                                        pack_k_scales, unpack_k_scales)
from ember.quantization.tensor import concat_rows, from_gguf, pack_int4


def _k_quant(n: int, k: int, seed: int, kind: str = "int4") -> QuantizedTensor:
    """Q4_K's form (Q5_K's with kind int5): w = d sc q + e m, d and e = -dmin f16 a 256 inputs, sc and m 0..63."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16 if kind == "int4" else 32, (n, k), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // 256, generator=g) * 0.004 + 1e-4).half().float()
    e = -(torch.rand(n, k // 256, generator=g) * 0.004).half().float()
    sc = torch.randint(0, 64, (n, k // 32), generator=g).float()
    m = torch.randint(0, 64, (n, k // 32), generator=g).float()
    scales, offsets = d.repeat_interleave(8, 1) * sc, e.repeat_interleave(8, 1) * m
    return QuantizedTensor(kind, pack_int4(q) if kind == "int4" else q, scales, offsets, 32, d, e)


def test_each_scale_byte_lies_where_the_kernel_reads_it():
    """Row 70 (block 1, column 6) of a 128 x 512 weight, group 9 (super-block 1, its group 1): block 1's super-block
    1 starts at (1 * 2 + 1) * 1280 bytes; its d at 2 * 6, e at 128 + 2 * 6, group 1's sc at 256 + 128 + 6, m 64
    bytes after."""
    n, k = 128, 512
    d, e = torch.full((n, 2), 0.5), torch.full((n, 2), -0.25)
    sc, m = torch.zeros(n, 16), torch.zeros(n, 16)
    d[70, 1], e[70, 1], sc[70, 9], m[70, 9] = 2.0, -4.0, 5, 7
    qt = QuantizedTensor("int4", torch.zeros(n, k // 2, dtype=torch.uint8), d.repeat_interleave(8, 1) * sc,
                         e.repeat_interleave(8, 1) * m, 32, d, e)
    packed = pack_k_scales(qt)
    assert packed.dtype == torch.uint8 and packed.shape == (n // 64, k // 256, 1280)
    at = (1 * 2 + 1) * 1280
    flat = packed.view(-1)
    assert flat[at + 12:at + 14].view(torch.float16).item() == 2.0
    assert flat[at + 128 + 12:at + 128 + 14].view(torch.float16).item() == -4.0
    assert flat[at + 256 + 128 + 6].item() == 5 and flat[at + 256 + 128 + 64 + 6].item() == 7
    assert (packed[..., 256:] != 0).sum().item() == 2  # sc and m: only the two set
    scales, offsets = unpack_k_scales(packed, n, k)
    assert torch.equal(scales, qt.scales) and torch.equal(offsets, qt.offsets)


def test_gguf_q4_k_blocks_keep_their_factors_and_pack_exactly():
    w = (np.random.default_rng(0).standard_normal((128, 768)) * 0.05).astype(np.float32)
    qt = from_gguf(quantize_q4_k(w), "Q4_K", (128, 768))
    assert qt.super_scales.shape == qt.super_offsets.shape == (128, 3)
    scales, offsets = unpack_k_scales(pack_k_scales(qt), 128, 768)
    assert torch.equal(scales, qt.scales) and torch.equal(offsets, qt.offsets)
    both = concat_rows([qt, qt.rows(torch.arange(64))])  # a fused projection's parts keep them
    assert both.super_scales.shape == (192, 3) and pack_k_scales(both) is not None
    assert concat_rows([qt, QuantizedTensor("int4", qt.data, qt.scales, qt.offsets, 32)]).super_scales is None


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("kind", ["int4", "int5"])
@pytest.mark.parametrize("n,k", [(64, 256), (192, 768)])
def test_the_kernel_multiplies_the_files_own_values(avx512, n, k, kind, invariant):
    """1 row, a few (the invariant passes) and 130 (the panel when not invariant), against float64 of the weight's
    values: within the bf16 output's rounding, and no further than the bf16 pairs, which round each s and zero."""
    qt = _k_quant(n, k, n + k, kind)
    q = qt.unpacked()
    w = pack_cpu_int4(q & 0xF)
    high = pack_cpu_int5_high(q) if kind == "int5" else None
    ks, pairs = pack_k_scales(qt), block_scale_zeros(_scale_zeros(qt))
    x = torch.randn(130, k, generator=torch.Generator().manual_seed(3)).bfloat16()
    ref = F.linear(x.double(), qt.dequantize(torch.float64))
    for rows in (1, 5, 130):
        y = avx512.int4_gemm(x[:rows], w, ks, 32, invariant, False, high).double()
        yp = avx512.int4_gemm(x[:rows], w, pairs, 32, invariant, False, high).double()
        err, err_pairs = ((y - ref[:rows]).norm() / ref[:rows].norm()).item(), \
            ((yp - ref[:rows]).norm() / ref[:rows].norm()).item()
        assert err < (4e-3 if rows == 130 and not invariant else 2.5e-3), (rows, err)  # the panel rounds w to bf16
        assert err <= err_pairs * 1.05, (rows, err, err_pairs)


@pytest.mark.parametrize("kind", ["int4", "int5"])
def test_rows_do_not_depend_on_the_rows_beside_them(avx512, kind):
    """Up to 6 rows the scales come from the bytes, more (several passes over a block) from their float copy."""
    qt = _k_quant(192, 768, 11, kind)
    q = qt.unpacked()
    w, ks = pack_cpu_int4(q & 0xF), pack_k_scales(qt)
    high = pack_cpu_int5_high(q) if kind == "int5" else None
    x = torch.randn(100, 768, generator=torch.Generator().manual_seed(5)).bfloat16()
    alone = torch.cat([avx512.int4_gemm(x[i:i + 1], w, ks, 32, True, False, high) for i in range(100)])
    for m in (2, 3, 5, 6, 7, 13, 48, 49, 97, 100):
        assert torch.equal(avx512.int4_gemm(x[:m], w, ks, 32, True, False, high), alone[:m]), m
        assert torch.equal(avx512.int4_gemm(x[-m:], w, ks, 32, True, False, high), alone[-m:]), m


def test_weights_without_such_factors_keep_the_pairs():
    qt = _k_quant(64, 512, 2)
    assert pack_k_scales(qt) is not None
    plain = QuantizedTensor("int4", qt.data, qt.scales, qt.offsets, 32)  # Q4_0 / Q4_1, or quantized by ember
    off_grid = QuantizedTensor("int4", qt.data, qt.scales * 1.0001, qt.offsets, 32, qt.super_scales,
                               qt.super_offsets)  # scales no byte multiples of d
    not_f16 = QuantizedTensor("int4", qt.data, qt.scales, qt.offsets, 32, qt.super_scales * (1 + 2 ** -20),
                              qt.super_offsets)
    for other in (plain, off_grid, not_f16):
        assert pack_k_scales(other) is None
    k384 = _k_quant(64, 512, 2)
    k384 = QuantizedTensor("int4", k384.data[:, :192], k384.scales[:, :12], k384.offsets[:, :12], 32,
                           k384.super_scales[:, :2], k384.super_offsets[:, :2])  # K = 384: half a super-block
    assert pack_k_scales(k384) is None


def test_the_matmul_path_holds_k_scales_and_gives_the_files_values(avx512):
    if cpu_kernels() is None or not cpu_kernels().has_avx512_bf16():
        pytest.skip("the int4 path holds torch's pack here (no AVX512-BF16 kernels)")
    qt = _k_quant(128, 512, 4)
    mm = QuantizedMatmul("int4", qt)
    if mm.impl.amx:
        assert mm.impl.s.dtype == torch.bfloat16  # AMX takes the pairs only
        return
    assert mm.impl.s.dtype == torch.uint8
    assert torch.equal(mm.dequantized(torch.float32), qt.dequantize(torch.float32))
    held = sum(t.numel() * t.element_size() for t in mm.tensors())
    assert held * 8 / (128 * 512) == 4.625
    pairs_mm = QuantizedMatmul("int4", QuantizedTensor("int4", qt.data, qt.scales, qt.offsets, 32))
    assert pairs_mm.impl.s.dtype == torch.bfloat16
    x = torch.randn(3, 512).bfloat16()
    ref = F.linear(x.double(), qt.dequantize(torch.float64))
    assert ((mm(x).double() - ref).norm() / ref.norm()).item() < 2.5e-3
    a8 = QuantizedMatmul("int4", qt, int8_activations=True)
    if a8.int8_x:  # the w4a8 kernel reads the pairs
        assert a8.impl.s.dtype == torch.bfloat16


def test_the_kernel_checks_k_scales(avx512):
    qt = _k_quant(64, 512, 6)
    w, ks = pack_cpu_int4(qt.unpacked()), pack_k_scales(qt)
    x = torch.randn(2, 512).bfloat16()
    with pytest.raises(RuntimeError, match=r"int4_gemm: K-quant scales \(uint8 scale_zeros\) need groups of 32"):
        avx512.int4_gemm(x, w, ks, 64)
    with pytest.raises(RuntimeError, match=r"int4_gemm: scale_zeros.size\(2\) must be 1280"):
        avx512.int4_gemm(x, w, ks[..., :-1].contiguous(), 32)
    with pytest.raises(RuntimeError, match=r"int4_gemm: scale_zeros.size\(1\) must be 2 \(K / 256"):
        avx512.int4_gemm(x, w, ks[:, :1].contiguous(), 32)
    with pytest.raises(RuntimeError, match="int4_gemm: K-quant scales run on the AVX512-BF16 kernel only"):
        avx512.int4_gemm(x, w, ks, 32, True, True)
    with pytest.raises(RuntimeError, match="int4_gemm: K-quant scales run on the AVX512-BF16 kernel only"):
        avx512.int4_gemm(x, w, ks, 32, True, False, None, True)
    with pytest.raises(RuntimeError, match="int4_gemm: scale_zeros must be one of BFloat16, Byte, got Float"):
        avx512.int4_gemm(x, w, ks.float(), 32)
