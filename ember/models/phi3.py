"""Phi-3, Phi-3.5 and Phi-4-mini: the Llama family's layers with the checkpoint's projections fused.

The checkpoint stores ``self_attn.qkv_proj`` (q, k, v rows stacked) and ``mlp.gate_up_proj`` (gate, up); they are
cut into the Llama names here, so the split over ranks, quantization and LoRA stay the Llama family's. What else
differs is RoPE (LongRoPE's short and long factors, partial rotary: ``layers.rotary``) and a sliding window on every
layer when the config sets one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from ember.distributed import WeightSlice
from ember.models.llama import LlamaForCausalLM
from ember.quantization import QuantizedTensor

Tensor = torch.Tensor | QuantizedTensor


def _rows(t: Tensor, start: int, stop: int) -> Tensor:
    return t.rows(torch.arange(start, stop)) if isinstance(t, QuantizedTensor) else t[start:stop]


class Phi3ForCausalLM(LlamaForCausalLM):
    def _parts(self, name: str) -> list[tuple[str, int, int]] | None:
        """The Llama names a fused checkpoint tensor holds, with their row ranges; None when it is not fused."""
        d, inter = self.shape.head_dim, self.config.intermediate_size
        q, kv = self.shape.num_heads * d, self.shape.num_kv_heads * d
        if ".self_attn.qkv_proj." in name:
            base = name.replace("qkv_proj", "{}")
            return [(base.format("q_proj"), 0, q), (base.format("k_proj"), q, q + kv),
                    (base.format("v_proj"), q + kv, q + 2 * kv)]
        if ".mlp.gate_up_proj." in name:
            base = name.replace("gate_up_proj", "{}")
            return [(base.format("gate_proj"), 0, inter), (base.format("up_proj"), inter, 2 * inter)]
        return None

    def weight_slice(self, name: str) -> WeightSlice | None:
        """A fused tensor is read whole (a rank's rows of q, k and v are not one range) and cut in load_weights."""
        parts = self._parts(name)
        if parts is None:
            return super().weight_slice(name)
        return None if super().weight_slice(parts[0][0]) is None else WeightSlice()

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        super().load_weights(self._unfused(weights))

    def _unfused(self, weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in weights:
            parts = self._parts(name)
            if parts is None:
                yield name, tensor
                continue
            for part, start, stop in parts:
                sl = super().weight_slice(part)  # this rank's rows of the part, as the reader would cut them
                if sl is not None and not sl.whole and sl.dim == 0:
                    start, stop = start + sl.start, start + sl.stop
                yield part, _rows(tensor, start, stop)
