"""A fused projection whose parts come in different layouts (Q4_K_M: q and k in Q4_K, v in Q6_K) holds each run of
rows in its own quantized weight; the layer's output is theirs joined, row for row the bits each part gives alone,
and within the quantization error of a float32 matmul of the dequantized weight (the reference)."""

from __future__ import annotations

import pytest
import torch

from ember.quantization import QuantizedMatmul, StackedMatmul, quantize_int4, quantize_int8


def _parts(invariant: bool) -> tuple[QuantizedMatmul, QuantizedMatmul]:
    torch.manual_seed(3)
    return (QuantizedMatmul("int4", quantize_int4(torch.randn(128, 96), 32), batch_invariant=invariant),
            QuantizedMatmul("int8", quantize_int8(torch.randn(48, 96)), batch_invariant=invariant))


@pytest.mark.parametrize("invariant", [True, False])
def test_a_stacked_weight_is_its_parts_joined(invariant):
    int4, int8 = _parts(invariant)
    mm = StackedMatmul([int4, int8])
    assert (mm.method, mm.n, mm.k) == ("int4+int8", 176, 96)
    assert mm.path == f"{int4.path}+{int8.path}"
    assert mm.tensors() == int4.tensors() + int8.tensors()
    ref_w = mm.dequantized(torch.float32)
    assert torch.equal(ref_w, torch.cat([int4.dequantized(torch.float32), int8.dequantized(torch.float32)]))
    for rows in (1, 5, 130):
        x = torch.randn(rows, 96).bfloat16()
        y = mm(x)
        assert y.shape == (rows, 176) and y.dtype == torch.bfloat16
        assert torch.equal(y, torch.cat([int4(x), int8(x)], dim=-1))
        ref = x.float() @ ref_w.t()
        assert ((y.float() - ref).norm() / ref.norm()).item() < 0.02, (mm.path, rows)


def test_a_stacked_weight_keeps_its_parts_batch_invariance():
    mm = StackedMatmul(list(_parts(True)))
    x = torch.randn(9, 96).bfloat16()
    together = mm(x)
    for i in (0, 4, 8):
        assert torch.equal(mm(x[i:i + 1]), together[i:i + 1])


def test_a_stacked_weight_needs_parts_of_one_input_size():
    int4, int8 = _parts(True)
    with pytest.raises(ValueError, match="two or more parts"):
        StackedMatmul([int4])
    with pytest.raises(ValueError, match=r"one input size, got inputs \[96, 64\]"):
        StackedMatmul([int4, QuantizedMatmul("int8", quantize_int8(torch.randn(16, 64)))])
