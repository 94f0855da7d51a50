"""Calibrated quantization (``quantization="awq"`` / ``"smoothquant"``): the checkpoint's float weights transformed
by the algorithm (``ember.quantization.awq`` / ``smoothquant``), computed once and cached.

Calibration runs ember's own model in float32 on the calibration text (one batch of prefill windows), with the
algorithm observing the input of each group of linears (``ember.quantization.calibration.capture``). The tensors it
changed (norms and linear weights of every decoder layer) are written under ember's cache as one safetensors file,
keyed by the source weight files, the algorithm and its settings, and a hash of the text; the next load (and every
other tensor-parallel rank, which waits on a file lock meanwhile) reads them from there, each rank only its slice,
like any checkpoint tensor. Everything the algorithm left alone still comes from the checkpoint (GGUF blocks kept).

This lives in model_loader, not quantization, because it builds and runs a model: quantization sits below models.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ember.cache import cache_dir, file_key
from ember.config import ModelShape
from ember.distributed import ParallelContext
from ember.layers.attention import AttentionMetadata, PrefillSpan
from ember.model_loader.hf import Select, iter_safetensors, read_all
from ember.quantization import QuantConfig, QuantizedTensor, calibration
from ember.quantization.awq import AWQ
from ember.quantization.calibration import Calibrator, calibration_sequences, capture, read_calibration_text, text_key
from ember.quantization.smoothquant import SmoothQuant

logger = logging.getLogger("ember")

CACHE_VERSION = 1  # bump when the cached tensors' meaning changes
WEIGHTS_FILE = "model.safetensors"


def make_calibrator(quant: QuantConfig, tensors: dict[str, torch.Tensor], hf_config: Any) -> Calibrator:
    """The algorithm of quant, working on tensors (Hugging Face names, float32; changed in place)."""
    if quant.algorithm == "awq":
        return AWQ(tensors, hf_config, quant)
    if quant.algorithm == "smoothquant":
        return SmoothQuant(tensors, hf_config)
    raise ValueError(f"quantization={quant.mode!r} is not a calibrated algorithm")


def _weight_files(ckpt: Any) -> list[str]:
    """The files whose change must invalidate cached results: the checkpoint file(s) or its folder's files."""
    path = ckpt.path
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, f) for f in os.listdir(path) if os.path.isfile(os.path.join(path, f)))
    param = getattr(ckpt, "param_path", None)  # an .asmodel's weights sit beside it
    return files + ([param] if param else [])


