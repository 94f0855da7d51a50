"""Write a transformers model as llama.cpp's converter would (its tensor names and metadata, the Q/K permutation for
``llama``, Gemma's norms stored as 1 + w), so that GGUF loading is tested against the model it came from."""

from __future__ import annotations

import numpy as np

_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_PHI3_LAYER = {**_LAYER, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_GEMMA_LAYER = {**_LAYER, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def write_gguf(hf_model, arch: str, path: str, qtype: str = "F32") -> None:
    import gguf

    cfg = hf_model.config
    gemma = arch in ("gemma2", "gemma3")
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # Gemma 3: the global layers' base
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if gemma:
        w.add_sliding_window(cfg.sliding_window)
    if arch == "phi3":  # as llama.cpp's Phi3MiniModel: rotary dims, LongRoPE's switch and its factors as tensors
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        if cfg.sliding_window:
            w.add_sliding_window(cfg.sliding_window)
        if rope["rope_type"] == "longrope":
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            for kind in ("long", "short"):
                w.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    layer = _GEMMA_LAYER if gemma else _PHI3_LAYER if arch == "phi3" else _LAYER
    for name, t in hf_model.state_dict().items():
        base, kind = name.rsplit(".", 1)
        if base.startswith("model.layers."):
            _, _, i, rest = base.split(".", 3)
            gname = f"blk.{i}.{layer[rest]}.{kind}"
        elif base in _NAMES:
            if base == "lm_head" and cfg.tie_word_embeddings:
                continue
            gname = f"{_NAMES[base]}.{kind}"
        else:
            continue
        a = t.float().numpy()
        if arch == "llama" and any(f".{p}." in name for p in ("q_proj", "k_proj")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            a = a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        if gemma and name.endswith("norm.weight"):
            a = a + 1.0  # llama.cpp's converter stores Gemma's norms with their offset
        if qtype != "F32" and a.ndim == 2 and a.shape[1] % 32 == 0:
            kind = getattr(gguf.GGMLQuantizationType, qtype)
            q = gguf.quants.quantize(a, kind)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=kind)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
