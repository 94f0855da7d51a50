"""5-bit weights (GGUF Q5_0 / Q5_1 / Q5_K, held as int5) on the CPU: the int4 kernel's pack of the low four bits
plus a plane of fifth bits, each bit where the kernel's masked add reads it; the product against a float32 matmul
of the weight's own values (the reference), batch invariant, and int8 per row where the kernel is not there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.layers.linear import Linear
from ember.quantization import QuantConfig, QuantizedMatmul, QuantizedTensor, cpu_holds_int5
from ember.quantization import kernels as qkernels
from ember.quantization.kernels import (_scale_zeros, block_scale_zeros, pack_cpu_int4, pack_cpu_int5_high,
                                        unpack_cpu_int5_high)


def _int5(n: int, k: int, seed: int) -> QuantizedTensor:
    """Q5_0's form: w = d (q - 16), one f16 d a group of 32."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    return QuantizedTensor("int5", q, d, -16 * d, 32)


def test_the_fifth_bits_lie_where_the_kernel_reads_them():
    """Row 70 (block 1, mask j = 0, column c = 6), input 5 (pair kp = 2, h = 1): bit 2c + h = 13 of block 1's mask
    4 kp + j, i.e. byte 1 of that 32-bit mask, bit 5."""
    n, k = 128, 64
    q = torch.zeros(n, k, dtype=torch.uint8)
    q[70, 5] = 16
    high = pack_cpu_int5_high(q)
    assert high.shape == (n * k // 8,)
    block1 = k // 2 * 16  # a block's masks: K / 2 pairs of four 4-byte masks
    want = torch.zeros_like(high)
    want[block1 + 2 * 16 + 0 * 4 + 1] = 1 << 5
    assert torch.equal(high, want)
    full = _int5(192, 96, 1).unpacked()
    assert torch.equal(unpack_cpu_int5_high(pack_cpu_int5_high(full), 192, 96), full >> 4)


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("n,k", [(64, 32), (192, 320), (128, 576)])
def test_the_kernel_multiplies_the_weights_own_values(avx512, n, k, invariant):
    """1 row, a few (the batch-invariant passes) and 130 (the panel path when not invariant), against a float32
    matmul of the dequantized weight: within bf16 rounding of the activations, the output and each group's scale
    pair. Without the plane the product is another one: the fifth bits are read."""
    qt = _int5(n, k, n + k)
    q = qt.unpacked()
    w, sz, high = pack_cpu_int4(q & 0xF), block_scale_zeros(_scale_zeros(qt)), pack_cpu_int5_high(q)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(130, k, generator=g).bfloat16()
    ref = F.linear(x.float(), qt.dequantize(torch.float32))
    for rows in (1, 5, 130):
        y = avx512.int4_gemm(x[:rows], w, sz, 32, invariant, False, high).float()
        assert ((y - ref[:rows]).norm() / ref[:rows].norm()).item() < 4e-3, rows
    low_only = avx512.int4_gemm(x[:5], w, sz, 32, invariant, False).float()
    assert ((low_only - ref[:5]).norm() / ref[:5].norm()).item() > 0.1


def test_the_kernel_checks_the_plane(avx512):
    qt = _int5(64, 64, 3)
    q = qt.unpacked()
    w, sz = pack_cpu_int4(q & 0xF), block_scale_zeros(_scale_zeros(qt))
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match=r"int4_gemm: high must hold N \* K / 8 = 512 bytes"):
        avx512.int4_gemm(x, w, sz, 32, True, False, pack_cpu_int5_high(q)[:-1])
    with pytest.raises(RuntimeError, match="amx=True takes 4-bit weights only"):
        avx512.int4_gemm(x, w, sz, 32, True, True, pack_cpu_int5_high(q))


needs_int5 = pytest.mark.skipif(not cpu_holds_int5(64, 64, 32),
                                reason="this CPU holds 5-bit weights as int8 (no AVX512-BF16 kernels, or AMX)")


@needs_int5
def test_the_matmul_path_holds_the_weight_at_six_bits_and_gives_its_values():
    qt = _int5(192, 320, 5)
    mm = QuantizedMatmul("int5", qt)
    assert mm.path == "cpu-int5"
    assert sum(t.numel() * t.element_size() for t in mm.tensors()) == 192 * 320 * 6 // 8  # 4 + 1 + a 32-bit pair / 32
    # the path's values: the file's, with each group's scale and zero (offset + 8 scale) in bf16
    s, z = qt.scales.bfloat16().float(), (qt.offsets + 8 * qt.scales).bfloat16().float()
    want = ((qt.unpacked().float().view(192, 10, 32) - 8) * s[..., None] + z[..., None]).view(192, 320)
    assert torch.equal(mm.dequantized(torch.float32), want)
    x = torch.randn(9, 320).bfloat16()
    together = mm(x)
    assert torch.equal(torch.cat([mm(x[i:i + 1]) for i in range(9)]), together)
    ref = F.linear(x.float(), qt.dequantize(torch.float32))
    assert ((together.float() - ref).norm() / ref.norm()).item() < 4e-3
    with pytest.raises(ValueError, match="int5 matmul needs an int5 weight"):
        QuantizedMatmul("int5", QuantizedTensor("int8", qt.unpacked().to(torch.int8), qt.scales, None, 32))


@pytest.mark.parametrize("holds", [True, False])
def test_a_mixed_layer_keeps_its_5_bit_parts_where_the_cpu_takes_them(monkeypatch, holds):
    """A fused projection of a 4-bit and a 5-bit part: int4 + int5 where ``cpu_holds_int5``, else the 5-bit part
    as int8 per row; either way the product of the parts' own values."""
    if holds and not cpu_holds_int5(64, 64, 32):
        pytest.skip("this CPU holds 5-bit weights as int8")
    monkeypatch.setattr("ember.layers.linear.cpu_holds_int5", lambda *a: holds)
    from ember.quantization import quantize_int4

    four, five = quantize_int4(torch.randn(128, 64), 32), _int5(64, 64, 9)
    layer = Linear(64, 192, bias=False, dtype=torch.bfloat16, quant=QuantConfig("int4", 32, mixed=True))
    layer.load_weight(four, 0)
    layer.load_weight(five, 128)
    layer.finalize(torch.device("cpu"), prepack=False)
    assert layer.kind == ("int4+int5" if holds else "int4+int8")
    x = torch.randn(3, 64).bfloat16()
    ref = F.linear(x.float(), torch.cat([four.dequantize(), five.dequantize()]))
    assert ((layer(x).float() - ref).norm() / ref.norm()).item() < 0.01


def test_no_int5_path_where_the_kernels_are_missing(monkeypatch):
    monkeypatch.setattr(qkernels, "_ember_gemm", lambda: None)
    assert not cpu_holds_int5(64, 64, 32)
    assert qkernels.select_path("int5", torch.device("cpu"), 64, 64, 32) == "portable"
