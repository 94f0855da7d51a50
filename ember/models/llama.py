"""The Llama family in one implementation: Llama / SmolLM2, Mistral, Qwen2 / Qwen2.5 and Qwen3.

The families differ only in switches read from the config: bias on the QKV projection (Qwen2), RMSNorm on each
query and key head (Qwen3), tied or separate LM head, sliding-window layers. The model sees one flat batch of
tokens ``[T]`` with their positions and the attention metadata; it never sees padding.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ember.config import ModelShape
from ember.layers.activation import silu_and_mul
from ember.layers.attention import AttentionMetadata, PagedAttention
from ember.layers.embedding import LMHead, VocabEmbedding
from ember.layers.linear import Linear, MergedLinear, load_float
from ember.layers.norm import RMSNorm
from ember.layers.rotary import RotaryEmbedding, apply_rotary
from ember.quantization import QuantConfig, QuantizedTensor


@dataclass(slots=True, frozen=True)
class FamilySwitches:
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool


def family_switches(architecture: str, config: Any) -> FamilySwitches:
    attention_bias = bool(getattr(config, "attention_bias", False))
    if architecture == "Qwen2ForCausalLM":
        return FamilySwitches(qkv_bias=True, o_bias=False, qk_norm=False)
    if architecture == "Qwen3ForCausalLM":
        return FamilySwitches(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
    return FamilySwitches(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=False)


def layer_windows(architecture: str, config: Any) -> list[int | None]:
    """The sliding window of each layer, None for full attention, as transformers decides it."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if architecture == "MistralForCausalLM":
        return [window] * n
    layer_types = getattr(config, "layer_types", None)
    if layer_types and window:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if getattr(config, "use_sliding_window", False) and window:
        start = getattr(config, "max_window_layers", n)
        return [window if i >= start else None for i in range(n)]
    return [None] * n


class Attention(nn.Module):
    def __init__(self, config: Any, sw: FamilySwitches, window: int | None, rope: RotaryEmbedding,
                 dtype: torch.dtype, quant: QuantConfig | None) -> None:
        super().__init__()
        shape = ModelShape.of(config)
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, {"q": q, "k": kv, "v": kv}, sw.qkv_bias, dtype, quant)
        self.o_proj = Linear(q, config.hidden_size, sw.o_bias, dtype, quant)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if sw.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if sw.qk_norm else None
        self.rope = rope
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, window)
        self.split = (q, kv, kv)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        v = qkv[:, (nq + nkv) * d:].view(T, nkv, d)
        if self.q_norm is None:  # Q and K are adjacent: one rotation for both
            qk = apply_rotary(qkv[:, :(nq + nkv) * d].view(T, nq + nkv, d), *rope)
            q, k = qk[:, :nq], qk[:, nq:]
        else:
            q = apply_rotary(self.q_norm(qkv[:, :nq * d].reshape(T, nq, d)), *rope)
            k = apply_rotary(self.k_norm(qkv[:, nq * d:(nq + nkv) * d].reshape(T, nkv, d)), *rope)
        return self.o_proj(self.attn(q, k, v, meta))


class MLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, quant: QuantConfig | None) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate": inter, "up": inter}, bias, dtype, quant)
        self.down_proj = Linear(inter, config.hidden_size, bias, dtype, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, sw: FamilySwitches, window: int | None, rope: RotaryEmbedding,
                 dtype: torch.dtype, quant: QuantConfig | None) -> None:
        super().__init__()
        self.self_attn = Attention(config, sw, window, rope, dtype, quant)
        self.mlp = MLP(config, dtype, quant)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the previous sublayer's output, residual the stream before it (None in the first layer)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, architecture: str, config: Any, max_position: int, dtype: torch.dtype,
                 quant: QuantConfig | None = None) -> None:
        super().__init__()
        sw = family_switches(architecture, config)
        self.rope = RotaryEmbedding(config, ModelShape.of(config).head_dim, max_position)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype,
                                           quantized=quant is not None and quant.embeddings)
        self.layers = nn.ModuleList(
            DecoderLayer(config, sw, w, self.rope, dtype, quant) for w in layer_windows(architecture, config)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(ids), None
        rope = self.rope.cos_sin(positions, x.dtype)  # once a step, shared by every layer
        for layer in self.layers:
            x, residual = layer(rope, x, residual, meta)
        return self.norm(x, residual)[0]


# checkpoint name part -> (fused parameter, shard)
_STACKED = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, architecture: str, config: Any, max_position: int, dtype: torch.dtype,
                 quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.quant = quant
        self.model = LlamaModel(architecture, config, max_position, dtype, quant)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, dtype,
                              tied_to=self.model.embed_tokens if self.tied else None,
                              quantized=quant is not None and quant.embeddings)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names; a weight may come quantized) into the model; fail on anything
        missing. Weights go through their module's load_weight, which quantizes or dequantizes as the layer needs."""
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        expected: set[tuple[str, str | None]] = set()
        for mod_name, module in modules.items():
            if isinstance(module, MergedLinear):
                expected.update((f"{mod_name}.weight", shard) for shard in module.shard_offsets)
                if module.bias is not None:
                    expected.update((f"{mod_name}.bias", shard) for shard in module.shard_offsets)
            elif hasattr(module, "load_weight") and not (module is self.lm_head and self.tied):
                expected.add((f"{mod_name}.weight", None))
        covered = {n for n, _ in expected}
        expected.update((name, None) for name in params if name not in covered)
        loaded: set[tuple[str, str | None]] = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (self.tied and name == "lm_head.weight"):
                continue
            parts = name.split(".")
            stacked = next((p for p in parts if p in _STACKED), None)
            if stacked is not None:
                fused, shard = _STACKED[stacked]
                target = name.replace(stacked, fused)
                if (target, shard) not in expected:
                    continue
                modules[target.rsplit(".", 1)[0]].load_shard(shard, parts[-1], tensor)
                loaded.add((target, shard))
                continue
            mod_name, _, param_name = name.rpartition(".")
            module = modules.get(mod_name)
            if param_name == "weight" and hasattr(module, "load_weight"):
                module.load_weight(tensor, name=name)
            elif name in params:
                load_float(params[name].data, tensor, f"weight {name}")
            else:
                continue
            loaded.add((name, None))
        missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - loaded)
        if missing:
            raise ValueError(f"model file is missing {len(missing)} weights, e.g. {missing[:5]}: "
                             "the checkpoint is incomplete or does not match its config")
