"""A GGUF model's config as the engine reads it, built from the file's metadata without transformers.

Importing transformers' config classes costs ~0.8 s on this machine (LlamaConfig pulls in torch.distributed.tensor),
a third of ``ember generate``'s start-up. The engine reads a handful of attributes; this object holds them under
transformers' names, with the values transformers' config class of the same model_type gives (its defaults for what
the metadata leaves out: tests/unit/model_loader/test_gguf_config.py checks every attribute against AutoConfig).
``to_transformers`` builds the real config for what needs one (export, .asmodel, scaled RoPE's init functions, the
facades).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# transformers' defaults (5.x) for the attributes the engine reads that a GGUF file may leave out, per model_type
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "sliding_window": None},
    "mistral": {"max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "sliding_window": None},
    "qwen3": {"max_position_embeddings": 32768, "sliding_window": None},
    "gemma2": {"max_position_embeddings": 8192, "sliding_window": 4096},
    "phi3": {"max_position_embeddings": 4096, "sliding_window": None, "rms_norm_eps": 1e-5},
    "mixtral": {"max_position_embeddings": 131072, "sliding_window": None, "rms_norm_eps": 1e-5,
                "rope_theta": 1e6},
    "qwen2_moe": {"max_position_embeddings": 32768, "sliding_window": None},
    "qwen3_moe": {"max_position_embeddings": 32768, "sliding_window": None},
    "olmoe": {"max_position_embeddings": 4096, "sliding_window": None, "rms_norm_eps": 1e-5},
    "gemma3_text": {"max_position_embeddings": 131072, "sliding_window": 4096},
}
# sliding_window counts only with use_sliding_window, which GGUF never sets
_WINDOWED_BY_FLAG = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
# read from the metadata by name when the file has them (MoE; OLMoE's clip_qkv)
_MOE_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
               "shared_expert_intermediate_size", "norm_topk_prob", "clip_qkv")


@dataclass(frozen=True, slots=True)
class GGUFConfig:
    model_type: str
    architectures: list[str]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_parameters: dict[str, Any]
    tie_word_embeddings: bool
    sliding_window: int | None
    rms_norm_eps: float = 1e-6
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    use_sliding_window: bool = False
    dtype: Any = None
    # Gemma 2 / 3 (None elsewhere): see ember/models/gemma.py
    layer_types: list[str] | None = None
    query_pre_attn_scalar: float | None = None
    hidden_activation: str | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Mixture-of-Experts (None elsewhere): see ember/models/moe.py
    num_experts: int | None = None
    num_local_experts: int | None = None  # Mixtral's name for num_experts
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    norm_topk_prob: bool | None = None
    clip_qkv: float | None = None  # OLMoE
    kwargs: dict[str, Any] = field(default_factory=dict, repr=False)  # what to_transformers passes

    @classmethod
    def of(cls, model_type: str, architecture: str, kwargs: dict[str, Any]) -> "GGUFConfig":
        """kwargs: transformers config arguments read from the metadata (hidden_size, rope_theta, rope_scaling...)."""
        defaults = _DEFAULTS[model_type]
        rope: dict[str, Any] = dict(kwargs.get("rope_scaling") or {"rope_type": "default"})
        rope["rope_theta"] = float(kwargs.get("rope_theta", defaults.get("rope_theta", 10000.0)))
        if "partial_rotary_factor" in kwargs:
            rope["partial_rotary_factor"] = float(kwargs["partial_rotary_factor"])
        if "rope_local_base_freq" in kwargs:  # Gemma 3: global layers as above, sliding ones their own base
            rope = {"full_attention": rope, "sliding_attention": {
                "rope_type": "default", "rope_theta": float(kwargs["rope_local_base_freq"])}}
        window = kwargs.get("sliding_window", defaults["sliding_window"])
        return cls(
            model_type=model_type, architectures=[architecture], vocab_size=int(kwargs["vocab_size"]),
            hidden_size=int(kwargs["hidden_size"]), intermediate_size=int(kwargs["intermediate_size"]),
            num_hidden_layers=int(kwargs["num_hidden_layers"]), num_attention_heads=int(kwargs["num_attention_heads"]),
            num_key_value_heads=int(kwargs.get("num_key_value_heads", kwargs["num_attention_heads"])),
            head_dim=int(kwargs["head_dim"]),
            max_position_embeddings=int(kwargs.get("max_position_embeddings", defaults["max_position_embeddings"])),
            rope_parameters=rope, tie_word_embeddings=bool(kwargs.get("tie_word_embeddings", False)),
            sliding_window=None if model_type in _WINDOWED_BY_FLAG else window,
            rms_norm_eps=float(kwargs.get("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6))),
            bos_token_id=kwargs.get("bos_token_id"),
            eos_token_id=kwargs.get("eos_token_id"), layer_types=kwargs.get("layer_types"),
            query_pre_attn_scalar=kwargs.get("query_pre_attn_scalar"),
            hidden_activation=kwargs.get("hidden_activation"),
            attn_logit_softcapping=kwargs.get("attn_logit_softcapping"),
            final_logit_softcapping=kwargs.get("final_logit_softcapping"),
            **{k: kwargs.get(k) for k in _MOE_FIELDS}, kwargs=dict(kwargs))

    @property
    def rope_scaling(self) -> dict[str, Any]:
        """transformers 5 keeps the 4.x name as an alias of rope_parameters."""
        return self.rope_parameters

    def to_transformers(self) -> Any:
        from transformers import AutoConfig

        config = AutoConfig.for_model(self.model_type, **self.kwargs)
        config.architectures = list(self.architectures)
        return config
