"""Continuous batching: every step picks the running sequences' next tokens and admits waiting prompts, within
max_num_seqs, max_num_batched_tokens and the free KV blocks, first come first served.

Decoding sequences go first, then running prefills, in admission order, then new prompts. With chunked prefill a
prompt longer than what is left of the step's token budget is computed in chunks over several steps, so a long
prompt never stalls the sequences that are decoding. ``max_num_prefill_seqs`` (EasyDeL's max_concurrent_prefill)
caps the prompts prefilled in one step, running chunks included.

Two policies (TensorRT-LLM's names):
- ``max_utilization`` admits greedily. When the pool cannot give a running sequence its next block, a beam that
  has answered and waits for its siblings is preempted, else the most recently admitted sequence: its blocks are
  freed (their full blocks stay in the prefix cache, and on an engine with a host tier they move there when the
  device needs the room: a swap) and it goes back to the front of the queue (behind the waiting beams of a search
  it gave way to: a search's beams advance together), ahead of new arrivals, to be recomputed (prompt plus what it
  generated so far), so greedy output is the same as without preemption.
- ``guaranteed_no_evict`` admits a request only when the blocks for its prompt plus max_tokens (for every one of
  its n samples) can be reserved on top of what the running requests have reserved; nothing is ever preempted.

A sequence that cannot get a block even with every other sequence preempted can never finish: it is given up and
ends with finish_reason "interrupted", keeping what it generated.

LoRA: a prompt whose adapter finds no slot (every slot holds an adapter that running sequences use) keeps its place
and the prompts behind it are still admitted, in order, when they need no adapter or a resident one (vLLM skips
such requests the same way). So that it is not starved, one in-use slot is drained for it: the least recently used
one when the first prompt is passed over; no prompt behind it is admitted with that slot's adapter until it has
its slot. Its wait is thus bounded by the running sequences of one adapter, which all end.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ember.config import SCHEDULING_POLICIES
from ember.core.block_manager import BlockManager
from ember.core.encoder_cache import EncoderCache
from ember.core.lora_slots import LoRASlots
from ember.core.request import CoreRequest, Sequence
from ember.errors import ConfigError
from ember.protocol import BlockCopy, FinishReason, MultiModalInput, RequestStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # tokens of each sequence computed this step
    preempted: list[Sequence] = field(default_factory=list)
    interrupted: list[Sequence] = field(default_factory=list)  # given up: the after-step work ends them
    copies: list[BlockCopy] = field(default_factory=list)  # KV block copies to run first
    encode: list[MultiModalInput] = field(default_factory=list)  # images the workers encode first
    encoder_free: list[str] = field(default_factory=list)  # encodings they drop

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True, policy: str = "max_utilization",
                 max_num_prefill_seqs: int | None = None, loras: LoRASlots | None = None,
                 encoder: EncoderCache | None = None) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy={policy!r} is not supported: use one of "
                              f"{', '.join(SCHEDULING_POLICIES)}")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.policy = policy
        self.max_num_prefill_seqs = max_num_prefill_seqs  # None: no limit beyond the token budget and the seats
        self.loras = loras  # LoRA: the adapter slots; a prompt waits while its adapter cannot get one
        self.encoder = encoder  # vision-language models: the step's encoder budget and the workers' encodings
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.draining: int | None = None  # LoRA: the adapter whose slot a passed-over prompt waits for
        self.num_preemptions = 0
        self.num_interrupted = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_preempted_waiting(self) -> int:
        """Preempted sequences waiting to resume (they sit at the front of the queue)."""
        return sum(1 for s in self.waiting if s.num_output_tokens > 0)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A new beam: already holds its parent's blocks, runs from the next step."""
        seq.status = RequestStatus.RUNNING
        self.running.append(seq)

    def requeue(self, seq: Sequence) -> None:
        """A sequence without KV that must run before new arrivals (a beam whose parent was preempted)."""
        seq.status = RequestStatus.WAITING
        self.waiting.appendleft(seq)

    # ----- guaranteed_no_evict bookkeeping -----

    def _reserve(self, seq: Sequence) -> int:
        """Blocks seq may still take from the pool before it finishes (a beam search's first sequence: its beams')."""
        most = self.bm.request_blocks(seq.num_prompt_tokens, seq.max_num_tokens, seq.seats())
        return most - min(len(seq.block_table), self.bm.blocks_for(seq.max_num_tokens))

    def _reserved(self) -> int:
        return sum(self._reserve(s) for s in self.running)

    # ----- one step -----

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        if self.encoder is not None:
            self.encoder.begin_step()
        decoding = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decoding + prefilling:
            if seq.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if seq in prefilling and not self._may_prefill(batch):
                continue
            n = self._chunk(seq, budget)
            if n == 0:
                continue
            need = self.bm.blocks_needed(seq, seq.num_computed_tokens + n)
            while not self.bm.can_allocate(need):
                victim = self._victim()
                if victim is seq and len(self.running) == 1:  # alone and still too big: it can never finish
                    self._interrupt(seq, batch)
                    break
                if victim in batch.seqs:  # scheduled earlier in this loop (a decode): take it out again
                    i = batch.seqs.index(victim)
                    budget += batch.num_tokens.pop(i)
                    batch.seqs.pop(i)
                # another request's sequence queues behind seq's waiting beams, which advance together with seq
                self._preempt(victim, at=0 if victim.request is seq.request else self._siblings_first(seq.request))
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not RequestStatus.RUNNING:
                continue
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            self._encode(seq, seq.num_computed_tokens, n)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        for seq, n in zip(batch.seqs, batch.num_tokens):  # no preemption from here on (BlockManager.commit)
            self.bm.commit(seq, seq.num_computed_tokens + n)
        if not batch.preempted:  # else the pool is full: admitting now would only preempt again
            budget = self._admit(batch, budget)
            if not batch.seqs and not batch.interrupted and self.waiting:
                self._unblock(batch, budget)
        self._add_drafts(batch, budget)
        batch.copies = self.bm.take_copies()
        if self.encoder is not None:
            batch.encode, batch.encoder_free = self.encoder.encode, self.encoder.free
        return batch

    def _unblock(self, batch: ScheduledBatch, budget: int) -> None:
        """Nothing runs and a prompt waits: the running sequences are beams that answered and wait for siblings that
        cannot get blocks (two searches can hold the pool so, each waiting on the other). Such beams are preempted,
        other requests' first, most recent first, each behind the queue's head and its waiting siblings
        (``_siblings_first``), until the head is admitted; their answers stay with their search, which recomputes
        the KV its next beams need."""
        head = self.waiting[0].request
        at = self._siblings_first(head)
        idle = [s for s in reversed(self.running) if _answered(s)]
        for victim in [s for s in idle if s.request is not head] + [s for s in idle if s.request is head]:
            self._preempt(victim, at=at)
            batch.preempted.append(victim)
            self._admit(batch, budget)
            if batch.seqs or batch.interrupted:
                return

    def _siblings_first(self, req: CoreRequest) -> int:
        """Move req's waiting sequences (beams of one search) to the front of the queue, in their order; how many.
        A search advances only once all its beams have answered, so they are admitted together: a victim queued
        between them became the next head, and two searches could take turns for ever, each preempting the other's
        answered beam before its own second beam got a turn."""
        siblings = [s for s in self.waiting if s.request is req]
        for s in siblings:
            self.waiting.remove(s)
        self.waiting.extendleft(reversed(siblings))
        return len(siblings)

    def _admit(self, batch: ScheduledBatch, budget: int) -> int:
        """Admit waiting prompts in order while seats, budget and blocks allow, passing over (in place) those whose
        adapter has no slot (the module's LoRA rule); the budget left."""
        seats = sum(s.seats() for s in self.running)
        reserved = self._reserved() if self.policy == "guaranteed_no_evict" else 0
        i, passed = 0, False  # the queue position looked at; whether a prompt was passed over for its adapter
        while i < len(self.waiting):
            seq = self.waiting[i]
            if self.bm.blocks_for(seq.num_tokens) > self.bm.num_blocks:  # grew past the whole pool while preempted
                del self.waiting[i]
                self._interrupt(seq, batch)
                continue
            # prompt blocks already in the prefix cache; prompt logprobs and pooling (a mean reads every
            # position's hidden state) need every prompt position computed
            req = seq.request
            hit = self.bm.lookup(seq) if not req.wants_prompt_logprobs and not req.pools else None
            start = seq.num_computed_tokens + (hit.num_blocks * self.bm.block_size if hit else 0)
            n = self._chunk(seq, budget, start)
            if n == 0 or seats + seq.seats() > self.max_num_seqs or not self._may_prefill(batch):
                break
            lora_id = seq.request.lora_id if self.loras is not None else 0
            in_use = {s.request.lora_id for s in self.running} if lora_id else set()
            if lora_id and (passed and lora_id == self.draining or not self.loras.can_take(lora_id, in_use)):
                # every slot holds an adapter that running sequences use, or this one's slot is drained for a prompt
                # ahead: it keeps its place; the first prompt passed over has a slot drained for it
                if not passed and self.draining not in in_use:
                    self.draining = self.loras.least_recent(in_use)
                passed = True
                i += 1
                continue
            taken = self.bm.blocks_to_take(hit) if hit else 0
            if self.policy == "guaranteed_no_evict":  # the free blocks it takes now plus all it may take later
                need = taken + self._reserve(seq) - (hit.num_blocks if hit else 0)
                if need + reserved > self.bm.num_free:
                    break
            new_blocks = self.bm.blocks_for(start + n) - len(seq.block_table) - (hit.num_blocks if hit else 0)
            if not self.bm.can_allocate(new_blocks + taken):
                break
            del self.waiting[i]
            if hit is not None:
                device, host = self.bm.take_cached(seq, hit)
                seq.num_computed_tokens = device + host
                if seq.index == 0 and seq.request.num_cached_tokens is None:
                    seq.request.num_cached_tokens = device + host
                    seq.request.num_host_cached_tokens = host
            elif seq.index == 0 and seq.request.num_cached_tokens is None:
                seq.request.num_cached_tokens = 0
            self.bm.allocate(seq, start + n)
            self.bm.commit(seq, start + n)  # a later request of this step may take these blocks
            self._encode(seq, start, n)
            if lora_id:
                self.loras.take(seq.request.record.lora, in_use)
            seq.status = RequestStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
            seats += seq.seats()
            if self.policy == "guaranteed_no_evict":
                reserved += self._reserve(seq)  # what it may still take, next to the blocks it holds now
        if not passed:
            self.draining = None
        return budget

    def _victim(self) -> Sequence:
        """The sequence that gives up its blocks for another's: a beam that answered and waits for its siblings (it
        runs nothing now and its answer stays with its search; kept, it could hold the blocks its last sibling
        needs, forever), else the most recently admitted."""
        for seq in reversed(self.running):
            if _answered(seq):
                return seq
        return self.running[-1]

    def _add_drafts(self, batch: ScheduledBatch, budget: int) -> None:
        """Speculative decoding, once every running sequence and new prompt has its tokens and blocks: a decoding
        row with a draft computes the draft too where what is left of the step's budget and of the free blocks holds
        it; else its draft is dropped. So a draft never preempts, delays or displaces anything."""
        for i, seq in enumerate(batch.seqs):
            k = len(seq.draft_token_ids)
            if not k:
                continue
            end = seq.num_computed_tokens + batch.num_tokens[i] + k
            if k > budget or not self.bm.can_allocate(self.bm.blocks_needed(seq, end)):
                seq.draft_token_ids = []
                continue
            self.bm.allocate(seq, end)
            batch.num_tokens[i] += k
            budget -= k

    def _may_prefill(self, batch: ScheduledBatch) -> bool:
        """One more prompt may be prefilled in this step (max_num_prefill_seqs); decodes are never held back."""
        if self.max_num_prefill_seqs is None:
            return True
        prefills = sum(1 for s in batch.seqs if s.num_tokens - s.num_computed_tokens > 1)
        return prefills < self.max_num_prefill_seqs

    def _chunk(self, seq: Sequence, budget: int, start: int | None = None) -> int:
        """Tokens of seq to compute this step: all that are left, or with chunked prefill what the budget allows."""
        computed = seq.num_computed_tokens if start is None else start
        left = seq.num_tokens - computed
        if self.bm.window is not None:
            left = min(left, self.bm.window.chunk_limit(computed))
        n = left if left <= budget else budget if self.chunked_prefill else 0
        items = seq.request.record.mm_inputs
        if n and items and self.encoder is not None:  # no more images than the step's encoder budget
            n = self.encoder.fit(items, computed, n)
            if n < left and not self.chunked_prefill:
                return 0
        return n

    def _encode(self, seq: Sequence, start: int, n: int) -> None:
        if self.encoder is not None and seq.request.record.mm_inputs:
            self.encoder.schedule(seq.request.record.mm_inputs, start, n)

    def _preempt(self, seq: Sequence, at: int = 0) -> None:
        """Free seq's blocks and queue it at position `at` (0: the front), to be recomputed."""
        self.running.remove(seq)
        self.bm.free(seq)
        seq.draft_token_ids = []
        seq.num_computed_tokens = 0
        seq.status = RequestStatus.WAITING
        self.waiting.insert(at, seq)
        self.num_preemptions += 1

    def _interrupt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.bm.free(seq)
        seq.finish(FinishReason.INTERRUPTED)
        batch.interrupted.append(seq)
        self.num_interrupted += 1

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)


def _answered(seq: Sequence) -> bool:
    """Every token computed and none to sample: a beam waiting for its siblings' answers."""
    return seq.num_tokens == seq.num_computed_tokens
