"""DashInfer's runtime configuration (``AsModelConfig``) and its fluent builder, translated to ember's EngineConfig
when the model starts."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from ember import envs
from ember.compat.dashinfer.allspark.status import AsCacheMode, TargetDevice

logger = logging.getLogger("ember")

SPAN_SIZES = (16, 32, 64, 128)


@dataclass(slots=True)
class AsModelConfig:
    """One installed model's runtime settings, with DashInfer's field names."""

    model_name: str = ""
    model_path: str = ""  # the .asmodel file
    weights_path: str = ""  # the .asparam file
    compute_unit: str = "CPU:0"  # "CUDA:0", "CUDA:0,1", "CPU:0"
    num_threads: int = 0  # CPU compute threads; 0: ember's choice
    engine_max_length: int = 2048  # prompt + output tokens of one request
    engine_max_batch: int = 32  # requests running at once
    engine_max_prefill_length: int = 0  # prompt tokens per step; 0: ember's default (chunked prefill)
    cache_mode: AsCacheMode = AsCacheMode.AsCacheDefault
    cache_span_size: int = 16  # tokens per KV block (DashInfer's span); ember's default block size
    cache_span_num_init: int = 0
    enable_prefix_cache: bool = True
    prefix_cache_ttl: int = 300  # seconds a cached prefix block unused by any request is kept
    lora_max_rank: int = 64
    lora_max_num: int = 5
    enable_sparsity_matmul: bool = False
    memory_ratio: float | None = None  # cuda_mem.memory_ratio: ember's kv_cache_memory_fraction
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def device_type(self) -> str:
        return self.compute_unit.split(":", 1)[0]

    @property
    def device_ids(self) -> list[int]:
        ids = self.compute_unit.split(":", 1)[1] if ":" in self.compute_unit else ""
        return [int(i) for i in ids.split(",") if i.strip()]


def _positive_int(name: str, value: Any, low: int = 1) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = None
    if number is None or isinstance(value, bool) or number < low or (isinstance(value, float) and value != number):
        raise ValueError(f"{name}={value!r} is out of range: it must be an integer >= {low}")
    return number


def cache_mode_from(value: Any) -> AsCacheMode:
    if isinstance(value, AsCacheMode):
        return value
    if isinstance(value, str) and value in AsCacheMode.__members__:
        return AsCacheMode[value]
    raise ValueError(f"kv_cache_mode={value!r} is not a cache mode: use one of {list(AsCacheMode.__members__)}")


class AsModelRuntimeConfigBuilder:
    """Fluent builder of an AsModelConfig: every setter returns the builder; build() hands the config out and
    starts a fresh one."""

    def __init__(self) -> None:
        self.new_runtime_cfg = AsModelConfig()

    def model_name(self, model_name: str) -> "AsModelRuntimeConfigBuilder":
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(f"model_name={model_name!r} is invalid: it must be a non-empty string")
        self.new_runtime_cfg.model_name = model_name
        return self

    def model_dir(self, model_dir: str, file_name_prefix: str) -> "AsModelRuntimeConfigBuilder":
        """Run the serialized pair model_dir/PREFIX.asmodel + PREFIX.asparam."""
        self.new_runtime_cfg.model_path = os.path.join(model_dir, file_name_prefix + ".asmodel")
        self.new_runtime_cfg.weights_path = os.path.join(model_dir, file_name_prefix + ".asparam")
        return self

    def model_file_path(self, model_file_name: str, weight_file_path: str) -> "AsModelRuntimeConfigBuilder":
        self.new_runtime_cfg.model_path = model_file_name
        self.new_runtime_cfg.weights_path = weight_file_path
        return self

    def compute_unit(self, target_device: TargetDevice | str, device_id_array: list[int] | None = None,
                     compute_thread_in_device: int = 0) -> "AsModelRuntimeConfigBuilder":
        """CUDA with card ids, CPU (one NUMA node), or CPU_NUMA with node ids; threads apply to CPU."""
        if isinstance(target_device, str):
            mapping = {d.value.lower(): d for d in TargetDevice}
            if target_device.lower() not in mapping:
                raise ValueError(f"target_device={target_device!r} is not supported: use one of "
                                 f"{[d.name for d in TargetDevice]}")
            target_device = mapping[target_device.lower()]
        if not isinstance(target_device, TargetDevice):
            raise ValueError(f"target_device={target_device!r} is not a TargetDevice")
        ids = [0] if not device_id_array else [_positive_int("device_id", i, 0) for i in device_id_array]
        unit = "CUDA" if target_device is TargetDevice.CUDA else "CPU"
        if target_device is TargetDevice.CPU:
            ids = [0]
        self.new_runtime_cfg.compute_unit = f"{unit}:{','.join(map(str, ids))}"
        self.new_runtime_cfg.num_threads = _positive_int("compute_thread_in_device", compute_thread_in_device, 0)
        if target_device is TargetDevice.CPU_NUMA:
            self.new_runtime_cfg.extra["numa"] = True
        return self

    def set_compute_unit_from_str(self, compute_unit: str) -> "AsModelRuntimeConfigBuilder":
        """'CUDA:0', 'CUDA:0,1' or 'CPU:0'."""
        kind, _, ids = compute_unit.partition(":")
        if kind not in ("CUDA", "CPU", "CPU_NUMA") or not ids:
            raise ValueError(f"compute_unit={compute_unit!r} is not supported: use e.g. 'CUDA:0' or 'CPU:0'")
        return self.compute_unit(kind, [int(i) for i in ids.split(",") if i.strip()], self.new_runtime_cfg.num_threads)

    def max_length(self, length: int | str) -> "AsModelRuntimeConfigBuilder":
        self.new_runtime_cfg.engine_max_length = _positive_int("max_length", length, 2)
        return self

    def max_batch(self, batch: int | str) -> "AsModelRuntimeConfigBuilder":
        self.new_runtime_cfg.engine_max_batch = _positive_int("max_batch", batch)
        return self

    def max_prefill_length(self, length: int) -> "AsModelRuntimeConfigBuilder":
        self.new_runtime_cfg.engine_max_prefill_length = _positive_int("max_prefill_length", length)
        return self

    def prefill_cache(self, enable: bool = True) -> "AsModelRuntimeConfigBuilder":
        self.new_runtime_cfg.enable_prefix_cache = bool(enable)
        return self

    def prefix_cache_ttl(self, ttl: int = 300) -> "AsModelRuntimeConfigBuilder":
        self.new_runtime_cfg.prefix_cache_ttl = _positive_int("prefix_cache_ttl", ttl, 0)
        return self

    def kv_cache_mode(self, cache_mode: AsCacheMode | str) -> "AsModelRuntimeConfigBuilder":
        self.new_runtime_cfg.cache_mode = cache_mode_from(cache_mode)
        return self

    def kv_cache_span_size(self, span_size: int) -> "AsModelRuntimeConfigBuilder":
        if span_size not in SPAN_SIZES:
            raise ValueError(f"kv_cache_span_size={span_size!r} is out of range: use one of {SPAN_SIZES}")
        self.new_runtime_cfg.cache_span_size = span_size
        return self

    def set_span_init_size(self, span_init_size: int) -> "AsModelRuntimeConfigBuilder":
        self.new_runtime_cfg.cache_span_num_init = _positive_int("span_init_size", span_init_size, 0)
        return self

    def lora_max_rank(self, rank: int) -> "AsModelRuntimeConfigBuilder":
        self.new_runtime_cfg.lora_max_rank = _positive_int("lora_max_rank", rank)
        return self

    def lora_max_num(self, num: int) -> "AsModelRuntimeConfigBuilder":
        self.new_runtime_cfg.lora_max_num = _positive_int("lora_max_num", num, 0)
        return self

    def enable_sparsity_matmul(self, enable: bool = False) -> "AsModelRuntimeConfigBuilder":
        if enable:
            raise ValueError("enable_sparsity_matmul=True is not supported: ember has no sparse matmul")
        return self

    def from_dict(self, rfield: dict[str, Any]) -> "AsModelRuntimeConfigBuilder":
        """DashInfer's DIConfig 'runtime_config' dict: model_name, compute_unit {device_type, device_ids,
        compute_thread_in_device}, engine_max_length, engine_max_batch, and the optional keys of update_from_dict."""
        for key in ("model_name", "compute_unit", "engine_max_length", "engine_max_batch"):
            if key not in rfield:
                raise ValueError(f"runtime config dict has no {key!r}: from_dict needs model_name, compute_unit, "
                                 "engine_max_length and engine_max_batch")
        unit = rfield["compute_unit"]
        self.model_name(rfield["model_name"]).compute_unit(unit["device_type"], unit.get("device_ids"),
                                                           unit.get("compute_thread_in_device", 0))
        return self.update_from_dict(rfield)

    _DICT_KEYS = ("model_name", "compute_unit", "engine_max_length", "engine_max_batch", "enable_prefix_cache",
                  "prefix_cache_ttl", "kv_cache_mode", "kv_cache_span_size", "enable_sparsity_matmul",
                  "cache_span_num_init", "engine_max_prefill_length", "cuda_mem")

    def update_from_dict(self, rfield: dict[str, Any]) -> "AsModelRuntimeConfigBuilder":
        unknown = sorted(set(rfield) - set(self._DICT_KEYS))
        if unknown:
            raise ValueError(f"runtime config key {unknown[0]!r} is unknown: allowed keys are {list(self._DICT_KEYS)}")
        setters = {"enable_prefix_cache": self.prefill_cache, "prefix_cache_ttl": self.prefix_cache_ttl,
                   "kv_cache_mode": self.kv_cache_mode, "kv_cache_span_size": self.kv_cache_span_size,
                   "enable_sparsity_matmul": self.enable_sparsity_matmul,
                   "cache_span_num_init": self.set_span_init_size,
                   "engine_max_prefill_length": self.max_prefill_length, "engine_max_length": self.max_length,
                   "engine_max_batch": self.max_batch}
        for key, setter in setters.items():
            if key in rfield:
                setter(rfield[key])
        if "cuda_mem" in rfield and "memory_ratio" in rfield["cuda_mem"]:
            ratio = rfield["cuda_mem"]["memory_ratio"]
            self.new_runtime_cfg.memory_ratio = envs.ratio_from("cuda_mem.memory_ratio", str(ratio))
        return self

    def build(self) -> AsModelConfig:
        cfg, self.new_runtime_cfg = self.new_runtime_cfg, AsModelConfig()
        return cfg
