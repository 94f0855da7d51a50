"""``ember.AsyncLLM``: asyncio front of the engine. Many generators share one event loop; each request's outputs
arrive on its own stream. Leaving an ``async for`` early aborts the request."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from typing import Any

from ember.config import EngineConfig
from ember.core.engine import Engine, PromptType
from ember.core.output_stream import OutputStream
from ember.outputs import RequestOutput
from ember.sampling_params import OutputKind, SamplingParams


class AsyncLLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = Engine(self.config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        stream = OutputStream(asyncio.get_running_loop())
        request = self.engine.make_request(prompt, sampling_params, stream.put, request_id)
        kind = request.params.output_kind
        self.engine.submit([request])
        total: RequestOutput | None = None
        finished = False
        try:
            while not finished:
                delta = await stream.aget()
                finished = delta.finished
                if kind is OutputKind.DELTA:
                    yield delta
                    continue
                if total is None:
                    total = delta
                else:
                    total.merge(delta)
                if kind is OutputKind.CUMULATIVE or finished:
                    yield _snapshot(total)
        finally:
            if not finished:
                self.engine.abort(request.request_id)

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the engine loop and join its thread; unfinished requests end with an error."""
        self.engine.shutdown()


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the consumer may keep while the engine goes on filling the cumulative output."""
    snap = copy.copy(out)
    snap.outputs = [copy.copy(o) for o in out.outputs]
    for o in snap.outputs:
        o.token_ids = list(o.token_ids)
        o.logprobs = list(o.logprobs) if o.logprobs is not None else None
    return snap
