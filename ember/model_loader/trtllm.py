"""Read a TensorRT-LLM checkpoint folder (the format ``examples/llama/convert_checkpoint.py`` writes, v0.9 on):
``config.json`` (TensorRT-LLM's PretrainedConfig: singular ``architecture``, ``mapping``, ``quantization``) and one
``rank{N}.safetensors`` per rank, N = pp_rank * tp_size + tp_rank. Llama family, unquantized float weights only.

Each rank file holds its tensor-parallel share of every weight and only its pipeline stage's layers (numbered from 0
in each stage). We give the weights back under Hugging Face names, the shares joined again:

=================================================  ==========================================  ====================
TensorRT-LLM (per rank)                            Hugging Face                                joined along
=================================================  ==========================================  ====================
transformer.vocab_embedding.weight                 model.embed_tokens.weight                   whole on every rank,
                                                                                               or embedding_sharding
                                                                                               _dim if use_parallel
                                                                                               _embedding
transformer.layers.N.input_layernorm.weight        model.layers.N.input_layernorm.weight       whole on every rank
transformer.layers.N.attention.qkv.weight / bias   self_attn.{q,k,v}_proj: each rank's rows    dim 0
                                                   are [q_r; k_r; v_r]
transformer.layers.N.attention.dense.weight        self_attn.o_proj.weight                     dim 1
transformer.layers.N.attention.dense.bias          self_attn.o_proj.bias                       whole on every rank
transformer.layers.N.post_layernorm.weight         model.layers.N.post_attention_layernorm     whole on every rank
transformer.layers.N.mlp.fc.weight / bias          mlp.gate_proj (the SiLU-gated half)         dim 0
transformer.layers.N.mlp.gate.weight / bias        mlp.up_proj                                 dim 0
transformer.layers.N.mlp.proj.weight               mlp.down_proj.weight                        dim 1
transformer.layers.N.mlp.proj.bias                 mlp.down_proj.bias                          whole on every rank
transformer.ln_f.weight                            model.norm.weight                           whole (last stage)
lm_head.weight                                     lm_head.weight (absent: tied embeddings)    dim 0, vocabulary
                                                                                               padded to a multiple
                                                                                               of tp_size: trimmed
=================================================  ==========================================  ====================

When there are fewer KV heads than tp_size the converter repeats each KV head over tp_size / num_key_value_heads
consecutive ranks; we read each head once. ``select`` is applied before reading: only the rank files' rows and
columns that the slice covers are read (the files are memory-mapped).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from ember.distributed import WeightSlice
from ember.errors import ConfigError
from ember.model_loader.hf import Select, load_generation_config, read_all

logger = logging.getLogger("ember")

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
# files any of which makes a folder's tokenizer loadable by transformers
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
_LAYER = re.compile(r"transformer\.layers\.(\d+)\.(.+)")
# per-layer tensors: TensorRT-LLM suffix -> (Hugging Face suffix, how the ranks' shares join: 0 / 1 = that dim,
# None = every rank holds it whole). attention.qkv is handled apart (three Hugging Face tensors).
_LAYER_TENSORS = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "post_layernorm.weight": ("post_attention_layernorm.weight", None),
    "attention.dense.weight": ("self_attn.o_proj.weight", 1),
    "attention.dense.bias": ("self_attn.o_proj.bias", None),
    "mlp.fc.weight": ("mlp.gate_proj.weight", 0),
    "mlp.fc.bias": ("mlp.gate_proj.bias", 0),
    "mlp.gate.weight": ("mlp.up_proj.weight", 0),
    "mlp.gate.bias": ("mlp.up_proj.bias", 0),
    "mlp.proj.weight": ("mlp.down_proj.weight", 1),
    "mlp.proj.bias": ("mlp.down_proj.bias", None),
}
_QKV = ("attention.qkv.weight", "attention.qkv.bias")
_IGNORED = ("attention.kv_cache_scaling_factor",)  # a KV-cache quantization scale: ember keeps its cache in float
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def trtllm_folder_kind(path: str) -> str | None:
    """'checkpoint' for a folder whose config.json is TensorRT-LLM's PretrainedConfig (singular ``architecture``),
    'engine' for a built engine folder (config.json with ``pretrained_config`` and ``build_config``), else None."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None  # the Hugging Face reader reports it
    if not isinstance(config, dict):
        return None
    if "pretrained_config" in config and "build_config" in config:
        return "engine"
    if isinstance(config.get("architecture"), str) and "architectures" not in config:
        return "checkpoint"
    return None


