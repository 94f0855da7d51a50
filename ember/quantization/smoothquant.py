"""SmoothQuant (Xiao et al. 2022, "SmoothQuant: Accurate and Efficient Post-Training Quantization for Large
Language Models"): W8A8 rounds each token's activations to int8 with one scale a token, so a few channels with
large activations (outliers) leave the others only a few levels. Dividing channel j by
s_j = max|x_j|^alpha / max|W_j|^(1 - alpha) and multiplying the weights' column j by s_j moves part of that range
into the weights, which int8 per output channel holds easily; the division is folded into the RMSNorm (or linear)
that writes the input (``calibration.fold_scales``), so the float model is unchanged.

The groups are q/k/v (after input_layernorm) and gate/up (after post_attention_layernorm), as in the paper's Llama
setting; down_proj (folded into up_proj's rows) on request. max|x_j| is taken over every calibration token.
"""

from __future__ import annotations

from typing import Any

import torch

from ember.quantization.calibration import ScaleGroup, fold_scales, group_weight, scale_groups

DEFAULT_ALPHA = 0.5  # migration strength: measured best in 0.5..0.85 on the two models of docs/quantization.md
DEFAULT_KINDS = ("qkv", "gate_up")


class SmoothQuant:
    """The calibrator (see ``calibration.Calibrator``): per-channel max |x| of each group's input, then the
    smoothing scales folded into ``tensors`` (Hugging Face names, float) at the end."""

    dtype = torch.bfloat16  # only max|x| a channel is kept: s moves 0.2% from float32's (median; 1% at p99)

    def __init__(self, tensors: dict[str, torch.Tensor], hf_config: Any, alpha: float = DEFAULT_ALPHA,
                 kinds: tuple[str, ...] = DEFAULT_KINDS) -> None:
        if not 0 <= alpha <= 1:
            raise ValueError(f"alpha={alpha!r} is out of range: SmoothQuant's migration strength is in [0, 1]")
        self.tensors, self.alpha, self.kinds = tensors, alpha, kinds
        self.groups = scale_groups(hf_config, kinds)
        self.act_max: dict[ScaleGroup, torch.Tensor] = {}

    def settings(self) -> str:
        return f"smoothquant alpha={self.alpha} groups={'+'.join(self.kinds)}"

    def observe(self, group: ScaleGroup, x: torch.Tensor) -> None:
        m = x.abs().amax(dim=0).cpu()
        self.act_max[group] = torch.maximum(self.act_max[group], m) if group in self.act_max else m

    def group_scales(self, group: ScaleGroup) -> torch.Tensor:
        """s_j = max|x_j|^alpha / max|W_j|^(1 - alpha) over the group's stacked weights."""
        w_max = group_weight(self.tensors, group).abs().amax(dim=0).clamp(min=1e-5)
        act = self.act_max[group].clamp(min=1e-5)
        return (act.pow(self.alpha) / w_max.pow(1 - self.alpha)).clamp(min=1e-5)

    def scales(self) -> dict[str, torch.Tensor]:
        """Each group's smoothing scales, by the module that reads the group's input."""
        missing = [g.module for g in self.groups if g not in self.act_max]
        if missing:
            raise RuntimeError(f"SmoothQuant saw no calibration input for {missing[:3]}")
        return {group.module: self.group_scales(group) for group in self.groups}

    def finish(self) -> dict[str, torch.Tensor]:
        scales = self.scales()
        changed: set[str] = set()
        for group in self.groups:  # forward order: a group's columns are read before a later group scales rows
            changed.update(fold_scales(self.tensors, group, scales[group.module]))
        return {name: self.tensors[name].contiguous() for name in sorted(changed)}
