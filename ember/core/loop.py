"""The engine core's thread: it builds the worker and the core, then runs schedule -> run the model -> sample ->
after-step work -> hand the outputs over, for as long as there is work; idle, it waits for a command.

Callers on any thread send commands (``ember.protocol.commands``: requests, aborts, utility calls by name with
plain arguments) through a thread-safe inbox; a utility call's answer comes back by its call id. Each step's
outputs go to one ``OutputHandler`` (the front end), called on this thread before the next step is scheduled; it
answers with the samples it found a stop string in, which are finished at once.

All torch work stays on this one thread. That matters on CPU: OpenMP gives each thread that runs parallel ops its
own team, and once the teams hold more threads than there are cores, libgomp stops spinning between ops and every
small op pays a wake-up (measured: a tiny softmax 3 us -> 60 us).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol

from ember.config import EngineConfig, ResolvedConfig
from ember.core.engine_core import EngineCore
from ember.core.guided import GrammarSource
from ember.errors import EngineDeadError
from ember.openmp import release_pool
from ember.protocol import (
    AbortRequest,
    AddRequests,
    EngineCommand,
    EngineOutput,
    EngineRequest,
    EngineStats,
    ModelInfo,
    Shutdown,
    StopSample,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger("ember")
IDLE_CHECK_S = 1.0  # an idle loop looks at its ranks this often


def _stop_thread(inbox: queue.Queue, thread: threading.Thread) -> None:
    if thread.is_alive():
        inbox.put(Shutdown())
        thread.join()


def settle(pending: dict[int, Future], result: UtilityResult) -> None:
    """Hand a utility call's result (or its exception) to the caller waiting on it, if it still waits."""
    done = pending.get(result.call_id)
    if done is None:  # the caller gave up (the engine died while it waited)
        return
    if result.error is not None:
        done.set_exception(result.error)
    else:
        done.set_result(result.value)


class OutputHandler(Protocol):
    def process(self, outputs: list[EngineOutput]) -> list[tuple[str, int]]:
        """Deliver one step's outputs; return the (request id, sample index) pairs that hit a stop string."""

    def fail_all(self, error: BaseException) -> None:
        """The loop ended: every request still open ends with this error."""


class EngineLoop:
    def __init__(self, config: EngineConfig, resolved: ResolvedConfig, handler: OutputHandler,
                 grammars: GrammarSource | None = None) -> None:
        self.handler = handler
        self.core: EngineCore | None = None
        self.dead: EngineDeadError | None = None  # set once the loop has stopped, with why
        self._inbox: queue.Queue = queue.Queue()
        self._calls = itertools.count()
        self._pending: dict[int, Future] = {}  # utility calls sent, by id, until their result comes back
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._busy = True  # torch work ran since the loop last freed its OpenMP workers (start-up counts)
        self._thread = threading.Thread(target=self._main, args=(config, resolved, grammars),
                                        name="ember-engine", daemon=True)
        self._thread.start()
        # at interpreter exit (the script's end, Ctrl-C, an uncaught exception) the loop stops as on shutdown(),
        # so a split model's other ranks are stopped, not killed
        self._finalizer = weakref.finalize(self, _stop_thread, self._inbox, self._thread)
        self._ready.wait()
        if self._init_error is not None:
            self._thread.join()
            raise self._init_error

    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    def add(self, requests: list[EngineRequest]) -> None:
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        self._inbox.put(AddRequests(tuple(requests)))

    def abort(self, request_id: str) -> None:
        self._inbox.put(AbortRequest(request_id))

    def shutdown(self) -> None:
        self._finalizer()

    def stats(self) -> EngineStats:
        return self.utility("stats")

    def is_alive(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    def utility(self, method: str, *args: Any) -> Any:
        """Run one of the core's ``UTILITIES`` on the loop's thread between steps and return its result: anything
        that talks to a split model's ranks must, since the ranks follow one sequence of collectives."""
        EngineCore.check_utility(method)
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        if threading.current_thread() is self._thread:  # from an output sink, between steps: waiting would deadlock
            return getattr(self.core, method)(*args)
        done: Future = Future()
        call = UtilityCall(next(self._calls), method, args)
        self._pending[call.call_id] = done
        self._inbox.put(call)
        try:
            while True:  # the loop may stop after the check above and before it takes the call: do not wait forever
                try:
                    return done.result(timeout=0.5)
                except FutureTimeout:
                    if not self._thread.is_alive():
                        raise EngineDeadError(str(self.dead or "the engine has stopped")) from None
        finally:
            self._pending.pop(call.call_id, None)

    def _main(self, config: EngineConfig, resolved: ResolvedConfig, grammars: GrammarSource | None) -> None:
        try:
            self.core = EngineCore.start(config, resolved, grammars)
            self._model_info = self.core.model_info
        except BaseException as e:
            self._init_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            while self._run_once():
                pass
        except BaseException as e:  # never leave a consumer waiting forever
            logger.exception("engine loop failed")
            self.dead = e if isinstance(e, EngineDeadError) else EngineDeadError(
                f"the engine stopped after an error: {e!r}")
            self.handler.fail_all(self.dead)
            self._cancel_calls()
        finally:
            self.core.shutdown()  # a split model's other ranks end with the loop, however it ends
            self.core = None  # its model and KV pool go with it (a server starting the engine again needs the memory)

    def _run_once(self) -> bool:
        """Take every pending command (waiting for one when idle), then run one step. False: shut down."""
        core = self.core
        idle = not core.has_work()
        try:
            item = self._inbox.get(block=idle, timeout=IDLE_CHECK_S if idle else None)
        except queue.Empty:
            item = None
            if idle:
                core.check_ranks()
                if self._busy:  # idle a while: this thread's OpenMP workers go, so that another engine's, or the
                    release_pool()  # caller's torch work, stay quick (ember.openmp); back-to-back requests keep them
                    self._busy = False
        while item is not None:
            if isinstance(item, Shutdown):
                self.dead = EngineDeadError("the engine was shut down")
                self.handler.fail_all(self.dead)
                self._cancel_calls()
                return False
            self._handle(core, item)
            self._busy = True  # a command may have run torch work (a utility)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None
        if core.has_work():
            self._deliver(core.step())
            self._busy = True
        return True

    def _handle(self, core: EngineCore, command: EngineCommand) -> None:
        reply = core.handle(command)
        if isinstance(reply, UtilityResult):
            settle(self._pending, reply)
        elif reply is not None:
            self._deliver([reply])

    def _cancel_calls(self) -> None:
        """Calls still queued when the loop ends fail with the reason, instead of waiting forever."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, UtilityCall):
                settle(self._pending, UtilityResult(item.call_id, error=self.dead))

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        if outputs:
            for request_id, index in self.handler.process(outputs):
                self._handle(self.core, StopSample(request_id, index))
