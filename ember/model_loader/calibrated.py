"""Calibrated quantization (``quantization="awq"`` / ``"smoothquant"``): the checkpoint's float weights with per-channel
scales folded in (``ember.quantization.awq`` / ``smoothquant`` find them), then quantized as ever.

Calibration runs ember's own model (in the calibrator's dtype) on the calibration text (one batch of prefill
windows), with the algorithm observing the input of each group of linears (``ember.quantization.calibration.capture``).
What it finds is one scale vector per group: those are cached under ember's cache, a few hundred KB, keyed by the
source weight files, the algorithm and its settings, and a hash of the text. Every load (and every other
tensor-parallel rank, which waits on a file lock while one calibrates) folds them into the checkpoint's tensors as
they stream in (``calibration.apply_scales``), each rank its slice; the tensors no group touches come as stored
(GGUF blocks kept). A GGUF's touched blocks are dequantized by any int8 load anyway, so folding costs nothing more.

This lives in model_loader, not quantization, because it builds and runs a model: quantization sits below models.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ember.cache import cache_dir, file_key
from ember.config import ModelShape
from ember.distributed import ParallelContext
from ember.layers.attention import AttentionMetadata, PrefillSpan
from ember.model_loader.hf import Select, read_all
from ember.quantization import QuantConfig, QuantizedTensor, calibration
from ember.quantization.awq import AWQ
from ember.quantization.calibration import (Calibrator, ScalePlan, apply_scales, calibration_sequences, capture,
                                            read_calibration_text, text_key)
from ember.quantization.smoothquant import SmoothQuant

logger = logging.getLogger("ember")

CACHE_VERSION = 2  # bump when the cached scales' meaning changes (1 held the changed float tensors)
# What SmoothQuant's w8a8 may cost a GGUF's default: mean NLL a token of the calibration windows over the float
# model's (``smoothquant_holds``). Measured 2026-11-25: Qwen2.5-Coder-0.5B's GGUF 0.0078 (on tests/data/alice_ch1.txt's
# 512-token windows 0.0009: the 256-token windows' short context exaggerates it), SmolLM2-135M as Q8_0 0.060 (alice
# 0.012, where int8 weights alone cost 0.003).
NLL_BUDGET = 0.02


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


def scales_file(ckpt: Any, hf_config: Any, quant: QuantConfig, text: str, tokenizer: str | None = None) -> str:
    """Where the scales of quant's algorithm for ckpt, calibrated on text, are cached."""
    settings = make_calibrator(quant, {}, hf_config).settings()
    files = _weight_files(ckpt)
    windows = f"{calibration.NUM_SEQUENCES}x{calibration.SEQUENCE_LENGTH}"
    key = file_key(files[0], *(file_key(f) for f in files[1:]), settings, windows, text_key(text), tokenizer,
                   CACHE_VERSION)
    stem = os.path.splitext(os.path.basename(os.path.normpath(ckpt.path)))[0]
    return cache_dir("calibrated", f"{stem}-{quant.algorithm}-{key}.safetensors")


