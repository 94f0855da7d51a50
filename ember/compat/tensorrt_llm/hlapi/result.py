"""What ``generate`` and ``generate_async`` return: ``GenerationOutput`` (text, token_ids, logprobs) and
``GenerationResult``, which is at once that output, a future and an iterator over the request's progress.

A result is fed by the engine thread (``_add``, one call per native delta) and read by any thread or event loop:
``result(timeout)`` blocks the calling thread, ``await aresult()`` (or ``await result``) does not, ``done()``
polls, ``cancel()`` aborts the request (its KV blocks are freed as it ends). Iterating it (``for`` or ``async
for``) yields a ``GenerationOutput`` snapshot per engine step when streaming, else only the final one. With
beam_width > 1, ``text`` and ``token_ids`` hold one entry per beam, best first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from ember.outputs import RequestOutput


@dataclass
class GenerationOutput:
    text: str | list[str] = ""
    token_ids: list[int] | list[list[int]] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class GenerationResult(GenerationOutput):
    """Printed as the page prints a generated output: ``GenerationOutput(text=..., token_ids=[...], logprobs=[...])``
    (the state so far, while the request runs)."""

    def __init__(self, abort: Callable[[], None], beam_width: int, streaming: bool,
                 decode: Callable[[list[int]], str] | None) -> None:
        super().__init__()
        self._abort = abort
        self.beam_width = beam_width
        self.streaming = streaming
        self._decode = decode  # a custom tokenizer's decode; None: the engine's text (or '' for token-id prompts)
        self._merged: RequestOutput | None = None
        self._items: list[GenerationOutput] = []
        self._done = False
        self._cancelled = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.request_id: str | None = None
        self.finish_reasons: list[str | None] = []

    def __repr__(self) -> str:
        return f"GenerationOutput(text={self.text!r}, token_ids={self.token_ids!r}, logprobs={self.logprobs!r})"

    # ----- fed by the engine thread -----

    def _add(self, item: RequestOutput | BaseException, text_wanted: bool) -> None:
        with self._cond:
            if isinstance(item, BaseException):
                self._error, self._done = item, True
            else:
                if self._merged is None:
                    self._merged = item
                else:
                    self._merged.merge(item)
                self._refresh(text_wanted)
                if self.streaming or item.finished:
                    self._items.append(GenerationOutput(self.text, self._copy(self.token_ids), list(self.logprobs)))
                self._done = item.finished
            waiters, self._waiters = self._waiters, []
            self._cond.notify_all()
        for loop, fut in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_wake, fut)

    def _refresh(self, text_wanted: bool) -> None:
        outs = self._merged.outputs
        ids = [list(o.token_ids) for o in outs]
        if self._decode is not None:
            texts = [self._decode(t) if text_wanted else "" for t in ids]
        else:
            texts = [o.text if text_wanted else "" for o in outs]
        self.finish_reasons = [o.finish_reason for o in outs]
        if self.beam_width > 1:
            self.text, self.token_ids = texts, ids
            self.logprobs = [o.cumulative_logprob for o in outs]
        else:
            self.text, self.token_ids = (texts[0], ids[0]) if outs else ("", [])

    @staticmethod
    def _copy(ids: list) -> list:
        return [list(t) for t in ids] if ids and isinstance(ids[0], list) else list(ids)

    # ----- future -----

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> bool:
        """Abort the request; its blocks are freed when it ends. False if it had already finished."""
        if self._done:
            return False
        self._cancelled = True
        self._abort()
        return True

    def result(self, timeout: float | None = None) -> "GenerationResult":
        """Block until the request ends; TimeoutError after timeout seconds leaves it running."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"request {self.request_id} has not finished after {timeout} s; it goes on "
                                   "running (cancel() aborts it)")
        return self._final()

    async def aresult(self) -> "GenerationResult":
        """Wait without blocking the event loop; cancelling the awaiting task aborts the request."""
        try:
            while not self._done:
                await self._changed()
        except asyncio.CancelledError:
            self.cancel()
            raise
        return self._final()

    def __await__(self):
        return self.aresult().__await__()

    def _final(self) -> "GenerationResult":
        if self._error is not None:
            raise self._error
        if self._cancelled:
            raise concurrent.futures.CancelledError(f"request {self.request_id} was cancelled")
        return self

    def _changed(self) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cond:
            if self._done:
                fut.set_result(None)
            else:
                self._waiters.append((loop, fut))
        return fut

    # ----- iteration -----

    def __iter__(self) -> Iterator[GenerationOutput]:
        i = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self._items) > i or self._done)
                if len(self._items) > i:
                    item = self._items[i]
                elif self._error is not None:
                    raise self._error
                else:
                    return
            i += 1
            yield item

    def __aiter__(self) -> AsyncIterator[GenerationOutput]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[GenerationOutput]:
        i = 0
        while True:
            while len(self._items) <= i and not self._done:
                await self._changed()
            if len(self._items) > i:
                i += 1
                yield self._items[i - 1]
            elif self._error is not None:
                raise self._error
            else:
                return


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
