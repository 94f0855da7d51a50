"""How one model is split over ranks, and what starts them: ``ParallelConfig``."""

from __future__ import annotations

from dataclasses import dataclass

from ember import envs

EXECUTOR_BACKENDS = ("uni", "mp", "launched", "ray")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How one model is split: T tensor-parallel ranks in each of P pipeline stages, started by ``backend``.
    Under a launcher, ``rank`` / ``local_rank`` are this process's (0 otherwise: the engine's process is rank 0)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    backend: str = "uni"
    rank: int = 0
    local_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_here(self) -> int | None:
        """Ranks on this machine: all of them when the engine spawns them, a launcher's local count, None (unknown)
        on a Ray cluster."""
        if self.backend == "ray":
            return None
        if self.backend == "launched":
            return envs.local_world_size() or self.world_size
        return self.world_size
