"""Qwen2-VL and Qwen2.5-VL: a vision tower (``qwen2_vl_vision``) whose merged patch tokens take the image tokens'
place, before a Qwen2 decoder with multimodal RoPE (M-RoPE: a (temporal, height, width) position a token,
``layers.mrope``).

Where the 3-D positions come from: the engine stays 1-D everywhere but one place. The front end puts each image's
token grid (from the processor's ``image_grid_thw``, after the merge) on its ``Placeholder``; the runner's
planning (``InputBatch`` with ``mrope=True``, which this model asks for through its ``mrope`` attribute) turns each
step's token indices and the sequence's placeholders into three position rows (``worker.mrope``), and the runner
sends [3, T] positions instead of [T]. Decode steps get their text index plus the sequence's rope delta the same way
(no state kept: the placeholders say it). Other models keep 1-D positions and the planning never looks at grids;
a pure decode step of this model sends the one row (its three are equal), so its CUDA graphs still apply."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from ember.distributed import ParallelContext
from ember.layers.mrope import MRotaryEmbedding
from ember.layers.rotary import RotaryEmbedding, rope_parameters
from ember.models.llama import DecoderLayer, LlamaForCausalLM, LlamaModel
from ember.models.qwen2_vl_vision import Qwen2VisionTower
from ember.quantization import QuantConfig, QuantizedTensor


class Qwen2VLTextModel(LlamaModel):
    def make_ropes(self, config: Any, head_dim: int, max_position: int) -> dict[str, RotaryEmbedding]:
        section = rope_parameters(config).get("mrope_section")
        if not section:
            raise ValueError("rope_parameters.mrope_section is missing: Qwen2-VL's decoder uses M-RoPE")
        return {DecoderLayer.rope_kind: MRotaryEmbedding(config, head_dim, max_position, list(section))}


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    model_class = Qwen2VLTextModel
    calibrated = False  # AWQ / SmoothQuant calibrate on text through the decoder only: not wired for images yet
    mrope = True  # the runner sends [3, T] positions (worker.mrope)

    def __init__(self, architecture: str, config: Any, max_position: int, dtype: torch.dtype,
                 quant: QuantConfig | None = None, parallel: ParallelContext = ParallelContext()) -> None:
        if parallel.world_size > 1:
            raise ValueError(f"{architecture}: tensor_parallel_size=1 and pipeline_parallel_size=1 are supported for "
                             "vision-language models")
        text = getattr(config, "text_config", None) or config
        super().__init__("Qwen2ForCausalLM", text, max_position, dtype, quant, parallel)
        self.hf_config = config
        self.visual = Qwen2VisionTower(config.vision_config, dtype)
        self.merge = config.vision_config.spatial_merge_size
        token = getattr(config, "image_token_id", None)
        self.image_token_id = int(token if token is not None else text.image_token_id)
        self.dtype = dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (a fresh tensor: the runner writes image features into it)."""
        return self.model.embed(ids)

    @torch.inference_mode()
    def encode_images(self, items: list[dict[str, Any]], device: torch.device) -> list[torch.Tensor]:
        """Each image's merged tokens in the decoder's width, [t * h * w / merge^2, hidden]; all images in one pass
        (attention stays within each)."""
        grids = [tuple(int(v) for v in np.asarray(item["image_grid_thw"]).reshape(3)) for item in items]
        patches = torch.cat([torch.as_tensor(np.asarray(item["pixel_values"])) for item in items])
        out = self.visual(patches.to(device=device, dtype=self.dtype), grids)
        return list(out.split([t * h * w // self.merge ** 2 for t, h, w in grids]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        super().load_weights(_ember_names(weights))

    def weight_slice(self, name: str):
        return super().weight_slice(_ember_name(name))


def _ember_name(name: str) -> str:
    """A checkpoint's tensor name as this model's (the decoder under ``model.``, the tower at ``visual.``: the hub's
    files, and what save_pretrained writes); transformers 5.x's module names (``model.visual.``,
    ``model.language_model.``) map there too."""
    for old, new in (("model.visual.", "visual."), ("model.language_model.", "model.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _ember_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        yield _ember_name(name), tensor
