"""The Mixture-of-Experts families over the Llama family's layers: Qwen3-MoE, Qwen2-MoE (a gated shared expert),
Mixtral and OLMoE. Attention is the Llama one (OLMoE's q / k norms over the whole projection: ``OlmoeAttention``);
each sparse layer's MLP is ``layers.moe.SparseMoE``; Qwen's ``mlp_only_layers`` / ``decoder_sparse_step`` keep some
layers dense. What each family's config calls its experts is read once into ``MoEShape``.

Checkpoint names: ``mlp.experts.E.{gate,up,down}_proj`` (Qwen, OLMoE), Mixtral's ``block_sparse_moe.experts.E.
{w1,w3,w2}`` (read as the former), ``mlp.gate`` the router, ``mlp.shared_expert*`` Qwen2-MoE's shared expert.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ember.config import ModelShape
from ember.distributed import ParallelContext, WeightSlice
from ember.distributed.comm import all_reduce
from ember.layers.activation import gated_activation
from ember.layers.attention import AttentionMetadata
from ember.layers.base import Layer
from ember.layers.linear import Linear
from ember.layers.lora import LoRABatch
from ember.layers.moe import MoEShape, SparseMoE
from ember.layers.norm import RMSNorm
from ember.layers.rotary import rotate_in_place
from ember.models.llama import Attention, DecoderLayer, FamilySwitches, LlamaForCausalLM, LlamaModel
from ember.quantization import QuantConfig, QuantizedTensor

_QWEN = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
_MIXTRAL_NAMES = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def moe_shape(architecture: str, config: Any) -> MoEShape:
    if architecture == "MixtralForCausalLM":
        return MoEShape(int(config.num_local_experts), int(config.num_experts_per_tok), int(config.intermediate_size),
                        True)
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size  # OLMoE: intermediate_size
    shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0) \
        if architecture == "Qwen2MoeForCausalLM" else 0
    return MoEShape(int(config.num_experts), int(config.num_experts_per_tok), int(inter),
                    bool(getattr(config, "norm_topk_prob", False)), shared)


def sparse_layers(architecture: str, config: Any) -> list[bool]:
    """Which layers route to experts (transformers' rule: Qwen's mlp_only_layers and decoder_sparse_step)."""
    n = config.num_hidden_layers
    if architecture not in _QWEN:
        return [True] * n
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return [i not in dense and (i + 1) % step == 0 for i in range(n)]


class OlmoeAttention(Attention):
    """OLMoE: q and k normed over the whole projection (every head at once), then optionally clipped (clip_qkv).
    Split over ranks, each holds its heads' slice of the norm and the sum of squares is all-reduced."""

    def __init__(self, config: Any, window: int | None, dtype: torch.dtype, quant: QuantConfig | None,
                 parallel: ParallelContext) -> None:
        shape = ModelShape.of(config)
        if parallel.tp_size > 1 and shape.num_kv_heads % parallel.tp_size:
            raise ValueError(f"OLMoE's k norm spans every KV head: num_key_value_heads={shape.num_kv_heads} must "
                             f"split evenly over tensor_parallel_size={parallel.tp_size}")
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, FamilySwitches(bias, bias, False), window, dtype, quant, parallel)
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        self.q_norm_full = RMSNorm(nq * d, config.rms_norm_eps, dtype)
        self.k_norm_full = RMSNorm(nkv * d, config.rms_norm_eps, dtype)
        self.widths = (shape.num_heads * d, shape.num_kv_heads * d)
        self.clip = getattr(config, "clip_qkv", None)
        self.parallel = parallel

    def _norm(self, norm: RMSNorm, x: torch.Tensor, width: int) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return norm(x.contiguous())
        h = x.float()
        squares = all_reduce(h.pow(2).sum(-1, keepdim=True), self.parallel)
        return norm.weight * (h * torch.rsqrt(squares / width + norm.eps)).to(x.dtype)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata,
                lora: LoRABatch | None = None) -> torch.Tensor:
        T, (nq, nkv, d) = x.shape[0], (self.num_heads, self.num_kv_heads, self.head_dim)
        qkv = self.qkv_proj(x, lora)
        q = self._norm(self.q_norm_full, qkv[:, :nq * d], self.widths[0])
        k = self._norm(self.k_norm_full, qkv[:, nq * d:(nq + nkv) * d], self.widths[1])
        v = qkv[:, (nq + nkv) * d:]
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = rotate_in_place(q.reshape(T, nq, d), *rope)  # new tensors (the norms' outputs): rotated in place
        k = rotate_in_place(k.reshape(T, nkv, d), *rope)
        return self.o_proj(self.attn(q, k, v.reshape(T, nkv, d), meta), lora)


