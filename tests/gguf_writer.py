"""Write a transformers model as llama.cpp's converter would (its tensor names and metadata, the Q/K permutation for
``llama`` (Mixtral is ``llama`` with experts), Gemma's norms stored as 1 + w, experts stacked a projection), so
that GGUF loading is tested against the model it came from."""

from __future__ import annotations

import re

import numpy as np

_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_PHI3_LAYER = {**_LAYER, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_MOE_LAYER = {"mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
              "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
              "mlp.shared_expert.down_proj": "ffn_down_shexp"}
_MIXTRAL = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
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
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:  # llama.cpp's MoE keys; its experts stacked into one tensor a projection (below)
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if getattr(cfg, "clip_qkv", None):
        w.add_clamp_kqv(cfg.clip_qkv)
    layer = _GEMMA_LAYER if gemma else _PHI3_LAYER if arch == "phi3" else _LAYER
    arrays: dict[str, np.ndarray] = {}
    stacked: dict[str, dict[int, np.ndarray]] = {}
    for name, t in hf_model.state_dict().items():
        base, kind = name.rsplit(".", 1)
        a = t.float().numpy()
        if base.endswith(".experts") and kind in ("gate_up_proj", "down_proj"):  # transformers 5's 3D experts
            i = base.split(".")[2]
            parts = {"gate": a[:, :a.shape[1] // 2], "up": a[:, a.shape[1] // 2:]} if kind == "gate_up_proj" \
                else {"down": a}
            for proj, v in parts.items():
                arrays[f"blk.{i}.ffn_{proj}_exps.weight"] = np.ascontiguousarray(v)
            continue
        if base.startswith("model.layers."):
            _, _, i, rest = base.split(".", 3)
            rest = ".".join(_MIXTRAL.get(p, p) for p in rest.split("."))
            m = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj", rest)
            if m:
                stacked.setdefault(f"blk.{i}.ffn_{m.group(2)}_exps.{kind}", {})[int(m.group(1))] = a
                continue
            if rest == "mlp.shared_expert_gate":
                a = a.reshape(-1)  # llama.cpp's 1-D shared gate
            gname = f"blk.{i}.{_MOE_LAYER.get(rest) or layer[rest]}.{kind}"
        elif base in _NAMES:
            if base == "lm_head" and cfg.tie_word_embeddings:
                continue
            gname = f"{_NAMES[base]}.{kind}"
        else:
            continue
        if arch == "llama" and any(f".{p}." in name for p in ("q_proj", "k_proj")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            a = a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        if gemma and name.endswith("norm.weight"):
            a = a + 1.0  # llama.cpp's converter stores Gemma's norms with their offset
        arrays[gname] = a
    for gname, parts in stacked.items():
        arrays[gname] = np.stack([parts[e] for e in sorted(parts)])
    for gname, a in arrays.items():
        if qtype != "F32" and a.ndim >= 2 and a.shape[-1] % 32 == 0:
            kind = getattr(gguf.GGMLQuantizationType, qtype)
            q = gguf.quants.quantize(a, kind)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=kind)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
