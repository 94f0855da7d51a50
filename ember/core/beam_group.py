"""One beam-search request's state in the core: running beam scores, answers waiting for the siblings, finished
hypotheses (``beam_search.BeamSearch`` works on it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.protocol import FinishReason


@dataclass(slots=True)
class Hypothesis:
    score: float  # logprob / generated_length ** length_penalty
    logprob: float
    token_ids: list[int]  # generated tokens, the ending token included
    finish_reason: FinishReason
    stop_reason: int | list[int] | None


@dataclass(slots=True)
class BeamGroup:
    scores: dict[int, float] = field(default_factory=dict)  # running seq_id -> summed logprob
    pending: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)  # seq_id -> its continuations
    finished: list[Hypothesis] = field(default_factory=list)  # the best W so far, best first
    improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied
