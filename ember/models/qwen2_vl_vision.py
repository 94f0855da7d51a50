"""Qwen2-VL's vision tower: images of any size cut by the processor into flattened patches of
temporal_patch_size x patch_size^2 pixels (an image is its one frame twice), a linear patch embedding (the
checkpoint's Conv3d has one stride-sized kernel: a matrix product), pre-LayerNorm blocks whose attention stays
within each frame and rotates queries and keys by each patch's (row, column) in the image (2-D RoPE), and a merger
that joins each spatial_merge_size^2 block of neighbouring patches (the processor puts them next to each other)
into one token of the decoder's width.

Qwen2.5-VL's tower (``window_size`` in its config) differs in three places: RMSNorm for LayerNorm, a gated MLP, and
attention within windows of window_size pixels square in all blocks but ``fullatt_block_indexes``. The patches are
put in window order once (whole merge blocks move, so the merger's groups stay together) and the merged tokens back
in the image's order at the end: every window, like every frame, is then one run of rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.layers.base import Layer
from ember.layers.linear import Linear, MergedLinear
from ember.layers.norm import LayerNorm, RMSNorm
from ember.layers.rotary import apply_rotary
from ember.models.clip import VisionMLP, activation


@dataclass(frozen=True, slots=True)
class TowerShape:
    """What differs between Qwen2-VL's tower and Qwen2.5-VL's, read from the vision config."""

    width: int  # the blocks'
    out: int  # the merger's: the decoder's width
    heads: int
    merge: int
    windowed: bool  # Qwen2.5-VL: RMSNorm, gated MLP, window attention
    window: int  # merged tokens a window side (0: none)
    full_blocks: frozenset[int]  # the blocks that attend over the whole frame

    @classmethod
    def of(cls, config: Any) -> "TowerShape":
        merge = config.spatial_merge_size
        if getattr(config, "window_size", None) is None:  # Qwen2-VL
            return cls(config.embed_dim, config.hidden_size, config.num_heads, merge, False, 0,
                       frozenset(range(config.depth)))
        return cls(config.hidden_size, config.out_hidden_size, config.num_heads, merge, True,
                   config.window_size // merge // config.patch_size, frozenset(config.fullatt_block_indexes))


class PatchEmbed(Layer):
    def __init__(self, config: Any, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        p, tp = config.patch_size, config.temporal_patch_size
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(width, config.in_channels, tp, p, p, dtype=dtype),
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


def window_order(grids: list[tuple[int, int, int]], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """The merge blocks of all images in window order (frame by frame, windows row-major, blocks row-major within
    a window) as indices into their image order, and each window's length in patches."""
    order: list[torch.Tensor] = []
    lengths: list[int] = []
    at = 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        blocks = torch.arange(t * gh * gw).view(t, gh, gw) + at
        for f in range(t):
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    win = blocks[f, r:r + window, c:c + window].reshape(-1)
                    order.append(win)
                    lengths.append(win.numel() * merge * merge)
        at += t * gh * gw
    return torch.cat(order), lengths


class VisionAttention(Layer):
    def __init__(self, config: Any, d: int, dtype: torch.dtype) -> None:
        super().__init__()
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


class GatedVisionMLP(Layer):
    """Qwen2.5-VL's: down(act(gate(x)) * up(x)), with biases."""

    def __init__(self, config: Any, d: int, dtype: torch.dtype) -> None:
        super().__init__()
        i = config.intermediate_size
        self.gate_up_proj = MergedLinear(d, {"gate": i, "up": i}, True, dtype, None)
        self.down_proj = Linear(i, d, True, dtype)
        self.act = activation(config.hidden_act, "vision_config.hidden_act")
        self.i = i

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.down_proj(self.act(gate_up[:, :self.i]) * gate_up[:, self.i:])


class VisionBlock(Layer):
    def __init__(self, config: Any, shape: TowerShape, dtype: torch.dtype) -> None:
        super().__init__()
        d = shape.width
        norm = (lambda: RMSNorm(d, 1e-6, dtype)) if shape.windowed else (lambda: LayerNorm(d, 1e-6, dtype))
        self.norm1 = norm()
        self.attn = VisionAttention(config, d, dtype)
        self.norm2 = norm()
        self.mlp = GatedVisionMLP(config, d, dtype) if shape.windowed else \
            VisionMLP(d, int(d * config.mlp_ratio), config.hidden_act, dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(Layer):
    def __init__(self, shape: TowerShape, dtype: torch.dtype) -> None:
        super().__init__()
        wide = shape.width * shape.merge ** 2
        self.ln_q = (RMSNorm if shape.windowed else LayerNorm)(shape.width, 1e-6, dtype)
        self.mlp = nn.Sequential(Linear(wide, wide, True, dtype), nn.GELU(), Linear(wide, shape.out, True, dtype))
        self.wide = wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.wide))


class Qwen2VisionTower(Layer):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.shape = shape = TowerShape.of(config)
        self.patch_embed = PatchEmbed(config, shape.width, dtype)
        params = getattr(config, "rope_parameters", None) or {}
        self.rotary_pos_emb = VisionRotary(shape.width // shape.heads, float(params.get("rope_theta", 10000.0)))
        self.blocks = nn.ModuleList(VisionBlock(config, shape, dtype) for _ in range(config.depth))
        self.merger = PatchMerger(shape, dtype)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [N, C * T * P * P] of images with these patch grids -> [N / merge^2, out]."""
        shape = self.shape
        unit = shape.merge ** 2
        cos, sin = self.rotary_pos_emb(patch_rows_cols(grids, shape.merge))
        frames = [h * w for t, h, w in grids for _ in range(t)]
        x = self.patch_embed(patches)
        order = windows = None
        if shape.window:  # windows as runs of rows: move whole merge blocks (and their rotations) there
            order, windows = window_order(grids, shape.merge, shape.window)
            order = order.to(x.device)
            x, cos, sin = (v.view(-1, unit, *v.shape[1:])[order].flatten(0, 1) for v in (x, cos, sin))
        for i, block in enumerate(self.blocks):
            x = block(x, (cos, sin), frames if i in shape.full_blocks else windows)
        merged = self.merger(x)
        if order is not None:  # back in the image's order
            merged = merged[torch.argsort(order)]
        return merged
