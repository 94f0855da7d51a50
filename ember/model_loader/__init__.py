"""Build a model from a Hugging Face folder, a GGUF file or an ember .asmodel pair, with its tokenizer and generation
defaults. The three checkpoint kinds share one small interface: hf_config(), generation_config(), tensors(config)
(Hugging Face names), tokenizer()."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ember.config import EngineConfig, resolve_dtype
from ember.layers.linear import mkldnn_prepack_available
from ember.model_loader.asmodel import AsModelCheckpoint
from ember.model_loader.gguf import GGUFCheckpoint
from ember.model_loader.hf import HFCheckpoint
from ember.models import resolve_architecture
from ember.tokenizer import Tokenizer

logger = logging.getLogger("ember")


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


Checkpoint = HFCheckpoint | GGUFCheckpoint | AsModelCheckpoint


def open_checkpoint(path: str) -> Checkpoint:
    """The checkpoint at path, by kind: a .gguf file, an .asmodel file, else a Hugging Face folder."""
    if path.endswith(".gguf"):
        return GGUFCheckpoint(path)
    if path.endswith(".asmodel"):
        return AsModelCheckpoint(path)
    return HFCheckpoint(path)


def load_model(config: EngineConfig) -> LoadedModel:
    ckpt = open_checkpoint(config.model)
    hf_config = ckpt.hf_config()
    generation_config = ckpt.generation_config()
    if isinstance(ckpt, AsModelCheckpoint) and ckpt.quantization.get("enable_quant"):
        logger.warning(
            "%s records a quantization recipe %s; ember does not apply weight quantization yet, the weights run in "
            "their stored dtype", config.model, ckpt.quantization)
    architecture, cls = resolve_architecture(getattr(hf_config, "architectures", None))
    config_dtype = getattr(hf_config, "dtype" if hasattr(hf_config, "dtype") else "torch_dtype", None)
    requested = config.dtype
    if requested == "auto" and isinstance(ckpt, AsModelCheckpoint):
        requested = ckpt.meta["dtype"]  # chosen when it was serialized: run it as stored
    dtype = resolve_dtype(requested, config_dtype, config.device)
    max_position = int(getattr(hf_config, "max_position_embeddings", 0) or 8192)
    if config.max_model_len is not None and config.max_model_len > max_position:
        raise ValueError(f"max_model_len={config.max_model_len} is out of range: this model supports at most "
                         f"{max_position} positions")

    with torch.device("cpu"):
        model = cls(architecture, hf_config, max_position, dtype)
    model.load_weights(ckpt.tensors(hf_config))
    model.to(config.device).eval()
    if config.device.startswith("cpu") and mkldnn_prepack_available():
        for module in model.modules():
            if hasattr(module, "prepack"):
                module.prepack()

    # a tokenizer given apart: a tokenizer folder, a .gguf or an .asmodel
    tokenizer = (open_checkpoint(config.tokenizer) if config.tokenizer else ckpt).tokenizer()
    eos = _eos_ids(tokenizer, hf_config, generation_config)
    return LoadedModel(model, hf_config, architecture, dtype, tokenizer, generation_config, eos, max_position)


def _eos_ids(tokenizer: Tokenizer, hf_config: Any, gen: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (tokenizer.eos_token_id, gen.get("eos_token_id"), getattr(hf_config, "eos_token_id", None)):
        for i in source if isinstance(source, list) else [source]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


__all__ = ["Checkpoint", "LoadedModel", "load_model", "open_checkpoint"]
