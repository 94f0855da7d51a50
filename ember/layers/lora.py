"""LoRA on a projection, for a batch that mixes adapters and the base model.

A projection with LoRA holds ``L`` adapter slots of rank ``R`` (max_loras x max_lora_rank): the A matrices of every
slot and every fused part stacked into one ``[S * L * R, in]`` matrix, and each part's B^T as ``[L * R, out_part]``
with the adapter's scaling folded in (a smaller rank is padded with zeros, an untargeted part is all zeros). A step
computes ``h = x A^T`` for all slots in one matmul, zeroes each row's columns of the slots it does not use (the
step's ``LoRABatch`` mask: a base-model row keeps none), and adds ``h B`` into each part's output columns. That is
the segmented matmul of punica / S-LoRA written as two dense matmuls: no loop over requests or adapters and no
per-row gather of weights, at the price of the shrink and expand running over every resident slot. A step whose
rows all use the base model passes no ``LoRABatch`` and costs nothing.
"""

from __future__ import annotations

import torch


class LoRABatch:
    """One step's (or micro-batch's) rows -> slots, as the mask ``[T, L * R]`` every LoRA projection applies."""

    __slots__ = ("mask",)

    def __init__(self, slots: torch.Tensor, max_loras: int, max_rank: int, dtype: torch.dtype) -> None:
        """slots: int64 [T], the slot of each row, -1 for the base model."""
        ids = torch.arange(max_loras, device=slots.device)
        self.mask = (slots[:, None] == ids[None, :]).to(dtype).repeat_interleave(max_rank, dim=1)

    @classmethod
    def of(cls, slots: list[int] | None, max_loras: int, max_rank: int, dtype: torch.dtype,
           device: torch.device) -> "LoRABatch | None":
        """The batch's mask, or None when no row uses an adapter."""
        if not slots or max(slots) < 0:
            return None
        return cls(torch.tensor(slots, dtype=torch.long, device=device), max_loras, max_rank, dtype)


class LoRAStack:
    """The resident adapters of one projection (one ``Linear``, its fused parts ``parts``: (offset, size) of each
    in the output)."""

    __slots__ = ("a", "b", "parts", "max_loras", "max_rank")

    def __init__(self, in_features: int, parts: list[tuple[int, int]], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        width = max_loras * max_rank
        self.parts, self.max_loras, self.max_rank = parts, max_loras, max_rank
        self.a = torch.zeros(len(parts) * width, in_features, dtype=dtype, device=device)
        self.b = [torch.zeros(width, size, dtype=dtype, device=device) for _, size in parts]

    def clear(self, slot: int) -> None:
        """Zero the slot in every part: an adapter loaded there next starts from nothing."""
        r, width = self.max_rank, self.max_loras * self.max_rank
        for part, b in enumerate(self.b):
            self.a[part * width + slot * r:part * width + (slot + 1) * r].zero_()
            b[slot * r:(slot + 1) * r].zero_()

    def set(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Write one module's A [r, in] and B [out_part, r] (this rank's slices) into the slot."""
        r, width = a.shape[0], self.max_loras * self.max_rank
        row = part * width + slot * self.max_rank
        self.a[row:row + r].copy_(a)
        self.b[part][slot * self.max_rank:slot * self.max_rank + r].copy_(b.t() * scaling)

    def apply(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        """y += the LoRA delta of each row's adapter (y: the base projection's output, written in place)."""
        h = torch.mm(x, self.a.t()).view(x.shape[0], len(self.parts), -1)
        h.mul_(batch.mask[:, None, :])
        for part, ((offset, size), b) in enumerate(zip(self.parts, self.b)):
            y[:, offset:offset + size].addmm_(h[:, part], b)
        return y
