"""Read a GGUF file of the Llama family with the `gguf` package: config from its metadata, weights under Hugging
Face names, dequantized to torch tensors or, for Q8_0 / Q4_0 / Q4_1 / Q4_K blocks, kept in ember's int8 / int4 layout.

llama.cpp's converter permutes the Q and K projections of `llama` checkpoints for its interleaved RoPE; we undo it
so that the one rotate-half implementation serves both formats (as transformers does).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ember.distributed import WeightSlice
from ember.errors import ConfigError
from ember.model_loader.config_checks import check_config, check_tensor_shapes
from ember.model_loader.gguf_config import GGUFConfig
from ember.model_loader.gguf_file import GGUFFile, GGUFTensor
from ember.model_loader.hf import Select, read_all
from ember.quantization import GGUF_DIRECT_TYPES, QuantConfig, QuantizedTensor, from_gguf

# GGUF general.architecture -> (Hugging Face architecture, model_type)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "olmoe": ("OlmoeForCausalLM", "olmoe"),
}
# llama.cpp renormalises the top-k weights for these (unless the file says, ``expert_weights_norm``)
_MOE_NORM = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False}
_GEMMA = ("gemma2", "gemma3")  # norms stored as 1 + w (llama.cpp adds the offset); four norms a layer
FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED_QUANT_TYPES = (*FLOAT_TYPES, "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")
FOUR_BIT_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})  # exactly ember's int4 in groups of 32
FIVE_BIT_TYPES = frozenset({"Q5_0", "Q5_1", "Q5_K"})  # exactly ember's int5 in groups of 32
SIX_BIT_TYPES = frozenset({"Q6_K"})  # exactly ember's int6 in groups of 16
K_QUANT_TYPES = frozenset({"Q4_K", "Q5_K", "Q6_K"})

_CONFIG_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.sliding_window": "sliding_window",
    "attention.clamp_kqv": "clip_qkv",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}
_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_qkv": "self_attn.qkv_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps")  # [experts, rows, cols]: one tensor each expert


class GGUFCheckpoint:
    """One GGUF file: its metadata as a config under transformers' names and its tensors under Hugging Face names."""

    kind = "gguf"

    def __init__(self, path: str) -> None:
        self.file = GGUFFile(path)  # ConfigError naming the file when its header lies
        self.path = path
        # the tokenizer's arrays (vocabulary, merges) are decoded only by the tokenizer conversion
        self.meta = {k: self.file.value(k) for k in self.file.keys if not k.startswith("tokenizer.ggml.")}
        self.gguf_arch = str(self.meta.get("general.architecture"))
        if self.gguf_arch not in GGUF_ARCHITECTURES:
            raise ConfigError(f"model file {path!r}: GGUF general.architecture={self.gguf_arch!r} is not supported: "
                              f"ember supports {sorted(GGUF_ARCHITECTURES)}")
        self.architecture, self.model_type = GGUF_ARCHITECTURES[self.gguf_arch]
        if self.gguf_arch == "llama" and self.meta.get("llama.expert_count"):  # llama.cpp writes Mixtral as llama
            self.architecture, self.model_type = "MixtralForCausalLM", "mixtral"
        self._config: GGUFConfig | None = None

    def hf_config(self) -> Any:
        """The transformers config (imports transformers: the engine itself reads ``model_config()``)."""
        return self.model_config().to_transformers()

    def model_config(self) -> GGUFConfig:
        """The config under transformers' names and defaults, from the metadata alone (no transformers import)."""
        if self._config is None:
            try:
                config = GGUFConfig.of(self.model_type, self.architecture, self._config_kwargs())
            except ConfigError:
                raise
            except (TypeError, ValueError, KeyError, ZeroDivisionError, OverflowError) as e:  # a value of a wrong type
                raise ConfigError(f"model file {self.path!r}: its metadata does not make a {self.gguf_arch} config "
                                  f"({type(e).__name__}: {e})") from None
            check_config(self.path, config)
            check_tensor_shapes(self.path, config, self.tensor_shapes())
            if "tokenizer.ggml.tokens" in self.file:
                n = self.file.array_len("tokenizer.ggml.tokens")
                if n > config.vocab_size:
                    raise ConfigError(f"model file {self.path!r}: its tokenizer has {n} tokens, more than the model's "
                                      f"vocab_size={config.vocab_size} embedding rows")
            self._config = config
        return self._config

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face name -> [out, in] shape of every tensor ember reads, from the header alone."""
        return {name: tuple(reversed(t.shape)) for t in self._entries()
                if (name := _hf_name(t.name, self.gguf_arch)) is not None}

    def _config_kwargs(self) -> dict[str, Any]:
        prefix = self.gguf_arch + "."
        kwargs: dict[str, Any] = {}
        for key, name in _CONFIG_KEYS.items():
            if prefix + key in self.meta:
                kwargs[name] = self.meta[prefix + key]
        if "vocab_size" not in kwargs:
            kwargs["vocab_size"] = self.file.array_len("tokenizer.ggml.tokens")
        kwargs["tie_word_embeddings"] = all(t.name != "output.weight" for t in self.file.tensors)
        scaling = self.meta.get(prefix + "rope.scaling.type")
        if scaling and scaling != "none":
            rope = {"rope_type": scaling, "factor": float(self.meta.get(prefix + "rope.scaling.factor", 1.0))}
            original = prefix + "rope.scaling.original_context_length"
            if original in self.meta:
                rope["original_max_position_embeddings"] = int(self.meta[original])
            kwargs["rope_scaling"] = rope
        if "head_dim" not in kwargs:
            kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
        if self.gguf_arch in _GEMMA:
            kwargs.update(self._gemma_kwargs(kwargs))
        if self.gguf_arch == "phi3":
            kwargs.update(self._phi3_kwargs(kwargs))
        if kwargs.get("num_experts"):
            kwargs["norm_topk_prob"] = bool(self.meta.get(prefix + "expert_weights_norm", _MOE_NORM[self.gguf_arch]))
            if self.model_type == "mixtral":
                kwargs["num_local_experts"] = kwargs.pop("num_experts")
        for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
            value = self.file.value("tokenizer.ggml." + key)
            if value is not None:
                kwargs[name] = int(value)
        return kwargs

    def _gemma_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """What llama.cpp fixes for Gemma where the file does not say: every sixth layer global (Gemma 3, unless
        ``attention.sliding_window_pattern`` says otherwise; Gemma 2 alternates), Gemma 3's sliding layers on RoPE
        base 10000, scores scaled by head_dim ** -0.5 (hidden / heads for the 27B models), GeGLU; Gemma 2's
        soft-caps as stored."""
        prefix, n = self.gguf_arch + ".", int(kwargs["num_hidden_layers"])
        heads, head_dim = int(kwargs["num_attention_heads"]), int(kwargs["head_dim"])
        out: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh"}
        pattern = self.meta.get(prefix + "attention.sliding_window_pattern", 6)  # newer converters write it
        if self.gguf_arch == "gemma3":
            sliding = [bool(p) for p in pattern] if isinstance(pattern, list) else [
                (i + 1) % int(pattern) != 0 for i in range(n)]
            out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
            out["rope_local_base_freq"] = 10000.0
            big = n == 62
        else:
            out["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
            for key in ("attn_logit_softcapping", "final_logit_softcapping"):
                if prefix + key in self.meta:
                    out[key] = float(self.meta[prefix + key])
            big = n == 46
        hidden = int(kwargs["hidden_size"])
        out["query_pre_attn_scalar"] = hidden // heads if big else head_dim
        return out

    def _phi3_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Phi-3's partial rotary (``rope.dimension_count`` of head_dim) and LongRoPE: its factors are tensors
        (``rope_factors_short`` / ``_long``), its switch ``rope.scaling.original_context_length``; the attention
        factor is left to transformers' formula (max / original context), from which llama.cpp computed it."""
        prefix, out = "phi3.", {}
        dims = self.meta.get(prefix + "rope.dimension_count", kwargs["head_dim"])
        out["partial_rotary_factor"] = int(dims) / int(kwargs["head_dim"])
        factors = {t.name: t for t in self.file.tensors if t.name.startswith("rope_factors_")}
        if factors:
            rope = {"rope_type": "longrope",
                    "original_max_position_embeddings": int(self.meta[prefix + "rope.scaling.original_context_length"])}
            for kind in ("short", "long"):
                rope[f"{kind}_factor"] = [float(v) for v in _dequantize(factors[f"rope_factors_{kind}.weight"].data,
                                                                        factors[f"rope_factors_{kind}.weight"].tensor_type)]
            out["rope_scaling"] = rope
            out["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
        return out

    def generation_config(self) -> dict[str, Any]:
        return {}  # GGUF carries no sampling defaults

    def tokenizer(self):
        from ember.tokenizer import Tokenizer

        return Tokenizer.load(self.path, gguf_file=self.path)

    def native_quantization(self) -> QuantConfig | None:
        """The ember layout that holds the file's blocks: int4 g32 when every linear weight is Q4_0 / Q4_1 / Q4_K
        (exactly ember's int4); ``mixed`` when some are 4-, 5- or 6-bit and the others are other block types (Q4_K_M:
        Q4_K with Q6_K for some attn_v / ffn_down; Q5_0 beside Q8_0), each weight as int4 / int5 / int6 where its
        blocks are 4- / 5- / 6-bit (int5 and int6 where the CPU kernels take them, ``cpu_holds_int5`` /
        ``cpu_holds_int6``), else int8 per row; int8 with a scale per row when every one is in some other quantized
        block type (Q8_0, requantized from their float values); None (float) when any linear weight is stored as
        float. The embedding table and LM head are int8 when they are stored in block types (int6 for Q6_K ones in
        the mixed layout)."""
        linear, table = self._block_types
        if not linear or linear & set(FLOAT_TYPES):
            return None
        embeddings = bool(table) and not table & set(FLOAT_TYPES)
        if linear <= FOUR_BIT_TYPES:
            return QuantConfig("int4", 32, embeddings=embeddings)
        if linear & (FOUR_BIT_TYPES | FIVE_BIT_TYPES | SIX_BIT_TYPES):  # those weights as they are, the others int8
            return QuantConfig("int4", 32, embeddings=embeddings, mixed=True)
        return QuantConfig("int8", 32, embeddings=embeddings)

    def has_k_quants(self) -> bool:
        """Whether any linear weight is in a K-quant block type (Q4_K, Q5_K, Q6_K): such files load as they are,
        with no calibration pass unless one is asked for (``default_mode``)."""
        return bool(self._block_types[0] & K_QUANT_TYPES)

    @functools.cached_property
    def _block_types(self) -> tuple[frozenset[str], frozenset[str]]:
        """(the linear weights' tensor types, the embedding table's and LM head's), read once from the header."""
        linear, table = set(), set()
        for t in self._entries():
            name = _hf_name(t.name, self.gguf_arch) or ""
            if name.endswith("_proj.weight"):
                linear.add(t.tensor_type.name)
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                table.add(t.tensor_type.name)
        return frozenset(linear), frozenset(table)

    def kept_block_size(self, suffix: str) -> int:
        """The block of the tensors ending with suffix that load kept in their blocks (Q8_0 / Q4_0 / Q4_1 / Q5_0 /
        Q5_1: 32); 1 when none is (other types, and Q4_K / Q5_K blocks a slice would cut, are dequantized and can be
        sliced anywhere)."""
        return max((32 for t in self._entries() if t.tensor_type.name in GGUF_DIRECT_TYPES and t.block == 32
                    and (_hf_name(t.name, self.gguf_arch) or "").endswith(suffix)),
                   default=1)

    def _entries(self) -> Iterator[GGUFTensor]:
        """The file's tensors, each expert of a stacked expert tensor (``blk.N.ffn_gate_exps``) on its own as
        ``blk.N.ffn_gate_exps.E`` (its rows of the map, never copied); Qwen2-MoE's 1-D shared gate as one row."""
        for t in self.file.tensors:
            base, _, kind = t.name.rpartition(".")
            if _EXPERTS.fullmatch(base) and len(t.shape) == 3:
                for e in range(int(t.shape[2])):
                    yield dataclasses.replace(t, name=f"{base}.{e}.{kind}", shape=tuple(t.shape[:2]), data=t.data[e])
            elif base.endswith("ffn_gate_inp_shexp") and len(t.shape) == 1:
                yield dataclasses.replace(t, shape=(int(t.shape[0]), 1), data=t.data.reshape(1, -1))
            else:
                yield t

    def tensors(self, config: Any, keep_quantized: bool = False, select: Select = read_all
                ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """keep_quantized: weights in GGUF_DIRECT_TYPES come as QuantizedTensor (never expanded to float; a K-quant
        column slice that cuts its 256-value blocks is read dequantized instead). select: the part of each
        tensor to read (rows, or columns on quantization-block boundaries)."""
        permute = self.gguf_arch in ("llama", "mistral")
        for t in self._entries():
            kind = t.tensor_type.name
            if kind not in SUPPORTED_QUANT_TYPES:
                raise ConfigError(f"model file {self.path!r}: GGUF tensor {t.name} has type {kind}: supported types "
                                  f"are {SUPPORTED_QUANT_TYPES}")
            name = _hf_name(t.name, self.gguf_arch)
            if name is None:
                continue
            sl = select(name)
            if sl is None:
                continue
            raw = t.data  # a read-only memory map: slicing it reads only those bytes
            full_rows = rows = int(t.shape[-1])  # GGUF lists dims innermost first; a 1-D tensor's rows are its values
            cols = int(t.shape[0])
            keep = keep_quantized and kind in GGUF_DIRECT_TYPES and (
                t.block == 32 or sl.whole or sl.dim == 0 or not (sl.start % t.block or sl.stop % t.block))
            trim = None
            if not sl.whole:
                raw, rows, cols, trim = _slice_raw(raw, t, sl, rows, cols, keep)
            heads = None
            if permute and (".q_proj." in name or ".k_proj." in name):
                total = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
                heads = total * rows // full_rows  # whole heads: the permutation stays within each head
            if keep:
                qt = from_gguf(raw, kind, (rows, cols))
                if heads is not None:
                    qt = qt.rows(torch.from_numpy(_unpermute(np.arange(qt.shape[0]), heads)))
                yield name, qt
                continue
            w = _dequantize(raw, t.tensor_type)
            w = np.array(w if trim is None else w[:, trim[0]:trim[1]], copy=True)  # the file is mapped read-only
            if heads is not None:
                w = _unpermute(w, heads)
            if self.gguf_arch in _GEMMA and name.endswith("norm.weight"):
                w -= 1.0  # back to the checkpoint's w: the model adds 1 as transformers does
            yield name, torch.from_numpy(w)


def _hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    base, _, kind = gguf_name.rpartition(".")
    m = re.fullmatch(_EXPERTS.pattern + r"\.(\d+)", base)  # one expert of a stacked tensor (see _entries)
    if m:
        return f"model.layers.{m.group(1)}.mlp.experts.{m.group(3)}.{m.group(2)}_proj.{kind}"
    if base in _TENSOR_NAMES:
        return f"{_TENSOR_NAMES[base]}.{kind}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _LAYER_NAMES:
        part = _LAYER_NAMES[m.group(2)]
        if m.group(2) == "ffn_norm" and arch in _GEMMA:
            part = "pre_feedforward_layernorm"
        elif m.group(2) == "ffn_up" and arch == "phi3":  # llama.cpp keeps Phi-3's gate and up fused, as ffn_up
            part = "mlp.gate_up_proj"
        return f"model.layers.{m.group(1)}.{part}.{kind}"
    return None


def _dequantize(raw: np.ndarray, tensor_type: Any) -> np.ndarray:
    """float32 values of a tensor's data: F32 / F16 come typed from the map; other types through the gguf package."""
    if tensor_type.name in ("F32", "F16"):
        return raw.astype(np.float32)
    from gguf import dequantize

    return dequantize(raw, tensor_type)


def _slice_raw(raw: np.ndarray, t: GGUFTensor, sl: WeightSlice, rows: int, cols: int, keep: bool
               ) -> tuple[np.ndarray, int, int, tuple[int, int] | None]:
    """Rows, or the columns' quantization blocks, of a tensor's raw data ``[rows, bytes a row]``: (raw, rows, cols,
    trim). A column slice that cuts a block reads the blocks that cover it and ``trim`` says which dequantized
    columns to keep; a tensor kept in its blocks (``keep``) must be cut on block boundaries."""
    if sl.dim == 0:
        return raw[sl.start:sl.stop], sl.stop - sl.start, cols, None
    block, size, name = t.block, t.block_bytes, t.name
    if block == 1:  # float types come as [rows, cols] of their own dtype
        return raw[:, sl.start:sl.stop], rows, sl.stop - sl.start, None
    lo, hi = sl.start // block, -(-sl.stop // block)
    if keep and (sl.start % block or sl.stop % block):
        raise ValueError(f"GGUF tensor {name} ({t.tensor_type.name}) stays in blocks of {block} values; columns "
                         f"{sl.start}..{sl.stop} cut a block: choose a tensor_parallel_size whose slices hold whole "
                         "blocks")
    trim = None if not (sl.start % block or sl.stop % block) else (sl.start - lo * block, sl.stop - lo * block)
    return raw[:, lo * size:hi * size], rows, sl.stop - sl.start, trim


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation (interleaved -> rotate-half RoPE layout)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
