"""The w8a8 products on a CPU without int8 dot products: float32 matmuls over slices of K, equal to the exact
integer products (int64 matmuls) to the bit, whatever the shapes and the rows beside a row."""

from __future__ import annotations

import pytest
import torch

from ember.quantization.kernels import int8_mm_exact_float


@pytest.mark.parametrize("rows,k,n", [(1, 576, 1536), (7, 1536, 576), (130, 2500, 300), (64, 1024, 64), (3, 1, 5)])
def test_float_slices_give_the_int8_gemm_to_the_bit(rows, k, n):
    g = torch.Generator().manual_seed(rows * k)
    x = torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    got = int8_mm_exact_float(x, w)
    # the reference is int64 arithmetic, not torch._int_mm: on AMX machines (torch 2.13) that returns garbage for K=1
    assert torch.equal(got, (x.long() @ w.long().t()).float())
    assert torch.equal(int8_mm_exact_float(x[:1], w), got[:1])  # a row alone: the same bits


def test_the_largest_sums_stay_exact():
    """Every product -128 x -128 over 1024 and 2048 columns: sums of 2**24 and 2**25, beyond float32's exact
    integers were they summed in one float32 matmul."""
    for k in (1024, 2048):
        x = torch.full((2, k), -128, dtype=torch.int8)
        w = torch.full((3, k), -128, dtype=torch.int8)
        assert torch.equal(int8_mm_exact_float(x, w), torch.full((2, 3), float(128 * 128 * k)))
