"""Token embedding and LM head; a tied head reuses the embedding's weight (float, or the same quantized table).

Both are vocabulary-parallel under tensor parallelism: TP rank r holds rows [r * chunk, (r + 1) * chunk) of the
table, chunk = ceil(vocab / T) (the last rank's missing rows are zeros). A lookup zeroes the ids other ranks hold
and all-reduces (exact: one rank contributes each row); the head's logits are gathered on TP rank 0 only, where
sampling happens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed import ParallelContext
from ember.distributed.comm import all_reduce, gather_last_dim
from ember.layers.base import Layer
from ember.layers.linear import PrepackedWeight, dense_kernels, linear, load_float
from ember.quantization import QuantizedMatmul, QuantizedTensor, concat_rows, cpu_holds_int6, requantize


def vocab_range(vocab_size: int, parallel: ParallelContext) -> tuple[int, int]:
    """Rows [start, stop) of the table this TP rank holds (stop - start may fall short of the chunk on the last)."""
    chunk = -(-vocab_size // parallel.tp_size)
    start = min(parallel.tp_rank * chunk, vocab_size)
    return start, min(start + chunk, vocab_size)


class VocabEmbedding(Layer):
    """quantized: the table is int8 with one scale per row, or, in the layout the file stores (``as_stored``: a GGUF's
    mixed layout) where it comes in Q6_K blocks and the CPU kernel takes them, int6 (``table6``: the LM head's
    matmul, whose pack a lookup reads its rows from); a lookup dequantizes only the rows it gathers."""

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, quantized: bool = False,
                 parallel: ParallelContext = ParallelContext(), as_stored: bool = False) -> None:
        super().__init__()
        self.as_stored = as_stored
        self.dtype, self.dim, self.quantized, self.vocab_size = dtype, dim, quantized, vocab_size
        self.parallel = parallel
        self.chunk = -(-vocab_size // parallel.tp_size)
        self.start, self.stop = vocab_range(vocab_size, parallel)
        self.weight = None if quantized else nn.Parameter(torch.zeros(self.chunk, dim, dtype=dtype),
                                                          requires_grad=False)
        self.qt: QuantizedTensor | None = None
        self.table6: QuantizedMatmul | None = None  # the int6 table (finalize), in place of qt

    def load_weight(self, value: torch.Tensor | QuantizedTensor, name: str = "weight") -> None:
        rows = self.stop - self.start
        if value.shape[0] != rows:
            raise ValueError(f"{name}: expected {rows} rows (vocabulary {self.start}..{self.stop}), got shape "
                             f"{tuple(value.shape)}")
        if self.quantized:
            if value.shape[1] != self.dim:
                raise ValueError(f"{name}: expected {self.dim} columns, got shape {tuple(value.shape)}")
            if self.as_stored and isinstance(value, QuantizedTensor) and value.kind == "int6" and rows == self.chunk:
                self.qt = value  # int6 or int8 when the device is known (finalize)
                return
            qt = requantize(value, "int8", self.dim)
            if rows < self.chunk:  # zero rows pad the last rank's slice to the chunk
                pad = self.chunk - rows
                qt = concat_rows([qt, QuantizedTensor("int8", torch.zeros(pad, self.dim, dtype=torch.int8),
                                                      torch.zeros(pad, 1), None, self.dim)])
            self.qt = qt
        else:
            load_float(self.weight.data[:rows], value, name)

    def finalize(self, device: torch.device, prepack: bool, batch_invariant: bool = True,
                 int8_activations: bool = False) -> None:
        if self.qt is not None and self.qt.kind == "int6":
            if device.type == "cpu" and cpu_holds_int6(*self.qt.shape):
                self.table6, self.qt = QuantizedMatmul("int6", self.qt, batch_invariant=batch_invariant), None
                return
            self.qt = requantize(self.qt, "int8", self.dim)
        if self.qt is not None:
            self.qt = self.qt.to(device)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table6 is not None:
            return self.table6.rows(ids).to(self.dtype)
        if self.qt is not None:
            return F.embedding(ids, self.qt.data).to(self.dtype) * F.embedding(ids, self.qt.scales).to(self.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return self.lookup(ids)
        mine = (ids >= self.start) & (ids < self.stop)
        x = self.lookup((ids - self.start).clamp(0, self.chunk - 1)) * mine[:, None].to(self.dtype)
        return all_reduce(x, self.parallel)


class LMHead(VocabEmbedding):
    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, tied_to: VocabEmbedding | None = None,
                 quantized: bool = False, parallel: ParallelContext = ParallelContext(), as_stored: bool = False
                 ) -> None:
        super().__init__(vocab_size if tied_to is None else 0, dim, dtype, quantized and tied_to is None, parallel,
                         as_stored)
        self.vocab_size = vocab_size
        self.__dict__["tied_to"] = tied_to  # a reference, not a submodule: the embedding is registered once
        if tied_to is not None:
            self.weight = tied_to.weight
        self.prepacked: PrepackedWeight | None = None
        self.dense = None  # as ``Linear.dense``: ember's fixed-order dense GEMM for a float table
        self.qmm: QuantizedMatmul | None = None

    def finalize(self, device: torch.device, prepack: bool, batch_invariant: bool = True,
                 int8_activations: bool = False) -> None:
        """Runs after the embedding's own finalize (it is registered first)."""
        super().finalize(device, prepack, batch_invariant, int8_activations)
        owner = self.tied_to if self.tied_to is not None else self
        if owner.table6 is not None:  # the int6 table's matmul itself (the embedding's when tied)
            self.qmm = owner.table6
            return
        if owner.qt is not None:
            # shares the int8 table with the embedding when tied
            self.qmm = QuantizedMatmul("int8", owner.qt, batch_invariant=batch_invariant,
                                       int8_activations=int8_activations)
            return
        self.dense = dense_kernels(device, self.weight.dtype, batch_invariant)
        if prepack and self.dense is None:
            self.prepacked = PrepackedWeight(self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits in float32 (the sampler and logprobs need the precision whatever the model dtype), written so by
        ember's kernels where they run (bf16 logits step by 0.125 at |logit| ~ 20: near ties that greedy decoding
        breaks by token id); under tensor parallelism the whole vocabulary on TP rank 0 and None on the others."""
        if self.qmm is not None:
            logits = self.qmm.logits(hidden)
        elif self.dense is not None and hidden.dim() == 2 and hidden.dtype == self.weight.dtype:
            logits = self.dense.dense_gemm(hidden, self.weight, True)  # float32 sums, not rounded to bf16
        else:
            logits = linear(hidden, self.weight, None, self.prepacked, self.dense).float()
        if self.parallel.tp_size == 1:
            return logits
        full = gather_last_dim(logits, self.parallel)
        return None if full is None else full[:, :self.vocab_size]
