"""Qwen2-VL's vision tower: images of any size cut by the processor into flattened patches of
temporal_patch_size x patch_size^2 pixels (an image is its one frame twice), a linear patch embedding (the
checkpoint's Conv3d has one stride-sized kernel: a matrix product), pre-LayerNorm blocks whose attention stays
within each frame and rotates queries and keys by each patch's (row, column) in the image (2-D RoPE), and a merger
that joins each spatial_merge_size^2 block of neighbouring patches (the processor puts them next to each other)
into one token of the decoder's width."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.layers.base import Layer
from ember.layers.linear import Linear
from ember.layers.norm import LayerNorm
from ember.layers.rotary import apply_rotary
from ember.models.clip import activation


class PatchEmbed(Layer):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        p, tp = config.patch_size, config.temporal_patch_size
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(config.embed_dim, config.in_channels, tp, p, p, dtype=dtype),
                                        requires_grad=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(patches.to(w.dtype), w.reshape(w.shape[0], -1))


def patch_rows_cols(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """[patches, 2] (row, column) of every patch in the processor's order: frame by frame, merge x merge blocks
    in row-major order, row-major within a block."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        rc = torch.stack([rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)], dim=-1)
        out.append(rc.repeat(t, 1))
    return torch.cat(out)


class VisionRotary(Layer):
    """2-D RoPE: the first half of each head's rotary frequencies turn with the patch's row, the second with its
    column (rotate-half layout, float32)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        quarter = head_dim // 2
        inv = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, rows_cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = (rows_cols.to(self.inv_freq.device).float()[..., None] * self.inv_freq).flatten(1)  # [N, hd / 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)


class VisionAttention(Layer):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d = config.embed_dim
        self.num_heads = config.num_heads
        self.qkv = Linear(d, 3 * d, True, dtype)
        self.proj = Linear(d, d, True, dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        n, d = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        q = apply_rotary(q.float(), *rope).to(x.dtype)
        k = apply_rotary(k.float(), *rope).to(x.dtype)
        outs, at = [], 0
        for length in lengths:  # each frame attends to itself only
            s = slice(at, at + length)
            outs.append(F.scaled_dot_product_attention(q[s].transpose(0, 1), k[s].transpose(0, 1),
                                                       v[s].transpose(0, 1)).transpose(0, 1))
            at += length
        return self.proj(torch.cat(outs).reshape(n, d))


class VisionMLP(Layer):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = int(config.embed_dim * config.mlp_ratio)
        self.fc1 = Linear(config.embed_dim, hidden, True, dtype)
        self.fc2 = Linear(hidden, config.embed_dim, True, dtype)
        self.act = activation(config.hidden_act, "vision_config.hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(Layer):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = LayerNorm(config.embed_dim, 1e-6, dtype)
        self.attn = VisionAttention(config, dtype)
        self.norm2 = LayerNorm(config.embed_dim, 1e-6, dtype)
        self.mlp = VisionMLP(config, dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(Layer):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        wide = config.embed_dim * config.spatial_merge_size ** 2
        self.ln_q = LayerNorm(config.embed_dim, 1e-6, dtype)
        self.mlp = nn.Sequential(Linear(wide, wide, True, dtype), nn.GELU(), Linear(wide, config.hidden_size, True,
                                                                                    dtype))
        self.wide = wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.wide))


class Qwen2VisionTower(Layer):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(config, dtype)
        params = getattr(config, "rope_parameters", None) or {}
        self.rotary_pos_emb = VisionRotary(config.embed_dim // config.num_heads, float(params.get("rope_theta",
                                                                                                   10000.0)))
        self.blocks = nn.ModuleList(VisionBlock(config, dtype) for _ in range(config.depth))
        self.merger = PatchMerger(config, dtype)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [N, C * T * P * P] of images with these patch grids -> [N / merge^2, hidden]."""
        rope = self.rotary_pos_emb(patch_rows_cols(grids, self.merge))
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        x = self.patch_embed(patches)
        for block in self.blocks:
            x = block(x, rope, lengths)
        return self.merger(x)
