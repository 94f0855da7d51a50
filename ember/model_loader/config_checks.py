"""A checkpoint's config checked against sane bounds and against the tensors its files hold, before the model is
built: the model and its KV cache are allocated from the config's sizes, so a file that lies about them (a huge
vocab_size, a thousand layers the file does not hold) must be refused here, by name, not by the allocator."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ember.config.model import text_config
from ember.errors import ConfigError

# field -> (smallest, largest) a real model has, with room (the largest public models: hidden 25k, 256k vocab,
# 10M positions); a value outside is a damaged or hand-crafted file
LIMITS = {"num_hidden_layers": (1, 1024), "hidden_size": (1, 1 << 16), "num_attention_heads": (1, 1024),
          "num_key_value_heads": (1, 1024), "head_dim": (1, 4096), "vocab_size": (1, 1 << 22),
          "intermediate_size": (0, 1 << 20), "max_position_embeddings": (1, 1 << 24)}
_OPTIONAL = ("num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def check_config(path: str, config: Any) -> None:
    """Every size the engine allocates from is an int within LIMITS (ConfigError naming file, field and value)."""
    cfg = text_config(config)
    for name, (lo, hi) in LIMITS.items():
        value = getattr(cfg, name, None)
        if value is None and name in _OPTIONAL:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise ConfigError(f"model file {path!r}: config {name}={value!r} is out of range: allowed an integer in "
                              f"{lo}..{hi}")
    eps = getattr(cfg, "rms_norm_eps", None)
    thetas = [("rms_norm_eps", eps)] if eps is not None else []
    rope = getattr(cfg, "rope_parameters", None) or {}
    for part in [rope, *(v for v in rope.values() if isinstance(v, dict))] if isinstance(rope, dict) else [rope]:
        if not isinstance(part, dict):
            raise ConfigError(f"model file {path!r}: config rope_parameters={rope!r} is not a JSON object")
        if "rope_theta" in part:
            thetas.append(("rope_theta", part["rope_theta"]))
    for name, value in thetas:  # an epsilon may be 0; a RoPE base of 0 or less has no frequencies
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
                0 <= value < 1e30 if name == "rms_norm_eps" else 0 < value < 1e30):
            raise ConfigError(f"model file {path!r}: config {name}={value!r} is out of range: allowed a finite "
                              f"number in {'0' if name == 'rms_norm_eps' else '(0'}..1e30)")
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if heads % kv:
        raise ConfigError(f"model file {path!r}: config num_key_value_heads={kv} does not divide "
                          f"num_attention_heads={heads}")


def check_tensor_shapes(path: str, config: Any, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """The config's sizes agree with the tensors (Hugging Face names, [out, in]) in the file: the embedding table,
    the LM head, the layer count and layer 0's projections. Only the Llama-family layout is compared (its names);
    other layouts are left to load_weights."""
    if "model.embed_tokens.weight" not in shapes:
        return
    cfg = text_config(config)
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    inter = getattr(cfg, "intermediate_size", None)
    expected = {"model.embed_tokens.weight": ((cfg.vocab_size, hidden), "vocab_size x hidden_size"),
                "lm_head.weight": ((cfg.vocab_size, hidden), "vocab_size x hidden_size"),
                "model.layers.0.self_attn.q_proj.weight": ((heads * head_dim, hidden),
                                                           "num_attention_heads * head_dim x hidden_size"),
                "model.layers.0.self_attn.k_proj.weight": ((kv * head_dim, hidden),
                                                           "num_key_value_heads * head_dim x hidden_size")}
    if inter:
        expected["model.layers.0.mlp.up_proj.weight"] = ((inter, hidden), "intermediate_size x hidden_size")
    for name, (want, what) in expected.items():
        got = shapes.get(name)
        if got is not None and tuple(got) != want:
            raise ConfigError(f"model file {path!r}: tensor {name} has shape {list(got)}, the config says {what} = "
                              f"{list(want)}")
    layers = {int(m.group(1)) for m in map(_LAYER.match, shapes) if m}
    if layers != set(range(cfg.num_hidden_layers)):
        missing = sorted(set(range(cfg.num_hidden_layers)) - layers)[:5]
        raise ConfigError(f"model file {path!r}: config num_hidden_layers={cfg.num_hidden_layers}, but the file holds "
                          f"the tensors of {len(layers)} layers (up to index {max(layers, default=-1)}; missing: "
                          f"{missing})")
