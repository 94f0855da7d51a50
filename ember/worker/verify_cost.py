"""What verifying a draft costs on this machine: a batch-1 step whose row carries k drafted tokens (1 + k tokens
over the paged cache, every position's logits) against a plain decode step, timed at start-up. The speculator sizes
drafts by it (``core.speculator.best_k``). The cost is not linear in k and differs between CPUs: the quantized
matmuls are memory-bound for a few rows and compute-bound past them, in passes of several rows (SmolLM2-135M at
k = 8: 1.23-1.31 decode steps on a 2-core Xeon with AMX, 1.7-1.8 on a 2-core AMD Zen 5 without). The step is
timed to its greedy token (logits and argmax): sampling with top-k / top-p adds a little a row, more with a large
vocabulary, and is not counted."""

from __future__ import annotations

import statistics
import time

import torch

from ember.layers.attention import AttentionMetadata, PrefillSpan
from ember.layers.sampler import greedy_tokens

MAX_TIMED_DRAFT = 32  # longer drafts are not timed (start-up stays short): the cost model extrapolates


def timed_points(most: int) -> list[int]:
    """The draft lengths timed (the others interpolated): every one up to 4, then about 1.5x apart, and ``most``."""
    points, k = [], 0
    while k < most:
        points.append(k)
        k = k + 1 if k < 4 else max(k + 1, k * 3 // 2)
    return points + [most]


@torch.inference_mode()
def measure_verify_costs(model: torch.nn.Module, device: torch.device, block_size: int, context: int, most: int,
                         repeats: int = 5) -> tuple[float, ...]:
    """costs[k] for k in 0 .. most (costs[0] = 1): the step verifying k drafted tokens at ``context`` tokens against
    a decode step there, the median over ``repeats`` interleaved rounds of each round's ratio, linear between the
    timed lengths and never falling as k grows (a dip is the machine's noise). Writes blocks 0 .. context /
    block_size of the pool: the caller clears them."""
    if context <= most:
        raise ValueError(f"context={context} must exceed most={most}: a verifying row holds 1 + most tokens")
    table = torch.arange(-(-context // block_size), device=device)
    slots = (table[:, None] * block_size + torch.arange(block_size, device=device)).view(-1)[:context]

    def inputs(k: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        n = k + 1
        pos = torch.arange(context - n, context, device=device)
        if k == 0:
            meta = AttentionMetadata(slots[-1:], 1, table[None], pos + 1, [])
        else:
            meta = AttentionMetadata(slots[-n:], 0, None, None, [PrefillSpan(0, n, context, table, draft=True)])
        return torch.zeros(n, dtype=torch.long, device=device), pos, meta

    points = timed_points(most)
    steps = {k: inputs(k) for k in points}

    def step(k: int) -> float:
        ids, pos, meta = steps[k]
        start = time.perf_counter()
        greedy_tokens(model.compute_logits(model(ids, pos, meta)))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    for k in points:  # warm-up: each shape once
        step(k)
    ratios: dict[int, list[float]] = {k: [] for k in points[1:]}
    for _ in range(repeats):
        base = step(0)
        for k in points[1:]:
            ratios[k].append(step(k) / base)
    timed = {0: 1.0}
    for k in points[1:]:
        timed[k] = max(statistics.median(ratios[k]), timed[max(timed)])
    costs = []
    for lo, hi in zip(points, points[1:]):
        costs += [timed[lo] + (timed[hi] - timed[lo]) * (k - lo) / (hi - lo) for k in range(lo, hi)]
    return tuple(costs + [timed[most]])
