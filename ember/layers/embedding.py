"""Token embedding and LM head; a tied head reuses the embedding's weight (float, or the same int8 table)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.layers.linear import PrepackedWeight, linear, load_float
from ember.quantization import QuantizedMatmul, QuantizedTensor, requantize


class VocabEmbedding(nn.Module):
    """quantized: the table is int8 with one scale per row; a lookup dequantizes only the rows it gathers."""

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, quantized: bool = False) -> None:
        super().__init__()
        self.dtype, self.dim, self.quantized = dtype, dim, quantized
        self.weight = None if quantized else nn.Parameter(torch.empty(vocab_size, dim, dtype=dtype),
                                                          requires_grad=False)
        self.qt: QuantizedTensor | None = None

    def load_weight(self, value: torch.Tensor | QuantizedTensor, name: str = "weight") -> None:
        if self.quantized:
            if value.shape[1] != self.dim:
                raise ValueError(f"{name}: expected {self.dim} columns, got shape {tuple(value.shape)}")
            self.qt = requantize(value, "int8", self.dim)
        else:
            load_float(self.weight.data, value, name)

    def finalize(self, device: torch.device, prepack: bool) -> None:
        if self.qt is not None:
            self.qt = self.qt.to(device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qt is not None:
            return F.embedding(ids, self.qt.data).to(self.dtype) * F.embedding(ids, self.qt.scales).to(self.dtype)
        return F.embedding(ids, self.weight)


class LMHead(VocabEmbedding):
    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, tied_to: VocabEmbedding | None = None,
                 quantized: bool = False) -> None:
        super().__init__(vocab_size if tied_to is None else 0, dim, dtype, quantized and tied_to is None)
        self.__dict__["tied_to"] = tied_to  # a reference, not a submodule: the embedding is registered once
        if tied_to is not None:
            self.weight = tied_to.weight
        self.prepacked: PrepackedWeight | None = None
        self.qmm: QuantizedMatmul | None = None

    def finalize(self, device: torch.device, prepack: bool) -> None:
        """Runs after the embedding's own finalize (it is registered first)."""
        super().finalize(device, prepack)
        table = self.tied_to.qt if self.tied_to is not None else self.qt
        if table is not None:
            self.qmm = QuantizedMatmul("int8", table)  # shares the int8 table with the embedding when tied
        elif prepack:
            self.prepacked = PrepackedWeight(self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32: the sampler and logprobs need the precision whatever the model dtype."""
        if self.qmm is not None:
            return self.qmm(hidden).float()
        return linear(hidden, self.weight, None, self.prepacked).float()
