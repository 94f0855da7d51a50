"""What the engine core asks of its executor, whatever runs the ranks: steps, and a few worker methods run on
every rank by name. Everything that crosses is data (``ember.protocol``): the core never holds a worker."""

from __future__ import annotations

from typing import Any, Protocol

from ember.protocol import SchedulerOutput, WorkerOutput


class Executor(Protocol):
    def execute_model(self, batch: SchedulerOutput) -> WorkerOutput:
        """Run one step on every rank; the sampling rank's tokens."""

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Run the worker method (one of ``Worker.RPC``) on every rank, in the order the core calls; each rank's
        result, rank 0 first. ``init_cache`` sizes every rank's KV pool alike; ``info`` and ``stats`` are read from
        rank 0's; ``report`` is every rank's."""

    def shutdown(self) -> None:
        """Stop every rank and free what they hold; safe to call twice."""
