"""Multimodal RoPE (Qwen2-VL): the rotary half-dims are split into three sections (``mrope_section``) that rotate by
a token's temporal, height and width position; the tables are the plain RoPE ones, each column read at the
position of its section. One-row positions (all three equal: text only, or a CUDA-graph decode) read the plain
table as before."""

from __future__ import annotations

from typing import Any

import torch

from ember.layers.rotary import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    def __init__(self, config: Any, head_dim: int, max_position: int, section: list[int]) -> None:
        super().__init__(config, head_dim, max_position)
        half = self.rotary_dim // 2
        if sum(section) != half:
            raise ValueError(f"mrope_section={section} sums to {sum(section)}: the rotary half-dim is {half}")
        axis = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
        self.register_buffer("axis", torch.cat([axis, axis]), persistent=False)  # the position row of each column
        self.register_buffer("columns", torch.arange(self.rotary_dim), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, meta: Any = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] (three equal rows) or [3, T] (temporal, height, width)."""
        if positions.dim() == 1:
            return super().cos_sin(positions, dtype, meta)
        rows = positions[self.axis].T  # [T, rotary_dim]: each column's position
        return (self.cos[rows, self.columns].to(dtype).unsqueeze(1),
                self.sin[rows, self.columns].to(dtype).unsqueeze(1))
