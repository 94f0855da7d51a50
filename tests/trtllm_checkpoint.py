"""Write a Hugging Face Llama folder as a TensorRT-LLM checkpoint, the way TensorRT-LLM's
examples/llama/convert_checkpoint.py (v0.9-0.10, tensorrt_llm/models/llama/convert.py) lays it out, for the tests.

Written from TensorRT-LLM's documented rules, apart from ember's reader (which joins the shares by row ranges):
here each rank's tensors are cut with torch.chunk from whole Hugging Face tensors, as the converter does.

- rank r = pp_rank * tp_size + tp_rank holds ``rank{r}.safetensors``; a pipeline stage's layers are numbered from 0
  (the layers split evenly, the converter's ``Mapping.pp_layers``); the embedding lives on the first stage, ln_f and
  lm_head on the last.
- ``attention.qkv`` = [q_r; k_r; v_r], each of q, k and v chunked over the ranks along the output dim; with fewer KV
  heads than tp_size each KV head is first repeated tp_size / num_key_value_heads times (``dup_kv_weight``).
- ``attention.dense`` (o_proj) and ``mlp.proj`` (down_proj) are chunked along the input dim; ``mlp.fc`` is
  gate_proj and ``mlp.gate`` is up_proj, both chunked along the output dim; row-parallel biases stay whole.
- ``lm_head`` (the embedding when the model ties them) is padded with zero rows to a multiple of tp_size and
  chunked along the vocabulary; the vocabulary embedding is whole on every rank unless use_parallel_embedding
  (then chunked along embedding_sharding_dim: 0 = vocabulary, padded the same way; 1 = hidden).
"""

from __future__ import annotations

import json
import os

import torch


def _chunk(t: torch.Tensor, n: int, i: int, dim: int = 0) -> torch.Tensor:
    assert t.shape[dim] % n == 0, (t.shape, n, dim)
    return torch.chunk(t, n, dim=dim)[i].contiguous()


