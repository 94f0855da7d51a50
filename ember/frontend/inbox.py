"""The outputs of several requests, from the engine thread to one asyncio consumer.

The engine emits a step's deltas in a burst, one per request; the consumer's loop is woken once per burst, not once
per delta. Measured on the default model, 16 greedy requests x 64 tokens through the EasyDeL facade: a wake-up per
delta made the facade 1.04-1.06x slower than EngineClient.submit with a plain callback; one per burst, 1.007x.
"""

from __future__ import annotations

import asyncio
import collections

from ember.outputs import RequestOutput


class Inbox:
    """A sink for EngineClient.submit whose items an asyncio task takes in batches. Used by one event loop."""

    __slots__ = ("_loop", "_items", "_woken", "_ready")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: collections.deque = collections.deque()
        self._woken = False  # a wake-up is scheduled and not yet taken
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:  # the engine thread
        self._items.append(item)  # before the flag is read: a take() that cleared it drains this item
        if not self._woken and not self._loop.is_closed():
            self._woken = True
            self._loop.call_soon_threadsafe(self._ready.set)

    async def take(self) -> list[RequestOutput | BaseException]:
        while not self._items:
            await self._ready.wait()
            self._ready.clear()
            self._woken = False
        self._woken = False  # cleared before draining: a put() after this schedules its own wake-up
        items = []
        while self._items:
            items.append(self._items.popleft())
        return items
