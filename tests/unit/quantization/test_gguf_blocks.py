"""GGUF Q4_K blocks load as ember's int4 in groups of 32, the 5-bit blocks (Q5_0, Q5_1, Q5_K) as int5 and Q6_K as
int6, with nothing lost: the values the layout gives are the gguf package's own decoding of the same bytes, to the
bit (blocks written by an encoder, and arbitrary bytes under finite scales, so every 6-bit scale / min packing and
every fifth and sixth bit is read)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quants
from gguf_writer import quantize_q4_k, quantize_q6_k

from ember.quantization.tensor import from_gguf


def _same_as_gguf(raw: np.ndarray, n: int, k: int) -> None:
    qt = from_gguf(raw, "Q4_K", (n, k))
    assert qt.kind == "int4" and qt.group_size == 32 and qt.shape == (n, k)
    want = dequantize(raw, GGMLQuantizationType.Q4_K)
    assert np.array_equal(qt.dequantize(torch.float32).numpy(), want)


def test_encoded_blocks_read_as_the_gguf_package_reads_them():
    w = (np.random.default_rng(0).standard_normal((64, 512)) * 0.05).astype(np.float32)
    raw = quantize_q4_k(w)
    assert raw.shape == (64, 2 * 144)
    assert np.abs(dequantize(raw, GGMLQuantizationType.Q4_K) - w).max() < 0.05 * np.abs(w).max()  # 4 bits, not noise
    _same_as_gguf(raw, 64, 512)


def test_arbitrary_scale_bytes_and_values_read_as_the_gguf_package_reads_them():
    raw = np.random.default_rng(1).integers(0, 256, size=(16, 3 * 144), dtype=np.uint8)
    for b in range(3):  # d and dmin finite (any other bytes are valid blocks)
        raw[:, b * 144:b * 144 + 4] = np.array([0.013 * (b + 1), 0.007], dtype=np.float16).view(np.uint8)
    _same_as_gguf(raw, 16, 768)


def test_the_q6_k_encoder_writes_blocks_the_gguf_package_reads():
    """The tests' Q6_K files (tests/e2e/test_loading.py: a K-quant file without 4-bit blocks) hold what was
    encoded, to 6 bits, as the gguf package decodes them."""
    w = (np.random.default_rng(2).standard_normal((64, 512)) * 0.05).astype(np.float32)
    raw = quantize_q6_k(w)
    assert raw.shape == (64, 2 * 210)
    err = np.abs(dequantize(raw, GGMLQuantizationType.Q6_K) - w).reshape(64, 32, 16)
    amax = np.abs(w).reshape(64, 32, 16).max(-1, keepdims=True)
    assert np.all(err <= amax / 62 * 1.05)  # half a step of 6 bits, each 16 values' own scale (fp16 / int8 rounded)
    qt = from_gguf(raw, "Q6_K", (64, 512))
    assert np.array_equal(qt.dequantize(torch.float32).numpy(), dequantize(raw, GGMLQuantizationType.Q6_K))


def test_arbitrary_q6_k_bytes_read_as_the_gguf_package_reads_them():
    """Arbitrary values, high bits and int8 scales under finite f16 d: int6 in groups of 16, each scale d * sc
    (exact in float32) and the d kept beside them (``super_scales``), values 0..63 (every high bit read)."""
    n, k = 16, 768
    rng = np.random.default_rng(6)
    raw = rng.integers(0, 256, size=(n, k // 256 * 210), dtype=np.uint8)
    blocks = raw.reshape(n, k // 256, 210)
    blocks[..., 208:210] = (rng.random((n, k // 256, 1)) * 0.01 + 1e-4).astype(np.float16).view(np.uint8)
    qt = from_gguf(raw, "Q6_K", (n, k))
    assert qt.kind == "int6" and qt.group_size == 16 and qt.shape == (n, k) and qt.super_scales.shape == (n, 3)
    assert qt.data.max() == 63 and qt.data.min() == 0
    sc = qt.scales / qt.super_scales.repeat_interleave(16, dim=1)
    assert torch.equal(sc, sc.round()) and sc.abs().max() <= 128
    assert np.array_equal(qt.dequantize(torch.float32).numpy(), dequantize(raw, GGMLQuantizationType.Q6_K))


@pytest.mark.parametrize("name,block,size", [("Q5_0", 32, 22), ("Q5_1", 32, 24), ("Q5_K", 256, 176)])
def test_five_bit_blocks_read_as_the_gguf_package_reads_them(name, block, size):
    """Arbitrary value and fifth-bit bytes under finite f16 scales (and Q5_1's / Q5_K's mins)."""
    n, k = 16, 512
    rng = np.random.default_rng(block + size)
    raw = rng.integers(0, 256, size=(n, k // block * size), dtype=np.uint8)
    blocks = raw.reshape(n, k // block, size)
    blocks[..., 0:2] = (rng.random((n, k // block, 1)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8)
    if name != "Q5_0":
        blocks[..., 2:4] = (rng.random((n, k // block, 1)) * 0.02 - 0.01).astype(np.float16).view(np.uint8)
    qt = from_gguf(raw, name, (n, k))
    assert qt.kind == "int5" and qt.group_size == 32 and qt.shape == (n, k)
    q = qt.unpacked()
    assert q.max() == 31 and q.min() == 0  # every fifth bit read: values above 15 occur
    want = dequantize(raw, getattr(GGMLQuantizationType, name))
    assert np.array_equal(qt.dequantize(torch.float32).numpy(), want)


def test_encoded_q5_0_blocks_read_as_the_gguf_package_reads_them():
    w = (np.random.default_rng(4).standard_normal((64, 256)) * 0.05).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType.Q5_0)
    qt = from_gguf(raw, "Q5_0", (64, 256))
    assert np.array_equal(qt.dequantize(torch.float32).numpy(), dequantize(raw, GGMLQuantizationType.Q5_0))
    assert np.abs(qt.dequantize(torch.float32).numpy() - w).max() < 0.05 * np.abs(w).max()  # 5 bits, not noise
