"""A sparse Mixture-of-Experts MLP: a router picks each token's top-k experts, each expert runs once over the tokens
routed to it, and their outputs are summed with the router's weights (plus a gated shared expert: Qwen2-MoE).

The experts are ordinary gated MLPs over ember's ``Linear`` layers, so bf16, int8 and int4 weights, the kernels and
the loader are the dense model's. The computation is grouped: the (token, slot) pairs are sorted by expert once, and
each expert that received tokens multiplies its block of rows; the loop is over experts hit this step (at most
top-k for one token), never over tokens. With tensor parallelism every rank holds a slice of every expert's
intermediate size (column-split gate/up, row-split down, as a dense MLP) and one all-reduce sums the layer's
output. The arithmetic follows transformers: softmax in float32, top-k, optional renormalisation, weights cast to
the activations' dtype, experts accumulated in ascending order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed import ParallelContext
from ember.distributed.comm import all_reduce
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

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, experts [T, k]) as transformers' routers compute them."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.shape.top_k, dim=-1)
        if self.shape.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        weights, experts = self.route(x)
        k = self.shape.top_k
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, experts ascending
        counts = torch.bincount(flat, minlength=self.shape.num_experts).tolist()
        tokens, slots = order // k, order % k
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows, picked = tokens[start:start + n], slots[start:start + n]
                y = self.experts[e](x[rows]) * weights[rows, picked, None]
                out.index_add_(0, rows, y)
                start += n
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return all_reduce(out, self.parallel)
