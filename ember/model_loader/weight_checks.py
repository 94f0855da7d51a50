"""Each weight checked as it streams from the file into the model: a dtype the model can hold, and finite values.

A NaN or inf weight (a bit-flipped exponent, a diverged training run) makes every output NaN, which the sampler
turns into token 0 forever without any error; refusing the file at load names it instead. The check runs over
every float tensor and every quantized tensor's scales (quantized data are integers), a sum each: measured in
docs/hostile_files.md at 0.4% of the default model's load time and 7% of Qwen2.5-Coder-1.5B Q4_K_M's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from ember.errors import ConfigError
from ember.quantization import QuantizedTensor

# what a weight may be stored as: floats, and integers for quantized data and integer buffers
ALLOWED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int32,
                  torch.int64, torch.bool)


def checked_weights(path: str, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]
                    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """weights as they are, each checked (ConfigError naming the file, the tensor and what is wrong)."""
    for name, t in weights:
        floats = [t] if isinstance(t, torch.Tensor) else [t.scales] if isinstance(t, QuantizedTensor) else []
        if isinstance(t, torch.Tensor) and t.dtype not in ALLOWED_DTYPES:
            raise ConfigError(f"model file {path!r}: tensor {name} has dtype {t.dtype}: allowed "
                              f"{[str(d).removeprefix('torch.') for d in ALLOWED_DTYPES]}")
        for f in floats:
            # one sum a tensor (30x cheaper than isfinite over it): any NaN or inf makes it non-finite; a finite sum
            # that overflowed is told apart by the exact count
            if f.is_floating_point() and not bool(torch.isfinite(f.sum(dtype=torch.float32))) \
                    and not bool(torch.isfinite(f).all()):
                bad = int((~torch.isfinite(f)).sum())
                raise ConfigError(f"model file {path!r}: tensor {name}{'' if f is t else ' (scales)'} holds {bad} "
                                  f"NaN or infinite values of {f.numel()}: the file is damaged")
        yield name, t
