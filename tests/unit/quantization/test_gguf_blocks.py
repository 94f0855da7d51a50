"""GGUF Q4_K blocks load as ember's int4 in groups of 32 with nothing lost: the values the layout gives are the
gguf package's own decoding of the same bytes, to the bit (blocks written by the test encoder, and arbitrary bytes
under finite super-block scales, so every 6-bit scale / min packing is read)."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, dequantize
from gguf_writer import quantize_q4_k

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
