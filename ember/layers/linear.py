"""Linear layers. Fused projections (QKV, gate/up) load their checkpoint parts into row slices of one weight, so a
decoder layer does two matmuls for attention input and MLP input instead of five.

A layer built with a QuantConfig holds no float weight: each loaded part (a float tensor, or a QuantizedTensor from
GGUF blocks or an .asparam file) is brought to the layer's layout as it arrives, and ``finalize`` lays the whole
weight out for the device's kernel (``ember.quantization.kernels``).

Float weights on CPU run oneDNN's pre-packed linear (or F.linear), except in a batch-invariant engine on an
AVX512-BF16 CPU: there oneDNN rounds a row differently with the rows beside it, and ember's fixed-order
``dense_gemm`` (``ember/kernels/dense_gemm.cpp``) takes float32 and bf16 weights instead (``dense_kernels``).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from ember import envs
from ember.distributed import ParallelContext
from ember.distributed.comm import all_reduce
from ember.dtypes import cpu_has_fast_bf16
from ember.kernels import cpu_kernels
from ember.layers.base import Layer
from ember.layers.lora import LoRABatch, LoRAStack
from ember.quantization import (QuantConfig, QuantizedMatmul, QuantizedTensor, StackedMatmul, concat_rows,
                                cpu_holds_int5, cpu_holds_int6, requantize)


def mkldnn_prepack_available(dtype: torch.dtype = torch.float32) -> bool:
    """oneDNN can pre-pack linear weights of this dtype on CPU: about 2x faster matmuls for decode-sized batches,
    fp32 everywhere, bf16 where the CPU has the instructions oneDNN's bf16 path needs (AVX512-BW/VL/DQ or
    AVX-NE-CONVERT; elsewhere it refuses the weight). EMBER_MKLDNN_LINEAR=0 turns it off."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    if dtype == torch.bfloat16 and not cpu_has_fast_bf16():
        return False
    return (envs.mkldnn_linear_enabled() and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PrepackedWeight:
    """A CPU weight re-laid out by oneDNN once at load time; the original stays for loading and inspection. Pickled
    as the original (oneDNN's layout is opaque to torch.save), packed again when unpickled."""

    __slots__ = ("packed", "weight")

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())

    def __reduce__(self) -> tuple:
        return PrepackedWeight, (self.weight,)


def dense_kernels(device: torch.device, dtype: torch.dtype, batch_invariant: bool):
    """The CPU kernel module whose ``dense_gemm`` a float layer runs, or None for oneDNN / F.linear.

    Only for batch-invariant layers on a CPU whose kernels were built with AVX512-BF16, float32 or bf16 weights:
    oneDNN's linear (and F.linear) round a row differently with the rows beside it there (an Intel Xeon with
    AVX512-BF16 / AMX, weight 576 x 1536), while on AVX2 CPUs oneDNN's fp32 rows are equal to the bit at the models'
    shapes (measured) and oneDNN stays. fp16 weights keep F.linear everywhere."""
    if not batch_invariant or device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    kernels = cpu_kernels()
    return kernels if kernels is not None and kernels.has_avx512_bf16() else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           prepacked: PrepackedWeight | None, dense=None) -> torch.Tensor:
    """x W^T (+ b): ember's fixed-order ``dense_gemm`` where ``dense`` (a kernel module from ``dense_kernels``) is
    given, bias added after; else oneDNN's packed weight; else F.linear."""
    if dense is not None:
        if x.dim() == 2 and x.dtype == weight.dtype:
            y = dense.dense_gemm(x, weight)
        else:
            y = dense.dense_gemm(x.reshape(-1, x.shape[-1]).to(weight.dtype), weight)
            y = y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    if prepacked is not None and x.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x, prepacked.packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def load_float(target: torch.Tensor, value: torch.Tensor | QuantizedTensor, name: str) -> None:
    """Copy value (dequantized if it is quantized) into target, shapes checked."""
    if isinstance(value, QuantizedTensor):
        value = value.dequantize(target.dtype)
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"{name}: expected shape {tuple(target.shape)}, got {tuple(value.shape)}")
    target.copy_(value)


