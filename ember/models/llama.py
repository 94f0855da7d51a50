"""The Llama family in one implementation: Llama / SmolLM2, Mistral, Qwen2 / Qwen2.5 and Qwen3.

The families differ only in switches read from the config: bias on the QKV projection (Qwen2), RMSNorm on each
query and key head (Qwen3), tied or separate LM head, sliding-window layers. The model sees one flat batch of
tokens ``[T]`` with their positions and the attention metadata; it never sees padding.

Split over ranks (``ParallelContext``), a rank builds only its part: its attention heads and KV heads, its slice of
the MLP, its vocabulary rows (tensor parallelism, as Megatron splits a decoder), and only its stage's layers
(pipeline parallelism; the others are empty placeholders so checkpoint names keep their global layer numbers).
``weight_slice`` tells the checkpoint reader which part of each tensor this rank reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ember.config import ModelShape
from ember.distributed import ParallelContext, WeightSlice, layer_range
from ember.layers.activation import silu_and_mul
from ember.layers.attention import AttentionMetadata, PagedAttention
from ember.layers.base import Layer
from ember.layers.embedding import LMHead, VocabEmbedding, vocab_range
from ember.layers.linear import Linear, MergedLinear, load_float, row_parallel_linear
from ember.layers.lora import LoRABatch, LoRAStack
from ember.layers.norm import RMSNorm
from ember.layers.rotary import RotaryEmbedding, rotate_in_place
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
    if architecture == "Qwen2MoeForCausalLM":
        return FamilySwitches(qkv_bias=bool(getattr(config, "qkv_bias", True)), o_bias=False, qk_norm=False)
    if architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        return FamilySwitches(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
    return FamilySwitches(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=False)


def layer_windows(architecture: str, config: Any) -> list[int | None]:
    """The sliding window of each layer, None for full attention, as transformers decides it."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):  # every layer, when set
        return [window] * n
    layer_types = getattr(config, "layer_types", None)
    if layer_types and window:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if getattr(config, "use_sliding_window", False) and window:
        start = getattr(config, "max_window_layers", n)
        return [window if i >= start else None for i in range(n)]
    return [None] * n


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """The attention heads of one TP rank: query heads [q_start, q_start + num_heads) and KV heads [kv_start,
    kv_start + num_kv_heads). With more ranks than KV heads each KV head is replicated on T / num_kv_heads ranks
    (as vLLM does), so a rank's query heads always find their KV head locally."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int

    @classmethod
    def of(cls, shape: ModelShape, parallel: ParallelContext) -> "HeadSplit":
        t, r = parallel.tp_size, parallel.tp_rank
        nq = shape.num_heads // t
        if shape.num_kv_heads >= t:
            nkv = shape.num_kv_heads // t
            return cls(nq, nkv, r * nq, r * nkv)
        return cls(nq, 1, r * nq, r * shape.num_kv_heads // t)


class Attention(Layer):
    def __init__(self, config: Any, sw: FamilySwitches, window: int | None, dtype: torch.dtype,
                 quant: QuantConfig | None, parallel: ParallelContext, scale: float | None = None,
                 norm: type[RMSNorm] = RMSNorm, softcap: float | None = None) -> None:
        """scale: the scores' scale (None: head_dim ** -0.5); norm: the q / k norms' class (Gemma's offset);
        softcap: the scores' tanh soft-cap (Gemma 2)."""
        super().__init__()
        shape = ModelShape.of(config)
        split = HeadSplit.of(shape, parallel)
        self.num_heads, self.num_kv_heads, self.head_dim = split.num_heads, split.num_kv_heads, shape.head_dim
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, {"q": q, "k": kv, "v": kv}, sw.qkv_bias, dtype, quant)
        self.o_proj = row_parallel_linear(q, config.hidden_size, sw.o_bias, dtype, quant, parallel,
                                          shape.num_heads * shape.head_dim)
        self.q_norm = norm(self.head_dim, config.rms_norm_eps, dtype) if sw.qk_norm else None
        self.k_norm = norm(self.head_dim, config.rms_norm_eps, dtype) if sw.qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, window, scale, softcap)
        self.split = (q, kv, kv)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata,
                lora: LoRABatch | None = None) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x, lora)
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        v = qkv[:, (nq + nkv) * d:].view(T, nkv, d)
        if self.q_norm is None:  # Q and K are adjacent: one rotation for both
            qk = rotate_in_place(qkv[:, :(nq + nkv) * d].view(T, nq + nkv, d), *rope)
            q, k = qk[:, :nq], qk[:, nq:]
        else:
            # Q and K are slices of the projection's new output: normalised where they lie when contiguous (one
            # token), then rotated in place (one kernel pass each, eager's rounding)
            q = rotate_in_place(self.q_norm(qkv[:, :nq * d].reshape(T, nq, d), overwrite=True), *rope)
            k = rotate_in_place(self.k_norm(qkv[:, nq * d:(nq + nkv) * d].reshape(T, nkv, d), overwrite=True), *rope)
        return self.o_proj(self.attn(q, k, v, meta), lora)


