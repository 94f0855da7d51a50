"""``AutoEasyDeLModelForCausalLM.from_pretrained`` on ember: every argument of EasyDeL's is honoured, mapped or
accepted with a stated reason (docs/easydel.md), and checked before anything loads.

It returns an ``EasyDeLCausalLM``: the checked checkpoint and the engine settings the arguments map to. The weights
load when ``vSurge`` builds the engine (``compile`` or ``start``), because the KV pool and the warm-up are sized by
vSurge's arguments (concurrent decodes, lengths) that only arrive then.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ember.compat.easydel import sharding, values
from ember.compat.easydel.enums import (
    AttentionMechanisms,
    EasyDeLBackends,
    EasyDeLGradientCheckPointers,
    EasyDeLPlatforms,
    EasyDeLQuantizationMethods,
    PartitionAxis,
)
from ember.compat.easydel.values import member, torch_dtype
from ember.config import EngineConfig, hub
from ember.quantization.config import INT4_GROUP_SIZES

logger = logging.getLogger("ember")

_Q = EasyDeLQuantizationMethods
WEIGHT_QUANTIZATION = {_Q.NONE: "none", _Q.NF4: "int4", _Q.A8BIT: "int8"}  # EngineConfig.quantization
KV_QUANTIZATION = {_Q.NONE: "auto", _Q.NF4: "uint4", _Q.A8BIT: "int8"}  # EngineConfig.kv_cache_dtype
BACKEND_DEVICES = {EasyDeLBackends.CPU: "cpu", EasyDeLBackends.GPU: "cuda"}

# EasyDeLBaseConfigDict keys that shape JAX kernels, scans, training or sharding constraints: accepted, with no
# effect on ember (its kernels, block sizes and KV layout are its own; inference has no backward pass)
CONFIG_KEYS_WITHOUT_EFFECT = frozenset({
    "blocksize_k", "blocksize_q", "blocksize_b", "moe_tiling_size_batch", "moe_tiling_size_seqlen",
    "moe_tiling_size_dim", "shard_attention_computation", "use_sharded_kv_caching", "use_sharding_constraint",
    "use_pallas_group_matmul", "easy_method", "bits", "scan_ring_attention", "scan_attention_layers", "use_scan_mlp",
    "scan_mlp_chunk_size", "sequence_axis_name", "kv_cache_quantization_blocksize",
    "kv_cache_sharding_sequence_axis_name", "flash_attention_backward_pass_impl", "attn_dtype", "attn_softmax_dtype",
    "fcm_max_ratio", "fcm_min_ratio", "hardware_abstraction", "pallas_m_block_size", "pallas_k_block_size",
    "pallas_n_block_size", "precompute_masks", "sharding_dcn_axis_dims"})
CONFIG_KEYS_READ = frozenset({
    "freq_max_position_embeddings", "mask_max_position_embeddings", "kv_cache_quantization_method", "kvdtype",
    "attn_mechanism", "decode_attn_mechanism", "gradient_checkpointing", "sharding_axis_dims", "sharding_axis_names",
    "partition_axis", "backend", "platform"})


@dataclass(frozen=True, slots=True)
class EasyDeLCausalLM:
    """A checkpoint checked and mapped onto ember's engine settings; vSurge.from_model builds the engine from it."""

    path: str  # the checkpoint file or folder found
    config: Any  # the checkpoint's transformers config, with config_kwargs' max positions set on it
    model_type: str
    num_parameters: int
    engine_settings: dict[str, Any] = field(repr=False)  # EngineConfig keyword arguments
    max_length: int  # the longest sequence (prompt + output): the smaller of the two max-position settings
    precision: str | None = None
    attn_mechanism: AttentionMechanisms = AttentionMechanisms.AUTO
    decode_attn_mechanism: AttentionMechanisms | None = None
    gradient_checkpointing: EasyDeLGradientCheckPointers = EasyDeLGradientCheckPointers.NONE
    partition_axis: PartitionAxis = PartitionAxis()
    sharding_axis_dims: tuple[int, ...] = sharding.DEFAULT_AXIS_DIMS

    @property
    def granted_mask_max_position_embedding(self) -> int:
        return self.max_length

    @property
    def tensor_parallel_size(self) -> int:
        return self.engine_settings["tensor_parallel_size"]

    @property
    def dtype(self) -> torch.dtype:
        return self.engine_settings["dtype"]


