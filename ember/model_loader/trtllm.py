"""Read a TensorRT-LLM checkpoint folder (the format ``examples/*/convert_checkpoint.py`` and ModelOpt's
``quantize.py`` write, v0.9 on): ``config.json`` (TensorRT-LLM's PretrainedConfig: singular ``architecture``,
``mapping``, ``quantization``) and one ``rank{N}.safetensors`` per rank, N = pp_rank * tp_size + tp_rank.

Families (``architecture``; all use Llama's tensor names below):

=============================================  =========================================  =========================
TensorRT-LLM architecture                      built as (transformers config)             notes
=============================================  =========================================  =========================
LlamaForCausalLM                               llama, LlamaForCausalLM                    attn_bias / mlp_bias read
InternLMForCausalLM                            llama, LlamaForCausalLM                    attn_bias: q/k/v/o biases
MistralForCausalLM                             mistral, MistralForCausalLM                sliding_window from
                                                                                          config.json if it has one,
                                                                                          else full attention
QWenForCausalLM, qwen_type 'qwen2'             qwen2, Qwen2ForCausalLM                    q/k/v biases, no others;
                                                                                          qwen_type 'qwen' (v1),
                                                                                          MoE, VL: refused
Qwen2ForCausalLM (the name from v0.12 on)      qwen2, Qwen2ForCausalLM                    as QWenForCausalLM
=============================================  =========================================  =========================

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

Quantized checkpoints (``quantization.quant_algo``) come back as float weights in the checkpoint's ``dtype``: each
quantized linear weight (qkv, dense, fc, gate, proj; lm_head too if it is stored so) is dequantized, computed in
float32 and rounded once to the dtype; its rank shares are split like the float weight's (column-parallel: rows and
their scales; row-parallel: columns, their groups' scales and the prequant scale). Whether a weight is quantized is
read from its tensor (int8, with a weights_scaling_factor beside it); exclude_modules is read only to tell which
float weights of the weight-only layout are transposed. Under a ``W8A8_SQ_*_PLUGIN`` algo a quantized weight is an
int8 one with a per_channel_scale beside it.

- W4A16_AWQ (ModelOpt): ``weight`` int8 [out/2, in], signed int4 pairs of output channels (low nibble the even
  one); ``weights_scaling_factor`` [out, in / group_size]; ``prequant_scaling_factor`` [in] (AWQ's activation scale,
  which the layer multiplies its input by; optional). W[o, i] = q[o, i] * wsf[o, i // group_size] * prequant[i].
- W8A8_SQ_PER_CHANNEL (ModelOpt): ``weight`` int8 [out, in]; ``weights_scaling_factor`` [out];
  ``prequant_scaling_factor`` [in] (the smoothing); ``activation_scaling_factor`` (static, not needed for float
  weights). W[o, i] = q[o, i] * wsf[o] * prequant[i].
- W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN, W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN, W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN,
  W8A8_SQ_PER_TENSOR_PLUGIN (TensorRT-LLM's own SmoothQuant, convert_checkpoint --smoothquant): ``weight`` int8
  [out, in]; ``per_channel_scale`` float32 [1, out] (per-channel modes; a row-parallel layer's whole on every rank)
  or [1, 1] (per-tensor modes); ``smoother`` [1, in] (dense and proj only: the runtime divides their input by it).
  W[o, i] = q[o, i] * per_channel_scale[o] / smoother[i]. The smoothing of qkv and fc / gate was folded into the
  stored input_layernorm / post_layernorm weights, read as they are. act_scale, scale_x_orig_quant,
  scale_y_accum_quant, scale_w_quant_orig, scale_y_quant_orig, the layernorms' scale_to_int and the layers'
  quantization_scaling_factor are not needed for float weights.
- W8A16 / W4A16 exported by ModelOpt (int8_wo / int4_wo): as above with no prequant: ``weight`` int8 [out, in] and
  ``weights_scaling_factor`` [out] (W8A16), or int4 pairs [out/2, in] and [out, in / group_size] (W4A16).
- W8A16 / W4A16 converted with --disable_weight_only_quant_plugin: ``weight`` float [in, out] (transposed back);
  ``per_channel_scale`` is not needed.

``native_quantization()`` is None: ember quantizes them again only when asked (``quantization='int4'`` etc.),
because none of these layouts is one of ember's (its int4 is asymmetric with zero points and has no per-input
scale, its w8a8 has no smoothing vector, and its default for a quantized int8 checkpoint first measures SmoothQuant
on calibration text), so requantizing at load would round the weights a second time unasked.

Refused, with the reason in the error: W8A16 / W4A16 int8 weights of convert_checkpoint (``per_channel_scale``
beside them; preprocessed for the converting GPU's GEMM
kernels: rows permuted, columns interleaved, offset on SM70-89; the GPU is not recorded, so they cannot be
recovered), TensorRT-LLM's SmoothQuant tensors under ModelOpt's W8A8_SQ_PER_CHANNEL, FP8 and every other
quant_algo, zero points, int8 weights without their layout's scales and shapes. A
``kv_cache_quant_algo`` is ignored with a warning (ember keeps its KV cache in the model's dtype).
"""

