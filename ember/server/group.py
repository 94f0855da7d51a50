"""The engine requests of one HTTP request (one per prompt), submitted together through ``EngineClient.submit``,
their deltas delivered to the event loop through one ``Inbox``, timed for the metrics, and all aborted when the
client leaves.

``close()`` is the one exit: it aborts whatever has not finished, gives the admission slots back and records the
requests that ended by abort, exactly once, whichever way the HTTP request ended (done, disconnect, error).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

from ember.frontend.client import EngineClient
from ember.frontend.inbox import Inbox
from ember.lora.request import LoRARequest
from ember.outputs import EmbeddingRequestOutput, RequestOutput
from ember.protocol import PoolingParams
from ember.sampling_params import SamplingParams
from ember.server.admission import Admission
from ember.server.errors import APIError
from ember.server.metrics import RequestTiming, ServerMetrics


class RequestGroup:
    def __init__(self, model_name: str, client: EngineClient, admission: Admission, metrics: ServerMetrics,
                 registry: dict[str, "RequestGroup"], request_id: str) -> None:
        self.model_name = model_name  # the engine's name in the metrics
        self.client, self.admission, self.metrics, self.registry = client, admission, metrics, registry
        self.request_id = request_id
        self.ids: list[str] = []
        self.timing: dict[str, RequestTiming] = {}
        self.open: set[str] = set()  # submitted, not finished
        self._inbox = Inbox(asyncio.get_running_loop())
        self._admitted = 0

    def submit(self, prompts: Sequence[str | list[int] | dict], params: SamplingParams | PoolingParams,
               lora: LoRARequest | None = None) -> None:
        """Admit (503 when full) and submit every prompt (with the adapter ``lora`` when the request named one); a
        bad one raises before any is queued."""
        try:
            self.admission.enter(len(prompts))
        except APIError as e:
            self.metrics.reject(self.model_name, e.code or "unavailable")
            raise
        self._admitted = len(prompts)
        ids = [f"{self.request_id}-{i}" for i in range(len(prompts))]
        start = time.monotonic()
        try:
            self.client.submit(prompts, [params] * len(prompts), self._inbox.put, ids, [lora] * len(prompts))
        except BaseException:
            self.close()
            raise
        self.ids = ids
        self.open = set(ids)
        self.registry[self.request_id] = self
        for rid in ids:
            self.timing[rid] = RequestTiming(start, 0)

    async def deltas(self) -> AsyncIterator[tuple[int, RequestOutput | EmbeddingRequestOutput]]:
        """(prompt index, delta) until every request finished; an engine failure is raised."""
        index = {rid: i for i, rid in enumerate(self.ids)}
        while self.open:
            for item in await self._inbox.take():
                if isinstance(item, BaseException):
                    raise item
                rid = item.request_id
                if rid not in self.open:
                    continue
                t = self.timing[rid]
                if t.prompt_tokens == 0:
                    t.prompt_tokens = len(item.prompt_token_ids)
                new = sum(len(o.token_ids) for o in item.outputs) if isinstance(item, RequestOutput) else 0
                if new and t.first_token is None:
                    t.first_token = time.monotonic()
                t.generated += new
                if item.finished:
                    self.open.discard(rid)
                    reason = item.finish_reason if isinstance(item, EmbeddingRequestOutput) else next(
                        (o.finish_reason for o in item.outputs if o.finish_reason), None) or "stop"
                    self.metrics.request_done(self.model_name, t, reason, time.monotonic())
                yield index[rid], item

    def abort(self) -> None:
        """Abort what has not finished (thread-safe: the engine takes the abort between steps)."""
        for rid in self.open:
            self.client.abort(rid)

    def close(self) -> None:
        if self._admitted == 0 and not self.open:
            return
        now = time.monotonic()
        for rid in sorted(self.open):
            self.client.abort(rid)
            self.metrics.request_done(self.model_name, self.timing[rid], "abort", now)
        self.open.clear()
        self.registry.pop(self.request_id, None)
        self.admission.leave(self._admitted)
        self._admitted = 0
