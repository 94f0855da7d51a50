"""A request: one prompt, its sampling parameters, its n sequences and the sink its outputs go to."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ember.core.sequence import Sequence, SequenceStatus
from ember.detokenizer import IncrementalDetokenizer
from ember.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from ember.sampling_params import SamplingParams
from ember.tokenizer import Tokenizer

OutputSink = Callable[[RequestOutput | BaseException], None]


class Request:
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "sink", "metrics", "seqs", "tokenizer",
                 "prompt_logprobs", "pending_prompt_logprobs", "prompt_logprobs_sent", "finished",
                 "num_cached_tokens", "num_host_cached_tokens", "max_num_tokens")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer | None, sink: OutputSink, max_num_tokens: int | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.sink = sink
        self.tokenizer = tokenizer
        self.metrics = RequestMetrics(arrival_time=time.time(), num_prompt_tokens=len(prompt_token_ids))
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.pending_prompt_logprobs: list[PositionLogprobs | None] = []  # filled chunk by chunk
        self.prompt_logprobs_sent = False
        self.finished = False
        self.num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache when first scheduled
        self.num_host_cached_tokens = 0  # of those, the ones copied back from the host tier
        self.max_num_tokens = max_num_tokens  # prompt + max_tokens, capped by max_model_len
        self.seqs: list[Sequence] = [self._new_sequence(0, pending_fork=params.n - 1)]

    def _new_sequence(self, index: int, pending_fork: int = 0) -> Sequence:
        p = self.params
        generator = None
        if p.seed is not None:
            generator = torch.Generator().manual_seed(p.seed + index)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids, p.stop, p.skip_special_tokens,
                                           p.include_stop_str_in_output)
        return Sequence(self, index, list(self.prompt_token_ids), generator, detok, pending_fork,
                        max_num_tokens=self.max_num_tokens)

    def fork(self, parent: Sequence) -> list[Sequence]:
        """Create the n - 1 siblings of the first sequence; they start from the prompt."""
        children = [self._new_sequence(i) for i in range(1, parent.pending_fork + 1)]
        parent.pending_fork = 0
        self.seqs.extend(children)
        return children

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None

    def all_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs) and not any(s.pending_fork for s in self.seqs)

    def take_delta(self) -> RequestOutput | None:
        """What changed since the last call, as a RequestOutput delta; None if nothing did."""
        outs = []
        for s in self.seqs:
            if not (s.new_token_ids or (s.is_finished and not s.final_sent)):
                continue
            text = s.detokenizer.delta(s.is_finished) if s.detokenizer is not None else ""
            wants_lp = self.params.logprobs is not None
            outs.append(CompletionOutput(
                index=s.index, text=text, token_ids=s.new_token_ids,
                logprobs=s.new_logprobs if wants_lp else None,
                cumulative_logprob=s.cumulative_logprob if wants_lp else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason))
            s.new_token_ids, s.new_logprobs = [], []
            s.final_sent = s.is_finished
        prompt_lp = None
        if self.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            prompt_lp, self.prompt_logprobs_sent = self.prompt_logprobs, True
        done = self.all_finished()
        if not outs and prompt_lp is None and not (done and not self.finished):
            return None
        if done:
            self.finished = True
            self.metrics.finished_time = time.time()
        self.metrics.num_generated_tokens = sum(s.num_output_tokens for s in self.seqs)
        cached = self.num_cached_tokens or 0
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, done, prompt_lp,
                             self.metrics, cached, cached - self.num_host_cached_tokens, self.num_host_cached_tokens)

    def finish_all(self, reason: str) -> None:
        """End every sample (siblings not yet forked included) with this finish reason."""
        for s in list(self.seqs):
            if s.pending_fork:
                self.fork(s)
        for s in self.seqs:
            if not s.is_finished:
                s.status, s.finish_reason = SequenceStatus.FINISHED, reason