from __future__ import annotations

import fnmatch
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
from ember.model_loader.trtllm_engine import engine_folder_message

logger = logging.getLogger("ember")

# TensorRT-LLM architecture -> (the transformers model_type of the config built, the architecture ember runs)
FAMILIES = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "InternLMForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "QWenForCausalLM": ("qwen2", "Qwen2ForCausalLM"),  # qwen_type 'qwen2' only
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
# the quant_algo values whose weights are read (dequantized to float); every other one is refused
# TensorRT-LLM's own SmoothQuant (convert_checkpoint --smoothquant [--per_channel] [--per_token])
SQ_PLUGIN_ALGOS = ("W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN", "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN",
                   "W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN", "W8A8_SQ_PER_TENSOR_PLUGIN")
READ_QUANT_ALGOS = ("W4A16_AWQ", "W8A8_SQ_PER_CHANNEL", "W8A16", "W4A16", *SQ_PLUGIN_ALGOS)
_WEIGHT_ONLY = ("W8A16", "W4A16")
# tensors of TensorRT-LLM's own SmoothQuant layout (convert_checkpoint --smoothquant): not ModelOpt's
_SQ_PLUGIN_TENSORS = ("per_channel_scale", "act_scale", "smoother", "scale_to_int", "quantization_scaling_factor",
                      "scale_w_quant_orig", "scale_y_accum_quant", "scale_y_quant_orig", "scale_x_orig_quant")
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
_NO_QWEN2_BIAS = ("attention.dense.bias", "mlp.fc.bias", "mlp.gate.bias", "mlp.proj.bias")  # Qwen2 has none
_LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")  # what quant_algo quantizes
# a quantized linear's companions (read with its weight, or not needed for float weights)
_SCALES = ("weights_scaling_factor", "prequant_scaling_factor", "activation_scaling_factor", "per_channel_scale")
# a SmoothQuant plugin linear's companions not needed for float weights (per_channel_scale and smoother are read)
_SQ_PLUGIN_LINEAR = ("per_channel_scale", "smoother", "act_scale", "scale_x_orig_quant", "scale_y_accum_quant",
                     "scale_w_quant_orig", "scale_y_quant_orig")
# ... and a layer's (the layernorms' and the blocks' static activation scales)
_SQ_PLUGIN_LAYER = ("input_layernorm.scale_to_int", "post_layernorm.scale_to_int",
                    "attention.quantization_scaling_factor", "mlp.quantization_scaling_factor")
_IGNORED = ("attention.kv_cache_scaling_factor",)  # a KV-cache quantization scale: ember keeps its cache in float
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_INT_DTYPES = ("I8", "U8")
_HOW = ("load the Hugging Face folder (or convert it again without quantization) and let ember quantize at load "
        "time (quantization='int8', 'int4', 'awq' or 'smoothquant')")


