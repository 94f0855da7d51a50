"""The decoding strategy of a request of one sample: each step appends the sampled token, and ``check_stop`` ends
the sample (EOS, stop ids or sequences, max_tokens, max_model_len)."""

from __future__ import annotations

from ember.core.request import CoreRequest, Sequence
from ember.core.scheduler import Scheduler
from ember.core.stop import check_stop
from ember.protocol import EngineOutput, FinishReason, WorkerOutput


class OneSample:
    def __init__(self, scheduler: Scheduler, max_model_len: int, released: list[int]) -> None:
        self.scheduler, self.max_model_len = scheduler, max_model_len
        self.released = released  # the engine's list of finished handles (the worker drops their state)

    def collect(self, seq: Sequence, row: int, result: WorkerOutput, outputs: dict[str, EngineOutput]) -> None:
        token, lp = result.token_ids[row], result.logprobs[row]
        seq.token_ids.append(token)
        out = seq.request.output_in(outputs)
        sample = out.sample(seq.index)
        sample.new_token_ids.append(token)
        if lp is not None:
            sample.new_logprobs = (sample.new_logprobs or []) + [lp]
        stop = check_stop(seq.request.params, seq.token_ids, seq.num_prompt_tokens, self.max_model_len)
        if stop is not None:
            self.finish(seq, *stop, out)

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | list[int] | None,
               out: EngineOutput | None) -> None:
        """End the sample: its blocks freed, its handle released, its reason into out (if given)."""
        seq.finish(reason, stop_reason)
        self.scheduler.finish(seq)
        self.released.append(seq.seq_id)
        if out is not None:
            sample = out.sample(seq.index)
            sample.finish_reason, sample.stop_reason = reason, stop_reason

    def end(self, req: CoreRequest, reason: FinishReason, out: EngineOutput) -> None:
        for seq in req.seqs:
            if not seq.is_finished:
                self.finish(seq, reason, None, out)
            elif seq.finish_reason is reason:  # the scheduler ended it already (interrupted)
                out.sample(seq.index).finish_reason = reason
