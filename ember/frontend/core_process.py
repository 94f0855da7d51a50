"""The engine core in its own process: the same commands and outputs as the in-process ``EngineLoop``
(``ember.protocol.commands``), pickled over a pipe. The client process keeps the tokenizer and the output processing
(text, stop strings, logprobs, ``RequestOutput``s), which then run while the core runs the next step; the core process
holds the scheduler, the executor and its ranks.

A stop string found in a sample's text reaches the core one step later than in process (the output processor has
already cut the text and the tokens at it); the extra token is computed and dropped. If the core process ends, every
open request ends with ``EngineDeadError`` and so does every later call. Which transport an engine uses:
``use_core_process``.
"""

from __future__ import annotations

import itertools
import logging
import signal
import socket
import subprocess
import sys
import threading
import weakref
from multiprocessing.connection import Connection
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from ember import envs
from ember.config import EngineConfig, ModelConfig, ResolvedConfig
from ember.core.engine_core import EngineCore
from ember.core.loop import IDLE_CHECK_S, OutputHandler, settle
from ember.errors import ConfigError, EngineDeadError
from ember.protocol import (
    AbortRequest,
    AddRequests,
    CoreFailed,
    CoreReady,
    EngineRequest,
    EngineStats,
    ModelInfo,
    Shutdown,
    StepOutputs,
    StopSample,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger("ember")

_PROCESS_BACKENDS = ("uni", "mp")  # the launched (torchrun) and Ray backends keep their core in the caller
# a fresh interpreter (multiprocessing's spawn would run the user's script again): its end of a socket pair as argv[1]
CORE_COMMAND = [sys.executable, "-m", "ember.frontend.core_process"]


def use_core_process(resolved: ResolvedConfig) -> bool:
    """``EMBER_ENGINE_CORE_PROCESS=1``: the core in its own process; ``0``: in the caller's process, on a thread.
    Unset, each device gets the transport measured faster there (docs/architecture.md): the thread on CPU, where the
    client's output work would compete with the model for the cores; the process on CUDA for the ``uni`` executor
    (on an H100 W1 was equal and nothing slower; ``mp`` on CUDA is not measured and keeps the thread)."""
    value = envs.engine_core_process()
    backend = resolved.parallel.backend
    if value is None:
        return resolved.model.device.startswith("cuda") and backend == "uni"
    if not value:
        return False
    if backend not in _PROCESS_BACKENDS:
        raise ConfigError(f"{envs.ENGINE_CORE_PROCESS}=1 is not supported with the {backend!r} executor: its ranks "
                          f"join the caller's process group; use one of {', '.join(_PROCESS_BACKENDS)} or unset it")
    return True


class _LazyGrammars:
    """The core process's grammar source: the model's tokenizer is loaded at the first guided request."""

    def __init__(self, model: ModelConfig) -> None:
        self._model = model
        self._grammars: Any = None

    def _load(self) -> Any:
        if self._grammars is None:
            from ember.frontend.structured_output import Grammars
            from ember.model_loader import load_tokenizer

            tok = load_tokenizer(self._model)
            self._grammars = Grammars(tok.tokenizer, tok.eos_token_ids)
        return self._grammars

    @property
    def vocab_size(self) -> int:
        return self._load().vocab_size

    def matcher(self, grammar: str) -> Any:
        return self._load().matcher(grammar)


def _picklable(error: BaseException) -> BaseException | None:
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 -- an exception holding something unpicklable: its message still goes
        return None


def serve_core(conn: Any, config: EngineConfig, resolved: ResolvedConfig) -> None:
    """The core process: start the core, then take every pending command (waiting for one when idle) and run a
    step, sending its outputs, until told to stop or the client is gone."""
    from ember.executor.rank import die_with_parent

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the client decides
    try:
        core = EngineCore.start(config, resolved, _LazyGrammars(resolved.model))
    except BaseException as e:
        conn.send(CoreFailed(f"{type(e).__name__}: {e}", _picklable(e)))
        return
    conn.send(CoreReady(core.model_info))
    try:
        while True:
            while conn.poll(0 if core.has_work() else IDLE_CHECK_S):
                command = conn.recv()
                if isinstance(command, Shutdown):
                    return
                reply = core.handle(command)
                if isinstance(reply, UtilityResult):
                    if reply.error is not None:
                        reply = UtilityResult(reply.call_id, error=_picklable(reply.error) or RuntimeError(
                            repr(reply.error)))
                    conn.send(reply)
                elif reply is not None:
                    conn.send(StepOutputs([reply]))
            if core.has_work():
                outputs = core.step()
                if outputs:
                    conn.send(StepOutputs(outputs))
            else:
                core.check_ranks()
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the client is gone
        pass
    except BaseException as e:
        logger.exception("engine core process failed")
        try:
            conn.send(CoreFailed(f"the engine stopped after an error: {e!r}", _picklable(e)))
        except OSError:
            pass
    finally:
        core.shutdown()


def _stop(conn: Connection, process: subprocess.Popen) -> None:
    try:
        conn.send(Shutdown())
    except OSError:
        pass
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class CoreProcess:
    """The client's side of a core in its own process; the same methods as ``EngineLoop``."""

    def __init__(self, config: EngineConfig, resolved: ResolvedConfig, handler: OutputHandler) -> None:
        self.handler = handler
        self.dead: EngineDeadError | None = None
        mine, theirs = socket.socketpair()
        self._process = subprocess.Popen(CORE_COMMAND + [str(theirs.fileno())], pass_fds=(theirs.fileno(),))
        theirs.close()
        self._conn = Connection(mine.detach())
        self._send_lock = threading.Lock()
        self._calls = itertools.count()
        self._pending: dict[int, Future] = {}
        try:
            self._conn.send((config, resolved))
            first = self._conn.recv()
        except (EOFError, OSError):
            code = self._process.wait()
            raise EngineDeadError(f"the engine core process ended while starting (exit code {code})") from None
        if isinstance(first, CoreFailed):
            self._process.wait()
            raise first.error or EngineDeadError(first.message)
        self.model_info: ModelInfo = first.model_info
        self._finalizer = weakref.finalize(self, _stop, self._conn, self._process)
        self._reader = threading.Thread(target=self._read, name="ember-core-outputs", daemon=True)
        self._reader.start()

    def _send(self, command: Any) -> None:
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        try:
            with self._send_lock:
                self._conn.send(command)
        except OSError as e:
            raise EngineDeadError(f"the engine core process is gone: {e}") from None

    def add(self, requests: list[EngineRequest]) -> None:
        self._send(AddRequests(tuple(requests)))

    def abort(self, request_id: str) -> None:
        if self.dead is None:
            try:
                self._send(AbortRequest(request_id))
            except EngineDeadError:
                pass

    def stats(self) -> EngineStats:
        return self.utility("stats")

    def is_alive(self) -> bool:
        return self.dead is None and self._process.poll() is None

    def utility(self, method: str, *args: Any) -> Any:
        """Run one of the core's ``UTILITIES`` between its steps and return the result (raised here if it raised)."""
        EngineCore.check_utility(method)
        done: Future = Future()
        call = UtilityCall(next(self._calls), method, args)
        self._pending[call.call_id] = done
        try:
            self._send(call)
            while True:
                try:
                    return done.result(timeout=0.5)
                except FutureTimeout:
                    if self.dead is not None:
                        raise EngineDeadError(str(self.dead)) from None
        finally:
            self._pending.pop(call.call_id, None)

    def shutdown(self) -> None:
        """Stop the core process (it stops its ranks); requests still open end with EngineDeadError."""
        if self.dead is None:
            self.dead = EngineDeadError("the engine was shut down")
        self._finalizer()
        self._reader.join(timeout=10)

    def _read(self) -> None:
        """The client's output thread: deliver each step's outputs (text, stop strings) while the core runs the
        next step; answer utility calls; on the core's end, fail every open request."""
        try:
            while True:
                message = self._conn.recv()
                if isinstance(message, StepOutputs):
                    for request_id, index in self.handler.process(message.outputs):
                        self._send(StopSample(request_id, index))
                elif isinstance(message, UtilityResult):
                    settle(self._pending, message)
                elif isinstance(message, CoreFailed):
                    self._fail(EngineDeadError(message.message))
                    return
        except (EOFError, OSError, EngineDeadError):
            try:
                code = self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
            self._fail(self.dead or EngineDeadError(f"the engine core process ended (exit code {code}). The engine "
                                                    "has stopped; create a new one"))
        except BaseException as e:  # an output sink that raised: never leave a consumer waiting
            logger.exception("engine output thread failed")
            self._fail(EngineDeadError(f"the engine's output thread failed: {e!r}"))
            self._finalizer()

    def _fail(self, error: EngineDeadError) -> None:
        if self.dead is None or self.dead is error:
            self.dead = error
        self.handler.fail_all(self.dead)
        for done in list(self._pending.values()):
            if not done.done():
                done.set_exception(self.dead)


def main() -> int:
    """``python -m ember.frontend.core_process FD``: serve the client at the other end of socket FD."""
    logging.basicConfig(level=logging.WARNING, format="[engine core] %(levelname)s %(message)s")
    conn = Connection(int(sys.argv[1]))
    try:
        config, resolved = conn.recv()
    except EOFError:  # the client ended before it sent the configuration
        return 1
    serve_core(conn, config, resolved)
    return 0


if __name__ == "__main__":
    sys.exit(main())
