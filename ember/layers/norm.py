"""RMSNorm, computed in float32 like transformers so float32 parity is exact and bf16 stays stable.

Given the residual stream, it first adds the sublayer's output to it (vLLM's fused add + norm): on CPU one pass of
ember's kernel instead of about nine eager ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.kernels import kernels_for
from ember.layers.base import Layer


class RMSNorm(Layer):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, overwrite: bool = False):
        """norm(x); with ``residual``: (norm(x + residual), x + residual). overwrite: x is the caller's own new
        tensor (a sublayer's output, a slice of its fresh projection), so the kernel may write norm(x) over it
        instead of into a copy."""
        kernels = kernels_for(x.device)
        if kernels is not None and x.is_contiguous() and (residual is None or residual.is_contiguous()):
            if residual is None:
                out = x if overwrite else x.clone()
                kernels.add_rms_norm_(out, None, self.weight, self.eps)
                return out
            kernels.add_rms_norm_(x, residual, self.weight, self.eps)  # residual += x; x = norm(residual)
            return x, residual
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm, ``norm(x) * (1 + w)``: checkpoints store w, the layer holds 1 + w (added once at load, in
    float32 as transformers adds it each call, so float32 results are the same bits) and runs as RMSNorm."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__(dim, eps, dtype)

    def load_weight(self, tensor: torch.Tensor, name: str = "weight") -> None:
        if tuple(tensor.shape) != tuple(self.weight.shape):
            raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, the model needs "
                             f"{tuple(self.weight.shape)}")
        self.weight.data.copy_((1.0 + tensor.float()).to(self.weight.dtype))


class LayerNorm(Layer):
    """Layer normalisation with weight and bias (the encoders': BERT, the CLIP vision tower)."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
