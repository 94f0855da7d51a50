"""An output stream to an asyncio consumer is fed on the engine's thread: a consumer whose event loop has closed
must not make that thread raise (that stopped the engine for every request); its request is aborted instead."""

from __future__ import annotations

import asyncio

from ember.frontend.output_stream import OutputStream
from ember.outputs import CompletionOutput, RequestOutput


def output(finished: bool) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], [CompletionOutput(0, "", [3], None, None, None, None)], finished)


class ClosingLoop:
    """A loop that closes between ``is_closed()`` and ``call_soon_threadsafe`` (the race asyncio cannot rule out:
    the consumer's thread closes it while the engine's thread delivers)."""

    def is_closed(self) -> bool:
        return False

    def call_soon_threadsafe(self, *args) -> None:
        raise RuntimeError("Event loop is closed")


def test_a_closed_consumer_loop_aborts_the_request_and_does_not_raise():
    aborted: list[str] = []
    for loop in (ClosingLoop(), asyncio.new_event_loop()):
        if isinstance(loop, asyncio.AbstractEventLoop):
            loop.close()
        stream = OutputStream(loop)
        stream.request_id, stream.on_close = "r", aborted.append
        stream.put(output(finished=False))  # must not raise on the engine's thread
        stream.put(output(finished=True))  # the last output: nothing left to abort
        stream.put(RuntimeError("engine stopped"))  # fail_all's error: nothing to abort either
    assert aborted == ["r", "r"]


def test_an_open_loop_gets_every_output_in_order():
    async def main() -> list[bool]:
        stream = OutputStream(asyncio.get_running_loop())
        stream.put(output(finished=False))
        stream.put(output(finished=True))
        return [(await stream.aget()).finished, (await stream.aget()).finished]

    assert asyncio.run(main()) == [False, True]
