"""Write a transformers model as llama.cpp's converter would (its tensor names and metadata, the Q/K permutation for
``llama`` (Mixtral is ``llama`` with experts), Gemma's norms stored as 1 + w, experts stacked a projection), so
that GGUF loading is tested against the model it came from."""

from __future__ import annotations

import re
import struct

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
        kind_name = _block_type(qtype, gname)
        if kind_name in _K_ENCODERS and a.ndim == 2 and a.shape[-1] % 256 == 0:
            q = _K_ENCODERS[kind_name](a)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=getattr(gguf.GGMLQuantizationType, kind_name))
        elif kind_name not in ("F32", *_K_ENCODERS) and a.ndim >= 2 and a.shape[-1] % 32 == 0:
            kind = getattr(gguf.GGMLQuantizationType, kind_name)
            q = gguf.quants.quantize(a, kind)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=kind)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _block_type(qtype: str, gguf_name: str) -> str:
    """"Q4_K_M": Q4_K, with the tensors llama.cpp's Q4_K_M gives more bits (attn_v, ffn_down, the token table) in
    Q5_0 (a stand-in for its Q6_K, kept since the scoring tests' tolerances were set on it); any other qtype: every
    tensor in it (Q4_K and Q6_K through the encoders below, the rest through the gguf package's)."""
    if qtype != "Q4_K_M":
        return qtype
    return "Q5_0" if any(k in gguf_name for k in ("attn_v.", "ffn_down.", "token_embd.")) else "Q4_K"


def quantize_q4_k(a: np.ndarray) -> np.ndarray:
    """float32 [N, K] (K a multiple of 256) -> ggml's Q4_K blocks as raw bytes [N, K / 256 * 144]: per 32 values a
    scale and a min (w ~ d * sc * q - dmin * m, q in 0..15), the 8 sub-blocks' 6-bit sc and m packed as
    ``get_scale_min_k4`` reads them. A plain encoder (no search over scales as llama.cpp's): the tests need valid
    blocks, and read them back with the gguf package's decoder as the reference."""
    n, k = a.shape
    sub = a.reshape(n, k // 256, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(-1), 0.0)  # Q4_K subtracts a non-negative min
    scale = (sub.max(-1) - lo) / 15.0
    d = np.maximum(scale.max(-1), 1e-8) / 63.0
    dmin = np.maximum((-lo).max(-1), 1e-8) / 63.0
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / d[..., None]), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(-lo / dmin[..., None]), 0, 63).astype(np.uint8)
    step = (d[..., None] * sc)[..., None]
    q = np.clip(np.rint((sub + (dmin[..., None] * m)[..., None]) / step), 0, 15).astype(np.uint8)
    scales = np.zeros((n, k // 256, 12), np.uint8)
    scales[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    scales[..., 4:8] = (m[..., 0:4] & 63) | ((m[..., 4:8] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:8] & 0xF) | ((m[..., 4:8] & 0xF) << 4)
    q = q.reshape(n, k // 256, 4, 2, 32)  # each 64 values: the first 32 in low nibbles, the next 32 in high ones
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(n, k // 256, 128)
    head = np.stack([d, dmin], -1).astype(np.float16).view(np.uint8).reshape(n, k // 256, 4)
    return np.concatenate([head, scales, qs], -1).reshape(n, k // 256 * 144)


def quantize_q6_k(a: np.ndarray) -> np.ndarray:
    """float32 [N, K] (K a multiple of 256) -> ggml's Q6_K blocks as raw bytes [N, K / 256 * 210]: per 16 values an
    int8 scale under the block's fp16 d (w = d * sc * (q - 32), q in 0..63), the low 4 bits of q in ``ql``, the
    high 2 in ``qh``, laid out as ``dequantize_row_q6_K`` reads them. A plain encoder, as quantize_q4_k."""
    n, k = a.shape
    nb = k // 256
    sub = a.reshape(n, nb, 16, 16).astype(np.float32)
    scale = np.maximum(np.abs(sub).max(-1), 1e-8) / 31.0
    d = (scale.max(-1) / 127.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.ceil(scale / d[..., None]), 1, 127).astype(np.int8)  # up: every value within 31 steps
    step = (d[..., None] * sc)[..., None]
    q = np.clip(np.rint(sub / step) + 32, 0, 63).astype(np.uint8).reshape(n, nb, 2, 4, 32)  # [half, quarter, l]
    ql = np.concatenate([q[..., 0, :] & 15 | (q[..., 2, :] & 15) << 4,
                         q[..., 1, :] & 15 | (q[..., 3, :] & 15) << 4], -1)  # per half: 64 bytes
    qh = q[..., 0, :] >> 4 | (q[..., 1, :] >> 4) << 2 | (q[..., 2, :] >> 4) << 4 | (q[..., 3, :] >> 4) << 6
    head = d.astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    return np.concatenate([ql.reshape(n, nb, 128), qh.reshape(n, nb, 64), sc.view(np.uint8), head],
                          -1).reshape(n, nb * 210)


_K_ENCODERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}


# ----- hand-crafted headers: every count, length and offset as the test states it, true or not -----

GGUF_U32, GGUF_F32, GGUF_STRING, GGUF_ARRAY, GGUF_U64 = 4, 6, 8, 9, 10


def gguf_string(s: str | bytes, length: int | None = None) -> bytes:
    """A GGUF string: its length (``length``: a lie, when given), then its bytes."""
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b) if length is None else length) + b


def gguf_kv(key: str, vtype: int, payload: bytes) -> bytes:
    """One metadata entry: key, value type, the value's bytes as given."""
    return gguf_string(key) + struct.pack("<I", vtype) + payload


def gguf_tensor_info(name: str, dims: tuple[int, ...], ggml_type: int, offset: int, n_dims: int | None = None) -> bytes:
    return (gguf_string(name) + struct.pack("<I", len(dims) if n_dims is None else n_dims)
            + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", ggml_type, offset))


def raw_gguf(kvs: list[bytes], infos: list[bytes], data: bytes = b"", n_kv: int | None = None,
             n_tensors: int | None = None, version: int = 3, align: int = 32) -> bytes:
    """A GGUF file's bytes from entries built above; n_kv / n_tensors as the header states them (default: true)."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(infos)
    return head + b"\0" * (-len(head) % align) + data


def small_gguf_kvs(arch: str = "llama", layers: int = 1, hidden: int = 32, heads: int = 4, inter: int = 64,
                   vocab: int = 16) -> list[bytes]:
    """The metadata of a small Llama-family model (every size a U32)."""
    u32 = lambda k, v: gguf_kv(f"{arch}.{k}", GGUF_U32, struct.pack("<I", v))  # noqa: E731
    return [gguf_kv("general.architecture", GGUF_STRING, gguf_string(arch)), u32("block_count", layers),
            u32("embedding_length", hidden), u32("feed_forward_length", inter), u32("attention.head_count", heads),
            u32("attention.head_count_kv", heads), u32("vocab_size", vocab)]
