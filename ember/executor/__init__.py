"""How the engine core reaches its model: one executor between the core and the workers.

- ``UniprocExecutor``: one rank, the worker in the engine's own thread (no process, no group, no extra cost);
- ``MultiprocExecutor`` (``mp``): rank 0 in the engine's process, the other ranks in processes it spawns and owns;
- ``LaunchedExecutor`` (``launched``): every rank started by a launcher (torchrun, mpirun, srun); rank 0 runs the
  user's script and the engine, the others serve until it ends (``serve_launched``);
- ``RayExecutor`` (``ray``): the other ranks are Ray actors on an existing (or a local) Ray cluster.
All but the first share ``DistributedExecutor``: the step description is broadcast over torch.distributed, every
rank runs its share, and the sampling rank's tokens come back.
"""

from __future__ import annotations

from ember.config import ResolvedConfig
from ember.executor.base import Executor
from ember.executor.uniproc import UniprocExecutor


def make_executor(resolved: ResolvedConfig) -> Executor:
    backend = resolved.parallel.backend
    if backend == "uni":
        return UniprocExecutor(resolved)
    if backend == "mp":
        from ember.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(resolved)
    if backend == "launched":
        from ember.executor.launched import LaunchedExecutor

        return LaunchedExecutor(resolved)
    from ember.executor.ray import RayExecutor

    return RayExecutor(resolved)


def serve_launched(resolved: ResolvedConfig) -> None:
    """On a launched rank other than 0: serve rank 0's engine until it shuts down, then end the process."""
    from ember.executor.launched import serve_launched as serve

    serve(resolved)


__all__ = ["Executor", "make_executor", "serve_launched"]
