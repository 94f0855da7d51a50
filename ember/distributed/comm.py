"""The collectives the sharded layers and the pipeline call, each a no-op on one rank, and the time they take.

Time is counted per process (``COMM``): the all-reduces of row-parallel layers and the vocabulary gather are
communication; a stage's wait for its input (``recv``) is mostly the pipeline bubble. ``docs/parallel.md`` reads
these to say how much of a step is spent communicating.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from ember.distributed.context import ParallelContext


class CommStats:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def add(self, kind: str, start: float) -> None:
        self.seconds[kind] += time.perf_counter() - start
        self.calls[kind] += 1

    def snapshot(self, reset: bool = False) -> dict[str, float]:
        out = {**{f"{k}_s": round(v, 6) for k, v in self.seconds.items()},
               **{f"{k}_calls": v for k, v in self.calls.items()}}
        if reset:
            self.seconds.clear()
            self.calls.clear()
        return out


COMM = CommStats()


def all_reduce(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Sum over the stage's TP ranks. Half-precision partial sums are added in float32 and rounded once, as one
    rank's matmul accumulates them, so T ranks stay as close as possible to one."""
    if ctx.tp_size == 1:
        return x
    import torch.distributed as dist

    start = time.perf_counter()
    y = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x.contiguous()
    dist.all_reduce(y, group=ctx.tp_group)
    COMM.add("all_reduce", start)
    return y.to(x.dtype)


def broadcast(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """TP rank 0's ``x`` on every TP rank of the stage (each passes a tensor of the same shape and dtype)."""
    if ctx.tp_size == 1:
        return x
    import torch.distributed as dist

    start = time.perf_counter()
    x = x.contiguous()
    dist.broadcast(x, src=ctx.tp_root, group=ctx.tp_group)
    COMM.add("broadcast", start)
    return x


def gather_last_dim(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor | None:
    """Concatenate each TP rank's slice along the last dim on TP rank 0; None on the other ranks."""
    if ctx.tp_size == 1:
        return x
    import torch.distributed as dist

    start = time.perf_counter()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(ctx.tp_size)] if ctx.tp_rank == 0 else None
    dist.gather(x, parts, dst=ctx.tp_root, group=ctx.tp_group)
    COMM.add("gather", start)
    return torch.cat(parts, dim=-1) if parts is not None else None


def send(x: torch.Tensor, dst: int):
    """Start sending a stage's output to the next stage; returns the handle to wait on."""
    import torch.distributed as dist

    start = time.perf_counter()
    work = dist.isend(x.contiguous(), dst=dst)
    COMM.add("send", start)
    return work


def recv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int) -> torch.Tensor:
    import torch.distributed as dist

    start = time.perf_counter()
    buf = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buf, src=src)
    COMM.add("recv", start)
    return buf
