"""Rotary position embedding with a precomputed cos/sin table indexed by each token's position.

Inverse frequencies come from transformers' own RoPE functions for scaled variants (linear, llama3, yarn), so long-
context checkpoints match the reference; the arithmetic mirrors transformers (float32 tables, rotate-half).
"""

from __future__ import annotations

from typing import Any

import torch

from ember.kernels import kernels_for
from ember.layers.base import Layer

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE settings of a transformers config, for both the 4.x and the 5.x attribute names; layer_type: those of
    one kind of layer where the config keeps one set per kind (Gemma 3: ``sliding_attention``, ``full_attention``)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if layer_type is not None:
        params = dict(params.get(layer_type) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


class RotaryEmbedding(Layer):
    """cos / sin tables over positions. Partial rotary (``partial_rotary_factor``: Phi-4-mini's 0.75) rotates the first
    ``rotary_dim`` values of each head and passes the rest. LongRoPE (Phi-3) keeps two tables, short and long
    factors, and a sequence reads the long one once it is longer than ``original_max_position_embeddings``, as
    transformers switches: per forward of that sequence (``switch``), decided by its length after the step."""

    def __init__(self, config: Any, head_dim: int, max_position: int, layer_type: str | None = None) -> None:
        super().__init__()
        params = rope_parameters(config, layer_type)
        rope_type = params["rope_type"]
        if rope_type not in _STATIC_ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not supported: use one of {_STATIC_ROPE_TYPES}")
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
        self.rotary_dim = int(head_dim * factor)
        self.max_position = max_position
        self.switch: int | None = None  # LongRoPE: sequences longer than this read the long table
        tables = []
        if rope_type == "default":
            d = self.rotary_dim
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
            tables.append((inv_freq, 1.0))
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            hf_config = config.to_transformers() if hasattr(config, "to_transformers") else config  # a GGUFConfig
            kwargs = {"layer_type": layer_type} if layer_type is not None else {}
            init = ROPE_INIT_FUNCTIONS[rope_type]
            tables.append(init(hf_config, torch.device("cpu"), **kwargs))
            if rope_type == "longrope":
                self.switch = int(params["original_max_position_embeddings"])
                tables.append(init(hf_config, torch.device("cpu"), seq_len=self.switch + 1, **kwargs))
        positions = torch.arange(max_position, dtype=torch.float32)
        cos, sin = [], []
        for inv_freq, scaling in tables:
            freqs = positions[:, None] * inv_freq[None, :].float()
            emb = torch.cat((freqs, freqs), dim=-1)
            cos.append(emb.cos() * scaling)
            sin.append(emb.sin() * scaling)
        self.register_buffer("cos", torch.cat(cos), persistent=False)
        self.register_buffer("sin", torch.cat(sin), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, meta: Any = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, rotary_dim] cos and sin of every token's position, in the activations' dtype (as transformers
        casts); meta (the step's AttentionMetadata) says each token's sequence length for LongRoPE's switch."""
        if self.switch is not None and meta is not None:
            positions = positions + (meta.sequence_ends(positions) > self.switch) * self.max_position
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def rotate_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary`` written back into x [T, H, D] (a view into the QKV projection's output) where ember's CPU
    kernel runs it in one pass (bf16/fp16; the same rounding as eager), else eager; returns the rotated tensor."""
    if cos.shape[-1] < x.shape[-1]:  # partial rotary: the rest of each head passes unrotated
        rot = cos.shape[-1]
        x[..., :rot] = apply_rotary(x[..., :rot], cos, sin)
        return x
    if x.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1 and x.stride(1) == x.shape[-1]:
        kernels = kernels_for(x.device)
        if kernels is not None:
            kernels.rotary_(x, cos, sin)
            return x
    return apply_rotary(x, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by rotate-half RoPE; the same arithmetic as transformers' apply_rotary_pos_emb (with
    partial rotary, over the first cos.shape[-1] values of each head)."""
    if cos.shape[-1] < x.shape[-1]:
        rot = cos.shape[-1]
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
