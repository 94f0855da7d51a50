"""Gemma 3 (text) and Gemma 2 over the Llama family's layers.

What differs from Llama, each read from the config: RMSNorm as ``norm(x) * (1 + w)`` (``OffsetRMSNorm``); a norm
after attention and a pair around the MLP (four a layer); GeGLU (``hidden_activation``); the embedding scaled by
sqrt(hidden_size); scores scaled by ``query_pre_attn_scalar ** -0.5``; sliding-window and global layers
(``layer_types``), Gemma 3's with their own RoPE base (``rope_parameters`` per layer type); Gemma 3's q / k norms;
Gemma 2's tanh soft-caps of the attention scores (``attn_logit_softcapping``: the ``torch`` attention backend,
the compiled kernels do not cap) and of the final logits (``final_logit_softcapping``). Weight names, the
tensor-parallel split, LoRA and loading are the Llama family's.
"""

from __future__ import annotations

from typing import Any

import torch

from ember.distributed import ParallelContext
from ember.layers.activation import gated_activation
from ember.layers.attention import AttentionMetadata
from ember.layers.base import Layer
from ember.layers.lora import LoRABatch
from ember.layers.norm import OffsetRMSNorm
from ember.layers.rotary import RotaryEmbedding
from ember.models.llama import MLP, Attention, DecoderLayer, FamilySwitches, LlamaForCausalLM, LlamaModel
from ember.quantization import QuantConfig

_LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_types(config: Any) -> list[str]:
    """Each layer's kind; a config without ``layer_types`` alternates as Gemma 2 does (even layers slide)."""
    types = getattr(config, "layer_types", None) or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config.num_hidden_layers)]
    for i, t in enumerate(types):
        if t not in _LAYER_TYPES:
            raise ValueError(f"layer_types[{i}]={t!r} is not supported: use one of {_LAYER_TYPES}")
    return list(types)


def _per_type_rope(config: Any) -> bool:
    """Gemma 3 keeps one RoPE setting per layer type (sliding: a local base); Gemma 2 one for all."""
    params = getattr(config, "rope_parameters", None) or {}
    return isinstance(params, dict) and set(params) <= set(_LAYER_TYPES) and bool(params)


class GemmaDecoderLayer(Layer):
    def __init__(self, config: Any, architecture: str, layer_type: str, window: int | None, dtype: torch.dtype,
                 quant: QuantConfig | None, parallel: ParallelContext, per_type_rope: bool = False) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.rope_kind = layer_type if per_type_rope else DecoderLayer.rope_kind  # the model's table it reads
        bias = bool(getattr(config, "attention_bias", False))
        switches = FamilySwitches(qkv_bias=bias, o_bias=bias, qk_norm=architecture == "Gemma3ForCausalLM")
        self.self_attn = Attention(config, switches, window, dtype, quant, parallel,
                                   scale=float(config.query_pre_attn_scalar) ** -0.5, norm=OffsetRMSNorm,
                                   softcap=getattr(config, "attn_logit_softcapping", None))
        act = gated_activation("hidden_activation", getattr(config, "hidden_activation", None)
                               or getattr(config, "hidden_act", "gelu_pytorch_tanh"))
        self.mlp = MLP(config, dtype, quant, parallel, act)
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, eps, dtype)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, eps, dtype)
        self.pre_feedforward_layernorm = OffsetRMSNorm(config.hidden_size, eps, dtype)
        self.post_feedforward_layernorm = OffsetRMSNorm(config.hidden_size, eps, dtype)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, lora: LoRABatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As the Llama layer: the stream is x + residual (x alone in the first layer), added by the next norm."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        # the sublayers' outputs are new tensors: normalised where they lie
        x = self.post_attention_layernorm(self.self_attn(rope, x, meta, lora), overwrite=True)
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x, lora), overwrite=True), residual


class GemmaModel(LlamaModel):
    """The Llama stack with Gemma's layers, its (1 + w) final norm, the scaled embedding and a RoPE table a kind of
    layer where the config keeps one set a kind (Gemma 3)."""

    norm_class = OffsetRMSNorm

    def make_ropes(self, config: Any, head_dim: int, max_position: int) -> dict[str, RotaryEmbedding]:
        if not _per_type_rope(config):
            return super().make_ropes(config, head_dim, max_position)
        return {t: RotaryEmbedding(config, head_dim, max_position, t) for t in sorted(set(layer_types(config)))}

    def make_layer(self, architecture: str, config: Any, index: int, sw: FamilySwitches, window: int | None,
                   dtype: torch.dtype, quant: QuantConfig | None, parallel: ParallelContext) -> Layer:
        return GemmaDecoderLayer(config, architecture, layer_types(config)[index], window, dtype, quant, parallel,
                                 per_type_rope=_per_type_rope(config))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        return x * torch.tensor(self.embed_tokens.dim ** 0.5, dtype=x.dtype)  # in x's dtype, as transformers does


class GemmaForCausalLM(LlamaForCausalLM):
    model_class = GemmaModel
    calibrated = False  # a scale cannot fold into (1 + w), and the MLP's input norm is pre_feedforward_layernorm

    def __init__(self, architecture: str, config: Any, max_position: int, dtype: torch.dtype,
                 quant: QuantConfig | None = None, parallel: ParallelContext = ParallelContext()) -> None:
        super().__init__(architecture, config, max_position, dtype, quant, parallel)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        if logits is None or not self.final_softcap:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap
