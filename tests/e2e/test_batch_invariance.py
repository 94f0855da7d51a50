"""Batch invariance (docs/batch_invariance.md): a row's result does not depend on the rows beside it, so a greedy
request gets the same tokens and logprobs, to the bit, alone, in any batch, chunked, from the prefix cache, after
preemption and as one of n samples.

Kernels are checked row by row against the same rows computed alone; engines through ``invariance.check``. The
AVX512-BF16 kernels run natively where the machine has them and emulated elsewhere (``emulated_kernels``: built
once, a few minutes, then cached), so every CI machine checks the default path of AVX-512 machines too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import TESTS, default_gguf, save_random_model
from internals import worker_of
from invariance import check

from ember import LLM, ConfigError, SamplingParams, envs
from ember.kernels import cpu_kernels, emulated_kernels
from ember.layers import linear as linear_module
from ember.layers.embedding import LMHead, VocabEmbedding
from ember.layers.linear import Linear, MergedLinear, mkldnn_prepack_available
from ember.quantization import QuantizedMatmul
from ember.quantization.kernels import (_scale_zeros, block_scale_zeros, pack_cpu_int4, pack_cpu_int5_high,
                                        pack_cpu_int6, pack_x8)
from ember.quantization.tensor import QuantizedTensor, quantize_int4, quantize_int8

HERE = TESTS


def _native_avx512() -> bool:
    k = cpu_kernels()
    return k is not None and k.has_avx512_bf16()


def _rows_alone(fn, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])


ROW_COUNTS = (2, 3, 4, 5, 7, 11, 12, 13, 47, 48, 49, 64, 127, 128, 130)


@pytest.mark.parametrize("amx", [False, True], ids=["avx512", "amx"])
@pytest.mark.parametrize("n,k,group", [(192, 256, 64), (128, 96, 32), (64, 576, 32), (64, 256, 128)])
def test_int4_kernel_rows_do_not_depend_on_the_rows_beside_them(avx512, n, k, group, amx):
    """Both int4 paths: AVX512-BF16 chains, and AMX tile products (at every row count, rows in tiles of 16 and a
    shorter last one) where the CPU has them; where it has not, asking for AMX gives the AVX512 path's bits."""
    g = torch.Generator().manual_seed(n + k)
    qt = quantize_int4(torch.randn(n, k, generator=g), group)
    w, sz = pack_cpu_int4(qt.unpacked()), block_scale_zeros(_scale_zeros(qt))
    x = torch.randn(130, k, generator=g).bfloat16()
    alone = _rows_alone(lambda r: avx512.int4_gemm(r, w, sz, group, True, amx), x)
    if amx and not avx512.has_amx():
        assert torch.equal(alone, _rows_alone(lambda r: avx512.int4_gemm(r, w, sz, group, True, False), x))
    for m in ROW_COUNTS:
        assert torch.equal(avx512.int4_gemm(x[:m], w, sz, group, True, amx), alone[:m]), f"{m} rows"
        assert torch.equal(avx512.int4_gemm(x[-m:], w, sz, group, True, amx), alone[-m:]), f"last {m} rows"
    ref = F.linear(x.float(), qt.dequantize(torch.float32))
    assert ((alone.float() - ref).norm() / ref.norm()).item() < 4e-3  # bf16 activations and output


@pytest.mark.parametrize("n,k,group", [(192, 256, 64), (128, 96, 32), (64, 576, 32), (64, 256, 128)])
def test_w4a8_kernel_rows_do_not_depend_on_the_rows_beside_them(avx512, n, k, group):
    """int4 weights against int8 activations (``int8_x``, w4a8.cpp; emulated where this build lacks VNNI / VBMI):
    passes of 1-6 rows over half a block (both halves up to 2 rows), spans of 48."""
    kernels = avx512 if avx512.has_w4a8() else emulated_kernels()
    g = torch.Generator().manual_seed(n + k + 1)
    qt = quantize_int4(torch.randn(n, k, generator=g), group)
    w, sz = pack_cpu_int4(qt.unpacked()), block_scale_zeros(_scale_zeros(qt))
    x = torch.randn(130, k, generator=g).bfloat16()
    alone = _rows_alone(lambda r: kernels.int4_gemm(r, w, sz, group, True, False, None, True), x)
    for m in ROW_COUNTS:
        assert torch.equal(kernels.int4_gemm(x[:m], w, sz, group, True, False, None, True), alone[:m]), f"{m} rows"
        assert torch.equal(kernels.int4_gemm(x[-m:], w, sz, group, True, False, None, True), alone[-m:]), \
            f"last {m} rows"
    ref = F.linear(x.float(), qt.dequantize(torch.float32))
    assert ((alone.float() - ref).norm() / ref.norm()).item() < 0.03  # int8 activations per 32 inputs


