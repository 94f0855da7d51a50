"""Write a Hugging Face folder (Llama, Mistral or Qwen2) as a TensorRT-LLM checkpoint, the way TensorRT-LLM's
converters (v0.9-0.10: examples/llama/convert_checkpoint.py, examples/qwen/convert_checkpoint.py) and ModelOpt's
quantized export lay it out, for the tests.

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
- Qwen2 is written as the v0.9-0.10 converter names it: ``"architecture": "QWenForCausalLM"`` with
  ``"qwen_type": "qwen2"`` (architecture="Qwen2ForCausalLM": as v0.12 on names it), attn_bias True; Mistral as
  ``MistralForCausalLM`` with no sliding-window field (the converter writes none).

Quantized (``quant_algo``), the five linears of each layer (qkv, dense, fc, gate, proj; embedding and lm_head stay
float, ``exclude_modules: ["lm_head"]``):

- ``W4A16_AWQ`` (ModelOpt): each linear quantized whole (q, k and v apart, sharing one prequant scale, as they share
  their input), then split like its float weight: ``weight`` int8 [out/2, in] holding signed int4 pairs of output
  channels (low nibble the even one), ``weights_scaling_factor`` [out, in / group_size], ``prequant_scaling_factor``
  [in] (a random positive AWQ scale p; the int4 values are round(W / p / s), so that q * s * p ~= W).
- ``W8A8_SQ_PER_CHANNEL`` (ModelOpt): ``weight`` int8 [out, in] = round(W / p / s), ``weights_scaling_factor``
  [out], ``prequant_scaling_factor`` [in] (random positive smoothing p), ``activation_scaling_factor`` [1].
- ``W8A16`` / ``W4A16`` (convert_checkpoint --use_weight_only): each rank's share quantized per output channel,
  ``weight`` int8 [in, out] (W4A16: int4 packed [in, out/2]) and ``per_channel_scale`` [out]. TensorRT-LLM then
  preprocesses the int8 for the converting GPU's kernels; we cannot, and write them unpreprocessed (the reader refuses
  them by dtype). weight_only_plugin=False (--disable_weight_only_quant_plugin): ``weight`` is the float share
  transposed, [in, out], per_channel_scale still written. weight_only_plugin="modelopt" (ModelOpt's int8_wo / int4_wo
  export): as ModelOpt's other layouts, with no prequant: ``weight`` int8 [out, in] and ``weights_scaling_factor``
  [out] (W8A16), or int4 packed [out/2, in] and ``weights_scaling_factor`` [out, in / group_size] (W4A16).
- ``W8A8_SQ_*_PLUGIN`` (TensorRT-LLM's own SmoothQuant, convert_checkpoint --smoothquant, models/llama/convert.py):
  random positive smoothing a layer: one s for q/k/v, folded into input_layernorm (stored ln / s; the weights
  W * s[in] quantized), one for gate/up folded into post_layernorm likewise; o_proj and down_proj each get a
  ``smoother`` m [1, in_r] (the runtime divides their input by it; W * m quantized). ``weight`` int8 [out_r, in]
  (row-parallel [out, in_r]) = round(W' / scale), ``per_channel_scale`` float32 [1, out_r] per output channel
  (row-parallel: [1, out] whole) in the per-channel modes, [1, 1] in the per-tensor ones (one for q, k and v
  together); companions written for the reader to ignore: act_scale, scale_x_orig_quant, scale_y_accum_quant,
  scale_w_quant_orig, scale_y_quant_orig, the layernorms' scale_to_int, the blocks' quantization_scaling_factor.
  ``smoothquant_plugin_float_state`` gives the float weights the checkpoint stands for.
- any other algo: only written into config.json (the weights stay float).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import torch

MODELOPT_ALGOS = ("W4A16_AWQ", "W8A8_SQ_PER_CHANNEL")
WEIGHT_ONLY_ALGOS = ("W8A16", "W4A16")
INT4_ALGOS = ("W4A16_AWQ", "W4A16")  # packed int4 weights, grouped scales
SQ_PLUGIN_ALGOS = ("W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN", "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN",
                   "W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN", "W8A8_SQ_PER_TENSOR_PLUGIN")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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


@dataclass(frozen=True)
class QuantLinear:
    """One Hugging Face linear as ModelOpt stores it, unpacked: q the integer values [out, in] (int8 dtype), scale
    [out, in / group_size] (AWQ) or [out] (SmoothQuant), prequant [in], act [1] (SmoothQuant's static activation
    scale); the float weight it stands for is q * scale * prequant."""

    q: torch.Tensor
    scale: torch.Tensor
    prequant: torch.Tensor
    act: torch.Tensor | None = None

    def rows(self, n: int, i: int) -> "QuantLinear":  # column-parallel share
        return replace(self, q=_chunk(self.q, n, i), scale=_chunk(self.scale, n, i))

    def cols(self, n: int, i: int) -> "QuantLinear":  # row-parallel share: grouped scales split with their inputs
        scale = _chunk(self.scale, n, i, 1) if self.scale.dim() == 2 else self.scale
        return replace(self, q=_chunk(self.q, n, i, 1), scale=scale, prequant=_chunk(self.prequant, n, i))

    def repeat_kv(self, kv_heads: int, tp: int) -> "QuantLinear":
        return replace(self, q=_repeat_kv(self.q, kv_heads, tp), scale=_repeat_kv(self.scale, kv_heads, tp))


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """int4 values [out, in] -> int8 [out/2, in]: row 2j in the low nibble, row 2j + 1 in the high one."""
    low, high = q[0::2].to(torch.int16) & 0xF, q[1::2].to(torch.int16) & 0xF
    return (low | (high << 4)).to(torch.uint8).view(torch.int8)


def _quantize(w: torch.Tensor, algo: str, group_size: int, prequant: torch.Tensor, dtype: torch.dtype,
              g: torch.Generator) -> QuantLinear:
    """ModelOpt's symmetric rounding of w / prequant: int4 per group of inputs (AWQ) or int8 per output channel
    (SmoothQuant); the scales and prequant as stored (in dtype), the integers rounded against those."""
    x = w.float() / prequant.float()
    if algo in INT4_ALGOS:
        out, k = x.shape
        amax = x.reshape(out, k // group_size, group_size).abs().amax(-1)
        scale = (amax.clamp(min=1e-6) / 7).to(dtype)
        q = (x / scale.float().repeat_interleave(group_size, dim=1)).round().clamp(-8, 7).to(torch.int8)
        return QuantLinear(q, scale, prequant)
    scale = (x.abs().amax(-1).clamp(min=1e-6) / 127).to(dtype)
    q = (x / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    act = (torch.rand(1, generator=g) + 0.5).to(torch.float32) if algo == "W8A8_SQ_PER_CHANNEL" else None
    return QuantLinear(q, scale, prequant, act)


def quantized_linears(state: dict[str, torch.Tensor], algo: str, group_size: int, dtype: torch.dtype,
                      layers: int, seed: int = 0) -> dict[str, QuantLinear]:
    """Hugging Face weight name -> its ModelOpt quantization, with random positive prequant scales (one for q, k
    and v together: they share their input and TensorRT-LLM fuses them; one for each other linear); weight-only
    algos (W8A16 / W4A16) have none: a prequant of ones, not written."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, QuantLinear] = {}

    def scale_for(name: str) -> torch.Tensor:
        if algo in WEIGHT_ONLY_ALGOS:
            return torch.ones(state[name].shape[1], dtype=dtype)
        return (torch.randn(state[name].shape[1], generator=g) * 0.5).exp().to(dtype)

    for i in range(layers):
        src = f"model.layers.{i}."
        shared = scale_for(f"{src}self_attn.q_proj.weight")
        for proj in LINEARS:
            name = f"{src}{'self_attn' if proj in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{proj}.weight"
            pre = shared if proj in ("q_proj", "k_proj", "v_proj") else scale_for(name)
            out[name] = _quantize(state[name].to(dtype), algo, group_size, pre, dtype, g)
    return out


