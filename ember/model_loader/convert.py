"""``ember convert``: any checkpoint ember reads, written as an .asmodel pair (optionally quantized, or calibrated
with AWQ / SmoothQuant first, so that loading it needs no calibration)."""

from __future__ import annotations

import os
from typing import Any

import torch

from ember.model_loader.asmodel import (AsModelCheckpoint, is_quantizable, pair_paths, parse_dtype, read_contents,
                                        validate, write)
from ember.model_loader.checkpoint import needs_calibration, open_checkpoint
from ember.quantization import QuantConfig


def convert(src: str, out_dir: str, name: str, dtype: str | torch.dtype | None = None,
            skip_if_exists: bool = False, show_progress: bool = False, quant_config: QuantConfig | None = None,
            extra: dict[str, Any] | None = None, calibration_data: str | None = None,
            tokenizer: str | None = None) -> str:
    """Serialize the checkpoint at src (Hugging Face folder, .gguf or .asmodel) as out_dir/NAME.asmodel +
    .asparam; with skip_if_exists, a pair that is already there and validates is kept. Returns the .asmodel path.
    tokenizer: a checkpoint to take the tokenizer from (a TensorRT-LLM checkpoint has none of its own).
    A quant_config with a calibrated algorithm (awq, smoothquant) stores the weights transformed by it, calibrated
    on calibration_data (a text file; None: the shipped text), then quantized: loading needs no calibration."""
    if quant_config is not None and quant_config.mixed:
        raise ValueError("quant_config with mixed=True (each weight as its GGUF blocks fit) is a loading layout, not "
                         "one .asmodel stores: convert with quantization='int4' or 'int8'")
    model_path, _ = pair_paths(out_dir, name)
    if skip_if_exists and validate(model_path) is None:
        return model_path
    ckpt = open_checkpoint(src)
    target = parse_dtype(dtype, ckpt.hf_config())
    progress = None
    if show_progress:
        from tqdm.auto import tqdm

        progress = lambda items: tqdm(items, desc="Converting", unit="tensor", dynamic_ncols=True)  # noqa: E731
    contents = read_contents(ckpt, target, os.path.abspath(src), progress, keep_quantized=quant_config is not None,
                             tokenizer=open_checkpoint(tokenizer).tokenizer() if tokenizer is not None else None)
    native = ckpt.native_quantization() if isinstance(ckpt, AsModelCheckpoint) else None
    if quant_config is not None and quant_config.algorithm and native is not None and native.mode != quant_config.mode:
        raise ValueError(f"quantization={quant_config.mode!r}: {src} is stored quantized as {native.describe()}; "
                         "calibrate from the original float checkpoint")
    if needs_calibration(ckpt, quant_config):
        from ember.model_loader.calibrated import calibrated_tensors

        # the tensors the algorithm's scales change, float32: weights quantized from it as write() stores them,
        # norms and biases in the stored dtype; the rest as read
        for t_name, t in calibrated_tensors(ckpt, ckpt.hf_config(), quant_config, calibration_data, changed_only=True):
            contents.tensors[t_name] = t if is_quantizable(t_name, quant_config) else t.to(target).contiguous()
    elif calibration_data is not None:
        raise ValueError(f"calibration_data={calibration_data!r} is only read by a calibrated quantization (awq, "
                         "smoothquant)")
    contents.extra = dict(extra or {})
    contents.quant_config = quant_config
    return write(contents, out_dir, name)[0]
