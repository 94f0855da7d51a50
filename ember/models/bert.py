"""BERT-family encoders (``BertModel``: all-MiniLM-L6-v2, bge-small-en-v1.5, ...) for embeddings: absolute position
embeddings, token type 0, post-LayerNorm blocks, GELU MLP, bidirectional attention.

Attention here is a plain SDPA over each prompt's own tokens, not ember's paged attention: the paged backends are
causal (a decoder's row sees only the positions before it) and keep KV for later steps, while an encoder's row sees
its whole prompt and nothing outlives the step. So the engine runs an encoder's prompt in one step (no chunked
prefill, no prefix cache: ``EngineCore``) and the worker allocates no KV pool (``Worker``: ``encoder_only``)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.config import ModelShape
from ember.distributed import ParallelContext
from ember.layers.attention import AttentionMetadata
from ember.layers.base import Layer
from ember.layers.linear import Linear, load_float
from ember.layers.norm import LayerNorm
from ember.quantization import QuantConfig

_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
_ONEDNN_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # oneDNN's GELU post-op


class EncoderLayer(Layer):
    def __init__(self, config: Any, dtype: torch.dtype, quant: QuantConfig | None) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads = config.num_attention_heads
        self.head_dim = h // self.num_heads
        self.qkv = Linear(h, 3 * h, True, dtype, quant)  # query, key, value stacked
        self.attn_out = Linear(h, h, True, dtype, quant)
        self.attn_norm = LayerNorm(h, eps, dtype)
        self.up = Linear(h, config.intermediate_size, True, dtype, quant)
        self.down = Linear(config.intermediate_size, h, True, dtype, quant)
        self.out_norm = LayerNorm(h, eps, dtype)
        self.act = _ACTIVATIONS[config.hidden_act]
        self.fused_gelu = _ONEDNN_GELU.get(config.hidden_act)

    def attend(self, qkv: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """Each prompt's tokens attend to all of that prompt's tokens (no mask within a prompt, none across). One
        call a prompt, 4-D ([1, heads, tokens, d]) so that the CPU takes its fused kernel, not the math path: at
        sentence lengths, measured faster than one masked call over the prompts padded to the longest."""
        n, d = qkv.shape[0], self.head_dim
        heads = qkv.view(1, n, 3, self.num_heads, d).permute(2, 0, 3, 1, 4)  # [3, 1, heads, n, d]
        out = torch.empty(1, self.num_heads, n, d, dtype=qkv.dtype, device=qkv.device)
        for start, length in spans:
            q, k, v = heads[:, :, :, start:start + length]
            out[:, :, start:start + length] = F.scaled_dot_product_attention(q, k, v)
        return out[0].transpose(0, 1).reshape(n, self.num_heads * d)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        up = self.up
        if up.prepacked is not None and self.fused_gelu is not None and x.dim() == 2:
            # oneDNN's packed weight (batch_invariant=False): bias and GELU in the GEMM's epilogue, one pass
            h = torch.ops.mkldnn._linear_pointwise(x, up.prepacked.packed, up.bias, "gelu", [], self.fused_gelu)
        else:
            h = self.act(up(x))
        return self.down(h)

    def forward(self, x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        x = self.attn_norm(x + self.attn_out(self.attend(self.qkv(x), spans)))
        return self.out_norm(x + self.mlp(x))


class _Heads:
    """What the worker reads of a model's heads: an encoder keeps no KV."""

    num_kv_heads = 0


