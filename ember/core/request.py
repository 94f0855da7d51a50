"""A request inside the engine core: its record, its n sequences and what the core tracks for its outputs."""

from __future__ import annotations

from ember.core.beam_search import BeamGroup
from ember.core.records import EngineRequest
from ember.core.sequence import Sequence
from ember.sampling_params import SamplingParams


class CoreRequest:
    __slots__ = ("record", "seqs", "num_cached_tokens", "num_host_cached_tokens", "prompt_logprobs_done",
                 "first_scheduled_time", "beams")

    def __init__(self, record: EngineRequest) -> None:
        self.record = record
        self.num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache when first scheduled
        self.num_host_cached_tokens = 0  # of those, the ones copied back from the host tier
        self.prompt_logprobs_done = False
        self.first_scheduled_time: float | None = None
        # beam search: the first sequence stands for all beam_width beams (seats, reservations) until its first step
        p = record.params
        self.beams = BeamGroup() if p.use_beam_search else None
        self.seqs: list[Sequence] = [self._new_sequence(0, pending_fork=(p.beam_width if self.beams else p.n) - 1)]

    @property
    def request_id(self) -> str:
        return self.record.request_id

    @property
    def params(self) -> SamplingParams:
        return self.record.params

    @property
    def lora_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.record.lora.lora_int_id if self.record.lora is not None else 0

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.record.prompt_token_ids

    def _new_sequence(self, index: int, pending_fork: int = 0) -> Sequence:
        r = self.record
        return Sequence(self, index, list(r.prompt_token_ids), pending_fork, r.max_num_tokens, r.cache_salt)

    def fork(self, parent: Sequence) -> list[Sequence]:
        """Create the n - 1 siblings of the first sequence; they start from the prompt."""
        children = [self._new_sequence(i) for i in range(1, parent.pending_fork + 1)]
        parent.pending_fork = 0
        self.seqs.extend(children)
        return children

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_done

    def all_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs) and not any(s.pending_fork for s in self.seqs)

    def seed_of(self, seq: Sequence) -> int | None:
        return None if self.params.seed is None else self.params.seed + seq.index
