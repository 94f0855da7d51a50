"""Model registry: Hugging Face architecture name -> implementation."""

from __future__ import annotations

from ember.models.bert import BertModel
from ember.models.gemma import GemmaForCausalLM
from ember.models.llama import LlamaForCausalLM
from ember.models.llava import LlavaForConditionalGeneration
from ember.models.moe import MoEForCausalLM
from ember.models.phi3 import Phi3ForCausalLM
from ember.models.qwen2_vl import Qwen2VLForConditionalGeneration

MODEL_REGISTRY: dict[str, type] = {
    "BertModel": BertModel,  # an encoder: embeddings only
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,  # a vision tower before a Llama-family decoder
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MoEForCausalLM,
    "OlmoeForCausalLM": MoEForCausalLM,
    "Qwen2MoeForCausalLM": MoEForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,  # M-RoPE decoder after a vision tower
    "Qwen2_5_VLForConditionalGeneration": Qwen2VLForConditionalGeneration,  # the same, a windowed tower
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def resolve_architecture(architectures: list[str] | None) -> tuple[str, type]:
    for arch in architectures or []:
        if arch in MODEL_REGISTRY:
            return arch, MODEL_REGISTRY[arch]
    raise ValueError(f"architectures={architectures!r} is not supported: ember supports {sorted(MODEL_REGISTRY)}")
