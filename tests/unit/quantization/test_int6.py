"""6-bit weights (GGUF Q6_K, held as int6) on the CPU: ember's int6 pack (a 64-row block's super-blocks in one
stream: d, the int8 scales, 6-bit values four to 24 bits), each value where the kernel's byte permutation and
multishift read it; the product against a float32 matmul of the weight's own values (the reference), batch
invariant, and int8 per row where the kernel is not there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.kernels import cpu_kernels, emulated_kernels
from ember.layers.linear import Linear
from ember.quantization import QuantConfig, QuantizedMatmul, QuantizedTensor, cpu_holds_int6
from ember.quantization import kernels as qkernels
from ember.quantization.kernels import pack_cpu_int6, unpack_cpu_int6


def _int6(n: int, k: int, seed: int) -> QuantizedTensor:
    """Q6_K's form: w = d sc (q - 32), an int8 sc a group of 16, an f16 d a super-block of 256."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=g)
    sc = torch.randint(-128, 128, (n, k // 16), generator=g).float()
    d = (torch.rand(n, k // 256, generator=g) * 1e-3 + 1e-5).half().float()
    scales = d.repeat_interleave(16, dim=1) * sc
    return QuantizedTensor("int6", q, scales, -32 * scales, 16, d)


def _sc(qt: QuantizedTensor) -> torch.Tensor:
    """The int8 sc each scale is d times."""
    return (qt.scales / qt.super_scales.repeat_interleave(16, dim=1)).round().to(torch.int8)


@pytest.fixture(scope="module")
def avx512():
    """The AVX512-BF16 kernels with VBMI: this machine's, or emulated where it has not got them."""
    k = cpu_kernels()
    if k is None:
        pytest.skip("the CPU kernels could not be built on this machine")
    return k if k.has_avx512_bf16() and k.has_int6() else emulated_kernels()


def test_the_values_lie_where_the_kernel_reads_them():
    """Row 70 (block 1, column c = 6: j = 0, t = 3, its values i = 0, 1), input 5 (pair kp = 2, h = 1, so i = 1):
    bits 6..11 of the 24 at byte 24 j + 3 t = 9 of pair 2's 96 bytes, after block 1's d (256 bytes) and sc (1024)."""
    n, k = 128, 256
    q = torch.zeros(n, k, dtype=torch.uint8)
    q[70, 5] = 0b101101
    sc, d = torch.zeros(n, k // 16, dtype=torch.int8), torch.zeros(n, k // 256)
    sc[70, 0], d[70, 0] = -3, 0.5
    packed = pack_cpu_int6(q, sc, d)
    assert packed.shape == (2, 1, 256 + 1024 + 128 * 96)
    want = torch.zeros_like(packed)
    want[1, 0, 1280 + 2 * 96 + 9] = (0b101101 << 6) & 0xFF
    want[1, 0, 1280 + 2 * 96 + 10] = 0b101101 >> 2
    want[1, 0, 6 * 4:6 * 4 + 4] = torch.tensor([0.5]).view(torch.uint8)  # d of column 6
    want[1, 0, 256 + 6] = torch.tensor([-3], dtype=torch.int8).view(torch.uint8)  # group 0's sc, column 6
    assert torch.equal(packed, want)
    qt = _int6(192, 512, 1)
    sc = _sc(qt)
    got = unpack_cpu_int6(pack_cpu_int6(qt.data, sc, qt.super_scales), 192, 512)
    assert all(torch.equal(a, b) for a, b in zip(got, (qt.data, sc, qt.super_scales)))


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("n,k", [(64, 256), (192, 512), (128, 1280)])
def test_the_kernel_multiplies_the_weights_own_values(avx512, n, k, invariant):
    """1 row, a few (the batch-invariant passes) and 130 (the panel path when not invariant), against a float32
    matmul of the weight's values: within bf16 rounding of the activations and the output."""
    qt = _int6(n, k, n + k)
    sc = _sc(qt)
    w = pack_cpu_int6(qt.data, sc, qt.super_scales)
    x = torch.randn(130, k, generator=torch.Generator().manual_seed(7)).bfloat16()
    ref = F.linear(x.float(), qt.dequantize(torch.float32))
    for rows in (1, 5, 130):
        y = avx512.int6_gemm(x[:rows], w, invariant).float()
        assert ((y - ref[:rows]).norm() / ref[:rows].norm()).item() < 4e-3, rows
    wrong = pack_cpu_int6(qt.data & 0xF, sc, qt.super_scales)  # the top two bits dropped: another product
    assert ((avx512.int6_gemm(x[:5], wrong, invariant).float() - ref[:5]).norm() / ref[:5].norm()).item() > 0.1


def test_rows_read_from_the_pack_are_the_weights_rows(monkeypatch):
    """An embedding lookup's rows, read from the pack where they lie (any ids, repeated, in any order, more than one
    pass of ``_INT6_ROWS``), are the weight's rows: no kernel needed."""
    monkeypatch.setattr(qkernels, "_INT6_ROWS", 5)
    qt = _int6(192, 768, 13)
    sc = _sc(qt)
    packed = pack_cpu_int6(qt.data, sc, qt.super_scales)
    ids = torch.tensor([0, 70, 191, 5, 70, 64, 127, 63, 1, 128, 2])
    assert torch.equal(qkernels.cpu_int6_rows(packed, ids, 192, 768), qt.dequantize(torch.float32)[ids])


def test_the_kernel_checks_its_arguments(avx512):
    qt = _int6(64, 256, 3)
    sc = _sc(qt)
    w = pack_cpu_int6(qt.data, sc, qt.super_scales)
    with pytest.raises(RuntimeError, match="int6_gemm: x's K = 128 must be a multiple of 256"):
        avx512.int6_gemm(torch.randn(2, 128).bfloat16(), w, True)
    with pytest.raises(RuntimeError, match="int6_gemm: w"):
        avx512.int6_gemm(torch.randn(2, 512).bfloat16(), w, True)
    with pytest.raises(RuntimeError, match="int6_gemm: w"):
        avx512.int6_gemm(torch.randn(2, 256).bfloat16(), w.view(-1)[:-1].view(1, 1, -1), True)


needs_int6 = pytest.mark.skipif(not cpu_holds_int6(64, 256),
                                reason="this CPU holds 6-bit weights as int8 (no AVX512-BF16 + VBMI kernels, or AMX)")


@needs_int6
def test_the_matmul_path_holds_the_weight_at_its_size_and_gives_its_values():
    qt = _int6(192, 512, 5)
    mm = QuantizedMatmul("int6", qt)
    assert mm.path == "cpu-int6"
    assert sum(t.numel() * t.element_size() for t in mm.tensors()) == 192 * 512 * 6.625 / 8
    assert torch.equal(mm.dequantized(torch.float32), qt.dequantize(torch.float32))  # exactly the file's values
    x = torch.randn(9, 512).bfloat16()
    together = mm(x)
    assert torch.equal(torch.cat([mm(x[i:i + 1]) for i in range(9)]), together)
    ref = F.linear(x.float(), qt.dequantize(torch.float32))
    assert ((together.float() - ref).norm() / ref.norm()).item() < 4e-3
    with pytest.raises(ValueError, match="int6 matmul needs an int6 weight"):
        QuantizedMatmul("int6", QuantizedTensor("int8", qt.data.to(torch.int8), qt.scales, None, 16))
    with pytest.raises(ValueError, match="not int8 multiples of its super_scales"):
        QuantizedMatmul("int6", QuantizedTensor("int6", qt.data, qt.scales + 1e-3, qt.offsets, 16, qt.super_scales))


@pytest.mark.parametrize("holds", [True, False])
def test_a_mixed_layer_keeps_its_6_bit_parts_where_the_cpu_takes_them(monkeypatch, holds):
    """A fused projection of a 4-bit and a 6-bit part (Q4_K_M's q / k and v): int4 + int6 where
    ``cpu_holds_int6``, else the 6-bit part as int8 per row; either way the product of the parts' own values."""
    if holds and not cpu_holds_int6(64, 256):
        pytest.skip("this CPU holds 6-bit weights as int8")
    monkeypatch.setattr("ember.layers.linear.cpu_holds_int6", lambda *a: holds)
    from ember.quantization import quantize_int4

    four, six = quantize_int4(torch.randn(128, 256), 32), _int6(64, 256, 9)
    layer = Linear(256, 192, bias=False, dtype=torch.bfloat16, quant=QuantConfig("int4", 32, mixed=True))
    layer.load_weight(four, 0)
    layer.load_weight(six, 128)
    layer.finalize(torch.device("cpu"), prepack=False)
    assert layer.kind == ("int4+int6" if holds else "int4+int8")
    x = torch.randn(3, 256).bfloat16()
    ref = F.linear(x.float(), torch.cat([four.dequantize(), six.dequantize()]))
    assert ((layer(x).float() - ref).norm() / ref.norm()).item() < 0.01


def test_no_int6_path_where_the_kernels_are_missing(monkeypatch):
    monkeypatch.setattr(qkernels, "_ember_gemm", lambda: None)
    assert not cpu_holds_int6(64, 256)
    assert qkernels.select_path("int6", torch.device("cpu"), 64, 256, 16) == "portable"


@pytest.mark.parametrize("holds", [True, False])
def test_a_q6_k_table_is_the_embedding_and_the_tied_lm_head_at_its_size(monkeypatch, holds):
    """A Q6_K embedding table in the layout as stored, where the CPU takes int6: one int6 pack serves both the tied LM
    head's matmul and the embedding's lookups (rows read from the pack: the file's values); else int8 per row, as
    other block types (and as in every layout asked for: ``as_stored`` False)."""
    if holds and not cpu_holds_int6(128, 256):
        pytest.skip("this CPU holds 6-bit weights as int8")
    monkeypatch.setattr("ember.layers.embedding.cpu_holds_int6", lambda *a: holds)
    from ember.layers.embedding import LMHead, VocabEmbedding

    table = _int6(128, 256, 11)
    emb = VocabEmbedding(128, 256, torch.float32, quantized=True, as_stored=True)
    head = LMHead(128, 256, torch.float32, tied_to=emb, quantized=True, as_stored=True)
    emb.load_weight(table)
    for layer in (emb, head):
        layer.finalize(torch.device("cpu"), prepack=False)
    ids = torch.tensor([3, 70, 127, 3, 64])
    rows, logits = emb(ids), head(torch.randn(4, 256).bfloat16().float())
    assert logits.shape == (4, 128)
    if holds:
        assert emb.qt is None and head.qmm is emb.table6 and head.qmm.path == "cpu-int6"
        assert torch.equal(rows, table.dequantize(torch.float32)[ids])
    else:
        assert emb.table6 is None and emb.qt.kind == "int8" and head.qmm.method == "int8"
        assert torch.allclose(rows, table.dequantize(torch.float32)[ids], atol=table.scales.abs().max().item() * 0.6)
