"""AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and Acceleration"): before
int4 rounding, scale up the input channels that carry large activations, so their weights round with a smaller
relative error, and fold the inverse scale into the op that writes the input (``calibration.fold_scales``).

Per group of linears sharing an input (q/k/v, o after v when there is no GQA, gate/up, down after up), as llm-awq
does: s = mean|x|^alpha (normalised by sqrt(max s * min s)), alpha on a grid of 20 points in [0, 1), the alpha whose
fake-quantized weights Q(W * s) / s give the least mean squared error of the group's outputs on the calibration
activations against the float weights. alpha = 0 (s = 1, plain rounding) is on the grid, so on the calibration
data AWQ is never worse than rounding. Rounding is ember's own int4 (``quantize_int4``'s arithmetic), exactly what
loading does.

llm-awq's weight clipping is here too (``clip=True``: per output row and quantization group, max|w| shrunk by up to
half, 10 steps, where that lowers the same output error; not on q/k, whose errors the attention scores amplify), but
off by default: it made perplexity worse on both models measured (docs/quantization.md) and doubles the time.

The search measures errors on a fixed random sample of the calibration tokens, in bfloat16 matmuls (they only
rank candidates); the activation means use every token. More sampled tokens measured no better
(docs/quantization.md).
"""

from __future__ import annotations

from typing import Any

import torch

from ember.quantization.calibration import ScaleGroup, fold_scales, group_weight, scale_groups
from ember.quantization.config import QuantConfig

N_GRID = 20  # alphas 0, 0.05, ..., 0.95 (llm-awq's grid)
SEARCH_TOKENS = 512  # calibration rows the output error is measured on
CLIP_TOKENS = 512  # rows for the clipping search (llm-awq: 512)
CLIP_STEPS = 10  # max|w| x 1.0, 0.95, ..., 0.55 (llm-awq: max_shrink 0.5 of a 20-point grid)
NO_CLIP = ("q_proj", "k_proj")


def fake_quantize(w: torch.Tensor, quant: QuantConfig) -> torch.Tensor:
    """w [N, K] float32 rounded to the int4 layout a layer with K inputs gets, back in float32: bit for bit
    ``quantize_int4(w, g).dequantize()`` (tested), without packing the nibbles (the search calls it 20 times a
    group)."""
    n, k = w.shape
    g = quant.linear_layout(k)[1]
    x = w.reshape(n, k // g, g)
    lo = x.amin(dim=-1, keepdim=True).clamp_(max=0)
    hi = x.amax(dim=-1, keepdim=True).clamp_(min=0)
    scale = ((hi - lo) / 15).clamp_(min=1e-10)
    zero = (-lo / scale).round_().clamp_(0, 15)
    q = (x / scale).round_().add_(zero).clamp_(0, 15)
    return q.mul_(scale).add_(-zero * scale).view(n, k)


def output_error(x: torch.Tensor, dw: torch.Tensor) -> float:
    """Mean squared error x @ dw^T over the rows of x (bf16 matmul: x is bf16 already)."""
    return (x @ dw.to(x.dtype).t()).float().pow(2).mean().item()


def search_scale(w: torch.Tensor, x: torch.Tensor, x_mean: torch.Tensor, quant: QuantConfig) -> tuple[torch.Tensor,
                                                                                                       float]:
    """The per-input-channel scale of least output error, and its alpha. w [N, K] float32; x [T, K] sample rows."""
    best, best_err, best_alpha = torch.ones_like(x_mean), float("inf"), 0.0
    for i in range(N_GRID):
        alpha = i / N_GRID
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = output_error(x, w - fake_quantize(w * s, quant) / s)
        if err < best_err:
            best, best_err, best_alpha = s, err, alpha
    return best, best_alpha


def search_clip(w: torch.Tensor, x: torch.Tensor, quant: QuantConfig) -> torch.Tensor:
    """w [N, K] with each (row, group) clipped to the symmetric range of least error in that group's share of the
    outputs, x [T, K] the (bf16) rows it is measured on."""
    n, k = w.shape
    g = quant.linear_layout(k)[1]
    groups = k // g
    wg = w.view(n, groups, g)
    xg = x.view(-1, groups, g).transpose(0, 1)  # [groups, T, g]
    full = wg.abs().amax(dim=-1, keepdim=True)  # [N, groups, 1]
    best_err = torch.full((n, groups), float("inf"), device=w.device)
    best_max = full.clone()
    for i in range(CLIP_STEPS):
        m = full * (1 - i / 20)
        clipped = torch.maximum(torch.minimum(wg, m), -m)
        dw = (fake_quantize(clipped.reshape(n, k), quant).view(n, groups, g) - wg).to(x.dtype)
        err = torch.bmm(xg, dw.permute(1, 2, 0)).float().pow(2).mean(dim=1).t()  # [N, groups]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better[..., None], m, best_max)
    return torch.maximum(torch.minimum(wg, best_max), -best_max).reshape(n, k)


class AWQ:
    """The calibrator (see ``calibration.Calibrator``): searches each group's scale as its input arrives, folds it
    into ``tensors`` (Hugging Face names, float); with ``clip``, then clips the scaled weights."""

    dtype = torch.float32  # the search ranks rounding errors measured on these activations

    def __init__(self, tensors: dict[str, torch.Tensor], hf_config: Any, quant: QuantConfig, clip: bool = False,
                 seed: int = 0) -> None:
        if quant.method != "int4":
            raise ValueError(f"AWQ quantizes to int4, not {quant.describe()}")
        self.tensors, self.quant, self.clip = tensors, quant, clip
        self.groups = scale_groups(hf_config)
        self.generator = torch.Generator().manual_seed(seed)
        self.changed: set[str] = set()
        self.alphas: dict[str, float] = {}  # group module -> the alpha chosen (for inspection)
        self.found: dict[str, torch.Tensor] = {}  # group module -> its scales

    def settings(self) -> str:
        clip = f"clip={CLIP_STEPS}x{CLIP_TOKENS}" if self.clip else "no-clip"
        return f"awq int4 g{self.quant.group_size} grid={N_GRID} tokens={SEARCH_TOKENS} {clip}"

    def _sample(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        if x.shape[0] <= rows:
            return x
        return x[torch.randperm(x.shape[0], generator=self.generator)[:rows].sort().values]

    def observe(self, group: ScaleGroup, x: torch.Tensor) -> None:
        x_mean = x.abs().mean(dim=0)
        sample = self._sample(x, SEARCH_TOKENS)
        w = group_weight(self.tensors, group).to(x.device)
        s, alpha = search_scale(w, sample.bfloat16(), x_mean, self.quant)
        self.alphas[group.module] = alpha
        self.found[group.module] = s.cpu()
        self.changed.update(fold_scales(self.tensors, group, s.cpu()))
        if not self.clip:
            return
        clip_x = (self._sample(sample, CLIP_TOKENS) / s).bfloat16()
        for name in group.linears:
            if name.rsplit(".", 1)[1] not in NO_CLIP:
                w = self.tensors[f"{name}.weight"].to(x.device)
                self.tensors[f"{name}.weight"] = search_clip(w, clip_x, self.quant).cpu()

    def scales(self) -> dict[str, torch.Tensor]:
        """Each group's scales, by the module that reads the group's input. Clipping changes weights beyond them:
        its result is ``finish``'s tensors only."""
        if self.clip:
            raise ValueError("AWQ with clip=True changes weights beyond per-channel scales: use finish()")
        return dict(self.found)

    def finish(self) -> dict[str, torch.Tensor]:
        return {name: self.tensors[name].contiguous() for name in sorted(self.changed)}
