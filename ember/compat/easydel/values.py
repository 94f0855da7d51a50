"""EasyDeL's argument values in ember's terms: jax dtypes and precisions (read by name, so nothing here imports
jax; with the ``ember[easydel]`` extra installed the jax objects pass as they are), strings, torch dtypes, enums."""

from __future__ import annotations

from enum import Enum
from typing import Any, TypeVar

import numpy as np
import torch

from ember import dtypes

# jax.lax.Precision's members and the strings jax accepts for them. On CPU every one computes in full float32
# (XLA:CPU has no reduced-precision matmul passes); ember's float32 matmuls are full float32 too.
PRECISIONS = {"default": "DEFAULT", "high": "HIGH", "highest": "HIGHEST", "bfloat16": "DEFAULT",
              "tensorfloat32": "HIGH", "float32": "HIGHEST", "fastest": "DEFAULT"}
_E = TypeVar("_E", bound=Enum)


def torch_dtype(value: Any, name: str) -> torch.dtype | None:
    """A dtype given as jnp.bfloat16 / jnp.dtype('float32') / numpy dtype / 'bfloat16' / torch.bfloat16, or None."""
    if value is None or isinstance(value, torch.dtype):
        return value
    text = value if isinstance(value, str) else dtype_name(value)
    dtype = dtypes.DTYPES.get(dtypes.canonical_dtype(text) or "") if text else None
    if dtype is None:
        raise ValueError(f"{name}={value!r} is not a supported dtype: use float32, bfloat16 or float16 (jnp.float32, "
                         "jnp.bfloat16, jnp.float16, their names as strings, or torch dtypes)")
    return dtype


def dtype_name(value: Any) -> str | None:
    """The name of a jax / numpy dtype or scalar type: jnp.bfloat16 is a scalar type whose .dtype is a numpy dtype
    (ml_dtypes' bfloat16); jnp.dtype(...) and numpy dtypes have .name themselves; np.float32 goes through np.dtype."""
    name = getattr(getattr(value, "dtype", value), "name", None)
    if isinstance(name, str):
        return name
    try:  # a numpy scalar type such as np.float32
        return np.dtype(value).name
    except TypeError:
        return None


def precision(value: Any) -> str | None:
    """jax.lax.Precision.DEFAULT / HIGH / HIGHEST (or a string jax accepts for one), as its member name; None stays."""
    if value is None:
        return None
    text = value if isinstance(value, str) else getattr(value, "name", None)
    found = PRECISIONS.get(str(text).lower()) if text is not None else None
    if found is None:
        raise ValueError(f"precision={value!r} is not supported: use jax.lax.Precision.DEFAULT, HIGH or HIGHEST, "
                         f"one of {sorted(PRECISIONS)} as a string, or None")
    return found


def member(enum: type[_E], value: Any, name: str) -> _E:
    """value as a member of enum: the member itself, its value, or its name (EasyDeL's enums are str enums)."""
    if isinstance(value, enum):
        return value
    for m in enum:
        if value == m.value or (isinstance(value, str) and value.upper() == m.name) or (value is None
                                                                                        and m.value == "None"):
            return m
    raise ValueError(f"{name}={value!r} is not supported: use one of "
                     f"{', '.join(f'{enum.__name__}.{m.name}' for m in enum)}")
