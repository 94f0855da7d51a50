"""GGUF Q4_K blocks load as ember's int4 in groups of 32 with nothing lost: the values the layout gives are the
gguf package's own decoding of the same bytes, to the bit (blocks written by the test encoder, and arbitrary bytes
under finite super-block scales, so every 6-bit scale / min packing is read)."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, dequantize
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
