"""A request inside the engine core: its record, its samples (``Sequence``) and what the core tracks for its
outputs.

A core request is one sample (n > 1 fans out in the front end, ``frontend.parallel_sampling``), or one beam
search, whose beams are sequences of the one request. A ``Sequence`` is what the scheduler sees: its tokens, how
many of them have KV in the cache, its block table and its status. Nothing there is sampling or output state: the
sampler's state lives in the worker under ``seq_id`` and the text in the front end. ``num_computed_tokens`` is
written by the scheduler (a prefix hit, a preemption) and by the after-step work (the tokens a step computed, the
drafted tokens a verification kept, a new beam's shared blocks), nowhere else. ``draft_token_ids`` is the draft
the speculator proposed for the coming step (``core.speculator``): tokens to verify, not yet the sequence's.
"""

from __future__ import annotations

import itertools

from ember.core.beam_group import BeamGroup
from ember.protocol import EngineOutput, EngineRequest, FinishReason, RequestStatus
from ember.sampling_params import SamplingParams

_ids = itertools.count()


class Sequence:
    __slots__ = ("seq_id", "request", "index", "token_ids", "num_prompt_tokens", "num_computed_tokens",
                 "block_table", "status", "extra_seats", "stop_reason", "num_hashed_blocks", "max_num_tokens",
                 "cache_salt", "caches_prefix", "draft_token_ids")

    def __init__(self, request: CoreRequest, index: int, token_ids: list[int], extra_seats: int = 0,
                 max_num_tokens: int | None = None, cache_salt: object = None, caches_prefix: bool = False) -> None:
        self.seq_id = next(_ids)
        self.request = request
        self.index = index  # which of the request's n samples
        self.token_ids = token_ids  # prompt + generated
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # leading blocks registered in the prefix cache
        # prompt + the most tokens it may generate (max_tokens, capped by max_model_len): what
        # guaranteed_no_evict reserves
        self.max_num_tokens = max_num_tokens if max_num_tokens is not None else len(token_ids)
        self.cache_salt = cache_salt  # extra prefix-cache key (a LoRA name): equal tokens under another salt miss
        self.caches_prefix = caches_prefix  # its full blocks go through the prefix cache even when that is off
        self.status = RequestStatus.WAITING
        # seats of max_num_seqs (and blocks, under guaranteed_no_evict) held for what it will become: a beam
        # search's first sequence holds them for its beam_width beams until its first step
        self.extra_seats = extra_seats
        self.stop_reason: int | list[int] | None = None
        self.draft_token_ids: list[int] = []  # speculative decoding: this step's draft, verified after the last token

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    def finish(self, reason: FinishReason, stop_reason: int | list[int] | None = None) -> None:
        self.status, self.stop_reason = RequestStatus.finished(reason), stop_reason

    def seats(self) -> int:
        """Slots of max_num_seqs this sequence holds."""
        return 1 + self.extra_seats

    def __repr__(self) -> str:
        return f"Sequence(id={self.seq_id}, req={self.request.request_id}, tokens={self.num_tokens}, " \
               f"computed={self.num_computed_tokens}, status={self.status.name})"


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
        self.seqs: list[Sequence] = [Sequence(self, 0, list(record.prompt_token_ids),
                                              p.beam_width - 1 if self.beams else 0, record.max_num_tokens,
                                              record.cache_salt)]

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

    @property
    def pools(self) -> bool:
        """A pooling request: prefilled only, finished with its pooled vector; it samples nothing."""
        return self.record.pooling is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_done

    def all_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def output_in(self, outputs: dict[str, EngineOutput]) -> EngineOutput:
        """This request's output of the step being collected in ``outputs`` (made on first use)."""
        out = outputs.get(self.request_id)
        if out is None:
            out = outputs[self.request_id] = EngineOutput(
                self.request_id, num_cached_tokens=self.num_cached_tokens,
                num_host_cached_tokens=self.num_host_cached_tokens, first_scheduled_time=self.first_scheduled_time)
        return out

    def seed_of(self, seq: Sequence) -> int | None:
        return None if self.params.seed is None else self.params.seed + seq.index