@pytest.mark.parametrize("n,k", [(192, 256), (77, 96), (130, 576)])
def test_int8_kernel_with_int8_activations_rows_do_not_depend_on_the_rows_beside_them(avx512, n, k):
    """int8 weights against int8 activations (``int8_x8_gemm``, w8a8_blocks.cpp, on ``pack_x8``'s layout; emulated
    where this build lacks VNNI / VBMI): passes of 1-12 rows against a 16-row panel, spans of 48."""
    kernels = avx512 if avx512.has_w4a8() else emulated_kernels()
    g = torch.Generator().manual_seed(n * k + 1)
    qt = quantize_int8(torch.randn(n, k, generator=g))
    s, (wv, nc) = qt.scales.view(-1).float(), pack_x8(qt.data)
    x = torch.randn(130, k, generator=g).bfloat16()
    alone = _rows_alone(lambda r: kernels.int8_x8_gemm(r, wv, nc, s), x)
    for m in ROW_COUNTS:
        assert torch.equal(kernels.int8_x8_gemm(x[:m], wv, nc, s), alone[:m]), f"{m} rows"
        assert torch.equal(kernels.int8_x8_gemm(x[-m:], wv, nc, s), alone[-m:]), f"last {m} rows"
    ref = F.linear(x.float(), qt.dequantize(torch.float32))
    assert ((alone.float() - ref).norm() / ref.norm()).item() < 0.03  # int8 activations per 32 inputs


@pytest.mark.parametrize("n,k", [(192, 256), (64, 576)])
def test_int5_kernel_rows_do_not_depend_on_the_rows_beside_them(avx512, n, k):
    """5-bit weights (GGUF Q5_0 / Q5_1 / Q5_K): the int4 chains with the fifth bits added (``int5_high``)."""
    g = torch.Generator().manual_seed(n * k)
    q = torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=g)
    d = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    qt = QuantizedTensor("int5", q, d, -16 * d, 32)
    w, sz, high = pack_cpu_int4(q & 0xF), block_scale_zeros(_scale_zeros(qt)), pack_cpu_int5_high(q)
    x = torch.randn(130, k, generator=g).bfloat16()
    alone = _rows_alone(lambda r: avx512.int4_gemm(r, w, sz, 32, True, False, high), x)
    for m in ROW_COUNTS:
        assert torch.equal(avx512.int4_gemm(x[:m], w, sz, 32, True, False, high), alone[:m]), f"{m} rows"
        assert torch.equal(avx512.int4_gemm(x[-m:], w, sz, 32, True, False, high), alone[-m:]), f"last {m} rows"
    ref = F.linear(x.float(), qt.dequantize(torch.float32))
    assert ((alone.float() - ref).norm() / ref.norm()).item() < 4e-3


