"""The after-step work, in one place: count the tokens a step computed (the scheduler registered their blocks in the
prefix cache as it scheduled them), append sampled tokens and end the samples that stop (``stop.check_stop``). Stop *strings* need text, so the front end
checks them and finishes the sample through ``EngineCore.stop_sample`` before the next step is scheduled.

``Decoding`` is the strategy for one sample a request (n > 1 fans out in the front end); beam-search requests hand
their rows to ``BeamSearch`` (its own rules for new beams and for finishing).
"""

from __future__ import annotations

import logging

from ember.core.beam_search import BeamSearch
from ember.core.block_manager import BlockManager
from ember.core.request import CoreRequest, Sequence
from ember.core.scheduler import ScheduledBatch, Scheduler
from ember.core.stop import check_stop
from ember.protocol import EngineOutput, FinishReason, TokenLogprobs, WorkerOutput

logger = logging.getLogger("ember")


class Decoding:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, max_model_len: int) -> None:
        self.scheduler = scheduler
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.released: list[int] = []  # handles of finished samples, for the worker to drop with the next batch
        self.beam_search = BeamSearch(scheduler, block_manager, max_model_len, self.released)

    def take_released(self) -> list[int]:
        released = list(self.released)
        self.released.clear()
        return released

    def after_step(self, batch: ScheduledBatch, sampled: list[Sequence], result: WorkerOutput,
                   outputs: dict[str, EngineOutput]) -> None:
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            seq.num_computed_tokens += n
            req = seq.request
            out = req.output_in(outputs)
            chunk = result.prompt_logprobs.get(seq.seq_id)
            if chunk is not None:
                out.prompt_logprobs, out.prompt_logprobs_start = chunk, start
                if seq.num_computed_tokens >= seq.num_prompt_tokens:
                    req.prompt_logprobs_done = out.prompt_logprobs_done = True
        for i, (seq, token, lp) in enumerate(zip(sampled, result.token_ids, result.logprobs)):
            if seq.request.beams is not None:
                self.beam_search.collect(seq, result.beams[i], outputs)
            else:
                self.append(seq, token, lp, seq.request.output_in(outputs))

    def append(self, seq: Sequence, token: int, lp: TokenLogprobs | None, out: EngineOutput) -> None:
        """Add a sampled token, finishing the sample if it stops."""
        seq.token_ids.append(token)
        sample = out.sample(seq.index)
        sample.new_token_ids.append(token)
        if lp is not None:
            sample.new_logprobs = (sample.new_logprobs or []) + [lp]
        stop = check_stop(seq.request.params, seq.token_ids, seq.num_prompt_tokens, self.max_model_len)
        if stop is not None:
            self.finish(seq, *stop, out)

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | list[int] | None,
               out: EngineOutput | None) -> None:
        seq.finish(reason, stop_reason)
        self.scheduler.finish(seq)
        self.released.append(seq.seq_id)
        if out is not None:
            sample = out.sample(seq.index)
            sample.finish_reason, sample.stop_reason = reason, stop_reason

    def interrupted(self, seq: Sequence, outputs: dict[str, EngineOutput]) -> None:
        """The policy gave seq up (the scheduler freed it): it ends INTERRUPTED, keeping its tokens."""
        req = seq.request
        logger.warning("request %s: sample %d interrupted (it no longer fits the KV pool)", req.request_id, seq.index)
        out = req.output_in(outputs)
        self.released.append(seq.seq_id)
        if req.beams is not None:  # one beam cannot go on: the search cannot either
            self.beam_search.end(req, FinishReason.INTERRUPTED, out)
            return
        out.sample(seq.index).finish_reason = FinishReason.INTERRUPTED

    def abort(self, req: CoreRequest) -> EngineOutput:
        """End the request's sample (a beam search: all of it) with ABORT."""
        out = req.output_in({})
        if req.beams is not None:
            self.beam_search.end(req, FinishReason.ABORT, out)
            return out
        for s in req.seqs:
            if not s.is_finished:
                self.finish(s, FinishReason.ABORT, None, out)
        return out
