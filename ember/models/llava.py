"""LLaVA: a CLIP vision tower, a two-layer projector, and a Llama-family decoder whose prompt holds one image token
per image feature. The decoder is ember's Llama family as it is (paged KV, batching, LoRA); the engine encodes each
image once (``encode_images``, cached by content hash in the model runner) and the runner puts the projected
features in place of the image tokens' embeddings (``embed``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from ember.distributed import ParallelContext
from ember.layers.base import Layer
from ember.layers.linear import Linear
from ember.models.clip import CLIPVisionTower, activation
from ember.models.llama import LlamaForCausalLM
from ember.quantization import QuantConfig, QuantizedTensor

# the decoder families a LLaVA checkpoint's text_config names, by model_type
TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


class LlavaProjector(Layer):
    def __init__(self, config: Any, vision_width: int, dtype: torch.dtype) -> None:
        super().__init__()
        bias = bool(getattr(config, "multimodal_projector_bias", True))
        text = config.text_config.hidden_size
        self.linear_1 = Linear(vision_width, text, bias, dtype)
        self.linear_2 = Linear(text, text, bias, dtype)
        self.act = activation(config.projector_hidden_act, "projector_hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    calibrated = False  # AWQ / SmoothQuant calibrate on text through the decoder only: not wired for images yet

    def __init__(self, architecture: str, config: Any, max_position: int, dtype: torch.dtype,
                 quant: QuantConfig | None = None, parallel: ParallelContext = ParallelContext()) -> None:
        text = config.text_config
        if text.model_type not in TEXT_ARCHITECTURES:
            raise ValueError(f"text_config.model_type={text.model_type!r} is not supported: use one of "
                             f"{sorted(TEXT_ARCHITECTURES)}")
        if parallel.world_size > 1:
            raise ValueError(f"{architecture}: tensor_parallel_size=1 and pipeline_parallel_size=1 are supported for "
                             "vision-language models")
        vision = config.vision_config
        if vision.model_type != "clip_vision_model":
            raise ValueError(f"vision_config.model_type={vision.model_type!r} is not supported: use one of "
                             "['clip_vision_model'] (LLaVA's CLIP tower)")
        super().__init__(TEXT_ARCHITECTURES[text.model_type], text, max_position, dtype, quant, parallel)
        self.hf_config = config
        layers = config.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        self.strategy = config.vision_feature_select_strategy
        if self.strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy={self.strategy!r} is not supported: use one of "
                             "['default', 'full']")
        self.vision_tower = CLIPVisionTower(config.vision_config, layers, dtype)
        self.multi_modal_projector = LlavaProjector(config, config.vision_config.hidden_size * len(layers), dtype)
        self.image_token_id = int(config.image_token_id if getattr(config, "image_token_id", None) is not None
                                  else config.image_token_index)
        # what the tower takes and gives: the front end refuses a processor output that differs (a checkpoint whose
        # processor config does not match the model) before the request is queued
        side = vision.image_size // vision.patch_size
        self.image_tokens = side * side + (self.strategy == "full")
        self.image_pixels = (vision.image_size, vision.image_size)
        self.dtype = dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (a fresh tensor: the runner writes image features into it)."""
        return self.model.embed(ids)

    @torch.inference_mode()
    def encode_images(self, items: list[dict[str, Any]], device: torch.device) -> list[torch.Tensor]:
        """Each image's features in the decoder's width, [tokens, hidden]; images of one size run as one batch."""
        out: list[torch.Tensor | None] = [None] * len(items)
        by_size: dict[tuple[int, ...], list[int]] = {}
        for i, item in enumerate(items):  # the processor's pixel_values of one image: [1, 3, H, W]
            by_size.setdefault(tuple(np.shape(item["pixel_values"])[-3:]), []).append(i)
        for size, which in by_size.items():
            pixels = torch.cat([torch.as_tensor(items[i]["pixel_values"]).reshape(1, *size) for i in which])
            states = self.vision_tower(pixels.to(device=device, dtype=self.dtype))
            if self.strategy == "default":  # drop the class token
                states = [s[:, 1:] for s in states]
            feats = torch.cat(states, dim=-1)
            b, n, w = feats.shape
            projected = self.multi_modal_projector(feats.reshape(b * n, w)).view(b, n, -1)
            for j, i in enumerate(which):
                out[i] = projected[j]
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        super().load_weights(_ember_names(weights))

    def weight_slice(self, name: str):
        return super().weight_slice(_ember_name(name))


def _ember_name(name: str) -> str:
    """A LLaVA checkpoint's tensor name (transformers' current layout, or the older one the hub's files use) as
    this model's: the decoder under ``model.``, the tower and projector at the top."""
    for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", "vision_tower."),
                     ("model.multi_modal_projector.", "multi_modal_projector.")):
        if name.startswith(old):
            name = new + name[len(old):]
            break
    return name.replace("vision_tower.vision_model.", "vision_tower.")


def _ember_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        yield _ember_name(name), tensor
