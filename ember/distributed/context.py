"""Where this process sits in a split model.

World rank = ``pp_rank * tp_size + tp_rank``. Rank 0 (stage 0, TP rank 0) runs the engine core beside its share
of the model; the last stage's TP rank 0 samples. A single-process engine uses ``ParallelContext()``: every
collective below is then a no-op and no process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ParallelContext:
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    tp_group: Any = None  # the process group of this stage's TP ranks (None when tp_size == 1)
    control_group: Any = None  # a gloo group of every rank: step descriptions down, sampled tokens back

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def world_rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def sampler_rank(self) -> int:
        """The world rank that gathers the logits and samples: TP rank 0 of the last stage."""
        return (self.pp_size - 1) * self.tp_size

    @property
    def is_sampler(self) -> bool:
        return self.world_rank == self.sampler_rank

    @property
    def tp_root(self) -> int:
        """World rank of TP rank 0 in this stage (where vocabulary-split logits are gathered)."""
        return self.pp_rank * self.tp_size

    def stage_peer(self, offset: int) -> int:
        """World rank of the same TP rank ``offset`` stages away (hidden states travel rank to rank)."""
        return (self.pp_rank + offset) * self.tp_size + self.tp_rank


def layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """Layers [start, stop) of a stage: an even split, the first ``num_layers % pp_size`` stages one layer more."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)