def trtllm_folder_kind(path: str) -> str | None:
    """'checkpoint' for a folder whose config.json is TensorRT-LLM's PretrainedConfig (singular ``architecture``),
    'engine' for a built engine folder (config.json with ``pretrained_config`` and ``build_config``), else None."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError, RecursionError):
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
    (row1 None: to its end; rows as the Hugging Face tensor counts them, [out, in] for a linear weight)."""

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
        file = os.path.join(path, "config.json")
        if trtllm_folder_kind(path) == "engine":
            with open(file) as f:
                raise ConfigError("model=" + engine_folder_message(
                    path, json.load(f), "set them with max_num_seqs=, max_model_len= (input + output) and "
                    "max_num_batched_tokens="))
        try:
            with open(file) as f:
                self.config: dict[str, Any] = json.load(f)
        except (OSError, ValueError, RecursionError) as e:
            raise ConfigError(f"model={path!r}: config.json could not be read ({e})") from e
        mapping = self.config.get("mapping") or {}
        try:
            self.tp_size = int(mapping.get("tp_size", 1) or 1)
            self.pp_size = int(mapping.get("pp_size", 1) or 1)
            world = int(mapping.get("world_size", self.tp_size * self.pp_size) or 1)
        except (AttributeError, TypeError, ValueError) as e:
            raise ConfigError(f"model={path!r}: config.json mapping={mapping!r} is malformed ({e})") from None
        if not (1 <= self.tp_size <= 1024 and 1 <= self.pp_size <= 1024):
            raise ConfigError(f"model={path!r}: config.json mapping tp_size={self.tp_size}, pp_size={self.pp_size} "
                              "is out of range: allowed 1..1024 each")
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
        self._quant_checked = False

    # ---------------------------------------------------------------- config

    @property
    def quantization(self) -> dict[str, Any]:
        quant = self.config.get("quantization")
        return quant if isinstance(quant, dict) else {}

    @property
    def quant_algo(self) -> str | None:
        return self.quantization.get("quant_algo") or None

    def _family(self) -> tuple[str, str]:
        """(model_type, architecture) of the model ember builds; refuses what it cannot."""
        c = self.config
        arch = c.get("architecture")
        if arch not in FAMILIES:
            raise ConfigError(f"model={self.path!r}: TensorRT-LLM architecture={arch!r} is not supported: ember reads "
                              f"TensorRT-LLM checkpoints of {list(SUPPORTED_ARCHITECTURES)} (QWenForCausalLM with "
                              "qwen_type 'qwen2'); load the Hugging Face folder instead")
        if FAMILIES[arch][0] == "qwen2":
            qwen_type = c.get("qwen_type", "qwen" if arch == "QWenForCausalLM" else "qwen2")
            if qwen_type != "qwen2":
                why = ("Qwen (v1) is another model, whose converter maps its c_attn / w1 / w2 / c_proj weights its "
                       "own way; ember implements Qwen2" if qwen_type == "qwen" else "ember implements Qwen2 only")
                raise ConfigError(f"model={self.path!r}: TensorRT-LLM architecture={arch!r} with qwen_type="
                                  f"{qwen_type!r} is not supported ({why}); ember reads qwen_type 'qwen2'. Load the "
                                  "Hugging Face folder instead")
        return FAMILIES[arch]

    def _check_supported(self) -> None:
        c = self.config
        model_type = self._family()[0]
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
        for key in ("residual_mlp", "qk_layernorm", "use_logn_attn"):
            if c.get(key):
                problems.append(f"{key}={c[key]!r}")
        for key in ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "output_multiplier_scale"):
            if float(c.get(key, 1.0) or 1.0) != 1.0:
                problems.append(f"{key}={c[key]!r}")
        if model_type == "qwen2" and c.get("mlp_bias"):
            problems.append("mlp_bias=True (Qwen2's MLP has no biases)")
        if problems:
            raise ConfigError(f"model={self.path!r}: this TensorRT-LLM checkpoint uses what ember does not support: "
                              f"{', '.join(problems)}")

    def _check_quantization(self) -> None:
        """Refuse a quant_algo whose weights cannot be read, before any weight is: from config.json and rank 0's
        tensor names and dtypes."""
        algo = self.quant_algo
        if not algo or self._quant_checked:
            return
        where = f"model={self.path!r} is a TensorRT-LLM checkpoint quantized with quant_algo={algo!r}"
        if algo not in READ_QUANT_ALGOS:
            if algo.startswith("W8A8_SQ"):
                why = "a SmoothQuant variant ember does not read"
            elif "FP8" in algo:
                why = "FP8 weights, which ember has no layout for"
            else:
                why = "a layout ember does not read"
            raise ConfigError(f"{where}: {why}. ember reads quantized TensorRT-LLM checkpoints of quant_algo "
                              f"{list(READ_QUANT_ALGOS)} (W8A16 / W4A16 when exported by ModelOpt or converted with "
                              f"--disable_weight_only_quant_plugin); {_HOW}")
        if self.quantization.get("has_zero_point"):
            raise ConfigError(f"{where} and has_zero_point=True: ember reads symmetric ModelOpt weights only; {_HOW}")
        from safetensors import safe_open

        with safe_open(self.rank_files[0], framework="pt") as f:
            keys = set(f.keys())
            dtypes = {k: f.get_slice(k).get_dtype() for k in keys if k.endswith(".weight")}
        plugin = sorted(k for k in keys if k.rsplit(".", 1)[-1] in _SQ_PLUGIN_TENSORS)
        if algo == "W8A8_SQ_PER_CHANNEL" and plugin:
            raise ConfigError(f"{where}, in TensorRT-LLM's own SmoothQuant layout ({plugin[0]}, ...), which ember "
                              f"does not read (it reads ModelOpt's: weights_scaling_factor, prequant_scaling_factor); "
                              f"{_HOW}")
        ints = sorted(k for k, d in dtypes.items() if d in _INT_DTYPES)
        if algo in SQ_PLUGIN_ALGOS:
            bare = [k for k in ints if k[:-len("weight")] + "per_channel_scale" not in keys]
            if bare:
                raise ConfigError(f"{where}, but {bare[0]} is {dtypes[bare[0]]} without per_channel_scale: not "
                                  f"TensorRT-LLM's SmoothQuant layout of {algo}, which ember reads; {_HOW}")
            self._quant_checked = True
            return
        bare = [k for k in ints if k[:-len("weight")] + "weights_scaling_factor" not in keys]
        if algo in _WEIGHT_ONLY and bare:  # the plugin's layout (per_channel_scale); ModelOpt's has scaling factors
            raise ConfigError(self._preprocessed(bare[0]))
        if bare:
            raise ConfigError(f"{where}, but {bare[0]} is {dtypes[bare[0]]} without weights_scaling_factor: not "
                              f"ModelOpt's layout of {algo}, which ember reads; {_HOW}")
        self._quant_checked = True

    def _preprocessed(self, key: str) -> str:
        algo = self.quant_algo
        return (f"model={self.path!r} is a TensorRT-LLM checkpoint quantized weight-only (quant_algo={algo!r}) for "
                f"TensorRT-LLM's weight-only GEMM plugin: its int8 weights ({key}, ...) were preprocessed for the "
                "kernels of the GPU that converted them (rows permuted, columns interleaved, offset on SM70-89), and "
                "the checkpoint does not record which GPU that was, so the weights cannot be recovered. Pass the "
                "Hugging Face folder it was converted from, a checkpoint ModelOpt exported (quantize.py --qformat "
                "int8_wo / int4_wo), or one converted with --disable_weight_only_quant_plugin (float weights; "
                "quantization='int8' or 'int4' quantizes them at load time)")

    def _head_size(self) -> int:
        c = self.config
        return int(c.get("head_size") or c["hidden_size"] // c["num_attention_heads"])

    def hf_config(self) -> Any:
        if self._hf_config is not None:
            return self._hf_config
        from transformers import AutoConfig

        self._check_supported()
        model_type, architecture = self._family()
        c = self.config
        kv_algo = self.quantization.get("kv_cache_quant_algo")
        if kv_algo:  # the weights are float; the file's kv_cache_scaling_factor tensors are skipped
            logger.warning("TensorRT-LLM checkpoint %s: kv_cache_quant_algo=%r is ignored (ember keeps its KV cache "
                           "in the model's dtype)", self.path, kv_algo)
        if self.quant_algo:
            logger.info("TensorRT-LLM checkpoint %s: quant_algo=%r weights are dequantized to %s; ember quantizes "
                        "them again only when asked (quantization='int8', 'int4', ...)", self.path, self.quant_algo,
                        c.get("dtype"))
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
                bos_token_id=c.get("bos_token_id"),
                eos_token_id=c.get("eos_token_id"),
                pad_token_id=c.get("pad_token_id"),
            )
            if model_type == "qwen2":  # q/k/v biases always, no others; no sliding window (TensorRT-LLM has none)
                kwargs.update(use_sliding_window=False, sliding_window=None)
            elif model_type == "llama":
                kwargs.update(attention_bias=bool(c.get("attn_bias", False)), mlp_bias=bool(c.get("mlp_bias", False)))
            else:  # mistral: no biases unless the checkpoint has them; the converter writes no window: full
                # attention, as TensorRT-LLM runs it unless told max_attention_window_size at run time
                kwargs.update({k: True for k, key in (("attention_bias", "attn_bias"), ("mlp_bias", "mlp_bias"))
                               if c.get(key)})
                window = c.get("sliding_window")
                kwargs["sliding_window"] = int(window) if window else None
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"model={self.path!r}: a field of the TensorRT-LLM config.json is malformed ({e!r})"
                              ) from e
        if c.get("rotary_scaling"):
            kwargs["rope_scaling"] = dict(c["rotary_scaling"])
        if c.get("dtype") in _DTYPES:
            kwargs["dtype"] = c["dtype"]
        kwargs["tie_word_embeddings"] = self._is_tied()
        self._layer_counts()  # every stage's layers present, adding up to num_hidden_layers
        config = AutoConfig.for_model(model_type, **kwargs)
        config.architectures = [architecture]
        self._hf_config = config
        return config

    def generation_config(self) -> dict[str, Any]:
        return load_generation_config(self.path)

    def native_quantization(self) -> None:
        """None: quantized checkpoints are read dequantized (see the module docstring); an algo that cannot be
        read is refused here, before the engine is built."""
        self._check_quantization()
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
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"model file {self.rank_files[rank]!r} is not a valid safetensors file: {e}") from None

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

    def _excluded(self, module: str) -> bool:
        """Whether quantization.exclude_modules keeps a module unquantized (a pattern matches its full name or its
        last component, as TensorRT-LLM matches them)."""
        patterns = self.quantization.get("exclude_modules") or []
        return any(fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(module.rsplit(".", 1)[-1], p)
                   for p in patterns)

    # ---------------------------------------------------------------- tensors

    def _layouts(self, store: "_Store", config: Any) -> Iterator[tuple[str, _Joined]]:
        """Every Hugging Face tensor of the checkpoint and how the ranks' parts make it up."""
        tp, c = self.tp_size, self.config
        vocab = int(config.vocab_size)
        qwen2 = self._family()[0] == "qwen2"
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
            names = store.keys(ranks[0])
            for j in range(count):
                prefix, hf = f"transformer.layers.{j}.", f"model.layers.{offset + j}."
                suffixes = sorted(k[len(prefix):] for k in names if k.startswith(prefix))
                unknown = [s for s in suffixes if (s not in _LAYER_TENSORS and s not in _QKV and s not in _IGNORED
                                                   and not _is_scale(s, self.quant_algo))
                           or (qwen2 and s in _NO_QWEN2_BIAS)]
                if unknown:
                    raise ConfigError(f"model={self.path!r}: TensorRT-LLM tensors {[prefix + s for s in unknown]} "
                                      "are not read by ember (quantization scales of a layout it does not read, or "
                                      "a layer it does not support)")
                for s in _QKV:
                    if s in suffixes:
                        yield from self._qkv(store, ranks, prefix + s, hf, s.rsplit(".", 1)[1])
                for s in suffixes:
                    if s in _LAYER_TENSORS:
                        name, dim = _LAYER_TENSORS[s]
                        parts = ranks if dim is not None else ranks[:1]
                        yield hf + name, _Joined(dim or 0, tuple(_Part(r, prefix + s) for r in parts))
            offset += count
        yield "model.norm.weight", _Joined(0, (_Part(last[0], "transformer.ln_f.weight"),))
        if not self._is_tied():
            yield "lm_head.weight", _Joined(0, tuple(_Part(r, "lm_head.weight") for r in last), vocab)

    def _qkv(self, store: "_Store", ranks: list[int], key: str, hf: str, kind: str
             ) -> Iterator[tuple[str, _Joined]]:
        """Each rank's fused rows are [q_r; k_r; v_r]; KV heads repeated over ranks are read once."""
        c, tp = self.config, self.tp_size
        head = self._head_size()
        heads = int(c["num_attention_heads"])
        kv_heads = int(c.get("num_key_value_heads") or heads)
        rows = store.shape(ranks[0], key)[0]
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
        """Hugging Face names, the ranks' shares joined, quantized weights dequantized (keep_quantized changes
        nothing: no layout here is ember's). select: the part of each tensor to read; only the rank files' rows and
        columns under it are read."""
        from safetensors import SafetensorError, safe_open

        self._check_quantization()
        with ExitStack() as stack:
            files = []
            for file in self.rank_files:
                try:
                    files.append(stack.enter_context(safe_open(file, framework="pt")))
                except (SafetensorError, OSError) as e:
                    raise ConfigError(f"model file {file!r} is not a valid safetensors file: {e}") from None
            store = _Store(self, files)
            for name, joined in self._layouts(store, config):
                sl = select(name)
                if sl is not None:
                    yield name, _read(store, joined, sl)