class Linear(Layer):
    """y = x W^T (+ b). Weights are allocated empty: the loader fills every element or fails."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 quant: QuantConfig | None = None, layout_features: int | None = None) -> None:
        """layout_features: the input size the int4 layout is chosen for (a row-parallel slice takes the whole
        layer's, so its groups are the ones a single rank would use)."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quant = quant
        self.kind, self.group_size = ("", 0) if quant is None else quant.linear_layout(layout_features or in_features)
        if self.kind == "int8":  # one scale a row of what this rank holds (a stored scale stays as it is)
            self.group_size = in_features
        # mixed: each part int4 / int5 if it comes so in groups of this size, int6 as it comes (GGUF Q6_K), else int8;
        # a fused layer of more than one kind holds each run of rows in its own (kind "int4+int8", a ``StackedMatmul``)
        self.mixed = quant is not None and quant.mixed
        if self.kind == "int4" and in_features % self.group_size:
            raise ValueError(f"int4 groups of {self.group_size} do not divide this rank's {in_features} inputs of "
                             f"a {layout_features}-input layer: choose a tensor_parallel_size whose slices hold "
                             "whole groups")
        self.weight = None if quant is not None else nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                                                  requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.prepacked: PrepackedWeight | None = None
        self.dense = None  # the kernel module whose dense_gemm runs the float weight (``dense_kernels``)
        self.qmm: QuantizedMatmul | StackedMatmul | None = None
        self.lora: LoRAStack | None = None  # resident adapters (``enable_lora``); None: no LoRA on this projection
        self._parts: list[tuple[int, QuantizedTensor]] = []  # quantized row blocks as loaded, until finalize
        self.run_by_owner = False  # set by a layer that runs this weight itself (the grouped MoE): no packed copy

    def load_weight(self, value: torch.Tensor | QuantizedTensor, offset: int = 0, name: str = "weight") -> None:
        rows, cols = tuple(value.shape)
        if cols != self.in_features or offset + rows > self.out_features:
            raise ValueError(f"{name}: expected {self.in_features} columns and at most {self.out_features - offset} "
                             f"rows, got shape {(rows, cols)}")
        if self.quant is None:
            load_float(self.weight.data[offset:offset + rows], value, name)
        elif self.mixed:  # 4- and 5-bit blocks of this group and 6-bit ones as they are, anything else int8 per row
            kept = isinstance(value, QuantizedTensor) and (value.kind == "int6" or (
                value.kind in ("int4", "int5") and value.group_size == self.group_size))
            self._parts.append((offset, value if kept else requantize(value, "int8", self.in_features)))
        else:
            self._parts.append((offset, requantize(value, self.kind, self.group_size)))

    def finalize(self, device: torch.device, prepack: bool, batch_invariant: bool = True,
                 int8_activations: bool = False) -> None:
        """After loading: lay the weight out for the device (quantized kernel; a float weight: ember's fixed-order
        dense GEMM where ``dense_kernels`` gives it, else oneDNN's packed float)."""
        if self.quant is not None:
            parts = [p for _, p in sorted(self._parts, key=lambda p: p[0])]
            self._parts = []
            if self.mixed:  # runs of parts of one kind (load_weight made each int4 / int5 / int6 or int8)
                # a 5- or 6-bit part where the CPU kernel does not take it: int8 per row, as other blocks
                parts = [p if self._held_as_loaded(p, device) else requantize(p, "int8", self.in_features)
                         for p in parts]
                mms = [QuantizedMatmul(kind, concat_rows(list(run)).to(device), batch_invariant=batch_invariant,
                                       int8_activations=int8_activations)
                       for kind, run in itertools.groupby(parts, key=lambda p: p.kind)]
                self.qmm = mms[0] if len(mms) == 1 else StackedMatmul(mms)
                self.kind = self.qmm.method
                if self.kind == "int8":
                    self.group_size = self.in_features
                return
            qt = concat_rows(parts).to(device)
            self.qmm = QuantizedMatmul(self.quant.method, qt, batch_invariant=batch_invariant,
                                       int8_activations=int8_activations)
            return
        self.dense = dense_kernels(device, self.weight.dtype, batch_invariant)
        if prepack and self.dense is None and not self.run_by_owner:
            self.prepacked = PrepackedWeight(self.weight)

    @staticmethod
    def _held_as_loaded(part: QuantizedTensor, device: torch.device) -> bool:
        """Whether a mixed layer's part runs in the kind it loaded in on this device (int4 and int8 everywhere)."""
        if part.kind == "int5":
            return device.type == "cpu" and cpu_holds_int5(*part.shape, part.group_size)
        if part.kind == "int6":
            return device.type == "cpu" and cpu_holds_int6(*part.shape)
        return True

    @property
    def lora_parts(self) -> list[tuple[int, int]]:
        """(offset, size) in the output of each part an adapter module maps to: the whole output here."""
        return [(0, self.out_features)]

    def enable_lora(self, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.lora = LoRAStack(self.in_features, self.lora_parts, max_loras, max_rank, dtype, device)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        if self.qmm is not None:
            y = self.qmm(x)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = linear(x, self.weight, self.bias, self.prepacked, self.dense)
        return y if lora is None or self.lora is None else self.lora.apply(x, y, lora)


def row_parallel_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                        quant: QuantConfig | None, parallel: ParallelContext, full_in_features: int) -> Linear:
    """A row-parallel layer, or a plain ``Linear`` on one rank (no extra call in its forward)."""
    if parallel.tp_size == 1:
        return Linear(in_features, out_features, bias, dtype, quant)
    return RowParallelLinear(in_features, out_features, bias, dtype, quant, parallel, full_in_features)


class RowParallelLinear(Linear):
    """The input dim split over the stage's TP ranks: each multiplies its slice of x by its columns of W, the
    partial products are all-reduced, then the bias is added once. Column-parallel layers need no class of their
    own: a rank's ``Linear`` / ``MergedLinear`` simply holds its rows (the loader hands it only those)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 quant: QuantConfig | None, parallel: ParallelContext, full_in_features: int) -> None:
        super().__init__(in_features, out_features, bias, dtype, quant, layout_features=full_in_features)
        self.parallel = parallel

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        y = self.qmm(x) if self.qmm is not None else linear(x, self.weight, None, self.prepacked, self.dense)
        if lora is not None and self.lora is not None:  # x holds this rank's inputs, A its columns: a partial sum
            y = self.lora.apply(x, y, lora)
        y = all_reduce(y, self.parallel)
        return y if self.bias is None else y + self.bias


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim; ``shard_sizes`` names each part."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool, dtype: torch.dtype,
                 quant: QuantConfig | None = None) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias, dtype, quant)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    @property
    def lora_parts(self) -> list[tuple[int, int]]:
        return list(self.shard_offsets.values())  # one adapter module a shard (q / k / v, gate / up)

    def load_shard(self, shard: str, param_name: str, tensor: torch.Tensor | QuantizedTensor) -> None:
        offset, size = self.shard_offsets[shard]
        if tensor.shape[0] != size:
            raise ValueError(f"{param_name} of shard {shard}: expected {size} rows, got shape {tuple(tensor.shape)}")
        if param_name == "weight":
            self.load_weight(tensor, offset, f"weight of shard {shard}")
        else:
            load_float(self.bias.data[offset:offset + size], tensor, f"bias of shard {shard}")