@pytest.mark.parametrize("n,k", [(192, 256), (64, 768)])
def test_int6_kernel_rows_do_not_depend_on_the_rows_beside_them(avx512, n, k):
    """6-bit weights (GGUF Q6_K): one chain a group of 16 at every row count."""
    if not avx512.has_int6():
        pytest.skip("int6_gemm needs AVX512-VBMI, which this build has not got")
    g = torch.Generator().manual_seed(n * k)
    q = torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=g)
    sc = torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8)
    d = torch.rand(n, k // 256, generator=g) * 1e-3
    w = pack_cpu_int6(q, sc, d)
    x = torch.randn(130, k, generator=g).bfloat16()
    alone = _rows_alone(lambda r: avx512.int6_gemm(r, w), x)
    for m in ROW_COUNTS:
        assert torch.equal(avx512.int6_gemm(x[:m], w), alone[:m]), f"{m} rows"
        assert torch.equal(avx512.int6_gemm(x[-m:], w), alone[-m:]), f"last {m} rows"
    scale = sc.float() * d.repeat_interleave(16, dim=1)
    ref = F.linear(x.float(), ((q.float() - 32).view(n, -1, 16) * scale[..., None]).view(n, k))
    assert ((alone.float() - ref).norm() / ref.norm()).item() < 4e-3
    logits = _rows_alone(lambda r: avx512.int6_gemm(r, w, True, True), x)  # float32 out: the same sums, unrounded
    assert logits.dtype == torch.float32 and torch.equal(logits.bfloat16(), alone)
    for m in (5, 13, 130):
        assert torch.equal(avx512.int6_gemm(x[:m], w, True, True), logits[:m]), f"{m} rows"


@pytest.mark.parametrize("n,k", [(192, 256), (77, 100), (64, 32), (130, 576), (9, 40), (75, 64), (21, 4130)])
def test_int8_kernel_rows_do_not_depend_on_the_rows_beside_them(avx512, n, k):
    """Output counts that are not multiples of the kernels' blocks, inputs that are not multiples of 32; from 13 rows
    4 x 4 tiles, and pairs of weight rows where K > 4096."""
    g = torch.Generator().manual_seed(n + k)
    qt = quantize_int8(torch.randn(n, k, generator=g))
    s32 = qt.scales.view(-1).float()
    x = torch.randn(70, k, generator=g).bfloat16()
    alone = _rows_alone(lambda r: avx512.int8_gemm(r, qt.data, s32), x)
    for m in (2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 15, 17, 64, 70):
        assert torch.equal(avx512.int8_gemm(x[:m], qt.data, s32), alone[:m]), f"{m} rows"
        assert torch.equal(avx512.int8_gemm(x[-m:], qt.data, s32), alone[-m:]), f"last {m} rows"
    ref = F.linear(x.float(), qt.dequantize(torch.float32))
    assert ((alone.float() - ref).norm() / ref.norm()).item() < 4e-3
    # float32 out (logits): the same sums, not rounded to bf16, so their bf16 is the bf16 path's bits
    logits = _rows_alone(lambda r: avx512.int8_gemm(r, qt.data, s32, True, True), x)
    assert logits.dtype == torch.float32 and torch.equal(logits.bfloat16(), alone)
    for m in (2, 3, 4, 5, 8, 12, 13, 17, 70):
        assert torch.equal(avx512.int8_gemm(x[:m], qt.data, s32, True, True), logits[:m]), f"{m} rows"
    assert (logits - ref).norm() < 0.5 * (alone.float() - ref).norm()


@pytest.mark.parametrize("n,k", [(192, 256), (77, 100), (16, 64), (130, 576), (9, 40), (3000, 1500)])
def test_int8_exact_kernel_is_the_exact_product_at_every_row_count(n, k):
    """AMX machines: x in exact integer parts against int8 weights (1-4 rows on AVX512-VNNI, more on integer
    tiles). Every output is the float64 product of the weight and x on its row's grid (2^(e - 23), e the exponent
    just above the row's largest |x|) rounded to bf16, so a row's bits cannot depend on the rows beside it or on
    the path; output and input counts off the kernels' blocks, an outlier row, a row of zeros, and a NaN confined
    to its row."""
    k8 = cpu_kernels()
    if k8 is None or not k8.has_amx():
        pytest.skip("the exact int8 kernel needs AMX (Intel Sapphire Rapids or later)")
    g = torch.Generator().manual_seed(n * k)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, generator=g) / 64
    sums = w.sum(1, dtype=torch.int32)
    x = torch.randn(40, k, generator=g).bfloat16()
    x[5, k // 2] = 300.0  # an outlier: its row's other values keep their bits
    x[7] = 0
    _, e = torch.frexp(x.float().abs().amax(dim=1, keepdim=True))  # the row's largest |x| < 2^e
    step = torch.pow(2.0, (e - 23).double())
    grid = torch.round(x.double() / step) * step  # round half to even, as the kernel's conversion
    exact_f = ((grid @ w.double().t()) * scales.double()).float()  # float32 out (logits): rounded once
    exact = exact_f.bfloat16()
    for m in (1, 2, 3, 4, 5, 17, 40):
        assert torch.equal(k8.int8_exact_gemm(x[:m], w, sums, scales), exact[:m]), f"{m} rows"
        assert torch.equal(k8.int8_exact_gemm(x[-m:], w, sums, scales), exact[-m:]), f"last {m} rows"
        assert torch.equal(k8.int8_exact_gemm(x[-m:], w, sums, scales, True), exact_f[-m:]), f"last {m} rows"
    bad = x[:20].clone()
    bad[3, 1] = float("nan")
    y = k8.int8_exact_gemm(bad, w, sums, scales)
    assert y[3].isnan().all() and torch.equal(y[torch.arange(20) != 3], exact[:20][torch.arange(20) != 3])


def test_w8a8_kernel_rows_do_not_depend_on_the_rows_beside_them(avx512):
    """Integer products are exact, so the dot-product rows (up to 4) and the GEMM agree to the bit."""
    g = torch.Generator().manual_seed(8)
    qt = quantize_int8(torch.randn(160, 96, generator=g))
    x = torch.randn(40, 96, generator=g).bfloat16()
    s = qt.scales.view(-1).float()
    alone = _rows_alone(lambda r: avx512.w8a8_linear(r, qt.data, s), x)
    for m in (2, 4, 5, 17, 40):
        assert torch.equal(avx512.w8a8_linear(x[:m], qt.data, s), alone[:m]), f"{m} rows"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(77, 100), (9, 40), (130, 576), (64, 33), (17, 7)])