def _repeat_kv(w: torch.Tensor, kv_heads: int, tp: int) -> torch.Tensor:
    """dup_kv_weight: each KV head's rows repeated tp // kv_heads times in a row."""
    assert tp % kv_heads == 0, (tp, kv_heads)
    heads = w.reshape(kv_heads, -1, *w.shape[1:])
    return torch.repeat_interleave(heads, tp // kv_heads, dim=0).reshape(-1, *w.shape[1:])


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -t.shape[0] % multiple
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def write_trtllm_checkpoint(hf_folder: str, out_dir: str, tp_size: int = 1, pp_size: int = 1, *,
                            use_parallel_embedding: bool = False, embedding_sharding_dim: int = 0,
                            share_embedding_table: bool = False, dtype: str | None = None,
                            quant_algo: str | None = None, kv_cache_quant_algo: str | None = None) -> str:
    """Convert the Llama checkpoint in hf_folder (config.json + model.safetensors) into out_dir; no tokenizer files
    are written (TensorRT-LLM's converter writes none). share_embedding_table: leave lm_head out (a tied model
    exported so reuses the embedding). quant_algo: only written into config.json (the weights stay float);
    kv_cache_quant_algo: also a kv_cache_scaling_factor a layer, as the converter's INT8 / FP8 KV cache options."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(hf_folder)
    state = load_file(os.path.join(hf_folder, "model.safetensors"))
    dtype = dtype or str(getattr(hf, "dtype", None) or "float32").removeprefix("torch.")
    torch_dtype = getattr(torch, dtype)
    heads, kv_heads, layers = hf.num_attention_heads, hf.num_key_value_heads, hf.num_hidden_layers
    head_size = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    tied = bool(hf.tie_word_embeddings)
    config = {
        "architecture": hf.architectures[0],
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": hf.vocab_size,
        "max_position_embeddings": hf.max_position_embeddings,
        "hidden_size": hf.hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_size": head_size,
        "hidden_act": hf.hidden_act,
        "intermediate_size": hf.intermediate_size,
        "norm_epsilon": hf.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "use_parallel_embedding": use_parallel_embedding,
        "embedding_sharding_dim": embedding_sharding_dim,
        "share_embedding_table": share_embedding_table,
        "mapping": {"world_size": tp_size * pp_size, "tp_size": tp_size, "pp_size": pp_size},
        "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": kv_cache_quant_algo, "group_size": 128,
                         "smoothquant_val": None, "has_zero_point": False, "pre_quant_scale": False,
                         "exclude_modules": None},
        "kv_dtype": dtype,
        "rotary_scaling": None if rope.get("rope_type", "default") == "default" else
        {k: v for k, v in rope.items() if k != "rope_theta"},
        "rotary_base": rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)),
        "residual_mlp": False,
        "attn_bias": bool(getattr(hf, "attention_bias", False)),
        "mlp_bias": bool(getattr(hf, "mlp_bias", False)),
        "moe": {"num_experts": 0, "top_k": 0, "normalization_mode": None},
        "tie_word_embeddings": tied,
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=4)

    w = {k: v.to(torch_dtype) for k, v in state.items()}
    embedding = w["model.embed_tokens.weight"]
    head = embedding if tied else w["lm_head.weight"]
    per_stage = layers // pp_size
    for pp in range(pp_size):
        for tp in range(tp_size):
            out: dict[str, torch.Tensor] = {}
            if pp == 0:
                table = embedding
                if use_parallel_embedding:  # along the vocabulary: padded like lm_head (the reader trims either way)
                    table = _pad_rows(table, tp_size) if embedding_sharding_dim == 0 else table
                    table = _chunk(table, tp_size, tp, embedding_sharding_dim)
                out["transformer.vocab_embedding.weight"] = table
            for local, i in enumerate(range(pp * per_stage, (pp + 1) * per_stage)):
                src, dst = f"model.layers.{i}.", f"transformer.layers.{local}."
                for kind in ("weight", "bias"):
                    if f"{src}self_attn.q_proj.{kind}" not in w:
                        continue
                    q = w[f"{src}self_attn.q_proj.{kind}"]
                    k = w[f"{src}self_attn.k_proj.{kind}"]
                    v = w[f"{src}self_attn.v_proj.{kind}"]
                    if kv_heads < tp_size:
                        k, v = _repeat_kv(k, kv_heads, tp_size), _repeat_kv(v, kv_heads, tp_size)
                    out[f"{dst}attention.qkv.{kind}"] = torch.cat(
                        [_chunk(q, tp_size, tp), _chunk(k, tp_size, tp), _chunk(v, tp_size, tp)])
                out[f"{dst}attention.dense.weight"] = _chunk(w[f"{src}self_attn.o_proj.weight"], tp_size, tp, 1)
                out[f"{dst}mlp.fc.weight"] = _chunk(w[f"{src}mlp.gate_proj.weight"], tp_size, tp)
                out[f"{dst}mlp.gate.weight"] = _chunk(w[f"{src}mlp.up_proj.weight"], tp_size, tp)
                out[f"{dst}mlp.proj.weight"] = _chunk(w[f"{src}mlp.down_proj.weight"], tp_size, tp, 1)
                if f"{src}self_attn.o_proj.bias" in w:
                    out[f"{dst}attention.dense.bias"] = w[f"{src}self_attn.o_proj.bias"]
                if f"{src}mlp.gate_proj.bias" in w:
                    out[f"{dst}mlp.fc.bias"] = _chunk(w[f"{src}mlp.gate_proj.bias"], tp_size, tp)
                    out[f"{dst}mlp.gate.bias"] = _chunk(w[f"{src}mlp.up_proj.bias"], tp_size, tp)
                    out[f"{dst}mlp.proj.bias"] = w[f"{src}mlp.down_proj.bias"]
                if kv_cache_quant_algo:
                    out[f"{dst}attention.kv_cache_scaling_factor"] = torch.tensor([1.0], dtype=torch.float32)
                out[f"{dst}input_layernorm.weight"] = w[f"{src}input_layernorm.weight"]
                out[f"{dst}post_layernorm.weight"] = w[f"{src}post_attention_layernorm.weight"]
            if pp == pp_size - 1:
                out["transformer.ln_f.weight"] = w["model.norm.weight"]
                if not share_embedding_table:
                    out["lm_head.weight"] = _chunk(_pad_rows(head, tp_size), tp_size, tp)
            save_file({k: t.contiguous().clone() for k, t in out.items()},
                      os.path.join(out_dir, f"rank{pp * tp_size + tp}.safetensors"))
    return out_dir
