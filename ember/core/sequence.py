"""One sample being generated: its tokens, how many of them have KV in the cache, and its block table.

A request with n > 1 starts as one sequence; once its prompt is prefilled the scheduler forks the other n - 1,
which share the prompt's full KV blocks.
"""

from __future__ import annotations

import itertools
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from ember.detokenizer import IncrementalDetokenizer
from ember.outputs import PositionLogprobs

if TYPE_CHECKING:
    from ember.core.request import Request

_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    __slots__ = ("seq_id", "request", "index", "token_ids", "num_prompt_tokens", "num_computed_tokens",
                 "block_table", "status", "generator", "detokenizer", "pending_fork", "finish_reason",
                 "stop_reason", "cumulative_logprob", "new_token_ids", "new_logprobs", "final_sent",
                 "num_hashed_blocks", "max_num_tokens", "cache_salt", "ngram_index")

    def __init__(self, request: "Request", index: int, token_ids: list[int], generator: torch.Generator | None,
                 detokenizer: IncrementalDetokenizer | None, pending_fork: int = 0,
                 max_num_tokens: int | None = None, cache_salt: str | None = None) -> None:
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
        self.status = SequenceStatus.WAITING
        self.generator = generator
        self.detokenizer = detokenizer
        self.pending_fork = pending_fork  # siblings to create once the prompt is prefilled
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        # what happened since the last output of the request was emitted
        self.new_token_ids: list[int] = []
        self.new_logprobs: list[PositionLogprobs] = []
        self.final_sent = False  # the delta carrying finish_reason went out
        self.ngram_index = None  # no_repeat_ngram_size: n-grams seen so far, built by the sampler as tokens come

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
        return self.status is SequenceStatus.FINISHED

    def seats(self) -> int:
        """Slots of max_num_seqs this sequence will occupy, its future siblings included."""
        return 1 + self.pending_fork

    def __repr__(self) -> str:
        return f"Sequence(id={self.seq_id}, req={self.request.request_id}, tokens={self.num_tokens}, " \
               f"computed={self.num_computed_tokens}, status={self.status.name})"
