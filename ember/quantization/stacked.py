"""One layer's output rows held in more than one quantized layout: a fused projection whose parts come in different
GGUF blocks. Q4_K_M stores a layer's q and k in Q4_K and, in half the layers, its v in Q6_K; held as one int8
weight, q and k would be requantized from their int4 groups (a rounding the file does not have) and read at 8 bits
a weight instead of 5. Here each run of rows keeps its own layout and kernel, and the outputs are joined."""

from __future__ import annotations

import torch

from ember.quantization.kernels import QuantizedMatmul


class StackedMatmul:
    """``QuantizedMatmul`` parts stacked along the output rows, with the same calls (``path``, ``dequantized``,
    ``tensors``); ``method`` names the parts' methods in order (``int4+int8``)."""

    __slots__ = ("parts", "method", "n", "k")

    def __init__(self, parts: list[QuantizedMatmul]) -> None:
        if len(parts) < 2 or len({p.k for p in parts}) != 1:
            raise ValueError(f"a stacked weight needs two or more parts of one input size, got inputs "
                             f"{[p.k for p in parts]}")
        self.parts = parts
        self.method = "+".join(p.method for p in parts)
        self.n, self.k = sum(p.n for p in parts), parts[0].k

    @property
    def path(self) -> str:
        return "+".join(p.path for p in self.parts)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([p.dequantized(dtype) for p in self.parts])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def tensors(self) -> list[torch.Tensor]:
        """What this weight holds in memory."""
        return [t for p in self.parts for t in p.tensors()]