class BertModel(Layer):
    """The encoder; its forward returns the last layer's hidden states (what sentence-transformers pools)."""

    encoder_only = True

    def __init__(self, architecture: str, config: Any, max_position: int, dtype: torch.dtype,
                 quant: QuantConfig | None = None, parallel: ParallelContext = ParallelContext()) -> None:
        super().__init__()
        if parallel.world_size > 1:
            raise ValueError(f"{architecture}: tensor_parallel_size=1 and pipeline_parallel_size=1 are supported "
                             "for encoders (a small model: run one engine a device)")
        kind = getattr(config, "position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"position_embedding_type={kind!r} is not supported: use one of ['absolute']")
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported: use one of {sorted(_ACTIVATIONS)}")
        self.config = config
        self.shape = ModelShape.of(config)
        self.heads = _Heads()
        h = config.hidden_size

        def table(rows: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(rows, h, dtype=dtype), requires_grad=False)

        self.word_embeddings = table(config.vocab_size)
        self.position_embeddings = table(config.max_position_embeddings)
        self.token_type_embeddings = table(getattr(config, "type_vocab_size", 2))
        self.embed_norm = LayerNorm(h, config.layer_norm_eps, dtype)
        self.layers = nn.ModuleList(EncoderLayer(config, dtype, quant) for _ in range(config.num_hidden_layers))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                intermediate: Any = None, lora: Any = None) -> torch.Tensor:
        """ids and positions of whole prompts, each in one step: one-token prompts come as the step's decode rows,
        the others as its prefill spans."""
        spans = [(i, 1) for i in range(meta.num_decode)] + [(p.start, p.length) for p in meta.prefills]
        x = self.word_embeddings[ids] + self.position_embeddings[positions] + self.token_type_embeddings[0]
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, spans)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{self.config.architectures}: an encoder has no LM head; it serves pooling requests only")

    def attention_layers(self) -> list[Any]:
        return []  # no paged attention: no KV pool

    def enable_lora(self, max_loras: int, max_rank: int, device: torch.device) -> None:
        raise ValueError("enable_lora=True is not supported for encoders: leave it False")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Hugging Face names (a ``bert.`` prefix, as task heads save it, is dropped; the pooler and any task head
        are not read); every tensor the encoder holds must come."""
        h = self.config.hidden_size
        loaded: set[str] = set()  # the checkpoint names read
        for name, value in weights:
            name = name.removeprefix("bert.").replace("LayerNorm.gamma", "LayerNorm.weight") \
                .replace("LayerNorm.beta", "LayerNorm.bias")
            target = self._target(name)
            if target is None:
                continue
            module, attr, offset = target
            if isinstance(module, Linear) and attr == "weight":
                module.load_weight(value, (offset or 0) * h, name)
            else:
                param = getattr(module, attr) if attr else module
                rows = value.shape[0]
                load_float(param.data[offset * h:offset * h + rows] if offset is not None else param.data, value,
                           name)
            loaded.add(name)
        missing = sorted(self._expected() - loaded)
        if missing:
            raise ValueError(f"{missing[0]} is not in the checkpoint ({len(missing)} encoder tensors missing): is it a "
                             "BertModel checkpoint?")

    def _expected(self) -> set[str]:
        """Every checkpoint name the encoder must read."""
        names = {f"embeddings.{t}_embeddings.weight" for t in ("word", "position", "token_type")}
        names |= {f"embeddings.LayerNorm.{a}" for a in ("weight", "bias")}
        parts = [*self._QKV, *self._IN_LAYER]
        names |= {f"encoder.layer.{i}.{p}.{a}" for i in range(len(self.layers)) for p in parts
                  for a in ("weight", "bias")}
        return names

    _LAYER = re.compile(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")
    _IN_LAYER = {"attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
                 "intermediate.dense": "up", "output.dense": "down", "output.LayerNorm": "out_norm"}
    _QKV = {"attention.self.query": 0, "attention.self.key": 1, "attention.self.value": 2}

    def _target(self, name: str) -> tuple[Any, str, int | None] | None:
        """(module or parameter, attribute, which third of qkv) a checkpoint tensor fills; None: not read."""
        tables = {"embeddings.word_embeddings.weight": self.word_embeddings,
                  "embeddings.position_embeddings.weight": self.position_embeddings,
                  "embeddings.token_type_embeddings.weight": self.token_type_embeddings}
        if name in tables:
            return tables[name], "", None
        if name.startswith("embeddings.LayerNorm."):
            return self.embed_norm, name.rsplit(".", 1)[1], None
        m = self._LAYER.match(name)
        if m is None:
            return None  # pooler.dense, embeddings.position_ids, task heads
        index, part, attr = int(m.group(1)), m.group(2), m.group(3)
        if index >= len(self.layers):
            return None
        layer = self.layers[index]
        if part in self._QKV:
            return layer.qkv, attr, self._QKV[part]
        if part in self._IN_LAYER:
            return getattr(layer, self._IN_LAYER[part]), attr, None
        return None
