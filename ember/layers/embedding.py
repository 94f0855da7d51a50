"""Token embedding and LM head; a tied head reuses the embedding's weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.layers.linear import PrepackedWeight, linear


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(VocabEmbedding):
    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__(vocab_size if tied_to is None else 0, dim, dtype)
        if tied_to is not None:
            self.weight = tied_to.weight
        self.prepacked: PrepackedWeight | None = None

    def prepack(self) -> None:
        self.prepacked = PrepackedWeight(self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32: the sampler and logprobs need the precision whatever the model dtype."""
        return linear(hidden, self.weight, None, self.prepacked).float()
