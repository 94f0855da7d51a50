"""What calibration-based quantization (AWQ, SmoothQuant) shares: the calibration text and its token windows, the
groups of linear layers that read one input, the exact rescaling of such a group, and the capture of each group's
input while a float model runs the calibration tokens.

Why a rescaling is free: a group's linears all read x, written by one op (an RMSNorm, or the previous linear). For
any positive per-channel s, ``prev`` writing x / s and every linear using W * s (column j times s_j) computes the
same float function, ``(x / s) @ (W * s)^T = x @ W^T``, but changes which weights are large, and so what rounding
them costs. Both algorithms pick s from activation statistics and then quantize as ever.

This module knows the Llama family's names (Hugging Face tensor names, and the fused modules of ember's model whose
input is hooked) and nothing of the model's code: the caller builds the float model and runs it
(``ember.model_loader``), so this layer stays below the models.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

DEFAULT_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "calibration.txt")
NUM_SEQUENCES = 16  # windows of calibration text, run as one batch
SEQUENCE_LENGTH = 256  # tokens a window: 4,096 tokens in all keep calibration under ~20 s for 135M on 2 cores
MIN_TOKENS = 64  # fewer tokens than this give no usable statistics

GROUP_KINDS = ("qkv", "o", "gate_up", "down")


def read_calibration_text(path: str | None) -> str:
    """The calibration text: the file at path (UTF-8), or the shipped one (the US Constitution, public domain) for
    None. A missing, unreadable or empty file raises ValueError naming calibration_data."""
    file = DEFAULT_TEXT if path is None else os.path.expanduser(str(path))
    if not os.path.isfile(file):
        raise ValueError(f"calibration_data={path!r} does not exist: pass a UTF-8 text file, or None for the shipped "
                         "calibration text")
    try:
        with open(file, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"calibration_data={path!r} cannot be read as UTF-8 text: {e}") from e
    if not text.strip():
        raise ValueError(f"calibration_data={path!r} is empty: it must hold text (a few thousand tokens of it)")
    return text


def text_key(text: str) -> str:
    """A short hash of the calibration text: part of the key of cached calibrated weights."""
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def calibration_sequences(ids: list[int], num: int = NUM_SEQUENCES, length: int = SEQUENCE_LENGTH,
                          source: str | None = None) -> list[list[int]]:
    """Up to num windows of length tokens, not overlapping, spread evenly over the text (a short text gives fewer
    windows, or one shorter window). source: calibration_data as given, for the error message."""
    if len(ids) < MIN_TOKENS:
        raise ValueError(f"calibration_data={source!r} holds {len(ids)} tokens: calibration needs at least "
                         f"{MIN_TOKENS} (a few thousand are better)")
    if len(ids) <= length:
        return [list(ids)]
    count = min(num, len(ids) // length)
    stride = (len(ids) - length) / max(count - 1, 1)
    return [list(ids[round(i * stride):round(i * stride) + length]) for i in range(count)]


@dataclass(frozen=True, slots=True)
class ScaleGroup:
    """Linear layers that read one input, and the op that writes it; a per-channel s folded into both leaves the
    float model unchanged (see the module docstring). Names are Hugging Face tensor names without ``.weight``."""

    kind: str  # "qkv", "o", "gate_up" or "down"
    layer: int
    module: str  # the module of ember's model that takes this input (hooked during calibration)
    prev: str  # what writes the input: an RMSNorm, or a linear whose output rows are scaled
    linears: tuple[str, ...]

    @property
    def prev_is_norm(self) -> bool:
        return self.prev.endswith("layernorm")


def scale_groups(hf_config: Any, kinds: tuple[str, ...] = GROUP_KINDS) -> list[ScaleGroup]:
    """The groups of every decoder layer, in the order a forward pass meets them. "o" (v_proj -> o_proj) only with
    as many KV heads as query heads: under GQA an o_proj column is fed by a KV head that several query heads share,
    so v_proj's rows cannot take one scale per column (the reference implementations skip it too)."""
    heads = hf_config.num_attention_heads
    mha = (getattr(hf_config, "num_key_value_heads", None) or heads) == heads
    out = []
    for i in range(hf_config.num_hidden_layers):
        p = f"model.layers.{i}"
        table = {
            "qkv": ScaleGroup("qkv", i, f"{p}.self_attn.qkv_proj", f"{p}.input_layernorm",
                              (f"{p}.self_attn.q_proj", f"{p}.self_attn.k_proj", f"{p}.self_attn.v_proj")),
            "o": ScaleGroup("o", i, f"{p}.self_attn.o_proj", f"{p}.self_attn.v_proj", (f"{p}.self_attn.o_proj",)),
            "gate_up": ScaleGroup("gate_up", i, f"{p}.mlp.gate_up_proj", f"{p}.post_attention_layernorm",
                                  (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj")),
            "down": ScaleGroup("down", i, f"{p}.mlp.down_proj", f"{p}.mlp.up_proj", (f"{p}.mlp.down_proj",)),
        }
        out += [table[k] for k in GROUP_KINDS if k in kinds and (k != "o" or mha)]
    return out


def group_weight(tensors: dict[str, torch.Tensor], group: ScaleGroup) -> torch.Tensor:
    """The group's weights stacked by rows, float32 [sum of outputs, inputs]: they share the input's columns."""
    return torch.cat([tensors[f"{name}.weight"].float() for name in group.linears])


def fold_scales(tensors: dict[str, torch.Tensor], group: ScaleGroup, s: torch.Tensor) -> list[str]:
    """Scale the group's input channels by 1 / s where they are written (norm weight, or the previous linear's
    output rows and bias) and its linears' columns by s: the same float function. Replaces the entries of tensors
    (float32) and returns the names it changed."""
    plan = ScalePlan.of_groups([(group, s)])
    changed = [name for name in sorted(plan.names) if name in tensors]
    for name in changed:
        tensors[name] = plan.apply(name, tensors[name].float())
    return changed


@dataclass(frozen=True, slots=True)
class ScalePlan:
    """Where a calibration's scales go (``fold_scales`` one tensor at a time, so a checkpoint's tensors can stream
    through it): weight name -> the scales of its input columns; norm weight, or linear weight / bias -> the scales
    of its outputs (divided). A tensor can take both (up_proj: gate_up's columns, down's rows)."""

    columns: dict[str, list[torch.Tensor]]
    writers: dict[str, list[torch.Tensor]]

    @classmethod
    def of(cls, hf_config: Any, scales: dict[str, torch.Tensor]) -> "ScalePlan":
        """scales: group module -> s, as a calibrator's ``scales()`` gives them."""
        return cls.of_groups((g, scales[g.module]) for g in scale_groups(hf_config) if g.module in scales)

    @classmethod
    def of_groups(cls, pairs: Iterable[tuple[ScaleGroup, torch.Tensor]]) -> "ScalePlan":
        columns: dict[str, list[torch.Tensor]] = {}
        writers: dict[str, list[torch.Tensor]] = {}
        for group, s in pairs:
            for name in group.linears:
                columns.setdefault(f"{name}.weight", []).append(s.float())
            writers.setdefault(f"{group.prev}.weight", []).append(s.float())
            if not group.prev_is_norm:
                writers.setdefault(f"{group.prev}.bias", []).append(s.float())
        return cls(columns, writers)

    @property
    def names(self) -> set[str]:
        return set(self.columns) | set(self.writers)

    def apply(self, name: str, t: torch.Tensor, cut: Any = None) -> torch.Tensor:
        """t (float) with its scales folded in. cut: the WeightSlice t is of (a tensor-parallel rank's part), so s
        is cut to match; None for the whole tensor."""
        for s in self.columns.get(name, ()):  # a column-sliced (row-parallel) weight takes its columns' scales
            t = t * (s if cut is None or cut.dim != 1 else s[cut.start:cut.stop])[None, :]
        for s in self.writers.get(name, ()):  # a norm's or a bias's values, a weight's rows
            s = s if cut is None or cut.dim != 0 else s[cut.start:cut.stop]
            t = t / (s if t.dim() == 1 else s[:, None])
        return t


def apply_scales(tensors: Iterable[tuple[str, Any]], plan: ScalePlan, select: Callable[[str], Any] | None = None
                 ) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensor stream with the plan's scales folded in. Tensors it does not touch pass through as they
    come (quantized blocks kept); touched ones come as float32 (a QuantizedTensor dequantized first). select: the
    slice of each tensor the stream holds, None for whole tensors."""
    from ember.quantization.tensor import QuantizedTensor

    for name, t in tensors:
        if name not in plan.columns and name not in plan.writers:
            yield name, t
            continue
        t = t.dequantize(torch.float32) if isinstance(t, QuantizedTensor) else t.float()
        yield name, plan.apply(name, t, select(name) if select is not None else None)


class Calibrator(Protocol):
    """One algorithm's side of calibration: the groups whose input it needs, what it does with each input (the
    calibration batch in one piece, [tokens, channels]), and at the end the per-channel scale of each group
    (``scales``: what loading folds into the checkpoint, see ``apply_scales``) or the float tensors it changed
    (``finish``). ``dtype``: the float model it observes (SmoothQuant needs only each channel's max, and bf16
    halves its calibration on CPU, Qwen2.5-Coder-0.5B 33 -> 17 s on 2 threads; AWQ's search compares rounding errors
    in float32)."""

    groups: list[ScaleGroup]
    dtype: torch.dtype

    def observe(self, group: ScaleGroup, x: torch.Tensor) -> None: ...

    def scales(self) -> dict[str, torch.Tensor]: ...

    def finish(self) -> dict[str, torch.Tensor]: ...

    def settings(self) -> str: ...


def capture(model: nn.Module, calibrator: Calibrator, run: Callable[[], None]) -> None:
    """Run the float model once (``run``) with a hook on each group's module that hands its input to the
    calibrator. Inputs are handed over as the forward pass makes them, so only one layer's activations are alive at
    a time."""
    modules = dict(model.named_modules())
    missing = [g.module for g in calibrator.groups if g.module not in modules]
    if missing:
        raise ValueError(f"calibration: the model has no modules {missing[:3]}: not a Llama-family model")
    handles = []
    for group in calibrator.groups:
        def hook(module: nn.Module, args: tuple, group: ScaleGroup = group) -> None:
            x = args[0]
            calibrator.observe(group, x.reshape(-1, x.shape[-1]).float())
        handles.append(modules[group.module].register_forward_pre_hook(hook))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