class AutoEasyDeLModelForCausalLM:
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, device: Any = None, dtype: Any = None,
                        param_dtype: Any = None, precision: Any = None,
                        sharding_axis_dims: tuple[int, ...] | None = None, sharding_dcn_axis_dims: Any = None,
                        sharding_axis_names: tuple[str, ...] | None = None, partition_axis: PartitionAxis | None = None,
                        shard_attention_computation: bool = True, shard_fns: Any = None,
                        backend: Any = None, platform: Any = None, config_kwargs: dict | None = None,
                        auto_shard_model: bool = True, partition_rules: Any = None,
                        quantization_platform: Any = None, quantization_method: Any = _Q.NONE,
                        quantization_block_size: int = 128, quantization_pattern: str | None = None,
                        quantize_tensors: bool = True, verbose: bool = True, from_torch: bool | None = None,
                        **kwargs: Any) -> EasyDeLCausalLM:
        """Check the checkpoint and map EasyDeL's arguments onto ember's engine settings (nothing loads yet)."""
        if kwargs:
            raise TypeError(f"from_pretrained() got arguments ember does not know: {', '.join(sorted(kwargs))}")
        ck = dict(config_kwargs or {})
        unknown = set(ck) - CONFIG_KEYS_READ - CONFIG_KEYS_WITHOUT_EFFECT
        if unknown:
            raise ValueError(f"config_kwargs has keys EasyDeLBaseConfigDict does not define: {sorted(unknown)}")
        for name, value in (("shard_fns", shard_fns), ("partition_rules", partition_rules),
                            ("quantization_pattern", quantization_pattern)):
            if value is not None:
                raise ValueError(f"{name}={value!r} is not supported: ember splits and quantizes every linear layer "
                                 "by its own rules (docs/easydel.md); pass None")
        dcn = sharding_dcn_axis_dims if sharding_dcn_axis_dims is not None else ck.get("sharding_dcn_axis_dims")
        if dcn is not None and any(d not in (1, -1) for d in dcn):
            raise ValueError(f"sharding_dcn_axis_dims={dcn!r} is not supported: ember runs across machines with "
                             "torchrun / Ray launchers (docs/parallel.md); pass None")
        if quantization_block_size not in INT4_GROUP_SIZES and member(_Q, quantization_method,
                                                                      "quantization_method") is _Q.NF4:
            raise ValueError(f"quantization_block_size={quantization_block_size!r} is out of range for 4-bit weights: "
                             f"use one of {INT4_GROUP_SIZES}")
        for name, value, enum in (("platform", platform if platform is not None else ck.get("platform"),
                                   EasyDeLPlatforms),
                                  ("quantization_platform", quantization_platform, EasyDeLPlatforms)):
            if value is not None:
                member(enum, value, name)

        path = _checkpoint_path(pretrained_model_name_or_path)
        hf_config = _hf_config(path)
        max_length = _max_length(ck, hf_config)
        model_dtype = _model_dtype(dtype, param_dtype)
        device_name = _device(device, backend if backend is not None else ck.get("backend"))
        axis = partition_axis or ck.get("partition_axis") or PartitionAxis()
        dims = tuple(sharding_axis_dims or ck.get("sharding_axis_dims") or sharding.DEFAULT_AXIS_DIMS)
        names = tuple(sharding_axis_names or ck.get("sharding_axis_names") or sharding.AXIS_NAMES)
        tp = sharding.tensor_parallel_size(dims, names, axis, sharding.device_count(device_name))
        if not auto_shard_model and tp > 1:
            logger.info("auto_shard_model=False: the weights are not split; the engine runs as one rank")
            tp = 1
        weights = WEIGHT_QUANTIZATION[member(_Q, quantization_method, "quantization_method")]
        kv = _kv_cache_dtype(ck.get("kvdtype"), ck.get("kv_cache_quantization_method", _Q.NONE), model_dtype)
        settings = dict(model=path, dtype=model_dtype, device=device_name, quantization=weights,
                        quant_group_size=quantization_block_size if weights == "int4" else None, kv_cache_dtype=kv,
                        tensor_parallel_size=tp, max_model_len=max_length)
        _check_settings(settings)
        decode = ck.get("decode_attn_mechanism")
        return EasyDeLCausalLM(
            path, hf_config, getattr(hf_config, "model_type", "llama"), _num_parameters(hf_config), settings,
            max_length, precision=values.precision(precision),
            attn_mechanism=member(AttentionMechanisms, ck.get("attn_mechanism", "auto"), "attn_mechanism"),
            decode_attn_mechanism=None if decode is None else member(AttentionMechanisms, decode,
                                                                     "decode_attn_mechanism"),
            gradient_checkpointing=member(EasyDeLGradientCheckPointers, ck.get("gradient_checkpointing", ""),
                                          "gradient_checkpointing"),
            partition_axis=axis, sharding_axis_dims=dims)


def _checkpoint_path(name: Any) -> str:
    if not isinstance(name, (str, os.PathLike)):
        raise ValueError(f"pretrained_model_name_or_path={name!r} is not a path: pass a Hugging Face folder, a "
                         ".gguf file, an .asmodel file or a hub id ('org/name')")
    path = hub.resolve(str(name), arg="pretrained_model_name_or_path",
                       accepted="a Hugging Face folder, a .gguf file or an .asmodel file")
    return EngineConfig(model=path).resolve().model.path


def _hf_config(path: str) -> Any:
    from ember.model_loader import open_checkpoint

    return open_checkpoint(path).hf_config()


