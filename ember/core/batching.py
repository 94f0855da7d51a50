"""The scheduler's choice for a step, written as the workers' ``SchedulerOutput``: a sequence the workers do not
hold goes out in full (``NewSequence``), the others as the tokens and blocks appended since they last ran. Rows are
ordered decodes first, then prefill chunks."""

from __future__ import annotations

from ember.core.lora_slots import LoRASlots
from ember.core.request import Sequence
from ember.core.scheduler import ScheduledBatch
from ember.protocol import NewSequence, SchedulerOutput


class StepWriter:
    """Remembers, per sequence the workers hold, how many of its tokens and blocks they have."""

    def __init__(self) -> None:
        # handle -> [tokens sent, blocks sent, 1 when its last step verified a draft (the worker's computed count
        # must be reset to the core's)]
        self.sent: dict[int, list[int]] = {}

    def write(self, batch: ScheduledBatch, finished: list[int],
              loras: LoRASlots | None = None) -> tuple[SchedulerOutput, list[Sequence]]:
        """The step's message, and the sequences that sample (aligned with the workers' sampling rows: a sequence
        verifying a draft of k tokens samples k + 1 rows and stands in k + 1 consecutive entries).
        ``finished``: handles the workers may drop with their sampling state. A preempted sequence is dropped too
        (its blocks are gone) and sent in full when it resumes."""
        out = SchedulerOutput(copies=batch.copies, finished=finished, encode=batch.encode,
                              encoder_free=batch.encoder_free)
        sent = self.sent
        for handle in finished:
            sent.pop(handle, None)
        for seq in batch.preempted:
            if sent.pop(seq.seq_id, None) is not None:
                out.preempted.append(seq.seq_id)
        if loras is not None:
            out.lora_loads = loras.take_loads()
        sampled: list[Sequence] = []
        for i in sorted(range(len(batch)), key=lambda i: batch.num_tokens[i] != 1):  # decodes first
            seq, n = batch.seqs[i], batch.num_tokens[i]
            handle, tokens, table = seq.seq_id, seq.token_ids, seq.block_table
            mark = sent.get(handle)
            if mark is None:
                out.new.append(self._new(seq, loras))
                mark = sent[handle] = [len(tokens), len(table), 0]
            else:
                if mark[2]:
                    out.num_computed_tokens[handle] = seq.num_computed_tokens
                    mark[2] = 0
                if len(tokens) > mark[0]:
                    out.new_token_ids[handle] = tokens[mark[0]:]
                    mark[0] = len(tokens)
                if len(table) > mark[1]:
                    out.new_block_ids[handle] = table[mark[1]:]
                    mark[1] = len(table)
            out.handles.append(handle)
            out.num_tokens.append(n)
            draft = seq.draft_token_ids
            if draft:  # the scheduler kept it: n = 1 + len(draft)
                out.draft_token_ids[handle] = list(draft)
                mark[2] = 1
                sampled.extend([seq] * n)
            elif seq.num_computed_tokens + n == len(tokens) and not seq.request.pools:
                sampled.append(seq)
        return out, sampled

    @staticmethod
    def _new(seq: Sequence, loras: LoRASlots | None) -> NewSequence:
        req = seq.request
        lora_id = req.lora_id
        k = req.params.prompt_logprobs if seq.index == 0 and req.wants_prompt_logprobs else None
        return NewSequence(seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens, seq.num_computed_tokens,
                           list(seq.block_table), req.params, req.seed_of(seq),
                           loras.slot_of(lora_id) if loras is not None and lora_id else -1, k,
                           req.record.pooling, tuple(m.placeholder for m in req.record.mm_inputs))
