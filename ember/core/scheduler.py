"""Continuous batching: every step picks the running sequences' next tokens and admits waiting prompts, within
max_num_seqs, max_num_batched_tokens and the free KV blocks.

Decoding sequences go first, then running prefills, in admission order, then new prompts. With chunked prefill a
prompt longer than what is left of the step's token budget is computed in chunks over several steps, so a long
prompt never stalls the sequences that are decoding. When the pool cannot give a running sequence its next block,
the most recently admitted sequence is preempted: its blocks are freed and it goes back to the front of the queue
to be recomputed (prompt plus what it generated so far), so greedy output is the same as without preemption.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ember.core.block_manager import BlockManager
from ember.core.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # tokens of each sequence computed this step
    preempted: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sibling: already holds shared blocks, runs from the next step."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        decoding = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decoding + prefilling:
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = self._chunk(seq, budget)
            if n == 0:
                continue
            while not self.bm.can_allocate(self.bm.blocks_needed(seq, seq.num_computed_tokens + n)):
                victim = self.running[-1]
                if victim in batch.seqs:  # scheduled earlier in this loop (a decode): take it out again
                    i = batch.seqs.index(victim)
                    budget += batch.num_tokens.pop(i)
                    batch.seqs.pop(i)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        if batch.preempted:  # the pool is full: admitting now would only preempt again
            return batch
        seats = sum(s.seats() for s in self.running)
        while self.waiting:
            seq = self.waiting[0]
            # prompt blocks already in the prefix cache; prompt logprobs need every prompt position computed
            hits = [] if seq.request.wants_prompt_logprobs else self.bm.lookup(seq)
            start = seq.num_computed_tokens + len(hits) * self.bm.block_size
            n = self._chunk(seq, budget, start)
            if n == 0 or seats + seq.seats() > self.max_num_seqs:
                break
            new_blocks = self.bm.blocks_for(start + n) - len(seq.block_table) - len(hits)
            if not self.bm.can_allocate(new_blocks + self.bm.revived(hits)):
                break
            self.waiting.popleft()
            cached = self.bm.take_cached(seq, hits)
            if seq.index == 0 and seq.request.num_cached_tokens is None:
                seq.request.num_cached_tokens = cached
            self.bm.allocate(seq, start + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
            seats += seq.seats()
        return batch

    def _chunk(self, seq: Sequence, budget: int, start: int | None = None) -> int:
        """Tokens of seq to compute this step: all that are left, or with chunked prefill what the budget allows."""
        left = seq.num_tokens - (seq.num_computed_tokens if start is None else start)
        if left <= budget:
            return left
        return budget if self.chunked_prefill else 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
