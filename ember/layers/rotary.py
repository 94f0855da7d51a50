"""Rotary position embedding with a precomputed cos/sin table indexed by each token's position.

Inverse frequencies come from transformers' own RoPE functions for scaled variants (linear, llama3, yarn), so long-
context checkpoints match the reference; the arithmetic mirrors transformers (float32 tables, rotate-half).
"""

from __future__ import annotations

from typing import Any

import torch

from ember.kernels import kernels_for
from ember.layers.base import Layer

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
    def __init__(self, config: Any, head_dim: int, max_position: int, layer_type: str | None = None) -> None:
        super().__init__()
        params = rope_parameters(config, layer_type)
        rope_type = params["rope_type"]
        if rope_type not in _STATIC_ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not supported: use one of {_STATIC_ROPE_TYPES}")
        if rope_type == "default":
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            hf_config = config.to_transformers() if hasattr(config, "to_transformers") else config  # a GGUFConfig
            kwargs = {"layer_type": layer_type} if layer_type is not None else {}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **kwargs)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D] cos and sin of every token's position, in the activations' dtype (as transformers casts)."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def rotate_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary`` written back into x [T, H, D] (a view into the QKV projection's output) where ember's CPU
    kernel runs it in one pass (bf16/fp16; the same rounding as eager), else eager; returns the rotated tensor."""
    if x.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1 and x.stride(1) == x.shape[-1]:
        kernels = kernels_for(x.device)
        if kernels is not None:
            kernels.rotary_(x, cos, sin)
            return x
    return apply_rotary(x, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by rotate-half RoPE; the same arithmetic as transformers' apply_rotary_pos_emb."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
