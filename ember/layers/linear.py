"""Linear layers. Fused projections (QKV, gate/up) load their checkpoint parts into slices of one weight, so a
decoder layer does two matmuls for attention input and MLP input instead of five."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


def mkldnn_prepack_available() -> bool:
    """oneDNN can pre-pack linear weights on CPU: about 2x faster matmuls for decode-sized batches, bf16 and fp32.
    EMBER_MKLDNN_LINEAR=0 turns it off."""
    return (os.environ.get("EMBER_MKLDNN_LINEAR", "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PrepackedWeight:
    """A CPU weight re-laid out by oneDNN once at load time; the original stays for loading and inspection."""

    __slots__ = ("packed",)

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           prepacked: PrepackedWeight | None) -> torch.Tensor:
    if prepacked is not None and x.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x, prepacked.packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """y = x W^T (+ b). Weights are allocated empty: the loader fills every element or fails."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.prepacked: PrepackedWeight | None = None

    def prepack(self) -> None:
        self.prepacked = PrepackedWeight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.prepacked)


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
