"""A GGUF file's config as the engine reads it (GGUFConfig, built without transformers) against transformers'
config class of the same model_type built from the same metadata: every attribute the engine reads, the sliding
windows and family switches it derives, and the RoPE tables."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import default_gguf

from ember.config import ModelShape
from ember.layers.rotary import RotaryEmbedding, rope_parameters
from ember.model_loader.gguf import GGUFCheckpoint
from ember.models.llama import family_switches, layer_windows
from ember.models.moe import moe_shape

ENGINE_READS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "dtype")
READ_WITH_DEFAULT = {"attention_bias": False, "mlp_bias": False, "use_sliding_window": False}  # getattr(c, k, False)


def _metadata_gguf(path: str, arch: str, **extra) -> str:
    """A GGUF holding a model's metadata, its embedding and a norm a layer (the engine's config reads no others)."""
    import gguf

    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(3)
    w.add_embedding_length(64)
    w.add_feed_forward_length(160)
    w.add_head_count(4)
    w.add_head_count_kv(extra.pop("kv_heads", 2))
    w.add_vocab_size(300)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for key, value in extra.items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((300, 64), dtype=np.float32))
    for i in range(3):  # the layers the config names (the reader checks the count against the file)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


CASES = {
    "llama-defaults": ("llama", {}),
    "llama-full": ("llama", dict(context_length=4096, layer_norm_rms_eps=1e-5, rope_freq_base=500000.0)),
    "llama-linear-rope": ("llama", dict(rope_scaling_type=None, rope_freq_base=10000.0)),
    "mistral-default-window": ("mistral", dict(context_length=32768)),
    "mistral-window": ("mistral", dict(sliding_window=48, kv_heads=1)),
    "qwen2": ("qwen2", dict(context_length=32768, rope_freq_base=1000000.0, sliding_window=128)),
    "qwen3": ("qwen3", dict(key_length=32, value_length=32, layer_norm_rms_eps=1e-6)),
    "gemma3": ("gemma3", dict(key_length=32, value_length=32, sliding_window=512, rope_freq_base=1000000.0,
                              context_length=32768, kv_heads=1)),
    "gemma3-linear-rope": ("gemma3", dict(key_length=16, value_length=16, sliding_window=1024, kv_heads=1,
                                          rope_freq_base=1000000.0, rope_scaling_type=None)),
    "mixtral": ("llama", dict(expert_count=8, expert_used_count=2, context_length=32768)),
    "qwen3moe": ("qwen3moe", dict(expert_count=8, expert_used_count=2, expert_feed_forward_length=32,
                                  key_length=16, value_length=16)),
    "qwen2moe": ("qwen2moe", dict(expert_count=8, expert_used_count=4, expert_feed_forward_length=32,
                                  expert_shared_feed_forward_length=48)),
    "olmoe": ("olmoe", dict(expert_count=8, expert_used_count=2, clamp_kqv=8.0)),
    "phi3-defaults": ("phi3", dict(context_length=4096)),
    "gemma2": ("gemma2", dict(key_length=32, value_length=32, sliding_window=4096, attn_logit_softcapping=50.0,
                              final_logit_softcapping=30.0)),
}
GEMMA_READS = ("layer_types", "query_pre_attn_scalar", "hidden_activation", "attn_logit_softcapping",
               "final_logit_softcapping", "sliding_window")


@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_config_matches_transformers(case, tmp_path):
    import gguf

    arch, extra = CASES[case]
    if "rope_scaling_type" in extra:
        extra.pop("rope_scaling_type")
        extra["rope_scaling_type"] = gguf.RopeScalingType.LINEAR
        extra["rope_scaling_factor"] = 4.0
    ckpt = GGUFCheckpoint(_metadata_gguf(str(tmp_path / f"{case}.gguf"), arch, **extra))
    ours, ref = ckpt.model_config(), ckpt.hf_config()
    for name in ENGINE_READS:
        assert getattr(ours, name) == getattr(ref, name), name
    for name, default in READ_WITH_DEFAULT.items():
        assert getattr(ours, name) == getattr(ref, name, default), name
    assert rope_parameters(ours) == rope_parameters(ref)
    assert ModelShape.of(ours) == ModelShape.of(ref)
    architecture = ours.architectures[0]
    assert layer_windows(architecture, ours) == layer_windows(architecture, ref)
    assert family_switches(architecture, ours) == family_switches(architecture, ref)
    if arch in ("llama", "qwen3moe", "qwen2moe", "olmoe") and "expert_count" in extra:
        assert moe_shape(architecture, ours) == moe_shape(architecture, ref)
        assert getattr(ours, "clip_qkv", None) == getattr(ref, "clip_qkv", None)
    kinds = [None]
    if arch in ("gemma2", "gemma3"):
        for name in GEMMA_READS:
            assert getattr(ours, name) == getattr(ref, name), name
        kinds = ["sliding_attention", "full_attention"] if arch == "gemma3" else [None]
    for kind in kinds:
        assert rope_parameters(ours, kind) == rope_parameters(ref, kind)
        d = ModelShape.of(ours).head_dim
        a, b = RotaryEmbedding(ours, d, 64, kind), RotaryEmbedding(ref, d, 64, kind)
        assert torch.equal(a.cos, b.cos) and torch.equal(a.sin, b.sin)


def test_engine_start_does_not_import_transformers_for_a_gguf_model():
    """The default model's config, shape and tokenizer come without transformers (its import is most of a CLI's
    start-up); run in a fresh interpreter so earlier tests' imports do not count."""
    import subprocess
    import sys

    from ember.tokenizer import Tokenizer

    Tokenizer.load(default_gguf(), gguf_file=default_gguf())  # the one-time conversion (it uses transformers)
    code = ("import sys; from ember.model_loader import load_tokenizer, model_config, open_checkpoint, read_shape; "
            "from ember.config import EngineConfig; p = sys.argv[1]; model_config(open_checkpoint(p)); read_shape(p); "
            "t = load_tokenizer(EngineConfig(model=p).resolve().model).tokenizer; t.decode(t.encode('Hi there')); "
            "t.apply_chat_template([{'role': 'user', 'content': 'Hi'}]); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    out = subprocess.run([sys.executable, "-c", code, default_gguf()], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
