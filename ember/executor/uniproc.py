"""One rank, in the engine's thread: today's path, with nothing added to a step."""

from __future__ import annotations

from typing import Any

from ember.config import ResolvedConfig
from ember.protocol import SchedulerOutput, WorkerOutput
from ember.worker.worker import Worker


class UniprocExecutor:
    def __init__(self, resolved: ResolvedConfig) -> None:
        self._worker = Worker(resolved.model, resolved.cache)

    def execute_model(self, batch: SchedulerOutput) -> WorkerOutput:
        return self._worker.execute_model(batch)

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return [getattr(self._worker, Worker.check_rpc(method))(*args)]

    def shutdown(self) -> None:
        pass
