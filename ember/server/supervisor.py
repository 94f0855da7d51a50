"""Restarting a served engine whose loop stopped (a tensor-parallel rank killed, the engine core's process gone, an
error inside a step), so that ``ember serve`` serves again without its operator.

The requests in flight on the dead engine have already ended with ``EngineDeadError`` (a 503 ``engine_dead``, or an
error event in a stream). The supervisor notices the stop within ``POLL_S``, shuts the dead engine down (its ranks
are ended), starts a fresh one from the same config, adds the served adapters again and puts it in place. Meanwhile
requests and ``/health`` get 503 ``engine_restarting`` with Retry-After. Restarts are bounded: at most
``max_restarts`` in any ``WINDOW_S`` (each start tried ``ATTEMPTS`` times with a growing pause); past that the
engine stays down and ``/health`` answers 503 ``engine_dead``, for an orchestrator to replace the server.
Every restart is logged with its cause and time, and counted in ``ember_engine_restarts``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ember.errors import EmberError
from ember.frontend.client import EngineClient
from ember.lora.request import LoRARequest

logger = logging.getLogger("ember")

POLL_S = 0.25  # how often a live engine is looked at (is_alive is a flag read)
WINDOW_S = 600.0  # restarts are counted over the last ten minutes
ATTEMPTS = 3  # starts tried per restart, with a pause of PAUSE_S, 2 PAUSE_S, ... between them
PAUSE_S = 1.0


class Supervised(Protocol):
    """What the supervisor needs of a served engine (the app's ``_Engine``)."""

    name: str
    client: EngineClient  # replaced by a restart
    admission: Any  # its ``closed``: the server is shutting down
    restarting: bool  # set while a restart runs: requests and /health get 503 engine_restarting


class Restarts(Protocol):
    def engine_restarted(self, model_name: str) -> None: ...


class EngineSupervisor:
    """Watches one served engine and restarts it when its loop stops."""

    def __init__(self, engine: Supervised, start: Callable[[], EngineClient], loras: Sequence[LoRARequest],
                 metrics: Restarts, max_restarts: int) -> None:
        self.engine, self.start, self.loras = engine, start, tuple(loras)
        self.metrics, self.max_restarts = metrics, max_restarts
        self.recent: deque[float] = deque()  # monotonic times of the restarts in the window
        self.started: EngineClient | None = None  # the engine this supervisor started last: it stops it at the end
        self.gave_up = False

    async def watch(self) -> None:
        """Until cancelled (the server's shutdown): restart the engine each time its loop has stopped."""
        while not self.gave_up:
            await asyncio.sleep(POLL_S)
            if not self.engine.client.is_alive() and not self.engine.admission.closed:
                try:
                    await self.restart()
                except Exception:  # noqa: BLE001  (a watcher that ended would leave the engine unsupervised)
                    logger.exception("[ember] restarting the engine of %s failed", self.engine.name)

    async def restart(self) -> None:
        e = self.engine
        now = time.monotonic()
        while self.recent and now - self.recent[0] > WINDOW_S:
            self.recent.popleft()
        why = e.client.stop_reason()
        if len(self.recent) >= self.max_restarts:
            self.gave_up = True
            logger.error("[ember] the engine of %s stopped (%s) and is not restarted: %d restarts in the last %d s "
                         "is the limit (--max-engine-restarts); /health answers 503", e.name, why,
                         len(self.recent), int(WINDOW_S))
            return
        self.recent.append(now)
        e.restarting = True
        logger.error("[ember] the engine of %s stopped (%s); restarting it (restart %d of at most %d in %d s)",
                     e.name, why, len(self.recent), self.max_restarts, int(WINDOW_S))
        try:
            await asyncio.to_thread(e.client.shutdown)  # ends its ranks; its requests have ended already
            client = await self._start()
            if client is None:
                self.gave_up = True
                return
            e.client = client  # the dead engine is referenced no more: its memory is free for the next start
            self.metrics.engine_restarted(e.name)
            logger.warning("[ember] the engine of %s is serving again after %.1f s", e.name, time.monotonic() - now)
        finally:
            e.restarting = False

    async def _start(self) -> EngineClient | None:
        for attempt in range(1, ATTEMPTS + 1):
            try:
                client = await asyncio.to_thread(self._started)
                self.started = client
                return client
            except Exception as err:  # noqa: BLE001  (any failure to start is logged and tried again, boundedly)
                logger.error("[ember] starting the engine of %s failed (attempt %d of %d): %r", self.engine.name,
                             attempt, ATTEMPTS, err)
                if attempt < ATTEMPTS:
                    await asyncio.sleep(PAUSE_S * 2 ** (attempt - 1))
        logger.error("[ember] the engine of %s could not be started again; /health answers 503", self.engine.name)
        return None

    def _started(self) -> EngineClient:
        """A fresh engine with the served adapters added (a thread's work: it loads the model)."""
        client = self.start()
        for lora in self.loras:
            try:
                client.add_lora(lora)
            except (EmberError, OSError) as err:  # its requests fail one by one (request_failed); the rest serve
                logger.error("[ember] the adapter %s of %s could not be loaded again: %s", lora.lora_name,
                             self.engine.name, err)
            except BaseException:
                client.shutdown()
                raise
        return client

    def close(self) -> None:
        """Stop the engine this supervisor started last (the first one is its owner's to stop)."""
        if self.started is not None:
            self.started.shutdown()

