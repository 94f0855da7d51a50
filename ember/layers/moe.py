"""A sparse Mixture-of-Experts MLP: a router picks each token's top-k experts, each expert runs once over the tokens
routed to it, and their outputs are summed with the router's weights (plus a gated shared expert: Qwen2-MoE).

The experts are ordinary gated MLPs over ember's ``Linear`` layers, so bf16, int8 and int4 weights, the kernels and the
loader are the dense model's. The computation is grouped: the (token, slot) pairs are sorted by expert once. Float
experts on a CPU with ember's AVX512-BF16 kernels are then stacked at load time and each projection is one
``grouped_dense_gemm`` call over every expert hit (a decode token's k experts in one parallel region: per-expert calls
cost about 0.5 ms an expert a layer, more than their weights take to read); elsewhere (quantized experts, other CPUs,
CUDA) each expert that received tokens multiplies its block of rows through its own ``Linear``. Either way the loop is
never over tokens, and in a batch-invariant engine a row's result is the same bits on both paths (with
``batch_invariant=False`` the grouped kernel still runs: its decode is what the per-expert oneDNN calls lose). With
tensor parallelism every rank holds a slice of every expert's intermediate size (column-split gate/up, row-split down,
as a dense MLP) and one all-reduce sums the layer's output. The router follows transformers: softmax in float32, top-k,
optional renormalisation, weights cast to the activations' dtype. Each token's k expert outputs are weighted and summed
in slot order by one ``sum`` (float accumulation, one rounding in bf16), so a token's result does not depend on the
tokens beside it; transformers adds them expert by expert instead, which in float32 reorders at most k additions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed import ParallelContext
from ember.distributed.comm import all_reduce
from ember.kernels import cpu_kernels
from ember.layers.base import Layer
from ember.layers.linear import Linear, MergedLinear
from ember.quantization import QuantConfig

Activation = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class MoEShape:
    """What a config says of its experts (each family's file reads its own field names into this)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's, whole (a rank holds intermediate_size / tp_size)
    normalize_top_k: bool  # renormalise the k weights to sum to 1 (Mixtral always; Qwen / OLMoE: norm_topk_prob)
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)

    def check(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts={self.num_experts}, num_experts_per_tok={self.top_k}: a MoE config needs "
                             "at least one expert and 1 <= num_experts_per_tok <= num_experts")


class ExpertMLP(Layer):
    """One expert (or the shared expert): act(gate) * up, then down; its output is this rank's partial sum."""

    def __init__(self, hidden: int, inter: int, act: Activation, dtype: torch.dtype, quant: QuantConfig | None,
                 full_inter: int) -> None:
        super().__init__()
        self.act = act
        self.gate_up_proj = MergedLinear(hidden, {"gate": inter, "up": inter}, False, dtype, quant)
        self.down_proj = Linear(inter, hidden, False, dtype, quant, layout_features=full_inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoE(Layer):
    def __init__(self, hidden: int, shape: MoEShape, act: Activation, dtype: torch.dtype,
                 quant: QuantConfig | None, parallel: ParallelContext) -> None:
        super().__init__()
        shape.check()
        t = parallel.tp_size
        for name, size in (("moe_intermediate_size", shape.intermediate_size),
                           ("shared_expert_intermediate_size", shape.shared_intermediate_size)):
            if size % t:
                raise ValueError(f"{name}={size} does not split over tensor_parallel_size={t}: choose a size that "
                                 "divides it")
        self.shape, self.parallel = shape, parallel
        self.gate = Linear(hidden, shape.num_experts, False, dtype)  # the router stays in float: it picks experts
        inter = shape.intermediate_size // t
        self.experts = nn.ModuleList(ExpertMLP(hidden, inter, act, dtype, quant, shape.intermediate_size)
                                     for _ in range(shape.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if shape.shared_intermediate_size:
            self.shared_expert = ExpertMLP(hidden, shape.shared_intermediate_size // t, act, dtype, quant,
                                           shape.shared_intermediate_size)
            self.shared_expert_gate = Linear(hidden, 1, False, dtype)
        self.grouped = None  # the kernel module running the stacked experts (``finalize``), or None: one call each
        self.w_gate_up: torch.Tensor | None = None  # [E, 2I, H]: expert e's gate_up_proj weight is a view of row e
        self.w_down: torch.Tensor | None = None  # [E, H, I]

    def finalize(self, device: torch.device, prepack: bool, batch_invariant: bool = True,
                 int8_activations: bool = False) -> None:
        """Runs before the experts' own (``model.modules()`` visits a module before its children): float experts
        on a CPU whose kernels have AVX512-BF16 are stacked for ``grouped_dense_gemm``, each expert's ``Linear``
        keeping a view of its slice (no second copy, and no oneDNN-packed one: the grouped path runs them)."""
        first = self.experts[0]
        if device.type != "cpu" or first.gate_up_proj.weight is None:
            return
        if first.gate_up_proj.weight.dtype not in (torch.float32, torch.bfloat16):
            return
        kernels = cpu_kernels()
        if kernels is None or not kernels.has_avx512_bf16():
            return
        self.grouped = kernels
        self.w_gate_up = torch.stack([e.gate_up_proj.weight.data for e in self.experts])
        self.w_down = torch.stack([e.down_proj.weight.data for e in self.experts])
        for i, expert in enumerate(self.experts):
            expert.gate_up_proj.weight.data = self.w_gate_up[i]
            expert.down_proj.weight.data = self.w_down[i]
            expert.gate_up_proj.run_by_owner = expert.down_proj.run_by_owner = True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, experts [T, k]) as transformers' routers compute them."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.shape.top_k, dim=-1)
        if self.shape.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        weights, experts = self.route(x)
        t, k = experts.shape
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert, experts ascending
        counts = torch.bincount(flat, minlength=self.shape.num_experts)
        rows = x.index_select(0, order // k)  # each pair's token, in that order
        y = self._grouped(rows, counts) if self.grouped is not None else self._each(rows, counts)
        # back to (token, slot) order: each token's k outputs weighted and summed in one order whatever the batch
        pairs = torch.empty_like(y).index_copy_(0, order, y).view(t, k, y.shape[-1])
        out = (pairs * weights.unsqueeze(-1)).sum(1)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return all_reduce(out, self.parallel)

    def _grouped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Every expert hit in two kernel calls over the stacked weights."""
        offsets = F.pad(torch.cumsum(counts, 0), (1, 0))
        h = self.experts[0].act(self.grouped.grouped_dense_gemm(rows, self.w_gate_up, offsets))
        return self.grouped.grouped_dense_gemm(h, self.w_down, offsets)

    def _each(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """One call an expert hit (quantized experts, CUDA, CPUs without the AVX512-BF16 kernels)."""
        y = rows.new_empty(rows.shape)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                y[start:start + n] = self.experts[e](rows[start:start + n])
                start += n
        return y