class MLP(Layer):
    def __init__(self, config: Any, dtype: torch.dtype, quant: QuantConfig | None, parallel: ParallelContext,
                 act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul) -> None:
        """act: the gated activation, act(gate) * up over the fused projection's output."""
        super().__init__()
        self.act = act
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size // parallel.tp_size
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate": inter, "up": inter}, bias, dtype, quant)
        self.down_proj = row_parallel_linear(inter, config.hidden_size, bias, dtype, quant, parallel,
                                             config.intermediate_size)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x, lora)), lora)


class DecoderLayer(Layer):
    rope_kind = "all"  # which of the model's RoPE tables the layer reads (LlamaModel.make_ropes)

    def __init__(self, config: Any, sw: FamilySwitches, window: int | None, dtype: torch.dtype,
                 quant: QuantConfig | None, parallel: ParallelContext, mlp: Layer | None = None,
                 attention: Layer | None = None) -> None:
        """mlp / attention: a family's own sublayer in place of the Llama one (a sparse MoE, OLMoE's attention)."""
        super().__init__()
        self.self_attn = attention if attention is not None else Attention(config, sw, window, dtype, quant, parallel)
        self.mlp = mlp if mlp is not None else MLP(config, dtype, quant, parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, lora: LoRABatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the previous sublayer's output, residual the stream before it (None in the first layer)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, meta, lora)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, lora), residual


class MissingLayer(nn.Module):
    """A layer another pipeline stage holds: keeps the layer numbering, holds nothing."""


class LlamaModel(Layer):
    """The decoder stack. A family over these layers changes what differs through its hooks: ``make_layer`` (its
    decoder layers), ``make_ropes`` (one RoPE table, or one a kind of layer), ``embed`` and ``norm_class``."""

    norm_class: type[RMSNorm] = RMSNorm  # the final norm's

    def __init__(self, architecture: str, config: Any, max_position: int, dtype: torch.dtype,
                 quant: QuantConfig | None = None, parallel: ParallelContext = ParallelContext()) -> None:
        super().__init__()
        sw = family_switches(architecture, config)
        self.parallel, self.dtype = parallel, dtype
        self.start, self.stop = layer_range(config.num_hidden_layers, parallel.pp_size, parallel.pp_rank)
        self.ropes = nn.ModuleDict(self.make_ropes(config, ModelShape.of(config).head_dim, max_position))
        tied = bool(getattr(config, "tie_word_embeddings", False))
        # the last stage holds the table too when the LM head is tied to it
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype,
                                           quant is not None and quant.embeddings, parallel,
                                           as_stored=quant is not None and quant.mixed) \
            if parallel.is_first_stage or (tied and parallel.is_last_stage) else None
        self.layers = nn.ModuleList(
            self.make_layer(architecture, config, i, sw, w, dtype, quant, parallel) if self.start <= i < self.stop
            else MissingLayer() for i, w in enumerate(layer_windows(architecture, config))
        )
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps, dtype) if parallel.is_last_stage else None
        self.local_layers = [self.layers[i] for i in range(self.start, self.stop)]  # a plain list: no lookup a step

    def make_ropes(self, config: Any, head_dim: int, max_position: int) -> dict[str, RotaryEmbedding]:
        """The RoPE tables by the ``rope_kind`` of the layers that read them: one for every layer here."""
        return {DecoderLayer.rope_kind: RotaryEmbedding(config, head_dim, max_position)}

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def make_layer(self, architecture: str, config: Any, index: int, sw: FamilySwitches, window: int | None,
                   dtype: torch.dtype, quant: QuantConfig | None, parallel: ParallelContext) -> Layer:
        """Decoder layer ``index``; a family whose layers differ in a sublayer builds them here."""
        return DecoderLayer(config, sw, window, dtype, quant, parallel)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None, lora: LoRABatch | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """This stage's layers. The first stage embeds ``ids``; later stages continue from ``intermediate``, the
        previous stage's (x, residual). The last stage returns the normed hidden states, the others (x, residual).
        lora: which adapter slot each row uses (None: every row runs the base model)."""
        if intermediate is None:
            x, residual = self.embed(ids), None
        else:
            x, residual = intermediate
        ropes = {k: rope.cos_sin(positions, x.dtype, meta) for k, rope in self.ropes.items()}  # once a step a table
        for layer in self.local_layers:
            x, residual = layer(ropes[layer.rope_kind], x, residual, meta, lora)
        if self.norm is None:
            return x, residual
        return self.norm(x, residual)[0]