def calibrated_weights(ckpt: Any, hf_config: Any, quant: QuantConfig, calibration_data: str | None = None,
                       tokenizer: str | None = None, device: str = "cpu") -> str:
    """The cache folder holding the float tensors quant's algorithm changed (WEIGHTS_FILE), made on first use.
    calibration_data: a text file (None: the shipped text); tokenizer: a tokenizer given apart from the model."""
    text = read_calibration_text(calibration_data)
    settings = make_calibrator(quant, {}, hf_config).settings()
    files = _weight_files(ckpt)
    windows = f"{calibration.NUM_SEQUENCES}x{calibration.SEQUENCE_LENGTH}"
    key = file_key(files[0], *(file_key(f) for f in files[1:]), settings, windows, text_key(text), tokenizer,
                   CACHE_VERSION)
    stem = os.path.splitext(os.path.basename(os.path.normpath(ckpt.path)))[0]
    folder = cache_dir("calibrated", f"{stem}-{quant.algorithm}-{key}")
    if os.path.isfile(os.path.join(folder, WEIGHTS_FILE)):
        return folder
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    with _locked(folder + ".lock"):  # one process calibrates; the others find its result
        if os.path.isfile(os.path.join(folder, WEIGHTS_FILE)):
            return folder
        from safetensors.torch import save_file

        start = time.perf_counter()
        changed = calibrate(ckpt, hf_config, quant, text, calibration_data, tokenizer, device)
        tmp = tempfile.mkdtemp(prefix=".calibrating-", dir=os.path.dirname(folder))
        try:
            save_file(changed, os.path.join(tmp, WEIGHTS_FILE), metadata={"ember": settings, "source": ckpt.path})
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info("%s: calibrated %d tensors in %.1f s (%s), cached in %s", quant.algorithm, len(changed),
                    time.perf_counter() - start, settings, folder)
    return folder


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def calibrated_tensors(ckpt: Any, hf_config: Any, quant: QuantConfig, calibration_data: str | None = None,
                       tokenizer: str | None = None, select: Select = read_all, device: str = "cpu"
                       ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The checkpoint's tensors with the algorithm's changes: the changed ones from the cache, the rest from the
    checkpoint (quantized blocks kept); select: the part of each this rank reads."""
    from safetensors import safe_open

    folder = calibrated_weights(ckpt, hf_config, quant, calibration_data, tokenizer, device)
    with safe_open(os.path.join(folder, WEIGHTS_FILE), framework="pt") as f:
        changed = set(f.keys())
    yield from ckpt.tensors(hf_config, keep_quantized=True, select=lambda n: None if n in changed else select(n))
    yield from iter_safetensors(folder, select)


def calibrate(ckpt: Any, hf_config: Any, quant: QuantConfig, text: str, source: str | None = None,
              tokenizer: str | None = None, device: str = "cpu",
              make: Callable[[dict[str, torch.Tensor], Any], Calibrator] | None = None) -> dict[str, torch.Tensor]:
    """Run the algorithm: the float32 model on the calibration windows of text, every group's input observed.
    Returns the changed tensors (Hugging Face names, float32, on the CPU). make(tensors, hf_config): another
    calibrator than quant's default one (tests, experiments)."""
    from ember.model_loader import open_checkpoint
    from ember.models import resolve_architecture

    tok = (open_checkpoint(tokenizer) if tokenizer else ckpt).tokenizer()
    sequences = calibration_sequences(tok.encode(text, add_special_tokens=False), calibration.NUM_SEQUENCES,
                                      calibration.SEQUENCE_LENGTH, source)
    tensors = {name: (t.dequantize(torch.float32) if isinstance(t, QuantizedTensor) else t.float())
               for name, t in ckpt.tensors(hf_config, keep_quantized=False)}
    architecture, cls = resolve_architecture(getattr(hf_config, "architectures", None))
    with torch.device("cpu"):
        model = cls(architecture, hf_config, ModelShape.of(hf_config).max_position, torch.float32, None,
                    ParallelContext())
    model.load_weights(tensors.items())
    model.to(device).eval()
    calibrator = make(tensors, hf_config) if make is not None else make_calibrator(quant, tensors, hf_config)
    return capture(model, calibrator, lambda: prefill(model, sequences, torch.device(device)))


@torch.inference_mode()
def prefill(model: torch.nn.Module, sequences: list[list[int]], device: torch.device, block_size: int = 16) -> None:
    """One forward pass of the sequences as fresh prompts in one flat batch. A fresh prompt attends to its own K/V
    only, so every layer can write into the same pool: one layer's worth of KV memory."""
    layers = model.attention_layers()
    blocks = [-(-len(s) // block_size) for s in sequences]
    k = torch.zeros(sum(blocks), block_size, layers[0].num_kv_heads, layers[0].head_dim, device=device)
    v = torch.zeros_like(k)
    for layer in layers:
        layer.k_cache, layer.v_cache = k, v
    spans, slots, start, first = [], [], 0, 0
    for seq, n in zip(sequences, blocks):
        spans.append(PrefillSpan(start, len(seq), len(seq), torch.arange(first, first + n, device=device)))
        slots.append(first * block_size + torch.arange(len(seq), device=device))
        start, first = start + len(seq), first + n
    meta = AttentionMetadata(torch.cat(slots), 0, None, None, spans)
    ids = torch.tensor([t for s in sequences for t in s], device=device)
    positions = torch.cat([torch.arange(len(s), device=device) for s in sequences])
    model(ids, positions, meta)