def test_dense_kernel_rows_do_not_depend_on_the_rows_beside_them(avx512, dtype, n, k):
    """ember's fixed-order dense GEMM (float weights of invariant layers on AVX-512 CPUs): odd output counts, inputs
    that are not multiples of 16 / 32, 1 to 130 rows. Against float64: every output's error is bounded by its
    summation depth (K / 16 + 4 float32 additions a product, 2e-5 of sum |x_k w_k| at these K), plus, for bf16, the
    one rounding of the output (2^-8 of it)."""
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(130, k, generator=g).to(dtype)
    alone = _rows_alone(lambda r: avx512.dense_gemm(r, w), x)
    assert alone.dtype == dtype and alone.shape == (130, n)
    for m in (1, *ROW_COUNTS):
        assert torch.equal(avx512.dense_gemm(x[:m], w), alone[:m]), f"{m} rows"
        assert torch.equal(avx512.dense_gemm(x[-m:], w), alone[-m:]), f"last {m} rows"
    ref = x.double() @ w.double().t()
    bound = 2e-5 * (x.double().abs() @ w.double().abs().t())
    logits = _rows_alone(lambda r: avx512.dense_gemm(r, w, True), x)  # float32 out: the sums, not rounded to bf16
    assert logits.dtype == torch.float32 and torch.equal(logits.to(dtype), alone)
    for m in (2, 3, 4, 13):
        assert torch.equal(avx512.dense_gemm(x[:m], w, True), logits[:m]), f"{m} rows"
    assert ((logits.double() - ref).abs() <= bound).all()
    if dtype == torch.bfloat16:
        bound += 2.0 ** -8 * ref.abs()
    assert ((alone.double() - ref).abs() <= bound).all()


