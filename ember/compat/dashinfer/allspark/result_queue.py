"""A request's ResultQueue: the engine thread feeds it native output deltas; any thread polls or blocks on it.

The status moves Init -> ContextFinished (first token) -> Generating -> GenerateFinished, or ends in
GenerateInterrupted / InternalError. A terminal status is reported once every token has been taken from the queue,
so DashInfer's loop (``Get()`` then ``GenerateStatus()``, break when finished) never drops the last tokens; to wait
for the end without taking tokens, use ``Engine.sync_request``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ember.compat.dashinfer.allspark.status import GenerateRequestStatus as S
from ember.outputs import RequestOutput


@dataclass(slots=True)
class GeneratedElements:
    """What one Get returns: the tokens generated since the previous Get, and their details."""

    ids_from_generate: list[int] = field(default_factory=list)
    log_probs_list: list[list[tuple[int, float]]] = field(default_factory=list)  # [token][top_logprobs] (id, lp)
    token_logprobs_list: list[float] = field(default_factory=list)  # the chosen token's logprob
    tensors_from_model_inference: list[Any] = field(default_factory=list)  # ember returns no hidden states
    prefix_cache_len: int = 0  # prompt tokens served by the prefix cache
    prefix_len_gpu: int = 0  # ... found in device memory
    prefix_len_cpu: int = 0  # ... copied back from the host tier


@dataclass(slots=True)
class RequestHandle:
    """Names one request for stop_request / release_request / sync_request."""

    model_name: str
    request_id: str


class ResultQueue:
    def __init__(self, request_id: str, prompt_len: int, top_logprobs: int = 0) -> None:
        self.request_id = request_id
        self._top_logprobs = top_logprobs
        self._cond = threading.Condition()
        self._status = S.Init
        self._final = S.GenerateFinished  # what a native "abort" means: stop_request sets Finished, stop_model
        self._pending = GeneratedElements()
        self._has_pending = False
        self._generated = 0
        self._prompt_len = prompt_len
        self._released = False
        self._error: BaseException | None = None
        self._last: RequestOutput | None = None
        self._last_token_time: float | None = None
        self.history: list[S] = [S.Init]  # every status the request went through, in order (for inspection)

    # ----- engine side -----

    def _set(self, status: S) -> None:
        if status is not self._status:
            self._status = status
            self.history.append(status)

    def _put(self, item: RequestOutput | BaseException) -> None:
        """The native engine's sink: one delta, or the exception that ended the request."""
        with self._cond:
            if isinstance(item, BaseException):
                self._error = item
                self._set(S.InternalError)
                self._cond.notify_all()
                return
            self._last = item
            out = item.outputs[0] if item.outputs else None
            if out is not None and out.token_ids:
                self._last_token_time = time.time()
                p = self._pending
                p.ids_from_generate.extend(out.token_ids)
                for pos in out.logprobs or []:  # {chosen token first, then the top ones}: id -> Logprob
                    p.token_logprobs_list.append(next(iter(pos.values())).logprob)
                    top = sorted((lp.rank, tid, lp.logprob) for tid, lp in pos.items() if lp.rank <= self._top_logprobs)
                    p.log_probs_list.append([(tid, lp) for _, tid, lp in top])
                p.prefix_cache_len, p.prefix_len_gpu, p.prefix_len_cpu = (
                    item.num_cached_tokens, item.num_device_cached_tokens, item.num_host_cached_tokens)
                self._has_pending = True
                self._generated += len(out.token_ids)
                self._set(S.ContextFinished if self._status is S.Init else S.Generating)
            if item.finished:
                reason = out.finish_reason if out is not None else None
                self._set(S.GenerateInterrupted if reason == "interrupted"
                          else self._final if reason == "abort" else S.GenerateFinished)
            self._cond.notify_all()

    def _mark_abort_as(self, status: S) -> None:
        with self._cond:
            self._final = status

    def _wait_finished(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._status.is_terminal or self._released, timeout)

    def _release(self) -> None:
        with self._cond:
            self._released = True
            self._pending, self._has_pending = GeneratedElements(), False
            self._cond.notify_all()

    # ----- user side (DashInfer's names) -----

    def GenerateStatus(self) -> S:
        """The request's status; never blocks. Terminal only once every token was taken (see the module doc)."""
        with self._cond:
            if self._status.is_terminal and self._has_pending:
                return next(s for s in reversed(self.history) if not s.is_terminal)
            status = self._status
        if not status.is_terminal:
            time.sleep(0)  # yield the GIL to the engine thread (see GetNoWait)
        return status

    def GeneratedLength(self) -> int:
        """Tokens generated so far (taken or not)."""
        with self._cond:
            return self._generated

    def RequestStatInfo(self) -> dict[str, Any]:
        """Timings (ms, and UNIX times) and token counts of this request."""
        with self._cond:
            last = self._last
        m = last.metrics if last is not None else None
        info: dict[str, Any] = {"context_token_length": self._prompt_len, "generated_token_length": self._generated,
                                "context_cached_length": last.num_cached_tokens if last else 0,
                                "context_cached_length_gpu": last.num_device_cached_tokens if last else 0,
                                "context_cached_length_cpu": last.num_host_cached_tokens if last else 0}
        if m is None:
            return info
        info["arrival_time"] = m.arrival_time
        info["first_token_time"] = m.first_token_time
        info["last_token_time"] = self._last_token_time
        if m.first_scheduled_time is not None:
            info["time_in_queue"] = (m.first_scheduled_time - m.arrival_time) * 1000
        if m.first_token_time is not None:
            info["time_to_first_token"] = (m.first_token_time - m.arrival_time) * 1000
            start = m.first_scheduled_time or m.arrival_time
            prefill = max(m.first_token_time - start, 1e-9)
            info["prefill_time_ms"] = prefill * 1000
            info["context_tps"] = (self._prompt_len - info["context_cached_length"]) / prefill
        if m.first_token_time is not None and self._last_token_time is not None:
            decode = self._last_token_time - m.first_token_time
            info["decode_time_ms"] = decode * 1000
            info["generate_tps"] = (self._generated - 1) / decode if decode > 0 else 0.0
        if m.finished_time is not None:
            info["finished_time"] = (m.finished_time - m.arrival_time) * 1000
        return info

    def _take(self) -> GeneratedElements | None:
        if not self._has_pending:
            return None
        out, self._pending, self._has_pending = self._pending, GeneratedElements(), False
        return out

    def Get(self) -> GeneratedElements | None:
        """Block until new tokens or the end; the tokens since the last Get, or None once finished and drained."""
        return self.GetWithTimeout(None)

    def GetWithTimeout(self, timeout_ms: int | None) -> GeneratedElements | None:
        """Like Get, but gives up after timeout_ms milliseconds (None: wait as long as it takes)."""
        with self._cond:
            self._cond.wait_for(lambda: self._has_pending or self._status.is_terminal or self._released,
                                None if timeout_ms is None else timeout_ms / 1000)
            return self._take()

    def GetNoWait(self) -> GeneratedElements | None:
        """The tokens since the last Get, or None if there are none; never blocks."""
        with self._cond:
            out = self._take()
        if out is None:
            # yield the GIL: DashInfer's engine runs in C++, so its users poll in tight loops; here such a loop would
            # hold the GIL the engine thread needs (measured: 20 polling threads, 92 s -> 0.3 s for 16 tokens each)
            time.sleep(0)
        return out

    def __repr__(self) -> str:
        return f"ResultQueue(request={self.request_id}, status={self._status.name}, generated={self._generated})"
