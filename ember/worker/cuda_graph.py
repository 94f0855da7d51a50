"""CUDA graphs of the decode step: the model forward for a batch of one-token sequences, captured once per batch
size bucket at start-up and replayed each decode step.

A small model's decode step on a GPU is bound by the host launching a few hundred kernels, not by the GPU: one
replay launches them all. The graph reads its inputs from static buffers (ids, positions, slots, context lengths,
block tables as wide as max_model_len needs) that each step fills with two host-to-device copies; a batch is
padded up to the next captured size with rows whose slot is -1 (nothing written) and whose context is 0 (nothing
read), which the ``triton`` attention backend guarantees. Steps that a graph does not cover run eagerly: any
prefill, LoRA, a split model (its collectives stay outside graphs), batches above the largest size.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ember.layers.attention import AttentionMetadata

logger = logging.getLogger("ember")

MAX_CAPTURED_BATCH = 512  # larger decode batches keep the GPU busy on their own: the launches no longer matter


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 32: a padded batch wastes at most a quarter of its rows, and
    a GPU's cost of a row in decode is small next to the weights it reads once for all of them."""
    top = min(max_batch, MAX_CAPTURED_BATCH)
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, min(top, 64) + 1, 8)) + list(range(96, top + 1, 32))
    if not sizes or sizes[-1] < top:
        sizes.append(top)
    return sorted(set(sizes))


Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeGraphs:
    """The captured graphs of one model and their static buffers; ``run`` replays the smallest that fits."""

    __slots__ = ("sizes", "max_blocks", "device", "inputs", "tables", "outputs", "graphs", "pool")

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device) -> None:
        self.sizes = capture_sizes(max_batch)
        self.max_blocks, self.device = max_blocks, device
        top = self.sizes[-1]
        # rows: ids, positions, slots, context lengths; one buffer so that a step's inputs are one copy
        self.inputs = torch.zeros(4, top, dtype=torch.long, device=device)
        self.inputs[2].fill_(-1)
        self.tables = torch.zeros(top, max_blocks, dtype=torch.long, device=device)
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _meta(self, n: int) -> AttentionMetadata:
        return AttentionMetadata(self.inputs[2, :n], n, self.tables[:n], self.inputs[3, :n], [])

    @torch.inference_mode()
    def capture(self, forward: Forward) -> None:
        """One graph per size, largest first, so that the smaller ones reuse its memory pool. The padding rows'
        inputs (slot -1, context 0) are what every capture runs on: the KV pool is neither read nor written."""
        for n in reversed(self.sizes):
            ids, positions, meta = self.inputs[0, :n], self.inputs[1, :n], self._meta(n)
            forward(ids, positions, meta)  # warm-up outside the graph: Triton compiles, cuBLAS picks kernels
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[n] = forward(ids, positions, meta)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[n] = graph
        torch.cuda.synchronize(self.device)

    def fits(self, num_seqs: int, width: int) -> bool:
        return num_seqs <= self.sizes[-1] and width <= self.max_blocks

    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: torch.Tensor,
            lens: list[int]) -> torch.Tensor:
        """Hidden states [len(ids), hidden] of a decode-only batch (``fits`` said yes); tables: the rows' block
        tables [len(ids), width] on the host."""
        n = len(ids)
        size = next(s for s in self.sizes if s >= n)
        pad = size - n
        host = torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad, lens + [0] * pad],
                            dtype=torch.long)
        self.inputs[:, :size].copy_(host, non_blocking=True)
        self.tables[:n, :tables.shape[1]].copy_(tables, non_blocking=True)
        self.graphs[size].replay()
        return self.outputs[size][:n]