@dataclass(frozen=True, slots=True)
class _Part:
    """One rank's share of a Hugging Face tensor: rows [row0, row1) of tensor ``key`` in rank file ``rank``
    (row1 None: to its end)."""

    rank: int
    key: str
    row0: int = 0
    row1: int | None = None


@dataclass(frozen=True, slots=True)
class _Joined:
    """A Hugging Face tensor as the ranks' parts joined along ``dim``, its first dimension cut to ``rows`` (the
    vocabulary padding left out; None: all of it)."""

    dim: int
    parts: tuple[_Part, ...]
    rows: int | None = None


class TRTLLMCheckpoint:
    """A TensorRT-LLM checkpoint folder behind the interface every checkpoint kind shares (see
    model_loader.open_checkpoint)."""

    kind = "trtllm"

    def __init__(self, path: str) -> None:
        self.path = path
        if trtllm_folder_kind(path) == "engine":
            raise ConfigError(f"model={path!r} is a built TensorRT-LLM engine folder: engines cannot be loaded; pass "
                              "the TensorRT-LLM checkpoint folder it was built from (config.json + rank*.safetensors) "
                              "or the Hugging Face folder")
        file = os.path.join(path, "config.json")
        try:
            with open(file) as f:
                self.config: dict[str, Any] = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"model={path!r}: config.json could not be read ({e})") from e
        mapping = self.config.get("mapping") or {}
        self.tp_size = int(mapping.get("tp_size", 1) or 1)
        self.pp_size = int(mapping.get("pp_size", 1) or 1)
        world = int(mapping.get("world_size", self.tp_size * self.pp_size) or 1)
        if world % (self.tp_size * self.pp_size):
            raise ConfigError(f"model={path!r}: mapping world_size={world} is not a multiple of tp_size={self.tp_size} "
                              f"x pp_size={self.pp_size}")
        self.rank_files = [os.path.join(path, f"rank{r}.safetensors") for r in range(self.tp_size * self.pp_size)]
        missing = [os.path.basename(f) for f in self.rank_files if not os.path.isfile(f)]
        if missing:
            raise ConfigError(f"model={path!r} is a TensorRT-LLM checkpoint of tp_size={self.tp_size} x "
                              f"pp_size={self.pp_size} ranks but lacks {missing}")
        self._hf_config: Any = None
        self._stages: list[int] | None = None
        self._tied: bool | None = None

    # ---------------------------------------------------------------- config

    def _check_supported(self) -> None:
        c = self.config
        arch = c.get("architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"model={self.path!r}: TensorRT-LLM architecture={arch!r} is not supported: ember reads "
                              f"TensorRT-LLM checkpoints of the Llama family {list(SUPPORTED_ARCHITECTURES)}; load "
                              "the Hugging Face folder instead")
        missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers") if not c.get(k)]
        if missing:
            raise ConfigError(f"model={self.path!r}: the TensorRT-LLM config.json lacks {missing}")
        self._check_quantization()
        problems = []
        position = str(c.get("position_embedding_type", "rope_gpt_neox")).rsplit(".", 1)[-1]
        if position != "rope_gpt_neox":
            problems.append(f"position_embedding_type={position!r} (only 'rope_gpt_neox')")
        act = c.get("hidden_act", "silu")
        if act not in ("silu", "swiglu"):
            problems.append(f"hidden_act={act!r} (only 'silu')")
        head = self._head_size()
        rotary_dim = c.get("rotary_embedding_dim")
        if rotary_dim is not None and int(rotary_dim) != head:
            problems.append(f"rotary_embedding_dim={rotary_dim} (partial rotary; only the head size {head})")
        moe = c.get("moe") if isinstance(c.get("moe"), dict) else {}
        experts = int(moe.get("num_experts", 0) or c.get("moe_num_experts", 0) or 0)
        if experts:
            problems.append(f"moe num_experts={experts} (mixture of experts)")
        for key in ("residual_mlp", "qk_layernorm"):
            if c.get(key):
                problems.append(f"{key}={c[key]!r}")
        for key in ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "output_multiplier_scale"):
            if float(c.get(key, 1.0) or 1.0) != 1.0:
                problems.append(f"{key}={c[key]!r}")
        if problems:
            raise ConfigError(f"model={self.path!r}: this TensorRT-LLM checkpoint uses what ember does not support: "
                              f"{', '.join(problems)}")

    def _check_quantization(self) -> None:
        quant = self.config.get("quantization") or {}
        algo = quant.get("quant_algo")
        if algo:
            raise ConfigError(
                f"model={self.path!r} is a quantized TensorRT-LLM checkpoint (quantization.quant_algo={algo!r}): "
                "ember reads unquantized TensorRT-LLM checkpoints only (float16, bfloat16 or float32 weights, "
                "quant_algo null); convert the model again without quantization (or load its Hugging Face folder) "
                "and let ember quantize at load time (quantization='int8' or 'int4')")

    def _head_size(self) -> int:
        c = self.config
        return int(c.get("head_size") or c["hidden_size"] // c["num_attention_heads"])

    def hf_config(self) -> Any:
        if self._hf_config is not None:
            return self._hf_config
        from transformers import AutoConfig

        self._check_supported()
        c = self.config
        kv_algo = (c.get("quantization") or {}).get("kv_cache_quant_algo")
        if kv_algo:  # the weights are float; the file's kv_cache_scaling_factor tensors are skipped
            logger.warning("TensorRT-LLM checkpoint %s: kv_cache_quant_algo=%r is ignored (ember keeps its KV cache "
                           "in the model's dtype)", self.path, kv_algo)
        try:
            heads = int(c["num_attention_heads"])
            kwargs: dict[str, Any] = dict(
                vocab_size=int(c.get("vocab_size") or self._embedding_rows()),
                hidden_size=int(c["hidden_size"]),
                intermediate_size=int(c.get("intermediate_size") or 4 * int(c["hidden_size"])),
                num_hidden_layers=int(c["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(c.get("num_key_value_heads") or heads),
                head_dim=self._head_size(),
                hidden_act="silu",
                max_position_embeddings=int(c.get("max_position_embeddings") or 2048),
                rms_norm_eps=float(c.get("norm_epsilon", 1e-5)),
                rope_theta=float(c.get("rotary_base", 10000.0)),
                attention_bias=bool(c.get("attn_bias", False)),
                mlp_bias=bool(c.get("mlp_bias", False)),
                bos_token_id=c.get("bos_token_id"),
                eos_token_id=c.get("eos_token_id"),
                pad_token_id=c.get("pad_token_id"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"model={self.path!r}: a field of the TensorRT-LLM config.json is malformed ({e!r})"
                              ) from e
        if c.get("rotary_scaling"):
            kwargs["rope_scaling"] = dict(c["rotary_scaling"])
        if c.get("dtype") in _DTYPES:
            kwargs["dtype"] = c["dtype"]
        kwargs["tie_word_embeddings"] = self._is_tied()
        self._layer_counts()  # every stage's layers present, adding up to num_hidden_layers
        config = AutoConfig.for_model("llama", **kwargs)
        config.architectures = [c["architecture"]]
        self._hf_config = config
        return config

    def generation_config(self) -> dict[str, Any]:
        return load_generation_config(self.path)

    def native_quantization(self) -> None:
        self._check_quantization()  # a quantized checkpoint is refused, never read as float
        return None

    def tokenizer(self):
        from ember.tokenizer import Tokenizer

        if not any(os.path.isfile(os.path.join(self.path, f)) for f in TOKENIZER_FILES):
            raise ConfigError(f"model={self.path!r} is a TensorRT-LLM checkpoint with no tokenizer files "
                              f"({', '.join(TOKENIZER_FILES)}): pass tokenizer=<folder>, e.g. the Hugging Face folder "
                              "it was converted from")
        try:
            return Tokenizer.load(self.path)
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"model={self.path!r}: the tokenizer files in this TensorRT-LLM checkpoint could not be "
                              f"loaded ({e}); pass tokenizer=<folder>, e.g. the Hugging Face folder it was converted "
                              "from") from e

    # ---------------------------------------------------------------- rank files

    def _rank(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    def _keys(self, rank: int) -> list[str]:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(self.rank_files[rank], framework="pt") as f:
                return list(f.keys())
        except SafetensorError as e:
            raise ValueError(f"model file {self.rank_files[rank]!r} is corrupt: {e}") from e

    def _layer_counts(self) -> list[int]:
        """Each pipeline stage's decoder layers (its files number them from 0)."""
        if self._stages is None:
            counts = []
            for p in range(self.pp_size):
                local = {int(m.group(1)) for k in self._keys(self._rank(p, 0)) if (m := _LAYER.fullmatch(k))}
                if local != set(range(len(local))):
                    raise ConfigError(f"model={self.path!r}: {os.path.basename(self.rank_files[self._rank(p, 0)])} "
                                      f"holds layers {sorted(local)}, not 0..{len(local) - 1}")
                counts.append(len(local))
            total = int(self.config.get("num_hidden_layers", 0))
            if sum(counts) != total:
                raise ConfigError(f"model={self.path!r}: the rank files hold {sum(counts)} layers ({counts} a stage), "
                                  f"config.json says num_hidden_layers={total}")
            self._stages = counts
        return self._stages

    def _is_tied(self) -> bool:
        """The converter writes lm_head.weight (the embedding copied for tied models); a checkpoint exported with
        share_embedding_table leaves it out and the head reuses the embedding."""
        if self._tied is None:
            self._tied = "lm_head.weight" not in self._keys(self._rank(self.pp_size - 1, 0))
        return self._tied

    def _embedding_rows(self) -> int:
        from safetensors import safe_open

        with safe_open(self.rank_files[0], framework="pt") as f:
            rows = f.get_slice("transformer.vocab_embedding.weight").get_shape()[0]
        if self.config.get("use_parallel_embedding") and int(self.config.get("embedding_sharding_dim", 0)) == 0:
            rows *= self.tp_size
        return rows

    # ---------------------------------------------------------------- tensors

    def _layouts(self, files: list[Any], config: Any) -> Iterator[tuple[str, _Joined]]:
        """Every Hugging Face tensor of the checkpoint and how the ranks' parts make it up."""
        tp, c = self.tp_size, self.config
        vocab = int(config.vocab_size)
        first, last = range(tp), [self._rank(self.pp_size - 1, t) for t in range(tp)]
        key = "transformer.vocab_embedding.weight"
        if c.get("use_parallel_embedding") and tp > 1:
            dim = int(c.get("embedding_sharding_dim", 0))
            yield "model.embed_tokens.weight", _Joined(dim, tuple(_Part(r, key) for r in first), vocab)
        else:
            yield "model.embed_tokens.weight", _Joined(0, (_Part(0, key),), vocab)
        offset = 0
        for p, count in enumerate(self._layer_counts()):
            ranks = [self._rank(p, t) for t in range(tp)]
            names = set(files[ranks[0]].keys())
            for j in range(count):
                prefix, hf = f"transformer.layers.{j}.", f"model.layers.{offset + j}."
                suffixes = sorted(k[len(prefix):] for k in names if k.startswith(prefix))
                unknown = [s for s in suffixes if s not in _LAYER_TENSORS and s not in _QKV and s not in _IGNORED]
                if unknown:
                    raise ConfigError(f"model={self.path!r}: TensorRT-LLM tensors {[prefix + s for s in unknown]} "
                                      "are not read by ember (quantization scales, or a layer it does not support)")
                for s in _QKV:
                    if s in suffixes:
                        yield from self._qkv(files, ranks, prefix + s, hf, s.rsplit(".", 1)[1])
                for s in suffixes:
                    if s in _LAYER_TENSORS:
                        name, dim = _LAYER_TENSORS[s]
                        parts = ranks if dim is not None else ranks[:1]
                        yield hf + name, _Joined(dim or 0, tuple(_Part(r, prefix + s) for r in parts))
            offset += count
        yield "model.norm.weight", _Joined(0, (_Part(last[0], "transformer.ln_f.weight"),))
        if not self._is_tied():
            yield "lm_head.weight", _Joined(0, tuple(_Part(r, "lm_head.weight") for r in last), vocab)

    def _qkv(self, files: list[Any], ranks: list[int], key: str, hf: str, kind: str
             ) -> Iterator[tuple[str, _Joined]]:
        """Each rank's fused rows are [q_r; k_r; v_r]; KV heads repeated over ranks are read once."""
        c, tp = self.config, self.tp_size
        head = self._head_size()
        heads = int(c["num_attention_heads"])
        kv_heads = int(c.get("num_key_value_heads") or heads)
        rows = files[ranks[0]].get_slice(key).get_shape()[0]
        q = heads * head // tp
        kv = (rows - q) // 2
        copies = kv * tp // (kv_heads * head) if kv else 0  # ranks that hold the same KV heads
        if q * tp != heads * head or q + 2 * kv != rows or not copies or copies * kv_heads * head != kv * tp \
                or tp % copies:
            raise ConfigError(f"model={self.path!r}: {key} has {rows} rows a rank, which is not [q; k; v] of "
                              f"{heads} heads and {kv_heads} KV heads of {head} split over tp_size={tp}")
        kv_ranks = ranks[::copies]
        yield f"{hf}self_attn.q_proj.{kind}", _Joined(0, tuple(_Part(r, key, 0, q) for r in ranks))
        yield f"{hf}self_attn.k_proj.{kind}", _Joined(0, tuple(_Part(r, key, q, q + kv) for r in kv_ranks))
        yield f"{hf}self_attn.v_proj.{kind}", _Joined(0, tuple(_Part(r, key, q + kv, rows) for r in kv_ranks))

    def tensors(self, config: Any, keep_quantized: bool = False, select: Select = read_all
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Hugging Face names, the ranks' shares joined. select: the part of each tensor to read; only the rank
        files' rows and columns under it are read."""
        from safetensors import SafetensorError, safe_open

        self._check_quantization()
        with ExitStack() as stack:
            files = []
            for file in self.rank_files:
                try:
                    files.append(stack.enter_context(safe_open(file, framework="pt")))
                except SafetensorError as e:
                    raise ValueError(f"model file {file!r} is corrupt: {e}") from e
            for name, joined in self._layouts(files, config):
                sl = select(name)
                if sl is not None:
                    yield name, _read(files, joined, sl)


def _read(files: list[Any], joined: _Joined, sl: WeightSlice) -> torch.Tensor:
    """The slice of a joined tensor, read part by part: only the rows and columns it covers."""
    shapes = [files[p.rank].get_slice(p.key).get_shape() for p in joined.parts]
    ndim = len(shapes[0])
    extents = [(p.row1 if p.row1 is not None else s[0]) - p.row0 if joined.dim == 0 else s[1]
               for p, s in zip(joined.parts, shapes)]
    sizes = [sum(extents) if joined.dim == 0 else shapes[0][0]]
    if ndim == 2:
        sizes.append(shapes[0][1] if joined.dim == 0 else sum(extents))
    if joined.rows is not None:
        sizes[0] = min(sizes[0], joined.rows)
    want = [(0, n) for n in sizes]  # [start, stop) of each dimension
    if not sl.whole:
        want[sl.dim] = (max(0, sl.start), min(sizes[sl.dim], sl.stop))
    pieces, offset = [], 0
    for part, shape, extent in zip(joined.parts, shapes, extents):
        lo, hi = max(want[joined.dim][0], offset), min(want[joined.dim][1], offset + extent)
        offset += extent
        if lo >= hi:
            continue
        ranges = list(want)
        ranges[joined.dim] = (lo - offset + extent, hi - offset + extent)  # within this part
        r0, r1 = ranges[0][0] + part.row0, ranges[0][1] + part.row0
        data = files[part.rank].get_slice(part.key)
        pieces.append(data[r0:r1] if ndim == 1 else data[r0:r1, ranges[1][0]:ranges[1][1]])
    if not pieces:
        return torch.empty([hi - lo for lo, hi in want])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=joined.dim)
