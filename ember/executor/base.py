"""What the engine core asks of its executor, whatever runs the ranks."""

from __future__ import annotations

from typing import Any, Protocol

from ember.config import SchedulerConfig
from ember.protocol import BatchDescription, WorkerOutput
from ember.worker.startup import PoolPlan
from ember.worker.worker import Worker


class Executor(Protocol):
    driver: Worker  # rank 0's worker, in the engine's process: model facts, device, memory figures

    def init_cache(self, sched: SchedulerConfig) -> PoolPlan:
        """Size and allocate every rank's KV pool (the same number of blocks on each), then warm up."""

    def execute(self, batch: BatchDescription) -> WorkerOutput:
        """Run one step on every rank; the sampled tokens."""

    def rank_reports(self, reset: bool = False) -> list[dict[str, Any]]:
        """Every rank's place, weight and KV bytes and time in collectives, rank 0 first; reset: zero the times."""

    def shutdown(self) -> None:
        """Stop every rank and free what they hold; safe to call twice."""
