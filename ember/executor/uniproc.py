"""One rank, in the engine's thread: today's path, with nothing added to a step."""

from __future__ import annotations

from typing import Any

from ember.config import ResolvedConfig, SchedulerConfig
from ember.protocol import BatchDescription, WorkerOutput
from ember.worker.startup import PoolPlan
from ember.worker.worker import Worker


class UniprocExecutor:
    def __init__(self, resolved: ResolvedConfig) -> None:
        self.driver = Worker(resolved.model, resolved.cache)

    def init_cache(self, sched: SchedulerConfig) -> PoolPlan:
        return self.driver.init_cache(sched)

    def execute(self, batch: BatchDescription) -> WorkerOutput:
        return self.driver.execute(batch)

    def rank_reports(self, reset: bool = False) -> list[dict[str, Any]]:
        return [self.driver.report(reset)]

    def shutdown(self) -> None:
        pass