# checkpoint name part -> (fused parameter, shard)
_STACKED = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
}


class LlamaForCausalLM(Layer):
    model_class: type[Layer] = LlamaModel  # a family over these layers builds its own decoder stack here
    calibrated = True  # AWQ / SmoothQuant scales fold into input_layernorm / post_attention_layernorm

    def __init__(self, architecture: str, config: Any, max_position: int, dtype: torch.dtype,
                 quant: QuantConfig | None = None, parallel: ParallelContext = ParallelContext()) -> None:
        super().__init__()
        self.config = config
        self.quant = quant
        self.parallel = parallel
        self.shape = ModelShape.of(config)
        self.heads = HeadSplit.of(self.shape, parallel)
        self.model = self.model_class(architecture, config, max_position, dtype, quant, parallel)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, dtype,
                              tied_to=self.model.embed_tokens if self.tied else None,
                              quantized=quant is not None and quant.embeddings,
                              parallel=parallel, as_stored=quant is not None and quant.mixed
                              ) if parallel.is_last_stage else None

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None, lora: LoRABatch | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.model(ids, positions, meta, intermediate, lora)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits; None on TP ranks other than 0 (they only lend their vocabulary slice)."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        """This stage's attention layers, in order (the KV pool holds these and no others)."""
        return [layer.self_attn.attn for layer in self.model.local_layers]

    def _projections(self) -> Iterable[Linear]:
        for layer in self.model.local_layers:
            yield from (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)

    def enable_lora(self, max_loras: int, max_rank: int, device: torch.device) -> None:
        """Adapter slots on every projection of this stage's layers (zeros until an adapter is loaded)."""
        for proj in self._projections():
            proj.enable_lora(max_loras, max_rank, self.model.dtype, device)

    def lora_stacks(self) -> list[LoRAStack]:
        return [proj.lora for proj in self._projections()]

    def lora_target(self, layer: int, proj: str) -> tuple[LoRAStack, int] | None:
        """The stack holding an adapter's module ``proj`` (Hugging Face name) of ``layer`` and its part there; None
        when another stage holds the layer."""
        if not self.model.start <= layer < self.model.stop:
            return None
        decoder = self.model.layers[layer]
        fused, shard = _STACKED.get(proj, (proj, None))
        module = getattr(decoder.self_attn if fused in ("qkv_proj", "o_proj") else decoder.mlp, fused)
        part = 0 if shard is None else list(module.shard_offsets).index(shard)
        return module.lora, part

    def weight_slice(self, name: str) -> WeightSlice | None:
        """The part of checkpoint tensor ``name`` (Hugging Face naming) this rank holds: None when it holds none of
        it (another stage's layer, a tied head), else a row or column slice, or the whole tensor."""
        p = self.parallel
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and len(parts) > 2:
            layer = int(parts[2])
            if not self.model.start <= layer < self.model.stop:
                return None
            if p.tp_size == 1:
                return WeightSlice()
            d, h, inter = self.shape.head_dim, self.heads, self.config.intermediate_size // p.tp_size
            proj, kind = parts[-2], parts[-1]
            if proj == "q_proj":
                return WeightSlice(0, h.q_start * d, (h.q_start + h.num_heads) * d)
            if proj in ("k_proj", "v_proj"):
                return WeightSlice(0, h.kv_start * d, (h.kv_start + h.num_kv_heads) * d)
            if proj in ("gate_proj", "up_proj"):
                return WeightSlice(0, p.tp_rank * inter, (p.tp_rank + 1) * inter)
            if proj == "o_proj" and kind == "weight":
                return WeightSlice(1, h.q_start * d, (h.q_start + h.num_heads) * d)
            if proj == "down_proj" and kind == "weight":
                return WeightSlice(1, p.tp_rank * inter, (p.tp_rank + 1) * inter)
            return WeightSlice()  # norms and row-parallel biases: every rank holds them whole
        if name.startswith("model.embed_tokens."):
            return self._vocab_slice() if self.model.embed_tokens is not None else None
        if name.startswith("lm_head."):
            return self._vocab_slice() if self.lm_head is not None and not self.tied else None
        if name.startswith("model.norm."):
            return WeightSlice() if self.model.norm is not None else None
        return WeightSlice()

    def _vocab_slice(self) -> WeightSlice:
        if self.parallel.tp_size == 1:
            return WeightSlice()
        return WeightSlice(0, *vocab_range(self.config.vocab_size, self.parallel))

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
