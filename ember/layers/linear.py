"""Linear layers. Fused projections (QKV, gate/up) load their checkpoint parts into slices of one weight, so a
decoder layer does two matmuls for attention input and MLP input instead of five."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b). Weights are allocated empty: the loader fills every element or fails."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim; ``shard_sizes`` names each part."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias, dtype)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def load_shard(self, shard: str, param_name: str, tensor: torch.Tensor) -> None:
        offset, size = self.shard_offsets[shard]
        target = getattr(self, param_name)
        if tensor.shape[0] != size or tensor.shape[1:] != target.shape[1:]:
            raise ValueError(f"{param_name} of shard {shard}: expected {(size, *target.shape[1:])}, "
                             f"got {tuple(tensor.shape)}")
        target.data[offset:offset + size].copy_(tensor)
