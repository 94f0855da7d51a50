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
from torch import nn

from ember.config import ModelShape
from ember.distributed import ParallelContext, layer_range
from ember.layers.activation import gated_activation
from ember.layers.attention import AttentionMetadata
from ember.layers.base import Layer
from ember.layers.embedding import VocabEmbedding
from ember.layers.lora import LoRABatch
from ember.layers.norm import OffsetRMSNorm
from ember.layers.rotary import RotaryEmbedding
from ember.models.llama import MLP, Attention, FamilySwitches, LlamaForCausalLM, MissingLayer, layer_windows
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
                 quant: QuantConfig | None, parallel: ParallelContext) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.layer_type = layer_type
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
        x = self.post_attention_layernorm(self.self_attn(rope, x, meta, lora))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x, lora)), residual


class GemmaModel(Layer):
    def __init__(self, architecture: str, config: Any, max_position: int, dtype: torch.dtype,
                 quant: QuantConfig | None = None, parallel: ParallelContext = ParallelContext()) -> None:
        super().__init__()
        self.parallel, self.dtype = parallel, dtype
        self.start, self.stop = layer_range(config.num_hidden_layers, parallel.pp_size, parallel.pp_rank)
        head_dim = ModelShape.of(config).head_dim
        types = layer_types(config)
        per_type = _per_type_rope(config)
        self.ropes = nn.ModuleDict({t: RotaryEmbedding(config, head_dim, max_position, t if per_type else None)
                                    for t in sorted(set(types))})
        self.embed_scale = config.hidden_size ** 0.5  # applied in the activations' dtype, as transformers does
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype,
                                           quant is not None and quant.embeddings, parallel) \
            if parallel.is_first_stage or (tied and parallel.is_last_stage) else None
        windows = layer_windows(architecture, config)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, architecture, t, w, dtype, quant, parallel) if self.start <= i < self.stop
            else MissingLayer() for i, (t, w) in enumerate(zip(types, windows)))
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, dtype) if parallel.is_last_stage else None
        self.local_layers = [self.layers[i] for i in range(self.start, self.stop)]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None, lora: LoRABatch | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if intermediate is None:
            x = self.embed_tokens(ids)
            x, residual = x * torch.tensor(self.embed_scale, dtype=x.dtype), None
        else:
            x, residual = intermediate
        ropes = {t: rope.cos_sin(positions, x.dtype, meta) for t, rope in self.ropes.items()}  # once a step a kind
        for layer in self.local_layers:
            x, residual = layer(ropes[layer.layer_type], x, residual, meta, lora)
        if self.norm is None:
            return x, residual
        return self.norm(x, residual)[0]


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
