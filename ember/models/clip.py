"""CLIP's vision transformer, the image encoder of LLaVA-style models: patches of a fixed-size image, a class token,
learned positions, pre-LayerNorm blocks with bidirectional attention. Only the layers up to the deepest one the
model reads are built (LLaVA reads the second to last: the last never runs)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.layers.base import Layer
from ember.layers.linear import Linear, MergedLinear
from ember.layers.norm import LayerNorm


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu}


def activation(name: str, field: str) -> Any:
    if name not in ACTIVATIONS:
        raise ValueError(f"{field}={name!r} is not supported: use one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class VisionEmbeddings(Layer):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        h, p = config.hidden_size, config.patch_size
        self.patch_size = p
        self.class_embedding = nn.Parameter(torch.empty(h, dtype=dtype), requires_grad=False)
        self.patch_embedding = nn.Conv2d(config.num_channels, h, p, stride=p, bias=False, dtype=dtype)
        self.patch_embedding.weight.requires_grad_(False)
        self.position_embedding = nn.Embedding((config.image_size // p) ** 2 + 1, h, dtype=dtype)
        self.position_embedding.weight.requires_grad_(False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> [B, 1 + patches, hidden]."""
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        x = torch.cat([cls, patches], dim=1)
        if x.shape[1] != self.position_embedding.num_embeddings:
            raise ValueError(f"pixel_values of {tuple(pixels.shape[-2:])} give {x.shape[1] - 1} patches; the vision "
                             f"tower was trained on {self.position_embedding.num_embeddings - 1}")
        return x + self.position_embedding.weight


class VisionAttention(Layer):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.qkv_proj = MergedLinear(h, {"q": h, "k": h, "v": h}, True, dtype, None)
        self.out_proj = Linear(h, h, True, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every patch of an image attends to all of that image's (no mask); [B, n, h] -> [B * n, h]."""
        b, n, h = x.shape
        q, k, v = self.qkv_proj(x.reshape(b * n, h)).view(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b * n, h))


class VisionMLP(Layer):
    """fc2(act(fc1(x))) with biases: the MLP of CLIP's and Qwen2-VL's vision blocks."""

    def __init__(self, width: int, hidden: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = Linear(width, hidden, True, dtype)
        self.fc2 = Linear(hidden, width, True, dtype)
        self.act = activation(act, "vision_config.hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(Layer):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = LayerNorm(h, eps, dtype)
        self.self_attn = VisionAttention(config, dtype)
        self.layer_norm2 = LayerNorm(h, eps, dtype)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        x = x + self.self_attn(self.layer_norm1(x)).view(b, n, h)
        return x + self.mlp(self.layer_norm2(x).reshape(b * n, h)).view(b, n, h)


class CLIPVisionTower(Layer):
    """Its forward returns the hidden states of the layers asked for (transformers' ``hidden_states`` indices:
    0 is the embeddings after the pre-LayerNorm, i the output of layer i, negative ones from the end)."""

    def __init__(self, config: Any, feature_layers: list[int], dtype: torch.dtype) -> None:
        super().__init__()
        depth = config.num_hidden_layers
        self.feature_layers = [i if i >= 0 else depth + 1 + i for i in feature_layers]
        if not all(0 <= i <= depth for i in self.feature_layers):
            raise ValueError(f"vision_feature_layer={feature_layers} is out of range for a vision tower of "
                             f"{depth} layers")
        self.embeddings = VisionEmbeddings(config, dtype)
        self.pre_layrnorm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype)  # transformers' spelling
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(VisionLayer(config, dtype) for _ in range(max(self.feature_layers)))

    def forward(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        x = self.pre_layrnorm(self.embeddings(pixels))
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        return [states[i] for i in self.feature_layers]
