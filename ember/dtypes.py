"""The one table of float dtypes ember accepts, with the aliases users write."""

from __future__ import annotations

import functools

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def canonical(name: str) -> str | None:
    """'bf16' -> 'bfloat16'; None for a name that is not a supported dtype."""
    name = ALIASES.get(name, name)
    return name if name in DTYPES else None


def to_dtype(value: str | torch.dtype) -> torch.dtype:
    """A torch dtype from a name or alias (raises KeyError for an unknown one)."""
    if isinstance(value, torch.dtype):
        return value
    return DTYPES[ALIASES.get(value, value)]


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
