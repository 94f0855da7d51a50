"""int8 activations per block of 32 (``EngineConfig.int8_activations``) against int4 weights (ember/kernels/w4a8.cpp)
and int8 ones (w8a8_blocks.cpp): each kernel against a reference of its arithmetic in plain torch (x quantized per
row and block of 32, round half to even, exact integer products; int4's offsets from the quantized x's sums), how
close int4's result is to the exact product, what they refuse, and which weights take them (a row's bits whatever rows
share the call: test_batch_invariance.py)."""

from __future__ import annotations

import pytest
import torch

from ember.kernels import cpu_kernels, emulated_kernels
from ember.quantization import QuantizedMatmul, quantize_int4, quantize_int8
from ember.quantization.held import held_kinds
from ember.quantization.kernels import W4A8_BLOCK, _scale_zeros, block_scale_zeros, pack_cpu_int4, pack_x8


@pytest.fixture(scope="module")
def k():
    """The native build where it has the kernel (AVX512-BF16, VNNI, VBMI), else the emulated one."""
    native = cpu_kernels()
    return native if native is not None and native.has_w4a8() else emulated_kernels()


def _weight(n: int, k: int, group: int, seed: int = 0):
    torch.manual_seed(seed)
    qt = quantize_int4(torch.randn(n, k) * 0.05, group)
    sz = _scale_zeros(qt)
    return qt, pack_cpu_int4(qt.unpacked()), block_scale_zeros(sz), sz