@dataclass(frozen=True)
class SQLinear:
    """One Hugging Face linear in TensorRT-LLM's SmoothQuant plugin layout: q int8 [out, in], scale float32 [out]
    (per channel) or [1] (per tensor), smoother float32 [in] (o_proj, down_proj) or None; the float weight it stands
    for is q * scale[o] / smoother[i]."""

    q: torch.Tensor
    scale: torch.Tensor
    smoother: torch.Tensor | None = None

    @property
    def per_channel(self) -> bool:
        return self.scale.numel() == self.q.shape[0] and self.q.shape[0] > 1

    def rows(self, n: int, i: int) -> "SQLinear":
        return replace(self, q=_chunk(self.q, n, i), scale=_chunk(self.scale, n, i) if self.per_channel else self.scale)

    def cols(self, n: int, i: int) -> "SQLinear":  # per_channel_scale stays whole, the smoother is split
        sm = _chunk(self.smoother, n, i) if self.smoother is not None else None
        return replace(self, q=_chunk(self.q, n, i, 1), smoother=sm)

    def repeat_kv(self, kv_heads: int, tp: int) -> "SQLinear":
        scale = _repeat_kv(self.scale, kv_heads, tp) if self.per_channel else self.scale
        return replace(self, q=_repeat_kv(self.q, kv_heads, tp), scale=scale)

    def float(self) -> torch.Tensor:
        w = self.q.float() * self.scale.float()[:, None]
        return w / self.smoother.float()[None, :] if self.smoother is not None else w


