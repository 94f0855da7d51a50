"""The after-step work, in one place: count the tokens a step computed (the scheduler registered their blocks in the
prefix cache as it scheduled them), hand prompt logprobs over, then give each sampled row to its request's decoding
strategy (``strategy.DecodingStrategy``): ``OneSample`` appends the token and ends the sample when ``check_stop``
says so; ``BeamSearch`` ranks the beams. Stop *strings* need text, so the front end checks them and finishes the
sample through ``EngineCore.stop_sample`` before the next step is scheduled.
"""

from __future__ import annotations

import logging

from ember.core.beam_search import BeamSearch
from ember.core.block_manager import BlockManager
from ember.core.one_sample import OneSample
from ember.core.request import CoreRequest, Sequence
from ember.core.scheduler import ScheduledBatch, Scheduler
from ember.core.speculator import Speculator
from ember.core.strategy import DecodingStrategy
from ember.protocol import EngineOutput, FinishReason, WorkerOutput

logger = logging.getLogger("ember")


class Decoding:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, max_model_len: int,
                 speculator: Speculator | None = None) -> None:
        self.released: list[int] = []  # handles of finished samples, for the worker to drop with the next batch
        self.one_sample = OneSample(scheduler, max_model_len, self.released, speculator)
        self.beam_search = BeamSearch(scheduler, block_manager, max_model_len, self.released)

    def strategy_of(self, req: CoreRequest) -> DecodingStrategy:
        return self.beam_search if req.beams is not None else self.one_sample

    def take_released(self) -> list[int]:
        released = list(self.released)
        self.released.clear()
        return released

    def after_step(self, batch: ScheduledBatch, sampled: list[Sequence], result: WorkerOutput,
                   outputs: dict[str, EngineOutput]) -> None:
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            seq.num_computed_tokens += n - len(seq.draft_token_ids)  # a draft's kept tokens count when collected
            req = seq.request
            out = req.output_in(outputs)
            chunk = result.prompt_logprobs.get(seq.seq_id)
            if chunk is not None:
                out.prompt_logprobs, out.prompt_logprobs_start = chunk, start
                if seq.num_computed_tokens >= seq.num_prompt_tokens:
                    req.prompt_logprobs_done = out.prompt_logprobs_done = True
            pooled = result.pooled.get(seq.seq_id) if result.pooled else None
            if pooled is not None:  # a pooling request's last prompt token was computed: it is done
                out.pooled = pooled
                self.one_sample.finish(seq, FinishReason.STOP, None, out)
        row = 0
        while row < len(sampled):  # a sequence verifying a draft of k tokens has k + 1 rows
            seq = sampled[row]
            drafted = result.drafts.get(seq.seq_id) if result.drafts else None
            if drafted is not None:  # the draft model's tokens in place of the placeholders the core sent
                seq.draft_token_ids = drafted
            width = 1 + len(seq.draft_token_ids)
            if not seq.is_finished:  # else a beam that had answered before, released by its search's step just now
                self.strategy_of(seq.request).collect(seq, row, result, outputs)
            row += width

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | list[int] | None,
               out: EngineOutput | None) -> None:
        """End one sample now (the front end found a stop string in its text)."""
        self.one_sample.finish(seq, reason, stop_reason, out)

    def interrupted(self, seq: Sequence, outputs: dict[str, EngineOutput]) -> None:
        """The policy gave seq up (the scheduler freed it): its request ends INTERRUPTED, keeping its tokens."""
        req = seq.request
        logger.warning("request %s: sample %d interrupted (it no longer fits the KV pool)", req.request_id, seq.index)
        self.released.append(seq.seq_id)
        self.strategy_of(req).end(req, FinishReason.INTERRUPTED, req.output_in(outputs))

    def abort(self, req: CoreRequest) -> EngineOutput:
        """End the request (a beam search: all of it) with ABORT."""
        out = req.output_in({})
        self.strategy_of(req).end(req, FinishReason.ABORT, out)
        return out

    def fail(self, req: CoreRequest, why: str, step_output: EngineOutput | None) -> EngineOutput:
        """End the request (all of it) with ERROR: the engine could not run it. The output replaces this step's
        (``step_output``), whose tokens are dropped; a sample that step ended ends with ERROR instead."""
        out = EngineOutput(req.request_id, error=why)
        self.strategy_of(req).end(req, FinishReason.ERROR, out)
        for s in step_output.samples if step_output is not None else ():
            if s.finish_reason is not None:
                out.sample(s.index).finish_reason = FinishReason.ERROR
        return out
