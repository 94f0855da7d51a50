"""EasyDeL's device mesh in ember's terms. EasyDeL lays its devices out on five named axes, ``sharding_axis_dims``
over ``sharding_axis_names`` = (dp, fsdp, ep, tp, sp), one of which may be -1 ("every device left"). On ember:

- tp (the mesh axes ``PartitionAxis.head_axis`` names) splits attention heads and MLP columns: ember's tensor
  parallelism, one rank per device.
- fsdp shards every weight over its devices and gathers each before use; ember holds each weight once across its
  ranks by splitting it by heads / columns instead, so fsdp devices are tensor-parallel ranks too.
- dp (replicas), ep (experts) and sp (sequence) must be 1: a replica is another engine (another vSurge), the
  Llama-family models ember serves have no experts, and ember has no sequence parallelism.

-1 takes the devices left: the CUDA devices on a GPU machine, one on CPU (as jax sees one CPU device).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ember.compat.easydel.enums import PartitionAxis

AXIS_NAMES = ("dp", "fsdp", "ep", "tp", "sp")
DEFAULT_AXIS_DIMS = (1, -1, 1, 1, 1)  # EasyDeL's default: every device on fsdp
_MUST_BE_ONE = {
    "dp": "data-parallel replicas are separate engines on ember: build one vSurge per replica",
    "ep": "the Llama-family models ember serves have no experts",
    "sp": "ember has no sequence parallelism: put the devices on tp",
}


def device_count(device: str) -> int:
    """Devices that -1 spreads over: the CUDA devices when the engine runs on CUDA, else one CPU device."""
    on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return torch.cuda.device_count() if on_cuda else 1


def tensor_parallel_size(dims: Sequence[int], names: Sequence[str] = AXIS_NAMES,
                         partition_axis: PartitionAxis | None = None, devices: int = 1) -> int:
    """The ranks a mesh of dims x names splits each weight over (see the module docstring); ValueError names the
    axis that cannot be honoured."""
    dims, names = tuple(dims), tuple(names)
    if len(dims) != len(names) or any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
        raise ValueError(f"sharding_axis_dims={dims!r} is out of range: it must be {len(names)} integers, one for "
                         f"each of sharding_axis_names={names!r}")
    if dims.count(-1) > 1 or any(d == 0 or d < -1 for d in dims):
        raise ValueError(f"sharding_axis_dims={dims!r} is out of range: each entry must be >= 1, and at most one -1 "
                         "(every device left)")
    known = math.prod(d for d in dims if d != -1)
    sizes = dict(zip(names, (max(1, devices // known) if d == -1 else d for d in dims)))
    head = (partition_axis or PartitionAxis()).head_axis
    weight_axes = {"fsdp", *((head,) if isinstance(head, str) else (head or ()))}
    for name, size in sizes.items():
        if size != 1 and name not in weight_axes:
            why = _MUST_BE_ONE.get(name, f"partition_axis.head_axis={head!r} does not name it")
            raise ValueError(f"sharding_axis_dims={dims!r} puts {size} devices on axis {name!r}, which ember cannot "
                             f"split: {why}")
    return math.prod(sizes[n] for n in weight_axes if n in sizes)
