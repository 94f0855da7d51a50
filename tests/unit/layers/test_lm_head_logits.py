"""An int8 LM head's logits in float32 as its kernel sums them, not rounded to bf16: at |logit| ~ 20 bf16 steps by
0.125, so two tokens a tenth of a logit apart tie and a greedy step takes the lower id (SmolLM2 answered "What is
the capital of France?" with "L'Étoile" on an AMX machine, against transformers' "The capital ... Paris")."""

from __future__ import annotations

import pytest
import torch

from ember.layers.embedding import LMHead, VocabEmbedding
from ember.quantization import quantize_int8
from ember.quantization import kernels as qkernels


def _int8_head(dtype: torch.dtype, g: torch.Generator, invariant: bool = True):
    """A tied LM head over a random int8 table of 300 x 128, finalized for the CPU; (head, table)."""
    table = quantize_int8(torch.randn(300, 128, generator=g))
    emb = VocabEmbedding(300, 128, dtype, quantized=True)
    head = LMHead(300, 128, dtype, tied_to=emb, quantized=True)
    emb.load_weight(table)
    for layer in (emb, head):
        layer.finalize(torch.device("cpu"), prepack=False, batch_invariant=invariant)
    return head, table


@pytest.mark.parametrize("invariant", [True, False])
def test_an_int8_head_writes_float32_logits_where_its_kernel_can(invariant):
    g = torch.Generator().manual_seed(3)
    head, table = _int8_head(torch.bfloat16, g, invariant)
    hidden = (torch.randn(5, 128, generator=g) * 4).bfloat16()
    logits = head(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (5, 300)
    ref = hidden.double() @ table.dequantize(torch.float64).t()
    off_grid = (logits != logits.bfloat16().float()).float().mean().item()
    exact = head.qmm.path == "cpu-int8" and head.qmm.impl.row_sums is not None  # AMX: at every setting
    if (invariant or exact) and head.qmm.path == "cpu-int8" and qkernels._ember_gemm() is not None:
        # ember's int8 kernels (AVX512-BF16 chains, or AMX's exact integer sums) write float32
        assert off_grid > 0.9
        assert (logits.double() - ref).abs().max() < 0.01
    else:  # other paths: their bf16 product, widened (torch's op also takes the scales in bf16)
        assert off_grid == 0
        assert (logits.double() - ref).abs().max() <= ref.abs().max() * 2 ** -7


def test_a_bf16_head_writes_float32_logits_where_the_dense_kernel_runs():
    from ember.layers.linear import dense_kernels

    g = torch.Generator().manual_seed(4)
    table = torch.randn(300, 128, generator=g).bfloat16()
    head = LMHead(300, 128, torch.bfloat16)
    head.load_weight(table)
    head.finalize(torch.device("cpu"), prepack=False)
    hidden = (torch.randn(5, 128, generator=g) * 4).bfloat16()
    logits = head(hidden)
    ref = hidden.double() @ table.double().t()
    assert logits.dtype == torch.float32
    if dense_kernels(torch.device("cpu"), torch.bfloat16, True) is None:
        pytest.skip("no fixed-order dense kernel here (AVX512-BF16): the bf16 product is widened")
    assert (logits != logits.bfloat16().float()).float().mean().item() > 0.9
    assert (logits.double() - ref).abs().max() < 0.01


def test_a_float32_model_gets_unrounded_logits_from_its_int8_head():
    """quantize_embeddings in a float32 model: the head's rows go in as bf16, as every quantized layer's, and its
    sums come back unrounded."""
    g = torch.Generator().manual_seed(5)
    head, table = _int8_head(torch.float32, g)
    hidden = torch.randn(3, 128, generator=g) * 4
    logits = head(hidden)
    assert logits.dtype == torch.float32
    if head.qmm.path != "cpu-int8" or qkernels._ember_gemm() is None:
        pytest.skip("torch's int8 op runs this head here: its bf16 product is widened")
    ref = hidden.bfloat16().double() @ table.dequantize(torch.float64).t()
    assert (logits != logits.bfloat16().float()).float().mean().item() > 0.9
    assert (logits.double() - ref).abs().max() < 0.01
