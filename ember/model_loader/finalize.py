"""The last step of loading: every weight laid out for the device's kernels."""

from __future__ import annotations

import torch


def finalize(model: torch.nn.Module, device: torch.device, prepack: bool, batch_invariant: bool = True,
             int8_activations: bool = False) -> None:
    """Lay every loaded weight out for the device's kernels (quantized paths, oneDNN's packed floats);
    batch_invariant: quantized kernels whose rows do not depend on the batch; int8_activations: int4 and int8
    weights multiply int8-quantized activations where the CPU has the kernels (``QuantizedMatmul``, both)."""
    for module in model.modules():  # embedding before LM head: a tied head reuses the finalized table
        if hasattr(module, "finalize"):
            module.finalize(device, prepack, batch_invariant, int8_activations)
