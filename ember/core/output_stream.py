"""A request's own output stream: the engine thread puts deltas in, one consumer takes them out.

Works for a plain thread (queue.Queue) or an asyncio task (the put is handed to the consumer's event loop).
An exception put into the stream is raised to the consumer.
"""

from __future__ import annotations

import asyncio
import queue

from ember.outputs import RequestOutput


class OutputStream:
    __slots__ = ("loop", "q")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop
        self.q: asyncio.Queue | queue.Queue = asyncio.Queue() if loop is not None else queue.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        if self.loop is not None:
            if not self.loop.is_closed():
                self.loop.call_soon_threadsafe(self.q.put_nowait, item)
        else:
            self.q.put(item)

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
