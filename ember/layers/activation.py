"""Gated MLP activations over a fused gate/up projection: act(gate) * up, the act named by the config."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.kernels import kernels_for


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up. bf16 on an AVX512-BF16 CPU build takes ember's one-pass kernel (its exp may move a result by
    the last bf16 bit); every other case runs eager."""
    if gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2 and gate_up.shape[1] % 32 == 0:
        kernels = kernels_for(gate_up.device)
        if kernels is not None and kernels.has_avx512_bf16() and gate_up.is_contiguous():
            return kernels.silu_and_mul_bf16(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up: Gemma's GeGLU (transformers' ``gelu_pytorch_tanh``)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# a config's hidden_act / hidden_activation -> the gated activation
GATED_ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul, "gelu_tanh": gelu_tanh_and_mul}


def gated_activation(field: str, name: str):
    """The gated activation a config names; an unknown one fails naming the field, its value and the choices."""
    act = GATED_ACTIVATIONS.get(name)
    if act is None:
        raise ValueError(f"{field}={name!r} is not supported: use one of {sorted(GATED_ACTIVATIONS)}")
    return act