class MoEModel(LlamaModel):
    def make_layer(self, architecture: str, config: Any, index: int, sw: FamilySwitches, window: int | None,
                   dtype: torch.dtype, quant: QuantConfig | None, parallel: ParallelContext) -> Layer:
        mlp = None
        if sparse_layers(architecture, config)[index]:
            act = gated_activation("hidden_act", getattr(config, "hidden_act", "silu"))
            mlp = SparseMoE(config.hidden_size, moe_shape(architecture, config), act, dtype, quant, parallel)
        attention = OlmoeAttention(config, window, dtype, quant, parallel) \
            if architecture == "OlmoeForCausalLM" else None
        return DecoderLayer(config, sw, window, dtype, quant, parallel, mlp, attention)


Tensor = torch.Tensor | QuantizedTensor


class MoEForCausalLM(LlamaForCausalLM):
    model_class = MoEModel
    calibrated = False  # AWQ / SmoothQuant would need statistics per expert

    def __init__(self, architecture: str, config: Any, max_position: int, dtype: torch.dtype,
                 quant: QuantConfig | None = None, parallel: ParallelContext = ParallelContext()) -> None:
        self.moe = moe_shape(architecture, config)
        self.mixtral = architecture == "MixtralForCausalLM"
        self.olmoe = architecture == "OlmoeForCausalLM"
        super().__init__(architecture, config, max_position, dtype, quant, parallel)

    def _projections(self) -> Iterable[Linear]:
        raise ValueError("LoRA adapters on Mixture-of-Experts models are not supported")

    def _name(self, name: str) -> str:
        """Mixtral's checkpoint names in the Qwen / OLMoE spelling the model uses."""
        if not self.mixtral:
            return name
        return ".".join(_MIXTRAL_NAMES.get(p, p) for p in name.split("."))

    def weight_slice(self, name: str) -> WeightSlice | None:
        name = self._name(name)
        p, proj = self.parallel, name.split(".")[-2]
        whole = super().weight_slice(name)
        if p.tp_size == 1 or whole is None:
            return whole
        if ".mlp.experts." in name or ".mlp.shared_expert." in name:
            full = self.moe.intermediate_size if ".experts." in name else self.moe.shared_intermediate_size
            inter = full // p.tp_size
            if proj in ("gate_proj", "up_proj"):
                return WeightSlice(0, p.tp_rank * inter, (p.tp_rank + 1) * inter)
            return WeightSlice(1, p.tp_rank * inter, (p.tp_rank + 1) * inter)  # down_proj
        if proj in ("q_norm", "k_norm") and self.olmoe:  # over the whole projection: this rank's heads' part
            return super().weight_slice(name.replace(f"{proj}.", f"{proj[0]}_proj."))
        return whole  # the router and the shared expert's gate are whole on every rank, as norms are

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        super().load_weights(self._renamed(weights))

    def _renamed(self, weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in weights:
            name = self._name(name)
            if self.olmoe:
                name = name.replace(".self_attn.q_norm.", ".self_attn.q_norm_full.").replace(
                    ".self_attn.k_norm.", ".self_attn.k_norm_full.")
            yield name, tensor
