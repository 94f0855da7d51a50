"""torch's side of the float dtypes ember accepts (their names and aliases: ``ember.config.model``), and the
dtype a model runs in (``resolve_dtype``)."""

from __future__ import annotations

import functools
import logging

import torch

from ember.config.model import FLOAT_DTYPES, canonical_dtype

logger = logging.getLogger("ember")

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in FLOAT_DTYPES}
NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def to_dtype(value: str | torch.dtype) -> torch.dtype:
    """A torch dtype from a name or alias (raises KeyError for an unknown one)."""
    if isinstance(value, torch.dtype):
        return value
    return DTYPES[canonical_dtype(value) or value]


def name_of(dtype: torch.dtype) -> str:
    return NAMES.get(dtype) or str(dtype).removeprefix("torch.")


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """Whether oneDNN runs bf16 natively on this CPU (AVX512-BF16 / AMX, or AVX512BW/VL/DQ / AVX-NE-CONVERT for its
    bf16 path): elsewhere bf16 matmuls are several times slower than float32 and oneDNN refuses bf16 weight packing.
    A fact of the machine, asked once."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(requested: str | torch.dtype, config_dtype: torch.dtype | str | None, device: str) -> torch.dtype:
    """'auto' takes the checkpoint's dtype, but float32 checkpoints run in bf16/fp16 (as vLLM does); on CPU
    float16 runs as bfloat16 where the CPU has fast bf16 (float32 otherwise), since CPUs have no fast fp16 matmul."""
    on_cpu = device.startswith("cpu")
    if isinstance(requested, torch.dtype):
        dtype = requested
    elif requested == "auto":
        if isinstance(config_dtype, str):
            config_dtype = DTYPES.get(config_dtype)
        dtype = config_dtype if config_dtype in (torch.bfloat16, torch.float16) else None
        if dtype is None:
            dtype = torch.bfloat16 if (not on_cpu or cpu_has_fast_bf16()) else torch.float32
    else:
        dtype = to_dtype(requested)
    if on_cpu and dtype == torch.float16:
        dtype = torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
        logger.warning("float16 has no fast matmul on CPU; running in %s instead", str(dtype).removeprefix("torch."))
    return dtype
