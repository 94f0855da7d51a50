"""The process groups of a split model, made the same way by every rank (torch.distributed requires every rank to
create every group, in the same order).

The world group carries tensors between stages and is gloo on CPU, NCCL on CUDA; each stage has a TP group on the
same backend; one gloo group of every rank carries the pickled step descriptions and outputs (objects travel on
CPU even when the tensors are on GPUs).
"""

from __future__ import annotations

import datetime

from ember import envs
from ember.distributed.context import ParallelContext
from ember.errors import ConfigError


def timeout() -> datetime.timedelta:
    """How long a collective may wait (EMBER_DIST_TIMEOUT): a hung rank fails then; a dead one fails at once."""
    return datetime.timedelta(seconds=envs.dist_timeout())


def init(rank: int, tp_size: int, pp_size: int, device_type: str, store=None) -> ParallelContext:
    """Join the world (through ``store``, else the launcher's MASTER_ADDR / MASTER_PORT) and build the groups.
    A launched script may have joined it already (with the same world size); spawned ranks never share one."""
    import torch.distributed as dist

    world = tp_size * pp_size
    backend = "nccl" if device_type == "cuda" else "gloo"
    if not dist.is_initialized():
        kwargs = {"store": store} if store is not None else {"init_method": "env://"}
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout(), **kwargs)
    elif store is not None or dist.get_world_size() != world:
        raise ConfigError(f"torch.distributed is already initialized in this process ({dist.get_world_size()} "
                          "ranks): one split engine a process; shut the other one down first (LLM.shutdown())")
    control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    tp_group = None
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks) if tp_size > 1 else None
        if rank in ranks:
            tp_group = group
    return ParallelContext(tp_size, rank % tp_size, pp_size, rank // tp_size, tp_group, control)


def destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
