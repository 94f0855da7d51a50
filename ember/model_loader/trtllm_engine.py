"""What a folder built by ``trtllm-build`` says about itself, and what to load instead.

An engine folder holds ``config.json`` (``version``, ``pretrained_config``: the checkpoint's own config, and
``build_config``: the limits the engine was compiled for) and one ``rank{N}.engine`` per rank: TensorRT plans, whose
weights only TensorRT can read back. ember cannot load them, so the error names the checkpoint folder the engine was
built from (``trtllm-build --checkpoint_dir``), as the config describes it, and the build limits to set again.
"""

from __future__ import annotations

import os
from typing import Any


def is_engine_config(config: Any) -> bool:
    return isinstance(config, dict) and "pretrained_config" in config and "build_config" in config


def engine_folder_message(path: str, config: dict[str, Any], limits_hint: str = "") -> str:
    """Why an engine folder cannot be loaded and exactly what to pass instead; limits_hint: how the caller's API
    sets the build limits again (appended when the config names any)."""
    pre = config.get("pretrained_config") if isinstance(config.get("pretrained_config"), dict) else {}
    build = config.get("build_config") if isinstance(config.get("build_config"), dict) else {}
    mapping = pre.get("mapping") if isinstance(pre.get("mapping"), dict) else {}
    quant = pre.get("quantization") if isinstance(pre.get("quantization"), dict) else {}
    tp, pp = int(mapping.get("tp_size", 1) or 1), int(mapping.get("pp_size", 1) or 1)
    ranks = sorted(f for f in os.listdir(path) if f.startswith("rank") and f.endswith(".engine")) \
        if os.path.isdir(path) else []
    facts = [f"architecture={pre.get('architecture')!r}", f"dtype={pre.get('dtype')!r}", f"tp_size={tp}",
             f"pp_size={pp}"]
    if quant.get("quant_algo") or quant.get("kv_cache_quant_algo"):
        facts += [f"{k}={quant.get(k)!r}" for k in ("quant_algo", "kv_cache_quant_algo")]
    version = f" (TensorRT-LLM {config['version']})" if config.get("version") else ""
    message = (f"{path!r} is an engine built by trtllm-build{version}: its weights are compiled into "
               f"{', '.join(ranks) or 'rank*.engine'}, TensorRT plans only TensorRT can read, so they cannot be "
               "recovered. Pass the TensorRT-LLM checkpoint folder it was built from (the --checkpoint_dir of "
               f"trtllm-build: config.json + {_rank_files(tp * pp)}, {', '.join(facts)}), or the Hugging Face folder "
               "that checkpoint was converted from")
    max_seq = build.get("max_seq_len")
    max_input = build.get("max_input_len")
    max_output = build.get("max_output_len")
    if max_output is None and isinstance(max_seq, int) and isinstance(max_input, int):
        max_output = max_seq - max_input  # max_seq_len replaced max_output_len in TensorRT-LLM 0.11
    limits = {"max_batch_size": build.get("max_batch_size"), "max_input_len": max_input,
              "max_output_len": max_output, "max_num_tokens": build.get("max_num_tokens"),
              "max_beam_width": build.get("max_beam_width")}
    given = ", ".join(f"{k}={v}" for k, v in limits.items() if v is not None)
    if given and limits_hint:
        message += f". The engine was built for {given}: {limits_hint}"
    return message


def _rank_files(n: int) -> str:
    return "rank0.safetensors" if n == 1 else f"rank0.safetensors .. rank{n - 1}.safetensors"