def _sq_quantize(ws: list[torch.Tensor], per_channel: bool) -> list[torch.Tensor]:
    """Symmetric int8 scales of the (already smoothed, float32) weights: per row, or one for them all."""
    if per_channel:
        return [w.abs().amax(-1).clamp(min=1e-6) / 127 for w in ws]
    amax = torch.stack([w.abs().amax() for w in ws]).amax().clamp(min=1e-6) / 127
    return [amax.reshape(1) for _ in ws]


def smoothquant_plugin(state: dict[str, torch.Tensor], algo: str, layers: int, seed: int = 0
                       ) -> tuple[dict[str, SQLinear], dict[str, torch.Tensor]]:
    """(Hugging Face linear name -> its SQLinear, Hugging Face layernorm name -> the smoothed weight stored, in the
    state's dtype), from the float state (in the checkpoint's dtype), with random positive smoothing vectors."""
    g = torch.Generator().manual_seed(seed + 1000)
    per_channel = "SQ_PER_CHANNEL" in algo
    linears: dict[str, SQLinear] = {}
    norms: dict[str, torch.Tensor] = {}

    def smoothing(n: int) -> torch.Tensor:
        return (torch.randn(n, generator=g) * 0.5).exp()

    for i in range(layers):
        src = f"model.layers.{i}."
        for norm, projs in (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                            ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))):
            ln = state[f"{src}{norm}.weight"]
            s = smoothing(ln.shape[0])
            norms[f"{src}{norm}.weight"] = (ln.float() / s).to(ln.dtype)
            names = [f"{src}{p}.weight" for p in projs]
            ws = [state[n].float() * s[None, :] for n in names]
            for n, w, scale in zip(names, ws, _sq_quantize(ws, per_channel)):
                q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
                linears[n] = SQLinear(q, scale.float())
        for proj in ("self_attn.o_proj", "mlp.down_proj"):
            n = f"{src}{proj}.weight"
            m = smoothing(state[n].shape[1])
            w = state[n].float() * m[None, :]
            scale = _sq_quantize([w], per_channel)[0]
            linears[n] = SQLinear((w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale.float(), m)
    return linears, norms


def smoothquant_plugin_float_state(state: dict[str, torch.Tensor], algo: str, layers: int, seed: int = 0
                                   ) -> dict[str, torch.Tensor]:
    """The float weights a SmoothQuant plugin checkpoint written from state (in the checkpoint's dtype) stands for:
    the smoothed layernorm weights as stored, each linear q * scale / smoother computed in float32 and rounded once
    to the dtype, every other tensor as in state."""
    linears, norms = smoothquant_plugin(state, algo, layers, seed)
    out = dict(state)
    out.update(norms)
    out.update({n: ql.float().to(state[n].dtype) for n, ql in linears.items()})
    return out


def _hf_config_fields(hf) -> dict:
    """architecture-specific config.json fields as the converters write them."""
    arch = hf.architectures[0]
    if arch == "Qwen2ForCausalLM":
        return {"architecture": "QWenForCausalLM", "qwen_type": "qwen2", "attn_bias": True, "mlp_bias": False,
                "use_logn_attn": False, "seq_length": 8192}
    return {"architecture": arch, "attn_bias": bool(getattr(hf, "attention_bias", False)),
            "mlp_bias": bool(getattr(hf, "mlp_bias", False))}


def write_trtllm_checkpoint(hf_folder: str, out_dir: str, tp_size: int = 1, pp_size: int = 1, *,
                            use_parallel_embedding: bool = False, embedding_sharding_dim: int = 0,
                            share_embedding_table: bool = False, dtype: str | None = None,
                            quant_algo: str | None = None, kv_cache_quant_algo: str | None = None,
                            group_size: int = 128, weight_only_plugin: bool | str = True, seed: int = 0,
                            architecture: str | None = None) -> str:
    """Convert the checkpoint in hf_folder (config.json + model.safetensors) into out_dir; no tokenizer files are
    written (TensorRT-LLM's converter writes none). share_embedding_table: leave lm_head out (a tied model exported
    so reuses the embedding). quant_algo, group_size, weight_only_plugin, seed: the quantized layouts of the module
    docstring (``quantized_linears(..., seed)`` gives the values written); kv_cache_quant_algo: also a
    kv_cache_scaling_factor a layer, as the converter's INT8 / FP8 KV cache options. architecture: replaces the one
    written."""
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
    modelopt = quant_algo in MODELOPT_ALGOS or (quant_algo in WEIGHT_ONLY_ALGOS and weight_only_plugin == "modelopt")
    weight_only = quant_algo in WEIGHT_ONLY_ALGOS and not modelopt
    sq_plugin = quant_algo in SQ_PLUGIN_ALGOS
    config = {
        **_hf_config_fields(hf),
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
        "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": kv_cache_quant_algo,
                         "group_size": group_size, "smoothquant_val": 0.5 if sq_plugin else None,
                         "has_zero_point": False,
                         "pre_quant_scale": quant_algo == "W4A16_AWQ",
                         "exclude_modules": ["lm_head"] if modelopt else None},
        "kv_dtype": dtype,
        "rotary_scaling": None if rope.get("rope_type", "default") == "default" else
        {k: v for k, v in rope.items() if k != "rope_theta"},
        "rotary_base": rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)),
        "residual_mlp": False,
        "disable_weight_only_quant_plugin": weight_only and not weight_only_plugin,
        "moe": {"num_experts": 0, "top_k": 0, "normalization_mode": None},
        "tie_word_embeddings": tied,
    }
    if architecture:
        config["architecture"] = architecture
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=4)

    w = {k: v.to(torch_dtype) for k, v in state.items()}
    quant = quantized_linears(w, quant_algo, group_size, torch_dtype, layers, seed) if modelopt else {}
    if sq_plugin:
        quant, norms = smoothquant_plugin(w, quant_algo, layers, seed)
        w.update(norms)
    embedding = w["model.embed_tokens.weight"]
    head = embedding if tied else w["lm_head.weight"]
    per_stage = layers // pp_size

    def linear(out: dict, prefix: str, share) -> None:
        """A linear's rank share (a float tensor, a QuantLinear or an SQLinear) as the algo stores it."""
        if isinstance(share, SQLinear):
            one = torch.ones(1, dtype=torch.float32)
            out[prefix + "weight"] = share.q
            out[prefix + "per_channel_scale"] = share.scale.reshape(1, -1).float()
            if share.smoother is not None:
                out[prefix + "smoother"] = share.smoother.reshape(1, -1).float()
            out[prefix + "act_scale"] = torch.full((1, 1), 0.7)
            out[prefix + "scale_x_orig_quant"] = one * 3.0
            out[prefix + "scale_y_accum_quant"] = share.scale.reshape(1, -1).float() / 3.0
            out[prefix + "scale_w_quant_orig"] = share.scale.reshape(1, -1).float()
            out[prefix + "scale_y_quant_orig"] = one * 0.25
        elif isinstance(share, QuantLinear):
            out[prefix + "weight"] = pack_int4_rows(share.q) if quant_algo in INT4_ALGOS else share.q
            out[prefix + "weights_scaling_factor"] = share.scale
            if quant_algo in MODELOPT_ALGOS:  # ModelOpt's weight-only export has no prequant scale
                out[prefix + "prequant_scaling_factor"] = share.prequant
            if share.act is not None:
                out[prefix + "activation_scaling_factor"] = share.act
        elif weight_only:
            wt = share.t().contiguous()  # [in, out]
            scale = wt.float().abs().amax(0).clamp(min=1e-6) / (127 if quant_algo == "W8A16" else 7)
            out[prefix + "per_channel_scale"] = scale.to(torch_dtype)
            if not weight_only_plugin:
                out[prefix + "weight"] = wt
            else:
                q = (wt.float() / scale).round().clamp(-128, 127).to(torch.int8)
                out[prefix + "weight"] = q if quant_algo == "W8A16" else pack_int4_rows(q.t()).t().contiguous()
        else:
            out[prefix + "weight"] = share

    def get(name: str):
        return quant.get(name, w[name])

    def rows(t, i: int):
        return t.rows(tp_size, i) if isinstance(t, (QuantLinear, SQLinear)) else _chunk(t, tp_size, i)

    def cols(t, i: int):
        return t.cols(tp_size, i) if isinstance(t, (QuantLinear, SQLinear)) else _chunk(t, tp_size, i, 1)

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
                    q, k, v = (get(f"{src}self_attn.{p}_proj.{kind}") for p in "qkv")
                    if kv_heads < tp_size:
                        k, v = ((t.repeat_kv(kv_heads, tp_size) if isinstance(t, (QuantLinear, SQLinear)) else
                                 _repeat_kv(t, kv_heads, tp_size)) for t in (k, v))
                    parts = [rows(t, tp) for t in (q, k, v)]
                    if kind == "bias":
                        out[f"{dst}attention.qkv.bias"] = torch.cat(parts)
                    elif isinstance(q, SQLinear):
                        scale = torch.cat([p.scale for p in parts]) if q.per_channel else parts[0].scale
                        linear(out, f"{dst}attention.qkv.", SQLinear(torch.cat([p.q for p in parts]), scale))
                    elif isinstance(q, QuantLinear):
                        linear(out, f"{dst}attention.qkv.", replace(
                            parts[0], q=torch.cat([p.q for p in parts]), scale=torch.cat([p.scale for p in parts])))
                    else:
                        linear(out, f"{dst}attention.qkv.", torch.cat(parts))
                linear(out, f"{dst}attention.dense.", cols(get(f"{src}self_attn.o_proj.weight"), tp))
                linear(out, f"{dst}mlp.fc.", rows(get(f"{src}mlp.gate_proj.weight"), tp))
                linear(out, f"{dst}mlp.gate.", rows(get(f"{src}mlp.up_proj.weight"), tp))
                linear(out, f"{dst}mlp.proj.", cols(get(f"{src}mlp.down_proj.weight"), tp))
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
                if sq_plugin:
                    for name in ("input_layernorm.scale_to_int", "post_layernorm.scale_to_int",
                                 "attention.quantization_scaling_factor", "mlp.quantization_scaling_factor"):
                        out[dst + name] = torch.tensor([2.0], dtype=torch.float32)
            if pp == pp_size - 1:
                out["transformer.ln_f.weight"] = w["model.norm.weight"]
                if not share_embedding_table:
                    out["lm_head.weight"] = _chunk(_pad_rows(head, tp_size), tp_size, tp)
            save_file({k: t.contiguous().clone() for k, t in out.items()},
                      os.path.join(out_dir, f"rank{pp * tp_size + tp}.safetensors"))
    return out_dir