def _x8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> q [M, K/32, 32] (float32 integers) and the scales [M, K/32], as the kernels quantize."""
    m, k = x.shape
    xb = x.float().view(m, k // W4A8_BLOCK, W4A8_BLOCK)
    xs = (xb.abs().amax(-1) / 127).clamp(min=1e-10)
    return torch.round(xb / xs[..., None]).clamp(-127, 127), xs  # float32 quotient, round half to even


def _reference(x: torch.Tensor, qt, sz: torch.Tensor, group: int) -> torch.Tensor:
    """The kernel's arithmetic in float64: per block b of 32 inputs, (integer sum * x scale) * weight scale; per
    group, the quantized x's sum (each block's x scale times its sum of q) times (zero - 8 scale)."""
    m, k = x.shape
    n = qt.shape[0]
    q, xs = _x8(x)
    isum = torch.einsum("mbk,nbk->mbn", q.double(), qt.unpacked().double().view(n, k // W4A8_BLOCK, W4A8_BLOCK))
    scale, zero = sz[..., 0].double(), sz[..., 1].double()  # [G, N]
    per = group // W4A8_BLOCK
    y = (isum * xs.double()[..., None] * scale.repeat_interleave(per, 0)[None]).sum(1)
    xsum = (q.double().sum(-1) * xs.double()).view(m, k // group, per).sum(-1)
    return y + xsum @ (zero - 8 * scale)


@pytest.mark.parametrize("n,kdim,group", [(64, 64, 32), (128, 256, 64), (192, 576, 32), (128, 1024, 128)])
def test_kernel_is_the_int8_block_product_rescaled(k, n, kdim, group):
    """Every pass size (1-6 rows, both halves' passes from 3) and a span past 48 rows; an all-zero block and a row
    of outliers: within the bf16 result's rounding (2**-8 relative) of the float64 reference."""
    qt, w, szb, sz = _weight(n, kdim, group)
    for rows in (1, 2, 3, 5, 6, 7, 13, 50):
        x = torch.randn(rows, kdim).bfloat16()
        x[0, :W4A8_BLOCK] = 0
        x[-1, 3] = 300.0
        y = k.int4_gemm(x, w, szb, group, True, False, None, True)
        ref = _reference(x, qt, sz, group)
        err = (y.double() - ref).abs() / (ref.abs() + 1e-3)
        assert err.max().item() < 2**-8 + 1e-4, (n, kdim, group, rows)


def test_int4_result_is_as_close_to_the_exact_product_as_the_quantized_x_is(k):
    """Against x W^T in float64 (W as held: scale (q - 8) + zero, zero-mean like trained weights), the kernel's error
    is the int8 rounding of x itself (x' W^T) plus the bf16 output's: the offsets take x's rounding too, so it
    cancels instead of adding (with the bf16 x's own sums in the offsets this error was twice x' W^T's)."""
    n, kdim, group = 256, 576, 32
    qt, w, szb, sz = _weight(n, kdim, group, seed=5)
    scale, zero = sz[..., 0].double().t(), sz[..., 1].double().t()  # [N, G]: the kernel's bf16 pairs
    wd = ((qt.unpacked().double() - 8).view(n, -1, group) * scale[..., None] + zero[..., None]).view(n, kdim)
    x = (torch.randn(16, kdim) * torch.rand(16, kdim).pow(4) * 4).bfloat16()  # heavy-tailed, as activations
    exact = x.double() @ wd.t()
    q, xs = _x8(x)
    quantized = (q.double() * xs.double()[..., None]).view(16, kdim) @ wd.t()
    y = k.int4_gemm(x, w, szb, group, True, False, None, True).double()
    floor = (quantized - exact).norm().item()
    assert floor > 0.005 * exact.norm().item()  # the int8 rounding is there to measure

    def bound(err: float) -> bool:
        return err < 1.1 * floor + 2**-9 * exact.norm().item()  # bf16 output rounding: under 2**-9 RMS

    assert bound((y - exact).norm().item())
    # the bound tells the arithmetics apart: offsets from the bf16 x's own sums (in float64) fall outside it
    own_sums = quantized + (x.double() - (q.double() * xs.double()[..., None]).view(16, kdim)).view(
        16, kdim // group, group).sum(-1) @ (zero - 8 * scale).t()
    assert not bound((own_sums - exact).norm().item())


@pytest.mark.parametrize("n,kdim", [(16, 32), (70, 96), (576, 576), (33, 1536)])
def test_int8_kernel_is_the_int8_block_product_rescaled(k, n, kdim):
    """int8 weights (a scale a row) in pack_x8's layout: panels of 16 weight rows (N not a multiple of 16), every
    pass size up to 12 and spans of 48 rows; within the bf16 result's rounding of the float64 reference sum_b
    (integer sum * x scale) * weight scale."""
    torch.manual_seed(n + kdim)
    qt = quantize_int8(torch.randn(n, kdim))
    w, ws = qt.data, qt.scales.view(-1).float()
    wv, negcorr = pack_x8(w)
    for rows in (1, 2, 5, 12, 13, 50):
        x = torch.randn(rows, kdim).bfloat16()
        x[0, :W4A8_BLOCK] = 0
        x[-1, 3] = 300.0
        y = k.int8_x8_gemm(x, wv, negcorr, ws)
        q, xs = _x8(x)
        isum = torch.einsum("mbk,nbk->mbn", q.double(), w.double().view(n, kdim // W4A8_BLOCK, W4A8_BLOCK))
        ref = (isum * xs.double()[..., None]).sum(1) * ws.double()
        err = (y.double() - ref).abs() / (ref.abs() + 1e-3)
        assert err.max().item() < 2**-8 + 1e-4, (n, kdim, rows)


def test_results_do_not_depend_on_the_thread_count(k):
    """One thread and two split the work differently (blocks, spans, panels): the same bits."""
    _, w, szb, _ = _weight(192, 576, 32, seed=3)
    wv, negcorr = pack_x8(quantize_int8(torch.randn(70, 576)).data)
    ws = torch.rand(70)
    x = torch.randn(53, 576).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y4, y8 = k.int4_gemm(x, w, szb, 32, True, False, None, True), k.int8_x8_gemm(x, wv, negcorr, ws)
        torch.set_num_threads(1)
        assert torch.equal(k.int4_gemm(x, w, szb, 32, True, False, None, True), y4)
        assert torch.equal(k.int8_x8_gemm(x, wv, negcorr, ws), y8)
    finally:
        torch.set_num_threads(threads)


def test_kernel_refuses_what_it_cannot_take(k):
    """Groups not a multiple of its 32-input blocks, 5-bit weights (the fifth bits) and int8 weights of K not a
    multiple of 32 are refused by name."""
    qt, w, szb, _ = _weight(64, 64, 16)
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match=r"int4_gemm: int8_x=True needs groups a multiple of 32, got 16"):
        k.int4_gemm(x, w, szb, 16, True, False, None, True)
    high = torch.zeros(64 * 64 // 8, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"int4_gemm: int8_x=True takes 4-bit weights only \(high given\)"):
        k.int4_gemm(x, w, szb, 16, True, False, high, True)
    wv, negcorr = pack_x8(quantize_int8(torch.randn(20, 64)).data)
    x, ws = torch.randn(2, 64).bfloat16(), torch.ones(20)
    with pytest.raises(RuntimeError, match=r"int8_x8_gemm: x's K must be a multiple of 32, got K = 48"):
        k.int8_x8_gemm(x[:, :48], wv, negcorr, ws)
    with pytest.raises(RuntimeError, match=r"int8_x8_gemm: wv must be \[2, 16, 16, 4\] \(N = 20 from scales, K = 64"):
        k.int8_x8_gemm(x, wv[:1], negcorr, ws)
    with pytest.raises(RuntimeError, match=r"int8_x8_gemm: negcorr must be Int, got Long"):
        k.int8_x8_gemm(x, wv, negcorr.long(), ws)


def test_layers_take_int8_activations_only_where_asked_and_the_kernel_runs():
    """A QuantizedMatmul asked for int8 activations runs them on the int4 and int8 paths where the native kernels
    are built and AMX does not run (held as 'int4 g32 a8' / 'int8 a8'); groups of 16 and K = 48 keep bf16 ones."""
    native = cpu_kernels()
    qt = quantize_int4(torch.randn(128, 256) * 0.05, 32)
    plain, asked = QuantizedMatmul("int4", qt), QuantizedMatmul("int4", qt, int8_activations=True)
    assert not plain.int8_x
    from ember import envs

    runs = (native is not None and native.has_w4a8() and not (envs.cpu_amx_enabled() and native.has_amx()))
    assert asked.int8_x == runs
    x = torch.randn(4, 256).bfloat16()
    ref = x.float() @ qt.dequantize().t()
    assert ((asked(x).float() - ref).norm() / ref.norm()).item() < 0.03
    assert not QuantizedMatmul("int4", quantize_int4(torch.randn(128, 256), 16), int8_activations=True).int8_x
    assert QuantizedMatmul("int8", quantize_int8(torch.randn(128, 256)), int8_activations=True).int8_x == runs
    assert not QuantizedMatmul("int8", quantize_int8(torch.randn(128, 48)), int8_activations=True).int8_x

    class Layer(torch.nn.Module):
        def __init__(self, mm):
            super().__init__()
            self.qmm = mm

    assert held_kinds(Layer(asked)) == {("int4 g32 a8" if runs else "int4 g32"): 128 * 256}