def test_dense_kernel_edge_shapes(avx512):
    w = torch.randn(5, 20)
    assert avx512.dense_gemm(torch.randn(0, 20), w).shape == (0, 5)
    assert torch.equal(avx512.dense_gemm(torch.randn(3, 0), torch.randn(5, 0)), torch.zeros(3, 5))
    x = torch.randn(6, 40)[:, ::2]  # not contiguous
    assert torch.equal(avx512.dense_gemm(x, w), avx512.dense_gemm(x.contiguous(), w))
    with pytest.raises(RuntimeError, match="both float32 or both bf16"):
        avx512.dense_gemm(x.bfloat16(), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_kernel_gives_each_row_dense_gemm_bits_against_its_expert(avx512, dtype):
    """The MoE projection kernel: experts with no rows, 1-4 rows (the rows blocking) and more (the tiles), outputs
    that are not a multiple of a task's 64 rows; every row equals dense_gemm of it alone against its expert."""
    g = torch.Generator().manual_seed(3)
    counts = [0, 1, 2, 3, 4, 0, 5, 13, 70, 0]
    w = torch.randn(len(counts), 150, 72, generator=g).to(dtype)
    x = torch.randn(sum(counts), 72, generator=g).to(dtype)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    y = avx512.grouped_dense_gemm(x, w, offsets)
    assert y.shape == (sum(counts), 150) and y.dtype == dtype
    for e, (a, b) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        if a < b:
            assert torch.equal(y[a:b], _rows_alone(lambda r: avx512.dense_gemm(r, w[e]), x[a:b])), f"expert {e}"
    assert avx512.grouped_dense_gemm(x[:0], w, torch.zeros(len(counts) + 1, dtype=torch.long)).shape == (0, 150)
    for bad, message in ((offsets.flip(0), "from 0"), (torch.tensor([0, 5, 3, *offsets[3:].tolist()]), "decrease"),
                         (offsets[:-1], r"int64 \[E \+ 1\]"), (offsets.int(), "int64")):
        with pytest.raises(RuntimeError, match=message):
            avx512.grouped_dense_gemm(x, w, bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_experts_run_grouped_with_the_bits_of_one_call_each(avx512, monkeypatch, dtype):
    """A SparseMoE of float experts finalized on a CPU with AVX512-BF16 kernels stacks them (each expert's Linear a
    view of its slice, no packed copy) and runs two grouped calls; its output equals, to the bit, the same layer
    running one Linear call an expert, at 1 to 40 tokens, and each token's row is the same alone (invariance)."""
    from ember.distributed import ParallelContext
    from ember.layers import moe as moe_module
    from ember.layers.activation import silu_and_mul
    from ember.layers.moe import MoEShape, SparseMoE

    monkeypatch.setattr(linear_module, "cpu_kernels", lambda: avx512)
    monkeypatch.setattr(moe_module, "cpu_kernels", lambda: avx512)
    g = torch.Generator().manual_seed(9)
    shape = MoEShape(num_experts=8, top_k=3, intermediate_size=40, normalize_top_k=True, shared_intermediate_size=24)
    layers = []
    for _ in range(2):
        layer = SparseMoE(64, shape, silu_and_mul, dtype, None, ParallelContext())
        torch.manual_seed(11)  # both layers get the same weights
        for p in layer.parameters():
            p.data.copy_(torch.randn(p.shape) * 0.2)
        layers.append(layer)
    grouped, looped = layers
    for m in grouped.modules():  # as the loader does: the MoE first, then its children
        if hasattr(m, "finalize"):
            m.finalize(torch.device("cpu"), mkldnn_prepack_available(dtype), batch_invariant=True)
    for m in looped.modules():
        if m is not looped and hasattr(m, "finalize"):
            m.finalize(torch.device("cpu"), mkldnn_prepack_available(dtype), batch_invariant=True)
    assert grouped.grouped is avx512 and looped.grouped is None
    expert = grouped.experts[5].gate_up_proj
    assert expert.weight.data_ptr() == grouped.w_gate_up[5].data_ptr() and expert.prepacked is None
    x = torch.randn(40, 64, generator=g).to(dtype)
    for t in (1, 2, 5, 40):
        assert torch.equal(grouped(x[:t]), looped(x[:t])), f"{t} tokens"
    assert torch.equal(_rows_alone(grouped, x), grouped(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_layers_of_an_invariant_model_use_the_dense_kernel_on_avx512(avx512, monkeypatch, dtype):
    """Linear (and its fused subclasses) and the tied LM head, finalized batch-invariant on a CPU whose kernels
    have AVX512-BF16 (this machine's, or the emulated module put in their place), run ``dense_gemm``, bias added
    after; batch_invariant=False keeps oneDNN / F.linear."""
    monkeypatch.setattr(linear_module, "cpu_kernels", lambda: avx512)
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 100, generator=g).to(dtype)
    merged = MergedLinear(100, {"gate": 40, "up": 37}, True, dtype)
    merged.weight.data.copy_(torch.randn(77, 100, generator=g))
    merged.bias.data.copy_(torch.randn(77, generator=g))
    merged.finalize(cpu, mkldnn_prepack_available(dtype), batch_invariant=True)
    assert merged.dense is avx512 and merged.prepacked is None
    y = merged(x)
    assert torch.equal(y, avx512.dense_gemm(x, merged.weight) + merged.bias)
    assert torch.equal(_rows_alone(merged, x), y)

    emb = VocabEmbedding(50, 100, dtype)
    emb.load_weight(torch.randn(50, 100, generator=g))
    head = LMHead(50, 100, dtype, tied_to=emb)
    for module in (emb, head):
        module.finalize(cpu, mkldnn_prepack_available(dtype), batch_invariant=True)
    assert head.dense is avx512
    logits = head(x)
    # float32 sums as the kernel writes them for logits (bf16: not rounded to bf16 first)
    assert logits.dtype == torch.float32 and torch.equal(logits, avx512.dense_gemm(x, emb.weight, True))
    assert torch.equal(logits.to(dtype), avx512.dense_gemm(x, emb.weight))

    variant = Linear(100, 77, False, dtype)
    variant.weight.data.copy_(merged.weight)
    variant.finalize(cpu, mkldnn_prepack_available(dtype), batch_invariant=False)
    assert variant.dense is None and (variant.prepacked is not None) == mkldnn_prepack_available(dtype)
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # bf16: both round the same float32 sum once
    torch.testing.assert_close(variant(x).float(), avx512.dense_gemm(x, variant.weight).float(), rtol=tol, atol=tol)


def test_float_layers_keep_onednn_where_the_kernels_have_no_avx512(monkeypatch):
    """An AVX2 machine (oneDNN's fp32 rows are invariant there, measured), a CUDA layer or fp16 weights: no dense
    kernel."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(linear_module, "cpu_kernels", lambda: None)
    assert linear_module.dense_kernels(cpu, torch.float32, True) is None

    class Avx2:
        @staticmethod
        def has_avx512_bf16() -> bool:
            return False

    monkeypatch.setattr(linear_module, "cpu_kernels", lambda: Avx2)
    assert linear_module.dense_kernels(cpu, torch.float32, True) is None
    monkeypatch.setattr(Avx2, "has_avx512_bf16", staticmethod(lambda: True))
    assert linear_module.dense_kernels(cpu, torch.float32, True) is Avx2
    assert linear_module.dense_kernels(cpu, torch.bfloat16, True) is Avx2
    assert linear_module.dense_kernels(cpu, torch.float16, True) is None
    assert linear_module.dense_kernels(cpu, torch.float32, False) is None
    assert linear_module.dense_kernels(torch.device("cuda"), torch.float32, True) is None


def _attention_cases(kernels, dtype, heads, kv_heads, d, bs, ctx=100):
    g = torch.Generator().manual_seed(heads * d + bs)
    blocks = -(-ctx // bs) + 3
    kc = torch.randn(blocks, bs, kv_heads, d, generator=g).to(dtype)
    vc = torch.randn(blocks, bs, kv_heads, d, generator=g).to(dtype)
    table = torch.randperm(blocks, generator=g)
    q = (torch.randn(ctx, heads, d, generator=g) * 2).to(dtype)
    for window in (0, 37):
        fresh = kernels.paged_prefill_attention(q, kc, vc, table, ctx, window, d ** -0.5)
        yield window, "a chunk after cached context", kernels.paged_prefill_attention(
            q[-40:], kc, vc, table, ctx, window, d ** -0.5), fresh[-40:]
        yield window, "a one-token chunk", kernels.paged_prefill_attention(
            q[59:60], kc, vc, table, 60, window, d ** -0.5), fresh[59:60]
        for n in (5, 9, 32, 33):  # drafted spans (up to 32 tokens: one work item a KV head), and past them
            yield window, f"a {n}-token chunk", kernels.paged_prefill_attention(
                q[90 - n:90], kc, vc, table, 90, window, d ** -0.5), fresh[90 - n:90]
        lens = torch.arange(1, ctx + 1)
        decode = kernels.paged_decode_attention(q, kc, vc, table[None].expand(ctx, -1).contiguous(), lens, window,
                                                d ** -0.5)
        yield window, "decode rows", decode, fresh
        order = torch.randperm(ctx, generator=g)[:17]  # a decode batch in another order and size
        yield window, "a shuffled decode batch", kernels.paged_decode_attention(
            q[order], kc, vc, table[None].expand(17, -1).contiguous(), lens[order], window, d ** -0.5), fresh[order]
        for i in (0, 36, ctx - 1):  # one sequence alone (fewer KV heads than threads: its layout split over them)
            yield window, f"decode row {i} alone", kernels.paged_decode_attention(
                q[i:i + 1], kc, vc, table[None], lens[i:i + 1], window, d ** -0.5), fresh[i:i + 1]


@pytest.mark.parametrize("heads,kv_heads,d,bs", [(9, 3, 64, 16), (14, 2, 64, 16), (4, 4, 128, 32), (8, 1, 64, 8),
                                                (4, 1, 256, 16), (8, 2, 256, 32)])
def test_avx512_attention_gives_a_query_the_same_bits_in_decode_prefill_and_chunks(avx512, heads, kv_heads, d, bs):
    for window, case, got, want in _attention_cases(avx512, torch.bfloat16, heads, kv_heads, d, bs):
        assert torch.equal(got, want), f"{case}, window {window}"


@pytest.mark.parametrize("dtype,d", [(torch.float32, 64), (torch.float32, 48), (torch.bfloat16, 48),
                                     (torch.float16, 32)])
def test_portable_attention_gives_a_query_the_same_bits_in_decode_prefill_and_chunks(dtype, d):
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels could not be built on this machine")
    for window, case, got, want in _attention_cases(kernels, dtype, 6, 2, d, 16):
        assert torch.equal(got, want), f"{case}, window {window}"


@pytest.mark.parametrize("method", ["int8", "int4", "w8a8"])
def test_quantized_matmul_rows_do_not_depend_on_the_batch(method):
    """The matmul paths as layers use them on this machine (ember's kernels or torch's packed ops): no switch to
    another kernel at any row count."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(192, 256, generator=g)
    mm = QuantizedMatmul(method, quantize_int4(w, 64) if method == "int4" else quantize_int8(w))
    x = torch.randn(200, 256, generator=g).bfloat16()
    alone = _rows_alone(mm, x)
    for m in (2, 5, 127, 128, 200):
        assert torch.equal(mm(x[:m]), alone[:m]), f"{m} rows"
    # the opt-out's kernels (its dense matmul from 128 rows, float32 where bf16 matmuls are slow) compute the same
    # product within bf16 rounding
    fast = QuantizedMatmul(method, quantize_int4(w, 64) if method == "int4" else quantize_int8(w),
                           batch_invariant=False)
    for m in (5, 200):
        got = fast(x[:m])
        assert got.dtype == torch.bfloat16 and got.shape == (m, 192)
        want = alone[:m].float()
        assert ((got.float() - want).norm() / want.norm()).item() < 1e-2, f"{m} rows"


# ----- engines -----

@pytest.fixture(scope="module")
def quantizable_model(tmp_path_factory, tokenizer_dir) -> str:
    """Head size 64 (the AVX512 attention kernels' shape), widths the int4 / int8 kernels take, a small vocabulary
    (prompts are random ids)."""
    return save_random_model("LlamaConfig", str(tmp_path_factory.mktemp("inv")), tokenizer_dir, hidden_size=256,
                             intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
                             tie_word_embeddings=True)


def test_default_model_answers_the_same_whatever_runs_beside_it():
    """The default model with default settings (int4 kernels and bf16 on AVX512-BF16 CPUs, float32 elsewhere)."""
    try:
        model = default_gguf()
    except ConfigError as e:
        pytest.skip(f"the default model is not installed: {e}")
    assert check(model) == []


@pytest.mark.parametrize("quantization", ["int4", "int8", "w8a8", "int4-a8"])
def test_quantized_model_answers_the_same_whatever_runs_beside_it(quantizable_model, quantization):
    """Weights quantized, the LM head int8, bf16 activations (int4-a8: int4 against int8 activations, the w4a8
    kernel): the AVX512-BF16 kernels, emulated in a process of their own where this machine has no AVX-512 (slow, so
    fewer and smaller batches there, and int4 alone: the default of AVX-512 machines; the int8, w8a8 and w4a8
    kernels' rows are checked under emulation in their unit tests)."""
    settings = dict(quantization=quantization.removesuffix("-a8"), quantize_embeddings=True, dtype="bfloat16",
                    max_model_len=256, int8_activations=quantization.endswith("-a8"))
    if quantization.endswith("-a8"):
        native = cpu_kernels()
        if native is None or not native.has_w4a8() or (envs.cpu_amx_enabled() and native.has_amx()):
            pytest.skip("int8 activations run natively only (AVX512-BF16, VNNI and VBMI, without AMX); the kernels' "
                        "rows are checked under emulation above")
        llm = LLM(quantizable_model, **settings)
        held = llm.model_info.quantization
        llm.shutdown()
        kinds = [part.rsplit(" (", 1)[0] for part in held.split(" + ")]
        assert kinds == ["int4 g128 a8", "int8 a8"], held  # every weight takes them, the int8 LM head too
    if _native_avx512():
        assert check(quantizable_model, **settings) == []
        return
    if cpu_kernels() is None:
        pytest.skip("the CPU kernels could not be built on this machine")
    if quantization != "int4":
        pytest.skip(f"{quantization} end to end runs on AVX-512 machines only (emulated, a run takes minutes); its "
                    "kernel's rows are checked under emulation here")
    emulated_kernels()  # built here (under the test's timeout) rather than inside the subprocess
    env = dict(os.environ, EMBER_EMULATE_AVX512="1")
    run = subprocess.run([sys.executable, os.path.join(HERE, "invariance.py"), quantizable_model,
                          json.dumps(settings | {"sizes": [2, 24]})], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == []


def test_split_model_answers_the_same_whatever_runs_beside_it(quantizable_model):
    """Two tensor-parallel ranks: each rank's rows are invariant and the all-reduce adds two partial sums, so the
    split model is invariant too (compared with its own runs: a split sums in another order than one rank)."""
    assert check(quantizable_model, sizes=(8,), dtype="float32", tensor_parallel_size=2, max_model_len=256) == []


def test_the_near_tie_chat_answers_the_same_alone_batched_cached_and_streamed():
    """The issue's example: a near tie at the first token once moved with the batch shape and with prefix hits."""
    try:
        model = default_gguf()
    except ConfigError as e:
        pytest.skip(f"the default model is not installed: {e}")
    llm = LLM(model)
    try:
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        params = SamplingParams(temperature=0, max_tokens=24)
        alone = llm.chat(msgs, params)[0].outputs[0].text
        assert [o.outputs[0].text for o in llm.chat([msgs] * 4, params)] == [alone] * 4
        assert llm.chat(msgs, params)[0].outputs[0].text == alone  # its prompt blocks are cached by now
        prompt = llm.client.chat_prompt(msgs)
        streamed = "".join(d.outputs[0].text for d in llm.stream({"prompt_token_ids": prompt}, params))
        assert streamed == alone
    finally:
        llm.shutdown()


def test_batch_invariant_is_a_bool_and_false_still_serves(quantizable_model):
    with pytest.raises(ConfigError, match="batch_invariant"):
        LLM(quantizable_model, batch_invariant="yes")
    llm = LLM(quantizable_model, batch_invariant=False, quantization="int4", max_model_len=256)
    try:
        assert worker_of(llm).attention_backend.batch_invariant is False
        out = llm.generate([[5, 6, 7]] * 3, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    finally:
        llm.shutdown()
