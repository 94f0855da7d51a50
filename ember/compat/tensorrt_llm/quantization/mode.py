"""TensorRT-LLM's ``QuantAlgo`` names and its ``QuantConfig``, mapped onto ember's quantization modes."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class QuantAlgo(str, Enum):
    """Every name TensorRT-LLM's QuantAlgo has (v0.9); ``SUPPORTED`` says which ember runs."""

    W8A16 = "W8A16"
    W4A16 = "W4A16"
    W4A16_AWQ = "W4A16_AWQ"
    W4A8_AWQ = "W4A8_AWQ"
    W4A16_GPTQ = "W4A16_GPTQ"
    W8A8_SQ_PER_CHANNEL = "W8A8_SQ_PER_CHANNEL"
    W8A8_SQ_PER_TENSOR_PLUGIN = "W8A8_SQ_PER_TENSOR_PLUGIN"
    W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN = "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
    W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN = "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN"
    W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN = "W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN"
    FP8 = "FP8"
    INT8 = "INT8"


# weight algorithm -> ember's EngineConfig(quantization=...). SmoothQuant runs ember's w8a8: per-channel int8
# weights with per-token dynamic int8 activations (TensorRT-LLM's PER_CHANNEL_PER_TOKEN flavour).
WEIGHT_MODES = {QuantAlgo.W8A16: "int8", QuantAlgo.W4A16: "int4", QuantAlgo.W4A16_AWQ: "awq",
                QuantAlgo.W8A8_SQ_PER_CHANNEL: "smoothquant",
                QuantAlgo.W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN: "smoothquant"}
KV_MODES = {QuantAlgo.INT8: "int8"}


def _algo(value: Any, name: str, allowed: dict) -> QuantAlgo | None:
    if value is None:
        return None
    try:
        algo = QuantAlgo(value.value if isinstance(value, Enum) else value)
    except ValueError:
        algo = None
    if algo not in allowed:
        names = ", ".join(f"QuantAlgo.{a.name}" for a in allowed)
        raise ValueError(f"{name}={value!r} is not supported on ember: use one of {names} or None")
    return algo


@dataclass
class QuantConfig:
    """TensorRT-LLM's QuantConfig fields; ``ember_kwargs`` gives the EngineConfig settings they mean."""

    quant_algo: QuantAlgo | None = None
    kv_cache_quant_algo: QuantAlgo | None = None
    group_size: int = 128
    smoothquant_val: float | None = None
    has_zero_point: bool = False
    pre_quant_scale: bool = False
    exclude_modules: list[str] | None = None

    def ember_kwargs(self) -> dict[str, Any]:
        """EngineConfig settings; ValueError names the field and the allowed values for anything ember lacks."""
        weights = _algo(self.quant_algo, "quant_algo", WEIGHT_MODES)
        kv = _algo(self.kv_cache_quant_algo, "kv_cache_quant_algo", KV_MODES)
        if self.smoothquant_val is not None:
            raise ValueError(f"smoothquant_val={self.smoothquant_val!r} is not supported: ember's SmoothQuant picks "
                             "its migration strength itself (docs/quantization.md); leave it None")
        if self.exclude_modules:
            raise ValueError(f"exclude_modules={self.exclude_modules!r} is not supported: ember quantizes every "
                             "linear layer of the decoder; leave it None")
        out: dict[str, Any] = {}
        if weights is not None:
            out["quantization"] = WEIGHT_MODES[weights]
            if weights in (QuantAlgo.W4A16, QuantAlgo.W4A16_AWQ):
                out["quant_group_size"] = self.group_size
        if kv is not None:
            out["kv_cache_dtype"] = KV_MODES[kv]
        return out
