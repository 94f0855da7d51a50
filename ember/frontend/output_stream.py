"""A request's own output stream: the engine thread puts deltas in, one consumer takes them out.

Works for a plain thread (queue.Queue) or an asyncio task (the put is handed to the consumer's event loop).
An exception put into the stream is raised to the consumer. Iterating a stream (``for`` or ``async for``) yields
its outputs in the request's ``output_kind`` (deltas, cumulative snapshots, or the final output only) and stops
after the last one; leaving the loop early aborts the request.
"""

from __future__ import annotations

import asyncio
import copy
import queue
from collections.abc import AsyncIterator, Callable, Iterator

from ember.outputs import RequestOutput
from ember.sampling_params import OutputKind


class OutputStream:
    __slots__ = ("loop", "q", "kind", "request_id", "on_close")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None, kind: OutputKind = OutputKind.DELTA) -> None:
        self.loop = loop
        self.q: asyncio.Queue | queue.Queue = asyncio.Queue() if loop is not None else queue.Queue()
        self.kind = kind
        self.request_id: str | None = None  # set by the client when the request is submitted
        self.on_close: Callable[[str], None] | None = None  # the client's abort, for a consumer that leaves early

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called on the engine's thread: it must not raise there (that would stop the engine for every request)."""
        if self.loop is None:
            self.q.put(item)
            return
        try:
            self.loop.call_soon_threadsafe(self.q.put_nowait, item)
        except RuntimeError:  # the consumer's event loop has closed (also between a check and the call): nobody
            if not getattr(item, "finished", True):  # reads this stream any more, so the request is aborted
                self._close()

    def get(self, timeout: float | None = None) -> RequestOutput:
        item = self.q.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise item
        return item

    async def aget(self) -> RequestOutput:
        item = await self.q.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def __iter__(self) -> Iterator[RequestOutput]:
        view, finished = _View(self.kind), False
        try:
            while not finished:
                delta = self.get()
                finished = delta.finished
                out = view.add(delta)
                if out is not None:
                    yield out
        finally:
            if not finished:
                self._close()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        view, finished = _View(self.kind), False
        try:
            while not finished:
                delta = await self.aget()
                finished = delta.finished
                out = view.add(delta)
                if out is not None:
                    yield out
        finally:
            if not finished:
                self._close()

    def _close(self) -> None:
        if self.on_close is not None and self.request_id is not None:
            self.on_close(self.request_id)


class _View:
    """Folds deltas into what the output kind asks for."""

    __slots__ = ("kind", "total")

    def __init__(self, kind: OutputKind) -> None:
        self.kind, self.total = kind, None

    def add(self, delta: RequestOutput) -> RequestOutput | None:
        if self.kind is OutputKind.DELTA:
            return delta
        if self.total is None:
            self.total = delta
        else:
            self.total.merge(delta)
        if self.kind is OutputKind.CUMULATIVE or delta.finished:
            return snapshot(self.total)
        return None


def snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the consumer may keep while the engine goes on filling the cumulative output."""
    snap = copy.copy(out)
    snap.outputs = [copy.copy(o) for o in out.outputs]
    for o in snap.outputs:
        o.token_ids = list(o.token_ids)
        o.logprobs = list(o.logprobs) if o.logprobs is not None else None
    return snap