def _is_scale(suffix: str, algo: str | None = None) -> bool:
    """A quantized linear's companion tensor (``attention.qkv.weights_scaling_factor``, ...); under a SmoothQuant
    plugin algo also that layout's (``attention.dense.smoother``, ``input_layernorm.scale_to_int``, ...)."""
    module, _, name = suffix.rpartition(".")
    if algo in SQ_PLUGIN_ALGOS and (suffix in _SQ_PLUGIN_LAYER or (module in _LINEARS and name in _SQ_PLUGIN_LINEAR)):
        return True
    return module in _LINEARS and name in _SCALES


class _Store:
    """The open rank files as Hugging Face-oriented float tensors: each tensor's shape ([out, in] for a linear
    weight) and any rows and columns of it, dequantized from the layouts of the module docstring."""

    def __init__(self, ckpt: TRTLLMCheckpoint, files: list[Any]) -> None:
        self.ckpt, self.files = ckpt, files
        self.algo = ckpt.quant_algo
        self.group = int(ckpt.quantization.get("group_size") or 128)
        self.dtype = _DTYPES.get(ckpt.config.get("dtype"))
        self._keys: dict[int, set[str]] = {}
        self._formats: dict[tuple[int, str], str] = {}

    def keys(self, rank: int) -> set[str]:
        if rank not in self._keys:
            self._keys[rank] = set(self.files[rank].keys())
        return self._keys[rank]

    def format(self, rank: int, key: str) -> str:
        """'float' (as stored), 'float_t' (a weight-only checkpoint's float weight, stored [in, out]), 'int4'
        (ModelOpt AWQ, W4A16), 'int8' (ModelOpt SmoothQuant, W8A16) or 'int8_sq' (TensorRT-LLM's SmoothQuant
        plugin layout); shapes checked."""
        if (rank, key) in self._formats:
            return self._formats[(rank, key)]
        data = self.files[rank].get_slice(key)
        dtype, shape = data.get_dtype(), data.get_shape()
        module = key[:-len(".weight")] if key.endswith(".weight") else ""
        linear = module == "lm_head" or module.endswith(tuple("." + m for m in _LINEARS))
        where = f"model={self.ckpt.path!r}: {os.path.basename(self.ckpt.rank_files[rank])} {key}"
        if dtype not in _INT_DTYPES:
            fmt = "float_t" if self.algo in _WEIGHT_ONLY and linear and module != "lm_head" \
                and not self.ckpt._excluded(module) else "float"
        elif not linear:
            raise ConfigError(f"{where} is {dtype}: only linear weights are read quantized")
        elif self.algo in _WEIGHT_ONLY and module + ".weights_scaling_factor" not in self.keys(rank):
            raise ConfigError(self.ckpt._preprocessed(key))
        elif self.algo not in READ_QUANT_ALGOS:
            raise ConfigError(f"{where} is {dtype}, but quantization.quant_algo={self.algo!r} says nothing of how")
        elif self.algo in SQ_PLUGIN_ALGOS:
            fmt = "int8_sq"
            scale = self._shape(rank, module + ".per_channel_scale")
            smoother = self._shape(rank, module + ".smoother")
            rows, cols = shape if len(shape) == 2 else (0, 0)
            n = 1 if "SQ_PER_TENSOR" in self.algo else rows
            if dtype != "I8" or len(shape) != 2 or scale not in ([1, n], [n]) \
                    or smoother not in (None, [1, cols], [cols]):
                raise ConfigError(f"{where} is {dtype} {shape} with per_channel_scale {scale} and smoother "
                                  f"{smoother}: not TensorRT-LLM's {self.algo} layout (weight I8 [out, in], "
                                  f"per_channel_scale [1, {'1' if n == 1 else 'out'}], smoother [1, in] or none)")
        else:
            fmt = "int4" if self.algo in ("W4A16_AWQ", "W4A16") else "int8"
            scale = self._shape(rank, module + ".weights_scaling_factor")
            pre = self._shape(rank, module + ".prequant_scaling_factor")
            rows, cols = (shape[0] * (2 if fmt == "int4" else 1), shape[1]) if len(shape) == 2 else (0, 0)
            scales = [[rows, cols // self.group]] if fmt == "int4" and cols % self.group == 0 else \
                [[rows], [rows, 1]] if fmt == "int8" else []
            if len(shape) != 2 or scale not in scales or pre not in (None, [cols], [1, cols]):
                layout = "[out/2, in], scales [out, in/group_size]" if fmt == "int4" else "[out, in], scales [out]"
                raise ConfigError(f"{where} is {dtype} {shape} with weights_scaling_factor {scale} and "
                                  f"prequant_scaling_factor {pre}: not ModelOpt's {self.algo} layout (weight "
                                  f"{layout}, prequant [in]; group_size={self.group})")
        self._formats[(rank, key)] = fmt
        return fmt

    def _shape(self, rank: int, key: str) -> list[int] | None:
        return self.files[rank].get_slice(key).get_shape() if key in self.keys(rank) else None

    def shape(self, rank: int, key: str) -> list[int]:
        shape = list(self.files[rank].get_slice(key).get_shape())
        fmt = self.format(rank, key)
        if fmt == "float_t":
            return shape[::-1]
        if fmt == "int4":
            return [2 * shape[0], shape[1]]
        return shape

    def read(self, rank: int, key: str, rows: tuple[int, int], cols: tuple[int, int] | None) -> torch.Tensor:
        """Rows [r0, r1) and columns [c0, c1) (None: a 1-D tensor) of the tensor as shape() gives it."""
        f, fmt = self.files[rank], self.format(rank, key)
        data = f.get_slice(key)
        r0, r1 = rows
        if cols is None:
            return data[r0:r1]
        c0, c1 = cols
        if fmt == "float":
            return data[r0:r1, c0:c1]
        if fmt == "float_t":
            return data[c0:c1, r0:r1].t().contiguous()
        module = key[:-len(".weight")]
        if fmt == "int8_sq":
            pcs = f.get_slice(module + ".per_channel_scale")
            s = pcs[:].float().reshape(-1)
            w = data[r0:r1, c0:c1].float() * (s if s.numel() == 1 else s[r0:r1]).reshape(-1, 1)
            if module + ".smoother" in self.keys(rank):
                w = w / f.get_slice(module + ".smoother")[:].float().reshape(-1)[c0:c1].reshape(1, -1)
            return w.to(self.dtype or torch.float32)
        scale = f.get_slice(module + ".weights_scaling_factor")
        if fmt == "int4":
            g = self.group
            q = _unpack_int4(data[r0 // 2:(r1 + 1) // 2, c0:c1])[r0 % 2:r0 % 2 + r1 - r0]
            g0, g1 = c0 // g, -(-c1 // g)
            s = scale[r0:r1, g0:g1].float().repeat_interleave(g, dim=1)[:, c0 - g0 * g:c1 - g0 * g]
        else:
            q = data[r0:r1, c0:c1]
            s = scale[r0:r1].float().reshape(-1, 1)
        w = q.float() * s
        if module + ".prequant_scaling_factor" in self.keys(rank):
            pre = f.get_slice(module + ".prequant_scaling_factor")
            w = w * (pre[c0:c1] if len(pre.get_shape()) == 1 else pre[:, c0:c1]).float().reshape(1, -1)
        return w.to(self.dtype or scale[0:1].dtype)


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [n, k], two signed int4 a byte (low nibble: output channel 2j, high: 2j + 1) -> int16 [2n, k]."""
    v = packed.to(torch.int16) & 0xFF
    low, high = ((v & 0xF) ^ 8) - 8, ((v >> 4) ^ 8) - 8
    return torch.stack([low, high], dim=1).reshape(-1, packed.shape[1])


def _read(store: _Store, joined: _Joined, sl: WeightSlice) -> torch.Tensor:
    """The slice of a joined tensor, read part by part: only the rows and columns it covers."""
    shapes = [store.shape(p.rank, p.key) for p in joined.parts]
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
    for part, extent in zip(joined.parts, extents):
        lo, hi = max(want[joined.dim][0], offset), min(want[joined.dim][1], offset + extent)
        offset += extent
        if lo >= hi:
            continue
        ranges = list(want)
        ranges[joined.dim] = (lo - offset + extent, hi - offset + extent)  # within this part
        rows = (ranges[0][0] + part.row0, ranges[0][1] + part.row0)
        pieces.append(store.read(part.rank, part.key, rows, None if ndim == 1 else ranges[1]))
    if not pieces:
        return torch.empty([hi - lo for lo, hi in want])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=joined.dim)