def calibrated_scales(ckpt: Any, hf_config: Any, quant: QuantConfig, calibration_data: str | None = None,
                      tokenizer: str | None = None, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The scales quant's algorithm finds for ckpt (group module -> s), calibrated on first use and then read from
    ember's cache. calibration_data: a text file (None: the shipped text); tokenizer: one given apart from the
    model."""
    from safetensors.torch import load_file

    return load_file(_calibrated_file(ckpt, hf_config, quant, calibration_data, tokenizer, device))


def calibration_report(ckpt: Any, hf_config: Any, quant: QuantConfig, calibration_data: str | None = None,
                       tokenizer: str | None = None, device: str = "cpu") -> dict[str, str]:
    """What calibration recorded beside the scales: the settings, and for SmoothQuant the mean negative
    log-likelihood a token of the calibration text under the float model (``nll_float``) and under the w8a8
    model loading builds (``nll_w8a8``), calibrating first if no cached result exists."""
    from safetensors import safe_open

    with safe_open(_calibrated_file(ckpt, hf_config, quant, calibration_data, tokenizer, device), "pt") as f:
        return dict(f.metadata() or {})


def _calibrated_file(ckpt: Any, hf_config: Any, quant: QuantConfig, calibration_data: str | None,
                     tokenizer: str | None, device: str) -> str:
    from safetensors.torch import save_file

    text = read_calibration_text(calibration_data)
    path = scales_file(ckpt, hf_config, quant, text, tokenizer)
    if os.path.isfile(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with _locked(path + ".lock"):  # one process calibrates; the others find its result
        if os.path.isfile(path):
            return path
        # a warning so that the command line, which shows warnings only, says why its first load pauses
        logger.warning("%s: calibrating %s on first use (a 0.5B model takes ~25 s on 2 cores; the result is cached)",
                       quant.algorithm, os.path.basename(ckpt.path))
        start = time.perf_counter()
        calibrator, report = run_calibration(ckpt, hf_config, quant, text, calibration_data, tokenizer, device,
                                             measure=quant.algorithm == "smoothquant")
        scales = {name: s.float().contiguous() for name, s in calibrator.scales().items()}
        fd, tmp = tempfile.mkstemp(prefix=".calibrating-", dir=os.path.dirname(path))
        os.close(fd)
        try:
            save_file(scales, tmp, metadata={"ember": calibrator.settings(), "source": ckpt.path, **report})
            os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared like the others
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        logger.info("%s: calibrated %d groups in %.1f s (%s%s), cached in %s", quant.algorithm, len(scales),
                    time.perf_counter() - start, calibrator.settings(),
                    "".join(f", {k} {v}" for k, v in report.items()), path)
    return path


def smoothquant_holds(ckpt: Any, hf_config: Any, tokenizer: str | None = None, device: str = "cpu") -> bool:
    """Whether SmoothQuant's w8a8 costs at most NLL_BUDGET a token of the shipped calibration text over the float
    model (measured once, at calibration): the test a GGUF's int8 default passes to run with int8 activations."""
    report = calibration_report(ckpt, hf_config, QuantConfig.of("smoothquant"), None, tokenizer, device)
    rise = float(report["nll_w8a8"]) - float(report["nll_float"])
    logger.info("smoothquant: w8a8 costs %+.4f nats a token of the calibration text (budget %.4f): %s", rise,
                NLL_BUDGET, "int8 activations" if rise <= NLL_BUDGET else "bf16 activations (quantization='int8')")
    return rise <= NLL_BUDGET


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def calibrated_tensors(ckpt: Any, hf_config: Any, quant: QuantConfig, calibration_data: str | None = None,
                       tokenizer: str | None = None, select: Select = read_all, device: str = "cpu",
                       changed_only: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The checkpoint's tensors with the algorithm's scales folded in: the touched ones float32, the rest as stored
    (quantized blocks kept); select: the part of each this rank reads. changed_only: the touched tensors alone."""
    plan = ScalePlan.of(hf_config, calibrated_scales(ckpt, hf_config, quant, calibration_data, tokenizer, device))
    names = plan.names
    pick = (lambda n: select(n) if n in names else None) if changed_only else select
    yield from apply_scales(ckpt.tensors(hf_config, keep_quantized=True, select=pick), plan, select)


def run_calibration(ckpt: Any, hf_config: Any, quant: QuantConfig, text: str, source: str | None = None,
                    tokenizer: str | None = None, device: str = "cpu",
                    make: Callable[[dict[str, torch.Tensor], Any], Calibrator] | None = None,
                    measure: bool = False) -> tuple[Calibrator, dict[str, str]]:
    """Run the algorithm: the float model (the calibrator's dtype) on the calibration windows of text, every group's
    input observed. Returns the calibrator, done (its ``scales()``, or ``finish()`` for the changed tensors), and a
    report: with ``measure``, the windows' mean NLL a token under the float model and under the model as loading
    builds it (the scales folded in, the decoder's linears quantized as quant says, the engine's own kernels; the
    table and LM head float). make(tensors, hf_config): another calibrator than quant's default one (tests,
    experiments)."""
    from ember.model_loader.checkpoint import open_checkpoint
    from ember.model_loader.finalize import finalize
    from ember.models import resolve_architecture

    tok = (open_checkpoint(tokenizer) if tokenizer else ckpt).tokenizer()
    sequences = calibration_sequences(tok.encode(text, add_special_tokens=False), calibration.NUM_SEQUENCES,
                                      calibration.SEQUENCE_LENGTH, source)
    tensors = {name: (t.dequantize(torch.float32) if isinstance(t, QuantizedTensor) else t.float())
               for name, t in ckpt.tensors(hf_config, keep_quantized=False)}
    calibrator = make(tensors, hf_config) if make is not None else make_calibrator(quant, tensors, hf_config)
    architecture, cls = resolve_architecture(getattr(hf_config, "architectures", None))
    dev = torch.device(device)

    def build(layout: QuantConfig | None, weights: Iterable[tuple[str, torch.Tensor]]) -> torch.nn.Module:
        with torch.device("cpu"):
            model = cls(architecture, hf_config, ModelShape.of(hf_config).max_position, calibrator.dtype, layout,
                        ParallelContext())
        model.load_weights(weights)
        model.to(device).eval()
        finalize(model, dev, False)
        return model

    model = build(None, tensors.items())
    hidden: list[torch.Tensor] = []
    capture(model, calibrator, lambda: hidden.append(prefill(model, sequences, dev)))
    if not measure:
        return calibrator, {}
    report = {"nll_float": f"{mean_nll(model, hidden.pop(), sequences):.6f}"}
    del model
    linears = QuantConfig(quant.method, quant.group_size)  # the decoder as the engine runs it; table, head float
    model = build(linears, apply_scales(tensors.items(), ScalePlan.of(hf_config, calibrator.scales())))
    report[f"nll_{linears.method}"] = f"{mean_nll(model, prefill(model, sequences, dev), sequences):.6f}"
    return calibrator, report


@torch.inference_mode()
def mean_nll(model: torch.nn.Module, hidden: torch.Tensor, sequences: list[list[int]]) -> float:
    """Mean negative log-likelihood a token of each sequence's next tokens, from the flat batch's hidden states
    (one window's logits at a time: 256 x a 152k vocabulary is 155 MB in float32)."""
    total, count, start = 0.0, 0, 0
    for seq in sequences:
        logits = model.compute_logits(hidden[start:start + len(seq) - 1]).float()
        target = torch.tensor(seq[1:], device=logits.device)
        total += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        count += len(seq) - 1
        start += len(seq)
    return total / count


def calibrate(ckpt: Any, hf_config: Any, quant: QuantConfig, text: str, source: str | None = None,
              tokenizer: str | None = None, device: str = "cpu",
              make: Callable[[dict[str, torch.Tensor], Any], Calibrator] | None = None) -> dict[str, torch.Tensor]:
    """The tensors the algorithm changes (Hugging Face names, float32, on the CPU), from ``run_calibration``."""
    return run_calibration(ckpt, hf_config, quant, text, source, tokenizer, device, make)[0].finish()


@torch.inference_mode()
def prefill(model: torch.nn.Module, sequences: list[list[int]], device: torch.device, block_size: int = 16
            ) -> torch.Tensor:
    """One forward pass of the sequences as fresh prompts in one flat batch; the last hidden states. A fresh prompt
    attends to its own K/V only, so every layer can write into the same pool: one layer's worth of KV memory."""
    layers = model.attention_layers()
    blocks = [-(-len(s) // block_size) for s in sequences]
    dtype = next(model.parameters()).dtype
    k = torch.zeros(sum(blocks), block_size, layers[0].num_kv_heads, layers[0].head_dim, dtype=dtype, device=device)
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
    return model(ids, positions, meta)