def _max_length(ck: dict, hf_config: Any) -> int:
    """The smaller of freq_ / mask_max_position_embeddings (either may be absent), else the model's positions;
    longer than the model's positions is refused (ember extends no RoPE table). Both are set on the config, as
    EasyDeL's config carries them."""
    positions = int(getattr(hf_config, "max_position_embeddings", 0) or 8192)
    asked = [ck[k] for k in ("freq_max_position_embeddings", "mask_max_position_embeddings") if ck.get(k) is not None]
    for value in asked:
        if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= positions:
            raise ValueError(f"config_kwargs max position {value!r} is out of range: it must be an integer in "
                             f"[2, {positions}] (the model's max_position_embeddings)")
    length = min(asked) if asked else positions
    for key in ("freq_max_position_embeddings", "mask_max_position_embeddings"):
        setattr(hf_config, key, ck.get(key) or positions)
    return length


def _model_dtype(dtype: Any, param_dtype: Any) -> torch.dtype:
    """EasyDeL stores the weights in param_dtype and casts them to dtype for every product. ember computes in the
    dtype it stores them in: float32 parameters computed in bfloat16 / float16 are cast before each product, which
    is the same as storing them in that dtype, so they are held in dtype (same results, half the memory). Parameters
    narrower than the compute dtype (rounded to bfloat16, computed in float32) ember cannot hold: refused."""
    compute, params = torch_dtype(dtype, "dtype"), torch_dtype(param_dtype, "param_dtype")
    chosen = compute or params or torch.bfloat16
    if params is not None and params != chosen:
        if params != torch.float32:
            raise ValueError(f"param_dtype={_name(params)} with dtype={_name(chosen)} is not supported: ember computes "
                             "in the dtype it stores the weights in, so it cannot keep them rounded to "
                             f"{_name(params)} while computing in {_name(chosen)}; pass param_dtype={_name(chosen)} "
                             f"(or dtype={_name(params)})")
        logger.info("param_dtype=float32 with dtype=%s: the weights are cast to %s before every product, so ember "
                    "holds them in %s (the same results)", _name(chosen), _name(chosen), _name(chosen))
    return chosen


def _kv_cache_dtype(kvdtype: Any, method: Any, model_dtype: torch.dtype) -> str:
    """The KV cache's element type: kv_cache_quantization_method picks int8 / uint4 (EasyDeL's A8BIT / NF4); a float
    cache is kept in the model's dtype, so a kvdtype (EasyDeL: float dtypes only) must be that one; float8 and a
    different float are refused, since ember has no such cache."""
    chosen = KV_QUANTIZATION[member(_Q, method, "kv_cache_quantization_method")]
    if kvdtype is None:
        return chosen
    try:
        kv = torch_dtype(kvdtype, "kvdtype")
    except ValueError:
        name = kvdtype if isinstance(kvdtype, str) else values.dtype_name(kvdtype) or kvdtype
        raise ValueError(f"kvdtype={name!r} is not supported: ember keeps a float KV cache in the model's dtype "
                         f"({_name(model_dtype)}); quantize it with kv_cache_quantization_method (A8BIT: int8, NF4: "
                         "uint4)") from None
    if kv != model_dtype and chosen == "auto":  # a quantized cache stores neither float
        raise ValueError(f"kvdtype={_name(kv)} with dtype={_name(model_dtype)} is not supported: ember keeps a float "
                         f"KV cache in the dtype it computes in; pass kvdtype={_name(model_dtype)} (or leave it out), "
                         "or quantize the cache with kv_cache_quantization_method (A8BIT: int8, NF4: uint4)")
    return chosen


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _device(device: Any, backend: Any) -> str:
    """EasyDeL's backend (or a jax device's platform) as ember's device."""
    if device is not None:
        platform = device if isinstance(device, str) else getattr(device, "platform", None)
        backend = backend if backend is not None else platform
    if backend is None:
        return "auto"
    chosen = member(EasyDeLBackends, backend, "backend")
    if chosen not in BACKEND_DEVICES:
        raise ValueError(f"backend={backend!r} is not supported: ember runs on CPU (EasyDeLBackends.CPU) or CUDA "
                         "(EasyDeLBackends.GPU)")
    return BACKEND_DEVICES[chosen]


def _check_settings(settings: dict[str, Any]) -> None:
    """The engine settings, checked now: ranges, and a tensor split the model's heads and layout allow."""
    from ember.model_loader import check_parallel

    resolved = EngineConfig(**settings).resolve()
    check_parallel(resolved.model, settings["tensor_parallel_size"], 1, None)


def _num_parameters(c: Any) -> int:
    """Parameters of a Llama-family model from its config (for vSurge's default name, as EasyDeL counts them)."""
    h, layers, inter, vocab = c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    hd = getattr(c, "head_dim", None) or h // heads
    per_layer = h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * inter + 2 * h
    return vocab * h * (1 if getattr(c, "tie_word_embeddings", False) else 2) + layers * per_layer + h
