"""The HLAPI's configuration objects (TensorRT-LLM v0.8-0.9, ../shared/reference/tensorrt-llm-hlapi.md):
``ModelConfig`` with its ``ParallelConfig`` and ``QuantConfig``, ``KvCacheConfig``, ``CapacitySchedulerPolicy``
and ``StreamingLLMParam``. They hold what the user set; ``LLM`` translates them into one native EngineConfig."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ember.compat.tensorrt_llm.quantization.mode import QuantConfig
from ember.config import hub
from ember.model_loader.trtllm_engine import engine_folder_message, is_engine_config

logger = logging.getLogger("ember")

# what model_dir may be, as ModelConfig detects it
FORMATS = ("a Hugging Face model folder", "a TensorRT-LLM checkpoint folder (config.json + rank{N}.safetensors)",
           "a folder written by LLM.save", "a .gguf file", "an ember .asmodel file")


class CapacitySchedulerPolicy(str, Enum):
    """TensorRT-LLM's capacity scheduler policies; ember's scheduler has both, under these names in lower case."""

    MAX_UTILIZATION = "max_utilization"
    GUARANTEED_NO_EVICT = "guaranteed_no_evict"


@dataclass
class KvCacheConfig:
    """The paged KV cache. free_gpu_memory_fraction: ember's kv_cache_memory_fraction (CUDA: the share of device
    memory ember may use, weights included; CPU: the share of available RAM for the pool); max_tokens: the pool's
    most tokens (the smaller of the two wins, as in TensorRT-LLM); max_attention_window / sink_token_length:
    StreamingLLM; enable_block_reuse: prefix caching (off by default, as in TensorRT-LLM); max_new_tokens: the
    default ``SamplingConfig.max_new_tokens`` of this LLM."""

    max_tokens: int | None = None
    max_attention_window: int | None = None
    sink_token_length: int | None = None
    free_gpu_memory_fraction: float | None = None
    enable_block_reuse: bool = False
    max_new_tokens: int | None = None


@dataclass(unsafe_hash=True)
class StreamingLLMParam:
    """StreamingLLM: KV of the first sink_token_length tokens and the most recent ones, max_attention_window_size
    tokens in all (TensorRT-LLM's defaults)."""

    max_attention_window_size: int = 2048
    sink_token_length: int = 4


@dataclass
class ParallelConfig:
    """tp_size x pp_size ranks; with auto_parallel, world_size ranks split as ``ModelConfig.auto_parallel_plan``
    chooses. devices: CUDA device ids (ember runs rank r on device r: select others with CUDA_VISIBLE_DEVICES)."""

    tp_size: int = 1
    pp_size: int = 1
    world_size: int = 1
    devices: list[int] = field(default_factory=list)
    auto_parallel: bool = False

    def get_devices(self) -> list[int]:
        return self.devices if self.devices else list(range(self.tp_size))


def model_format(path: str) -> str:
    """'hf' | 'trtllm-checkpoint' | 'saved' | 'gguf' | 'asmodel'; ValueError naming the accepted formats else."""
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return "gguf"
        if path.endswith(".asmodel"):
            return "asmodel"
    elif os.path.isdir(path):
        cfg = os.path.join(path, "config.json")
        if os.path.isfile(cfg):
            with open(cfg, encoding="utf-8") as f:
                meta = json.load(f)
            if is_engine_config(meta):
                raise ValueError("model_dir=" + engine_folder_message(
                    path, meta, "set them on the ModelConfig with config._set_additional_options(max_batch_size=..., "
                    "max_input_len=..., max_output_len=..., max_num_tokens=...) and max_beam_width=..."))
            if "architecture" in meta and os.path.isfile(os.path.join(path, "rank0.safetensors")):
                return "trtllm-checkpoint"
            return "hf"
        if len([f for f in os.listdir(path) if f.endswith(".asmodel")]) == 1:
            return "saved"
    raise ValueError(f"model_dir={path!r} is none of the formats ember reads: pass {', '.join(FORMATS)}")


@dataclass
class ModelConfig:
    """What to run: model_dir (any of FORMATS), max_beam_width, parallel_config, quant_config. A TensorRT-LLM
    checkpoint brings its tp_size / pp_size (as TensorRT-LLM does); a folder written by ``LLM.save`` brings the
    quantization, max_beam_width, KV settings and tp_size / pp_size it was saved with (set them after
    ModelConfig(...) to change them)."""

    model_dir: str | None = None
    model: Any = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    quant_config: QuantConfig = field(default_factory=QuantConfig)
    max_beam_width: int = 1
    plugin_config: Any = None

    def __post_init__(self) -> None:
        # TensorRT-LLM builds its engine for these (its defaults); here they bound the engine: max_batch_size
        # sequences, max_input_len + max_output_len tokens each, max_num_tokens a step
        self._max_batch_size, self._max_input_len, self._max_output_len = 128, 512, 200
        self._max_num_tokens: int | None = 4096
        if not self.model_dir:
            raise ValueError("model_dir is required: pass " + ", ".join(FORMATS))
        if self.model is not None:
            raise ValueError("model= (an in-memory or hub model) is not supported: ember runs from files; pass "
                             "model_dir")
        if self.plugin_config:
            raise ValueError("plugin_config is not supported: it configures TensorRT plugins; ember has none")
        self.model_dir = hub.resolve(str(self.model_dir), arg="model_dir", accepted=", ".join(FORMATS))
        if isinstance(self.max_beam_width, bool) or not isinstance(self.max_beam_width, int) \
                or self.max_beam_width < 1:
            raise ValueError(f"max_beam_width={self.max_beam_width!r} is out of range: it must be an integer >= 1")
        self.model_format = model_format(self.model_dir)
        self.saved: dict[str, Any] = {}
        if self.model_format == "trtllm-checkpoint":
            self._adopt_checkpoint_mapping()
        elif self.model_format == "saved":
            self._adopt_saved_settings()

    def _set_additional_options(self, max_batch_size: int | None = None, max_input_len: int | None = None,
                                max_output_len: int | None = None, max_num_tokens: int | None = None) -> None:
        """TensorRT-LLM's way to change the build limits (for testing and debugging, it says); each one given is
        set."""
        for name, value in (("max_batch_size", max_batch_size), ("max_input_len", max_input_len),
                            ("max_output_len", max_output_len), ("max_num_tokens", max_num_tokens)):
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{name}={value!r} is out of range: it must be an integer >= 1")
                setattr(self, "_" + name, value)

    @property
    def max_batch_size(self) -> int:
        return self._max_batch_size

    @property
    def max_input_len(self) -> int:
        return self._max_input_len

    @property
    def max_output_len(self) -> int:
        return self._max_output_len

    @property
    def max_num_tokens(self) -> int | None:
        return self._max_num_tokens

    @property
    def model_path(self) -> str:
        """The path ember loads: a saved folder's .asmodel file, else model_dir."""
        if self.model_format == "saved":
            name = next(f for f in sorted(os.listdir(self.model_dir)) if f.endswith(".asmodel"))
            return os.path.join(self.model_dir, name)
        return self.model_dir

    @property
    def is_multi_gpu(self) -> bool:
        return self.world_size > 1

    @property
    def world_size(self) -> int:
        p = self.parallel_config
        if p.auto_parallel:
            if p.tp_size > 1 or p.pp_size > 1:
                raise ValueError("tp_size / pp_size cannot be set with auto_parallel: set world_size only")
            return p.world_size
        if p.world_size > 1:
            raise ValueError(f"world_size={p.world_size} is only read with auto_parallel=True: set tp_size / pp_size")
        return p.tp_size * p.pp_size

    def _adopt_checkpoint_mapping(self) -> None:
        with open(os.path.join(self.model_dir, "config.json"), encoding="utf-8") as f:
            mapping = json.load(f).get("mapping", {})
        tp, pp, p = mapping.get("tp_size", 1), mapping.get("pp_size", 1), self.parallel_config
        for name, ours, theirs in (("tp_size", p.tp_size, tp), ("pp_size", p.pp_size, pp)):
            if ours not in (1, theirs):
                raise ValueError(f"{name}={ours} is not consistent with the checkpoint's {name}={theirs}")
        if not p.auto_parallel:
            p.tp_size, p.pp_size = tp, pp

    def _adopt_saved_settings(self) -> None:
        from ember.model_loader import asmodel

        self.saved = asmodel.read_meta(self.model_path).get("extra", {}).get("tensorrt_llm", {})
        self.max_beam_width = max(self.max_beam_width, self.saved.get("max_beam_width", 1))
        p = self.parallel_config  # the split it was saved with, as a built engine keeps its ranks
        p.tp_size, p.pp_size = int(self.saved.get("tp_size", 1)), int(self.saved.get("pp_size", 1))
