"""Limits of one step and of one sequence: ``SchedulerConfig``, settled once the model's length limit is known
(``EngineConfig.scheduler``)."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULING_POLICIES = ("max_utilization", "guaranteed_no_evict")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one step and of one sequence, settled against the model's length limit."""

    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    policy: str
    max_num_prefill_seqs: int | None = None
