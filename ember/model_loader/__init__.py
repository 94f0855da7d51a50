"""Build a model from a Hugging Face folder or a GGUF file, with its tokenizer and generation defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ember.config import EngineConfig, resolve_dtype
from ember.layers.linear import mkldnn_prepack_available
from ember.model_loader.gguf import GGUFCheckpoint
from ember.model_loader.hf import iter_safetensors, load_generation_config, load_hf_config
from ember.models import resolve_architecture
from ember.tokenizer import Tokenizer


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    hf_config: Any
    architecture: str
    dtype: torch.dtype
    tokenizer: Tokenizer
    generation_config: dict[str, Any]
    eos_token_ids: tuple[int, ...]
    max_position: int


def load_model(config: EngineConfig) -> LoadedModel:
    if config.is_gguf:
        ckpt = GGUFCheckpoint(config.model)
        hf_config = ckpt.hf_config()
        generation_config: dict[str, Any] = {}
    else:
        ckpt = None
        hf_config = load_hf_config(config.model)
        generation_config = load_generation_config(config.model)
    architecture, cls = resolve_architecture(getattr(hf_config, "architectures", None))
    config_dtype = getattr(hf_config, "dtype" if hasattr(hf_config, "dtype") else "torch_dtype", None)
    dtype = resolve_dtype(config.dtype, config_dtype, config.device)
    max_position = int(getattr(hf_config, "max_position_embeddings", 0) or 8192)
    if config.max_model_len is not None and config.max_model_len > max_position:
        raise ValueError(f"max_model_len={config.max_model_len} is out of range: this model supports at most "
                         f"{max_position} positions")

    with torch.device("cpu"):
        model = cls(architecture, hf_config, max_position, dtype)
    weights = ckpt.tensors(hf_config) if ckpt is not None else iter_safetensors(config.model)
    model.load_weights(weights)
    model.to(config.device).eval()
    if config.device.startswith("cpu") and mkldnn_prepack_available():
        for module in model.modules():
            if hasattr(module, "prepack"):
                module.prepack()

    tok_path = config.tokenizer or config.model
    tokenizer = Tokenizer.load(tok_path, gguf_file=tok_path if tok_path.endswith(".gguf") else None)
    eos = _eos_ids(tokenizer, hf_config, generation_config)
    return LoadedModel(model, hf_config, architecture, dtype, tokenizer, generation_config, eos, max_position)


def _eos_ids(tokenizer: Tokenizer, hf_config: Any, gen: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (tokenizer.eos_token_id, gen.get("eos_token_id"), getattr(hf_config, "eos_token_id", None)):
        for i in source if isinstance(source, list) else [source]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


__all__ = ["LoadedModel", "load_model"]
