"""Which part of a checkpoint tensor one rank reads: a slice along one dimension, or the whole tensor.

Checkpoint readers apply it before reading (safetensors slices, GGUF rows and whole quantization blocks, .asparam
rows and groups), so no rank materialises a weight it does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class WeightSlice:
    dim: int | None = None  # None: the whole tensor
    start: int = 0
    stop: int = 0

    @property
    def whole(self) -> bool:
        return self.dim is None

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.dim is None else t.narrow(self.dim, self.start, self.stop - self.start)

