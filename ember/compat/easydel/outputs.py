"""EasyDeL's ``ReturnSample`` (easydel/inference/vsurge/utils.py) and how vSurge fills it from ember's outputs.

As in EasyDeL, one ReturnSample stands for one prompt and each field is a list with one entry per generation
(``n`` of them). On ember ``text`` is the cumulative text in streams as well as in final results (EasyDeL streams
put only the newest piece there, and the whole text in ``accumulated_text``: ember fills both with the whole text),
``token_ids`` holds every generated id so far, and ``finish_reason`` / ``finished`` carry the final state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ember.outputs import RequestOutput


@dataclass(slots=True)
class ReturnSample:
    text: list[str]
    token_ids: list[list[int]]
    time_spent_computing: list[float] = field(default_factory=list)  # seconds from submission to the latest token
    accumulated_text: list[str] = field(default_factory=list)
    tokens_per_second: list[float] = field(default_factory=list)  # num_generated_tokens / time_spent_computing
    num_generated_tokens: list[int] = field(default_factory=list)
    generation_idx: list[int] = field(default_factory=list)
    finish_reason: list[str | None] = field(default_factory=list)  # "stop" | "length" | "abort" once ended
    finished: bool = False  # every generation of the prompt has ended


class PromptProgress:
    """The n generations of one prompt as the engine's deltas arrive, timed from submission."""

    __slots__ = ("start", "detokenize", "text", "token_ids", "last_token", "finish_reason", "finished")

    def __init__(self, n: int, start: float, detokenize: bool) -> None:
        self.start, self.detokenize = start, detokenize
        self.text = [""] * n
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.last_token = [start] * n
        self.finish_reason: list[str | None] = [None] * n
        self.finished = False

    def add(self, delta: RequestOutput) -> None:
        now = time.perf_counter()
        for o in delta.outputs:
            if o.token_ids:
                self.token_ids[o.index].extend(o.token_ids)
                self.last_token[o.index] = now
            if self.detokenize:
                self.text[o.index] += o.text
            if o.finish_reason is not None:
                self.finish_reason[o.index] = o.finish_reason
        self.finished = self.finished or delta.finished

    def sample(self) -> ReturnSample:
        """A snapshot: lists copied, so later deltas do not change what was handed out."""
        spent = [t - self.start for t in self.last_token]
        counts = [len(ids) for ids in self.token_ids]
        return ReturnSample(text=list(self.text), token_ids=[list(ids) for ids in self.token_ids],
                            time_spent_computing=spent, accumulated_text=list(self.text),
                            tokens_per_second=[c / s if s > 0 else 0.0 for c, s in zip(counts, spent)],
                            num_generated_tokens=counts, generation_idx=list(range(len(counts))),
                            finish_reason=list(self.finish_reason), finished=self.finished)
