"""The decoding strategy of a request of one sample: each step appends the sampled token (with speculative decoding,
the drafted tokens the sampler agreed with, then its own next one), and ``check_stop`` ends the sample (EOS, stop
ids or sequences, max_tokens, max_model_len)."""

from __future__ import annotations

from ember.core.request import CoreRequest, Sequence
from ember.core.scheduler import Scheduler
from ember.core.speculator import Speculator, kept_tokens
from ember.core.stop import check_stop
from ember.protocol import EngineOutput, FinishReason, WorkerOutput


class OneSample:
    def __init__(self, scheduler: Scheduler, max_model_len: int, released: list[int],
                 speculator: Speculator | None = None) -> None:
        self.scheduler, self.max_model_len = scheduler, max_model_len
        self.released = released  # the engine's list of finished handles (the worker drops their state)
        self.speculator = speculator

    def collect(self, seq: Sequence, row: int, result: WorkerOutput, outputs: dict[str, EngineOutput]) -> None:
        """Rows row .. row + k hold the tokens sampled after the last token and after each of the k drafted ones:
        the draft is kept up to the first token the sampler disagrees with, and the sampler's token there (or
        after the whole draft) follows; every token kept is checked against the stop rules in turn."""
        draft = seq.draft_token_ids
        sampled = result.token_ids[row:row + 1 + len(draft)]
        kept = kept_tokens(draft, sampled)
        out = seq.request.output_in(outputs)
        sample = out.sample(seq.index)
        if draft:
            seq.num_computed_tokens += kept  # their KV was written by this step; the rest is overwritten later
            seq.draft_token_ids = []
            sample.num_draft_tokens += len(draft)
            sample.num_accepted_draft_tokens += kept
            if self.speculator is not None:
                self.speculator.record(seq, len(draft), kept)
        params = seq.request.params
        for j in range(kept + 1):
            token, lp = sampled[j], result.logprobs[row + j]
            seq.token_ids.append(token)
            sample.new_token_ids.append(token)
            if lp is not None:
                sample.new_logprobs = (sample.new_logprobs or []) + [lp]
            stop = check_stop(params, seq.token_ids, seq.num_prompt_tokens, self.max_model_len)
            if stop is not None:
                self.finish(seq, *stop, out)
                return

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | list[int] | None,
               out: EngineOutput | None) -> None:
        """End the sample: its blocks freed, its handle released, its reason into out (if given)."""
        seq.finish(reason, stop_reason)
        self.scheduler.finish(seq)
        self.released.append(seq.seq_id)
        if self.speculator is not None:
            self.speculator.finished(seq)
        if out is not None:
            sample = out.sample(seq.index)
            sample.finish_reason, sample.stop_reason = reason, stop_reason

    def end(self, req: CoreRequest, reason: FinishReason, out: EngineOutput) -> None:
        for seq in req.seqs:
            if not seq.is_finished:
                self.finish(seq, reason, None, out)
            elif seq.finish_reason is reason:  # the scheduler ended it already (interrupted)
                out.sample(seq.index).finish_reason = reason
