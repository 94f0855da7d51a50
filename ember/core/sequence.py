"""One sample being generated, as the scheduler sees it: its tokens, how many of them have KV in the cache, its
block table and its status. Nothing here is sampling or output state: the sampler's state lives in the worker
under ``seq_id`` and the text in the front end.

A request with n > 1 starts as one sequence; once its prompt is prefilled the after-step work forks the other
n - 1, which share the prompt's full KV blocks. ``num_computed_tokens`` is written by the scheduler (a prefix hit,
a preemption) and by the after-step work (the tokens a step computed, a fork), nowhere else.
"""

from __future__ import annotations

import itertools
from enum import Enum, auto
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember.core.request import CoreRequest

_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    __slots__ = ("seq_id", "request", "index", "token_ids", "num_prompt_tokens", "num_computed_tokens",
                 "block_table", "status", "pending_fork", "finish_reason", "stop_reason", "num_hashed_blocks",
                 "max_num_tokens", "cache_salt")

    def __init__(self, request: "CoreRequest", index: int, token_ids: list[int], pending_fork: int = 0,
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
        self.pending_fork = pending_fork  # siblings to create once the prompt is prefilled
        self.finish_reason: str | None = None
        self.stop_reason: int | str | list[int] | None = None

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

    def finish(self, reason: str, stop_reason: int | str | list[int] | None = None) -> None:
        self.status, self.finish_reason, self.stop_reason = SequenceStatus.FINISHED, reason, stop_reason

    def seats(self) -> int:
        """Slots of max_num_seqs this sequence will occupy, its future siblings included."""
        return 1 + self.pending_fork

    def __repr__(self) -> str:
        return f"Sequence(id={self.seq_id}, req={self.request.request_id}, tokens={self.num_tokens}, " \
               f"computed={self.num_computed_tokens}, status={self.status.name})"
