"""What every route shares about the HTTP connection: waiting for a group's answer unless the client leaves first,
and an SSE response that closes its group however it ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from ember.server.group import RequestGroup

T = TypeVar("T")


async def disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_left(request: Request, group: RequestGroup, work: Coroutine[Any, Any, T]) -> T | None:
    """work's result (the group's answers), or None (the work cancelled) when the client leaves first; the group
    is closed either way, which aborts whatever it still has running."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        group.close()
    if task in done:
        return task.result()
    task.cancel()
    return None


class EventStream(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends, even when its body was never started."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
