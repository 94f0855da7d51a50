"""Turns the engine core's records into what users read: text (incremental, UTF-8 safe, stop strings cut),
logprobs with decoded tokens, metrics, and ``RequestOutput`` deltas put into each request's sink.

It runs on the engine loop's thread, between steps, so a stop string found in a sample's text finishes that sample
before the next step is scheduled (the core cannot see text). A request of n > 1 samples went to the core as n
requests (``parallel_sampling``): their outputs are routed back to it as samples 0..n-1. A request ends when all n
of its samples have a finish reason; then its id is free again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from ember.errors import BadRequestError, RequestFailedError
from ember.frontend.detokenizer import IncrementalDetokenizer
from ember.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from ember.protocol import EngineOutput, FinishReason, TokenLogprobs
from ember.sampling_params import SamplingParams
from ember.tokenizer import Tokenizer

logger = logging.getLogger("ember")

OutputSink = Callable[[RequestOutput | EmbeddingRequestOutput | BaseException], None]


class SampleState:
    __slots__ = ("detokenizer", "num_tokens", "cumulative_logprob", "finish_reason", "token_ids")

    def __init__(self, detokenizer: IncrementalDetokenizer, keeps_tokens: bool = False) -> None:
        self.detokenizer = detokenizer
        self.num_tokens = 0
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.token_ids: list[int] | None = [] if keeps_tokens else None  # the completion (a predicted request's)


class RequestState:
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "sink", "metrics", "samples",
                 "prompt_logprobs", "pending_prompt_logprobs", "num_cached_tokens", "num_host_cached_tokens",
                 "core_ids", "pools", "prediction")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 sink: OutputSink, core_ids: list[str] | None = None, pools: bool = False,
                 prediction: list[int] | None = None) -> None:
        self.request_id = request_id
        self.prediction = prediction  # OpenAI's predicted output, tokenized: counted against each completion
        self.pools = pools  # a pooling request: one EmbeddingRequestOutput when it ends
        self.core_ids = core_ids or [request_id]  # the core's requests: sample i of n > 1 is core_ids[i]
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.sink = sink
        self.metrics = RequestMetrics(arrival_time=time.time(), num_prompt_tokens=len(prompt_token_ids))
        self.samples: dict[int, SampleState] = {}
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None  # complete, not yet sent
        self.pending_prompt_logprobs: list[PositionLogprobs | None] = []  # filled chunk by chunk
        self.num_cached_tokens = 0
        self.num_host_cached_tokens = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.routes: dict[str, tuple[RequestState, int]] = {}  # core request id -> its request, its first sample
        self._lock = threading.Lock()  # states is added to by callers, emptied by the engine thread

    def register(self, states: list[RequestState]) -> None:
        """Claim the requests' ids and their core requests' ids (caller's thread); raises BadRequestError for one
        already in use."""
        with self._lock:
            ids = [s.request_id for s in states]
            core = [c for s in states for c in s.core_ids]
            dup = [i for i in ids if i in self.states] + [c for c in core if c in self.routes]
            if dup or len(set(ids)) != len(ids) or len(set(core)) != len(core):
                raise BadRequestError(f"request_id={(dup or ids)[0]!r} is already in use: request ids must be "
                                      "unique among the requests in flight")
            for s in states:
                self.states[s.request_id] = s
                for i, c in enumerate(s.core_ids):
                    self.routes[c] = (s, i)

    def forget(self, request_ids: list[str]) -> None:
        with self._lock:
            for rid in request_ids:
                st = self.states.pop(rid, None)
                for c in st.core_ids if st is not None else ():
                    self.routes.pop(c, None)

    def core_ids(self, request_id: str) -> list[str]:
        """The core requests of a request in flight (``[request_id]`` when it is not in flight)."""
        st = self.states.get(request_id)
        return list(st.core_ids) if st is not None else [request_id]

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            states, self.states = list(self.states.values()), {}
        for st in states:
            st.sink(error)

    def process(self, outputs: list[EngineOutput]) -> list[tuple[str, int]]:
        stops: list[tuple[str, int]] = []
        for out in outputs:
            route = self.routes.get(out.request_id)
            if route is None:
                continue
            if out.error is not None:  # the request could not run: it ends with the reason (its other samples too)
                logger.warning("request %s could not be run: %s", route[0].request_id, out.error)
                self.forget([route[0].request_id])
                route[0].sink(RequestFailedError(f"request {route[0].request_id!r}: {out.error}"))
            else:
                self._one(route[0], out, stops, route[1])
        return stops

    def _one(self, st: RequestState, out: EngineOutput, stops: list[tuple[str, int]], first: int) -> None:
        """One core request's output; its sample j is the request's sample first + j."""
        if st.pools:
            self._pooled(st, out)
            return
        params, metrics = st.params, st.metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = out.first_scheduled_time
        if out.num_cached_tokens is not None and first == 0:  # the request's figures are its first sample's
            st.num_cached_tokens, st.num_host_cached_tokens = out.num_cached_tokens, out.num_host_cached_tokens
        if out.prompt_logprobs is not None:
            if out.prompt_logprobs_start == 0:  # the prompt's first token has no logprob; a recompute starts over
                st.pending_prompt_logprobs = [None]
            targets = st.prompt_token_ids[out.prompt_logprobs_start + 1:]
            st.pending_prompt_logprobs.extend(self._position(t, lp) for t, lp in zip(targets, out.prompt_logprobs))
            if out.prompt_logprobs_done:
                st.prompt_logprobs = st.pending_prompt_logprobs
        wants_lp = params.logprobs is not None
        completions = []
        for so in out.samples:
            index = first + so.index
            ss = st.samples.get(index)
            if ss is None:
                ss = st.samples[index] = SampleState(self._detokenizer(st), st.prediction is not None)
            elif ss.finish_reason is not None:  # it ended here (a stop string) and a core in its own process,
                continue  # told one step late, sent one more token: not the answer, and the sample stays ended
            reason, stop_reason, stop_str = so.finish_reason, so.stop_reason, None
            metrics.num_draft_tokens += so.num_draft_tokens
            metrics.num_accepted_draft_tokens += so.num_accepted_draft_tokens
            new_lps: list[PositionLogprobs] = []
            kept = so.new_token_ids  # up to the token that completes a stop string: the rest is not the answer
            # a stop token (EOS, a stop token id) is in token_ids but not in the text, as in vLLM (it shows when
            # special tokens are not skipped: a tool-call parser's request)
            stop_token = len(kept) - 1 if reason is FinishReason.STOP and not isinstance(so.stop_reason, list) \
                and not params.include_stop_str_in_output else -1
            for j, token in enumerate(so.new_token_ids):
                ss.num_tokens += 1
                if metrics.first_token_time is None:
                    metrics.first_token_time = time.time()
                if so.new_logprobs is not None:
                    lp = so.new_logprobs[j]
                    ss.cumulative_logprob += lp.logprob
                    new_lps.append(self._position(token, lp))
                if j == stop_token:
                    break
                stop_str = ss.detokenizer.add(token, check_stop=ss.num_tokens >= params.min_tokens)
                if stop_str is not None:
                    kept = so.new_token_ids[:j + 1]
                    break
            # the core's token stops come first, then a stop string, then the length limit
            if stop_str is not None and reason in (None, FinishReason.LENGTH):
                if reason is None:
                    stops.append((out.request_id, so.index))
                reason, stop_reason = FinishReason.STOP, stop_str
            if reason is not None and reason is not FinishReason.ABORT and stop_str is None:
                ss.detokenizer.flush_incomplete()
            ss.finish_reason = reason
            if ss.token_ids is not None:
                ss.token_ids.extend(kept)
            text = ss.detokenizer.delta(reason is not None)
            completions.append(CompletionOutput(
                index=index, text=text, token_ids=list(kept), logprobs=new_lps if wants_lp else None,
                cumulative_logprob=ss.cumulative_logprob if wants_lp else so.cumulative_logprob,
                finish_reason=reason.value if reason is not None else None, stop_reason=stop_reason))
        prompt_lp, st.prompt_logprobs = st.prompt_logprobs, None
        done = len(st.samples) == params.n and all(s.finish_reason is not None for s in st.samples.values())
        if not completions and prompt_lp is None and not done:
            return
        if done:
            metrics.finished_time = time.time()
            if st.prediction is not None:
                found = sum(_in_completion(st.prediction, s.token_ids or []) for s in st.samples.values())
                metrics.accepted_prediction_tokens = found
                metrics.rejected_prediction_tokens = len(st.prediction) * len(st.samples) - found
            self.forget([st.request_id])
        metrics.num_generated_tokens = sum(s.num_tokens for s in st.samples.values())
        cached, host = st.num_cached_tokens, st.num_host_cached_tokens
        completions.sort(key=lambda c: c.index)
        st.sink(RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, completions, done, prompt_lp, metrics,
                              cached, cached - host, host))

    def _pooled(self, st: RequestState, out: EngineOutput) -> None:
        """A pooling request ends in one output: its vector, or (aborted, interrupted) an empty one."""
        reason = next((s.finish_reason for s in out.samples if s.finish_reason is not None), None)
        if out.pooled is None and reason is None:
            return
        st.metrics.first_scheduled_time = st.metrics.first_scheduled_time or out.first_scheduled_time
        st.metrics.finished_time = time.time()
        self.forget([st.request_id])
        st.sink(EmbeddingRequestOutput(st.request_id, st.prompt_token_ids, EmbeddingOutput(out.pooled or []), True,
                                       (reason or FinishReason.STOP).value, st.metrics))

    def _detokenizer(self, st: RequestState) -> IncrementalDetokenizer:
        p = st.params
        return IncrementalDetokenizer(self.tokenizer, st.prompt_token_ids, p.stop, p.skip_special_tokens,
                                      p.include_stop_str_in_output)

    def _position(self, token: int, lp: TokenLogprobs) -> PositionLogprobs:
        decode = self.tokenizer.decode
        out = {token: Logprob(lp.logprob, lp.rank, decode([token], skip_special_tokens=False))}
        for r, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
            if t not in out:
                out[t] = Logprob(v, r, decode([t], skip_special_tokens=False))
        return out


def _in_completion(prediction: list[int], completion: list[int]) -> int:
    """OpenAI's accepted_prediction_tokens for one completion: "the number of tokens in the prediction that appeared
    in the completion", each completion token matching at most one prediction token (the multisets' overlap). Linear
    in both lengths, where an alignment (difflib) takes quadratic time on a prediction of one repeated token. Not the
    drafted tokens kept: those include lookup and draft-model drafts and tokens past a stop string."""
    have = Counter(completion)
    return sum(min(n, have[t]) for t, n in Counter(prediction).items())
